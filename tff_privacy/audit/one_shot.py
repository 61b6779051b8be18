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
  scores, included = _checked(scores, included)
  if min(included.sum(), (~included).sum()) < 2:
    return None  # no spread to measure on one side
  mu = _mu(scores[included], scores[~included])
  return None if mu <= 0 else _epsilon_of_mu(mu, delta)


def estimate_interval(scores: Sequence[float], included: Sequence[bool],
                      delta: float, confidence: float = 0.95,
                      resamples: int = 1000, seed: int = 0) -> Optional[list]:
  """The estimate's `confidence` interval, [low, high], by a percentile
  bootstrap over the canaries (included and held-out ones resampled apart):
  epsilon grows with the gap over the pooled spread, so the interval is the
  epsilons of that ratio's percentiles. 0 where the gap may vanish, None
  for an unbounded end (JSON has no infinity); None where `epsilon_estimate`
  gives none."""
  scores, included = _checked(scores, included)
  if epsilon_estimate(scores, included, delta) is None:
    return None
  rng = np.random.default_rng(seed)
  inside, outside = scores[included], scores[~included]
  mus = [_mu(rng.choice(inside, len(inside)), rng.choice(outside, len(outside)))
         for _ in range(resamples)]
  tail = (1 - confidence) / 2
  # no interpolation: resamples without spread have an infinite ratio
  ends = [_epsilon_of_mu(m, delta) if m > 0 else 0.0
          for m in np.quantile(mus, [tail, 1 - tail], method="inverted_cdf")]
  return [None if np.isinf(e) else float(e) for e in ends]


def _checked(scores, included) -> tuple[np.ndarray, np.ndarray]:
  scores, included = np.asarray(scores, float), np.asarray(included, bool)
  if scores.shape != included.shape:
    raise ValueError(f"scores and included: need one of each per canary, got "
                     f"{scores.shape} and {included.shape}")
  return scores, included


def _mu(inside: np.ndarray, outside: np.ndarray) -> float:
  """The gap of the means over the pooled standard deviation."""
  pooled = np.sqrt(((len(inside) - 1) * inside.var(ddof=1)
                    + (len(outside) - 1) * outside.var(ddof=1))
                   / (len(inside) + len(outside) - 2))
  gap = inside.mean() - outside.mean()
  if gap <= 0:
    return float(gap)
  return float("inf") if pooled * _LARGEST_MU <= gap else float(gap / pooled)


def _epsilon_of_mu(mu: float, delta: float) -> float:
  """The Gaussian mechanism's epsilon at `delta` at a gap of `mu` spreads:
  infinite past `_LARGEST_MU` (no spread to speak of: no noise)."""
  if mu >= _LARGEST_MU:
    return float("inf")
  return accounting.epsilon(dp_accounting.GaussianDpEvent(1 / mu), delta, "pld")


def reported_estimate(scores: Sequence[float], included: Sequence[bool],
                      delta: float) -> Optional[float]:
  """`epsilon_estimate` as audit.json records it: None where it is None or
  unbounded (JSON has no infinity)."""
  value = epsilon_estimate(scores, included, delta)
  return None if value is None or np.isinf(value) else value


def reported_fields(scores: Sequence[float], included: Sequence[bool],
                    delta: float) -> dict:
  """audit.json's 'epsilon_estimate' (`reported_estimate`) and
  'epsilon_estimate_ci' (`estimate_interval`)."""
  return {"epsilon_estimate": reported_estimate(scores, included, delta),
          "epsilon_estimate_ci": estimate_interval(scores, included, delta)}
