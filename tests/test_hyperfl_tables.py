"""experiments/hyperfl_tables.py: which evaluation each row's runs use, and
the mean and spread over seeds that its tables report."""

import argparse
import os

import numpy as np
import pytest

from tff_privacy import io, provenance, runner

from conftest import load_script


@pytest.fixture(scope="module")
def script():
  return load_script("experiments/hyperfl_tables.py")


def _fake_run(configs):
  """`runner.run` that records each config and returns one round whose
  accuracies depend on the seed and on the evaluation's metric names."""
  def run(config, progress=True):
    configs.append(config)
    os.makedirs(config.out)
    entry = {"round": config.rounds, "seconds": 2.0}
    for prefix, base in (("personal", 0.5), ("local_after_training", 0.8)):
      entry.update({f"{prefix}_accuracy_mean": base + 0.01 * config.seed,
                    f"{prefix}_accuracy_std": 0.1 * (config.seed + 1),
                    f"{prefix}_accuracy_min": base - 0.2})
    return [entry]
  return run


@pytest.mark.parametrize("label,evaluation,base", [
    ("FedAvg", "local models after training", 0.8),
    ("HyperFL", "local models after training", 0.8),
    ("CENTAUR", "local models after training", 0.8),
    ("pFedHN", "own models after the round", 0.5)])
def test_a_row_is_its_seeds_runs_in_the_papers_evaluation(script, tmp_path,
                                                          monkeypatch, label,
                                                          evaluation, base):
  configs = []
  monkeypatch.setattr(runner, "run", _fake_run(configs))
  monkeypatch.setattr(script.runtime, "renew", lambda: None)
  args = argparse.Namespace(out=str(tmp_path), scale="small", dataset="mnist5k",
                            rounds=3, seeds=[0, 1, 4], data_dir=None, quiet=True)
  row = script.run_row(args, "20 clients", label)
  assert [c.seed for c in configs] == [0, 1, 4]
  assert {c.evaluate for c in configs} == {
      "global" if base == 0.5 else "local-after-training"}
  assert {c.evaluate_every for c in configs} == {3}  # the last round only
  means = [base + 0.01 * s for s in (0, 1, 4)]  # by hand
  assert row["evaluation"] == evaluation
  assert row["accuracy"] == pytest.approx(np.mean(means))
  assert row["seed_std"] == pytest.approx(np.std(means))
  assert (row["seed_min"], row["seed_max"]) == pytest.approx((means[0], means[2]))
  assert row["client_std"] == pytest.approx(np.mean([0.1, 0.2, 0.5]))
  assert row["worst_client"] == pytest.approx(base - 0.2)
  if label == "FedAvg":
    assert configs[0].method_kwargs["weight_decay"] == 5e-4  # the authors'
  table = script.write_table(str(tmp_path), [row], "mnist5k", 3, [0, 1, 4])
  assert f"| 20 clients | {label} | {evaluation} | {100 * np.mean(means):.2f} |" in table
  assert "seeds 0, 1, 4" in table
  # cached: a second call trains nothing
  assert script.run_row(args, "20 clients", label) == row and len(configs) == 3


def test_a_table_names_the_runs_made_by_other_code(script, tmp_path, monkeypatch):
  now = {"commit": "c" * 40, "dirty": False, "diff_sha256": None}
  other = {"commit": "a" * 40, "dirty": False, "diff_sha256": None}
  monkeypatch.setattr(provenance, "code_version", lambda: dict(now))
  configs = []
  monkeypatch.setattr(runner, "run", _fake_run(configs))
  monkeypatch.setattr(script.runtime, "renew", lambda: None)
  args = argparse.Namespace(out=str(tmp_path), scale="small", dataset="mnist5k",
                            rounds=3, seeds=[0, 1], data_dir=None, quiet=True)
  row = script.run_row(args, "20 clients", "FedAvg")
  for config, version in zip(configs, (now, other)):
    io.write_json(os.path.join(config.out, "config.json"), {provenance.KEY: [version]})
  table = script.write_table(str(tmp_path), [row], "mnist5k", 3, [0, 1])
  assert "Code: commit cccccccccccc." in table
  reused = [line for line in table.splitlines() if line.startswith("- ")]
  assert reused == [f"- {os.path.relpath(configs[1].out, tmp_path)}: made by commit "
                    "aaaaaaaaaaaa; the code now is commit cccccccccccc"]
  assert open(tmp_path / "table1.md").read() == table


@pytest.mark.parametrize("text", ["", "0,x", "1,1"])
def test_seeds_must_be_distinct_integers(script, text):
  with pytest.raises(ValueError, match="--seeds: .*give"):
    script.parse_seeds(text)
  assert script.parse_seeds("2, 0,5") == [2, 0, 5]


def test_a_split_file_gives_table_1_its_clients(script, tmp_path, monkeypatch):
  from tff_privacy.data import splits
  path = str(tmp_path / "mine.json")
  splits.write(path, [np.arange(3), np.arange(3, 6)], [np.arange(2), np.arange(2, 4)])
  configs = []
  monkeypatch.setattr(runner, "run", _fake_run(configs))
  monkeypatch.setattr(script.runtime, "renew", lambda: None)
  args = argparse.Namespace(out=str(tmp_path), scale="small", dataset="mnist5k",
                            rounds=3, seeds=[0], data_dir=None, quiet=True,
                            split=path)
  setting = script.split_setting(path)
  assert setting == "2 clients"
  row = script.run_row(args, setting, "FedAvg")
  (config,) = configs
  assert config.partition == f"file:{path}"
  assert (config.clients_per_round, config.samples_per_client) == (None, None)
  assert config.out == os.path.join(str(tmp_path), "split_mine", "fedavg", "seed0")
  table = script.write_table(str(tmp_path), [row], "mnist5k", 3, [0], path)
  assert f"split file {path}" in table
  assert "| 2 clients | FedAvg |" in table and table.rstrip().count("| - | - |") == 1
