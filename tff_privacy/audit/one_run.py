"""A lower bound on epsilon from guesses about canaries: the one-run audit of
Steinke, Nasr and Jagielski (NeurIPS 2023, "Privacy Auditing with One (1)
Training Run").

m canaries are each included in the mechanism's input with probability 1/2,
independently. The auditor scores every canary from the output, guesses
"included" for the k highest scores and "excluded" for the k lowest, and
abstains on the rest. Of its r = 2k guesses, v are right. Under
(epsilon, delta)-DP the number of right guesses is dominated by that of
epsilon-randomised response, Binomial(r, q) with q = e^eps / (1 + e^eps),
plus a term for delta (their Theorem 5.2):

```text
P[right >= v] <= P[Bin(r, q) >= v]
                 + 2 m delta max_{1<=i<=v} P[v - i <= Bin(r, q) < v] / i.
```

`p_value` is that right-hand side; an epsilon whose p-value lies below
1 - confidence is refuted, and `epsilon_lower_bound` is the largest such
epsilon (0 where none is).

Choices where the paper leaves them to the auditor:

* k is chosen from `GUESS_FRACTIONS` of m, after seeing the scores, so each
  candidate k is tested at (1 - confidence) / len(GUESS_FRACTIONS)
  (Bonferroni): the bound reported for the best k keeps its confidence.
* The interval beside the bound (`epsilon_interval`) is where the audited
  epsilon lies for the guesser used, at the same corrected level on each
  side: from the lower bound to the epsilon at which v + 1 or more right
  guesses have probability 1 - level at delta 0 (None, unbounded, where
  every guess was right; delta's term only loosens the tail's bound, and
  would pull this end down). It is the Clopper-Pearson interval of the
  guessing accuracy, mapped through q = e^eps / (1 + e^eps), with the
  lower end loosened by delta. Its upper end
  bounds nothing about the mechanism (a weak guesser makes it small); only
  the lower bound is a claim about the mechanism.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats

CONFIDENCE = 0.95
# k as fractions of the canaries, each side (2k guesses)
GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
_EPSILON_CAP = 100.0  # an accuracy of 1 - e^-100 is past float64
_XTOL = 1e-6


def _check(m: int, r: int, v: int, delta: float) -> None:
  if not (isinstance(m, (int, np.integer)) and 0 <= v <= r <= m):
    raise ValueError(f"canaries m, guesses r and right guesses v: need "
                     f"0 <= v <= r <= m, got m={m}, r={r}, v={v}")
  if not 0 <= delta < 1:
    raise ValueError(f"delta must lie in [0, 1), got {delta}")


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
  """The probability bound of v or more right guesses of r about m
  canaries under (epsilon, delta)-DP (the module docstring's inequality).

  Raises:
    ValueError: not 0 <= v <= r <= m, epsilon < 0 or delta outside [0, 1).
  """
  _check(m, r, v, delta)
  if epsilon < 0:
    raise ValueError(f"epsilon must be >= 0, got {epsilon}")
  q = scipy.special.expit(epsilon)
  tail = scipy.stats.binom.sf(v - 1, r, q)
  if delta == 0 or v == 0:
    return float(min(tail, 1.0))
  # P[v - i <= Bin < v] for i = 1..v: the pmf's sums from v - 1 downwards
  below = np.cumsum(scipy.stats.binom.pmf(np.arange(v - 1, -1, -1), r, q))
  alpha = float(np.max(below / np.arange(1, v + 1)))
  return float(min(tail + 2 * m * delta * alpha, 1.0))


def _epsilon_at(m: int, r: int, v: int, delta: float, level: float) -> float:
  """The epsilon whose p-value is `level` (0 where even epsilon 0 gives
  more; the cap where even it gives less)."""
  if p_value(m, r, v, 0.0, delta) >= level:
    return 0.0
  if p_value(m, r, v, _EPSILON_CAP, delta) <= level:
    return _EPSILON_CAP
  root = scipy.optimize.brentq(lambda e: p_value(m, r, v, e, delta) - level,
                               0.0, _EPSILON_CAP, xtol=_XTOL)
  return max(0.0, float(root) - _XTOL)  # the bracket's lower end: conservative


def epsilon_lower_bound(m: int, r: int, v: int, delta: float,
                        confidence: float = CONFIDENCE) -> float:
  """The largest epsilon that v right guesses of r about m canaries refute
  at `confidence`: the mechanism is not (epsilon, delta)-DP for any smaller
  epsilon, with that confidence (0 where they refute none).

  Raises:
    ValueError: as `p_value`, or confidence outside (0, 1).
  """
  if not 0 < confidence < 1:
    raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
  return _epsilon_at(m, r, v, delta, 1 - confidence)


@dataclasses.dataclass(frozen=True)
class Audit:
  """The outcome of guessing about m canaries from their scores.

  Attributes:
    canaries: m.
    guesses: r, the guesses made (2k); right: v, those that were right.
    epsilon_lower_bound: at `confidence`, Bonferroni-corrected over the
      candidate guess counts.
    epsilon_interval: [the lower bound, high] for the guesser used (high
      None: unbounded; see the module docstring).
    epsilon_reachable: the bound if every guess at the widest k that the
      canaries drawn on each side allow were right: the most these
      canaries can show. A claim above it can be
      neither confirmed nor refuted by them.
    confidence, delta: as audited.
  """

  canaries: int
  guesses: int
  right: int
  epsilon_lower_bound: float
  epsilon_interval: list[Optional[float]]
  epsilon_reachable: float
  confidence: float
  delta: float

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def audit_scores(scores: Sequence[float], included: Sequence[bool], delta: float,
                 confidence: float = CONFIDENCE,
                 fractions: Sequence[float] = GUESS_FRACTIONS) -> Audit:
  """Guesses from each canary's score (higher: more likely included) and
  the lower bound they give (the module docstring's procedure).

  Raises:
    ValueError: scores and included of other lengths, fewer than 2
      canaries, or as `epsilon_lower_bound`.
  """
  scores, included = np.asarray(scores, float), np.asarray(included, bool)
  m = len(scores)
  if included.shape != scores.shape or m < 2:
    raise ValueError(f"scores and included: need one of each per canary, at "
                     f"least 2; got {scores.shape} and {included.shape}")
  order = included[np.argsort(scores, kind="stable")]
  level = (1 - confidence) / len(fractions)
  best = None
  for k in _guess_counts(m, fractions):
    right = int(np.sum(order[-k:]) + np.sum(~order[:k]))
    bound = epsilon_lower_bound(m, 2 * k, right, delta, 1 - level)
    if best is None or bound > best[0]:
      best = (bound, k, right)
  bound, k, right = best
  # delta's term only loosens the tail's bound: the upper end without it
  high = (None if right == 2 * k else
          _epsilon_at(m, 2 * k, right + 1, 0.0, 1 - level))
  # all right is possible only where k fits the canaries drawn on each side
  sides = min(int(included.sum()), m - int(included.sum()))
  widest = max([c for c in _guess_counts(m, fractions) if c <= sides]
               or [min(_guess_counts(m, fractions))])
  reachable = epsilon_lower_bound(m, 2 * widest, 2 * widest, delta, 1 - level)
  return Audit(m, 2 * k, right, bound, [bound, high], reachable, confidence, delta)


def _guess_counts(m: int, fractions: Sequence[float]) -> list[int]:
  """The candidate k (guesses each side) for m canaries."""
  return sorted({max(1, int(f * m)) for f in fractions if 2 * max(1, int(f * m)) <= m})
