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
* `binary_mse`: one 0/1 label per sample, one output unit whose sigmoid is
  the probability of class 1, trained on the squared error of that
  probability (RECUP-FL's Adult model: "1 sigmoid" output, MSE loss);
  accuracy at the 0.5 threshold. The data set still has 2 classes; the
  model has 1 output (`output_units`). Analytic label recovery (iDLG) is
  written for softmax outputs, so it is not offered.

Attacks differentiate a task's loss on soft (or one-hot) labels, [...,
num_classes] (`soft_loss`): DLG optimises those labels.

`evaluate` works from sums over batches (`sums`, then `scores`), so a test
set is scored in one pass of any batch size.
"""

from __future__ import annotations

import abc
from typing import Sequence

import tensorflow as tf

TASKS = ("binary_mse", "classification", "segmentation")


class Task(abc.ABC):
  name = "task"
  primary_metric = "accuracy"
  default_model = "cnn"  # a run's model when it names none (`models.MODELS`)
  labels_recoverable = False
  sum_names: tuple[str, ...] = ()

  @abc.abstractmethod
  def label_shape(self, input_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of one sample's label."""

  def output_units(self, num_classes: int) -> int:
    """The model's outputs per sample (or pixel) for `num_classes` classes."""
    return num_classes

  def predict(self, logits: tf.Tensor) -> tf.Tensor:
    """The predicted class of each sample (or pixel), int32."""
    return tf.argmax(logits, -1, output_type=tf.int32)

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

  def soft_loss(self, logits: tf.Tensor, y_soft: tf.Tensor) -> tf.Tensor:
    """The mean loss on soft (or one-hot) labels [..., num_classes], written
    out rather than with the fused cross-entropy, whose second-order
    gradient ignores the labels: DLG differentiates the weight gradient
    with respect to its dummy labels."""
    return tf.reduce_mean(self._soft_terms(logits, y_soft))

  def _soft_terms(self, logits, y_soft):
    return -tf.reduce_sum(y_soft * tf.nn.log_softmax(logits), -1)

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
    correct = tf.reduce_sum(tf.cast(tf.equal(self.predict(logits), labels),
                                    tf.float32))
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
  default_model = "unet"
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

  def _soft_terms(self, logits, y_soft):
    """Each term weighted 1 + (w - 1) y_soft[..., 1]: the weighted loss for
    one-hot labels, linear in soft ones."""
    return (super()._soft_terms(logits, y_soft)
            * (1.0 + (self.positive_weight - 1.0) * y_soft[..., 1]))

  def keras_loss(self):
    if self.positive_weight == 1.0:
      return super().keras_loss()
    return _WeightedCrossEntropy(self)

  def loss(self, logits, labels):
    return tf.reduce_mean(self.pixel_losses(logits, labels))

  def sums(self, logits, labels):
    loss = self.loss(logits, labels) * tf.cast(tf.shape(labels)[0], tf.float32)
    predicted = tf.equal(self.predict(logits), 1)
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


class _TaskLoss(tf.keras.losses.Loss):
  """A task's `loss` as a Keras loss (its own mean over the batch)."""

  def __init__(self, task):
    super().__init__(name=f"{task.name}_loss")
    self.task = task

  def call(self, y_true, y_pred):
    return self.task.loss(y_pred, y_true)


class BinaryMSE(Classification):
  name = "binary_mse"
  default_model = "mlp"  # tabular features
  labels_recoverable = False

  def output_units(self, num_classes):
    if num_classes != 2:
      raise ValueError(f"the binary_mse task needs 2 classes, got {num_classes}")
    return 1

  def probability(self, logits: tf.Tensor) -> tf.Tensor:
    """P(class 1) of each sample: the sigmoid of its one output."""
    return tf.sigmoid(logits[..., 0])

  def predict(self, logits):
    return tf.cast(logits[..., 0] > 0, tf.int32)

  def loss(self, logits, labels):
    return tf.reduce_mean(tf.square(self.probability(logits)
                                    - tf.cast(labels, tf.float32)))

  def soft_loss(self, logits, y_soft):
    return tf.reduce_mean(tf.square(self.probability(logits) - y_soft[..., 1]))

  def keras_loss(self):
    return _TaskLoss(self)

  def keras_metrics(self):
    # Keras squeezes the [N, 1] outputs to [N] first; named like
    # classification's accuracy: the key the runner reads
    return [tf.keras.metrics.MeanMetricWrapper(
        lambda y, logits: tf.cast(tf.equal(
            tf.reshape(logits, [-1]) > 0, tf.reshape(y, [-1]) > 0.5), tf.float32),
        name="sparse_categorical_accuracy")]


_TASKS = {"binary_mse": BinaryMSE, "classification": Classification,
          "segmentation": Segmentation}


def get(name: str, **kwargs) -> Task:
  """The task `name` (one of `TASKS`) with its arguments (segmentation:
  `positive_weight`)."""
  if name not in _TASKS:
    raise ValueError(f"task={name!r} is unknown; choose one of {TASKS}")
  try:
    return _TASKS[name](**kwargs)
  except TypeError:
    raise ValueError(f"task {name!r} takes no arguments {sorted(kwargs)}") from None
