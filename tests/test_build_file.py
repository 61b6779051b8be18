"""BUILD lists exactly the package's modules and one py_test per test file."""

import ast
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


def _test_data(text: str) -> dict[str, set[str]]:
  """{test name: files on disk} of BUILD's TEST_DATA, globs expanded."""
  block = re.search(r"TEST_DATA = \{(.*?)\n\}", text, re.S)
  assert block, "BUILD has no TEST_DATA dict"
  data = {}
  for name, value in re.findall(r'"(\w+)": (.*?\]\)?),\n', block.group(1) + "\n", re.S):
    data[name] = set().union(*(_on_disk(p) for p in re.findall(r'"([^"]+)"', value)))
  return data


def _project_files_named(test_file: str) -> set[str]:
  """The project files (or globs of them) that a test file names: string
  constants holding a relative path, and the trailing string arguments of
  `os.path.join` calls (``os.path.join(ROOT, "experiments", "x.py")``);
  only names that exist on disk."""
  with open(os.path.join(ROOT, test_file)) as f:
    tree = ast.parse(f.read())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and "/" in node.value:
      names.add(node.value)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr == "join"):
      tail = []
      for arg in reversed(node.args):
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
          break
        tail.insert(0, arg.value)
      if tail:
        names.add(os.path.join(*tail))
  return {f for name in names if not os.path.isabs(name) for f in _on_disk(name)
          if os.path.isfile(os.path.join(ROOT, f))}


def test_the_scan_finds_a_script_a_test_runs():
  # test_splits runs os.path.join(ROOT, "experiments", "write_split.py")
  assert "experiments/write_split.py" in _project_files_named("tests/test_splits.py")


def test_every_file_a_test_names_is_in_its_targets_data():
  """What a py_test reads beyond the package and tests/ must be among its
  data, or Bazel's sandbox lacks it."""
  data = _test_data(_build_text())
  missing = {}
  # this file names files only to test the scan
  for test_file in sorted(_on_disk("tests/test_*.py") - {"tests/test_build_file.py"}):
    name = os.path.basename(test_file)[:-len(".py")]
    named = {f for f in _project_files_named(test_file)
             if not f.startswith(("tff_privacy/", "tests/")) and f != "BUILD"}
    if named - data.get(name, set()):
      missing[name] = sorted(named - data.get(name, set()))
  assert not missing, f"add to BUILD's TEST_DATA: {missing}"
