"""Calibration to a target epsilon: the strength of a mechanism (a noise
multiplier, or a budget parameter such as LDP-Fed's alpha) whose accounted
epsilon is the target.

The epsilon comes from a function of the strength, e.g. a run's own
accounting at that strength (`tff_privacy.runner.Run.privacy_spent`), so
that the calibrated strength spends what the run will report. The search
runs on log(epsilon) against log(strength), where the accountants' curves
are nearly straight: secant steps from the starting strength until the
target is bracketed (which way epsilon moves with the strength is found
from the values, not assumed), then Brent's method inside the bracket,
stopped as soon as epsilon is within 0.1% of the target: each value can
cost a run's configuration and accounting (up to a second), so the search
spends few of them (3 to 6 for the built-in grids' entries).
"""

from __future__ import annotations

import math
import sys
from typing import Callable, Optional

from scipy import optimize

SPAN = 1e10  # the search covers start / SPAN to start * SPAN
TOLERANCE = 0.01  # the calibrated epsilon lies within 1% of the target
_CLOSE = math.log1p(1e-3)  # the search ends this close to the target
_XTOL = 1e-3  # a bracket this narrow (in log strength) ends the search
_MAX_STEPS = 60


def strength_for_epsilon(epsilon_at: Callable[[float], Optional[float]],
                         target: float, start: float, name: str) -> float:
  """The strength s in [start / SPAN, start * SPAN] at which `epsilon_at(s)`
  lies within `TOLERANCE` of `target` (the search aims at 0.1%).

  Args:
    epsilon_at: the epsilon spent at a strength, >= 0 (None where the
      mechanism gives no guarantee; a ValueError where the strength is
      refused); monotonic in the strength, either way.
    target: the epsilon to reach, > 0.
    start: the strength the search starts from, a number > 0.
    name: what is calibrated, for error messages.

  Raises:
    ValueError: in one line naming `name`: a target or start that is not a
      number > 0, or a target that no strength in the range reaches within
      `TOLERANCE`.
  """
  if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
             for v in (target, start)):
    raise ValueError(f"{name}: the target epsilon and the start strength must be "
                     f"numbers > 0, got {target!r} and {start!r}")
  search = _Search(epsilon_at, target, start, name)
  gap = search.gap
  lo, hi = math.log(start) - math.log(SPAN), math.log(start) + math.log(SPAN)
  a = math.log(start)
  if abs(gap(a)) <= _CLOSE:
    return start
  b = a + math.log(2.0)
  for _ in range(_MAX_STEPS):
    if abs(gap(b)) <= _CLOSE:
      return search.strength(b)
    if (gap(a) < 0) != (gap(b) < 0):
      return search.strength(_brent(search, a, b))
    slope = (gap(b) - gap(a)) / (b - a)
    following = min(max(b - gap(b) / slope, lo), hi) if slope else b
    if following == b:
      break
    a, b = b, following
  raise ValueError(
      f"{name}: no strength in [{math.exp(lo):.3g}, {math.exp(hi):.3g}] reaches "
      f"epsilon {target:g} (epsilon {search.epsilon(a):.4g} at "
      f"{search.strength(a):.4g}, {search.epsilon(b):.4g} at {search.strength(b):.4g})")


class _Search:
  """The epsilons of a search, each computed once, by log strength u."""

  def __init__(self, epsilon_at: Callable[[float], Optional[float]], target: float,
               start: float, name: str):
    self.epsilon_at, self.target, self.start, self.name = epsilon_at, target, start, name
    self.epsilons = {}

  def strength(self, u: float) -> float:
    """The strength of log strength `u`: `start` itself at log(start)."""
    return self.start if u == math.log(self.start) else math.exp(u)

  def epsilon(self, u: float) -> float:
    """The epsilon spent at log strength `u`.

    Raises:
      ValueError: the strength is refused, or gives no (finite) epsilon.
    """
    if u not in self.epsilons:
      strength = self.strength(u)
      try:
        epsilon = self.epsilon_at(strength)
      except ValueError as e:
        raise ValueError(f"{self.name}: the search reached strength {strength:.4g}, "
                         f"which is refused ({e})") from None
      if epsilon is None or not 0 <= epsilon < math.inf:
        raise ValueError(f"{self.name}: the search reached strength {strength:.4g}, "
                         f"where epsilon is {epsilon}")
      self.epsilons[u] = epsilon
    return self.epsilons[u]

  def gap(self, u: float) -> float:
    """log(epsilon / target) at log strength `u`; an epsilon of 0 counts as
    the least positive float."""
    return math.log(max(self.epsilon(u), sys.float_info.min) / self.target)


class _Reached(Exception):
  """Ends Brent's method at log strength `u`, close enough to the target."""

  def __init__(self, u: float):
    super().__init__(u)
    self.u = u


def _brent(search: _Search, a: float, b: float) -> float:
  """The log strength in [a, b] (where the search's gap changes sign) at
  which the gap is within `_CLOSE` of 0, by Brent's method, stopped there.
  Where the bracket closes first (epsilon jumps beside the target), its
  end is the answer if it lies within `TOLERANCE`.

  Raises:
    ValueError: epsilon jumps over the target by more than `TOLERANCE`.
  """
  def gap(u: float) -> float:
    if abs(search.gap(u)) <= _CLOSE:
      raise _Reached(u)
    return search.gap(u)

  try:
    u = optimize.brentq(gap, a, b, xtol=_XTOL)
  except _Reached as reached:
    return reached.u
  if abs(search.gap(u)) > math.log1p(TOLERANCE):
    raise ValueError(f"{search.name}: epsilon jumps over {search.target:g} near "
                     f"strength {search.strength(u):.4g} (to {search.epsilon(u):.4g}); "
                     f"no strength reaches it within {TOLERANCE:.0%}")
  return u
