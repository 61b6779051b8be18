"""What the round-time benchmarks share: a method's rounds timed in a
process of its own (`time_rounds`), started and watched for its peak
memory by `measured`; the floating point operations of a TensorFlow
function (`graph_flops`)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time

import tensorflow as tf
# Grappler's function inlining, which TensorFlow exports no public form of
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.grappler import tf_optimizer

from fedre_memory import watch  # this folder's
from tff_privacy import runner, runtime


def time_rounds(config: runner.RunConfig, rounds: int, path: str) -> None:
  """Writes to `path` (JSON) the seconds of each of `rounds` rounds of the
  run `config` after a compiling one, all on round 1's clients, without
  capture or evaluation; `config.out` is replaced by a temporary folder."""
  runtime.start()
  with tempfile.TemporaryDirectory() as tmp:
    run = runner.Run(dataclasses.replace(config, out=tmp))
    data = run.round_data(1)
    state = run.step(run.initial_state(), data, False)[0]  # compile
    times = []
    for _ in range(rounds):
      start = time.perf_counter()
      state = run.step(state, data, False)[0]
      times.append(time.perf_counter() - start)
  with open(path, "w") as f:
    json.dump(times, f)
  runtime.stop()


def measured(script: str, arguments: list[str], limit_mb: int, what: str,
             python: str = sys.executable) -> tuple[list[float], int]:
  """(seconds of each timed round, peak resident bytes of the process
  tree) of `python script ARGUMENTS --times-file PATH`, a process that
  writes them there as `time_rounds` does; exits naming `what` where it
  fails or passes `limit_mb`."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "times.json")
    peak, _, _, outcome = watch(
        [python, os.path.abspath(script), *arguments, "--times-file", path],
        limit_mb * 2**20)
    if outcome != "finished":
      sys.exit(f"{what}: {outcome} at peak_rss_mb={peak // 2**20}")
    with open(path) as f:
      return json.load(f), peak


def graph_flops(fn, *specs) -> int:
  """The floating point operations TensorFlow's profiler counts in the
  graph of `fn` traced at `specs`, with the functions it calls inlined
  (the profiler does not look inside a call: a `ForwardAccumulator`'s JVPs
  run in such calls); ops the profiler has no count for add none."""
  traced = tf.function(fn).get_concrete_function(*specs)
  meta_graph = tf.compat.v1.train.export_meta_graph(
      graph_def=traced.graph.as_graph_def(), graph=traced.graph)
  fetches = meta_graph.collection_def["train_op"].node_list.value
  fetches.extend(t.name for t in traced.outputs)
  config = config_pb2.ConfigProto()
  config.graph_options.rewrite_options.optimizers[:] = ["function"]
  config.graph_options.rewrite_options.min_graph_nodes = -1
  inlined = tf.Graph()
  with inlined.as_default():
    tf.graph_util.import_graph_def(tf_optimizer.OptimizeGraph(config, meta_graph),
                                   name="")
  options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
  options["output"] = "none"
  return tf.compat.v1.profiler.profile(inlined, options=options).total_float_ops
