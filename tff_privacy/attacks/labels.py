"""Analytic label recovery from the last layer's upload (iDLG and beyond).

For softmax cross-entropy the gradient of the mean loss with respect to the
last layer's bias is g_c = mean_i (p_ic - y_ic). With one sample only the
true class has g_c < 0 (Zhao et al. 2020, iDLG). For a batch of B samples the
label counts are n_c = B * (pbar_c - g_c), where pbar_c, the batch's mean
predicted probability, is estimated from the broadcast model on random inputs
in the data range (the 'impact' estimate of Wainakh et al. 2022); the counts
are rounded to sum to B by largest remainder. A model delta of FedAvg is the
learning rate times the sum of the local gradients, so it is rescaled by the
number of local steps and the learning rate first. Without a last-layer bias
the column sums of the last kernel's gradient (for non-negative features) play
the same role for a single sample.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tff_privacy.attacks import functional
from tff_privacy.attacks.refusal import UploadRefused
from tff_privacy.protocol import local_batch_sizes


def _last_layer_signal(upload, num_classes: int) -> tuple[np.ndarray, bool]:
  """(per-class signal, is_bias): the last bias gradient, else kernel sums."""
  last = np.asarray(upload[-1])
  if last.ndim == 1 and last.shape[0] == num_classes:
    return last, True
  kernel = np.asarray(upload[-1] if last.ndim == 2 else upload[-2])
  return kernel.sum(axis=0), False


def mean_gradient(upload, upload_kind: str, protocol: dict, num_examples: int):
  """The upload expressed as an average per-step gradient.

  A model delta of T steps of SGD with learning rate lr and momentum mu on a
  constant gradient g is lr g sum_{k=1..T} (1 - mu^k) / (1 - mu) (lr T g
  without momentum); the upload is divided by that factor."""
  if upload_kind == "gradient":
    return upload
  if protocol.get("client_optimizer") == "adam":
    raise UploadRefused("labels cannot be recovered analytically from an Adam "
                        "client's model delta (its steps are not a multiple of "
                        "the gradient); give the attack label_knowledge 'true' "
                        "or 'background'")
  steps = len(local_batch_sizes(num_examples, protocol["batch_size"],
                                protocol.get("local_epochs", 1)))
  mu = protocol.get("client_momentum", protocol.get("momentum", 0.0))
  scale = functional.learning_rate(protocol) * sum(
      (1 - mu ** k) / (1 - mu) for k in range(1, steps + 1))
  return [np.asarray(u) / scale for u in upload]


def whole_counts(counts: np.ndarray, total: int) -> np.ndarray:
  """Non-negative integers summing to `total`, each near its entry of
  `counts` (>= 0): floors, then units moved where the rounding erred most."""
  whole = np.floor(counts).astype(int)
  while whole.sum() > total:
    excess = np.where(whole > 0, whole - counts, -np.inf)
    whole[np.argmax(excess)] -= 1
  while whole.sum() < total:
    whole[np.argmax(counts - whole)] += 1
  return whole


def recover_labels(model: tf.keras.Model, broadcast, upload, num_examples: int,
                   upload_kind: str, protocol: dict,
                   bounds=(0.0, 1.0), seed: int = 0) -> np.ndarray:
  """Labels (length `num_examples`, sorted) inferred from `upload`;
  `bounds`: the range of the model's inputs (`Target.bounds`), which the
  probe of the expected softmax is drawn from."""
  num_classes = int(model.output_shape[-1])
  grads = mean_gradient(upload, upload_kind, protocol, num_examples)
  signal, is_bias = _last_layer_signal(grads, num_classes)
  if num_examples == 1 or not is_bias:
    order = np.argsort(signal)
    return np.sort(order[:num_examples]).astype(np.int32)
  rng = np.random.default_rng(seed)
  lo, hi = bounds
  probe = rng.uniform(lo, hi, size=(64,) + tuple(model.input_shape[1:]))
  logits = functional.forward(model, [tf.constant(w) for w in broadcast],
                              tf.constant(probe, tf.float32))
  pbar = tf.reduce_mean(tf.nn.softmax(logits), axis=0).numpy()
  counts = np.clip(num_examples * (pbar - signal), 0, None)
  return np.repeat(np.arange(num_classes),
                   whole_counts(counts, num_examples)).astype(np.int32)
