"""Steady-state cost of one TFF FedAvg round relative to plain TensorFlow.

Both sides do the same client arithmetic on the same data: 10 clients of the
bundled MNIST digits, each running one epoch of minibatch SGD (batch 32) on the
small CNN from the broadcast weights, then the example-weighted mean of the
model deltas applied by the server. TFF runs `build_weighted_fed_avg` through
its C++ worker; the baseline runs a `tf.function` per client in this process.

Prints the median seconds per round of each and their ratio (TFF / plain TF).

  python benchmarks/round_overhead.py [--rounds 10] [--clients 10] [--model cnn]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the CUDA plugin lines

import argparse
import collections
import statistics
import time

import numpy as np
import tensorflow as tf

from tff_privacy import algorithms, data, models, runtime
from tff_privacy.runs import clients


def client_datasets(fed: data.FederatedData, batch_size: int):
  out = []
  for c in range(fed.num_clients):
    x, y = fed.client_arrays(c)
    out.append(clients.unoptimized(tf.data.Dataset.from_tensor_slices(
        collections.OrderedDict(x=x, y=y)).batch(batch_size)))  # as the runner's
  return out


def tff_round_times(spec, datasets, rounds: int, lr: float) -> list[float]:
  process = algorithms.build_fedavg(spec.tff_model_fn(), client_learning_rate=lr)
  state = process.initialize()
  state = process.next(state, datasets).state  # compile
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    state = process.next(state, datasets).state
    times.append(time.perf_counter() - start)
  return times


def plain_tf_round_times(spec, datasets, rounds: int, lr: float) -> list[float]:
  model = spec.keras()
  loss_fn = models.loss_fn()
  global_weights = [tf.Variable(v) for v in model.trainable_variables]

  @tf.function
  def client_update(dataset):
    for v, g in zip(model.trainable_variables, global_weights):
      v.assign(g)
    n = tf.constant(0.0)
    for batch in iter(dataset):  # the loop TFF's client updates run (defended.CLIENT_LOOP)
      with tf.GradientTape() as tape:
        loss = loss_fn(batch["y"], model(batch["x"], training=True))
      grads = tape.gradient(loss, model.trainable_variables)
      for v, g in zip(model.trainable_variables, grads):
        v.assign_sub(lr * g)
      n += tf.cast(tf.shape(batch["y"])[0], tf.float32)
    return [g - v for g, v in zip(global_weights, model.trainable_variables)], n

  def one_round():
    sums = [tf.zeros_like(v) for v in global_weights]
    total = 0.0
    for ds in datasets:
      delta, n = client_update(ds)
      sums = [s + n * d for s, d in zip(sums, delta)]
      total += float(n)
    for g, s in zip(global_weights, sums):
      g.assign_sub(s / total)

  one_round()  # trace
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    one_round()
    times.append(time.perf_counter() - start)
  return times


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--clients", type=int, default=10)
  parser.add_argument("--model", default="cnn", choices=sorted(models.MODELS))
  parser.add_argument("--batch-size", type=int, default=32)
  args = parser.parse_args()
  runtime.start()
  fed = data.load("mnist5k", args.clients)
  spec = models.ModelSpec(args.model, fed.source.input_shape, fed.source.num_classes)
  datasets = client_datasets(fed, args.batch_size)
  tff_times = tff_round_times(spec, datasets, args.rounds, 0.1)
  tf_times = plain_tf_round_times(spec, datasets, args.rounds, 0.1)
  tff_s, tf_s = statistics.median(tff_times), statistics.median(tf_times)
  print(f"clients={args.clients} model={args.model} batches/client="
        f"{int(np.ceil(len(fed.client_indices[0]) / args.batch_size))} "
        f"rounds={args.rounds} (median of steady rounds)")
  print(f"tff_fedavg_round_s={tff_s:.4f}")
  print(f"plain_tf_round_s={tf_s:.4f}")
  print(f"ratio_tff_over_plain_tf={tff_s / tf_s:.2f}")
  runtime.stop()


if __name__ == "__main__":
  main()
