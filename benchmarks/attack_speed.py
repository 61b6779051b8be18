"""Iterations per second of Inverting Gradients compiled (`tf.function`)
versus the same loop run eagerly, measured in one process; with a GPU visible,
also CPU versus GPU for the compiled loop.

The target is a FedSGD upload of one bundled MNIST digit under the small ReLU
CNN (computed here, as a client would).

  python benchmarks/attack_speed.py [--iterations 500] [--eager-iterations 50]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import time

import tensorflow as tf

from tff_privacy import attacks, data, models
from tff_privacy.attacks import functional
from tff_privacy.updates import UpdateRecord


def make_record(model_name: str) -> UpdateRecord:
  src = data.load_source("mnist5k")
  spec = models.ModelSpec(model_name, src.input_shape, src.num_classes)
  model = spec.keras()
  broadcast = [v.numpy() for v in model.trainable_variables]
  upload = functional.simulate_upload(
      model, [tf.constant(w) for w in broadcast], tf.constant(src.x_train[:1]),
      tf.one_hot(src.y_train[:1], 10), "gradient", {"batch_size": 1})
  meta = {"method": "fedsgd", "upload_kind": "gradient", "model": spec.to_json(),
          "dataset": "mnist5k", "value_range": [0.0, 1.0], "raw_max": 255.0,
          "protocol": {"batch_size": 1}}
  return UpdateRecord(1, 0, "client_0000", [u.numpy() for u in upload], 1.0, 1,
                      broadcast, meta)


def iterations_per_second(record, iterations: int, compiled: bool,
                          device: str | None) -> float:
  attack = attacks.InvertingGradients(iterations=iterations, compiled=compiled)
  attack([record], device=device)  # trace and warm up
  start = time.perf_counter()
  attack([record], device=device)
  return iterations / (time.perf_counter() - start)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--iterations", type=int, default=500)
  parser.add_argument("--eager-iterations", type=int, default=50)
  parser.add_argument("--model", default="cnn", choices=sorted(models.MODELS))
  args = parser.parse_args()
  record = make_record(args.model)
  compiled = iterations_per_second(record, args.iterations, True, "/CPU:0")
  eager = iterations_per_second(record, args.eager_iterations, False, "/CPU:0")
  print(f"model={args.model} attack=ig batch=1")
  print(f"cpu_tf_function_it_per_s={compiled:.1f}")
  print(f"cpu_eager_it_per_s={eager:.1f}")
  print(f"ratio_tf_function_over_eager={compiled / eager:.1f}")
  if tf.config.list_physical_devices("GPU"):
    gpu = iterations_per_second(record, args.iterations, True, "/GPU:0")
    print(f"gpu_tf_function_it_per_s={gpu:.1f}")
    print(f"ratio_gpu_over_cpu={gpu / compiled:.1f}")
  else:
    print("gpu: none visible to TensorFlow; CPU vs GPU not measured")


if __name__ == "__main__":
  main()
