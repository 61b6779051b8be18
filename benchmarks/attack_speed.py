"""Iterations per second of Inverting Gradients compiled (`tf.function`)
versus the same loop run eagerly, and records per second of --records
single-image records attacked one at a time versus in one vectorised group
(`group_size`), measured in one process; with a GPU visible, also CPU versus
GPU for the compiled loop and both record rates on the GPU.

The targets are FedSGD uploads of bundled MNIST digits under the small ReLU
CNN (computed here, as a client would).

  python benchmarks/attack_speed.py [--iterations 500] [--eager-iterations 50]
      [--records 8] [--record-iterations 200] [--repeats 5] [--model cnn]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the CUDA plugin lines

import argparse
import time

import tensorflow as tf

from tff_privacy import attacks, data, models, runtime
from tff_privacy.attacks import functional
from tff_privacy.cli import _positive_int
from tff_privacy.updates import UpdateRecord


def make_record(model_name: str, index: int = 0) -> UpdateRecord:
  """Client `index`'s FedSGD upload of training digit `index`."""
  src = data.load_source("mnist5k")
  spec = models.ModelSpec(model_name, src.input_shape, src.num_classes)
  model = spec.keras()
  broadcast = [v.numpy() for v in model.trainable_variables]
  x, y = src.x_train[index:index + 1], src.y_train[index:index + 1]
  upload = functional.simulate_upload(
      model, [tf.constant(w) for w in broadcast], tf.constant(x),
      tf.one_hot(y, 10), "gradient", {"batch_size": 1})
  meta = {"method": "fedsgd", "upload_kind": "gradient", "model": spec.to_json(),
          "dataset": "mnist5k", "value_range": [0.0, 1.0], "raw_max": 255.0,
          "protocol": {"batch_size": 1}}
  return UpdateRecord(1, index, f"client_{index:04d}", [u.numpy() for u in upload],
                      1.0, 1, broadcast, meta)


def iterations_per_second(record, iterations: int, compiled: bool,
                          device: str | None) -> float:
  attack = attacks.InvertingGradients(iterations=iterations, compiled=compiled)
  attack([record], device=device)  # trace and warm up
  start = time.perf_counter()
  attack([record], device=device)
  return iterations / (time.perf_counter() - start)


def records_per_second(records, iterations: int, group_sizes: tuple[int, ...],
                       device: str | None, repeats: int) -> list[float]:
  """Records per second at each group size: the fastest of `repeats` timed
  calls, the group sizes taking turns so that a slow spell of a shared
  machine does not fall on one of them only."""
  runs = [attacks.InvertingGradients(iterations=iterations, group_size=size)
          for size in group_sizes]
  for attack in runs:
    attack(records, device=device)  # trace and warm up
  best = [float("inf")] * len(runs)
  for _ in range(repeats):
    for i, attack in enumerate(runs):
      start = time.perf_counter()
      attack(records, device=device)
      best[i] = min(best[i], time.perf_counter() - start)
  return [len(records) / seconds for seconds in best]


def print_record_rates(records, iterations: int, device: str, prefix: str,
                       repeats: int) -> None:
  one, grouped = records_per_second(records, iterations, (1, len(records)),
                                    device, repeats)
  print(f"{prefix}one_at_a_time_records_per_s={one:.3f}")
  print(f"{prefix}batched_records_per_s={grouped:.3f}")
  print(f"{prefix}ratio_batched_over_one_at_a_time={grouped / one:.2f}")


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--iterations", type=int, default=500)
  parser.add_argument("--eager-iterations", type=int, default=50)
  parser.add_argument("--model", default="cnn", choices=sorted(models.MODELS))
  parser.add_argument("--records", type=int, default=8,
                      help="single-image records for the batched comparison")
  parser.add_argument("--record-iterations", type=int, default=200,
                      help="IG iterations per record in that comparison")
  parser.add_argument("--repeats", type=_positive_int, default=5,
                      help="timed calls per group size in that comparison, "
                      "the fastest kept")
  args = parser.parse_args()
  record = make_record(args.model)
  compiled = iterations_per_second(record, args.iterations, True, "/CPU:0")
  eager = iterations_per_second(record, args.eager_iterations, False, "/CPU:0")
  print(f"model={args.model} attack=ig batch=1")
  print(f"cpu_tf_function_it_per_s={compiled:.1f}")
  print(f"cpu_eager_it_per_s={eager:.1f}")
  print(f"ratio_tf_function_over_eager={compiled / eager:.1f}")
  records = [make_record(args.model, i) for i in range(args.records)]
  print(f"records={args.records} iterations_per_record={args.record_iterations}")
  print_record_rates(records, args.record_iterations, "/CPU:0", "", args.repeats)
  if tf.config.list_physical_devices("GPU"):
    gpu = iterations_per_second(record, args.iterations, True, "/GPU:0")
    print(f"gpu_tf_function_it_per_s={gpu:.1f}")
    print(f"ratio_gpu_over_cpu={gpu / compiled:.1f}")
    print_record_rates(records, args.record_iterations, "/GPU:0", "gpu_",
                       args.repeats)
  else:
    print("gpu: none visible to TensorFlow; CPU vs GPU not measured")


if __name__ == "__main__":
  main()
