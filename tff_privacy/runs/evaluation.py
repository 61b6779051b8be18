"""The evaluation of a global model on the test set, in chunks that
bound its memory (`Evaluator`)."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from tff_privacy import models

EVAL_BATCH = 64  # samples evaluated at once: a U-Net's activations bound the memory
EVAL_CHUNK = 16 * EVAL_BATCH  # samples an evaluation holds at once


class _NotRetracing(logging.Filter):
  """Drops TensorFlow's retracing warning about Evaluator functions: each
  Evaluator traces its functions once, and TensorFlow's detector counts
  those traces over every instance (a leaderboard process makes one per
  row), which is not retracing."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ("triggered tf.function retracing" in message
                and "Evaluator." in message)


def _quiet_retracing_warnings() -> None:
  logger = tf.get_logger()
  if not any(isinstance(f, _NotRetracing) for f in logger.filters):
    logger.addFilter(_NotRetracing())


def _eval_chunks(count: int, indices: Optional[np.ndarray]):
  """(positions, samples) of each `EVAL_CHUNK` of `count` samples: a slice
  of the positions, and the samples' indices there (the slice itself
  where `indices` is None)."""
  for start in range(0, count, EVAL_CHUNK):
    positions = slice(start, start + EVAL_CHUNK)
    yield positions, positions if indices is None else indices[positions]


class Evaluator:
  """The task's metrics (`tff_privacy.tasks`) of a model given its weights
  on given samples, in plain TensorFlow (one trace for every weights and
  sample count)."""

  def __init__(self, spec: models.ModelSpec):
    self._model = spec.keras()
    self.task = spec.task_object
    weights = [tf.TensorSpec(v.shape, v.dtype)
               for v in self._model.trainable_variables]
    _quiet_retracing_warnings()
    self._sums = tf.function(self._sums_fn, input_signature=[
        weights, tf.TensorSpec((None,) + spec.input_shape, tf.float32),
        tf.TensorSpec((None,) + self.task.label_shape(spec.input_shape), tf.int32)])
    self._group_sums = tf.function(self._group_sums_fn, input_signature=[
        weights, tf.TensorSpec((None,) + spec.input_shape, tf.float32),
        tf.TensorSpec((None,) + self.task.label_shape(spec.input_shape), tf.int32),
        tf.TensorSpec((None,), tf.int32), tf.TensorSpec((), tf.int32)])

  def _sums_fn(self, weights, x, y):
    for v, w in zip(self._model.trainable_variables, weights):
      v.assign(w)
    totals = tf.zeros([len(self.task.sum_names)])
    for xb, yb in tf.data.Dataset.from_tensor_slices((x, y)).batch(EVAL_BATCH):
      totals += tf.stack(self.task.sums(self._model(xb, training=False), yb))
    return totals

  def _group_sums_fn(self, weights, x, y, groups, num_groups):
    for v, w in zip(self._model.trainable_variables, weights):
      v.assign(w)
    totals = tf.zeros([num_groups, len(self.task.sum_names)])
    for xb, yb, gb in tf.data.Dataset.from_tensor_slices((x, y, groups)).batch(EVAL_BATCH):
      per_sample = tf.vectorized_map(
          lambda pair: tf.stack(self.task.sums(pair[0][None], pair[1][None])),
          (self._model(xb, training=False), yb))
      totals += tf.math.unsorted_segment_sum(per_sample, gb, num_groups)
    return totals

  def scores(self, weights: Sequence[np.ndarray], x: np.ndarray,
             y: np.ndarray, indices: Optional[np.ndarray] = None
             ) -> dict[str, float]:
    """Every metric of the task on (x, y), or on its samples `indices`; an
    empty set is refused. Reads `EVAL_CHUNK` samples at a time, so the
    memory it takes does not grow with the set (x may be a memmap)."""
    count = len(y) if indices is None else len(indices)
    if not count:
      raise ValueError("no samples to score: a model has no metrics on an "
                       "empty set")
    weights = [tf.constant(w) for w in weights]
    sums = np.zeros(len(self.task.sum_names))
    for _, samples in _eval_chunks(count, indices):
      sums += self._sums(weights, x[samples], y[samples]).numpy()
    return self.task.scores([float(v) for v in sums], count)

  def scores_by_group(self, weights: Sequence[np.ndarray], x: np.ndarray,
                      y: np.ndarray, groups: np.ndarray, num_groups: int,
                      indices: Optional[np.ndarray] = None
                      ) -> list[Optional[dict[str, float]]]:
    """Every metric of the task on each group of (x, y), or of its samples
    `indices` (`groups` holds each of those samples' group in [0,
    num_groups)), one model, in one pass: the same as `scores` on each
    group's samples, without a call per group; None for a group without
    samples."""
    weights = [tf.constant(w) for w in weights]
    groups = np.asarray(groups, np.int32)
    sums = np.zeros((num_groups, len(self.task.sum_names)))
    for positions, samples in _eval_chunks(len(groups), indices):
      sums += self._group_sums(weights, x[samples], y[samples],
                               groups[positions], num_groups).numpy()
    counts = np.bincount(groups, minlength=num_groups)
    return [self.task.scores([float(v) for v in sums[g]], int(counts[g]))
            if counts[g] else None for g in range(num_groups)]

  def __call__(self, weights: Sequence[np.ndarray], x: np.ndarray,
               y: np.ndarray) -> tuple[float, float]:
    """(the task's primary metric, e.g. accuracy; mean loss) on (x, y)."""
    scores = self.scores(weights, x, y)
    return scores[self.task.primary_metric], scores["loss"]
