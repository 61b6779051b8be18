"""`CaptureFactory`: an aggregator wrapper that reports every client's upload.

It forwards to any inner weighted aggregator unchanged and, in its
measurements, returns the uploads of all clients stacked along a new leading
axis (in client order) together with their weights, so that the runner can write
exactly what left each client to the update store.
"""

from __future__ import annotations

import collections

import tensorflow as tf
import tensorflow_federated as tff


class CaptureFactory(tff.aggregators.WeightedAggregationFactory):
  """Wraps `inner`; measurements gain `uploads`, `upload_weights`, `num_uploads`.

  `capacity` is the largest number of clients in one call. Client order is the
  order of the CLIENTS-placed values: the C++ runtime folds `federated_aggregate`
  over clients in that order, and `merge` keeps it (tests check both).
  """

  def __init__(self, inner: tff.aggregators.WeightedAggregationFactory,
               capacity: int, server_view=None):
    """`server_view`, if given, maps a client's value (list of tensors) to
    what the server receives of it when `inner` transforms values on the
    clients first (e.g. DP-FedAvg's clipping); that is what gets recorded."""
    if capacity < 1:
      raise ValueError(f"capacity must be >= 1, got {capacity}")
    self._inner = inner
    self._capacity = capacity
    self._server_view = server_view

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    inner = self._inner.create(value_type, weight_type)
    zero, accumulate, merge, report = stacking_computations(
        value_type, weight_type, self._capacity)
    view = self._server_view

    @tff.tensorflow.computation(value_type)
    def seen_by_server(value):
      return view(value) if view is not None else value

    @tff.federated_computation()
    def init_fn():
      return inner.initialize()

    @tff.federated_computation(
        init_fn.type_signature.result,
        tff.FederatedType(value_type, tff.CLIENTS),
        tff.FederatedType(weight_type, tff.CLIENTS))
    def next_fn(state, value, weight):
      output = inner.next(state, value, weight)
      captured = tff.federated_aggregate(
          tff.federated_zip((tff.federated_map(seen_by_server, value), weight)),
          zero(), accumulate, merge, report)
      measurements = tff.federated_zip(collections.OrderedDict(
          inner=output.measurements, captured=captured))
      return tff.templates.MeasuredProcessOutput(
          state=output.state, result=output.result, measurements=measurements)

    return tff.templates.AggregationProcess(init_fn, next_fn)


class ClientPlacedCapture(CaptureFactory):
  """A `CaptureFactory` that a personalised process may replace by returning
  the uploads and their weights CLIENTS-placed to the simulation's driver
  (`algorithms.personalized.build_personalized_process`: `next`'s `uploads`
  and `upload_weights`), aggregating with `inner` alone; any other builder
  gets the `CaptureFactory`. The runner turns the returned uploads into the
  same `captured` measurements.

  Why: TFF's C++ runtime keeps every intermediate accumulator of a
  `federated_aggregate` until the call ends, so stacking N uploads of B bytes
  holds about N^2 B / 2: 20 of HyperFL's 60 MB hypernetworks needed over
  23 GB and were killed. CLIENTS-placed values come back one per client."""

  @property
  def inner(self) -> tff.aggregators.WeightedAggregationFactory:
    return self._inner


def stacking_computations(value_type, weight_type, capacity: int):
  """The (zero, accumulate, merge, report) of a `federated_aggregate` that
  stacks (value, weight) pairs, in arrival order, into fixed-size buffers."""
  leaves = tff.structure.flatten(value_type)
  weight_dtype = weight_type.dtype

  @tff.tensorflow.computation
  def zero():
    return (tf.constant(0, tf.int32),
            [tf.zeros((capacity,) + tuple(t.shape), t.dtype) for t in leaves],
            tf.zeros((capacity,), weight_dtype))

  acc_type = zero.type_signature.result

  @tff.tensorflow.computation(acc_type, (value_type, weight_type))
  def accumulate(acc, value_and_weight):
    count, buffers, weights = acc
    value, weight = value_and_weight
    check = tf.debugging.assert_less(
        count, capacity, message="more clients than CaptureFactory capacity")
    with tf.control_dependencies([check]):
      at = tf.reshape(count, [1, 1])
    buffers = [tf.tensor_scatter_nd_update(b, at, v[None])
               for b, v in zip(buffers, tf.nest.flatten(value))]
    weights = tf.tensor_scatter_nd_update(weights, at, tf.reshape(weight, [1]))
    return count + 1, buffers, weights

  @tff.tensorflow.computation(acc_type, acc_type)
  def merge(a, b):
    def join(x, y):
      joined = tf.concat([x[: a[0]], y[: b[0]], tf.zeros_like(x)], axis=0)
      return tf.ensure_shape(joined[:capacity], x.shape)
    return (a[0] + b[0], [join(x, y) for x, y in zip(a[1], b[1])],
            join(a[2], b[2]))

  @tff.tensorflow.computation(acc_type)
  def report(acc):
    count, buffers, weights = acc
    return collections.OrderedDict(
        num_uploads=count, uploads=buffers, upload_weights=weights)

  return zero, accumulate, merge, report
