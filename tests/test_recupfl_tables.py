"""experiments/recupfl_tables.py: defence levels, the equal-loss reading of
the curves, and the rows it builds from a run's metrics.json."""

import argparse
import math
import os

import numpy as np
import pytest

from tff_privacy import io

from conftest import load_script


@pytest.fixture(scope="module")
def tables():
  return load_script("experiments/recupfl_tables.py")


def test_levels_are_log_spaced_for_noise_and_even_for_shares(tables):
  assert tables.levels("ldp_gaussian", 1e-5, 0.1, 5) == [1e-5, 1e-4, 1e-3, 1e-2, 0.1]
  assert tables.levels("recupfl", 1e-4, 1e-2, 3) == [1e-4, 1e-3, 1e-2]
  assert tables.levels("sparsification", 0.2, 0.8, 4) == [0.2, 0.4, 0.6, 0.8]
  assert tables.levels("soteria", 0.2, 0.9, 1) == [0.9]


def test_soteria_defends_a_learned_representation_on_adult(tables):
  import tensorflow as tf
  from tff_privacy.models import builders
  kwargs = tables.defense_kwargs("soteria", 0.5, None, "race", "adult")
  spec = tables.DATASETS["adult"]
  with tf.Graph().as_default():
    model = builders.mlp((103,), 1, hidden=tuple(spec["model_kwargs"]["hidden"]))
    # the defended layer reads the 50 hidden units, not the 103 raw inputs
    assert model.get_layer(kwargs["layer"]).input_shape == (None, 50)
  assert kwargs == {"p": 0.5, "layer": "fc2"}
  # the image CNN keeps Soteria's own default (its first dense layer)
  assert tables.defense_kwargs("soteria", 0.9, None, "parity",
                               "mnist5k_parity") == {"p": 0.9}


def test_interpolate_at_reads_the_curve_linearly_between_its_losses(tables):
  rows = [{"learning_loss": 0.3, "asr": 0.2}, {"learning_loss": 0.1, "asr": 0.6},
          {"learning_loss": 0.2, "asr": 0.5}]
  # between (0.2, 0.5) and (0.3, 0.2): a quarter of the way
  assert tables.interpolate_at(0.225, rows, "asr") == pytest.approx(0.425)
  assert tables.interpolate_at(0.1, rows, "asr") == pytest.approx(0.6)
  assert math.isnan(tables.interpolate_at(0.31, rows, "asr"))
  assert math.isnan(tables.interpolate_at(0.05, rows, "asr"))


def _args(tmp_path, **overrides):
  values = dict(dataset="adult", attribute="race", adversaries=["stru_nn", "rf"],
                zoo_epochs=3, zoo_refresh=1, clients=10, clients_per_round=5, seed=0,
                shadow_samples=20, out=str(tmp_path), quiet=True, epsilon=1e-3)
  values.update(overrides)
  return argparse.Namespace(**values)


def _history(rounds, losses, asr):
  history = []
  for r, loss in zip(range(1, rounds + 1), losses):
    entry = {"round": r, "test_loss": loss, "asr/race/chance": 0.8,
             "balanced_asr/race/chance": 0.2}
    for adversary, value in asr.items():
      entry[f"asr/race/{adversary}"] = value + r / 100
      entry[f"asr_ci/race/{adversary}"] = [value - 0.1, value + 0.1]
      entry[f"balanced_asr/race/{adversary}"] = value / 2
      entry[f"balanced_asr_ci/race/{adversary}"] = [0.0, 1.0]
    history.append(entry)
  return history


def test_point_reads_a_finished_run_without_training(tables, tmp_path):
  args = _args(tmp_path)
  exp = tables.Experiment(args, "adult", os.path.join(args.out, "runs"))
  name = "recupfl_0.01_zoo_size5_r5"
  io.write_json(os.path.join(args.out, "runs", name, "metrics.json"),
                _history(5, [0.5, 0.4, 0.3, 0.2, 0.1], {"stru_nn": 0.7, "rf": 0.9}))
  rows = exp.point("recupfl", 0.01, zoo_size=5)
  assert [(r["round"], r["adversary"]) for r in rows] == [
      (1, "stru_nn"), (1, "rf"), (3, "stru_nn"), (3, "rf"), (5, "stru_nn"), (5, "rf")]
  assert [r["learning_loss"] for r in rows[::2]] == [0.5, 0.3, 0.1]
  assert rows[3]["asr"] == pytest.approx(0.93)
  assert rows[3]["balanced_asr"] == pytest.approx(0.45)
  assert (rows[3]["asr_low"], rows[3]["asr_high"]) == pytest.approx((0.8, 1.0))
  assert "adaptive_asr" not in rows[3]
  assert rows[0]["curve"] == "RECUP-FL"
  assert {r["zoo_size"] for r in rows} == {5}
  assert rows[0]["chance"] == 0.8


def test_point_names_runs_by_their_non_default_settings(tables, tmp_path):
  args = _args(tmp_path)
  exp = tables.Experiment(args, "adult", os.path.join(args.out, "runs"))
  for name in ("none_r5", "ldp_gaussian_0.001_r5", "recupfl_0.001_protectrace+sex_r1"):
    rounds = int(name[-1])
    io.write_json(os.path.join(args.out, "runs", name, "metrics.json"),
                  _history(rounds, [0.5] * rounds, {"stru_nn": 0.7, "rf": 0.9}))
  # each call finds its run on disk; a wrong name would start training
  assert len(exp.point("none", None)) == 6
  assert len(exp.point("ldp_gaussian", 1e-3)) == 6
  assert len(exp.point("recupfl", 1e-3, rounds=(1,), zoo_size=20,
                       protect="race,sex")) == 2


def test_interpolate_at_reads_log_axes_in_log10(tables):
  rows = [{"update_relative_error": 0.01, "asr": 0.8},
          {"update_relative_error": 1.0, "asr": 0.2}]
  # 0.1 is half way between 0.01 and 1 in log10
  assert tables.interpolate_at(0.1, rows, "asr", "update_relative_error",
                               log=True) == pytest.approx(0.5)
  assert tables.interpolate_at(0.1, rows, "asr", "update_relative_error") == (
      pytest.approx(0.8 - 0.6 * 0.09 / 0.99))


def test_verdict_compares_whole_intervals(tables):
  assert tables.verdict((0.1, 0.2), (0.25, 0.4)) == "lower"
  assert tables.verdict((0.5, 0.6), (0.25, 0.4)) == "higher"
  assert tables.verdict((0.3, 0.5), (0.25, 0.4)) == "overlap"
  assert tables.verdict((0.3, 0.5), (math.nan, math.nan)) == "-"


def _point(curve, defense, level, round_num, loss, error, asr, adaptive=None):
  row = {"curve": curve, "defense": defense, "level": level, "round": round_num,
         "attribute": "race", "adversary": "rf", "learning_loss": loss,
         "update_relative_error": error, "asr": asr, "asr_low": asr - 0.05,
         "asr_high": asr + 0.05}
  if adaptive is not None:
    row.update(adaptive_asr=adaptive, adaptive_asr_low=adaptive - 0.05,
               adaptive_asr_high=adaptive + 0.05)
  return row


def test_equal_utility_table_reads_each_baseline_at_recupfl_utility(tables, tmp_path):
  args = _args(tmp_path, adversaries=["rf"])
  rows = [_point("RECUP-FL (race)", "recupfl", 0.01, 1, 0.25, 0.1, 0.2, 0.82),
          _point("DP Gaussian", "ldp_gaussian", 0.01, 1, 0.2, 0.01, 0.9, 0.9),
          _point("DP Gaussian", "ldp_gaussian", 0.1, 1, 0.4, 1.0, 0.5, 0.7),
          _point("DP Laplace", "ldp_laplace", 0.1, 1, 0.3, 0.2, 0.1, 0.4),
          _point("DP Laplace", "ldp_laplace", 1.0, 1, 0.5, 2.0, 0.05, 0.3)]
  noise = {"learning_loss": {1: 0.01, 3: 0.01, 5: 0.01},
           "update_relative_error": {1: 0.0, 3: 0.0, 5: 0.0}}
  table = tables.equal_utility_table(rows, args, "race", "asr", noise)
  loss_part, error_part = table.split("#### at equal aggregate-update")
  line = next(l for l in loss_part.splitlines() if l.startswith("| 1 | rf"))
  cells = [c.strip() for c in line.strip("|").split("|")]
  # loss 0.25 is a quarter of the way from (0.2, 0.9) to (0.4, 0.5): 0.8,
  # bounds 0.75 and 0.85; adaptive from 0.9 to 0.7: 0.85. Laplace's losses
  # start at 0.3: no reading. Adaptive against adaptive: RECUP-FL's
  # [0.77, 0.87] overlaps [0.80, 0.90], though its plain interval is lower
  assert cells[5:7] == ["0.200 [0.150, 0.250]", "0.820 [0.770, 0.870]"]
  assert cells[7] == "0.800 [0.750, 0.850] (RECUP-FL lower)"
  assert cells[8] == "0.850 [0.800, 0.900] (RECUP-FL overlap)"
  assert cells[9:] == ["-", "-"]
  line = next(l for l in error_part.splitlines() if l.startswith("| 1 | rf"))
  cells = [c.strip() for c in line.strip("|").split("|")]
  # error 0.1 is half way from 0.01 to 1 in log10: Gaussian (0.9 + 0.5) / 2
  assert cells[7] == "0.700 [0.650, 0.750] (RECUP-FL lower)"
  # below Laplace's smallest error 0.2: no reading
  assert cells[9] == "-"
  assert ("learning_loss vs DP Gaussian: lower 1, overlap 0, higher 0, "
          "within noise 0") in table


def test_equal_utility_table_says_when_an_axis_spreads_less_than_its_noise(
    tables, tmp_path):
  args = _args(tmp_path, adversaries=["rf"])
  rows = [_point("RECUP-FL (race)", "recupfl", 0.01, 1, 0.259554, 0.1, 0.2),
          _point("DP Gaussian", "ldp_gaussian", 0.01, 1, 0.259902, 0.01, 0.9),
          _point("DP Gaussian", "ldp_gaussian", 0.1, 1, 0.259700, 1.0, 0.5)]
  noise = {"learning_loss": {1: 2e-4, 3: 0, 5: 0},
           "update_relative_error": {1: 0.0, 3: 0.0, 5: 0.0}}
  table = tables.equal_utility_table(rows, args, "race", "asr", noise)
  loss_part, error_part = table.split("#### at equal aggregate-update")
  assert ("spread 3.48e-04 is below twice its noise 2.00e-04: it does not "
          "separate the defences") in loss_part
  assert not any(l.startswith("| 1 | rf") for l in loss_part.splitlines())
  assert any(l.startswith("| 1 | rf") for l in error_part.splitlines())


def test_tradeoff_settings_cover_both_protections_and_both_noises(tables, tmp_path):
  args = _args(tmp_path, levels=2, second="sex", tradeoff_extra=[],
               two_attribute_levels=[], recupfl_levels=[],
               dp_levels=[])
  settings = tables.tradeoff_settings(args)
  curves = [s[0] for s in settings]
  assert curves == (["no defence"] + ["RECUP-FL (race)"] * 2
                    + ["RECUP-FL (race, sex)"] * 2 + ["DP Gaussian"] * 2
                    + ["DP Laplace"] * 2)
  assert settings[3][3] == {"protect": "race,sex"}
  assert [s[2] for s in settings if s[1] == "ldp_gaussian"] == [1e-5, 0.1]
  args.two_attribute_levels = [1e-3]
  assert [s[2] for s in tables.tradeoff_settings(args)
          if s[0] == "RECUP-FL (race, sex)"] == [1e-3]
  args.dp_levels = [1e-3, 0.1]
  assert [s[2] for s in tables.tradeoff_settings(args)
          if s[1] == "ldp_laplace"] == [1e-3, 0.1]
  args.recupfl_levels = [1e-4]
  assert [s[2] for s in tables.tradeoff_settings(args)
          if s[0] == "RECUP-FL (race)"] == [1e-4]


def test_equal_utility_reconstruction_picks_each_baseline_at_recupfl_utility(
    tables, tmp_path):
  args = _args(tmp_path)
  rows = [{"defense": "recupfl", "level": 1e-3, "learning_loss": 0.3,
           "update_relative_error": 0.1, "mse": 0.2, "ssim": 0.5}]
  for defense in ("ldp_gaussian", "ldp_laplace", "sparsification", "soteria"):
    rows += [{"defense": defense, "level": 0.5, "learning_loss": 0.2,
              "update_relative_error": 0.01, "mse": 0.1, "ssim": 0.9},
             {"defense": defense, "level": 0.9, "learning_loss": 0.6,
              "update_relative_error": 10.0, "mse": 0.5, "ssim": 0.3}]
  table = tables._equal_utility_reconstruction(rows, args)
  loss_part, error_part = table.split("#### at equal aggregate-update")
  assert "spans 0.200000 to 0.600000 over all settings (spread 4.00e-01)" in table
  gaussian = next(line for line in loss_part.splitlines()
                  if line.startswith("| DP Gaussian"))
  # loss 0.3: a quarter of the way from (0.1, 0.9) to (0.5, 0.3); nearest 0.5
  assert gaussian == ("| DP Gaussian | 0.200 | 0.750 | 0.5 | 0.2 | 0.1000 | "
                      "0.900 |")
  gaussian = next(line for line in error_part.splitlines()
                  if line.startswith("| DP Gaussian"))
  # error 0.1: a third of the way from 0.01 to 10 in log10; nearest 0.01 (one
  # decade off against two)
  assert gaussian == ("| DP Gaussian | 0.233 | 0.700 | 0.5 | 0.01 | 0.1000 | "
                      "0.900 |")


def test_an_out_folder_keeps_the_settings_its_runs_were_made_with(tables, tmp_path):
  args = _args(tmp_path, participation_clients=20)
  tables.check_settings(args)
  tables.check_settings(args)  # the same settings: fine
  with pytest.raises(SystemExit, match="its runs were made with clients=10; "
                     "give the same settings or another --out"):
    tables.check_settings(_args(tmp_path, participation_clients=20, clients=30))


def test_a_cached_reconstruction_row_is_redone_for_other_attack_settings(
    tables, tmp_path, monkeypatch):
  args = _args(tmp_path, ig_iterations=10, ig_victims=1)
  exp = tables.Experiment(args, "mnist5k_parity", os.path.join(args.out, "reconstruction"))
  attack = {"ig_iterations": 10, "ig_victims": 1, "seed": 0}
  cached = {"defense": "none", "level": None, "learning_loss": 0.5,
            "update_relative_error": 0.2, "mse": 0.1, "attack": attack}
  io.write_json(os.path.join(args.out, "reconstruction", "none", "row.json"), cached)
  assert tables._attacked_point(exp, "none", None, "parity") == cached
  # another iteration count: the run is read back and attacked anew
  io.write_json(os.path.join(args.out, "reconstruction", "none", "metrics.json"),
                [{"round": 1, "test_loss": 0.4}])
  args.ig_iterations = 20
  calls = []
  monkeypatch.setattr(tables.UpdateStore, "__init__", lambda self, path: None)
  monkeypatch.setattr(tables.UpdateStore, "clients", lambda self, r: [4, 7])
  monkeypatch.setattr(tables.evaluate, "attack_round", lambda *a, **k: calls.append(
      k) or {"mean": {"mse": 0.3, "ssim": 0.2, "psnr": 9.0}, "seconds": 1.0})
  row = tables._attacked_point(exp, "none", None, "parity")
  assert calls == [{"clients": [4], "attack_kwargs": {"iterations": 20}, "seed": 0}]
  assert (row["learning_loss"], row["mse"], row["victim_clients"]) == (0.4, 0.3, [4])
  assert row["attack"] == {**attack, "ig_iterations": 20}
  assert io.read_json(os.path.join(args.out, "reconstruction", "none",
                                   "row.json")) == row


def test_the_reconstruction_grid_refuses_settings_with_other_victims(tables, tmp_path):
  args = _args(tmp_path)
  rows = [{"defense": d, "level": 1e-3, "learning_loss": 0.3, "victim_clients": [0, 1]}
          for d in ("recupfl", "ldp_gaussian", "ldp_laplace", "sparsification",
                    "soteria")]
  rows.append({"defense": "none", "level": None, "learning_loss": 0.2,
               "victim_clients": [0, 2]})
  with pytest.raises(ValueError, match=r"attacked different clients"):
    tables._reconstruction_grid(rows, args)


@pytest.mark.slow
def test_tradeoff_reads_finished_runs_into_tables_and_figures(tables, tmp_path):
  args = _args(tmp_path, adversaries=["rf"], levels=2, second="sex",
               tradeoff_extra=[], noise_seeds=1, two_attribute_levels=[],
               recupfl_levels=[], dp_levels=[])
  exp = tables.Experiment(args, "adult", os.path.join(args.out, "runs"))
  rng = np.random.default_rng(0)

  def history(adaptive):
    out = []
    for r in range(1, 6):
      entry = {"round": r, "test_loss": 0.26 - r / 100 + rng.uniform(0, 1e-3),
               "update_relative_error": rng.uniform(0.01, 1),
               "update_cosine": 0.5}
      for a in ("race", "sex"):
        entry.update({f"asr/{a}/chance": 0.8, f"balanced_asr/{a}/chance": 0.5})
        for kind in ("asr", "balanced_asr") + (
            ("adaptive_asr", "adaptive_balanced_asr") if adaptive else ()):
          value = rng.uniform(0.2, 0.8)
          entry[f"{kind}/{a}/rf"] = value
          entry[f"{kind}_ci/{a}/rf"] = [value - 0.05, value + 0.05]
      out.append(entry)
    return out

  names = ["none_r5", "recupfl_1e-05_adaptive_r5", "recupfl_0.1_adaptive_r5",
           "recupfl_1e-05_protectrace+sex_adaptive_r5",
           "recupfl_0.1_protectrace+sex_adaptive_r5",
           "ldp_gaussian_1e-05_adaptive_r5", "ldp_gaussian_0.1_adaptive_r5",
           "ldp_laplace_1e-05_adaptive_r5", "ldp_laplace_0.1_adaptive_r5",
           "none_seed1_r5"]
  for name in names:
    io.write_json(os.path.join(args.out, "runs", name, "metrics.json"),
                  history("adaptive" in name))
  rows, text = tables.tradeoff(exp)  # no training: every run is on disk
  assert len(rows) == 9 * 3 * 2  # settings x rounds x attributes (one adversary)
  assert "### RECUP-FL vs DP at equal utility: plain ASR of sex" in text
  assert "Seed-to-seed noise of the learning loss" in text
  for figure in ("tradeoff_race_asr.png", "tradeoff_sex_balanced_asr.png",
                 "loss_curves.png"):
    assert os.path.getsize(os.path.join(args.out, figure)) > 10_000


def test_a_verdict_that_changes_within_the_noise_of_the_utility_is_within_noise(
    tables):
  curve = [_point("DP Gaussian", "ldp_gaussian", 0.01, 1, 0.20, 0.01, 0.9),
           _point("DP Gaussian", "ldp_gaussian", 0.1, 1, 0.40, 1.0, 0.1)]
  ours = _point("RECUP-FL (race)", "recupfl", 0.01, 1, 0.30, 0.1, 0.5)
  # ours 0.5 [0.45, 0.55]; at loss 0.30 the baseline reads 0.5 [0.45, 0.55]: overlap. Within
  # 2 sigma = 0.02 it reads 0.58 [0.53, 0.63] and 0.42 [0.37, 0.47]: overlap
  assert tables.noise_robust_verdict(ours, "asr", curve, "asr", "learning_loss",
                                     False, 0.01) == "overlap"
  # 2 sigma = 0.1: 0.7 [0.65, 0.75] (lower) and 0.3 [0.25, 0.35] (higher)
  assert tables.noise_robust_verdict(ours, "asr", curve, "asr", "learning_loss",
                                     False, 0.05) == "within noise"
  # without noise, the plain verdict; outside the curve, no reading
  assert tables.noise_robust_verdict(ours, "asr", curve, "asr", "learning_loss",
                                     False, 0.0) == "overlap"
  far = _point("RECUP-FL (race)", "recupfl", 0.01, 1, 0.50, 0.1, 0.5)
  assert tables.noise_robust_verdict(far, "asr", curve, "asr", "learning_loss",
                                     False, 0.01) == "-"


def test_a_cached_run_made_with_another_config_is_refused_in_one_line(tables,
                                                                        tmp_path):
  args = _args(tmp_path)
  exp = tables.Experiment(args, "adult", os.path.join(args.out, "runs"))
  name = "recupfl_0.01_r1"
  io.write_json(os.path.join(args.out, "runs", name, "metrics.json"),
                _history(1, [0.5], {"stru_nn": 0.7, "rf": 0.9}))
  config = tables.runner.RunConfig(
      out=os.path.join(args.out, "runs", name), rounds=1, capture_rounds=(1,),
      infer_attributes=("race",), clients_per_round=args.clients_per_round,
      defense="recupfl", defense_kwargs=tables.defense_kwargs(
          "recupfl", 0.01, args, "race", "adult"), **exp.common).to_json()
  config["defense_kwargs"]["attack_loss"] = "cross_entropy"  # an older run
  io.write_json(os.path.join(args.out, "runs", name, "config.json"), config)
  with pytest.raises(SystemExit, match=r"holds a run with another config \(differs "
                     r'in defense_kwargs.attack_loss: "cross_entropy" there, '
                     r'"logit_margin" now\)'):
    exp.point("recupfl", 0.01, rounds=(1,))
  config["defense_kwargs"]["attack_loss"] = "logit_margin"
  io.write_json(os.path.join(args.out, "runs", name, "config.json"), config)
  assert len(exp.point("recupfl", 0.01, rounds=(1,))) == 2  # read back
