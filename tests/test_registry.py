"""Registries: components register by decorator or entry point, one line
names a wrong name, and attacks import no layer above them."""

import os
import subprocess
import sys
import textwrap

import pytest

from tff_privacy import attacks, defenses, runner
from tff_privacy.disclosure import Disclosure
from tff_privacy.registry import Registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def own_defense():
  """A defense of this test's own, registered for the test only."""

  @defenses.register
  class Halve(defenses.UpdateDefense):
    name = "halve_for_test"
    DISCLOSURE = Disclosure(noise_levels=lambda record: [0.0] * len(record.upload))

    def apply(self, update, seed, client=None):
      return [u / 2 for u in update]

  yield Halve
  defenses.DEFENSES.unregister(Halve.name)


def test_a_registered_defense_is_a_choice_of_every_reader(own_defense):
  assert defenses.defense_class("halve_for_test") is own_defense
  assert "halve_for_test" in defenses.DEFENSES
  # the run's checks read the registry when they run, not at import
  config = runner.RunConfig(out="unused", defense="halve_for_test")
  assert config.defense == "halve_for_test"
  # its declaration brings the attack that reads it
  assert attacks.adaptive_attacks("halve_for_test") == ["ig_noise_aware"]
  assert "halve_for_test" not in attacks.without_adaptive_attack()


def test_a_wrong_name_gets_one_line_with_the_choices():
  with pytest.raises(ValueError, match=r"^defense='nope' is unknown; choose one of "
                     r"\[.*'ldp_gaussian'.*\]$"):
    defenses.defense_class("nope")
  with pytest.raises(ValueError, match=r"^attack='nope' is unknown"):
    attacks.attack_class("nope")


def test_a_name_is_registered_once():
  registry = Registry("widget", "tff_privacy.disclosure", "tff_privacy_test.none")

  class A:
    name = "a"

  class B:
    name = "a"

  assert registry.register(A) is A
  registry.register(A)  # the same component again: a no-op
  with pytest.raises(ValueError, match="widget 'a' is registered already"):
    registry.register(B)
  with pytest.raises(ValueError, match="needs a non-empty string `name`"):
    registry.register(object())
  assert list(registry) == ["a"] and registry["a"] is A


def _plugin_package(tmp_path, group, target, module_text):
  """An installed distribution on `tmp_path` declaring entry point 'qsgd'
  of `group` at `target` ('module:attribute'), its module holding
  `module_text` (each test its own module name: imports are cached)."""
  module = target.split(":")[0]
  (tmp_path / f"{module}.py").write_text(textwrap.dedent(module_text))
  info = tmp_path / "qsgd_plugin-1.0.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: qsgd-plugin\nVersion: 1.0\n")
  (info / "entry_points.txt").write_text(f"[{group}]\nqsgd = {target}\n")


def test_an_installed_packages_entry_point_registers_its_component(tmp_path,
                                                                   monkeypatch):
  _plugin_package(tmp_path, "tff_privacy_test.widgets", "widget_plugin:Widget",
                  "class Widget:\n  pass\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  registry = Registry("widget", "tff_privacy.disclosure", "tff_privacy_test.widgets")
  assert list(registry) == ["qsgd"]
  assert registry["qsgd"].__module__ == "widget_plugin"


@pytest.mark.parametrize("target, text, why", [
    ("broken_plugin:Missing", "x = 1\n", "has no attribute 'Missing'"),
    # runs record the component's own name, which must be the one it is
    # found by
    ("misnamed_plugin:Widget", "class Widget:\n  name = 'other'\n",
     "is named 'other', not 'qsgd'")])
def test_an_entry_point_that_cannot_serve_is_left_out_with_a_warning(
    tmp_path, monkeypatch, target, text, why):
  group = "tff_privacy_test." + target.split("_")[0]
  _plugin_package(tmp_path, group, target, text)
  monkeypatch.syspath_prepend(str(tmp_path))
  registry = Registry("widget", "tff_privacy.disclosure", group)
  with pytest.warns(UserWarning, match=f"entry point 'qsgd' .* is left out: .*{why}"):
    assert list(registry) == []


def test_a_registry_whose_builtin_import_fails_tries_again():
  registry = Registry("widget", "tff_privacy_test_no_such_module", "tff_privacy_test.none")
  for _ in range(2):  # not left empty for good by the first failure
    with pytest.raises(ModuleNotFoundError):
      list(registry)


def test_the_cli_offers_a_plugin_defense_from_an_installed_package(tmp_path):
  # a fresh process: the plugin is found through its entry point alone
  # its module reads the runner as it loads: the registry is read after
  # the runner's import, not during it
  _plugin_package(tmp_path, "tff_privacy.defenses", "qsgd_plugin:Quantize", """
      from tff_privacy import defenses, runner
      from tff_privacy.disclosure import Disclosure

      class Quantize(defenses.UpdateDefense):
        name = "qsgd"
        DISCLOSURE = Disclosure(no_adaptive_attack="a test's plugin")

        def apply(self, update, seed, client=None):
          return list(update)
      """)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
  shown = subprocess.run([sys.executable, "-m", "tff_privacy.cli", "train", "--help"],
                         capture_output=True, text=True, env=env, check=True)
  assert "qsgd" in shown.stdout


def test_attacks_import_no_higher_layer():
  # import-linter's contracts in pyproject.toml, on the code as it is
  done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "lint-imports"),
                         "--no-cache"], cwd=ROOT, capture_output=True, text=True)
  assert done.returncode == 0, done.stdout[-2000:]
  assert "attacks import no defense, method or run code KEPT" in done.stdout
  assert "each layer imports only the layers below it KEPT" in done.stdout
