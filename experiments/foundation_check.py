"""Measures the foundation's acceptance numbers with the `tff-privacy` CLI.

1. FedAvg on mnist5k, 10 clients, 20 rounds, IID and Dirichlet(alpha=0.5):
   final test accuracy.
2. The IID run again, killed with SIGKILL once round `--kill-after` is in
   metrics.json, then re-run with the same command: does it resume, and is the
   final metrics.json (timing fields aside) identical to the uninterrupted run?
3. After every command: is any TFF worker_binary left whose parent died?

  python experiments/foundation_check.py --out results/foundation_check
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the CUDA plugin lines

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time

import psutil

CLI = os.path.join(os.path.dirname(sys.executable), "tff-privacy")
COMMON = ["train", "--method", "fedavg", "--dataset", "mnist5k", "--model", "cnn",
          "--clients", "10", "--rounds", "20", "--batch-size", "32", "--seed", "0",
          "--quiet"]


def metrics(out: str) -> list[dict]:
  try:
    with open(os.path.join(out, "metrics.json")) as f:
      return json.load(f)
  except (FileNotFoundError, json.JSONDecodeError):
    return []


def without_timing(history: list[dict]) -> list[dict]:
  return [{k: v for k, v in m.items() if k != "seconds"} for m in history]


def orphans(since: float) -> list[int]:
  return [p.pid for p in psutil.process_iter(["name", "ppid", "create_time"])
          if p.info["name"] == "worker_binary" and p.info["ppid"] == 1
          and p.info["create_time"] >= since]


def train(out: str, *extra: str) -> float:
  start = time.perf_counter()
  subprocess.run([CLI, *COMMON, "--out", out, *extra], check=True,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="results/foundation_check")
  parser.add_argument("--kill-after", type=int, default=10)
  args = parser.parse_args()
  shutil.rmtree(args.out, ignore_errors=True)
  since = time.time()
  rows = []
  for name, extra in [("iid", []), ("dirichlet", ["--partition", "dirichlet",
                                                   "--alpha", "0.5"])]:
    out = os.path.join(args.out, f"fedavg_{name}")
    seconds = train(out, *extra)
    rows.append((name, metrics(out)[-1]["test_accuracy"], seconds))

  killed = os.path.join(args.out, "fedavg_iid_killed")
  proc = subprocess.Popen([CLI, *COMMON, "--out", killed],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  while len(metrics(killed)) < args.kill_after and proc.poll() is None:
    time.sleep(0.1)
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  rounds_at_kill = len(metrics(killed))
  time.sleep(2)  # the kernel signals the worker; give it a moment to exit
  orphans_after_kill = orphans(since)
  train(killed)
  same = without_timing(metrics(killed)) == without_timing(
      metrics(os.path.join(args.out, "fedavg_iid")))

  print("| partition | final test accuracy | wall seconds |")
  print("|---|---|---|")
  for name, acc, seconds in rows:
    print(f"| {name} | {acc:.4f} | {seconds:.1f} |")
  print(f"killed after round {rounds_at_kill}; resumed run's metrics.json equals "
        f"the uninterrupted run's (timing aside): {same}")
  print(f"orphaned workers right after SIGKILL: {orphans_after_kill or 'none'}; "
        f"at the end: {orphans(since) or 'none'}")
  sys.exit(0 if same and not orphans(since) else 1)


if __name__ == "__main__":
  main()
