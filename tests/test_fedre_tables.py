"""experiments/fedre_tables.py on the paper's data set format (a DocTamper
fixture), as a user runs it."""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import load_script, write_doctamper_split

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "experiments", "fedre_tables.py")
SPLITS = (("DocTamperV1-TrainingSet", 8), ("DocTamperV1-TestingSet", 2))


def _script(*argv):
  return subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True,
                        text=True, timeout=600,
                        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})


@pytest.fixture(scope="module")
def script():
  """The script as a module: its functions, and its main() for refusals,
  which come before it starts a worker (a process of their own would spend
  seconds importing TensorFlow)."""
  return load_script(SCRIPT)


def _refusal(script, monkeypatch, capsys, *argv) -> str:
  """The last line of stderr of the script's main() run with `argv`, which
  must exit with status 2."""
  monkeypatch.setattr(sys, "argv", [SCRIPT, *argv])
  with pytest.raises(SystemExit) as exited:
    script.main()
  assert exited.value.code == 2
  return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow  # 100 s of one FedRE U-Net run; the fast suite keeps the
# DocTamper loader (test_tamper_sets) and the script's run configs
# (test_every_setting_makes_valid_leakage_run_configs)
def test_table1_runs_on_doctamper_with_a_regions_file(tmp_path):
  boxes = {}
  for split, count in SPLITS:
    write_doctamper_split(tmp_path / split, count, 32, count)
    boxes.update({f"{split}/{i}": {"amount": [[0, 0, 16, 8]], "phone": [[16, 24, 32, 32]]}
                  for i in range(count)})
  (tmp_path / "boxes.json").write_text(json.dumps(boxes))
  out = tmp_path / "out"
  result = _script("--dataset", "doctamper", "--data-dir", str(tmp_path),
                   "--data-kwargs", json.dumps({"size": 16,
                                                "regions": str(tmp_path / "boxes.json")}),
                   "--region", "amount,phone", "--tables", "1", "--table1-methods",
                   "Central,FedRE", "--table1-epsilons", "50", "--seeds", "0",
                   "--rounds", "1", "--clients", "2", "--out", str(out), "--quiet")
  assert result.returncode == 0, result.stderr[-2000:]
  with open(out / "table1" / "fedre_e50_s0" / "config.json") as f:
    config = json.load(f)
  assert config["dataset"] == "doctamper" and config["data_dir"] == str(tmp_path)
  assert config["data_kwargs"]["size"] == 16
  with open(out / "table1" / "fedre_e50_s0" / "metrics.json") as f:
    assert np.isfinite(json.load(f)[-1]["paper_epsilon"])
  assert "| inf | Central |" in (out / "table1.md").read_text()


@pytest.mark.slow
def test_bad_data_kwargs_are_one_line_errors(tmp_path, script, monkeypatch,
                                            capsys):
  # as a user runs it: nothing, not even at exit, prints a traceback
  result = _script("--dataset", "doctamper", "--data-kwargs", '{"size": 2}',
                   "--out", str(tmp_path))
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].endswith(
      "--data-kwargs: data_kwargs of dataset 'doctamper': size must be >= 8, got 2")
  assert "Traceback" not in result.stderr
  assert "argument --data-kwargs: takes a JSON object like" in _refusal(
      script, monkeypatch, capsys, "--dataset", "doctamper", "--data-kwargs",
      "[1]", "--out", str(tmp_path))
  assert _refusal(script, monkeypatch, capsys, "--dataset", "doctamper",
                  "--data-dir", str(tmp_path), "--out", str(tmp_path)).startswith(
      "fedre_tables.py: error: --dataset doctamper (--data-dir, --data-kwargs): "
      f"path={str(tmp_path / 'DocTamperV1-TrainingSet')!r} is not an LMDB folder")


def test_every_setting_makes_valid_leakage_run_configs(tmp_path, script):
  module = script
  from tff_privacy import runner
  args = argparse.Namespace(data_dir=None, data_kwargs=None)  # no flags given
  for name, setting in module.SETTINGS.items():
    config = runner.RunConfig(out=str(tmp_path), dataset=name, clients=8,
                              model=setting.model[0], **module._data(args),
                              **module._leakage_partition(setting))
    assert config.data_kwargs == {}
    assert config.partition == {"docs": "groups", "digits": "label_groups"}.get(
        name, "one_per_client")


def test_bad_region_is_a_one_line_error(tmp_path, script, monkeypatch, capsys):
  last = _refusal(script, monkeypatch, capsys, "--dataset", "digits", "--region",
                  "6,6,2,2", "--out", str(tmp_path))
  assert last.startswith("fedre_tables.py: error: --region: "), last
  assert not os.path.exists(tmp_path / "table1")


def test_table1_fedavg_row_trains_the_documents_protocol_without_dp(
    tmp_path, script, monkeypatch):
  calls = []
  monkeypatch.setattr(script, "trained", lambda args, out, row, **config: (
      calls.append((out, config)) or row))
  args = argparse.Namespace(
      setting=script.SETTINGS["docs"], seeds=[0], table1_methods=["FedAvg"],
      table1_epsilons=[50.0], out=str(tmp_path), data_dir=None,
      data_kwargs={"size": 32}, clients=10, rounds=20, client_lr=0.005,
      region="numbers")
  rows = script.table1_rows(args)
  assert rows == [{"epsilon": "inf", "method": "FedAvg", "seed": 0}]
  (out, config), = calls
  assert out == os.path.join(str(tmp_path), "table1", "fedavg_s0")
  run = script.run_config(args, out, **config)
  assert (run.method, run.defense, run.clients, run.partition, run.rounds,
          run.batch_size, run.positive_weight, run.data_kwargs) == (
      "fedavg", None, 10, "groups", 20, 16, 10.0, {"size": 32})
  assert run.method_kwargs == {"client_optimizer": "adam",
                               "client_learning_rate": 0.005, "local_epochs": 2}


def test_docs_setting_is_the_train_commands_documents_protocol(script):
  docs = script.SETTINGS["docs"]
  assert (docs.clients, docs.rounds, docs.batch_size, docs.partition,
          docs.client_optimizer, docs.client_lr, docs.local_epochs,
          docs.positive_weight, docs.data_kwargs, docs.input_shape) == (
      10, 20, 16, "groups", "adam", 0.005, 2, 10.0, {"size": 32}, (32, 32, 3))
  assert "FedAvg" in script.TABLE1_METHODS


def test_table2_attacks_defended_rows_also_with_the_attacks_that_know_them(script):
  docs = script.SETTINGS["docs"]
  assert script.table2_attacks({"method": "fedavg"}) == ["ig"]
  for label in ("LDP-Fed", "FedRE w/o PSI", "FedRE"):
    assert script.table2_attacks(script.method_config(docs, label, 50.0, 20)) == [
        "ig", "ig_noise_aware"], label


def _leak(eps, method, attack, region_ssim):
  return {"epsilon": eps, "method": method, "attack": attack, "region_mse": 0.1,
          "region_psnr": 10.0, "region_ssim": region_ssim, "mse": 0.2,
          "psnr": 7.0, "ssim": 0.3, "lpips": None}


def test_table2_names_each_rows_strongest_attack_in_the_region(tmp_path, script):
  rows = [_leak("none", "No defence", "ig", 0.9),
          _leak("50", "FedRE", "ig", 0.20),
          _leak("50", "FedRE", "ig_noise_aware", 0.31),
          _leak("50", "LDP-Fed", "ig", 0.40),
          _leak("50", "LDP-Fed", "ig_noise_aware", 0.35)]
  assert script.worst_case_rows(rows) == [
      {"epsilon": "none", "method": "No defence", "attack": "ig",
       "region_ssim": 0.9, "region_ssim_ig": 0.9},
      {"epsilon": "50", "method": "FedRE", "attack": "ig_noise_aware",
       "region_ssim": 0.31, "region_ssim_ig": 0.20},
      {"epsilon": "50", "method": "LDP-Fed", "attack": "ig",
       "region_ssim": 0.40, "region_ssim_ig": 0.40}]
  args = argparse.Namespace(setting=script.SETTINGS["docs"], attack_iterations=10,
                            region="numbers", lpips_weights=None, out=str(tmp_path))
  image = np.zeros((8, 8, 3), np.float32)
  text = script.write_table2(args, rows, {"original": [image],
                                          "No defence (none)": [image],
                                          "FedRE (50)": [image]})
  assert "| 50 | FedRE | ig_noise_aware | 0.3100 | 0.2000 |" in text
  assert "| 50 | FedRE | ig | 0.1000 | 10.00 | 0.2000 |" in text
  assert text.count("0.808, 0.888") == 1  # the paper's SSIM on IG's row only
  assert "Without a defence IG reaches region SSIM 0.9000" in text
  assert (tmp_path / "table2.csv").read_text().splitlines()[0].startswith(
      "epsilon,method,attack,")
  assert (tmp_path / "fig4.png").stat().st_size > 0


@pytest.mark.parametrize("flag,value", [
    ("--table1-epsilons", "50,x"), ("--table1-epsilons", "10,inf"),
    ("--table2-epsilons", ""), ("--table2-epsilons", "0"),
    ("--fig-epsilons", "-5")])
def test_bad_epsilons_are_one_line_errors(tmp_path, script, monkeypatch, capsys,
                                          flag, value):
  last = _refusal(script, monkeypatch, capsys, "--dataset", "digits", flag, value,
                  "--out", str(tmp_path))
  assert last == (f"fedre_tables.py: error: {flag}: {value!r}; give "
                  "comma-separated finite numbers > 0"), last
  assert not os.listdir(tmp_path)


def test_fig6_gains_are_each_pda_pam_rule_minus_the_plain_mean(tmp_path, script,
                                                              monkeypatch):
  scores = {"pda_pam": 0.30, "pda_pam_normalized": 0.25, "mean": 0.20}
  calls = []

  def trained(args, out, row, **config):
    calls.append((out, config))
    name = os.path.basename(out).split("_e")[0]
    return {"f_score": scores[name] + config["clients"] / 100}

  monkeypatch.setattr(script, "trained", trained)
  args = argparse.Namespace(setting=script.SETTINGS["docs"], seeds=[3],
                            fig_epsilons=[50.0], out=str(tmp_path))
  rows = script.fig6_rows(args)
  assert [(r["epsilon"], r["clients"]) for r in rows] == [(50.0, 2), (50.0, 5),
                                                          (50.0, 10)]
  for r in rows:  # the clients' share cancels in each difference
    assert r["gain_paper"] == pytest.approx(0.10)
    assert r["gain_normalized"] == pytest.approx(0.05)
  out, config = calls[0]
  assert out == os.path.join(str(tmp_path), "fig6", "pda_pam_e50_k2")
  assert config == {"method": "fedre", "clients": 2, "seed": 3, "method_kwargs": {
      "epsilon": 50.0, "aggregation": "pda_pam", "pda_pam_rule": "paper"}}
  assert calls[2][1]["method_kwargs"] == {"epsilon": 50.0, "aggregation": "mean"}
  text = script.write_fig6(args, rows)
  assert "| 50 | 5 | 0.350 | 0.300 | 0.250 | +0.100 | +0.050 |" in text
  assert (tmp_path / "fig6.png").stat().st_size > 0
  assert (tmp_path / "fig6.csv").read_text().startswith("epsilon,clients,")


def test_fig5_trains_each_epsilon_beside_the_pixel_noise_that_leaks_as_much(
    tmp_path, script, monkeypatch):
  # region SSIM of each arm's level, by hand: epsilon 50 leaks 0.12, closest
  # to std 0.8 (0.15); epsilon 1e6 leaks 0.60, closest to std 0.1 (0.58)
  leaks = {("gradient", 50.0): 0.12, ("gradient", 1e6): 0.60}
  leaks.update({("pixels", s): v for s, v in zip(
      script.FIG5_PIXEL_NOISE, (0.70, 0.58, 0.45, 0.30, 0.15, 0.05, 0.01))})

  def level(config):
    kwargs = config["method_kwargs"]
    return (("gradient", kwargs["epsilon"]) if "epsilon" in kwargs
            else ("pixels", kwargs["pixel_noise"]))

  monkeypatch.setattr(script, "_leakage", lambda args, base, config, it: (
      level(config), None, None))
  monkeypatch.setattr(script, "_leakage_scores", lambda key: {
      "region_ssim": leaks[key], "region_psnr": 9.0, "ssim": 0.5})
  trained_runs = []

  def trained(args, out, row, **config):
    trained_runs.append(os.path.basename(out))
    accuracy = 0.9 if config["method"] == "fedavg" else {
        "gradient": 0.8, "pixels": 0.2}[level(config)[0]]
    return {**row, "accuracy": accuracy}

  monkeypatch.setattr(script, "trained", trained)
  args = argparse.Namespace(setting=script.SETTINGS["digits"], seeds=[0],
                            fig_epsilons=[50.0, 1e6], out=str(tmp_path),
                            fig5_iterations=7, rounds=3, clients=4, region="2,2,6,6")
  leakage, utility = script.fig5_rows(args)
  assert len(leakage) == 2 + len(script.FIG5_PIXEL_NOISE)
  assert [(u["epsilon"], u["pixel_noise"]) for u in utility] == [(50.0, 0.8),
                                                                  (1e6, 0.1)]
  assert trained_runs == ["train_none", "train_gradient_50", "train_pixels_0.8",
                          "train_gradient_1e+06", "train_pixels_0.1"]
  assert utility[0]["accuracy_none"] == 0.9
  assert (utility[0]["accuracy_gradient"], utility[0]["accuracy_pixels"]) == (0.8, 0.2)
  text = script.write_fig5(args, leakage, utility)
  assert "| 50 | 0.8 | 0.1200, 0.1500 | yes | 0.900, 0.800, 0.200 |" in text
  assert "With the least pixel noise (std 0.05) the attack reaches region SSIM 0.7000" in text
  assert (tmp_path / "fig5.png").stat().st_size > 0
  assert (tmp_path / "fig5_leakage.csv").read_text().startswith("arm,level,")
