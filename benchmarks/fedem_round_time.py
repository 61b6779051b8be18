"""Wall time of one FedEM round relative to one FedSGD round, same process.

Both methods run through TFF on the same round's data (mnist5k, 4 clients of
one batch of 32, the cnn, as FedEM's Sec. 4.1.2 setting). A FedEM client
makes 2N + 1 forward-backward passes (N on the perturbation, N on the local
model copy, one for the upload), a FedSGD client one, so 2N + 1 is the ratio
the client arithmetic alone predicts; fixed per-round costs (TFF dispatch,
aggregation, the server step) pull the measured ratio below it. Rounds of the
two methods alternate, after one compiling round each.

Prints, per N, the median seconds per round of each method and their ratio.

  python benchmarks/fedem_round_time.py [--rounds 10] [--steps 1,5,10]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the CUDA plugin lines

import argparse
import statistics
import tempfile
import time

from tff_privacy import runner, runtime


def _process_and_data(method: str, out: str, **method_kwargs):
  run = runner.Run(runner.RunConfig(
      out=out, method=method, dataset="mnist5k", model="cnn", clients=4,
      batch_size=32, seed=0, method_kwargs=method_kwargs))
  process = run.process(capture=False)
  # the run with its datasets: they may read files it owns
  return process, process.initialize(), [c.process_data for c in run.round_data(1)], run


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--steps", default="1,5,10",
                      help="comma-separated values of N (perturb_steps)")
  args = parser.parse_args()
  runtime.start()
  steps = [int(s) for s in args.steps.split(",")]
  with tempfile.TemporaryDirectory() as tmp:
    sgd = _process_and_data("fedsgd", os.path.join(tmp, "sgd"))
    fedem = {n: _process_and_data("fedem", os.path.join(tmp, f"em{n}"),
                                  perturb_steps=n) for n in steps}
    runs = {"fedsgd": sgd, **{f"fedem_N{n}": fedem[n] for n in steps}}
    times = {name: [] for name in runs}
    states = {name: process.next(state, datasets).state  # compile
              for name, (process, state, datasets, _) in runs.items()}
    for _ in range(args.rounds):
      for name, (process, _, datasets, _) in runs.items():
        start = time.perf_counter()
        states[name] = process.next(states[name], datasets).state
        times[name].append(time.perf_counter() - start)
  base = statistics.median(times["fedsgd"])
  print(f"fedsgd: {base:.4f} s/round (median of {args.rounds})")
  for n in steps:
    t = statistics.median(times[f"fedem_N{n}"])
    print(f"fedem N={n}: {t:.4f} s/round, ratio to fedsgd {t / base:.2f} "
          f"(2N+1 = {2 * n + 1})")
  runtime.stop()


if __name__ == "__main__":
  main()
