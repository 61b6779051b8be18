"""The leaderboard: grids refused in one line, swept strengths routed to the
defence or the method, the Pareto front and the utility-matched rows by
hand, a tiny leaderboard run end to end, resumed, and reported, and an attack's
failure run again while a refusal is kept."""

import collections
import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import psutil
import pytest
import tensorflow as tf
import tensorflow_federated as tff
from conftest import attack_store, record_of, worker_children

from tff_privacy import attacks as attacks_package
from tff_privacy import cli, evaluate, leaderboard, models, provenance, runner
from tff_privacy.leaderboard import board, grid, report
from tff_privacy.updates import GroundTruthStore, UpdateStore

TINY = {
    "protocol": {"dataset": "mnist5k_parity", "model": "mlp",
                 "model_kwargs": {"hidden": [8]}, "clients": 40,
                 "clients_per_round": 8, "rounds": 2, "batch_size": 2, "seed": 1},
    "attacks": {"inversion": ["ig"], "iterations": 4, "victims": 2,
                "attribute": "parity", "adversaries": ["svm", "rf"],
                "shadow_samples": 20},
    "reference": "FedSGD",
    "entries": [
        {"name": "FedSGD", "method": "fedsgd"},
        {"name": "LDP Gaussian", "method": "fedsgd", "defense": "ldp_gaussian",
         "defense_kwargs": {"clip": 1.0}, "sweep": {"noise_multiplier": [0.01, 1.0]},
         "default": 1.0},
    ],
    # no equal-epsilon rows (their calibration: test_calibration.py)
    "equal_epsilon": None,
}


def _with(**changes):
  data = json.loads(json.dumps(TINY))
  data.update(changes)
  return data


@pytest.mark.parametrize("data, message", [
    (_with(colour=1), "unknown keys ['colour']"),
    (_with(entries=[]), "entries: a non-empty list"),
    (_with(reference="FedAvg"), "reference: 'FedAvg' is not an entry's name"),
    (_with(utility_target=1.5), "utility_target: a fraction"),
    (_with(attacks={"inversion": ["nope"]}), "inversion: a list of attacks from"),
    (_with(attacks={"victims": 0}), "victims: an integer >= 1"),
    (_with(protocol={"rounds": 2, "colour": "red"}), "unknown keys ['colour']"),
    (_with(entries=[{"name": "A", "method": "fedsgd", "sweep": {"p": [0.5]}}]),
     "'p' is a parameter of neither the defence nor method 'fedsgd'"),
    (_with(entries=[{"name": "A", "method": "fedsgd", "defense": "sparsification",
                     "sweep": {"p": [0.5]}, "default": 0.9}]),
     "default: 0.9 is not one of the strengths [0.5]"),
    (_with(entries=[{"name": "A", "method": "fedsgd", "defense": "sparsification",
                     "sweep": {"p": [1.5]}}]), "entries[0] (A): "),
    (_with(entries=[{"name": "A", "method": "fedsgd"}] * 2), "names must differ"),
    (_with(entries=[{"name": "A", "method": "fedzz"}]), "entries[0] (A): method='fedzz'"),
    (_with(entries=[{"name": "A", "method": "fedsgd", "default": 0.1}]),
     "entries[0] (A) default: a strength of the entry's sweep"),
    (_with(protocol={**TINY["protocol"], "clients_per_round": 50}),
     "(FedSGD): clients_per_round must be in [1, clients=40]"),
    (_with(attacks={"capture_round": 3}), "capture_rounds must lie in [1, rounds=2]"),
    (_with(attacks={"shadow_samples": 1}), "shadow_samples: an integer >= 2"),
    (_with(equal_epsilon=8), "grid equal_epsilon: a JSON object of the target"),
    (_with(equal_epsilon={"eps": 8}), "equal_epsilon: unknown keys ['eps']"),
    (_with(equal_epsilon={"epsilon": 0}), "equal_epsilon epsilon: a number > 0, got 0"),
    (_with(equal_epsilon={"epsilon": True}), "equal_epsilon epsilon: a number > 0"),
    (_with(equal_epsilon={"delta": 1}), "equal_epsilon delta: a number in (0, 1), got 1"),
    (_with(seeds=0), "grid seeds: an integer >= 1, got 0"),
    (_with(protocols=[]), "grid protocols: a non-empty list of protocol changes"),
    (_with(protocols=[{"model": "cnn"}]), "protocols[0] name: a non-empty name"),
    (_with(protocols=[{"name": "A", "colour": 1}]), "protocols[0]: unknown keys ['colour']"),
    (_with(protocols=[{"name": "A b"}, {"name": "a-B"}]), "protocols: names must differ"),
    (_with(protocols=[{"name": "big", "clients_per_round": 50}]),
     "(FedSGD): clients_per_round must be in [1, clients=40]"),
])
def test_a_wrong_grid_is_refused_in_one_line(data, message):
  with pytest.raises(ValueError) as error:
    grid.parse(data)
  assert message in str(error.value)
  assert "\n" not in str(error.value)


def test_a_swept_parameter_goes_to_the_defense_else_to_the_method():
  rows = grid.parse(_with(reference="G", entries=[
      {"name": "G", "method": "fedsgd", "defense": "ldp_gaussian",
       "defense_kwargs": {"clip": 2.0}, "sweep": {"noise_multiplier": [0.1, 1.0]},
       "default": 1.0},
      {"name": "F", "method": "fedre", "method_kwargs": {"regions": "1,1,5,5"},
       "sweep": {"epsilon": [10.0]}, "protocol": {"rounds": 3}}])).rows()
  assert [r.key for r in rows] == ["g__noise-multiplier-0.1",
                                   "g__noise-multiplier-1", "f__epsilon-10"]
  assert rows[0].defense_kwargs == {"clip": 2.0, "noise_multiplier": 0.1}
  assert rows[0].method_kwargs == {}
  # F names no default: its first strength is
  assert [r.is_default for r in rows] == [False, True, True]
  assert rows[2].method_kwargs == {"regions": "1,1,5,5", "epsilon": 10.0}
  assert rows[2].protocol["rounds"] == 3 and rows[0].protocol["rounds"] == 2


def test_the_pareto_front_by_hand():
  # (utility, leakage): B dominates C; A and D trade off; E has no leakage
  points = [(0.9, 0.5), (0.8, 0.2), (0.7, 0.3), (0.95, 0.9), (0.99, None),
            (0.8, 0.2)]
  assert report.pareto_front(points) == [True, True, False, True, False, True]


def test_with_intervals_only_a_row_better_beyond_them_on_both_axes_dominates():
  points = [(0.90, 0.50), (0.80, 0.20), (0.70, 0.30), (0.60, 0.60)]
  # B's utility interval overlaps C's: tied there, so C is not dominated;
  # A and B both beat D beyond their intervals
  cis = [([0.88, 0.92], [0.45, 0.55]), ([0.74, 0.86], [0.15, 0.25]),
         ([0.65, 0.75], [0.28, 0.32]), ([0.58, 0.62], [0.58, 0.62])]
  assert report.pareto_front(points, cis) == [True, True, True, False]
  # without intervals, each point is its own: B beats C on both axes
  assert report.pareto_front(points, [(None, None)] * 4) == [True, True, False, False]
  # equal utility: tied, whatever the leakage
  assert report.pareto_front([(0.8, 0.2), (0.8, 0.3)], [(None, None)] * 2) == [True, True]


def test_rows_without_a_finite_utility_or_leakage_are_off_the_front():
  nan = float("nan")
  # the NaN points would dominate nothing and be dominated by nothing
  assert report.pareto_front([(0.5, nan), (0.95, 0.1), (nan, 0.0), (0.9, 0.2)]) == [
      False, True, False, False]


def test_a_swept_string_parameter_names_its_rows():
  rows = grid.parse(_with(reference="F", entries=[
      {"name": "F", "method": "fedre", "method_kwargs": {"regions": "1,1,5,5"},
       "sweep": {"pda_pam_rule": ["paper", "normalized"]},
       "default": "normalized"}])).rows()
  assert [r.key for r in rows] == ["f__pda-pam-rule-paper",
                                   "f__pda-pam-rule-normalized"]
  assert rows[1].label == "F (pda_pam_rule=normalized)" and rows[1].is_default


def test_the_matched_row_is_the_strength_closest_to_the_target():
  def row(entry, key, utility, parameter="p"):
    return {"entry": entry, "key": key, "utility": utility,
            "settings": {"parameter": parameter}}
  results = [row("ref", "r", 0.9, None), row("a", "a1", 0.85), row("a", "a2", 0.5),
             row("b", "b1", 0.2), row("b", "b2", 0.79)]
  # target 0.9 x 0.9 = 0.81: |0.85 - 0.81| < |0.5 - 0.81|; |0.79 - 0.81| < 0.61
  assert report.matched_keys(results, 0.81) == {"a1", "b2"}


@pytest.mark.slow  # 90 s of four trainings; the fast suite trains a row,
# keeps its refusals and runs its failures again in
# test_a_failed_attack_runs_again_and_a_refusal_is_kept, and `make demo`
# runs the whole leaderboard
def test_a_tiny_leaderboard_runs_resumes_and_reports(tmp_path):
  out = str(tmp_path / "board")
  tiny = grid.parse(TINY)
  before = {p.pid for p in worker_children()}
  # in two spawned processes; the resumed row below runs in this one
  first = board.run(tiny, out, progress=False, log=lambda _: None, jobs=2)
  assert {p.pid for p in worker_children()} <= before  # the pool's workers ended
  assert [r["key"] for r in first] == [r.key for r in tiny.rows()]
  path = report.write(tiny, first, out, ["tff-privacy", "leaderboard"])
  text = open(path).read()
  assert "| FedSGD [" in text or "| FedSGD |" in text
  for figure in report.FIGURES:
    assert os.path.getsize(os.path.join(out, figure)) > 1000, figure

  spec = models.ModelSpec("mlp", (28, 28, 1), 2, {"hidden": [8]})
  params = sum(int(np.prod(w.shape)) for w in spec.keras(0).get_weights())
  for r in first:
    assert r["upload_bytes"] == 4 * params
    assert 0 <= r["utility"] <= 1
    assert set(r["attribute"]["asr"]) == {"svm", "rf"}
    assert r["inversion"]["ig"]["label_accuracy"] >= 0
  assert first[0]["privacy"] is None
  for r in first:  # what the attack had after 1, 2 and all 4 iterations
    by_iterations = r["inversion"]["ig"]["ssim_by_iterations"]
    assert sorted(by_iterations, key=int) == ["1", "2", "4"]
    assert by_iterations["4"] == pytest.approx(r["inversion"]["ig"]["ssim"])
  for row in report.table_rows(tiny, first):  # every number with its interval
    assert row["victims"] == 2 and row["attack_converged"] is not None
    for field in ("utility", "ssim", "psnr", "balanced_asr_max"):
      low, high = row[f"{field}_ci"]
      assert low <= row[field] + 1e-9 and row[field] - 1e-9 <= high, (field, row)
  for r in first:  # its run, attack and attribute inference each name their code
    recorded = provenance.recorded(os.path.join(out, "rows", r["key"]))
    assert {"train/config.json", *(f"{a}/attack.json" for a in r["inversion"])} < set(
        recorded) and all(None not in v for v in recorded.values())
    assert [v["commit"] for v in r[provenance.KEY]] == [
        provenance.code_version()["commit"]]
  metrics = json.load(open(os.path.join(out, "rows", first[2]["key"], "train",
                                        "metrics.json")))
  assert first[2]["privacy"]["epsilon"] == metrics[-1]["epsilon"]

  # a killed leaderboard: the last row's result and attack are gone; the
  # row, retrained here, gives what its spawned process gave
  last = os.path.join(out, "rows", first[-1]["key"])
  os.remove(os.path.join(last, board.ROW_FILE))
  shutil.rmtree(os.path.join(last, "ig"))
  logged = []
  again = board.run(tiny, out, progress=False, log=logged.append)
  assert sum("cached" in line for line in logged) == 2
  for a, b in zip(first, again):
    assert a["utility"] == b["utility"] and a["attribute"] == b["attribute"]
    np.testing.assert_allclose(a["inversion"]["ig"]["ssim"],
                               b["inversion"]["ig"]["ssim"], atol=1e-5)

  # an entry whose settings changed starts its rows afresh; the others stay
  changed = _with(entries=[TINY["entries"][0], {
      **TINY["entries"][1], "defense_kwargs": {"clip": 0.5}}])
  logged = []
  third = board.run(grid.parse(changed), out, progress=False, log=logged.append)
  assert sum("cached" in line for line in logged) == 1
  assert third[0] == again[0]
  for r in third[1:]:
    config = json.load(open(os.path.join(out, "rows", r["key"], "train", "config.json")))
    assert config["defense_kwargs"]["clip"] == 0.5

  # another protocol in the same folder is refused
  with pytest.raises(ValueError, match="holds a leaderboard with other protocol"):
    board.run(grid.parse(_with(protocol={**TINY["protocol"], "rounds": 3})), out,
              progress=False, log=lambda _: None)


@pytest.mark.slow
def test_a_failed_attack_runs_again_and_a_refusal_is_kept(tmp_path, monkeypatch, capsys):
  # ig_body reads HyperFL's body uploads and refuses FedSGD's gradients
  one = grid.parse(_with(
      protocol={**TINY["protocol"], "rounds": 1, "clients": 8, "clients_per_round": 4},
      attacks={**TINY["attacks"], "victims": 1},
      entries=[{**TINY["entries"][0], "attacks": ["ig", "ig_body"]}]))
  out = str(tmp_path / "board")
  calls = []
  short = {"ig": tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor"),
           "attribute": MemoryError("no memory left")}  # each raised once
  attack_round, infer = evaluate.attack_round, evaluate.infer_attributes_round

  def attack(updates, round_num, out, name, **kwargs):
    calls.append(name)
    if name in short:
      raise short.pop(name)
    return attack_round(updates, round_num, out, name, **kwargs)

  def attributes(*args, **kwargs):
    calls.append("attribute")
    if "attribute" in short:
      raise short.pop("attribute")
    return infer(*args, **kwargs)

  monkeypatch.setattr(evaluate, "attack_round", attack)
  monkeypatch.setattr(evaluate, "infer_attributes_round", attributes)
  [first] = board.run(one, out, progress=False, log=lambda _: None)
  assert first["inversion"]["ig"] == {
      "error": "ResourceExhaustedError: OOM when allocating tensor"}
  assert first["attribute"] == {"error": "MemoryError: no memory left"}
  refusal = first["inversion"]["ig_body"]
  assert refusal["refused"] and "handles body_weights, body_delta uploads" in refusal["error"]
  err = capsys.readouterr().err
  assert "FedSGD, ig: failed, run again by the next run: ResourceExhaustedError" in err
  assert "FedSGD, attribute: failed, run again by the next run: MemoryError" in err
  text = report.markdown(one, report.table_rows(one, board.read(out)[1]))
  failed = text.split("## Attacks that failed")[1].split("##")[0]
  refused = text.split("## Attacks that could not run")[1].split("##")[0]
  assert "- FedSGD, ig: ResourceExhaustedError: OOM" in failed
  assert "- FedSGD, attribute: MemoryError: no memory left" in failed
  assert "ig_body" in refused and "ig_body" not in failed

  # the next run attacks again; the refusal is a result and stays one. The
  # training has finished: resuming it (test_runner's subject) would only
  # trace its computations again
  history = json.load(open(os.path.join(out, "rows", first["key"], "train",
                                        "metrics.json")))
  monkeypatch.setattr(runner, "run", lambda config, progress, **_: history)
  calls.clear()
  logged = []
  [second] = board.run(one, out, progress=False, log=logged.append)
  assert not any("cached" in line for line in logged)
  assert sorted(calls) == ["attribute", "ig", "ig_body"]
  assert "error" not in second["inversion"]["ig"]
  assert -1 <= second["inversion"]["ig"]["ssim"] <= 1
  assert set(second["attribute"]["asr"]) == {"svm", "rf"}
  assert second["inversion"]["ig_body"] == first["inversion"]["ig_body"]
  assert "failed" not in capsys.readouterr().err
  text = report.markdown(one, report.table_rows(one, [second]))
  assert "## Attacks that failed" not in text and "ig_body" in text

  # finished but for a refusal: cached
  calls.clear()
  logged = []
  assert board.run(one, out, progress=False, log=logged.append) == [second]
  assert calls == [] and any("cached" in line for line in logged)


def test_an_attack_that_cannot_read_an_old_store_is_a_refusal(tmp_path):
  # a FedRE store captured before its metadata had 'noise_on': ig_noise_aware
  # cannot read it on any try, so the row keeps a refusal, not a failure to
  # run again
  from tff_privacy.data import sources
  source = sources.load_source("digits")
  x, y = source.x_train[:1], source.y_train[:1]
  record = record_of(x, y)
  old = dataclasses.replace(record, metadata={
      **record.metadata, "method": "fedre",
      "defense": {"name": "fedre", "epsilon": 50.0, "clip": 1.0,
                  "budget_split": "psi", "eta_placement": "client",
                  "learning_rate": 0.005, "perturbation": "gradient",
                  "regions": None}})
  updates = attack_store(tmp_path, old, x, y)
  cell = board._inversion(updates, 1, [0], "ig_noise_aware", {"iterations": 1},
                          str(tmp_path / "ig_noise_aware"), 0, False)
  assert cell["refused"] is True
  assert cell["error"].startswith(
      "attack 'ig_noise_aware' refuses round 1 client 0")
  assert "has no 'noise_on'" in cell["error"]
  result = {"inversion": {"ig_noise_aware": cell}, "attribute": None}
  assert board.failures(result) == {}
  assert board.refusals(result) == {"ig_noise_aware": cell["error"]}


def test_the_cli_refuses_a_bad_config_and_an_empty_folder(tmp_path, capsys):
  bad = tmp_path / "grid.json"
  bad.write_text("{not json")
  assert cli.main(["leaderboard", "--out", str(tmp_path / "o"),
                   "--config", str(bad)]) == 2
  assert "not JSON" in capsys.readouterr().err
  assert cli.main(["report", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err.strip()
  assert "no leaderboard here" in err and "\n" not in err
  assert cli.main(["report", str(tmp_path)]) == 2  # its grid.json is broken
  assert "grid.json: not JSON" in capsys.readouterr().err


def test_the_built_in_grids_parse():
  for scale in leaderboard.defaults.SCALES:
    parsed = grid.parse(leaderboard.defaults.grid(scale))
    rows = parsed.rows()
    assert len({r.key for r in rows}) == len(rows)
    assert parsed.equal_epsilon == (None if scale == "compact" else
                                    {"epsilon": 8.0, "delta": 1e-5})


def test_equal_epsilon_is_8_at_1e_5_unless_given_and_null_turns_it_off():
  default = {k: v for k, v in TINY.items() if k != "equal_epsilon"}
  assert grid.parse(default).equal_epsilon == {"epsilon": 8.0, "delta": 1e-5}
  assert grid.parse(_with(equal_epsilon={"epsilon": 2})).equal_epsilon == {
      "epsilon": 2.0, "delta": 1e-5}
  off = grid.parse(TINY)
  assert off.equal_epsilon is None and grid.parse(off.to_json()) == off
  # nothing calibrated yet: no equal-epsilon rows, whatever the target
  assert grid.parse(default).rows() == off.rows()


@pytest.mark.slow
def test_a_pools_processes_and_workers_end_with_the_leaderboard():
  """SIGKILL the program running rows in processes: its pool's processes
  (and their TFF workers) must not go on training."""
  script = textwrap.dedent("""
      import multiprocessing, os, time
      from concurrent import futures
      from tff_privacy.leaderboard import board
      context = multiprocessing.get_context("spawn")
      pool = futures.ProcessPoolExecutor(1, mp_context=context,
                                         initializer=board._start_process)
      print(pool.submit(os.getpid).result(), flush=True)
      pool.submit(time.sleep, 600)
      time.sleep(600)
  """)
  parent = subprocess.Popen([sys.executable, "-c", script],
                            stdout=subprocess.PIPE, text=True)
  row_process = psutil.Process(int(parent.stdout.readline()))
  processes = [row_process] + row_process.children(recursive=True)
  assert any(p.name() == "worker_binary" for p in processes)
  parent.kill()
  parent.wait()
  _, alive = psutil.wait_procs(processes, timeout=30)
  assert not alive, [p.cmdline()[:2] for p in alive]


def _adaptive_grid():
  return grid.parse(_with(entries=[
      {"name": "FedSGD", "method": "fedsgd"},
      {"name": "Sparse", "method": "fedsgd", "defense": "sparsification",
       "sweep": {"p": [0.9]}},
      {"name": "Clip", "method": "fedsgd", "defense": "dp_clip",
       "defense_kwargs": {"clip": 1.0}},
      {"name": "HyperFL", "method": "hyperfl",
       "attacks": ["ig_hyperfl", "tailored_hyperfl"]}]))


def test_each_row_is_also_attacked_by_the_adaptive_attacks_of_its_defense():
  rows = {r.entry: r for r in _adaptive_grid().rows()}
  assert rows["FedSGD"].inversion == ("ig",) and rows["FedSGD"].adaptive == ()
  assert rows["Sparse"].inversion == ("ig", "ig_masked")
  assert rows["Sparse"].adaptive == ("ig_masked",)
  assert rows["Sparse"].upload_defense == "sparsification"
  # named by the entry already: not twice
  assert rows["HyperFL"].inversion == ("ig_hyperfl", "tailored_hyperfl")
  assert rows["HyperFL"].adaptive == ("tailored_hyperfl",)
  assert rows["HyperFL"].upload_defense == "hyperfl"
  # which attacks run does not decide whether a row's training is reused
  assert "inversion" not in rows["Sparse"].settings()


def test_a_finished_row_runs_again_for_an_attack_it_lacks(tmp_path, monkeypatch):
  tiny = _adaptive_grid()
  sparse = next(r for r in tiny.rows() if r.entry == "Sparse")
  cached = {"inversion": {"ig": {"ssim": 0.5}}, "attribute": None}
  monkeypatch.setattr(board, "_cached", lambda row, out: dict(cached) if row.key in (
      sparse.key, "fedsgd", "clip", "hyperfl") else None)
  ran = []
  monkeypatch.setattr(board, "_timed_row", lambda row, *a, **k: (ran.append(row.key) or {}, 0.0))
  board.run(tiny, str(tmp_path), progress=False, log=lambda _: None)
  # FedSGD and Clip have every attack; HyperFL and Sparse lack theirs
  assert sorted(ran) == sorted(["hyperfl", sparse.key])


def _result(row, ssims, utility=0.9):
  """A finished row's result with the given SSIM per attack; each attack's
  folder is rows/<key>/<attack>."""
  return {"key": row.key, "label": row.label, "entry": row.entry,
          "is_default": row.is_default,
          "settings": {"parameter": row.parameter, "strength": row.strength},
          "utility": utility, "utility_kind": board.GLOBAL_UTILITY, "loss": 0.1,
          "inversion": {a: {"ssim": s, "psnr": 10 * s, "label_accuracy": 1.0,
                            "folder": os.path.join("rows", row.key, a),
                            "value_range": [0.0, 1.0]}
                        for a, s in ssims.items()},
          "attribute": None, "privacy": None, "seconds_per_round": 1.0,
          "upload_bytes": 4}


def test_per_victim_scores_average_each_victims_samples():
  samples = [{"client": 5, "ssim": 0.2, "psnr": 10.0}, {"client": 2, "ssim": 0.9, "psnr": 30.0},
             {"client": 5, "ssim": 0.4, "psnr": 20.0}]
  got = board.per_victim(samples)
  assert got["clients"] == [5, 2] and got["psnr"] == [15.0, 30.0]
  assert got["ssim"] == pytest.approx([0.3, 0.9])


def test_every_number_of_a_row_carries_its_interval():
  """Utility by Wilson over the test samples (scipy's binomtest called
  here), leakage by the worst-case bootstrap over the victims, the best
  adversary's ASR by attribute inference's own intervals; none where none
  can be computed."""
  import scipy.stats
  from tff_privacy.metrics import intervals
  tiny = _adaptive_grid()
  rows = {r.entry: r for r in tiny.rows()}
  sparse = _result(rows["Sparse"], {"ig": 0.3, "ig_masked": 0.7}, 0.85)
  victims = {"ig": [0.2, 0.4, 0.3], "ig_masked": [0.6, 0.8, 0.7]}
  for name, ssims in victims.items():
    sparse["inversion"][name]["victims"] = {
        "clients": [4, 5, 6], "ssim": ssims, "psnr": [10 * v for v in ssims]}
  sparse["samples_tested"] = 200
  sparse["attribute"] = {
      "asr": {"svm": 0.6, "rf": 0.7}, "asr_ci": {"svm": [0.1, 0.2], "rf": [0.3, 0.4]},
      "balanced_asr": {"svm": 0.65, "rf": 0.55},
      "balanced_asr_ci": {"svm": [0.5, 0.6], "rf": [0.7, 0.8]},
      "chance": 0.5, "balanced_chance": 0.5}
  old = _result(rows["Clip"], {"ig": 0.2}, 0.5)  # made before intervals were kept
  table = {r["entry"]: r for r in report.table_rows(tiny, [sparse, old])}
  row = table["Sparse"]
  wilson = scipy.stats.binomtest(170, 200).proportion_ci(0.95, method="wilson")
  np.testing.assert_allclose(row["utility_ci"], [wilson.low, wilson.high])
  assert row["victims"] == 3
  # ig_masked is the worst on every victim: every resample chooses it
  assert row["ssim_ci"] == intervals.worst_case_interval(
      {"ig_masked": victims["ig_masked"]})
  assert 0.6 <= row["ssim_ci"][0] <= 0.7 <= row["ssim_ci"][1] <= 0.8 + 1e-12
  assert row["psnr_ci"] == pytest.approx([10 * v for v in row["ssim_ci"]])
  assert row["unaware_ssim_ci"] == intervals.worst_case_interval({"ig": victims["ig"]})
  assert (row["asr_max_ci"], row["balanced_asr_max_ci"]) == ([0.3, 0.4], [0.5, 0.6])
  assert [table["Clip"][k] for k in ("victims", "ssim_ci", "psnr_ci", "utility_ci")
          ] == [None] * 4
  text = report.markdown(tiny, list(table.values()))
  low, high = row["ssim_ci"]
  assert f"0.700 [{low:.3f}, {high:.3f}] (ig_masked)" in text
  assert f"0.8500 [{wilson.low:.4f}, {wilson.high:.4f}]" in text
  assert "0.65 [0.50, 0.60] (0.50)" in text and "3 victims attacked per row" in text


def test_a_personalised_rows_utility_interval_is_over_its_tested_clients():
  """The last round's per-client accuracies travel into the row; the
  interval is the bootstrap's over clients. By hand: the mean of 4 draws
  from {1, 2, 3, 4}/4 is S/16, S a sum of 4 four-sided dice, P(S <= 5) =
  5/256 < 2.5% < P(S <= 6) = 15/256 and symmetrically P(S >= 14) = 15/256,
  so the interval is [6/16, 14/16]."""
  accuracies = [0.5, 1.0, 0.25, 0.75]
  history = [{"round": 1, "personal_accuracy_mean": 0.1,
              "personal_accuracy_by_client": [0.1, 0.1]},
             {"round": 2, "personal_accuracy_mean": 0.625, "personal_loss_mean": 0.8,
              "personal_accuracy_by_client": accuracies}]
  assert board.utility(history) == {
      "utility": 0.625, "loss": 0.8, "utility_kind": "personalised accuracy",
      "utility_by_client": accuracies}
  made_before = [{"round": 2, "personal_accuracy_mean": 0.625}]
  assert board.utility(made_before)["utility_by_client"] is None
  tiny = _adaptive_grid()
  hyperfl = {r.entry: r for r in tiny.rows()}["HyperFL"]
  result = {**_result(hyperfl, {"ig_hyperfl": 0.3}), **board.utility(history)}
  row = report.table_rows(tiny, [result])[0]
  assert row["utility_ci"] == [0.375, 0.875]
  assert "0.6250 [0.3750, 0.8750]*" in report.markdown(tiny, [row])
  # one tested client, or a row made before the accuracies were kept: none
  assert report.utility_interval({**result, "utility_by_client": [0.625]}) is None
  old = {k: v for k, v in result.items() if k != "utility_by_client"}
  assert report.utility_interval(old) is None


def test_leakage_is_the_worst_attack_with_the_unaware_ones_beside_it(tmp_path,
                                                                     monkeypatch):
  from tff_privacy.metrics import report as metrics_report
  tiny = _adaptive_grid()
  rows = {r.entry: r for r in tiny.rows()}
  results = [_result(rows["FedSGD"], {"ig": 0.9}),
             _result(rows["Sparse"], {"ig": 0.3, "ig_masked": 0.7}, 0.85),
             _result(rows["Clip"], {"ig": 0.2}, 0.5)]
  table = {r["entry"]: r for r in report.table_rows(tiny, results)}
  assert (table["Sparse"]["attack"], table["Sparse"]["ssim"]) == ("ig_masked", 0.7)
  assert (table["Sparse"]["unaware_attack"], table["Sparse"]["unaware_ssim"]) == ("ig", 0.3)
  assert table["Sparse"]["ssim_ig"] == 0.3 and table["Sparse"]["psnr_ig_masked"] == 7.0
  # the front is on the worst case: Clip at (0.84, 0.5) is on it beside
  # Sparse's (0.85, 0.7); by Sparse's unaware 0.3 it would be dominated
  results[2] = _result(rows["Clip"], {"ig": 0.5}, 0.84)
  table = {r["entry"]: r for r in report.table_rows(tiny, results)}
  assert [table[e]["pareto"] for e in ("FedSGD", "Sparse", "Clip")] == [True] * 3
  text = report.markdown(tiny, list(table.values()))
  assert "0.700 (ig_masked)" in text and "0.300 (ig)" in text
  without = text.split("## Defences without a known adaptive attack")[1].split("##")[0]
  reason = attacks_package.disclosure("dp_clip").no_adaptive_attack
  assert f"- dp_clip (Clip): {reason}" in without and "sparsification" not in without
  original = np.zeros((2, 28, 28, 1), np.float32)
  for r in results:
    for name, cell in r["inversion"].items():
      os.makedirs(tmp_path / cell["folder"])
      np.savez(tmp_path / cell["folder"] / "reconstructions.npz", original=original,
               reconstructed=original + cell["ssim"])
  shown = {}
  monkeypatch.setattr(metrics_report, "save_grid",
                      lambda images, *a, **k: shown.update(images))
  report.write(tiny, results, str(tmp_path))
  # each entry's images are its winning attack's
  assert sorted(shown) == ["Clip (ig)", "FedSGD (ig)", "Sparse (ig_masked)", "original"]
  np.testing.assert_array_equal(shown["Sparse (ig_masked)"], original + 0.7)
  with open(tmp_path / "leaderboard.csv") as f:
    header = f.readline().strip().split(",")
  assert {"ssim_ig", "ssim_ig_masked", "psnr_ig_masked", "unaware_ssim",
          "ssim_tailored_hyperfl"} <= set(header)


@pytest.mark.parametrize("last", [
    # a run whose clients have no test samples: no personal_* entry at all
    {"round": 2, "clients_without_test_data": 5, "train_loss": 0.3},
    # a task measuring no accuracy: other personal_* entries only
    {"round": 2, "clients_without_test_data": 5, "personal_loss_mean": 0.4,
     "personal_f_score_mean": 0.6}])
def test_a_personalised_run_without_client_test_data_is_refused_in_one_line(last):
  with pytest.raises(ValueError) as error:
    board.utility([last])
  assert "round 2 has no personalised accuracy (personal_accuracy_mean)" in str(
      error.value)
  assert "(5 of its clients have no test samples)" in str(error.value)
  assert "\n" not in str(error.value)


def test_the_upload_column_gives_a_compressing_defenses_own_encoding(tmp_path,
                                                                    monkeypatch):
  spec = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": [16]})
  broadcast = spec.initial_weights(0)
  # 64 x 16 + 16 + 16 x 10 + 10 = 1210 entries, 100 of them nonzero
  upload = [np.zeros(w.shape, np.float32) for w in broadcast]
  upload[0].flat[:100] = 1.0
  updates = str(tmp_path / "updates")
  UpdateStore(updates).write_round(1, broadcast, [(0, "client_0000", upload, 1.0, 1)], {
      "method": "fedsgd", "upload_kind": "gradient", "model": spec.to_json()})
  reads = []
  read = UpdateStore.read
  monkeypatch.setattr(UpdateStore, "read",
                      lambda self, *a, **k: reads.append(a) or read(self, *a, **k))
  # an int32 index and a float32 value per nonzero entry
  assert board.upload_sizes(updates, 1, "sparsification", {"p": 0.9}) == {
      "upload_bytes": 4 * 1210, "upload_bytes_encoded": 8 * 100}
  assert reads == [(1, 0)]  # the record is read once for both
  for defense, kwargs in ((None, {}), ("dp_clip", {"clip": 1.0})):
    assert board.upload_sizes(updates, 1, defense, kwargs) == {
        "upload_bytes": 4 * 1210, "upload_bytes_encoded": 4 * 1210}
  tiny = _adaptive_grid()
  rows = {r.entry: r for r in tiny.rows()}
  results = [{**_result(rows["FedSGD"], {"ig": 0.9}), "upload_bytes": 4840,
              "upload_bytes_encoded": 4840},
             {**_result(rows["Sparse"], {"ig": 0.3}), "upload_bytes": 4840,
              "upload_bytes_encoded": 800},
             _result(rows["Clip"], {"ig": 0.2})]  # a row from before: dense only
  table = report.table_rows(tiny, results)
  assert [r["upload_bytes_encoded"] for r in table] == [4840, 800, None]
  assert "upload_bytes_encoded" in report.COLUMNS
  lines = report.markdown(tiny, table).splitlines()
  # 4840 / 1024 = 4.7 KiB dense; 800 / 1024 = 0.8 KiB encoded
  assert next(x for x in lines if x.startswith("| FedSGD")).endswith("| 4.7 KiB |")
  assert next(x for x in lines if x.startswith("| Sparse")).endswith(
      "| 4.7 KiB (0.8 KiB encoded) |")
  assert next(x for x in lines if x.startswith("| Clip")).endswith("| 0.0 KiB |")


def test_a_grid_of_one_strength_per_entry_reports_one_table():
  single = grid.parse(_with(entries=[
      TINY["entries"][0], {**TINY["entries"][1], "sweep": {"noise_multiplier": [1.0]}}]))
  results = [_result(r, {"ig": s}, u) for r, s, u in zip(single.rows(), (0.9, 0.2),
                                                          (0.9, 0.6))]
  text = report.markdown(single, report.table_rows(single, results))
  titles = [line for line in text.splitlines() if line.startswith("## Every row")
            or line.startswith("## At each") or line.startswith("## Utility")]
  assert titles == ["## Every row, each entry at its default strength (P: on the "
                    "Pareto front of utility against leakage)"]
  assert "| LDP Gaussian (noise_multiplier=1) [P] |" in text  # no M: nothing matched
  swept = grid.parse(TINY)
  results = [_result(r, {"ig": 0.5}) for r in swept.rows()]
  text = report.markdown(swept, report.table_rows(swept, results))
  assert "## At each entry's default strength" in text and "## Utility-matched" in text


def _digits_client_data(indices: dict[str, list[int]], test: dict[str, list[int]]):
  """ClientData of the bundled 8x8 digits, as a TFF user builds it."""
  from tff_privacy.data import sources
  src = sources.load_digits()
  def build(x, y, chosen):
    return tff.simulation.datasets.TestClientData({
        c: collections.OrderedDict(x=x[i], y=y[i]) for c, i in chosen.items()})
  return build(src.x_train, src.y_train, indices), build(src.x_test, src.y_test, test)


CLIENT_DATA_GRID = {
    "protocol": {"dataset": "digits", "model": "mlp", "model_kwargs": {"hidden": [8]},
                 "clients_per_round": 3, "rounds": 1, "batch_size": 2},
    "attacks": {"inversion": ["ig"], "iterations": 2, "victims": 3, "attribute": None},
    "entries": [{"name": "FedSGD", "method": "fedsgd"}],
}


@pytest.mark.slow
def test_a_leaderboard_trains_on_the_clients_of_client_data(tmp_path):
  from tff_privacy.data import sources
  src = sources.load_digits()
  train = {"a": [0, 1, 2], "b": [3, 4], "c": [5, 6, 7, 8]}
  test = {"a": [0], "b": [1, 2]}
  train_data, test_data = _digits_client_data(train, test)
  out = str(tmp_path / "board")
  tiny = grid.parse(CLIENT_DATA_GRID)
  result, = board.run(tiny, out, progress=False, log=lambda _: None,
                      train_data=train_data, test_data=test_data)
  protocol = json.load(open(os.path.join(out, "grid.json")))["protocol"]
  assert protocol["partition"] == "client_data" and protocol["clients"] == 3
  run_dir = os.path.join(out, "rows", result["key"], "train")
  assert json.load(open(os.path.join(run_dir, "config.json")))["split_sha256"] == \
      protocol["split_sha256"]
  # FedSGD's one batch of each client: two of its own samples (the store
  # keeps them in the order used)
  truth = GroundTruthStore(os.path.join(run_dir, "ground_truth"))
  for k, name in enumerate("abc"):
    x, _ = truth.read(1, k)
    own = src.x_train[train[name]].reshape(len(train[name]), -1)
    assert len(x) == 2
    assert all(any(np.array_equal(s.ravel(), o) for o in own) for s in x)
  assert result["inversion"]["ig"]["label_accuracy"] >= 0

  logged = []
  again = board.run(grid.load(os.path.join(out, "grid.json")), out, progress=False,
                    log=logged.append, train_data=train_data, test_data=test_data)
  assert again == [result] and "cached" in logged[0]
  with pytest.raises(ValueError, match="give the clients' ClientData"):
    board.run(grid.load(os.path.join(out, "grid.json")), out, progress=False)
  other_train, _ = _digits_client_data({**train, "c": [5, 6, 7, 9]}, test)
  with pytest.raises(ValueError, match="holds a leaderboard with other protocol"):
    board.run(tiny, out, progress=False, train_data=other_train, test_data=test_data)


@pytest.mark.parametrize("change, message", [
    ({"attacks": {**CLIENT_DATA_GRID["attacks"], "attribute": "parity"}},
     "attacks attribute: 'parity' is not in ClientData"),
    ({"entries": [{"name": "A", "method": "fedsgd", "protocol": {"clients": 3}}]},
     "entry 'A' protocol: clients come from the ClientData"),
    ({"protocol": {**CLIENT_DATA_GRID["protocol"], "clients_per_round": 5}},
     "clients_per_round must be in [1, clients=3]"),
])
def test_a_grid_the_client_data_cannot_serve_is_refused_in_one_line(change, message):
  train_data, test_data = _digits_client_data({"a": [0, 1], "b": [2], "c": [3]},
                                              {"a": [0]})
  with pytest.raises(ValueError) as error:
    grid.with_client_data(grid.parse({**CLIENT_DATA_GRID, **change}),
                          train_data, test_data)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_the_clients_of_client_data_reach_a_rows_process_unchanged():
  """Rows in processes receive the clients pickled."""
  train_data, test_data = _digits_client_data({"a": [0, 1], "b": [2]}, {"a": [0]})
  _, federations = grid.with_client_data(grid.parse(CLIENT_DATA_GRID | {
      "protocol": {**CLIENT_DATA_GRID["protocol"], "clients_per_round": 2}}),
      train_data, test_data)
  federation, = federations.values()
  copy = pickle.loads(pickle.dumps(federation))
  assert copy.sha256() == federation.sha256()
  np.testing.assert_array_equal(copy.client_arrays(1)[0], federation.client_arrays(1)[0])


def test_each_row_reads_the_client_data_with_its_own_data_options(tmp_path, monkeypatch):
  from tff_privacy.data import sources
  raw = sources.load_digits().x_train[[0, 1, 2, 3]]
  train_data, test_data = _digits_client_data({"a": [0, 1], "b": [2, 3]}, {"a": [0]})
  both = grid.parse(CLIENT_DATA_GRID | {
      "protocol": {**CLIENT_DATA_GRID["protocol"], "clients_per_round": 2},
      "entries": [{"name": "Plain", "method": "fedsgd"},
                  {"name": "Normalised", "method": "fedsgd",
                   "protocol": {"data_kwargs": {"normalize": [[0.5], [0.25]]}}}]})
  on_clients, federations = grid.with_client_data(both, train_data, test_data)
  handed = {}
  def run(config, progress, federation):
    handed[config.out] = config, federation
    raise InterruptedError("trained no further")
  monkeypatch.setattr(runner, "run", run)
  for row in on_clients.rows():
    with pytest.raises(InterruptedError):
      board.run_row(row, on_clients, str(tmp_path), False, 1, federations)
  (plain, plain_fed), (normalised, normalised_fed) = handed.values()
  np.testing.assert_array_equal(plain_fed.source.x_train, raw)
  # (x - 0.5) / 0.25 of the [0, 1] digits
  np.testing.assert_allclose(normalised_fed.source.x_train, (raw - 0.5) * 4, atol=1e-6)
  # each config names the SHA-256 of the samples it trains on
  assert plain.split_sha256 == plain_fed.sha256() == on_clients.protocol["split_sha256"]
  assert normalised.split_sha256 == normalised_fed.sha256() != plain.split_sha256


def _write_json(path, value):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(value, f)


def test_a_row_trained_on_other_clients_than_it_reads_runs_again(tmp_path,
                                                                 monkeypatch):
  """Before each row read the ClientData with its own data options, the
  normalising rows trained on the plain samples and their config.json
  names the plain samples' SHA-256: such a row, finished or not, runs
  again in an emptied folder, saying why; the plain row stays cached."""
  train_data, test_data = _digits_client_data({"a": [0, 1], "b": [2, 3]}, {"a": [0]})
  normalise = {"data_kwargs": {"normalize": [[0.5], [0.25]]}}
  three = grid.parse(CLIENT_DATA_GRID | {
      "protocol": {**CLIENT_DATA_GRID["protocol"], "clients_per_round": 2},
      "entries": [{"name": "Plain", "method": "fedsgd"},
                  {"name": "Finished", "method": "fedsgd", "protocol": normalise},
                  {"name": "Unfinished", "method": "fedsgd", "protocol": normalise}]})
  on_clients, federations = grid.with_client_data(three, train_data, test_data)
  plain, finished, unfinished = on_clients.rows()
  old = on_clients.protocol["split_sha256"]  # the plain samples'
  for row in (plain, finished, unfinished):
    folder = tmp_path / "rows" / row.key
    _write_json(folder / board.SETTINGS_FILE, row.settings())
    _write_json(folder / "train" / "config.json", {"split_sha256": old})
    if row is not unfinished:
      _write_json(folder / board.ROW_FILE,
                  {**_result(row, {"ig": 0.5}), "settings": row.settings()})
  ran = {}
  def timed_row(row, grid, out, progress, jobs, federations):
    ran[row.key] = os.path.exists(os.path.join(out, "rows", row.key))
    return _result(row, {"ig": 0.4}), 1.0
  monkeypatch.setattr(board, "_timed_row", timed_row)
  logged = []
  board.run(three, str(tmp_path), progress=False, log=logged.append,
            train_data=train_data, test_data=test_data)
  now = federations[grid.data_key(finished)].sha256()
  assert now != old
  why = (f"its run trained on other clients (split_sha256 {old[:12]}; its data "
         f"options read {now[:12]}); running it again")
  assert logged[0].startswith("[1/3] Plain: cached")
  assert logged[1:] == [f"[2/3] Finished: {why}", f"[3/3] Unfinished: {why}",
                        "[2/3] Finished: running", "[2/3] Finished: done in 1 s",
                        "[3/3] Unfinished: running", "[3/3] Unfinished: done in 1 s"]
  assert ran == {finished.key: False, unfinished.key: False}  # folders emptied


def test_a_rows_process_receives_only_the_clients_it_reads(monkeypatch):
  """Each row's arguments are pickled to its process: of the federations,
  only the one its data options read."""
  from concurrent import futures
  two = grid.parse(CLIENT_DATA_GRID | {"entries": [
      {"name": "Plain", "method": "fedsgd"},
      {"name": "Normalised", "method": "fedsgd",
       "protocol": {"data_kwargs": {"normalize": [[0.5], [0.25]]}}}]})
  plain, normalised = two.rows()
  federations = {grid.data_key(plain): "plain clients",
                 grid.data_key(normalised): "normalised clients"}
  sent = {}

  class Pool:  # runs nothing: keeps what each row's process would receive
    def __init__(self, *args, **kwargs):
      pass

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      return False

    def submit(self, fn, row, *args):
      sent[row.key] = pickle.loads(pickle.dumps(args[-1]))
      done = futures.Future()
      done.set_result(({}, 0.0))
      return done

  monkeypatch.setattr(futures, "ProcessPoolExecutor", Pool)
  list(board._in_processes([(1, plain), (2, normalised)], two, "unused", 2,
                           federations))
  assert sent == {plain.key: {grid.data_key(plain): "plain clients"},
                  normalised.key: {grid.data_key(normalised): "normalised clients"}}


def test_a_run_refuses_clients_that_its_config_does_not_name(tmp_path):
  train_data, test_data = _digits_client_data({"a": [0, 1], "b": [2]}, {"a": [0]})
  config, federation = runner.with_client_data(
      runner.RunConfig(out=str(tmp_path / "r"), dataset="digits", model="mlp"),
      train_data, test_data)
  other, _ = _digits_client_data({"a": [0, 1], "b": [3]}, {"a": [0]})
  _, elsewhere = runner.with_client_data(config, other, test_data)
  for kwargs, message in [
      (dict(config=runner.RunConfig(out=config.out, dataset="digits", model="mlp"),
            federation=federation), "federation: its config is the one"),
      (dict(config=config, federation=elsewhere), "federation: its config is the one"),
      (dict(config=config, federation=federation, train_data=train_data,
            test_data=test_data), "federation: give it or train_data"),
  ]:
    with pytest.raises(ValueError, match=message):
      runner.run(progress=False, **kwargs)
  assert not os.path.exists(config.out)


def test_rows_made_by_other_code_are_named_in_the_log_and_the_report(tmp_path,
                                                                     monkeypatch):
  now = {"commit": "c" * 40, "dirty": False, "diff_sha256": None}
  edited = {**now, "dirty": True, "diff_sha256": "d" * 64}
  monkeypatch.setattr(provenance, "code_version", lambda: dict(now))
  tiny = grid.parse(TINY)
  rows = tiny.rows()
  results = [_result(row, dict.fromkeys(row.inversion, 0.5)) for row in rows]
  results[0][provenance.KEY] = [now]
  results[1][provenance.KEY] = [edited, now]  # results[2]: from before versions
  cached = {r["key"]: r for r in results}
  monkeypatch.setattr(board, "_cached", lambda row, out: cached[row.key])
  logged = []
  board.run(tiny, str(tmp_path), progress=False, log=logged.append)
  assert logged == [
      f"[1/3] {rows[0].label}: cached",
      f"[2/3] {rows[1].label}: cached (made partly by commit cccccccccccc with "
      "uncommitted changes (diff sha256 dddddddddddd), partly by the code now "
      "(commit cccccccccccc))",
      f"[3/3] {rows[2].label}: cached (made by an unrecorded code version; the "
      "code now is commit cccccccccccc)"]
  text = report.markdown(tiny, report.table_rows(tiny, results))
  section = text.split("## Rows made by other code")[1].split("##")[0]
  items = [line for line in section.splitlines() if line.startswith("- ")]
  assert items == [
      f"- {rows[1].label} (rows/{rows[1].key}): made partly by commit "
      "cccccccccccc with uncommitted changes (diff sha256 dddddddddddd), partly "
      "by the code now (commit cccccccccccc)",
      f"- {rows[2].label} (rows/{rows[2].key}): made by an unrecorded code "
      "version; the code now is commit cccccccccccc"]
  assert "- tff_privacy code: commit cccccccccccc\n" in text


def test_without_a_known_code_version_no_row_is_called_other_code(tmp_path,
                                                                   monkeypatch):
  monkeypatch.setattr(provenance, "code_version", lambda: dict(provenance.UNKNOWN))
  tiny = grid.parse(TINY)
  rows = tiny.rows()
  results = [_result(row, dict.fromkeys(row.inversion, 0.5)) for row in rows]
  results[0][provenance.KEY] = [dict(provenance.UNKNOWN)]
  results[1][provenance.KEY] = [{"commit": "c" * 40, "dirty": False,
                                 "diff_sha256": None}]  # results[2]: unrecorded
  cached = {r["key"]: r for r in results}
  monkeypatch.setattr(board, "_cached", lambda row, out: cached[row.key])
  logged = []
  board.run(tiny, str(tmp_path), progress=False, log=logged.append)
  assert logged == [f"[{i}/3] {row.label}: cached" for i, row in enumerate(rows, 1)]
  text = report.markdown(tiny, report.table_rows(tiny, results))
  assert "## Rows made by other code" not in text
  assert "- tff_privacy code: an unknown code version (not a git checkout)\n" in text


@pytest.mark.parametrize("by_iterations,converged", [
    ({"75": 0.50, "150": 0.60, "300": 0.63}, False),  # +0.03 over the last half
    ({"75": 0.50, "150": 0.60, "300": 0.615}, True),
    ({"3": 0.2, "6": 0.9, "12": 0.9}, True), (None, None)])
def test_an_attack_still_improving_over_its_last_half_has_not_converged(
    by_iterations, converged):
  assert report.attack_converged(by_iterations) is converged


def test_rows_whose_attack_had_not_converged_are_named_as_lower_bounds():
  tiny = _adaptive_grid()
  rows = {r.entry: r for r in tiny.rows()}
  still = _result(rows["FedSGD"], {"ig": 0.63})
  still["inversion"]["ig"]["ssim_by_iterations"] = {"75": 0.5, "150": 0.6, "300": 0.63}
  done = _result(rows["Clip"], {"ig": 0.2})
  done["inversion"]["ig"]["ssim_by_iterations"] = {"75": 0.2, "150": 0.2, "300": 0.2}
  table = report.table_rows(tiny, [still, done])
  assert [r["attack_converged"] for r in table] == [False, True]
  text = report.markdown(tiny, table)
  lower = text.split("## Leakage that is a lower bound")[1].split("##")[0]
  assert "- FedSGD, ig: SSIM 0.500 after 75, 0.600 after 150, 0.630 after 300" in lower
  assert "Clip" not in lower


def test_audited_rows_have_their_audit_columns_and_table():
  tiny = _adaptive_grid()
  rows = {r.entry: r for r in tiny.rows()}
  clip = _result(rows["Clip"], {"ig": 0.2})
  clip["privacy"] = {"epsilon": 40.0, "delta": 1e-5, "relation": "local DP: any two"}
  clip["audit"] = {
      "epsilon_claimed": 2.5, "epsilon_lower_bound": 3.1, "epsilon_interval": [3.1, None],
      "confidence": 0.95, "canaries": 1000, "claim_refuted": True,
      "unit": "one upload", "applied_to": "one upload",
      "canary_audit": {"computed": True, "epsilon_reachable": 5.31}, "mia_auc": 0.52,
      "membership_inference": {"computed": True, "best_attack": "knn",
                               "mia_auc_ci": [0.5, 0.54]}}
  plain = _result(rows["FedSGD"], {"ig": 0.9})
  plain["audit"] = {"epsilon_claimed": None, "epsilon_lower_bound": None,
                    "canary_audit": {"computed": False, "reason": "no defence here"},
                    "mia_auc": None, "membership_inference": {
                        "computed": False, "reason": "no global model"}}
  sparse = _result(rows["Sparse"], {"ig": 0.5})  # not audited
  table = {r["entry"]: r for r in report.table_rows(tiny, [clip, plain, sparse])}
  assert (table["Clip"]["epsilon_audited"], table["Clip"]["claim_refuted"],
          table["Clip"]["mia_auc"]) == (3.1, True, 0.52)
  assert not table["Sparse"]["audited"]
  text = report.markdown(tiny, list(table.values()))
  audits = text.split("## Audits")[1].split("\n## ")[0]
  assert ("| Clip | 40 (one upload) | upload | 2.5 | 3.10 [3.10, unbounded] of 5.31 "
          "(1000 canaries) | **refuted** | 0.520 [0.500, 0.540] (knn) |") in audits
  assert ("| FedSGD | none |  | none | not audited: no defence here |  | "
          "not computed: no global model |") in audits
  assert "Sparse" not in audits
  assert "## Audits" not in report.markdown(tiny, [table["Sparse"]])


def test_auditing_a_leaderboard_audits_each_row_not_audited_yet(tmp_path, monkeypatch):
  from tff_privacy.audit import report as audits
  tiny = _adaptive_grid()
  rows = {r.entry: r for r in tiny.rows()}
  done, fresh = _result(rows["Clip"], {"ig": 0.2}), _result(rows["FedSGD"], {"ig": 0.9})
  older = _result(rows["Sparse"], {"ig": 0.5})
  done["audit"], fresh["audit"] = {"format": 2, "mia_auc": 0.5}, None
  older["audit"] = {"mia_auc": 0.5}  # format 1: before the methods' own audits
  monkeypatch.setattr(board, "read", lambda out: (tiny, [done, fresh, older]))
  calls = []
  monkeypatch.setattr(audits, "audit_run", lambda run, *args: calls.append((run, args)))
  board.audit(str(tmp_path), 300, 200, log=lambda line: None)
  assert calls == [(os.path.join(str(tmp_path), "rows", r["key"], "train"), (300, 200, 0))
                   for r in (fresh, older)]


def test_the_equal_epsilon_rows_have_one_table_per_unit_their_epsilon_protects():
  """Rows calibrated to epsilon 8 leave the main tables, the Pareto front
  and the utility match for tables of their own, one per unit protected,
  naming each row's relation; an entry no strength brings to epsilon 8,
  and a model below 0.9 x the reference's utility (0.9 x 0.9 = 0.81), say
  so."""
  upload = "local DP: any two uploads of one client are neighbours"
  client = "central DP, user level: replacing one client's data"
  laplace = "entry 'LDP Laplace': no strength in [1e-10, 1e+10] reaches epsilon 8"
  parsed = grid.parse(_with(equal_epsilon={"epsilon": 8}, entries=[
      *TINY["entries"],
      {"name": "DP-FedAvg", "method": "fedavg", "defense": "dp_fedavg",
       "defense_kwargs": {"clip": 1.0}, "sweep": {"noise_multiplier": [1.0]}},
      {"name": "LDP Laplace", "method": "fedsgd", "defense": "ldp_laplace",
       "defense_kwargs": {"clip": 1.0}, "sweep": {"noise_multiplier": [1.0]}}]))
  calibrated = dataclasses.replace(parsed, calibration={
      "LDP Gaussian": {"strength": 5.7, "epsilon": 8.01, "delta": 1e-5, "relation": upload},
      "DP-FedAvg": {"strength": 1.5, "epsilon": 8.0, "delta": 1e-5, "relation": client},
      "LDP Laplace": {"strength": None, "error": laplace, "relation": upload}})
  # (utility, SSIM): the equal-epsilon DP-FedAvg row would dominate every
  # other row and be the utility match of its entry (|0.95 - 0.81| < |0.6 - 0.81|)
  made = {"fedsgd": (0.9, 0.9), "ldp-gaussian__noise-multiplier-0.01": (0.85, 0.8),
          "ldp-gaussian__noise-multiplier-1": (0.5, 0.3),
          "dp-fedavg__noise-multiplier-1": (0.6, 0.4),
          "ldp-laplace__noise-multiplier-1": (0.3, 0.2),
          "ldp-gaussian__eps-8": (0.7, 0.25), "dp-fedavg__eps-8": (0.95, 0.05)}
  rows = {r.key: r for r in calibrated.rows()}
  assert list(rows) == list(made)
  results = []
  for key, (utility, ssim) in made.items():
    results.append(_result(rows[key], {"ig": ssim}, utility))
    if rows[key].equal_epsilon:
      entry = calibrated.calibration[rows[key].entry]
      results[-1]["privacy"] = {k: entry[k] for k in ("epsilon", "delta", "relation")}
  table = {r["key"]: r for r in report.table_rows(calibrated, results)}
  assert {k for k, r in table.items() if r["equal_epsilon"] == 8.0} == {
      "ldp-gaussian__eps-8", "dp-fedavg__eps-8"}
  assert all(table[k]["equal_delta"] is None for k in list(made)[:5])
  assert {"equal_epsilon", "equal_delta"} < set(report.COLUMNS)
  assert [k for k, r in table.items() if r["pareto"]] == list(made)[:5]
  assert [k for k, r in table.items() if r["matched"]] == [
      "ldp-gaussian__noise-multiplier-0.01", "dp-fedavg__noise-multiplier-1",
      "ldp-laplace__noise-multiplier-1"]

  text = report.markdown(calibrated, list(table.values()))
  main, equal = text.split("## At equal privacy: epsilon 8 (delta 1e-05)\n")
  assert "at epsilon 8" not in main
  upload_part, client_part = equal.split("### Protecting a client's data\n")
  assert "### Protecting one upload\n" in upload_part
  assert ("| LDP Gaussian | noise_multiplier=5.7 | 8.01 (1e-05) | R1 | 0.7000 | "
          "0.250 (ig) | n/a | not usable (utility below 0.8100) |") in upload_part
  assert f"- R1: {upload}\n" in upload_part
  assert f"- LDP Laplace: no row at epsilon 8: {laplace}\n" in upload_part
  assert ("| DP-FedAvg | noise_multiplier=1.5 | 8 (1e-05) | R1 | 0.9500 | "
          "0.050 (ig) | n/a | usable |") in client_part
  assert f"- R1: {client}\n" in client_part and "LDP" not in client_part.split("##")[0]


def test_an_attack_searches_its_victims_together_where_one_search_serves_all():
  attacks = {"iterations": 300}
  assert board.attack_settings("ig", attacks, [1] * 16) == {"iterations": 300,
                                                           "group_size": 16}
  assert board.attack_settings("ig_masked", attacks, [1, 1]) == {"iterations": 300,
                                                                "group_size": 2}
  # uploads of several images: searched one at a time
  assert board.attack_settings("ig", attacks, [20, 20]) == {"iterations": 300}
  assert board.attack_settings("ig", attacks, [20, 25]) == {"iterations": 300}
  # an attack that searches one record at a time
  assert board.attack_settings("ig_hyperfl", attacks, [1, 1]) == {"iterations": 300}


def test_source_iterations_leave_each_attack_its_own_default():
  from tff_privacy.leaderboard import defaults
  full = grid.parse(defaults.grid("full"))
  assert full.attacks["iterations"] == "source"
  assert board.attack_settings("ig", full.attacks, [1, 2]) == {}
  # the attacks' documented source counts: inversefed's 4,800 and DLG's
  # 300 steps of up to 20 L-BFGS iterations
  assert attacks_package.attack_class("ig").PARAMETERS["iterations"].default == 4800
  assert attacks_package.attack_class("idlg").PARAMETERS["iterations"].default == 6000
  with pytest.raises(ValueError, match="iterations: an integer >= 1 or 'source'"):
    grid.parse({"attacks": {"iterations": "many"},
                "entries": [{"name": "FedSGD", "method": "fedsgd"}]})


def test_every_row_trains_under_each_protocol_with_each_seed():
  two = grid.parse(_with(seeds=2, protocols=[
      {"name": "CNN, batch 8", "model": "cnn", "model_kwargs": {}, "batch_size": 8},
      {"name": "MLP"}]))
  rows = {r.key: r for r in two.rows()}
  first = rows["cnn-batch-8__fedsgd"]
  assert first.protocol["model"] == "cnn" and first.protocol["batch_size"] == 8
  assert first.protocol["seed"] == 1 and first.protocol_name == "CNN, batch 8"
  second = rows["cnn-batch-8__fedsgd__seed-1"]
  assert second.protocol["seed"] == 2 and second.replicate == 1
  assert second.base_key == first.key and second.label == first.label
  # the grid's own protocol where a change leaves it
  assert rows["mlp__fedsgd"].protocol == {**TINY["protocol"]}
  # 2 protocols x 3 rows x 2 seeds
  assert len(rows) == 12
  assert second.settings() != first.settings()
  # one protocol, one seed: the folders of before
  assert [r.key for r in grid.parse(TINY).rows()] == [
      "fedsgd", "ldp-gaussian__noise-multiplier-0.01", "ldp-gaussian__noise-multiplier-1"]


def test_the_built_in_protocols_are_the_analytic_regime_and_a_cnn_at_batch_1_and_8():
  from tff_privacy.leaderboard import defaults
  assert grid.parse(defaults.grid("compact")).protocols is None
  cnn = grid.parse(defaults.grid("cnn"))
  assert [(p["model"], p["batch_size"]) for p in cnn.protocols] == [("cnn", 1), ("cnn", 8)]
  # a CNN's uploads take IG longer to converge than the MLP's
  assert (cnn.attacks["iterations"], grid.parse(defaults.grid("compact")).attacks[
      "iterations"]) == (1000, 300)
  full = grid.parse(defaults.grid("full"))
  assert [(p["model"], p["batch_size"]) for p in full.protocols] == [
      ("mlp", 1), ("cnn", 1), ("cnn", 8)]
  assert full.seeds == 3


def test_entries_can_be_chosen_and_the_reference_stays():
  tiny = grid.parse(TINY)
  kept = grid.only(tiny, ["LDP Gaussian"])
  assert [e["name"] for e in kept.entries] == ["FedSGD", "LDP Gaussian"]
  assert [e["name"] for e in grid.only(tiny, ["FedSGD"]).entries] == ["FedSGD"]
  with pytest.raises(ValueError, match="--entries: 'Nope' is not an entry"):
    grid.only(tiny, ["Nope"])


def test_a_rows_seeds_are_one_row_of_the_report_with_pooled_numbers():
  two = grid.parse(_with(seeds=2, protocols=[{"name": "A"}, {"name": "B"}]))
  rows = {r.key: r for r in two.rows()}
  results = []
  for key, ssims, utility in (("a__fedsgd", [0.2, 0.4], 0.8),
                              ("a__fedsgd__seed-1", [0.6, 0.8], 0.6),
                              ("b__fedsgd", [0.1, 0.3], 0.9)):
    r = _result(rows[key], {"ig": float(np.mean(ssims))}, utility)
    r["inversion"]["ig"]["victims"] = {"clients": [0, 1], "ssim": ssims,
                                       "psnr": [10 * v for v in ssims]}
    r["samples_tested"] = 100
    results.append(r)
  table = report.table_rows(two, results)
  assert [(x["protocol"], x["key"], x["seeds"]) for x in table] == [
      ("A", "a__fedsgd", 2), ("B", "b__fedsgd", 1)]
  pooled = table[0]
  # 80 + 60 right of 200; the four victims' mean SSIM
  assert pooled["utility"] == pytest.approx(0.7)
  assert pooled["ssim"] == pytest.approx(0.5) and pooled["victims"] == 4
  assert pooled["ssim_ci"][0] <= 0.5 <= pooled["ssim_ci"][1]
  # each protocol is its own reference and its own Pareto front
  assert table[0]["pareto"] and table[1]["pareto"]
  text = report.markdown(two, table)
  assert "## Protocol: A" in text and "## Protocol: B" in text
  assert "2 seeds per row" in text
  assert report.ANALYTIC_REGIME not in text  # batch 2 is not the analytic regime
  analytic = grid.parse(_with(protocol={**TINY["protocol"], "batch_size": 1}))
  assert report.ANALYTIC_REGIME in report.markdown(analytic, [])


def test_each_protocol_has_its_figures_and_its_verdicts_name_the_seeds(tmp_path):
  two = grid.parse(_with(seeds=2, protocols=[{"name": "A"}, {"name": "B b"}]))
  rows = {r.key: r for r in two.rows()}
  results = [_result(rows[key], {"ig": 0.5}) for key in (
      "a__fedsgd", "a__ldp-gaussian__noise-multiplier-1", "b-b__fedsgd")]
  for r in results:
    os.makedirs(tmp_path / r["inversion"]["ig"]["folder"])
    np.savez(tmp_path / r["inversion"]["ig"]["folder"] / "reconstructions.npz",
             original=np.zeros((2, 28, 28, 1), np.float32),
             reconstructed=np.ones((2, 28, 28, 1), np.float32))
  report.write(two, results, str(tmp_path))
  assert report.figures("B b") == ("tradeoff_b-b.png", "reconstructions_b-b.png",
                                   "asr_b-b.png")
  for name in ("A", "B b"):
    assert all((tmp_path / f).exists() for f in report.figures(name))
  text = (tmp_path / "report.md").read_text()
  verdicts = text.split("## Verdicts (A)")[1]
  assert "2 seeds per row" in verdicts.split("\n\n")[1]
  # one seed of two finished: the table says so
  assert "| FedSGD [P] (1 of 2 seeds) |" in text
  with pytest.raises(ValueError, match=r"results of rows \['nope'\] are not rows"):
    report.write(two, [dict(results[0], key="nope")], str(tmp_path))


def test_entries_run_alone_and_the_folder_keeps_the_whole_grid(tmp_path, monkeypatch):
  tiny = grid.parse(TINY)
  ran = []
  monkeypatch.setattr(board, "_timed_row",
                      lambda row, *a, **k: (ran.append(row.key) or {}, 0.0))
  board.run(tiny, str(tmp_path), progress=False, log=lambda _: None,
            entries=["FedSGD"])
  assert ran == ["fedsgd"]
  assert grid.load(str(tmp_path / "grid.json")) == tiny
  with pytest.raises(ValueError, match="--entries: 'Nope'"):
    board.run(tiny, str(tmp_path), progress=False, log=lambda _: None,
              entries=["Nope"])


def test_the_command_line_sets_the_equal_epsilon_target():
  tiny = grid.parse(TINY)
  assert grid.with_equal_epsilon(tiny, 8.0).equal_epsilon == {"epsilon": 8.0,
                                                              "delta": 1e-5}
  at_two = grid.parse(_with(equal_epsilon={"epsilon": 1, "delta": 1e-6}))
  assert grid.with_equal_epsilon(at_two, 3.0).equal_epsilon == {"epsilon": 3.0,
                                                                "delta": 1e-6}
  assert grid.with_equal_epsilon(at_two, False).equal_epsilon is None
  with pytest.raises(SystemExit):
    cli.main(["leaderboard", "--out", "unused", "--equal-epsilon", "-1"])


def test_a_model_is_usable_or_not_only_beyond_its_utility_interval():
  at = {"utility": 0.728, "utility_ci": [0.6996, 0.7547]}
  # 0.9 x 0.811: inside the interval, so neither is claimed
  assert report._usable(at, 0.7299) == (
      "usable or not within its interval (which holds 0.7299)")
  assert report._usable(dict(at, utility_ci=[0.73, 0.75]), 0.7299) == "usable"
  assert report._usable(dict(at, utility_ci=[0.70, 0.7298]), 0.7299) == (
      "not usable (utility below 0.7299)")
  assert report._usable(dict(at, utility_ci=None), 0.7299) == (
      "not usable (utility below 0.7299)")


def test_a_target_set_before_in_the_folder_stays(tmp_path):
  tiny = grid.parse(TINY)
  assert board.with_recorded_target(tiny, str(tmp_path)) == tiny  # no folder yet
  at_eight = grid.with_equal_epsilon(tiny, 8.0)
  io_path = tmp_path / "grid.json"
  io_path.write_text(json.dumps(at_eight.to_json()))
  assert board.with_recorded_target(tiny, str(tmp_path)).equal_epsilon == {
      "epsilon": 8.0, "delta": 1e-5}
  # a grid.json from before the target was kept records none
  old = {k: v for k, v in at_eight.to_json().items() if k != "equal_epsilon"}
  io_path.write_text(json.dumps(old))
  assert board.with_recorded_target(tiny, str(tmp_path)).equal_epsilon is None
