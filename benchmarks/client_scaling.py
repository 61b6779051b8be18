"""How the cost of one FedAvg round grows with the clients per round.

At each size (default 10, 50, 200 and 1,000 clients per round) one run of
the library's FedAvg (`tff_privacy.runner.Run`: the round's client data as
the runner builds it, then the TFF process through 1 and 2 local workers) is
timed over steady rounds, beside a plain-TensorFlow loop doing the same
client arithmetic in this process (`round_overhead.plain_tf_round_times`):
each client a few samples of the bundled MNIST digits (partition
label_groups), the small MLP, one epoch of SGD, the example-weighted mean of
the deltas.

Prints seconds per round and per client at each size and worker count, then

  per_client_ratio_<largest>_over_<second>=<x>   (seconds per client at the
      largest size over the second size given, 1 worker: 1.0 is linear growth)
  ratio_tff_over_plain_tf_at_<largest>=<y>       (1 worker)

  python benchmarks/client_scaling.py [--sizes 10,50,200,1000] [--rounds 3]
      [--workers 1,2] [--samples-per-client 4]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import statistics
import tempfile
import time

from round_overhead import plain_tf_round_times
from tff_privacy import runner, runtime


def runner_round_times(run: runner.Run, rounds: int) -> list[float]:
  """Seconds of each steady round: the runner's client data, then the step."""
  state = run.initial_state()
  state, _ = run.step(state, run.round_data(1), capture=False)  # compiles
  times = []
  for round_num in range(2, rounds + 2):
    start = time.perf_counter()
    state, _ = run.step(state, run.round_data(round_num), capture=False)
    times.append(time.perf_counter() - start)
  return times


def build_run(size: int, samples: int, out: str) -> runner.Run:
  config = runner.RunConfig(
      out=out, method="fedavg", dataset="mnist5k", model="mlp",
      model_kwargs={"hidden": [32]}, clients=size, partition="label_groups",
      samples_per_client=samples, batch_size=samples, rounds=1, seed=0,
      method_kwargs={"client_learning_rate": 0.1})
  return runner.Run(config)


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="10,50,200,1000")
  parser.add_argument("--workers", default="1,2")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--samples-per-client", type=int, default=4)
  args = parser.parse_args()
  sizes = [int(s) for s in args.sizes.split(",")]
  counts = [int(w) for w in args.workers.split(",")]
  if len(sizes) < 2 or 1 not in counts:
    parser.error("--sizes takes at least two sizes and --workers must include 1")
  per_client: dict[tuple[int, int], float] = {}
  plain: dict[int, float] = {}
  with tempfile.TemporaryDirectory() as out:
    for size in sizes:
      run = build_run(size, args.samples_per_client, out)
      datasets = [c.dataset for c in run.round_data(1)]
      plain[size] = statistics.median(plain_tf_round_times(
          run.spec, datasets, args.rounds, 0.1))
      for count in counts:
        runtime.stop()
        runtime.start(workers=count)
        seconds = statistics.median(runner_round_times(run, args.rounds))
        per_client[size, count] = seconds / size
        print(f"clients={size} workers={count} round_s={seconds:.3f} "
              f"per_client_ms={1000 * seconds / size:.2f} "
              f"plain_tf_round_s={plain[size]:.3f}", flush=True)
  runtime.stop()
  large, second = sizes[-1], sizes[1]
  print(f"per_client_ratio_{large}_over_{second}="
        f"{per_client[large, 1] / per_client[second, 1]:.2f}")
  print(f"ratio_tff_over_plain_tf_at_{large}="
        f"{per_client[large, 1] * large / plain[large]:.2f}")


if __name__ == "__main__":
  main()
