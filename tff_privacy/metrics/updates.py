"""Utility of a defended round, read off its aggregate update.

A defence's cost shows in the learning loss only once the model has moved:
after one round of FedSGD on Adult at learning rate 0.01, every defence's
test loss lies within 4e-4 of every other's. The aggregate the server steps
with separates them at once: how far the defended aggregate lies from the
one the same clients would have sent without the defence, at the same model.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class UndefinedFidelity(ValueError):
  """No client has a positive weight, or an aggregate is zero or not
  finite, so its direction (and for the clean one, the relative error) is
  undefined."""


def weighted_mean(uploads: Sequence[Sequence[np.ndarray]],
                  weights: Sequence[float]) -> np.ndarray:
  """sum_i w_i u_i / sum_i w_i of the clients' uploads `uploads` (each a
  list of tensors, flattened and concatenated), in float64, over the
  clients of positive weight only: TFF gives a client whose update is not
  finite weight 0, and 0 * NaN would still be NaN.

  Raises:
    ValueError: a weight per upload is missing, or one is negative.
    UndefinedFidelity: no weight is positive.
  """
  w = np.asarray(weights, np.float64)
  if len(w) != len(uploads) or not len(w):
    raise ValueError(f"weights: {len(w)} given for {len(uploads)} uploads; "
                     "give one per upload, at least one")
  if not np.all(w >= 0):
    raise ValueError(f"weights must be >= 0, got {w.tolist()}")
  if not np.any(w > 0):
    raise UndefinedFidelity(f"no client has a positive weight (weights "
                            f"{w.tolist()}): the mean update is undefined")
  kept = np.flatnonzero(w > 0)
  flat = np.stack([np.concatenate([np.ravel(t).astype(np.float64)
                                   for t in uploads[i]]) for i in kept])
  return w[kept] @ flat / w[kept].sum()


def aggregate_fidelity(clean: Sequence[Sequence[np.ndarray]],
                       defended: Sequence[Sequence[np.ndarray]],
                       weights: Sequence[float]) -> dict[str, float]:
  """How close the defended aggregate d lies to the clean one c, both the
  `weighted_mean` of the clients' uploads (the same clients, in the same
  order, with the same `weights`; clients of weight 0 left out of both):
  'update_cosine' <d, c> / (||d|| ||c||) and 'update_relative_error'
  ||d - c|| / ||c||, in float64.

  Raises:
    ValueError: the uploads differ in number or shape, or bad weights.
    UndefinedFidelity: no weight is positive, or an aggregate is zero or
      not finite.
  """
  if len(clean) != len(defended):
    raise ValueError(f"{len(clean)} clean uploads but {len(defended)} defended "
                     "ones; give the same clients' uploads")
  shapes = [[np.shape(t) for t in u] for u in clean]
  if shapes != [[np.shape(t) for t in u] for u in defended]:
    raise ValueError("the clean and defended uploads are shaped differently")
  c, d = weighted_mean(clean, weights), weighted_mean(defended, weights)
  clean_norm, defended_norm = np.linalg.norm(c), np.linalg.norm(d)
  for name, norm in (("clean", clean_norm), ("defended", defended_norm)):
    if not np.isfinite(norm):
      raise UndefinedFidelity(f"the {name} aggregate update is not finite")
    if norm == 0:
      raise UndefinedFidelity(f"the {name} aggregate update is zero: its "
                              "direction is undefined")
  return {"update_cosine": float(d @ c / (defended_norm * clean_norm)),
          "update_relative_error": float(np.linalg.norm(d - c) / clean_norm)}
