"""Peak resident memory of a FedRE run on the bundled documents: the whole
process tree of `tff-privacy train --method fedre --dataset docs` (the
driver and its TFF worker processes), sampled every 0.5 s. The tree is
killed when it exceeds `--limit-mb`, so a run that would exhaust the
machine stops first; the peak it reached and the time are printed either
way. The run takes the documents' protocol except for its rounds (and
`--clients` where given); further `tff-privacy train` flags follow `--`,
e.g. `-- --data-kwargs '{"size": 64}'` for 64x64 documents.

  python benchmarks/fedre_memory.py [--clients N] [--rounds 2]
      [--limit-mb 12000] [-- TRAIN FLAGS...]

Prints the measured command line, then `peak_rss_mb=<x>` (every resident
page; the limit applies to it) and `peak_anon_mb=<y>` (anonymous and
shared-memory pages, which only swap can take out of memory; the rest are
pages of files on disk that the kernel drops under pressure, such as the
documents' file-backed arrays), the seconds elapsed and whether the run
finished or was killed.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the run's: quiet CUDA plugin errors

import argparse
import shlex
import subprocess
import sys
import tempfile
import time

import psutil

SAMPLE_S = 0.5


def _positive_int(text: str) -> int:
  """An argparse type; the benchmark imports nothing of the library, it
  only starts the run and measures it."""
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"takes an integer >= 1, got {text!r}")
  return int(text)


def tree_memory(root: psutil.Process) -> tuple[int, int]:
  """Bytes resident in `root` and all of its descendants: (all of them,
  those the kernel cannot drop without swap: anonymous and shared-memory
  pages, tmpfs files included). The difference is pages of files on disk
  (mapped data, code), which the kernel writes out and drops under
  pressure."""
  rss = kept = 0
  for p in [root, *root.children(recursive=True)]:
    try:
      rss += p.memory_info().rss
      kept += _unreclaimable(p.pid)
    except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
      continue
  return rss, kept


def _unreclaimable(pid: int) -> int:
  """RssAnon + RssShmem of process `pid`, in bytes (Linux)."""
  with open(f"/proc/{pid}/status") as f:
    fields = dict(line.split(":", 1) for line in f if line.startswith("Rss"))
  # an exiting process (a zombie) lists none
  return sum(int(fields.get(k, "0").split()[0]) for k in ("RssAnon", "RssShmem")) * 1024


def kill_tree(root: psutil.Process) -> None:
  """SIGKILLs `root` and its descendants, children first."""
  for p in [*root.children(recursive=True), root]:
    try:
      p.kill()
    except psutil.NoSuchProcess:
      pass


def watch(command: list[str], limit_bytes: int) -> tuple[int, int, float, str]:
  """Runs `command`; returns (peak tree RSS in bytes, peak tree anonymous
  RSS in bytes, seconds, outcome)."""
  start = time.monotonic()
  process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
  root = psutil.Process(process.pid)
  peak = peak_anon = 0
  while process.poll() is None:
    try:
      rss, anon = tree_memory(root)
    except psutil.NoSuchProcess:
      break
    peak, peak_anon = max(peak, rss), max(peak_anon, anon)
    if peak > limit_bytes:
      kill_tree(root)
      process.wait()
      return peak, peak_anon, time.monotonic() - start, "killed_over_limit"
    time.sleep(SAMPLE_S)
  outcome = "finished" if process.wait() == 0 else f"failed_rc={process.returncode}"
  return peak, peak_anon, time.monotonic() - start, outcome


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--clients", type=_positive_int, help="default: the protocol's")
  parser.add_argument("--rounds", type=_positive_int, default=2)
  parser.add_argument("--limit-mb", type=_positive_int, default=12000,
                      help="kill the run's process tree above this resident size")
  parser.add_argument("extra", nargs="*", help="more `tff-privacy train` flags")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as out:
    command = [sys.executable, "-m", "tff_privacy.cli", "train", "--method", "fedre",
               "--dataset", "docs", "--model", "unet", "--rounds", str(args.rounds),
               *(["--clients", str(args.clients)] if args.clients else []),
               "--quiet", "--out", out, *args.extra]
    shown = ["tff-privacy", *command[3:]]
    shown[shown.index(out)] = "OUT"
    print("command=" + shlex.join(shown), flush=True)
    peak, peak_anon, seconds, outcome = watch(command, args.limit_mb * 2**20)
  print(f"peak_rss_mb={peak // 2**20} peak_anon_mb={peak_anon // 2**20} "
        f"seconds={seconds:.0f} outcome={outcome}")


if __name__ == "__main__":
  main()
