"""Differential-privacy mechanisms as tensorflow-privacy `DPQuery` objects.

tensorflow-privacy draws its noise from unseeded random ops, so two runs of
the same configuration differ and, inside a TFF computation traced once, a
graph-level seed would repeat the same noise every round. The queries here
keep a stateless-RNG seed in their global state instead: the noise is a pure
function of that seed, `get_noised_result` returns the state with the seed
advanced, and a client can run a query under its own seed
(`with_seed(global_state, seed)`) for local DP.

* `SeededGaussianSumQuery`: tensorflow-privacy's `GaussianSumQuery` (L2 clip
  of each record, N(0, stddev^2) on the sum) with seeded noise.
* `LayerwiseGaussianQuery`: a `NestedSumQuery` of those, one per tensor of the
  model: layer l is clipped to C_l and receives N(0, (C_l sigma_l)^2).
* `LaplaceSumQuery`: clipping plus Laplace noise of scale b, which
  tensorflow-privacy lacks.
* `CanaryClientsQuery`: `SeededGaussianSumQuery` with canary clients in
  its sum, for the audit of a whole training.

All are `SumAggregationDPQuery`s, so TFF's `DifferentiallyPrivateFactory`
accepts them too.
"""

from __future__ import annotations

import collections
from typing import Sequence

import dp_accounting
import numpy as np
import tensorflow as tf
from tensorflow_privacy.privacy.dp_query import dp_query, gaussian_query
from tensorflow_privacy.privacy.dp_query.nested_query import NestedSumQuery

NORMS = ("l1", "l2")


def _seed(seed) -> tf.Tensor:
  """A stateless-RNG seed (shape [2], int64) from an int or a pair."""
  seed = tf.cast(tf.convert_to_tensor(seed), tf.int64)
  return tf.stack([seed, tf.constant(0, tf.int64)]) if seed.shape.rank == 0 else seed


def _split(seed: tf.Tensor, n: int) -> list[tf.Tensor]:
  """n + 1 independent seeds: one per leaf and the next state's seed."""
  seeds = tf.random.experimental.stateless_split(seed, num=n + 1)
  return [seeds[i] for i in range(n + 1)]


def _check_positive(name: str, value: float) -> None:
  if not np.all(np.asarray(value) > 0):
    raise ValueError(f"{name} must be > 0, got {value}")


def _check_non_negative(name: str, value: float) -> None:
  if not np.all(np.asarray(value) >= 0):
    raise ValueError(f"{name} must be >= 0, got {value}")


class SeededGaussianSumQuery(gaussian_query.GaussianSumQuery):
  """`GaussianSumQuery` whose noise comes from a seed in its global state."""

  _GlobalState = collections.namedtuple("_GlobalState",
                                        ["l2_norm_clip", "stddev", "seed"])

  def __init__(self, l2_norm_clip: float, stddev: float, seed=0):
    _check_positive("l2_norm_clip", l2_norm_clip)
    _check_non_negative("stddev", stddev)
    super().__init__(l2_norm_clip, stddev)
    self._seed = seed

  def make_global_state(self, l2_norm_clip, stddev, seed=0):
    return self._GlobalState(tf.cast(l2_norm_clip, tf.float32),
                             tf.cast(stddev, tf.float32), _seed(seed))

  def initial_global_state(self):
    return self.make_global_state(self._l2_norm_clip, self._stddev, self._seed)

  def get_noised_result(self, sample_state, global_state):
    leaves = tf.nest.flatten(sample_state)
    seeds = _split(global_state.seed, len(leaves))
    noised = [v + tf.cast(tf.random.stateless_normal(
        tf.shape(v), seed=s, stddev=global_state.stddev), v.dtype)
              for v, s in zip(leaves, seeds)]
    result = tf.nest.pack_sequence_as(sample_state, noised)
    event = dp_accounting.GaussianDpEvent(
        global_state.stddev / global_state.l2_norm_clip)
    return result, global_state._replace(seed=seeds[-1]), event


# folded into a round's seed for which canary clients take part
_CANARY_STREAM = 2**31 - 3


def canary_directions(shapes: Sequence[Sequence[int]], count: int, seed: int
                      ) -> list[tf.Tensor]:
  """`count` random directions over tensors of `shapes`, each of global L2
  norm 1: one tensor [count, *shape] per shape, a pure function of `seed`
  (the same in a TFF computation and eagerly)."""
  parts = [tf.random.stateless_normal([count, *s], seed=[seed, 7919 + i])
           for i, s in enumerate(shapes)]
  squares = tf.add_n([tf.reduce_sum(tf.reshape(p, [count, -1]) ** 2, axis=1)
                      for p in parts])
  norms = tf.sqrt(squares)
  return [p / tf.reshape(norms, [count] + [1] * len(s)) for p, s in zip(parts, shapes)]


def inserted_canaries(count: int, seed: int) -> np.ndarray:
  """bool[count]: which canary clients take part in training, each with
  probability 1/2 (the others are held out)."""
  return np.random.default_rng([seed, 7919]).random(count) < 0.5


class CanaryClientsQuery(SeededGaussianSumQuery):
  """`SeededGaussianSumQuery` whose sum holds canary clients beside the
  real ones, for the audit of a whole training (Andrew et al., ICLR 2024).

  `canaries` canary clients have fixed random directions u_j
  (`canary_directions`); half of them are inserted (`inserted_canaries`),
  the others held out. Each round, each inserted canary takes part with
  probability `rate` (drawn from the round's seed), and its update, u_j at
  or past the clip norm, enters the sum clipped: C u_j, before the noise,
  as a real client's would. The round's noise is the parent's, from the
  same seed."""

  def __init__(self, l2_norm_clip: float, stddev: float, seed=0, *,
               canaries: int, rate: float):
    super().__init__(l2_norm_clip, stddev, seed)
    if not isinstance(canaries, int) or canaries < 2:
      raise ValueError(f"canaries must be an integer >= 2, got {canaries!r}")
    if not 0 < rate <= 1:
      raise ValueError(f"rate must lie in (0, 1], got {rate}")
    self.canaries, self.rate, self.canary_seed = canaries, rate, int(seed)

  def get_noised_result(self, sample_state, global_state):
    leaves = tf.nest.flatten(sample_state)
    directions = canary_directions([v.shape for v in leaves], self.canaries,
                                   self.canary_seed)
    joins = tf.random.stateless_uniform(
        [self.canaries], tf.random.experimental.stateless_fold_in(
            global_state.seed, _CANARY_STREAM)) < self.rate
    weights = global_state.l2_norm_clip * tf.cast(
        joins & inserted_canaries(self.canaries, self.canary_seed), tf.float32)
    with_canaries = [v + tf.tensordot(weights, d, axes=1)
                     for v, d in zip(leaves, directions)]
    return super().get_noised_result(
        tf.nest.pack_sequence_as(sample_state, with_canaries), global_state)


class LaplaceSumQuery(dp_query.SumAggregationDPQuery):
  """Clips each record to norm C and adds Laplace(0, b) noise to the sum.

  With `norm='l1'` (default) the L1 sensitivity is C, and the DP event is
  the Laplace mechanism with noise multiplier b / C. `norm='l2'` clips the L2
  norm as RECUP-FL's phi_l and FedEM's LDP baseline do; the L1 sensitivity is
  then sqrt(d) C for d coordinates, which the event uses.
  """

  _GlobalState = collections.namedtuple("_GlobalState", ["norm_clip", "scale", "seed"])

  def __init__(self, norm_clip: float, scale: float, norm: str = "l1", seed=0):
    _check_positive("norm_clip", norm_clip)
    _check_non_negative("scale", scale)
    if norm not in NORMS:
      raise ValueError(f"norm={norm!r}; choose one of {NORMS}")
    self._norm_clip, self._scale, self._norm, self._seed = norm_clip, scale, norm, seed

  def initial_global_state(self):
    return self._GlobalState(tf.constant(self._norm_clip, tf.float32),
                             tf.constant(self._scale, tf.float32), _seed(self._seed))

  def derive_sample_params(self, global_state):
    return global_state.norm_clip

  def preprocess_record(self, params, record):
    leaves = tf.nest.flatten(record)
    if self._norm == "l2":
      clipped, _ = tf.clip_by_global_norm(leaves, params)
    else:
      l1 = tf.add_n([tf.reduce_sum(tf.abs(v)) for v in leaves])
      factor = tf.minimum(1.0, params / tf.maximum(l1, 1e-12))
      clipped = [v * factor for v in leaves]
    return tf.nest.pack_sequence_as(record, clipped)

  def get_noised_result(self, sample_state, global_state):
    leaves = tf.nest.flatten(sample_state)
    seeds = _split(global_state.seed, len(leaves))
    noised = [v + laplace_noise(tf.shape(v), global_state.scale, s, v.dtype)
              for v, s in zip(leaves, seeds)]
    result = tf.nest.pack_sequence_as(sample_state, noised)
    sensitivity = global_state.norm_clip
    if self._norm == "l2":
      dims = sum(int(np.prod(v.shape)) for v in leaves)
      sensitivity = sensitivity * np.sqrt(dims)
    event = dp_accounting.LaplaceDpEvent(global_state.scale / sensitivity)
    return result, global_state._replace(seed=seeds[-1]), event


def laplace_noise(shape, scale, seed, dtype=tf.float32) -> tf.Tensor:
  """Laplace(0, scale) samples by inverse CDF of a stateless uniform."""
  u = tf.random.stateless_uniform(shape, seed=seed, minval=-0.5, maxval=0.5)
  u = tf.clip_by_value(u, -0.5 + 1e-7, 0.5 - 1e-7)
  return tf.cast(-scale * tf.sign(u) * tf.math.log1p(-2.0 * tf.abs(u)), dtype)


class LayerwiseGaussianQuery(NestedSumQuery):
  """Per-layer Gaussian mechanism: one clip C_l and noise multiplier sigma_l
  per tensor; layer l is clipped to C_l and gets N(0, (C_l sigma_l)^2) noise.

  Records are lists of tensors in the model's trainable-variable order.
  """

  def __init__(self, l2_norm_clips: Sequence[float],
               noise_multipliers: Sequence[float], seed=0):
    if len(l2_norm_clips) != len(noise_multipliers):
      raise ValueError(f"l2_norm_clips has {len(l2_norm_clips)} entries but "
                       f"noise_multipliers has {len(noise_multipliers)}")
    _check_positive("l2_norm_clips", l2_norm_clips)
    _check_non_negative("noise_multipliers", noise_multipliers)
    self.l2_norm_clips = [float(c) for c in l2_norm_clips]
    self.noise_multipliers = [float(s) for s in noise_multipliers]
    self._seed = seed
    super().__init__([
        SeededGaussianSumQuery(c, c * s)
        for c, s in zip(self.l2_norm_clips, self.noise_multipliers)])

  def initial_global_state(self):
    """Each layer's noise seed is folded from the query's seed and the layer
    index here, in TensorFlow, so the query can be built and used inside a
    `tf.function` or a TFF computation."""
    return with_seed(self, super().initial_global_state(), self._seed)


def with_seed(query: dp_query.DPQuery, global_state, seed):
  """`global_state` with every seed replaced by one derived from `seed`
  (distinct per nested sub-query), for a client running the query locally."""
  base = _seed(seed)

  def replace(state, index):
    if hasattr(state, "seed"):
      return state._replace(seed=tf.random.experimental.stateless_fold_in(base, index))
    return state

  if isinstance(query, NestedSumQuery):
    return type(global_state)(replace(s, i) for i, s in enumerate(global_state))
  return replace(global_state, 0)
