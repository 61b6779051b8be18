"""The client's computation as a differentiable function of input and weights.

Attacks need d(upload)/d(input) through the exact arithmetic the client ran:
one gradient (FedSGD) or several local SGD steps (FedAvg), built on the
functional forward pass of `tff_privacy.models.functional` and the local
schedule of `tff_privacy.protocol` that the runner also follows.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tff_privacy import tasks
from tff_privacy.models.functional import forward
from tff_privacy.protocol import local_batch_sizes

CLASSIFICATION = tasks.get("classification")


def batch_loss(model, weights, x, y_soft, task: tasks.Task = CLASSIFICATION,
               records: bool = False) -> tf.Tensor:
  """The `task`'s mean loss (`Task.soft_loss`) of soft (or one-hot) labels
  `y_soft` on the model's outputs at `weights`. With `records` (weights
  stacked over records, x and y_soft [R, B, ...]; see
  `tff_privacy.models.functional`), the sum over records of each record's
  mean loss, whose gradient with respect to the stacked weights holds every
  record's own gradient. Every task's loss is a mean over equally many
  terms per record, so that sum is R times the mean over all records."""
  logits = forward(model, weights, x, records=records)
  if not records:
    return task.soft_loss(logits, y_soft)
  fold = lambda t: tf.reshape(t, [-1] + t.shape[2:].as_list())
  return logits.shape[0] * task.soft_loss(fold(logits), fold(y_soft))


def local_sgd(model, weights, x_seq, y_seq, learning_rate: float,
              batch_sizes: Sequence[int], momentum: float = 0.0,
              weight_decay: float = 0.0, optimizer: str = "sgd",
              task: tasks.Task = CLASSIFICATION, records: bool = False
              ) -> list[tf.Tensor]:
  """w0 - wK after local steps over consecutive batches of the sample
  sequence (x_seq, y_seq) cut to `batch_sizes` (TFF's sign convention).

  'sgd': with `momentum` or `weight_decay`, PyTorch's SGD (b = momentum b +
  g + weight_decay w; w = w - learning_rate b, b starting at 0), which is
  TFF's `build_sgdm` when `weight_decay` is 0. 'adam': TFF's `build_adam`
  (m += (1 - 0.9)(g - m), v += (1 - 0.999)(g^2 - v), w -= lr sqrt(1 -
  0.999^t) / (1 - 0.9^t) m / (sqrt(v) + 1e-7), moments starting at 0).
  With `records`, the samples are on axis 1 and every record steps its own
  stacked weights (`batch_loss`)."""
  cut = ((lambda t, a, b: t[:, a:b]) if records else (lambda t, a, b: t[a:b]))
  current, start = list(weights), 0
  first = [tf.zeros_like(w) for w in current]
  second = [tf.zeros_like(w) for w in current]
  for step, size in enumerate(batch_sizes, start=1):
    with tf.GradientTape() as tape:
      tape.watch(current)
      loss = batch_loss(model, current, cut(x_seq, start, start + size),
                        cut(y_seq, start, start + size), task, records)
    grads = tape.gradient(loss, current)
    if optimizer == "adam":
      first = [m + (g - m) * (1 - 0.9) for m, g in zip(first, grads)]
      second = [v + (tf.square(g) - v) * (1 - 0.999) for v, g in zip(second, grads)]
      rate = learning_rate * (1 - 0.999 ** step) ** 0.5 / (1 - 0.9 ** step)
      current = [w - rate * m / (tf.sqrt(v) + 1e-7)
                 for w, m, v in zip(current, first, second)]
    else:
      first = [momentum * b + g + weight_decay * w
               for w, g, b in zip(current, grads, first)]
      current = [w - learning_rate * b for w, b in zip(current, first)]
    start += size
  return [w0 - w for w0, w in zip(weights, current)]


def learning_rate(protocol: dict) -> float:
  """The clients' learning rate a protocol states (FedAvg's
  `client_learning_rate`, the DP baselines' `learning_rate`)."""
  return protocol.get("client_learning_rate", protocol.get("learning_rate"))


def simulate_upload(model, weights, x, y_soft, upload_kind: str,
                    protocol: dict, num_examples: int | None = None,
                    task: tasks.Task = CLASSIFICATION, records: bool = False):
  """What a client holding (x, y_soft) would upload from broadcast `weights`,
  training on `task`'s loss (`batch_loss`).

  'gradient': the gradient of the mean loss over the batch (FedSGD).
  'model_delta': w0 - wK after `local_epochs` passes of minibatch SGD with
  the protocol's learning rate (`client_learning_rate`, or `learning_rate`),
  momentum (`client_momentum` or `momentum`) and `weight_decay`, or of Adam
  where its `client_optimizer` is 'adam', batches cut
  by `local_batch_sizes`, the samples in the order given in every epoch,
  since an attacker cannot know the client's shuffling (FedAvg; TFF's sign
  convention). A DP client's clipping and noise are not simulated: the
  attacker cannot know the noise. With `records`, the uploads of R clients
  at once: weights, x and y_soft stacked on a leading record axis, the
  uploads too.
  """
  if upload_kind == "gradient":
    with tf.GradientTape() as tape:
      tape.watch(weights)
      loss = batch_loss(model, weights, x, y_soft, task, records)
    return tape.gradient(loss, weights)
  if upload_kind == "model_delta":
    axis = 1 if records else 0
    n = int(x.shape[axis]) if num_examples is None else num_examples
    epochs = protocol.get("local_epochs", 1)
    sizes = local_batch_sizes(n, protocol["batch_size"], epochs)
    return local_sgd(
        model, weights, tf.concat([x] * epochs, axis),
        tf.concat([y_soft] * epochs, axis),
        learning_rate(protocol), sizes, protocol.get("client_momentum", protocol.get("momentum", 0.0)),
        protocol.get("weight_decay", 0.0),
        "adam" if protocol.get("client_optimizer") == "adam" else "sgd", task,
        records)
  raise ValueError(f"upload_kind={upload_kind!r} cannot be simulated; "
                   "supported: 'gradient', 'model_delta'")
