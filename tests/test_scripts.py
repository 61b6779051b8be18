"""The benchmark and experiment scripts as a user starts them."""

import ast
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
                 + glob.glob(os.path.join(ROOT, "experiments", "*.py")))
HELPERS = {"round_timing.py"}  # imported by the benchmarks, not run


def _imports_the_library(tree: ast.Module) -> bool:
  return any(isinstance(node, (ast.Import, ast.ImportFrom)) and any(
      (getattr(node, "module", None) or alias.name).startswith("tff_privacy")
      for alias in node.names) for node in tree.body)


def _main(tree: ast.Module):
  return next((n for n in tree.body if isinstance(n, ast.FunctionDef)
               and n.name == "main"), None)


def _main_calls(tree: ast.Module) -> list[str]:
  """The calls made by main() before its argument parser is built."""
  main = _main(tree)
  calls = []
  for statement in main.body:
    text = ast.unparse(statement)
    if "ArgumentParser" in text:
      break
    calls.append(text)
  return calls


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_scripts_replace_tffs_context_before_anything_can_exit(path):
  # TFF's default context, made on import, prints a traceback at interpreter
  # exit, also after --help or a refused flag, unless it is replaced first
  with open(path) as f:
    tree = ast.parse(f.read())
  if not _imports_the_library(tree):
    return
  if os.path.basename(path) in HELPERS:
    assert _main(tree) is None and "__main__" not in ast.unparse(tree)
    return
  assert "runtime.install()" in _main_calls(tree), os.path.basename(path)


@pytest.mark.slow
def test_a_refused_flag_prints_one_line_and_no_traceback():
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "attack_speed.py"),
       "--repeats", "0"], capture_output=True, text=True, timeout=300,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
  assert result.returncode == 2
  assert "argument --repeats: takes an integer >= 1, got '0'" in result.stderr
  assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr


@pytest.mark.slow
def test_the_authors_baseline_refuses_a_folder_without_their_code(tmp_path):
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "hyperfl_authors_fedavg.py"),
       "--authors-code", str(tmp_path)], capture_output=True, text=True,
      timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
  assert result.returncode == 2
  assert (f"--authors-code: '{tmp_path}' has no cnn/methods/fedavg.py; give a clone "
          "of the HyperFL authors' repository") in result.stderr
  assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr
