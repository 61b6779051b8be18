"""Privacy accounting: what a run spent, through `dp_accounting`.

* Gaussian mechanisms (plain, sampled, composed, per-layer) compose over rounds
  with the RDP accountant (default) or the PLD accountant.
* Laplace mechanisms are handled by the PLD accountant only (dp_accounting's
  RDP accountant does not support them); `laplace_pure_epsilon` gives the pure
  epsilon of k-fold composition, k / noise_multiplier.
* `simple_composition` is the basic theorem: epsilons and deltas add up.
* `rounds_epsilon` is what a run reports: one round's event composed over
  the rounds, through the accountant that suits it, under the neighbouring
  relation the event is stated in (`RoundEvent`).

Every reported epsilon names its neighbouring relation (`protected`: what
that relation protects, for comparing epsilons): local mechanisms
treat any two uploads of one client as neighbours (a clipped upload's
sensitivity is twice the clip; the defences fold that factor into their
events' noise multipliers), central DP-FedAvg adds or removes one client
(or, with fixed-size sampling, replaces one).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import dp_accounting
import numpy as np
import scipy.optimize
import scipy.stats

ACCOUNTANTS = ("rdp", "pld")
NeighborRel = dp_accounting.NeighboringRelation


@dataclasses.dataclass(frozen=True)
class RoundEvent:
  """One round's DP event, with what its epsilon means.

  Attributes:
    event: the `dp_accounting` event of one round, or one such event per
      group of clients that spend alike, of which the largest epsilon is
      reported (see `largest_rounds_epsilon`).
    relation: the neighbouring relation, in words (written into metrics).
    sampling: how clients are sampled, in words (written into metrics).
    neighboring_relation: the relation the accountant uses for sampled
      events (dp_accounting's RDP accountant needs REPLACE_ONE for sampling
      without replacement, ADD_OR_REMOVE_ONE for Poisson sampling).
  """

  event: "dp_accounting.DpEvent | tuple[dp_accounting.DpEvent, ...]"
  relation: str
  sampling: str
  neighboring_relation: NeighborRel = NeighborRel.ADD_OR_REMOVE_ONE


# What an epsilon protects, by how its relation's words begin (as the
# mechanisms' `dp_relation`s do)
PROTECTED = (("sample-level", "one record"), ("central DP, user level", "a client's data"),
             ("local DP", "one upload"))


def protected(relation: str) -> str:
  """What an epsilon under the neighbouring relation `relation` (a run's
  `dp_relation`) protects: 'one record', "a client's data" or 'one upload'
  (`PROTECTED`); the relation itself where it begins otherwise."""
  return next((unit for start, unit in PROTECTED if relation.startswith(start)),
              relation)


def _check(delta: float) -> None:
  if not 0 < delta < 1:
    raise ValueError(f"delta must lie in (0, 1), got {delta}")


def _accountant(name: str, relation: NeighborRel):
  if name == "rdp":
    return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
  if name == "pld":
    return dp_accounting.pld.PLDAccountant(neighboring_relation=relation)
  raise ValueError(f"accountant={name!r}; choose one of {ACCOUNTANTS}")


def epsilon(event: dp_accounting.DpEvent, delta: float, accountant: str = "rdp",
            relation: NeighborRel = NeighborRel.ADD_OR_REMOVE_ONE) -> float:
  """Epsilon at `delta` of `event` (e.g. a composed event over rounds)."""
  _check(delta)
  acc = _accountant(accountant, relation)
  if not acc.supports(event):
    raise ValueError(f"the {accountant} accountant cannot account for {event}")
  acc.compose(event)
  return float(acc.get_epsilon(delta))


def gaussian_epsilon(noise_multiplier: float, rounds: int, delta: float,
                     sampling_probability: float = 1.0,
                     accountant: str = "rdp") -> float:
  """Epsilon of `rounds` Gaussian steps (Poisson-sampled when q < 1)."""
  if rounds < 1:
    raise ValueError(f"rounds must be >= 1, got {rounds}")
  if not 0 < sampling_probability <= 1:
    raise ValueError(f"sampling_probability must lie in (0, 1], got "
                     f"{sampling_probability}")
  if not noise_multiplier > 0:
    raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
  step = dp_accounting.GaussianDpEvent(noise_multiplier)
  if sampling_probability < 1:
    step = dp_accounting.PoissonSampledDpEvent(sampling_probability, step)
  return epsilon(dp_accounting.SelfComposedDpEvent(step, rounds), delta, accountant)


def laplace_epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
  """Epsilon at `delta` of `rounds` Laplace steps (PLD accountant)."""
  if not noise_multiplier > 0:
    raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
  step = dp_accounting.LaplaceDpEvent(noise_multiplier)
  return epsilon(dp_accounting.SelfComposedDpEvent(step, rounds), delta, "pld")


def gaussian_epsilon_once(noise_multiplier: float, delta: float) -> float:
  """Epsilon at `delta` of one Gaussian mechanism with `noise_multiplier`
  (noise std over sensitivity), from its exact privacy profile (Balle and
  Wang 2018): delta(eps) = Phi(1/(2 s) - eps s) - e^eps Phi(-1/(2 s) - eps s).
  dp_accounting's PLD accountant agrees, but takes seconds at small
  multipliers."""
  _check(delta)
  if not noise_multiplier > 0:
    raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
  sigma = noise_multiplier
  phi = scipy.stats.norm.cdf

  def excess(eps):  # delta(eps) - delta, decreasing in eps
    with np.errstate(over="ignore", invalid="ignore"):
      tail = math.exp(eps) * phi(-1 / (2 * sigma) - eps * sigma) if eps < 700 else 0.0
    return phi(1 / (2 * sigma) - eps * sigma) - (0.0 if np.isnan(tail) else tail) - delta

  if excess(0.0) <= 0:
    return 0.0
  high = 1.0
  while excess(high) > 0:
    high *= 2
  return float(scipy.optimize.brentq(excess, 0.0, high, xtol=1e-9))


def laplace_epsilon_once(noise_multiplier: float, delta: float) -> float:
  """Epsilon at `delta` of one Laplace mechanism, in closed form: its
  privacy profile is delta(eps) = 1 - exp((eps - eps0) / 2) for eps <=
  eps0 = 1 / noise_multiplier, so eps = eps0 + 2 log(1 - delta) (floored at
  0). dp_accounting's PLD accountant gives the same, but discretises a
  range that grows with eps0: minutes for eps0 in the thousands."""
  _check(delta)
  if not noise_multiplier > 0:
    raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
  return max(0.0, 1 / noise_multiplier + 2 * math.log1p(-delta))


def laplace_pure_epsilon(noise_multiplier: float, rounds: int) -> float:
  """Pure epsilon of `rounds` Laplace steps: each costs 1 / noise_multiplier."""
  if not noise_multiplier > 0:
    raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
  return rounds / noise_multiplier


def simple_composition(epsilons: Sequence[float],
                       deltas: Sequence[float] | None = None) -> tuple[float, float]:
  """Basic composition: (sum of epsilons, sum of deltas)."""
  if any(e < 0 for e in epsilons):
    raise ValueError(f"epsilons must be >= 0, got {list(epsilons)}")
  deltas = list(deltas) if deltas is not None else [0.0] * len(epsilons)
  if len(deltas) != len(epsilons):
    raise ValueError("epsilons and deltas differ in length")
  return float(sum(epsilons)), float(sum(deltas))


# Above this per-step epsilon (1 / noise multiplier) the PLD accountant's
# discretisation needs more memory than a machine has (tens of GiB), while
# the pure-DP bound is already far from any meaningful guarantee.
PLD_MAX_LAPLACE_EPSILON = 10.0


def largest_rounds_epsilon(round_event: RoundEvent, rounds: int, delta: float
                           ) -> tuple[float, float]:
  """`rounds_epsilon` of `round_event`, the largest of its events' when it
  holds one per group of clients."""
  events = (round_event.event if isinstance(round_event.event, tuple)
            else (round_event.event,))
  return max(rounds_epsilon(e, rounds, delta, round_event.neighboring_relation)
             for e in events)


def rounds_epsilon(event: dp_accounting.DpEvent, rounds: int, delta: float,
                   relation: NeighborRel = NeighborRel.ADD_OR_REMOVE_ONE
                   ) -> tuple[float, float]:
  """(epsilon, delta) of `event` composed over `rounds` rounds.

  Gaussian events (possibly sampled): RDP at `delta` under `relation`.
  Laplace events: PLD at `delta`, or, when one step's epsilon exceeds
  `PLD_MAX_LAPLACE_EPSILON`, the pure bound rounds / noise_multiplier with
  delta 0.
  """
  if isinstance(event, dp_accounting.LaplaceDpEvent):
    if 1 / event.noise_multiplier > PLD_MAX_LAPLACE_EPSILON:
      return laplace_pure_epsilon(event.noise_multiplier, rounds), 0.0
    return laplace_epsilon(event.noise_multiplier, rounds, delta), delta
  return epsilon(dp_accounting.SelfComposedDpEvent(event, rounds), delta, "rdp",
                 relation), delta
