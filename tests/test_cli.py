"""The `tff-privacy` command end to end, in subprocesses as a user runs it."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from conftest import worker_children

CLI = [os.path.join(os.path.dirname(sys.executable), "tff-privacy")]
SMALL = ["--dataset", "digits", "--model", "mlp", "--model-kwargs",
         '{"hidden": [16]}', "--clients", "4", "--batch-size", "8", "--seed", "1",
         "--quiet"]


def _train(out, *extra, **kwargs):
  return subprocess.run(CLI + ["train", "--out", str(out)] + SMALL + list(extra),
                        capture_output=True, text=True, timeout=300, **kwargs)


def _orphaned_workers(since: float) -> list[int]:
  return [p.pid for p in psutil.process_iter(["name", "ppid", "create_time"])
          if p.info["name"] == "worker_binary" and p.info["ppid"] == 1
          and p.info["create_time"] >= since]


def _metrics(out):
  with open(os.path.join(out, "metrics.json")) as f:
    return [{k: v for k, v in m.items() if k != "seconds"} for m in json.load(f)]


def test_train_through_a_pipe_finishes_and_leaves_no_worker(tmp_path):
  start = time.time()
  # capture_output pipes stdout: a worker that kept it open would hang this.
  result = _train(tmp_path, "--method", "fedsgd", "--rounds", "2",
                  "--capture-rounds", "1")
  assert result.returncode == 0, result.stderr
  assert "test_accuracy=" in result.stdout and str(tmp_path) in result.stdout
  for name in ("metrics.json", "config.json", "updates/manifest.json",
               "updates/round_0001/client_0000.npz", "ground_truth/manifest.json"):
    assert os.path.exists(tmp_path / name), name
  assert not _orphaned_workers(start)


def test_kill_9_mid_run_then_rerun_resumes_to_identical_metrics(tmp_path):
  args = ["--method", "fedavg", "--rounds", "6"]
  reference = tmp_path / "reference"
  assert _train(reference, *args).returncode == 0

  killed = tmp_path / "killed"
  proc = subprocess.Popen(CLI + ["train", "--out", str(killed)] + SMALL + args,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 240
  while time.time() < deadline:
    try:
      if len(_metrics(killed)) >= 3:
        break
    except (FileNotFoundError, json.JSONDecodeError):
      pass
    time.sleep(0.2)
  workers = worker_children(proc.pid)
  assert workers, "the CLI should have started a TFF worker"
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  gone, alive = psutil.wait_procs(workers, timeout=15)
  assert not alive, "the TFF worker outlived its SIGKILLed parent"
  assert len(_metrics(killed)) < 6

  result = _train(killed, *args)
  assert result.returncode == 0, result.stderr
  assert _metrics(killed) == _metrics(reference)


@pytest.mark.parametrize("extra,message", [
    (["--partition", "dirichlet", "--alpha", "0"], "alpha must be > 0"),
    (["--rounds", "2", "--capture-rounds", "5"], "capture_rounds must lie in"),
    (["--defense", "ldp_gaussian", "--clip", "1", "--sparsity", "0.5"],
     "--sparsity does not apply to --defense ldp_gaussian"),
    (["--defense", "sparsification", "--sparsity", "1.5"], "p must lie in [0, 1)"),
    (["--defense", "soteria", "--prune-rate", "1.0"], "p must lie in [0, 1)"),
    (["--defense", "ldp_fed", "--cldp-alpha", "0"], "alpha must be > 0"),
    (["--method", "fedsgd", "--perturb-steps", "3"],
     "--perturb-steps apply to --method fedem only"),
    (["--method", "fedem", "--rho-min", "0.5", "--rho-max", "0.1"],
     "rho_min must lie in [0, rho_max=0.1]"),
])
def test_bad_values_exit_2_naming_the_parameter(tmp_path, extra, message):
  result = _train(tmp_path, *extra)
  assert result.returncode == 2
  assert message in result.stderr


def test_fedem_flags_reach_the_method(tmp_path):
  result = _train(tmp_path, "--method", "fedem", "--rounds", "1",
                  "--perturb-steps", "2", "--rho-max", "0.05", "--perturb-norm", "l2",
                  "--capture-rounds", "1")
  assert result.returncode == 0, result.stderr
  with open(os.path.join(tmp_path, "updates", "manifest.json")) as f:
    manifest = json.load(f)
  protocol = manifest["run"]["protocol"]
  assert (protocol["perturb_steps"], protocol["rho_max"], protocol["norm"]) == (
      2, 0.05, "l2")


def test_unknown_method_is_rejected_by_the_parser(tmp_path):
  result = _train(tmp_path, "--method", "bogus")
  assert result.returncode == 2
  assert "invalid choice: 'bogus'" in result.stderr


def test_attack_command_writes_scores_and_figure(tmp_path):
  run = tmp_path / "run"
  trained = subprocess.run(
      CLI + ["train", "--out", str(run), "--method", "fedsgd", "--dataset",
             "digits", "--model", "lenet", "--clients", "3", "--partition",
             "one_per_client", "--batch-size", "1", "--rounds", "1",
             "--capture-rounds", "1", "--quiet"],
      capture_output=True, text=True, timeout=300)
  assert trained.returncode == 0, trained.stderr
  out = tmp_path / "attack"
  result = subprocess.run(
      CLI + ["attack", "--updates", str(run / "updates"), "--round", "1",
             "--client", "all", "--attack", "idlg", "--iterations", "200",
             "--out", str(out)], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  with open(out / "attack.json") as f:
    report = json.load(f)
  assert report["clients"] == [0, 1, 2] and len(report["samples"]) == 3
  for sample in report["samples"]:
    assert {"mse", "psnr", "ssim", "recovered_label", "true_label"} <= set(sample)
  assert report["mean"]["ssim"] > 0.9  # undefended single-sample gradients leak
  assert report["lpips"].startswith("not computed") and "lpips" not in report["mean"]
  assert "lpips: not computed" in result.stdout
  assert (out / "reconstructions.png").stat().st_size > 1000
  with np.load(out / "reconstructions.npz") as arrays:
    assert arrays["original"].shape == arrays["reconstructed"].shape == (3, 8, 8, 1)
    mse = ((arrays["original"] - arrays["reconstructed"]) ** 2).mean(axis=(1, 2, 3))
  np.testing.assert_allclose(mse, [s["mse"] for s in report["samples"]], rtol=1e-4)
  wrong = subprocess.run(
      CLI + ["attack", "--updates", str(run / "updates"), "--round", "1",
             "--attack", "dlg", "--tv-weight", "0.1", "--out", str(out)],
      capture_output=True, text=True, timeout=300)
  assert wrong.returncode == 2 and "--tv-weight does not apply" in wrong.stderr
