"""BUILD lists exactly the package's modules and one py_test per test file."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build_text() -> str:
  with open(os.path.join(ROOT, "BUILD")) as f:
    return f.read()


def _library_srcs(text: str, name: str) -> set[str]:
  block = re.search(r'py_library\(\s*name = "%s",\s*srcs = \[(.*?)\]' % name,
                    text, re.S)
  assert block, f"BUILD has no py_library {name}"
  return set(re.findall(r'"([^"]+\.py)"', block.group(1)))


def _on_disk(pattern: str) -> set[str]:
  return {os.path.relpath(p, ROOT)
          for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)}


def test_library_lists_every_module():
  listed = _library_srcs(_build_text(), "tff_privacy")
  on_disk = _on_disk("tff_privacy/**/*.py")
  assert listed == on_disk, (f"add to BUILD: {sorted(on_disk - listed)}; "
                             f"remove from BUILD: {sorted(listed - on_disk)}")


def test_every_test_file_has_a_py_test():
  block = re.search(r"TESTS = \{(.*?)\}", _build_text(), re.S)
  assert block, "BUILD has no TESTS dict"
  listed = {f"tests/{name}.py" for name in re.findall(r'"(\w+)":', block.group(1))}
  on_disk = _on_disk("tests/test_*.py")
  assert listed == on_disk, (f"add py_test for: {sorted(on_disk - listed)}; "
                             f"remove: {sorted(listed - on_disk)}")
