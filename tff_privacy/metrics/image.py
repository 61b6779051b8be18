"""Image similarity between client samples and their reconstructions.

One convention for every attack and method: reconstructions are clipped to the
data set's recorded value range, each image is scored on its own with
scikit-image (MSE, PSNR and SSIM with `data_range` = the range's width), then
scores are averaged. For batches, reconstructions are first assigned to the
true samples by the assignment of least total MSE (Hungarian method).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf
from scipy import ndimage
from scipy.optimize import linear_sum_assignment
from skimage import metrics as skm

PSNR_CAP_DB = 100.0  # reported for an exact reconstruction (MSE = 0)
MIN_SSIM_SIDE = 3  # SSIM's smallest window


def _ssim(a: np.ndarray, b: np.ndarray, data_range: float) -> float:
  side = min(a.shape[0], a.shape[1])
  win = min(7, side if side % 2 else side - 1)
  if a.shape[-1] == 1:
    return float(skm.structural_similarity(a[..., 0], b[..., 0], win_size=win,
                                           data_range=data_range))
  return float(skm.structural_similarity(a, b, win_size=win, channel_axis=-1,
                                         data_range=data_range))


def image_scores(x_true: np.ndarray, x_rec: np.ndarray,
                 value_range: Sequence[float]) -> list[dict[str, float]]:
  """Per-image MSE, PSNR (dB) and SSIM of aligned (N, H, W, C) batches."""
  lo, hi = value_range
  x_true = np.asarray(x_true, np.float64)
  x_rec = np.clip(np.asarray(x_rec, np.float64), lo, hi)
  if x_true.shape != x_rec.shape:
    raise ValueError(f"shapes differ: true {x_true.shape}, reconstructed {x_rec.shape}")
  scores = []
  for a, b in zip(x_true, x_rec):
    mse = float(skm.mean_squared_error(a, b))
    psnr = (PSNR_CAP_DB if mse == 0 else
            min(PSNR_CAP_DB, float(skm.peak_signal_noise_ratio(a, b, data_range=hi - lo))))
    scores.append({"mse": mse, "psnr": psnr, "ssim": _ssim(a, b, hi - lo)})
  return scores


def region_boxes(mask: np.ndarray) -> list[tuple[slice, slice]]:
  """The bounding boxes (row and column slices) of the 8-connected
  components of a [H, W] mask."""
  components, _ = ndimage.label(mask, structure=np.ones((3, 3)))
  return ndimage.find_objects(components)


def ssim_parts(mask: np.ndarray) -> list[tuple[slice, slice]]:
  """The `region_boxes` SSIM can score: at least `MIN_SSIM_SIDE` pixels
  on each side.

  Raises:
    ValueError: if there is none.
  """
  boxes = [b for b in region_boxes(mask)
           if min(b[0].stop - b[0].start, b[1].stop - b[1].start) >= MIN_SSIM_SIDE]
  if not boxes:
    raise ValueError(f"the region has no part of at least {MIN_SSIM_SIDE}x"
                     f"{MIN_SSIM_SIDE} pixels for SSIM to score")
  return boxes


def region_scores(x_true: np.ndarray, x_rec: np.ndarray, mask: np.ndarray,
                  value_range: Sequence[float]) -> list[dict[str, float]]:
  """Per-image MSE, PSNR and SSIM inside a region, a [H, W] mask.

  MSE and PSNR are over the region's pixels. SSIM is scored on the crop of
  each connected part's bounding box (`ssim_parts`; thinner parts count in
  MSE and PSNR only), and the crops' SSIMs averaged weighted by their
  pixels in the region. A region of one box is therefore scored on exactly
  that crop.

  Raises:
    ValueError: if the mask has no part SSIM can score.
  """
  mask = np.asarray(mask, bool)
  boxes = ssim_parts(mask)
  lo, hi = value_range
  x_true = np.asarray(x_true, np.float64)
  x_rec = np.clip(np.asarray(x_rec, np.float64), lo, hi)
  weights = np.array([mask[b].sum() for b in boxes], np.float64)
  scores = []
  for a, b in zip(x_true, x_rec):
    mse = float(np.mean(np.square(a[mask] - b[mask])))
    psnr = (PSNR_CAP_DB if mse == 0 else
            min(PSNR_CAP_DB, 10 * np.log10((hi - lo) ** 2 / mse)))
    ssim = [_ssim(a[box], b[box], hi - lo) for box in boxes]
    scores.append({"mse": mse, "psnr": float(psnr),
                   "ssim": float(np.average(ssim, weights=weights))})
  return scores


def match_by_mse(x_true: np.ndarray, x_rec: np.ndarray) -> np.ndarray:
  """Index array `perm` such that x_rec[perm[i]] is matched to x_true[i]."""
  diff = x_true.reshape(len(x_true), 1, -1) - x_rec.reshape(1, len(x_rec), -1)
  rows, cols = linear_sum_assignment(np.mean(diff ** 2, axis=-1))
  return cols[np.argsort(rows)]


def feature_mse(model: tf.keras.Model, weights, x_true: np.ndarray,
                x_rec: np.ndarray) -> float:
  """FedEM's 'feature MSE', read here as the mean squared difference between
  the penultimate-layer features (the input of the last layer) of the true
  samples and of their reconstructions under the attacked (broadcast) model."""
  from tff_privacy.models.functional import forward
  w = [tf.constant(v) for v in weights]
  last = model.layers[-1].name
  _, f_true = forward(model, w, tf.constant(x_true, tf.float32), tap=last)
  _, f_rec = forward(model, w, tf.constant(x_rec, tf.float32), tap=last)
  return float(tf.reduce_mean(tf.square(f_true - f_rec)))


def summarize(scores: Sequence[dict[str, float]]) -> dict[str, float]:
  """Mean of each score over images."""
  return {k: float(np.mean([s[k] for s in scores])) for k in scores[0]} if scores else {}
