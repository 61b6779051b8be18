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
(`tff.federated_aggregate`), in parts of at most `PART_ELEMENTS` entries:
TFF's runtime holds each aggregation's accumulator of every client until
that aggregation ends, so the parts bound that memory to a few MiB per
client whatever the size of the value. `WideMeanFactory` is the weighted
mean (the default model aggregator), `WideSumFactory` the unweighted sum,
`wide_sum_then_finalize` serves TFF's learning builders' metrics, and
`federated_wide_sum` and `federated_wide_mean` the project's own federated
computations. `federated_wide_total` and `federated_weighted_totals` stop
before the rounding, for rounds whose clients run in several calls
(`algorithms.personalized`): each call's float64 totals are added, and
`narrow_total` or `mean_of_totals` round the sum once. Value types are
structures with Python containers (lists, OrderedDicts), as TFF's learning
types are.
"""

from __future__ import annotations

import collections
from typing import Callable, NamedTuple, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

# float32 entries folded by one aggregation (see `_wide_total`): a float64
# accumulator of 8 MiB per client
PART_ELEMENTS = 2**20


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


def _parts(specs) -> list[list[tuple[int, int, int]]]:
  """`specs` (flat `tf.TensorSpec`s) cut into parts of at most
  `PART_ELEMENTS` entries (one part when there is nothing to cut): each
  part a list of (leaf, first row, end row) slices along the leaves' first
  axis (a scalar is its one row), whole leaves packed together in order
  and a larger leaf cut into blocks of rows."""
  parts, part, size = [], [], 0
  for i, spec in enumerate(specs):
    rows = spec.shape[0] if spec.shape.rank else 1
    row = spec.shape[1:].num_elements() if spec.shape.rank else 1
    block = max(1, PART_ELEMENTS // max(row, 1))
    for first in range(0, max(rows, 1), block):
      end = min(first + block, rows)
      if part and size + (end - first) * row > PART_ELEMENTS:
        parts.append(part)
        part, size = [], 0
      part.append((i, first, end))
      size += (end - first) * row
  return parts + [part] if part or not parts else parts


def _slice(tensor, first: int, end: int):
  return tensor[first:end] if tensor.shape.rank else tensor


def _wide_part(value, part, specs, leaves, weighted: bool, rows=None):
  """The float64 total of one part (see `_parts`) of a CLIENTS value (of
  (value, weight) pairs if `weighted`), SERVER-placed: a list of its slices.
  With `rows` (see `federated_weighted_totals`), each slice is formed from
  the client's compact value by `rows(value, leaf, first, end)`."""
  wide = [tf.TensorSpec([b - a, *specs[i].shape[1:]] if specs[i].shape.rank else [],
                        tf.float64 if leaves[i] else specs[i].dtype)
          for i, a, b in part]

  @tff.tensorflow.computation
  def zeros():
    return [tf.zeros(s.shape, s.dtype) for s in wide]

  @tff.tensorflow.computation(zeros.type_signature.result,
                              value.type_signature.member)
  def accumulate(total, client_value):
    own = client_value[0] if weighted else client_value
    flat = None if rows else tf.nest.flatten(own)
    out = []
    for t, (i, a, b) in zip(total, part):
      v = rows(own, i, a, b) if rows else _slice(flat[i], a, b)
      if weighted:  # as `tff.aggregators.MeanFactory` weighs
        v = v * tf.cast(client_value[1], v.dtype)
      out.append(t + (tf.cast(v, tf.float64) if leaves[i] else v))
    return out

  @tff.tensorflow.computation(zeros.type_signature.result,
                              zeros.type_signature.result)
  def merge(a, b):
    return [x + y for x, y in zip(a, b)]

  @tff.tensorflow.computation(zeros.type_signature.result)
  def report(total):
    return total

  return tff.federated_aggregate(value, zeros(), accumulate, merge, report)


def _wide_total(value, weighted: bool = False, expansion=None):
  """The sum of a CLIENTS value (with `weighted`, of (value, weight) pairs:
  the sum of value * weight as `tff.aggregators.MeanFactory` forms each
  product), its float32 leaves accumulated in float64: (the SERVER-placed
  total as a list of the summed type's leaves in `tf.nest` order, the
  summed type, which of its leaves are float32).

  TFF's C++ runtime keeps every client's accumulator of a
  `tff.federated_aggregate` until the aggregation ends, so one aggregation
  over the whole value would hold a float64 copy of it per client. The
  value is folded in parts of at most `PART_ELEMENTS` entries instead, one
  aggregation each, which the runtime runs one after another; every entry
  is summed by the same client-by-client fold either way. With an
  `Expansion`, the value is each client's compact form of a value of
  `expansion.value_type`, expanded part by part in the fold."""
  value_type = value.type_signature.member
  if expansion:
    summed_type = expansion.value_type
  else:
    summed_type = value_type[0] if weighted else value_type
  specs = tf.nest.flatten(tff.types.type_to_tf_tensor_specs(summed_type))
  leaves = [spec.dtype == tf.float32 for spec in specs]
  parts = _parts(specs)
  rows = expansion.rows if expansion else None
  totals = tff.federated_zip([_wide_part(value, part, specs, leaves, weighted, rows)
                              for part in parts])

  @tff.tensorflow.computation(totals.type_signature.member)
  def assemble(part_totals):
    pieces = [[] for _ in specs]
    for part, part_total in zip(parts, part_totals):
      for (i, _, _), t in zip(part, part_total):
        pieces[i].append(t)
    return [tf.concat(p, 0) if len(p) > 1 else p[0] for p in pieces]

  return tff.federated_map(assemble, totals), summed_type, leaves


def _narrow(flat, leaves: list[bool], summed_type):
  """The float64 leaves `flat` of a total cast back to float32 where
  `leaves` says, packed as `summed_type`."""
  return tf.nest.pack_sequence_as(
      tff.types.type_to_tf_tensor_specs(summed_type),
      [tf.cast(t, tf.float32) if cast else t for t, cast in zip(flat, leaves)])


def federated_wide_total(value):
  """The float64 total of a CLIENTS value, before `federated_wide_sum`
  rounds it (SERVER-placed, a list of the value's leaves in `tf.nest`
  order). Totals of disjoint sets of clients add, in float64, to the total
  of their union (see the module docstring on grouping); `narrow_total`
  then rounds it as `federated_wide_sum` does. Call it inside a federated
  computation."""
  return _wide_total(value)[0]


def narrow_total(value_type) -> tff.Computation:
  """The TF computation that rounds a `federated_wide_total` of values of
  `value_type` to their sum, as `federated_wide_sum` returns it."""
  wide, leaves = _wide_specs(value_type)

  @tff.tensorflow.computation(wide)
  def narrow(flat):
    return _narrow(flat, leaves, value_type)
  return narrow


def _wide_specs(value_type) -> tuple[list[tf.TensorSpec], list[bool]]:
  """The flat specs of a float64 total of `value_type` (its float32 leaves
  widened), and which leaves were float32."""
  specs = tf.nest.flatten(tff.types.type_to_tf_tensor_specs(value_type))
  leaves = [spec.dtype == tf.float32 for spec in specs]
  return [tf.TensorSpec(s.shape, tf.float64 if cast else s.dtype)
          for s, cast in zip(specs, leaves)], leaves


def federated_wide_sum(value):
  """`tff.federated_sum` of a CLIENTS value, its float32 leaves accumulated
  in float64 (see the module docstring); call it inside a federated
  computation."""
  return tff.federated_map(narrow_total(value.type_signature.member),
                           federated_wide_total(value))


def federated_wide_mean(value):
  """`tff.federated_mean` (unweighted) of a CLIENTS value of float32
  leaves, the sum accumulated in float64 and divided before the one
  rounding to float32."""
  member = value.type_signature.member
  if not all(_float32_leaves(member)):
    raise TypeError(f"federated_wide_mean takes float32 values, not {member}")
  total, _, leaves = _wide_total(value)
  count = tff.federated_sum(tff.federated_value(np.int32(1), tff.CLIENTS))

  @tff.tensorflow.computation(total.type_signature.member, np.int32)
  def divide(flat, clients):
    return _narrow([t / tf.cast(clients, tf.float64) for t in flat], leaves, member)
  return tff.federated_map(divide, (total, count))


class WideSumFactory(tff.aggregators.UnweightedAggregationFactory):
  """`tff.aggregators.SumFactory` accumulated in float64 (see the module
  docstring): a sum that does not depend on how clients are grouped."""

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


class WideMeanFactory(tff.aggregators.WeightedAggregationFactory):
  """`tff.aggregators.MeanFactory` over two `WideSumFactory`s, to the bit:
  sum_i (value_i * weight_i) / sum_i weight_i, each product rounded to the
  value's dtype, both sums accumulated in float64 and rounded once, then
  divided. Each client's product is formed inside the fold (`_wide_total`)
  rather than by a `federated_map` first, which the runtime would hold for
  every client until the round ends. State and measurements have
  `MeanFactory`'s layout, so checkpoints of either load in both."""

  def create(self, value_type, weight_type) -> tff.templates.AggregationProcess:
    specs = tf.nest.flatten(tff.types.type_to_tf_tensor_specs(value_type))
    if not all(spec.dtype.is_floating for spec in specs):
      raise TypeError(f"WideMeanFactory averages float values, not {value_type}")

    @tff.federated_computation()
    def initialize():
      return tff.federated_value(collections.OrderedDict(
          value_sum_process=(), weight_sum_process=()), tff.SERVER)

    @tff.federated_computation(initialize.type_signature.result,
                               tff.FederatedType(value_type, tff.CLIENTS),
                               tff.FederatedType(weight_type, tff.CLIENTS))
    def next_fn(state, value, weight):
      mean = tff.federated_map(mean_of_totals(value_type, weight_type),
                               federated_weighted_totals(value, weight))
      return tff.templates.MeasuredProcessOutput(
          state=state, result=mean,
          measurements=tff.federated_value(MEAN_MEASUREMENTS, tff.SERVER))

    return tff.templates.AggregationProcess(initialize, next_fn)


# what `WideMeanFactory` measures (`MeanFactory`'s layout)
MEAN_MEASUREMENTS = collections.OrderedDict(mean_value=(), mean_weight=())


class Expansion(NamedTuple):
  """Client values given in a compact form that the fold expands (see
  `federated_weighted_totals`).

  Attributes:
    value_type: the TFF type of one client's expanded value.
    rows: a TensorFlow function (compact value, leaf, first, end) -> rows
      [first, end) of the expanded value's `leaf`-th tensor (in `tf.nest`
      order; a scalar is its one row).
  """
  value_type: tff.Type
  rows: Callable


def federated_weighted_totals(value, weight, expansion: Optional[Expansion] = None):
  """`WideMeanFactory`'s sums before it rounds and divides them: the
  SERVER-placed `OrderedDict(value=..., weight=...)` of the float64 totals
  (as `federated_wide_total` gives them) of value * weight, each product
  formed inside the fold, and of the weights. Totals of disjoint sets of
  clients add to their union's; `mean_of_totals` finishes the mean.

  With an `expansion`, `value` holds each client's compact form, and the
  fold forms each part of the client's value from it by `expansion.rows`
  just before adding it: TFF's runtime then holds the compact forms of the
  clients, not their values, until the aggregation ends."""
  return tff.federated_zip(collections.OrderedDict(
      value=_wide_total(tff.federated_zip((value, weight)), weighted=True,
                        expansion=expansion)[0],
      weight=federated_wide_total(weight)))


def mean_of_totals(value_type, weight_type) -> tff.Computation:
  """The TF computation that turns `federated_weighted_totals` into
  `WideMeanFactory`'s mean: each total rounded once, then divided."""
  wide_value, value_leaves = _wide_specs(value_type)
  wide_weight, weight_leaves = _wide_specs(weight_type)

  @tff.tensorflow.computation(collections.OrderedDict(value=wide_value,
                                                      weight=wide_weight))
  def divide(totals):
    mean = _narrow(totals["value"], value_leaves, value_type)
    weights = _narrow(totals["weight"], weight_leaves, weight_type)
    return tf.nest.map_structure(
        lambda t: tf.math.divide(t, tf.cast(weights, t.dtype)), mean)
  return divide


def wide_mean_factory() -> WideMeanFactory:
  """TFF's weighted mean with both of its sums accumulated in float64."""
  return WideMeanFactory()


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
