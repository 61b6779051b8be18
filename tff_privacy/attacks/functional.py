"""The client's computation as a differentiable function of input and weights.

Attacks need d(upload)/d(input) through the exact arithmetic the client ran:
one gradient (FedSGD) or several local SGD steps (FedAvg), built on the
functional forward pass of `tff_privacy.models.functional`.
"""

from __future__ import annotations

import tensorflow as tf

from tff_privacy.models.functional import forward


def batch_loss(model, weights, x, y_soft) -> tf.Tensor:
  """Mean cross-entropy of soft (or one-hot) labels `y_soft` on logits.

  Written out rather than with the fused `tf.nn.softmax_cross_entropy_with_
  logits`, whose second-order gradient ignores the labels: DLG differentiates
  the weight gradient with respect to its dummy labels.
  """
  logits = forward(model, weights, x)
  return tf.reduce_mean(-tf.reduce_sum(y_soft * tf.nn.log_softmax(logits), -1))


def simulate_upload(model, weights, x, y_soft, upload_kind: str,
                    protocol: dict, num_examples: int | None = None):
  """What a client holding (x, y_soft) would upload from broadcast `weights`.

  'gradient': the gradient of the mean loss over the batch (FedSGD).
  'model_delta': w0 - wK after `local_epochs` passes of minibatch SGD with
  `client_learning_rate` and `batch_size` over the samples in the order given,
  the same order in every epoch since an attacker cannot know the client's
  shuffling (FedAvg; TFF's sign convention).
  """
  if upload_kind == "gradient":
    with tf.GradientTape() as tape:
      tape.watch(weights)
      loss = batch_loss(model, weights, x, y_soft)
    return tape.gradient(loss, weights)
  if upload_kind == "model_delta":
    lr = protocol["client_learning_rate"]
    bs = protocol["batch_size"]
    n = int(x.shape[0]) if num_examples is None else num_examples
    current = list(weights)
    for _ in range(protocol.get("local_epochs", 1)):
      for start in range(0, n, bs):
        with tf.GradientTape() as tape:
          tape.watch(current)
          loss = batch_loss(model, current, x[start:start + bs],
                            y_soft[start:start + bs])
        grads = tape.gradient(loss, current)
        current = [w - lr * g for w, g in zip(current, grads)]
    return [w0 - w for w0, w in zip(weights, current)]
  raise ValueError(f"upload_kind={upload_kind!r} cannot be simulated; "
                   "supported: 'gradient', 'model_delta'")
