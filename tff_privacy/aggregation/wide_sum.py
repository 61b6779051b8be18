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
are. `WideSumFactory` serves `tff.aggregators.MeanFactory`,
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


def federated_wide_sum(value):
  """`tff.federated_sum` of a CLIENTS value, its float32 leaves accumulated
  in float64 (see the module docstring); call it inside a federated
  computation."""
  value_type = value.type_signature.member
  leaves = _float32_leaves(value_type)
  widen = _recast(value_type, leaves, tf.float64)
  total = tff.federated_sum(tff.federated_map(widen, value))
  return tff.federated_map(
      _recast(widen.type_signature.result, leaves, tf.float32), total)


def federated_wide_mean(value):
  """`tff.federated_mean` (unweighted) of a CLIENTS value of float32
  leaves, the sum accumulated in float64 and divided before the one
  rounding to float32."""
  value_type = value.type_signature.member
  leaves = _float32_leaves(value_type)
  if not all(leaves):
    raise TypeError(f"federated_wide_mean takes float32 values, not {value_type}")
  widen = _recast(value_type, leaves, tf.float64)
  total = tff.federated_sum(tff.federated_map(widen, value))
  count = tff.federated_sum(tff.federated_value(np.int32(1), tff.CLIENTS))

  @tff.tensorflow.computation(widen.type_signature.result, np.int32)
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
