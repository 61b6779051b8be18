"""Seconds Inverting Gradients spends tracing a search of a FedAvg upload
(a local epoch of batch-1 SGD steps, unrolled in its objective) against the
seconds the same compiled search then takes to run, measured in one
process: the first call of a fresh attack traces and runs, the second only
runs. Also prints this process's peak resident memory.

The upload is like the compact leaderboard's FedAvg row's: the 784-64-2
MLP on bundled MNIST digits labelled digit >= 5 (mnist5k_parity),
--examples images, learning rate 0.05, computed here as a client would.

  python benchmarks/attack_trace.py [--examples 20] [--iterations 100]
      [--records 2]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import resource
import time

import tensorflow as tf

from tff_privacy import attacks, data, models, runtime
from tff_privacy.attacks import functional
from tff_privacy.cli import _positive_int
from tff_privacy.updates import UpdateRecord

PROTOCOL = {"client_learning_rate": 0.05, "batch_size": 1, "local_epochs": 1}


def make_record(examples: int, index: int) -> UpdateRecord:
  """Client `index`'s one-epoch FedAvg delta of `examples` training digits."""
  src = data.load_source("mnist5k_parity")
  spec = models.ModelSpec("mlp", src.input_shape, 2, {"hidden": [64]})
  model = spec.keras()
  broadcast = [v.numpy() for v in model.trainable_variables]
  first = index * examples
  x = src.x_train[first:first + examples]
  y = src.y_train[first:first + examples]
  upload = functional.simulate_upload(
      model, [tf.constant(w) for w in broadcast], tf.constant(x),
      tf.one_hot(y, 2), "model_delta", PROTOCOL)
  meta = {"method": "fedavg", "upload_kind": "model_delta",
          "model": spec.to_json(), "dataset": "mnist5k_parity",
          "value_range": [0.0, 1.0], "raw_max": 255.0, "protocol": PROTOCOL}
  return UpdateRecord(1, index, f"client_{index:04d}", [u.numpy() for u in upload],
                      float(examples), examples, broadcast, meta)


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--examples", type=_positive_int, default=20,
                      help="images behind each upload (local SGD steps)")
  parser.add_argument("--iterations", type=_positive_int, default=100)
  parser.add_argument("--records", type=_positive_int, default=2)
  args = parser.parse_args()
  records = [make_record(args.examples, i) for i in range(args.records)]
  attack = attacks.InvertingGradients(iterations=args.iterations)
  start = time.perf_counter()
  attack(records)
  first = time.perf_counter() - start
  start = time.perf_counter()
  found = attack(records)
  steady = time.perf_counter() - start
  print(f"model=mlp upload=model_delta examples={args.examples} "
        f"records={args.records} iterations={args.iterations}")
  # what the searches found, to compare versions of the code by
  print("objectives=" + ",".join(f"{r.objective:.7g}" for r in found))
  print(f"first_call_s={first:.2f}")
  print(f"steady_call_s={steady:.2f}")
  print(f"trace_s={first - steady:.2f}")
  print(f"ratio_trace_over_steady={(first - steady) / steady:.2f}")
  # the search runs in this process (no TFF worker): its peak is the peak
  print(f"peak_rss_mb={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")


if __name__ == "__main__":
  main()
