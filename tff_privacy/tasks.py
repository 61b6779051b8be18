"""What a model is trained to do: its labels, loss, metrics and scoring.

A `Task` lets classification and pixel segmentation run through the same
ModelSpec, TFF model, runner and evaluator:

* `classification`: one integer label per sample; cross-entropy on the
  logits; accuracy. Labels can be recovered from a gradient (iDLG).
* `segmentation`: one integer label per pixel (0 pristine, 1 tampered for
  FedRE's tamper detection); per-pixel cross-entropy (the paper's L_CE;
  `positive_weight` w > 1 weighs class-1 pixels w times, mean of
  w_p * CE_p over all pixels, for rare tampered pixels); IoU, precision,
  recall and F-score of class 1 over all test pixels (0 where undefined: no
  predicted or no true positive pixel). No analytic label recovery.

`evaluate` works from sums over batches (`sums`, then `scores`), so a test
set is scored in one pass of any batch size.
"""

from __future__ import annotations

import abc
from typing import Sequence

import tensorflow as tf

TASKS = ("classification", "segmentation")


class Task(abc.ABC):
  name = "task"
  primary_metric = "accuracy"
  labels_recoverable = False
  sum_names: tuple[str, ...] = ()

  @abc.abstractmethod
  def label_shape(self, input_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of one sample's label."""

  def keras_loss(self) -> tf.keras.losses.Loss:
    """The training loss, on logits (mean over samples and pixels)."""
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def keras_metrics(self) -> list[tf.keras.metrics.Metric]:
    """TFF's training metrics."""
    return [tf.keras.metrics.SparseCategoricalAccuracy()]

  def loss(self, logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """The mean loss of a batch, as a function (PSI, attacks)."""
    return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
        labels, logits, from_logits=True))

  @abc.abstractmethod
  def sums(self, logits: tf.Tensor, labels: tf.Tensor) -> list[tf.Tensor]:
    """Per-batch sums (`sum_names`) that `scores` turns into metrics."""

  @abc.abstractmethod
  def scores(self, sums: Sequence[float], count: int) -> dict[str, float]:
    """Metrics from the sums over `count` samples."""


class Classification(Task):
  name = "classification"
  primary_metric = "accuracy"
  labels_recoverable = True
  sum_names = ("loss", "correct")

  def label_shape(self, input_shape):
    return ()

  def sums(self, logits, labels):
    loss = self.loss(logits, labels) * tf.cast(tf.shape(labels)[0], tf.float32)
    correct = tf.reduce_sum(tf.cast(tf.equal(
        tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32))
    return [loss, correct]

  def scores(self, sums, count):
    loss, correct = sums
    count = max(count, 1)
    return {"accuracy": correct / count, "loss": loss / count}


class _WeightedCrossEntropy(tf.keras.losses.Loss):
  """Keras' form of `Segmentation.loss` with a positive weight."""

  def __init__(self, task):
    super().__init__(name="weighted_cross_entropy")
    self.task = task

  def call(self, y_true, y_pred):
    return self.task.pixel_losses(y_pred, y_true)


class Segmentation(Task):
  name = "segmentation"
  primary_metric = "f_score"
  labels_recoverable = False
  sum_names = ("loss", "true_positive", "false_positive", "false_negative")

  def __init__(self, positive_weight: float = 1.0):
    if not positive_weight > 0:
      raise ValueError(f"positive_weight must be > 0, got {positive_weight}")
    self.positive_weight = float(positive_weight)

  def label_shape(self, input_shape):
    return tuple(input_shape[:2])

  def pixel_losses(self, logits, labels):
    """w_p * CE_p per pixel [N, H, W]."""
    labels = tf.cast(labels, tf.int32)
    ce = tf.keras.losses.sparse_categorical_crossentropy(labels, logits,
                                                         from_logits=True)
    return ce * tf.where(tf.equal(labels, 1), self.positive_weight, 1.0)

  def keras_loss(self):
    if self.positive_weight == 1.0:
      return super().keras_loss()
    return _WeightedCrossEntropy(self)

  def loss(self, logits, labels):
    return tf.reduce_mean(self.pixel_losses(logits, labels))

  def sums(self, logits, labels):
    loss = self.loss(logits, labels) * tf.cast(tf.shape(labels)[0], tf.float32)
    predicted = tf.equal(tf.argmax(logits, -1, output_type=tf.int32), 1)
    true = tf.equal(labels, 1)

    def count(a, b):
      return tf.reduce_sum(tf.cast(tf.logical_and(a, b), tf.float32))
    return [loss, count(predicted, true), count(predicted, ~true),
            count(~predicted, true)]

  def scores(self, sums, count):
    loss, tp, fp, fn = sums

    def ratio(a, b):
      return a / b if b > 0 else 0.0
    precision, recall = ratio(tp, tp + fp), ratio(tp, tp + fn)
    return {"iou": ratio(tp, tp + fp + fn), "precision": precision,
            "recall": recall,
            "f_score": ratio(2 * precision * recall, precision + recall),
            "loss": loss / max(count, 1)}


_TASKS = {"classification": Classification, "segmentation": Segmentation}


def get(name: str, **kwargs) -> Task:
  """The task `name` (one of `TASKS`) with its arguments (segmentation:
  `positive_weight`)."""
  if name not in _TASKS:
    raise ValueError(f"task={name!r} is unknown; choose one of {TASKS}")
  try:
    return _TASKS[name](**kwargs)
  except TypeError:
    raise ValueError(f"task {name!r} takes no arguments {sorted(kwargs)}") from None
