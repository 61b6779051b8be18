"""Wall time of one FedAvg round of the HyperFL paper's MNIST setting here,
relative to the HyperFL authors' PyTorch code doing the same round on the
same machine, each in a process of its own, with each one's peak memory.

The setting: 20 clients of 150 samples (mnist5k, HyperFL's label-group
split; round 1's clients, their samples written once for both sides), 5
local epochs of batch 50, SGD at lr 0.02 with momentum 0.5 and weight decay
5e-4, the paper's 117k-parameter CNN (`hyperfl_cnn` here, their
`CNN_FMNIST`). Here the round is `tff-privacy train --method fedavg`'s
(TFF's FedAvg through its worker, no capture or evaluation). The baseline
is `authors_fedavg_round.py`, run by the Python of the PyTorch virtualenv
that `make venv-torch` builds (their pinned torch 2.0.1 and what their
`cnn/` code imports), on a clone of their code (`--authors-code`: the
repository Pengxin-Guo/HyperFL); it skips their per-client evaluation, as
this round has none (see that script).

Each side runs one warm-up round, then `--rounds` timed ones; the two
processes alternate `--repeats` times, since on 2 cores one process's
rounds can run 30% slower than the next one's. Each repeat prints both
medians and their ratio; the summary gives `ratio_tff_over_authors=` (the
median over the repeats, with its smallest and largest) and
`peak_rss_mb_<side>=` (the largest process-tree resident size).

  python benchmarks/hyperfl_authors_fedavg.py --authors-code DIR
      [--torch-python PYTHON] [--torch-threads 4]
      [--rounds 3] [--repeats 3] [--limit-mb 12000]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import dataclasses
import statistics
import subprocess
import tempfile

import numpy as np

import round_timing  # this folder's
from tff_privacy import runner, runtime
from tff_privacy.cli import _positive_int

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_PYTHON = os.path.join(os.path.dirname(HERE), ".venv-torch", "bin", "python")
AUTHORS_FILE = os.path.join("cnn", "methods", "fedavg.py")
CLIENTS, SAMPLES, BATCH, EPOCHS = 20, 150, 50, 5


def config() -> runner.RunConfig:
  return runner.RunConfig(
      out="unused", method="fedavg", dataset="mnist5k", model="hyperfl_cnn",
      clients=CLIENTS, batch_size=BATCH, partition="label_groups",
      samples_per_client=SAMPLES, seed=0,
      method_kwargs=dict(local_epochs=EPOCHS, client_learning_rate=0.02,
                         client_momentum=0.5, weight_decay=5e-4))


def write_clients(path: str) -> None:
  """Round 1's clients' samples, x0, y0, x1, ..., for the PyTorch side."""
  with tempfile.TemporaryDirectory() as tmp:
    run = runner.Run(dataclasses.replace(config(), out=tmp))
    clients = run.round_data(1)
    arrays = {}
    for c, client in enumerate(clients):
      arrays[f"x{c}"] = np.asarray(client.x, np.float32)
      arrays[f"y{c}"] = np.asarray(client.y, np.int64)
  np.savez(path, **arrays)


def authors_round(args, clients_file: str) -> tuple[list[float], int]:
  """(seconds of each timed round, peak tree RSS) of the authors' code."""
  return round_timing.measured(
      os.path.join(HERE, "authors_fedavg_round.py"),
      ["--authors-code", args.authors_code, "--clients-file", clients_file,
       "--rounds", str(args.rounds), "--threads", str(args.torch_threads),
       "--batch-size", str(BATCH), "--local-epochs", str(EPOCHS)],
      args.limit_mb, "the authors' round", python=args.torch_python)


def tff_round(args) -> tuple[list[float], int]:
  return round_timing.measured(__file__, ["--time-tff", "--rounds", str(args.rounds)],
                               args.limit_mb, "the TFF round")


def _checked(parser: argparse.ArgumentParser, args) -> None:
  if not os.path.isfile(os.path.join(args.authors_code, AUTHORS_FILE)):
    parser.error(f"--authors-code: {args.authors_code!r} has no {AUTHORS_FILE}; "
                 "give a clone of the HyperFL authors' repository")
  probe = subprocess.run([args.torch_python, "-c", "import torch, opacus, cvxpy"],
                         capture_output=True) if os.path.isfile(args.torch_python) else None
  if probe is None or probe.returncode:
    parser.error(f"--torch-python: {args.torch_python!r} is not a Python with torch, "
                 "opacus and cvxpy; run `make venv-torch`")


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--authors-code", help="a clone of Pengxin-Guo/HyperFL")
  parser.add_argument("--torch-python", default=TORCH_PYTHON,
                      help="the PyTorch virtualenv's Python (make venv-torch)")
  parser.add_argument("--torch-threads", type=_positive_int, default=4,
                      help="torch.set_num_threads of the authors' side "
                           "(their federated_main.py sets 4)")
  parser.add_argument("--rounds", type=_positive_int, default=3)
  parser.add_argument("--repeats", type=_positive_int, default=3,
                      help="alternations of the two sides' processes")
  parser.add_argument("--limit-mb", type=_positive_int, default=12000,
                      help="kill a side's process tree above this resident size")
  parser.add_argument("--time-tff", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--times-file", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.time_tff:
    round_timing.time_rounds(config(), args.rounds, args.times_file)
    return
  if args.authors_code is None:
    parser.error("--authors-code: required, a clone of the HyperFL authors' repository")
  _checked(parser, args)
  print(f"setting: {CLIENTS} clients x {SAMPLES} samples, {EPOCHS} local epochs of "
        f"batch {BATCH}, SGD lr 0.02 momentum 0.5 weight decay 5e-4; the authors' "
        f"side at {args.torch_threads} torch threads", flush=True)
  ratios, peaks = [], {"tff": 0, "authors": 0}
  with tempfile.TemporaryDirectory() as tmp:
    clients_file = os.path.join(tmp, "clients.npz")
    write_clients(clients_file)
    for repeat in range(1, args.repeats + 1):
      seconds = {}
      for side, measure in (("tff", lambda: tff_round(args)),
                            ("authors", lambda: authors_round(args, clients_file))):
        times, peak = measure()
        seconds[side] = statistics.median(times)
        peaks[side] = max(peaks[side], peak)
      ratios.append(seconds["tff"] / seconds["authors"])
      print(f"repeat {repeat}: tff {seconds['tff']:.3f} s/round, authors "
            f"{seconds['authors']:.3f} s/round (medians of {args.rounds}), "
            f"ratio {ratios[-1]:.2f}", flush=True)
  print(f"ratio over {args.repeats} repeats: median {statistics.median(ratios):.2f}, "
        f"from {min(ratios):.2f} to {max(ratios):.2f}")
  print(f"ratio_tff_over_authors={statistics.median(ratios):.2f} "
        + " ".join(f"peak_rss_mb_{side}={peak // 2**20}" for side, peak in peaks.items()))
  runtime.stop()


if __name__ == "__main__":
  main()
