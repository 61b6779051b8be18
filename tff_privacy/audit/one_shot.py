"""An estimate of epsilon from canary scores, after Andrew et al. (ICLR 2024,
"One-shot Empirical Privacy Estimation for Federated Learning").

The scores of the canaries that were included and of those that were not
are taken as two Gaussians; the epsilon at delta of telling them apart is
the estimate. Choice where the paper fits each its own variance: one pooled
variance, so that the pair is the Gaussian mechanism of sensitivity
|mean_in - mean_out| and noise the pooled standard deviation, whose epsilon
`dp_accounting` gives exactly (PLD accountant). The estimate is not a bound:
it is exact for a Gaussian mechanism audited along its worst direction,
and says nothing rigorous otherwise (`one_run` gives the rigorous lower
bound).
"""

from __future__ import annotations

from typing import Optional, Sequence

import dp_accounting
import numpy as np

from tff_privacy.dp import accounting

# gap over spread past which the estimate is unbounded: PLD's grid grows
# with it, and epsilon there is in the thousands
_LARGEST_MU = 50.0


def epsilon_estimate(scores: Sequence[float], included: Sequence[bool],
                     delta: float) -> Optional[float]:
  """The estimate from each canary's score and whether it was included:
  infinite where the scores barely spread (a mechanism without noise), None
  where the included canaries do not score higher on average or fewer than
  2 are on a side.

  Raises:
    ValueError: lengths that differ, or delta outside (0, 1).
  """
  scores, included = np.asarray(scores, float), np.asarray(included, bool)
  if scores.shape != included.shape:
    raise ValueError(f"scores and included: need one of each per canary, got "
                     f"{scores.shape} and {included.shape}")
  if min(included.sum(), (~included).sum()) < 2:
    return None  # no spread to measure on one side
  inside, outside = scores[included], scores[~included]
  pooled = np.sqrt(((len(inside) - 1) * inside.var(ddof=1)
                    + (len(outside) - 1) * outside.var(ddof=1))
                   / (len(scores) - 2))
  gap = inside.mean() - outside.mean()
  if gap <= 0:
    return None
  if pooled * _LARGEST_MU <= gap:
    return float("inf")  # no spread to speak of: no noise
  return accounting.epsilon(dp_accounting.GaussianDpEvent(pooled / gap), delta, "pld")


def reported_estimate(scores: Sequence[float], included: Sequence[bool],
                      delta: float) -> Optional[float]:
  """`epsilon_estimate` as audit.json records it: None where it is None or
  unbounded (JSON has no infinity)."""
  value = epsilon_estimate(scores, included, delta)
  return None if value is None or np.isinf(value) else value
