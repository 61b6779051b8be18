"""Peak memory of the TFF worker summing the clients' values three ways:
TFF's float32 `federated_sum`, every value widened to float64 before
`federated_sum`, and `aggregation.wide_sum.federated_wide_sum` (one float64
accumulator folded client by client). Each way runs on a fresh local worker;
its resident set is sampled every 50 ms.

  python benchmarks/wide_sum_memory.py [--clients 100] [--size 4000000]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import threading
import time

import numpy as np
import psutil
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import runtime
from tff_privacy.aggregation import wide_sum
from tff_privacy.cli import _positive_int


def summation(way: str, value_type):
  widen = wide_sum._recast(value_type, [True], tf.float64)  # pylint: disable=protected-access
  narrow = wide_sum._recast(widen.type_signature.result, [True], tf.float32)  # pylint: disable=protected-access

  @tff.federated_computation(tff.FederatedType(value_type, tff.CLIENTS))
  def total(values):
    if way == "float32":
      return tff.federated_sum(values)
    if way == "widen_then_sum":
      return tff.federated_map(narrow, tff.federated_sum(tff.federated_map(widen, values)))
    return wide_sum.federated_wide_sum(values)
  return total


def peak_rss_mb(way: str, clients: int, size: int) -> int:
  runtime.stop()
  worker = psutil.Process(runtime.start().process.pid)
  peak, done = [0], threading.Event()

  def sample():
    while not done.is_set():
      peak[0] = max(peak[0], worker.memory_info().rss)
      time.sleep(0.05)
  threading.Thread(target=sample, daemon=True).start()
  values = [np.full(size, i, np.float32) for i in range(clients)]
  summation(way, tff.TensorType(np.float32, [size]))(values)
  done.set()
  return peak[0] // 2**20


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--clients", type=_positive_int, default=100)
  parser.add_argument("--size", type=_positive_int, default=4_000_000,
                      help="float32 entries of each client's value")
  args = parser.parse_args()
  print(f"clients={args.clients} values_mb={args.clients * args.size * 4 // 2**20}")
  for way in ("float32", "widen_then_sum", "wide_sum"):
    print(f"{way}_worker_peak_rss_mb={peak_rss_mb(way, args.clients, args.size)}")
  runtime.stop()


if __name__ == "__main__":
  main()
