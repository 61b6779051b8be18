"""One leaderboard row from the runs of several seeds: their victims, test
samples and clients pooled, and 95% intervals that hold the seed-to-seed
spread (`tff_privacy.metrics.intervals.seeded_interval`: the seeds
resampled, and inside each its victims, test samples or clients).

A pooled number is over the pooled units: leakage is the worst attack's
mean over every seed's victims (each victim's mean over its images;
each seed's mean weighed by its victims), the
global model's accuracy the share of every seed's test samples it got
right, a personalised accuracy the mean over every seed's clients, an
attack success rate over every seed's victims. Where a seed's result lacks
what pooling needs (a row made before per-unit values were kept), the
number is the seeds' mean and its interval None.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from tff_privacy import provenance
from tff_privacy.attacks import attribute as attribute_inference
from tff_privacy.leaderboard.board import GLOBAL_UTILITY
from tff_privacy.metrics import intervals


def pooled(results: Sequence[dict]) -> dict[str, Any]:
  """The first seed's result with its numbers pooled over `results` (one
  per seed, the first seed first) and 'seeds', the results themselves."""
  if len(results) == 1:
    return results[0]
  first = results[0]
  return {**first, **_utility(results),
          "loss": _mean([r["loss"] for r in results]),
          "seconds_per_round": _mean([r["seconds_per_round"] for r in results]),
          "concurrent_rows": max(r.get("concurrent_rows", 1) for r in results),
          "inversion": {name: _inversion([r["inversion"].get(name, {"error": "missing"})
                                          for r in results])
                        for name in first["inversion"]},
          "attribute": _attribute([r.get("attribute") for r in results]),
          provenance.KEY: provenance.merged(*(provenance.versions_of(r)
                                              for r in results)),
          "seeds": list(results)}


def _average(values: Sequence[Optional[float]], weights: Sequence[int]
             ) -> Optional[float]:
  """The weighted mean of `values`; None where one is missing."""
  if None in values:
    return None
  return float(np.average(values, weights=weights))


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
  known = [v for v in values if v is not None]
  return float(np.mean(known)) if known else None


def _utility(results: Sequence[dict]) -> dict[str, Any]:
  kind = results[0]["utility_kind"]
  counts = [r.get("samples_tested") for r in results]
  by_client = [r.get("utility_by_client") for r in results]
  if kind == GLOBAL_UTILITY and None not in counts:
    right = sum(round(r["utility"] * n) for r, n in zip(results, counts))
    return {"utility": right / sum(counts), "samples_tested": sum(counts)}
  if kind != GLOBAL_UTILITY and None not in by_client:
    values = [v for seed in by_client for v in seed]
    return {"utility": float(np.mean(values)), "utility_by_client": values}
  return {"utility": _mean([r["utility"] for r in results]),
          "samples_tested": None, "utility_by_client": None}


def utility_columns(result: dict) -> Optional[list[list[np.ndarray]]]:
  """Per seed, the units of a pooled result's utility (each test sample's
  0/1 correctness, in no order, or each client's accuracy); None where a
  seed lacks them."""
  columns = []
  for r in result["seeds"]:
    n, by_client = r.get("samples_tested"), r.get("utility_by_client")
    if r["utility_kind"] == GLOBAL_UTILITY and n:
      right = round(r["utility"] * n)
      columns.append([np.r_[np.ones(right), np.zeros(n - right)]])
    elif r["utility_kind"] != GLOBAL_UTILITY and by_client:
      columns.append([np.asarray(by_client, np.float64)])
    else:
      return None
  return columns


def utility_interval(result: dict) -> Optional[list[float]]:
  """The pooled utility's 95% interval over the seeds and their units."""
  columns = utility_columns(result)
  return (None if columns is None else
          intervals.seeded_interval(columns, intervals.weighted_mean))


def _inversion(cells: Sequence[dict]) -> dict[str, Any]:
  """One attack's cells of every seed as one: the first failed or refused
  cell where there is one (the row is then incomplete), else its victims
  pooled."""
  failed = next((c for c in cells if "error" in c), None)
  if failed is not None:
    return failed
  per_victim = [c.get("victims") for c in cells]
  # each seed by its victims; equally where a seed's number is not kept
  weights = ([len(v["clients"]) for v in per_victim] if None not in per_victim
             else [1] * len(cells))
  pooled_cell = {**cells[0], **{
      metric: _average([c.get(metric) for c in cells], weights)
      for metric in ("ssim", "psnr", "mse", "label_accuracy")},
      "seconds": sum(c.get("seconds") or 0.0 for c in cells)}
  snapshots = [c.get("ssim_by_iterations") for c in cells]
  pooled_cell["ssim_by_iterations"] = (None if None in snapshots else {
      k: float(np.average([s[k] for s in snapshots], weights=weights))
      for k in snapshots[0]})
  pooled_cell["victims"] = (None if None in per_victim else {
      "clients": [f"seed {i}: {c}" for i, v in enumerate(per_victim)
                  for c in v["clients"]],
      **{m: [x for v in per_victim for x in v[m]] for m in ("ssim", "psnr")}})
  return pooled_cell


def leakage_intervals(result: dict, names: Sequence[str]) -> dict[str, Any]:
  """{'victims', 'ssim_ci', 'psnr_ci'} of a pooled result's worst attack
  among `names`, by the two-level bootstrap, the worst attack chosen inside
  each resample; None intervals where a seed lacks per-victim scores."""
  per_seed = []
  for r in result["seeds"]:
    cells = [r["inversion"][n] for n in names]
    victims = [c.get("victims") for c in cells]
    if None in victims or len({tuple(v["clients"]) for v in victims}) != 1:
      return {"victims": None, "ssim_ci": None, "psnr_ci": None}
    per_seed.append([np.asarray(v[m], np.float64) for m in ("ssim", "psnr")
                     for v in victims])
  count = len(names)

  def worst(weights, *columns, reported: int):
    means = np.stack([intervals.weighted_mean(weights, c) for c in columns])
    chosen = np.argmax(means[:count], axis=0)
    return np.take_along_axis(means[reported * count:(reported + 1) * count],
                              chosen[None], axis=0)[0]

  return {"victims": sum(len(s[0]) for s in per_seed),
          "ssim_ci": intervals.seeded_interval(
              per_seed, lambda w, *c: worst(w, *c, reported=0)),
          "psnr_ci": intervals.seeded_interval(
              per_seed, lambda w, *c: worst(w, *c, reported=1))}


def _balanced(weights: np.ndarray, guessed: np.ndarray, truth: np.ndarray
              ) -> np.ndarray:
  """Per resample, the balanced rate (the mean over the classes drawn of
  each one's share guessed right) of the units drawn as `weights` says."""
  recalls = [intervals.weighted_mean(weights * (truth == c), guessed == c)
             for c in np.unique(truth)]
  with np.errstate(all="ignore"):
    return np.nanmean(np.stack(recalls), axis=0)


def _attribute(cells: Sequence[Optional[dict]]) -> Optional[dict[str, Any]]:
  """Attribute inference over every seed's victims: rates, chance and their
  intervals recomputed from each victim's guess and truth."""
  if any(c is None or "error" in c for c in cells):
    return next((c for c in cells if c is None or "error" in c), None)
  if any(c.get("truth") is None for c in cells):
    return {**cells[0], **{rate: {n: _mean([c[rate][n] for c in cells])
                                  for n in cells[0][rate]}
                           for rate in ("asr", "balanced_asr")},
            "asr_ci": None, "balanced_asr_ci": None,
            "victims": sum(c["victims"] for c in cells)}
  truth = np.concatenate([c["truth"] for c in cells])
  names = list(cells[0]["guesses"])
  guesses = {n: np.concatenate([c["guesses"][n] for c in cells]) for n in names}
  per_seed = {n: [[np.asarray(c["guesses"][n]), np.asarray(c["truth"])]
                  for c in cells] for n in names}
  return {**cells[0], "victims": len(truth), "truth": truth.tolist(),
          "guesses": {n: g.tolist() for n, g in guesses.items()},
          "asr": {n: float(np.mean(g == truth)) for n, g in guesses.items()},
          "balanced_asr": {n: attribute_inference.balanced_rate(g, truth)
                           for n, g in guesses.items()},
          "asr_ci": {n: intervals.seeded_interval(
              per_seed[n], lambda w, g, t: intervals.weighted_mean(w, g == t))
              for n in names},
          "balanced_asr_ci": {n: intervals.seeded_interval(per_seed[n], _balanced)
                              for n in names},
          "chance": attribute_inference.chance_rate(truth),
          "balanced_chance": 1.0 / len(np.unique(truth))}
