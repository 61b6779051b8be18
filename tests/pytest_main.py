"""Entry point of the Bazel `py_test` targets: runs pytest on the test files
given as arguments (Bazel runs a `py_test`'s main, not pytest)."""

import os
import sys

import pytest

if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
