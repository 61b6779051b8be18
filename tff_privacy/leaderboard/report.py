"""The leaderboard's report: OUT/report.md with its table, figures, CSV and
JSON, rebuilt from the finished rows at any time (`tff-privacy report`).

Leakage is the worst case over a row's inversion attacks, those unaware of
its defence and the adaptive ones that know it: the attack with the highest
SSIM. Beside it the report gives the worst of the unaware attacks alone (what
a defence looks like to an attacker who ignores it), and leaderboard.csv
every attack's SSIM and PSNR. A row is on the Pareto front when no other row
has higher utility and lower (worst-case) leakage, each beyond the two rows'
95% intervals: rows whose intervals overlap on an axis are tied there, not
ordered.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any, Optional, Sequence

import numpy as np

from tff_privacy import attacks as inversion_attacks
from tff_privacy import io, provenance
from tff_privacy.dp import accounting
from tff_privacy.leaderboard import pooling
from tff_privacy.leaderboard.board import GLOBAL_UTILITY, failures, refusals
from tff_privacy.leaderboard.grid import (SOURCE_ITERATIONS, Grid, calibration_key,
                                          slug)
from tff_privacy.metrics import intervals

FIGURES = ("tradeoff.png", "reconstructions.png", "asr.png")


def figures(protocol_name: Optional[str]) -> tuple[str, ...]:
  """The figures' file names for the rows of protocol `protocol_name` (of
  the grid's `protocols`; None for a grid without them): `FIGURES`, with
  the protocol's name before '.png'."""
  if protocol_name is None:
    return FIGURES
  return tuple(f.replace(".png", f"_{slug(protocol_name)}.png") for f in FIGURES)
PACKAGES = ("tff_privacy", "tensorflow", "tensorflow-federated",
            "tensorflow-privacy", "dp-accounting", "scikit-learn", "numpy")
COLUMNS = ("label", "protocol", "seeds", "entry", "parameter", "strength", "default", "matched", "pareto",
           "utility", "utility_ci", "utility_kind", "loss", "upload_defense", "victims",
           "attack", "ssim", "ssim_ci", "psnr", "psnr_ci", "label_accuracy",
           "attack_converged", "unaware_attack", "unaware_ssim", "unaware_ssim_ci", "asr_max", "asr_max_ci",
           "chance", "balanced_asr_max", "balanced_asr_max_ci",
           "balanced_chance", "epsilon", "delta", "relation", "equal_epsilon",
           "equal_delta", "epsilon_claimed_once", "epsilon_audited",
           "epsilon_audited_ci", "claim_refuted", "mia_auc", "mia_auc_ci",
           "time_ratio", "upload_bytes", "upload_bytes_encoded")


def leakage(result: dict, among: Optional[Sequence[str]] = None
            ) -> Optional[dict[str, Any]]:
  """The row's worst inversion result (highest SSIM) over all its attacks or
  those `among`, with the attack's name; None when no such attack could read
  the uploads."""
  scored = [(name, r) for name, r in result["inversion"].items()
            if "error" not in r and _finite(r["ssim"])
            and (among is None or name in among)]
  if not scored:
    return None
  name, best = max(scored, key=lambda item: item[1]["ssim"])
  return {"attack": name, **best}


def leakage_intervals(result: dict, among: Optional[Sequence[str]] = None
                      ) -> dict[str, Any]:
  """{'victims': how many victims the row's inversion attacks (those
  `among`) scored, 'ssim_ci' and 'psnr_ci': the 95% intervals of the worst
  attack's mean SSIM and its PSNR, the victims resampled and the worst
  attack chosen inside each resample (`intervals.worst_case_interval`)}.
  The intervals are None where they cannot be computed: fewer than two
  victims, attacks that scored different victims, or a row made before
  per-victim scores were kept."""
  scored = {name: r for name, r in result["inversion"].items()
            if "error" not in r and _finite(r["ssim"])
            and (among is None or name in among)}
  if scored and len(result.get("seeds", ())) > 1:
    return pooling.leakage_intervals(result, list(scored))
  per_victim = [r.get("victims") for r in scored.values()]
  if not scored or None in per_victim or len(
      {tuple(v["clients"]) for v in per_victim}) != 1:
    return {"victims": None, "ssim_ci": None, "psnr_ci": None}
  ssim = {name: r["victims"]["ssim"] for name, r in scored.items()}
  psnr = {name: r["victims"]["psnr"] for name, r in scored.items()}
  return {"victims": len(per_victim[0]["clients"]),
          "ssim_ci": intervals.worst_case_interval(ssim),
          "psnr_ci": intervals.worst_case_interval(ssim, psnr)}


CONVERGENCE_TOLERANCE = 0.02  # SSIM gained over the last half of a search


def attack_converged(ssim_by_iterations: Optional[dict[str, float]]) -> Optional[bool]:
  """Whether the worst attack's mean SSIM rose by at most
  `CONVERGENCE_TOLERANCE` over the last half of its iterations (False: it
  was still improving, and the row's leakage is a lower bound); None where
  no snapshots were kept."""
  if not ssim_by_iterations or len(ssim_by_iterations) < 2:
    return None
  steps = sorted(ssim_by_iterations, key=int)
  half = next(k for k in steps if int(k) >= int(steps[-1]) // 2)
  return bool(ssim_by_iterations[steps[-1]] - ssim_by_iterations[half]
              <= CONVERGENCE_TOLERANCE)


def utility_interval(result: dict) -> Optional[list[float]]:
  """The 95% interval of a row's utility: the global model's test accuracy's
  Wilson interval over the test samples it scored, or the personalised mean
  accuracy's percentile bootstrap interval over the tested clients; None
  for a utility that is not finite, one tested client, or a row made before
  the samples' number or the clients' accuracies were kept."""
  if not _finite(result["utility"]):
    return None
  if len(result.get("seeds", ())) > 1:
    return pooling.utility_interval(result)
  if result["utility_kind"] != GLOBAL_UTILITY:
    return intervals.mean_interval(result.get("utility_by_client") or [])
  count = result.get("samples_tested")
  return (intervals.proportion_interval(round(result["utility"] * count), count)
          if count else None)


def best_adversary_intervals(attribute: dict) -> dict[str, Any]:
  """The intervals over victims (as attribute inference computed them) of
  the best adversary's plain and balanced success rates."""
  found = {}
  for rate in ("asr", "balanced_asr"):
    values, cis = attribute.get(rate), attribute.get(f"{rate}_ci")
    best = max(values, key=values.get) if values else None
    found[f"{rate}_max_ci"] = cis.get(best) if cis and best else None
  return found


def table_rows(grid: Grid, results: Sequence[dict]) -> list[dict[str, Any]]:
  """One flat dict per finished row: the report's and the CSV's columns;
  the rows of one protocol (of the grid's `protocols`) together, each
  compared with that protocol's reference, the seeds of a row pooled
  (`pooling.pooled`)."""
  grid_rows = {row.key: row for row in grid.rows()}
  rows = []
  for name, _ in grid.variants():
    mine = [r for r in results if grid_rows[r["key"]].protocol_name == name]
    rows += _protocol_rows(grid, _by_seed(mine, grid_rows), grid_rows, name)
  return rows


def _by_seed(results: Sequence[dict], grid_rows: dict) -> list[dict]:
  """One result per row of the grid, its finished seeds pooled, in order."""
  seeds: dict[str, list] = {}
  for r in sorted(results, key=lambda r: grid_rows[r["key"]].replicate):
    seeds.setdefault(grid_rows[r["key"]].base_key, []).append(r)
  return [{**pooling.pooled(found), "key": key, "seeds_done": len(found)}
          for key, found in seeds.items()]


def _protocol_rows(grid: Grid, results: Sequence[dict], grid_rows: dict,
                   protocol_name: Optional[str]) -> list[dict[str, Any]]:
  """`table_rows` of one protocol's results."""
  reference = _reference(grid, results)
  target = (grid.utility_target * reference["utility"]
            if reference and _finite(reference["utility"]) else None)
  matched = matched_keys([r for r in results if not grid_rows[r["key"]].equal_epsilon],
                         target)
  current = provenance.code_version()
  rows = []
  for r in results:
    worst = leakage(r) or {}
    row = grid_rows[r["key"]]
    unaware_names = [a for a in r["inversion"] if a not in row.adaptive]
    unaware = leakage(r, unaware_names) or {}
    attribute = r.get("attribute") or {}
    asr, balanced = attribute.get("asr"), attribute.get("balanced_asr")
    strength = r["settings"]["strength"]
    rows.append({
        "key": r["key"], "label": r["label"], "entry": r["entry"],
        "protocol": protocol_name, "seeds": r["seeds_done"],
        "seeds_planned": grid.seeds,
        "parameter": r["settings"]["parameter"], "strength": strength,
        "default": r["is_default"], "matched": r["key"] in matched,
        "utility": r["utility"], "utility_ci": utility_interval(r),
        "utility_kind": r["utility_kind"], "loss": r["loss"],
        **leakage_intervals(r), "unaware_ssim_ci": leakage_intervals(
            r, unaware_names)["ssim_ci"],
        **best_adversary_intervals(attribute),
        "upload_defense": row.upload_defense, "adaptive": list(row.adaptive),
        "attack": worst.get("attack"), "ssim": worst.get("ssim"),
        "ssim_by_iterations": worst.get("ssim_by_iterations"),
        "attack_converged": attack_converged(worst.get("ssim_by_iterations")),
        "psnr": worst.get("psnr"), "label_accuracy": worst.get("label_accuracy"),
        "unaware_attack": unaware.get("attack"), "unaware_ssim": unaware.get("ssim"),
        **{f"{metric}_{name}": cell.get(metric)
           for name, cell in r["inversion"].items() for metric in ("ssim", "psnr")},
        "asr": asr, "asr_max": max(asr.values()) if asr else None,
        "chance": attribute.get("chance"),
        "balanced_asr": balanced,
        "balanced_asr_max": max(balanced.values()) if balanced else None,
        "balanced_chance": attribute.get("balanced_chance"),
        **{f"balanced_asr_{name}": value for name, value in (balanced or {}).items()},
        "epsilon": (r["privacy"] or {}).get("epsilon"),
        "delta": (r["privacy"] or {}).get("delta"),
        "relation": (r["privacy"] or {}).get("relation"),
        # the target of a row calibrated to it (`grid.equal_epsilon_rows`)
        "equal_epsilon": (row.equal_epsilon or {}).get("epsilon"),
        "equal_delta": (row.equal_epsilon or {}).get("delta"),
        "time_ratio": (r["seconds_per_round"] / reference["seconds_per_round"]
                       if reference else None),
        "upload_bytes": r["upload_bytes"],
        # None for a row run before it was measured
        "upload_bytes_encoded": r.get("upload_bytes_encoded"),
        "concurrent_rows": r.get("concurrent_rows", 1),
        **audit_columns(r.get("audit")),
        "code_note": provenance.note(provenance.versions_of(r), current),
        "errors": refusals(r), "failures": failures(r)})
  plain = [x for x in rows if x["equal_epsilon"] is None]  # the main tables'
  front = pareto_front([(x["utility"], x["ssim"]) for x in plain],
                       [(x["utility_ci"], x["ssim_ci"]) for x in plain])
  on_front = {x["key"] for x, on in zip(plain, front) if on}
  for x in rows:
    x["pareto"] = x["key"] in on_front
  return rows


def audit_columns(audit: Optional[dict]) -> dict[str, Any]:
  """A row's audit (`tff-privacy audit`'s audit.json of its run; None where
  it was not audited) as columns: the claimed and audited epsilon of the
  one application audited (`audit_unit`: 'one upload', or 'one round' of
  a central mechanism), the bound's interval and reach, whether the claim is
  refuted, the membership-inference AUC, and why a part was not computed."""
  audit = audit or {}
  canary = audit.get("canary_audit") or {}
  mia = audit.get("membership_inference") or {}
  return {"audited": bool(audit),
          "epsilon_claimed_once": audit.get("epsilon_claimed"),
          "epsilon_audited": audit.get("epsilon_lower_bound"),
          "epsilon_audited_ci": audit.get("epsilon_interval"),
          "epsilon_reachable": canary.get("epsilon_reachable"),
          "audit_unit": audit.get("applied_to"),
          "audit_protects": audit.get("unit"),
          "audit_confidence": audit.get("confidence"),
          "audit_canaries": audit.get("canaries"),
          "claim_refuted": audit.get("claim_refuted"),
          "canary_audit_note": canary.get("reason"),
          "mia_auc": audit.get("mia_auc"),
          "mia_auc_ci": mia.get("mia_auc_ci"),
          "mia_attack": mia.get("best_attack"),
          "mia_note": mia.get("reason")}


def matched_keys(results: Sequence[dict], target: Optional[float]) -> set[str]:
  """Per swept entry, the row whose utility is closest to `target` (ties:
  the first strength)."""
  if target is None:
    return set()
  keys = set()
  for entry in dict.fromkeys(r["entry"] for r in results):
    mine = [r for r in results if r["entry"] == entry]
    scored = [r for r in mine if _finite(r["utility"])]
    if mine[0]["settings"]["parameter"] is None or not scored:
      continue
    keys.add(min(scored, key=lambda r: abs(r["utility"] - target))["key"])
  return keys


def _reference(grid: Grid, results: Sequence[dict]) -> Optional[dict]:
  """The reference entry's row at its default strength (its only row when
  it is not swept)."""
  return next((r for r in results if r["entry"] == grid.reference and r["is_default"]),
              None)


def _finite(value) -> bool:
  return value is not None and bool(np.isfinite(value))


def pareto_front(points: Sequence[tuple[float, Optional[float]]],
                 intervals: Optional[Sequence[tuple]] = None) -> list[bool]:
  """Which (utility, leakage) points no other point dominates. Without
  `intervals`: higher or equal utility and lower or equal leakage, one
  strictly. With them (per point, (utility interval, leakage interval),
  either None for none): higher utility and lower leakage each beyond the
  intervals (the other's utility interval wholly above, its leakage
  interval wholly below), so that points whose intervals overlap on an axis
  are tied there, not ordered. Points without a finite utility and leakage
  are not on the front."""
  scored = [_finite(u) and _finite(s) for u, s in points]
  bounds = [(_bounds(u, cu), _bounds(s, cs)) for (u, s), (cu, cs) in zip(
      points, intervals or [(None, None)] * len(points))]

  def beats(j: int, i: int) -> bool:
    if intervals is None:
      return (points[j][0] >= points[i][0] and points[j][1] <= points[i][1]
              and points[j] != points[i])
    return bounds[j][0][0] > bounds[i][0][1] and bounds[j][1][1] < bounds[i][1][0]

  return [scored[i] and not any(scored[j] and j != i and beats(j, i)
                                for j in range(len(points)))
          for i in range(len(points))]


def _bounds(value, interval) -> tuple:
  """(low, high) of `value`'s interval, (value, value) without one."""
  return tuple(interval) if interval is not None else (value, value)


def write(grid: Grid, results: Sequence[dict], out: str,
          command: Optional[Sequence[str]] = None) -> str:
  """Writes report.md, leaderboard.csv, leaderboard.json and the figures
  under `out`; returns the report's path. `command`, the command line that
  ran the leaderboard, is kept in OUT/command.json; None reuses the kept one."""
  kept = os.path.join(out, "command.json")
  if command is not None:
    io.write_json(kept, list(command))
  elif os.path.exists(kept):
    command = io.read_json(kept)
  unknown = sorted({r["key"] for r in results} - {row.key for row in grid.rows()})
  if unknown:
    raise ValueError(f"results of rows {unknown} are not rows of the grid (of "
                     "another grid, or equal-epsilon rows of an uncalibrated "
                     "one); report what board.read(out) returns")
  rows = table_rows(grid, results)
  attacks = dict.fromkeys(a for row in grid.rows() for a in row.inversion)
  io.write_csv(os.path.join(out, "leaderboard.csv"), rows, COLUMNS + tuple(
      f"balanced_asr_{name}" for name in grid.attacks["adversaries"]) + tuple(
          f"{metric}_{name}" for name in attacks for metric in ("ssim", "psnr")))
  io.write_json(os.path.join(out, "leaderboard.json"),
                {"grid": grid.to_json(), "rows": rows, "versions": versions(),
                 "code_version": provenance.code_version()})
  for name, _ in grid.variants():
    mine = [r for r in rows if r["protocol"] == name]
    tradeoff, reconstructions, asr = figures(name)
    _tradeoff_figure([r for r in mine if r["equal_epsilon"] is None],
                     os.path.join(out, tradeoff))
    _reconstruction_figure(mine, _first_seeds(grid, results), out,
                           os.path.join(out, reconstructions))
    _asr_figure(mine, os.path.join(out, asr))
  path = os.path.join(out, "report.md")
  io.write_text(path, markdown(grid, rows, command))
  return path


def markdown(grid: Grid, rows: Sequence[dict], command=None) -> str:
  attacks, protocol = grid.attacks, grid.protocol
  lines = ["# Leaderboard", "",
           ("Protocol, which each protocol below changes as it says: "
            if grid.protocols else "Protocol: ") +
           f"{_settings(protocol)}. Every row is attacked on round "
           f"{attacks['capture_round']}'s uploads of its first {attacks['victims']} "
           f"clients: {', '.join(sorted({a for r in grid.rows() for a in r.inversion}))} "
           f"({_iterations(attacks)}; the adaptive ones only on the "
           "rows of the defences they know), and attribute inference of "
           f"'{attacks['attribute']}' by {', '.join(attacks['adversaries'])} "
           f"(trained on {attacks['shadow_samples']} clean shadow samples).", "",
           "Leakage is the worst inversion attack of the row (highest SSIM), "
           "over the attacks unaware of its defence and the adaptive ones that "
           "know it; 'unaware' is the worst of the unaware attacks alone, what "
           "the defence looks like to an attacker who ignores it. ASR "
           "is the best adversary's balanced attack success rate (the mean "
           "recall over the attribute's classes, so that a few victims of one "
           "class do not pass for leakage) beside its chance rate; "
           "leaderboard.csv has every adversary's, and the plain rates. Time is seconds per round over the reference's "
           f"({grid.reference}){_concurrency(rows)}; the upload is one "
           "client's, dense float32, and in parentheses, where it differs, in its "
           "defence's own encoding (sparsification: an int32 index and float32 "
           "value per nonzero entry; LDP-Fed: ceil(log2 |U|) bits per entry). "
           "Utility is the global model's test accuracy, or, marked *, the "
           "mean accuracy of the clients' own models on their own test splits "
           "(personalised methods): the two are different measurements. "
           "Brackets hold 95% intervals: utility's over the test samples "
           "(Wilson), or for a personalised mean over the clients (a "
           "bootstrap), leakage's over the victims (a bootstrap that chooses the "
           "worst attack inside each resample, so it covers that choice too), "
           "ASR's over the victims; a value without one has none that can be "
           f"computed here (one victim or tested client, a row made before "
           f"they were kept). {_seeds(grid)}{_victims(rows)}. A row is on "
           "the Pareto front (P) unless another has higher utility and lower "
           "leakage, each beyond the two rows' intervals: rows whose intervals "
           "overlap are tied, not ordered.", ""]
  for name, variant in grid.variants():
    lines += _protocol_sections(variant, [r for r in rows if r["protocol"] == name],
                                name)
  lines += _without_adaptive(rows)
  lines += _audits(rows)
  lines += _unconverged(rows)
  lines += _listed("Attacks that could not run", rows, "errors")
  lines += _listed("Attacks that failed (the next run of the leaderboard runs "
                   "them again)", rows, "failures")
  lines += _other_code(rows)
  names = [figures(name) for name, _ in grid.variants()]
  lines += ["## Figures", "", *(["One of each per protocol: " + "; ".join(
      f"{name}: {', '.join(files)}" for (name, _), files in zip(grid.variants(), names)),
      ""] if grid.protocols else []),
            f"- {names[0][0]}: utility against leakage, one point per row with "
            "its intervals as bars; the rows on the Pareto front are ringed.",
            f"- {names[0][1]}: the same originals (top) and each entry's "
            "reconstruction at its matched (else default) strength.",
            f"- {names[0][2]}: each adversary's balanced attack success rate per "
            "entry at its matched (else default) strength; the dashed line is chance.",
            "", "## How it was made", ""]
  if command:
    lines += ["```", " ".join(command), "```", ""]
  lines += [f"- {name}: {version}" for name, version in versions().items()]
  return "\n".join(lines) + "\n"


ANALYTIC_REGIME = (
    "This protocol is the analytic regime: at batch 1 the gradient of a dense "
    "first layer hands the image over exactly (each row of its weight "
    "gradient divided by that unit's bias gradient), so a defence that "
    "leaves the first layer's gradient intact leaks there whatever it does "
    "to later layers; gradient-inversion papers and the defences' own "
    "evaluations use CNNs at batches of 1 to 8 (the `cnn` grid, and "
    "`--scale full`).")


def _protocol_sections(grid: Grid, rows: Sequence[dict],
                       name: Optional[str]) -> list[str]:
  """The tables and verdicts of one protocol's rows (`grid`: the grid under
  it, `Grid.variants`), headed by its name where the grid has several."""
  lines = ([f"## Protocol: {name}", "", f"{_settings(grid.protocol)}.", ""]
           if name else [])
  if _analytic(grid.protocol):
    lines += [ANALYTIC_REGIME, ""]
  main = [r for r in rows if r["equal_epsilon"] is None]
  if all(r["default"] for r in main):  # one strength per entry: one table
    lines += section(_titled("Every row, each entry at its default strength (P: on "
                             "the Pareto front of utility against leakage)", name),
                     main, matched=False)
  else:
    lines += _strength_sections(grid, main, name)
  lines += _equal_epsilon_sections(grid, rows, name)
  from tff_privacy.leaderboard import verdicts  # deferred: it formats with this module
  found = verdicts.verdicts(rows, grid.reference)
  under = f"Under {name}: " if name else ""
  return lines + ([f"## {_titled('Verdicts', name)}", "",
                   "Written from the numbers and their 95% intervals, "
                   f"{_seeds(grid).lower()}: where two intervals overlap the rows "
                   "are tied, not ordered.", "", *(f"- {under}{v}" for v in found), ""]
                  if found else [])


def _titled(title: str, protocol_name: Optional[str]) -> str:
  return f"{title} ({protocol_name})" if protocol_name else title


def _analytic(protocol: dict) -> bool:
  """Whether `protocol` trains an MLP on batch-1 gradients."""
  return protocol.get("model") == "mlp" and protocol.get("batch_size") == 1


def _seeds(grid: Grid) -> str:
  if grid.seeds == 1:
    return "One seed per row"
  return (f"{grid.seeds} seeds per row (seed {grid.protocol.get('seed', 0)} on), "
          "pooled: each number is over every seed's victims, test samples or "
          "clients, and its interval resamples the seeds and, inside each, "
          "those units, so it holds the seed-to-seed spread")


def _strength_sections(grid: Grid, rows: Sequence[dict],
                       name: Optional[str] = None) -> list[str]:
  """The tables of a grid that sweeps strengths: at the defaults, matched
  in utility to the reference, and every row."""
  lines = section(_titled("At each entry's default strength", name),
                  [r for r in rows if r["default"]])
  reference = _reference_row(grid, rows)
  if reference and _finite(reference["utility"]):
    lines += section(_titled(
        f"Utility-matched: the strength closest to {grid.utility_target:g} x "
        f"the reference's {reference['utility_kind']} "
        f"({grid.utility_target * reference['utility']:.4f})", name),
        [r for r in rows if r["matched"]])
  return lines + section(_titled("Every row (P: on the Pareto front of utility "
                                 "against leakage)", name), rows)


def _equal_epsilon_sections(grid: Grid, rows: Sequence[dict],
                            protocol_name: Optional[str] = None) -> list[str]:
  """The rows calibrated to the grid's equal-epsilon target, one table per
  unit their epsilon protects (`accounting.protected`), each followed by
  the entries protecting it that no strength brings to the target; none
  without a target or any such row or entry. `grid` is the grid under
  protocol `protocol_name` (`Grid.variants`)."""
  target = grid.equal_epsilon
  calibrated = [r for r in rows if r["equal_epsilon"] is not None]
  mine = {calibration_key(protocol_name, e): e["name"] for e in grid.entries}
  failed = {mine[key]: c for key, c in (grid.calibration or {}).items()
            if key in mine and c.get("error")}
  if target is None or not (calibrated or failed):
    return []
  usable = _usable_utility(grid, rows)
  lines = [f"## {_titled('At equal privacy', protocol_name)}: epsilon "
           f"{target['epsilon']:g} (delta {target['delta']:g})",
           "", "Each swept entry with a DP guarantee, run once more at the strength "
           "of its swept parameter at which its run's own accounting spends epsilon "
           f"{target['epsilon']:g} at delta {target['delta']:g} (calibrated with "
           "dp_accounting before training, within 1%; a pure-DP mechanism spends "
           "it at delta 0). An epsilon means what its neighbouring "
           "relation protects (one record, a client's data, one upload), so rows are "
           "compared only within one such unit: one table each, naming each row's "
           "relation. "
           + ("A model is usable when its utility is at least "
              f"{grid.utility_target:g} x the reference's ({usable:.4f}), the "
              "utility-matched table's target, and is said to be usable or not "
              "only where its utility's interval lies wholly on one side." if usable is not None else
              "Without the reference's utility no model is judged usable or not."),
           ""]
  for unit in dict.fromkeys(accounting.protected(x["relation"]) for x in
                            calibrated + list(failed.values())):
    mine = [r for r in calibrated if accounting.protected(r["relation"]) == unit]
    unreached = [f"- {name}: no row at epsilon {target['epsilon']:g}: {c['error']}"
                 for name, c in failed.items()
                 if accounting.protected(c["relation"]) == unit]
    lines += ([f"### Protecting {unit}", ""]
              + (_equal_epsilon_table(mine, usable) if mine else [])
              + (unreached + [""] if unreached else []))
  return lines


def _usable(r: dict, usable: Optional[float]) -> str:
  """Whether row `r`'s model is usable (utility >= `usable`), judged on its
  utility's interval where it has one: usable or not only beyond it."""
  if usable is None or not _finite(r["utility"]):
    return "n/a"
  low, high = r["utility_ci"] or (r["utility"], r["utility"])
  if low >= usable:
    return "usable"
  if high < usable:
    return f"not usable (utility below {usable:.4f})"
  return f"usable or not within its interval (which holds {usable:.4f})"


def _usable_utility(grid: Grid, rows: Sequence[dict]) -> Optional[float]:
  """The least utility of a usable model: `utility_target` x the reference
  row's utility (the utility-matched table's target); None without it."""
  reference = _reference_row(grid, rows)
  if reference is None or not _finite(reference["utility"]):
    return None
  return grid.utility_target * reference["utility"]


def _reference_row(grid: Grid, rows: Sequence[dict]) -> Optional[dict]:
  """The table row of the grid's reference entry at its default strength."""
  return next((r for r in rows if r["entry"] == grid.reference and r["default"]), None)


def _equal_epsilon_table(rows: Sequence[dict], usable: Optional[float]) -> list[str]:
  """A table of equal-epsilon rows: strength, epsilon spent under which
  relation (Rn, listed below it), utility, leakage, ASR and whether the
  model is usable (utility >= `usable`)."""
  head = ("| entry | calibrated strength | epsilon spent (delta) | relation | utility | "
          "leakage SSIM (attack) | balanced ASR (chance) | model |")
  lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
  relations = list(dict.fromkeys(r["relation"] for r in rows))
  for r in rows:
    model = _usable(r, usable)
    lines.append("| " + " | ".join([
        r["entry"], f"{r['parameter']}={r['strength']:.4g}",
        "n/a" if r["epsilon"] is None else f"{r['epsilon']:.4g} ({r['delta']:g})",
        f"R{relations.index(r['relation']) + 1}", _utility_cell(r), _leakage_cell(r),
        _asr_cell(r), model]) + " |")
  return lines + [""] + [f"- R{i}: {words}" for i, words in enumerate(relations, 1)] + [""]


def _without_adaptive(rows: Sequence[dict]) -> list[str]:
  """A section naming the rows' defences that no attack here knows (judged
  by attacks unaware of them only), each with the reason it states; none
  when there are none."""
  unknown = inversion_attacks.without_adaptive_attack()
  entries = {}
  for r in rows:
    if r["upload_defense"] in unknown:
      entries.setdefault(r["upload_defense"], []).append(r["entry"])
  items = [f"- {defense} ({', '.join(dict.fromkeys(names))}): "
           f"{unknown[defense] or 'no reason stated'}"
           for defense, names in entries.items()]
  return (["## Defences without a known adaptive attack", "",
           "Their leakage is the unaware attacks' only: a lower bound on what "
           "an attacker who knows them recovers.", "", *items, ""]
          if items else [])


def _audits(rows: Sequence[dict]) -> list[str]:
  """The audits' table (`tff-privacy audit --leaderboard OUT`); none where
  no row was audited."""
  audited = [r for r in rows if r["audited"]]
  if not audited:
    return []
  lines = ["## Audits", "",
           "What each row's claim survives: the epsilon claimed for one "
           "application of its mechanism (one upload of a local DP defence; "
           "one round of DP-FedAvg, for adding or removing a client) beside "
           "Steinke et al.'s one-run lower bound on it from canaries, with the "
           "bound's interval and, after 'of', the most its canaries can show "
           "(a claim above that can be neither confirmed nor refuted by them); "
           "'refuted' where the bound exceeds the claim. MIA AUC is "
           "the best of tensorflow_privacy's membership-inference attacks on "
           "the final model (training against test samples; 0.5 is chance), "
           "with its interval over the scored samples, the best attack chosen "
           "inside each resample; the best of six attacks lies above 0.5 even "
           "where none has an edge.", "",
           "| row | epsilon of the run (relation) | audited: one | claimed | audited lower bound | refuted | MIA AUC (attack) |",
           "|---|---|---|---|---|---|---|"]
  for r in audited:
    claimed = r["epsilon_claimed_once"]
    if r["epsilon_audited"] is None:
      bound = f"not audited: {r['canary_audit_note']}"
    else:
      low, high = r["epsilon_audited_ci"]
      reach = ("" if r["epsilon_reachable"] is None
               else f" of {r['epsilon_reachable']:.2f}")
      bound = (f"{r['epsilon_audited']:.2f} [{low:.2f}, "
               f"{'unbounded' if high is None else f'{high:.2f}'}]{reach} "
               f"({r['audit_canaries']} canaries)")
    run = ("none" if r["epsilon"] is None else
           f"{r['epsilon']:.3g} ({accounting.protected(r['relation'])})")
    ci = ("" if not r.get("mia_auc_ci") else
          " [{:.3f}, {:.3f}]".format(*r["mia_auc_ci"]))
    mia = (f"{r['mia_auc']:.3f}{ci} ({r['mia_attack']})" if r["mia_auc"] is not None
           else f"not computed: {r['mia_note']}")
    refuted = {True: "**refuted**", False: "no", None: ""}[r["claim_refuted"]]
    unit = {"one upload": "upload", "one round": "round"}.get(r["audit_unit"], "")
    if unit and r.get("audit_protects") == "one record":
      unit += " (record)"
    lines.append(f"| {_where(r)} | {run} | {unit} | "
                 f"{'none' if claimed is None else f'{claimed:.3g}'} | {bound} | "
                 f"{refuted} | {mia} |")
  return lines + [""]


def _unconverged(rows: Sequence[dict]) -> list[str]:
  """A section naming the rows whose worst attack was still improving when
  it stopped; none when there are none."""
  items = [f"- {_where(r)}, {r['attack']}: SSIM " + ", ".join(
      f"{v:.3f} after {k}" for k, v in sorted(r["ssim_by_iterations"].items(),
                                            key=lambda kv: int(kv[0])))
           for r in rows if r["attack_converged"] is False]
  return (["## Leakage that is a lower bound", "",
           "The worst attack of these rows gained more than "
           f"{CONVERGENCE_TOLERANCE} SSIM over the last half of its iterations: "
           "it was still improving when it stopped.", "", *items, ""]
          if items else [])


def _other_code(rows: Sequence[dict]) -> list[str]:
  """A section naming the rows made by code other than the current (reused
  from earlier runs), and by which; none when there are none."""
  items = [f"- {_where(r)} (rows/{r['key']}): {r['code_note']}"
           for r in rows if r["code_note"]]
  return (["## Rows made by other code", "",
           "Finished rows are reused whichever code made them; delete a "
           "row's folder to run it again with the current code.", "", *items, ""]
          if items else [])


def _seeds_done(r: dict) -> str:
  """' (k of n seeds)' for a row whose seeds have not all finished."""
  done, planned = r.get("seeds", 1), r.get("seeds_planned", 1)
  return f" ({done} of {planned} seeds)" if done < planned else ""


def _where(r: dict) -> str:
  """A row's label, and its protocol where the grid has several."""
  return r["label"] + (f" under {r['protocol']}" if r.get("protocol") else "")


def _listed(title: str, rows: Sequence[dict], key: str) -> list[str]:
  """A section listing the rows' attacks under `key` and why; none when
  there are none."""
  items = [f"- {_where(r)}, {attack}: {why}" for r in rows
           for attack, why in r[key].items()]
  return [f"## {title}", "", *items, ""] if items else []


def section(title: str, rows: Sequence[dict], matched: bool = True) -> list[str]:
  head = ("| row | utility | loss | leakage SSIM (attack) | PSNR dB | label acc. | "
          "unaware SSIM (attack) | balanced ASR (chance) | epsilon (delta) | "
          "time x | upload |")
  lines = [f"## {title}", "", head, "|" + "---|" * head.count(" | ") + "---|"]
  for r in rows:
    marks = "".join(m for m, on in (("P", r["pareto"]), ("M", matched and r["matched"]))
                    if on)
    lines.append("| " + " | ".join([
        r["label"] + (f" [{marks}]" if marks else "") + _seeds_done(r),
        _utility_cell(r),
        _number(r["loss"], 4), _leakage_cell(r),
        _with_interval(r["psnr"], r["psnr_ci"], 2), _number(r["label_accuracy"], 2),
        _unaware(r), _asr_cell(r),
        "-" if r["epsilon"] is None else f"{r['epsilon']:.3g} ({r['delta']:g})",
        _number(r["time_ratio"], 2), _upload(r)]) + " |")
  return lines + [""]


def _utility_cell(r: dict) -> str:
  """The utility with its interval; * marks a personalised mean."""
  return (_with_interval(r["utility"], r["utility_ci"], 4)
          + ("*" if r["utility_kind"] != GLOBAL_UTILITY else ""))


def _leakage_cell(r: dict) -> str:
  """The worst attack's SSIM with its interval, and the attack."""
  if r["ssim"] is None:
    return "n/a"
  return f"{_with_interval(r['ssim'], r['ssim_ci'], 3)} ({r['attack']})"


def _asr_cell(r: dict) -> str:
  """The best adversary's balanced ASR with its interval, and chance."""
  if r["balanced_asr_max"] is None:
    return "n/a"
  return (f"{_with_interval(r['balanced_asr_max'], r['balanced_asr_max_ci'], 2)} "
          f"({r['balanced_chance']:.2f})")


def _unaware(r: dict) -> str:
  """The unaware attacks' worst SSIM and attack; '=' for a row without
  adaptive attacks, whose leakage is the unaware attacks' already."""
  if r["unaware_ssim"] is None:
    return "n/a"
  if not r["adaptive"]:
    return "="
  return (f"{_with_interval(r['unaware_ssim'], r['unaware_ssim_ci'], 3)} "
          f"({r['unaware_attack']})")


def _upload(r: dict) -> str:
  """The dense upload's size, and its encoded size where that differs."""
  encoded = r["upload_bytes_encoded"]
  if encoded is None or encoded == r["upload_bytes"]:
    return _bytes(r["upload_bytes"])
  return f"{_bytes(r['upload_bytes'])} ({_bytes(encoded)} encoded)"


def _iterations(attacks: dict) -> str:
  if attacks["iterations"] == SOURCE_ITERATIONS:
    return "each for the iterations at which its source reports results"
  return f"{attacks['iterations']} iterations"


def _victims(rows: Sequence[dict]) -> str:
  counts = sorted({r["victims"] for r in rows if r["victims"] is not None})
  return (f"; {', '.join(map(str, counts))} victims attacked per row"
          if counts else "")


def _concurrency(rows: Sequence[dict]) -> str:
  jobs = max((r.get("concurrent_rows") or 1 for r in rows), default=1)
  return ("" if jobs == 1 else f", measured while up to {jobs} rows trained at "
          "once (--jobs 1 for clean timings)")


def _with_interval(value, interval: Optional[Sequence[float]], digits: int) -> str:
  """`value` and, where there is one, its 95% interval in brackets."""
  if value is None or interval is None:
    return _number(value, digits)
  low, high = interval
  return f"{_number(value, digits)} [{_number(low, digits)}, {_number(high, digits)}]"


def _number(value, digits: int) -> str:
  if value is None:
    return "n/a"
  if not np.isfinite(value) or abs(value) >= 1e4:  # a diverged loss
    return f"{value:.3g}"
  return f"{value:.{digits}f}"


def _bytes(n: int) -> str:
  return f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.2f} MiB"


def _settings(protocol: dict) -> str:
  return ", ".join(f"{k} {v}" for k, v in protocol.items())


def versions() -> dict[str, str]:
  found = {"python": platform.python_version()}
  for name in PACKAGES:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = "not installed"
  found["tff_privacy code"] = provenance.describe(provenance.code_version())
  return found


def _shown(rows: Sequence[dict]) -> list[dict]:
  """One row per entry: its matched strength, else its default."""
  shown = {}
  for r in rows:
    if r["matched"] or (r["default"] and r["entry"] not in shown):
      shown[r["entry"]] = r
  return list(shown.values())


def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _save(fig, path: str) -> None:
  plt = _pyplot()
  with io.atomic_path(path) as tmp:
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
  plt.close(fig)


def _tradeoff_figure(rows: Sequence[dict], path: str) -> None:
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(8, 5.5))
  entries = list(dict.fromkeys(r["entry"] for r in rows))
  colours = plt.get_cmap("tab20")(np.linspace(0, 1, max(len(entries), 2)))
  for entry, colour in zip(entries, colours):
    mine = [r for r in rows if r["entry"] == entry and r["ssim"] is not None]
    if mine:
      ax.errorbar([r["ssim"] for r in mine], [r["utility"] for r in mine],
                  xerr=_error_bars(mine, "ssim"), yerr=_error_bars(mine, "utility"),
                  fmt="o-", color=colour, label=entry, alpha=0.85, capsize=2)
  front = [(r["ssim"], r["utility"]) for r in rows if r["pareto"]]
  if front:  # rows tied within their intervals make no staircase: ringed
    ax.scatter(*zip(*front), s=150, facecolors="none", edgecolors="black",
               linewidths=1.2, label="Pareto front (within the intervals)")
  ax.set_xlabel("leakage: worst inversion SSIM (lower is more private)")
  kinds = list(dict.fromkeys(r["utility_kind"] for r in rows))
  ax.set_ylabel("utility: " + (f"{kinds[0]}" if len(kinds) == 1 else
                               f"{kinds[0]} (personalised methods: {', '.join(kinds[1:])})"))
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="best")
  ax.set_title("Utility against leakage, one point per strength")
  _save(fig, path)


def _error_bars(rows: Sequence[dict], field: str) -> np.ndarray:
  """[[below], [above]] of each row's `field` to its interval's ends (0
  where it has none), for matplotlib's errorbar."""
  return np.array([[r[field] - r[f"{field}_ci"][0], r[f"{field}_ci"][1] - r[field]]
                   if r[f"{field}_ci"] else [0.0, 0.0] for r in rows]).T.clip(0)


def _reconstruction_figure(rows: Sequence[dict], results: Sequence[dict], out: str,
                           path: str) -> None:
  """The reconstructions of the `rows` shown (`_shown`; table rows of one
  protocol) from `results`, a row's first finished seed's, keyed by the
  row's `base_key`."""
  from tff_privacy.metrics import report
  images, originals, value_range = {}, None, None
  for r in (results[x["key"]] for x in _shown(rows) if x["key"] in results):
    worst = leakage(r)
    if worst is None:
      continue
    data = np.load(os.path.join(out, worst["folder"], "reconstructions.npz"))
    if originals is None:
      originals, value_range = data["original"], worst["value_range"]
      images["original"] = list(originals)
    images[f"{r['entry']} ({worst['attack']})"] = _same_originals(
        originals, data["original"], data["reconstructed"])
  if images:
    report.save_grid(images, path, value_range, max_columns=8,
                     title="Reconstructions of the same round-1 images")


def _first_seeds(grid: Grid, results: Sequence[dict]) -> dict[str, dict]:
  """{row's `base_key`: the result of its first finished seed}."""
  rows = {row.key: row for row in grid.rows()}
  found = {}
  for r in sorted(results, key=lambda r: -rows[r["key"]].replicate):
    found[rows[r["key"]].base_key] = r
  return found


def _same_originals(originals: np.ndarray, theirs: np.ndarray,
                    reconstructed: np.ndarray) -> list[np.ndarray]:
  """The reconstruction of each of `originals` in another row's attack
  (whose uploads may hold more images, e.g. a local epoch's), found by
  equal original; a blank (NaN) image where that row's uploads lack it."""
  shown = []
  for image in originals:
    match = [j for j, other in enumerate(theirs)
             if other.shape == image.shape and np.array_equal(other, image)]
    shown.append(reconstructed[match[0]] if match
                 else np.full(image.shape, np.nan, dtype=np.float32))
  return shown


def _asr_figure(rows: Sequence[dict], path: str) -> None:
  plt = _pyplot()
  shown = [r for r in _shown(rows) if r["balanced_asr"]]
  fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(shown) + 2), 4.5))
  if shown:
    adversaries = list(shown[0]["balanced_asr"])
    width = 0.8 / len(adversaries)
    x = np.arange(len(shown))
    for k, name in enumerate(adversaries):
      ax.bar(x + (k - (len(adversaries) - 1) / 2) * width,
             [r["balanced_asr"][name] for r in shown], width, label=name)
    for i, r in enumerate(shown):
      ax.hlines(r["balanced_chance"], i - 0.45, i + 0.45, colors="black",
                linestyles="--")
    ax.set_xticks(x, [r["entry"] for r in shown], rotation=35, ha="right", fontsize=8)
    ax.legend(fontsize=8)
  ax.set_ylim(0, 1.05)
  ax.set_ylabel("balanced attribute inference success rate")
  ax.set_title("Attribute inference per entry (dashed: chance)")
  _save(fig, path)
