"""LPIPS (Zhang et al. 2018, AlexNet variant) from a user-supplied weights file.

LPIPS needs pretrained AlexNet features and the learned per-channel layer
weights; neither ships with this package and neither can be downloaded at run
time, so nothing here has default weights: without a file, callers must report
that LPIPS was not computed.

The weights file is an `.npz` with, for i = 1..5, `conv{i}_kernel` (TF layout
(kh, kw, in, out)), `conv{i}_bias` and `lin{i}` (one non-negative weight per
channel of layer i), converted from the official LPIPS 'alex' release and
torchvision's AlexNet. Inputs in the data range are mapped to [-1, 1],
grey images repeated to 3 channels, and images smaller than 64 pixels
resized to 64 (bilinear) so that AlexNet's strides leave spatial extent.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np
import tensorflow as tf

# AlexNet's feature layers: (channels, kernel, stride, padding), each followed
# by ReLU; a 3x3/2 max-pool follows layers 1 and 2.
_LAYERS = [(64, 11, 4, 2), (192, 5, 1, 2), (384, 3, 1, 1), (256, 3, 1, 1),
           (256, 3, 1, 1)]
_SHIFT = np.array([-0.030, -0.088, -0.188], np.float32)
_SCALE = np.array([0.458, 0.448, 0.450], np.float32)
_MIN_SIDE = 64


def load_weights(path: str) -> dict[str, np.ndarray]:
  """Reads and checks an LPIPS weights file; errors name the missing key."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"LPIPS weights file {path} does not exist")
  try:
    with np.load(path, allow_pickle=False) as npz:
      weights = {k: npz[k].astype(np.float32) for k in npz.files}
  except (ValueError, OSError, zipfile.BadZipFile) as e:
    raise ValueError(f"{path}: not a readable LPIPS weights .npz ({e})") from None
  in_ch = 3
  for i, (ch, k, _, _) in enumerate(_LAYERS, start=1):
    expected = {f"conv{i}_kernel": (k, k, in_ch, ch), f"conv{i}_bias": (ch,),
                f"lin{i}": (ch,)}
    for key, shape in expected.items():
      if key not in weights:
        raise ValueError(f"{path}: LPIPS weights lack {key!r}")
      if weights[key].shape != shape:
        raise ValueError(f"{path}: {key} has shape {weights[key].shape}, "
                         f"expected {shape}")
    in_ch = ch
  return weights


def _features(x: tf.Tensor, weights) -> list[tf.Tensor]:
  taps = []
  h = x
  for i, (_, _, stride, pad) in enumerate(_LAYERS, start=1):
    h = tf.pad(h, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
    h = tf.nn.relu(tf.nn.conv2d(h, weights[f"conv{i}_kernel"], stride, "VALID")
                   + weights[f"conv{i}_bias"])
    taps.append(h)
    if i <= 2:
      h = tf.nn.max_pool2d(h, 3, 2, "VALID")
  return taps


def lpips(x_true: np.ndarray, x_rec: np.ndarray, weights: dict[str, np.ndarray],
          value_range=(0.0, 1.0)) -> np.ndarray:
  """Per-image LPIPS distance of (N, H, W, C) batches (lower is closer)."""
  lo, hi = value_range

  def prepare(x):
    x = tf.constant(np.clip(x, lo, hi), tf.float32)
    x = (x - lo) / (hi - lo) * 2.0 - 1.0
    if x.shape[-1] == 1:
      x = tf.repeat(x, 3, axis=-1)
    side = min(x.shape[1], x.shape[2])
    if side < _MIN_SIDE:
      f = _MIN_SIDE / side
      x = tf.image.resize(x, (round(x.shape[1] * f), round(x.shape[2] * f)))
    return (x - _SHIFT) / _SCALE

  total = 0.0
  for i, (a, b) in enumerate(zip(_features(prepare(x_true), weights),
                                 _features(prepare(x_rec), weights)), start=1):
    a = a / (tf.norm(a, axis=-1, keepdims=True) + 1e-10)
    b = b / (tf.norm(b, axis=-1, keepdims=True) + 1e-10)
    per_pixel = tf.reduce_sum(tf.square(a - b) * weights[f"lin{i}"], axis=-1)
    total += tf.reduce_mean(per_pixel, axis=[1, 2])
  return np.asarray(total)
