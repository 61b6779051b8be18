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
from tensorflow.python.framework import ops
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


def graph_flops(fn, *specs, depending_on: "int | None" = None) -> int:
  """The floating point operations of the graph of `fn` traced at `specs`
  by the counts TensorFlow registers for its ops (those its profiler
  adds; ops without one add none), with the functions it calls inlined
  (the profiler does not look inside a call: a `ForwardAccumulator`'s JVPs
  run in such calls) and only the ops its outputs need (the inlined
  functions hold ops whose results nothing reads). With `depending_on`
  (the index of one of `specs`), only the ops that depend on that input:
  what a vectorised map over that input computes once per element, the
  rest once per map (`specs[depending_on]` may be a structure of specs)."""
  traced = tf.function(fn).get_concrete_function(*specs)
  meta_graph = tf.compat.v1.train.export_meta_graph(
      graph_def=traced.graph.as_graph_def(), graph=traced.graph)
  outputs = [t.op.name for t in traced.outputs]
  meta_graph.collection_def["train_op"].node_list.value.extend(outputs)
  config = config_pb2.ConfigProto()
  config.graph_options.rewrite_options.optimizers[:] = ["function"]
  config.graph_options.rewrite_options.min_graph_nodes = -1
  needed = tf.compat.v1.graph_util.extract_sub_graph(
      tf_optimizer.OptimizeGraph(config, meta_graph), outputs)
  graph = tf.Graph()
  with graph.as_default():
    tf.graph_util.import_graph_def(needed, name="")
  counted = graph.get_operations()
  if depending_on is not None:
    start = len(tf.nest.flatten(specs[:depending_on]))
    given = traced.inputs[start:start + len(tf.nest.flatten(specs[depending_on]))]
    counted = _dependents(graph, [t.op.name for t in given])
  return sum(_op_flops(graph, op) for op in counted)


def _dependents(graph: tf.Graph, names: list[str]) -> list:
  """The ops of `graph` whose data inputs depend on the ops `names`
  (themselves included). Control edges are not followed: a vectorised map
  runs an op once whose data inputs do not vary, whatever its control
  inputs do."""
  reached, frontier = set(), [graph.get_operation_by_name(n) for n in names]
  while frontier:
    op = frontier.pop()
    if op.name not in reached:
      reached.add(op.name)
      frontier += [c for out in op.outputs for c in out.consumers()]
  return [graph.get_operation_by_name(n) for n in reached]


def _op_flops(graph: tf.Graph, op) -> int:
  """The operations TensorFlow registers for `op`; 0 where the count needs
  shapes the graph does not know (in the graphs measured here, scalar
  bookkeeping such as a vectorised map's loop counters)."""
  try:
    return int(ops.get_stats_for_node_def(graph, op.node_def, "flops").value or 0)
  except ValueError:
    return 0
