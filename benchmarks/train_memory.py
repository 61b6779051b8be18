"""Peak resident memory of one `tff-privacy train` run: its whole process
tree (the driver and its TFF worker processes), sampled every 0.5 s by
`fedre_memory.watch` and killed above `--limit-mb`. The run's flags follow
`--`; it writes to their `--out` folder where given (to compare its
metrics.json with another run's), else to a temporary one.

E.g. HyperFL on the authors' split (20 clients, 150 training and 50 test
samples each), 20 rounds:

  python experiments/write_split.py --out split.json
  python benchmarks/train_memory.py -- --method hyperfl --dataset mnist5k \\
      --model cnn --partition file:split.json --rounds 20 --batch-size 32

Prints the measured command line, then `peak_rss_mb=<x>` and
`peak_anon_mb=<y>` (as `fedre_memory` does), the seconds elapsed and
whether the run finished or was killed.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the run's: quiet CUDA plugin errors

import argparse
import shlex
import sys
import tempfile

from fedre_memory import _positive_int, watch


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--limit-mb", type=_positive_int, default=12000,
                      help="kill the run's process tree above this resident size")
  parser.add_argument("train", nargs="+", help="`tff-privacy train` flags, after --")
  args = parser.parse_args()
  given_out = any(f == "--out" or f.startswith("--out=") for f in args.train)
  with tempfile.TemporaryDirectory() as tmp:
    out = [] if given_out else ["--out", tmp]
    command = [sys.executable, "-m", "tff_privacy.cli", "train", "--quiet",
               *out, *args.train]
    shown = ["tff-privacy", *command[3:]]
    if not given_out:
      shown[shown.index(tmp)] = "OUT"
    print("command=" + shlex.join(shown), flush=True)
    peak, peak_anon, seconds, outcome = watch(command, args.limit_mb * 2**20)
  print(f"peak_rss_mb={peak // 2**20} peak_anon_mb={peak_anon // 2**20} "
        f"seconds={seconds:.0f} outcome={outcome}")
  if outcome != "finished":
    sys.exit(1)


if __name__ == "__main__":
  main()
