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
  """An aggregate is zero, so its direction (and for the clean one, the
  relative error) is undefined."""


def weighted_mean(uploads: Sequence[Sequence[np.ndarray]],
                  weights: Sequence[float]) -> np.ndarray:
  """sum_i w_i u_i / sum_i w_i of the clients' uploads `uploads` (each a
  list of tensors, flattened and concatenated), in float64."""
  w = np.asarray(weights, np.float64)
  if len(w) != len(uploads) or not len(w):
    raise ValueError(f"weights: {len(w)} given for {len(uploads)} uploads; "
                     "give one per upload, at least one")
  if np.any(w < 0) or not w.sum() > 0:
    raise ValueError(f"weights must be >= 0 with a positive sum, got {w.tolist()}")
  flat = np.stack([np.concatenate([np.ravel(t).astype(np.float64) for t in u])
                   for u in uploads])
  return w @ flat / w.sum()


def aggregate_fidelity(clean: Sequence[Sequence[np.ndarray]],
                       defended: Sequence[Sequence[np.ndarray]],
                       weights: Sequence[float]) -> dict[str, float]:
  """How close the defended aggregate d lies to the clean one c, both the
  `weighted_mean` of the clients' uploads (the same clients, in the same
  order, with the same `weights`): 'update_cosine' <d, c> / (||d|| ||c||)
  and 'update_relative_error' ||d - c|| / ||c||, in float64.

  Raises:
    ValueError: the uploads differ in number or shape, or bad weights.
    UndefinedFidelity: an aggregate is zero.
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
    if norm == 0:
      raise UndefinedFidelity(f"the {name} aggregate update is zero: its "
                              "direction is undefined")
  return {"update_cosine": float(d @ c / (defended_norm * clean_norm)),
          "update_relative_error": float(np.linalg.norm(d - c) / clean_norm)}
