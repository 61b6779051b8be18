"""Sums over clients that do not depend on the order TFF adds them in.

TFF sums a round's client values in whatever order its executor meets them;
with several workers (`tff_privacy.runtime`), each worker first sums its own
share of the clients and the partial sums are then merged. In float32 the
result depends on that grouping in its last bits, so a 2-worker run would
drift from the 1-worker run of the same seed. Here float32 values are cast to
float64 before `tff.federated_sum` and the total is cast back once at the
server. A float64 sum of float32 values is exact while the values' exponents
span fewer than about 29 - log2(clients) binary orders, so the float32 total
is then the correctly rounded sum, whatever the grouping; beyond that span
the groupings differ only where the float64 sums straddle a float32 rounding
boundary. Other dtypes (the integer counts of metrics) are summed as they
are. The clients' values are folded one by one into a float64 accumulator
(`tff.federated_aggregate`), so the aggregation holds one widened total,
not a widened copy of every client's value. `WideSumFactory` serves `tff.aggregators.MeanFactory`,
`wide_sum_then_finalize` TFF's learning builders' metrics, and
`federated_wide_sum` and `federated_wide_mean` the project's own federated
computations. Value types are structures with Python containers (lists,
OrderedDicts), as TFF's learning types are.
"""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff


def _float32_leaves(value_type) -> list[bool]:
  """Which leaves of `value_type` (in `tf.nest` order) are float32."""
  specs = tff.types.type_to_tf_tensor_specs(value_type)
  return [spec.dtype == tf.float32 for spec in tf.nest.flatten(specs)]


def _recast(value_type, leaves: list[bool], target):
  """A TF computation casting the leaves of `value_type` marked in `leaves`
  to `target`, the others left as they are."""
  @tff.tensorflow.computation(value_type)
  def recast(value):
    flat = [tf.cast(t, target) if cast else t
            for t, cast in zip(tf.nest.flatten(value), leaves)]
    return tf.nest.pack_sequence_as(value, flat)
  return recast


def _wide_total(value):
  """(the float64 sum of a CLIENTS value, the sum's type, which leaves were
  float32): `tff.federated_aggregate` folds each client's value into one
  float64 accumulator, so no widened copy of every client's value is held
  at once (the mergeable form merges the workers' accumulators)."""
  value_type = value.type_signature.member
  leaves = _float32_leaves(value_type)
  wide_type = _recast(value_type, leaves, tf.float64).type_signature.result

  @tff.tensorflow.computation
  def zeros():
    specs = tff.types.type_to_tf_tensor_specs(wide_type)
    return tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), specs)

  @tff.tensorflow.computation(wide_type, value_type)
  def accumulate(total, client_value):
    flat = [t + (tf.cast(v, tf.float64) if cast else v) for t, v, cast in zip(
        tf.nest.flatten(total), tf.nest.flatten(client_value), leaves)]
    return tf.nest.pack_sequence_as(total, flat)

  @tff.tensorflow.computation(wide_type, wide_type)
  def merge(a, b):
    return tf.nest.map_structure(tf.add, a, b)

  @tff.tensorflow.computation(wide_type)
  def report(total):
    return total

  total = tff.federated_aggregate(value, zeros(), accumulate, merge, report)
  return total, wide_type, leaves


def federated_wide_sum(value):
  """`tff.federated_sum` of a CLIENTS value, its float32 leaves accumulated
  in float64 (see the module docstring); call it inside a federated
  computation."""
  total, wide_type, leaves = _wide_total(value)
  return tff.federated_map(_recast(wide_type, leaves, tf.float32), total)


def federated_wide_mean(value):
  """`tff.federated_mean` (unweighted) of a CLIENTS value of float32
  leaves, the sum accumulated in float64 and divided before the one
  rounding to float32."""
  if not all(_float32_leaves(value.type_signature.member)):
    raise TypeError("federated_wide_mean takes float32 values, not "
                    f"{value.type_signature.member}")
  total, wide_type, _ = _wide_total(value)
  count = tff.federated_sum(tff.federated_value(np.int32(1), tff.CLIENTS))

  @tff.tensorflow.computation(wide_type, np.int32)
  def divide(wide_total, clients):
    return tf.nest.map_structure(
        lambda t: tf.cast(t / tf.cast(clients, tf.float64), tf.float32), wide_total)
  return tff.federated_map(divide, (total, count))


class WideSumFactory(tff.aggregators.UnweightedAggregationFactory):
  """`tff.aggregators.SumFactory` accumulated in float64 (see the module
  docstring): as `value_sum_factory` of `tff.aggregators.MeanFactory`, a
  weighted mean whose sum does not depend on how clients are grouped."""

  def create(self, value_type) -> tff.templates.AggregationProcess:
    @tff.federated_computation()
    def initialize():
      return tff.federated_value((), tff.SERVER)

    @tff.federated_computation(initialize.type_signature.result,
                               tff.FederatedType(value_type, tff.CLIENTS))
    def next_fn(state, value):
      return tff.templates.MeasuredProcessOutput(
          state=state, result=federated_wide_sum(value),
          measurements=tff.federated_value((), tff.SERVER))

    return tff.templates.AggregationProcess(initialize, next_fn)


def wide_mean_factory() -> tff.aggregators.MeanFactory:
  """TFF's weighted mean with both of its sums accumulated in float64."""
  return tff.aggregators.MeanFactory(value_sum_factory=WideSumFactory(),
                                     weight_sum_factory=WideSumFactory())


def wide_sum_then_finalize(metric_finalizers, local_unfinalized_metrics_type=None):
  """`tff.learning.metrics.sum_then_finalize` with the clients' unfinalized
  metrics summed in float64 (`federated_wide_sum`): a `metrics_aggregator`
  for TFF's learning builders."""
  del local_unfinalized_metrics_type  # as TFF's: read from the argument

  @tff.federated_computation
  def aggregate(client_metrics):
    unfinalized_type = client_metrics.type_signature.member
    if callable(metric_finalizers):
      finalize = tff.tensorflow.computation(metric_finalizers, unfinalized_type)
    else:
      @tff.tensorflow.computation(unfinalized_type)
      def finalize(unfinalized):
        return collections.OrderedDict(
            (name, finalizer(unfinalized[name]))
            for name, finalizer in metric_finalizers.items())
    return tff.federated_map(finalize, federated_wide_sum(client_metrics))
  return aggregate
