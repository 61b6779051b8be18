"""95% intervals of the leaderboard's numbers, from the unit that varies.

- A proportion over independent trials (a model's accuracy over test
  samples, an adversary's success over victims): the Wilson score interval
  (scipy's ``binomtest(...).proportion_ci``).
- The worst case over attacks of a mean over victims (a row's leakage): a
  percentile bootstrap that resamples the victims, the same victims for every
  attack, and takes the worst attack inside each resample, so that the
  interval covers the choice of the attack as well as the victims drawn.
- A mean over clients (a personalised method's mean accuracy of the clients'
  own models): a percentile bootstrap that resamples the clients.
- The best of several attacks' AUCs (membership inference): a
  percentile bootstrap that resamples each attack's members and
  non-members and takes the best attack inside each resample.
- Any of these over several training runs (seeds): a two-level bootstrap
  that resamples the seeds and, inside each, its units, so that the
  interval holds the seed-to-seed spread.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np
import scipy.stats

CONFIDENCE = 0.95
RESAMPLES = 2000


def proportion_interval(successes: int, trials: int,
                        confidence: float = CONFIDENCE) -> list[float]:
  """[low, high]: the Wilson score interval of `successes` in `trials`.

  Raises:
    ValueError: trials < 1, or successes outside 0..trials.
  """
  if trials < 1 or not 0 <= successes <= trials:
    raise ValueError(f"successes and trials: need 0 <= successes <= trials and "
                     f"trials >= 1, got {successes} and {trials}")
  interval = scipy.stats.binomtest(int(successes), int(trials)).proportion_ci(
      confidence, method="wilson")
  return [float(interval.low), float(interval.high)]


def worst_case_interval(chosen_by: Mapping[str, Sequence[float]],
                        reported: Optional[Mapping[str, Sequence[float]]] = None,
                        seed: int = 0, resamples: int = RESAMPLES,
                        confidence: float = CONFIDENCE) -> Optional[list[float]]:
  """[low, high]: the percentile bootstrap interval of the worst attack's
  mean over victims. `chosen_by` maps each attack to its score of every
  victim (the victims in the same order for every attack); the worst attack
  is the one whose mean of those is highest, and the interval is of its
  mean of `reported` (same layout; default `chosen_by`: the leakage SSIM,
  or with `reported` the PSNR of the attack with the highest SSIM). A
  resample draws victims with replacement and keeps each one's scores
  under every attack (scipy's `bootstrap`, paired), and chooses the worst
  attack in itself. None with fewer than two victims, whom no resample can
  vary.

  Raises:
    ValueError: no attack, attacks scored on different numbers of victims,
      or `reported` naming other attacks.
  """
  reported = chosen_by if reported is None else reported
  if not chosen_by or set(reported) != set(chosen_by):
    raise ValueError("chosen_by and reported: the same attacks, at least one, "
                     f"got {sorted(chosen_by)} and {sorted(reported)}")
  names = list(chosen_by)
  columns = ([np.asarray(chosen_by[n], np.float64) for n in names]
             + [np.asarray(reported[n], np.float64) for n in names])
  if len({len(c) for c in columns}) != 1:
    raise ValueError("chosen_by and reported: every attack must score the same "
                     f"victims, got lengths {[len(c) for c in columns]}")
  if len(columns[0]) < 2:
    return None

  def statistic(*resampled, axis=-1):
    means = np.stack([np.mean(c, axis=axis) for c in resampled])
    worst = np.argmax(means[:len(names)], axis=0)
    return np.take_along_axis(means[len(names):], worst[None], axis=0)[0]

  interval = scipy.stats.bootstrap(
      columns, statistic, paired=True, n_resamples=resamples,
      confidence_level=confidence, method="percentile",
      random_state=np.random.default_rng(seed)).confidence_interval
  return [float(interval.low), float(interval.high)]


def mean_interval(values: Sequence[float], seed: int = 0,
                  resamples: int = RESAMPLES,
                  confidence: float = CONFIDENCE) -> Optional[list[float]]:
  """[low, high]: the percentile bootstrap interval of the mean of `values`
  (one per unit, e.g. each client's accuracy), resampling the units with
  replacement (scipy's `bootstrap`). None with fewer than two values, which
  no resample can vary."""
  if len(values) < 2:
    return None
  interval = scipy.stats.bootstrap(
      (np.asarray(values, np.float64),), np.mean, n_resamples=resamples,
      confidence_level=confidence, method="percentile",
      random_state=np.random.default_rng(seed)).confidence_interval
  return [float(interval.low), float(interval.high)]


def best_auc_interval(scores: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                      seed: int = 0, resamples: int = RESAMPLES,
                      confidence: float = CONFIDENCE) -> list[float]:
  """[low, high]: the percentile bootstrap interval of the largest AUC
  among attacks, each given (scores of members, scores of non-members):
  every resample redraws each attack's members and non-members with
  replacement and takes the best attack's AUC (scikit-learn's), so that
  the interval covers the choice of the attack too.

  Raises:
    ValueError: no attacks, or an attack without members or non-members.
  """
  import sklearn.metrics  # only here: the leaderboard's other intervals need none
  if not scores or any(min(len(a), len(b)) < 1 for a, b in scores.values()):
    raise ValueError("scores: need members and non-members for each attack")
  rng = np.random.default_rng(seed)
  best = np.empty(resamples)
  for i in range(resamples):
    aucs = []
    for inside, outside in scores.values():
      a = rng.choice(np.asarray(inside, float), len(inside))
      b = rng.choice(np.asarray(outside, float), len(outside))
      aucs.append(sklearn.metrics.roc_auc_score(
          np.r_[np.ones(len(a)), np.zeros(len(b))], np.r_[a, b]))
    best[i] = max(aucs)
  tail = (1 - confidence) / 2 * 100
  return [float(np.percentile(best, tail)), float(np.percentile(best, 100 - tail))]


def seeded_interval(per_seed: Sequence[Sequence[Sequence[float]]], statistic,
                    seed: int = 0, resamples: int = RESAMPLES,
                    confidence: float = CONFIDENCE) -> Optional[list[float]]:
  """[low, high]: the percentile interval of `statistic` by a two-level
  bootstrap, for a number measured on several training runs (seeds): each
  resample draws the seeds with replacement and, inside each seed drawn,
  its units (victims, test samples, clients) with replacement, and pools
  the units drawn; so the interval holds the seed-to-seed spread as well as
  the units'. Resampling at both levels (Davison and Hinkley's first
  strategy) counts the units' spread twice, which widens the interval,
  while with S seeds it sees only (S - 1) / S of the seeds' spread and a
  few distinct draws of them (10 of 3 seeds), which narrows it: with few
  seeds whose means differ much more than their units do, it is narrower
  than a t-interval over the seeds' means.

  Args:
    per_seed: per seed, paired columns of equal length (one value per unit).
    statistic: `statistic(weights, *columns)` -> one value per resample,
      where `weights` [resamples, units] holds how often each of the pooled
      units (every seed's, in order) was drawn, and each column is the
      seeds' columns concatenated (`weighted_mean` is the mean's).

  Returns:
    None with fewer than two units in all, or where no resample's
    statistic is finite.

  Raises:
    ValueError: no seed, or a seed whose columns differ in number or length.
  """
  columns = [[np.asarray(c, np.float64) for c in s] for s in per_seed]
  if not columns or len({len(s) for s in columns}) != 1 or any(
      len({len(c) for c in s}) != 1 for s in columns):
    raise ValueError("per_seed: the same number of columns for every seed, of "
                     "one length within a seed, and at least one seed")
  sizes = [len(s[0]) for s in columns]
  if sum(sizes) < 2:
    return None
  rng = np.random.default_rng(seed)
  drawn = rng.multinomial(len(sizes), np.full(len(sizes), 1 / len(sizes)),
                          size=resamples)  # [resamples, seeds]: times drawn
  # the units of c draws of a seed of n units: c * n draws among its n
  weights = np.concatenate([
      rng.multinomial(drawn[:, k] * n, np.full(n, 1 / n)) if n else
      np.zeros((resamples, 0)) for k, n in enumerate(sizes)], axis=1)
  pooled = [np.concatenate([s[j] for s in columns]) for j in range(len(columns[0]))]
  values = np.asarray(statistic(weights.astype(np.float64), *pooled), np.float64)
  if not np.isfinite(values).any():
    return None
  tail = (1 - confidence) / 2 * 100
  low, high = np.nanpercentile(values, [tail, 100 - tail])
  return [float(low), float(high)]


def weighted_mean(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
  """Per resample (row of `weights`), the mean of `values` with each unit
  counted as often as it was drawn: `seeded_interval`'s mean."""
  with np.errstate(invalid="ignore", divide="ignore"):
    return weights @ values / weights.sum(axis=1)
