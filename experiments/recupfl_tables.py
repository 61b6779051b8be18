"""RECUP-FL's experiments (paper 003, Sec. 6) at a small scale by default.

Every point is one FedSGD run in TFF (`tff_privacy.runner`) with one sample
per client (Sec. 5.1) and the server learning rate of Appendix Table 2
(Adult: 0.01). Its rounds 1, 3 and 5 are captured, and the sensitive
attributes of every sampled client are inferred from its upload by the four
adversaries (`tff-privacy train --infer-attributes`: Stru-NN, Unknown-NN,
SVM and RF trained, as the paper's are, on clean shadow uploads of the
training records the defender zoo trains on, at the round's broadcast
model). ASR is the share of victims whose attribute is inferred correctly
(the paper's metric); the balanced ASR, the mean recall over the
attribute's classes, is given beside it because 85% of Adult's records are
white, so plain ASR stays high for an adversary that always says 'white'.
Every ASR comes with its 95% interval (Wilson for plain ASR, a bootstrap
over victims for balanced ASR).

Utility is read on two axes: the learning loss (the global model's loss on
the test split after the round, Sec. 5.6; MSE on Adult), and the aggregate
update's relative error against the undefended mean of the same clients'
uploads at the same model (`update_relative_error`; `update_cosine` beside
it). On Adult one FedSGD round at learning rate 0.01 barely moves the
loss, so the first axis often cannot order the defences: the seed-to-seed
standard deviation of the undefended loss (--noise-seeds extra runs) is its
noise, and where a round's defended points spread less than twice that,
the tables say so instead of reading the curves there.

Tables (CSV and Markdown in OUT; PNG figures):
* tradeoff: ASR against each utility axis for no defence, RECUP-FL
  protecting the attribute (M = 1) and, on Adult, race and sex (M = 2),
  DP Gaussian and DP Laplace, and --tradeoff-extra defences, every defence
  also attacked by adaptive adversaries (trained on shadow uploads through
  the same defence: the same noise; for RECUP-FL, perturbed against the
  round's zoo as the victims' uploads are),
  each over its range of Sec. 5.3 / 5.5, for each adversary at rounds 1, 3
  and 5 (Figs. 2, 10, 11: tradeoff_<attribute>_<asr|balanced_asr>.png,
  error bars the 95% intervals; loss_curves.png, the learning loss over
  rounds). tradeoff.md reads DP Gaussian's and DP Laplace's ASR (and
  interval bounds) at each RECUP-FL point's utility, interpolated between
  the two measured points around it, and says whether RECUP-FL's interval
  lies below, above or overlaps theirs (adaptive against adaptive);
* gamma: race and sex protected together with gamma_race swept 0 to 1 by
  0.25 and gamma_sex = 1 - gamma_race (Sec. 6.3), ASR of both at round 1;
* attributes: M = 1 (race) and M = 2 (race and sex, gamma 1 each) protected
  attributes, ASR of both at round 1;
* zoo: zoo sizes 5, 10, 15 and 20 (Fig. 8) and fgsm: the FGSM variants of
  Appendix E against Algorithm 1 (Fig. 9), both at round 1;
* participation: the learning loss per round with 20% to 100% of the clients
  sampled each round (Fig. 7), RECUP-FL on;
* reconstruction: Inverting Gradients on round-1 uploads of the bundled
  digits (whatever --dataset is; RECUP-FL protects parity) under every
  setting of the trade-off, its MSE read at RECUP-FL's learning loss
  (Fig. 6; reconstruction.png shows each baseline at its nearest loss);
* adaptive: round 1 of every defence at the trade-off's levels, ASR of the
  paper's adversaries beside that of adaptive ones, trained on shadow
  uploads passed through the same defence (not in the paper: clean-shadow
  adversaries misread noisy or perturbed uploads).

Small scale (--scale small, the default): 1,000 clients, 400 sampled per
round (the victims), the adversaries and the zoo trained on the same 1,000
training records; each RECUP-FL zoo (20 models) is trained for 20 epochs
at the broadcast model of rounds 1, 3 and 5 (the captured ones; rounds 2
and 4 perturb against the zoo of the round before); 4 levels per defence.
--scale paper trains the zoo 80 epochs every round, uses 5 levels, adds
sparsification and Soteria and runs IG for 2,000 iterations. RECUP-FL's
fixed budget for the zoo, fgsm, gamma and participation tables is --epsilon
(default 1e-3). Every run lives in OUT/runs/<name>/ and is not recomputed
when its metrics are complete.

  python experiments/recupfl_tables.py                       # all tables, Adult
  python experiments/recupfl_tables.py --tables tradeoff --levels 3
  python experiments/recupfl_tables.py --scale paper
  python experiments/recupfl_tables.py --dataset mnist5k_parity
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import math

import numpy as np

from tff_privacy import evaluate, io, provenance, runner, runtime
from tff_privacy.updates import UpdateStore
from tff_privacy.metrics import report
from tff_privacy.attacks.attribute import ADVERSARIES

TABLES = ("tradeoff", "gamma", "attributes", "zoo", "fgsm", "participation",
          "reconstruction", "adaptive")
ROUNDS = (1, 3, 5)
# clip bound B of the DP baselines: Sec. 5.5 sets B in [20, 22] on Adult and
# AudioMNIST, a bound that does not bind; sigma (Gaussian std) and b (Laplace
# scale) are then the noise itself: noise_multiplier = sigma / B
CLIP = 20.0
# each defence's parameter and range (Sec. 5.3 and 5.5), log-spaced for the
# noise levels and budgets, evenly for the shares
# soteria_layer: the dense layer Soteria defends. Its input must be a learned
# representation (Soteria's setting): the MLP's first layer reads the raw
# one-hot record, where Soteria's scores 1 / (x + 0.1) prune every non-zero
# input row at all of Sec. 5.5's rates, i.e. the whole first-layer gradient.
DATASETS = {
    "adult": {"model": "mlp", "model_kwargs": {"hidden": [50]}, "soteria_layer": "fc2",
              "learning_rate": 0.01, "attribute": "race", "second": "sex",
              "ranges": {"recupfl": (1e-5, 0.1), "ldp_gaussian": (1e-5, 0.1),
                         "ldp_laplace": (1e-5, 0.1), "sparsification": (0.15, 0.8),
                         "soteria": (0.2, 0.9)}},
    # no paper setting: the bundled digits (task digit >= 5, attribute
    # parity) with LFW's ranges, the closest image data set of the paper
    "mnist5k_parity": {"model": "cnn", "model_kwargs": {},
                       "learning_rate": 0.01, "attribute": "parity", "second": None,
                       "ranges": {"recupfl": (5e-5, 0.5), "ldp_gaussian": (5e-5, 0.5),
                                  "ldp_laplace": (2e-5, 0.2),
                                  "sparsification": (0.8, 0.99),
                                  "soteria": (0.8, 0.95)}},
}
LABELS = {"none": "no defence", "recupfl": "RECUP-FL", "ldp_gaussian": "DP Gaussian",
          "ldp_laplace": "DP Laplace", "sparsification": "sparsification",
          "soteria": "Soteria"}
ASR_KINDS = ("asr", "balanced_asr", "adaptive_asr", "adaptive_balanced_asr")
# the utility axes of the trade-off: (metrics key, label, read on a log scale)
UTILITY_AXES = (("learning_loss", "learning loss", False),
                ("update_relative_error", "aggregate-update relative error", True))
DP_CURVES = ("DP Gaussian", "DP Laplace")
RECUPFL_DEFAULTS = {"zoo_size": 20, "fgsm": "recupfl"}  # and protect: the attribute
# --scale: the defaults of the run settings. 'small' retrains the zoo at the
# captured rounds 1, 3 and 5 only (each round's clients perturb against the
# latest zoo); the paper pre-trains its zoo once and trains it 80 epochs.
SCALES = {"small": {"zoo_epochs": 20, "zoo_refresh": 2, "levels": 4,
                    "tradeoff_extra": "", "ig_iterations": 1000},
          "paper": {"zoo_epochs": 80, "zoo_refresh": 1, "levels": 5,
                    "tradeoff_extra": "sparsification,soteria",
                    "ig_iterations": 2000}}


def levels(defense: str, low: float, high: float, count: int) -> list[float]:
  """`count` levels from `low` to `high`: log-spaced for noise and budgets,
  evenly spaced for the shares of sparsification and Soteria."""
  if count == 1:
    return [high]
  if defense in ("sparsification", "soteria"):
    return [float(v) for v in np.round(np.linspace(low, high, count), 4)]
  return [float(f"{v:.3g}") for v in np.geomspace(low, high, count)]


def defense_kwargs(defense: str, level: float, args, attribute: str,
                   dataset: str) -> dict:
  if defense == "recupfl":
    return {"protect": attribute, "perturbation_budget": level,
            "zoo_epochs": args.zoo_epochs, "zoo_refresh": args.zoo_refresh,
            "shadow_samples": args.shadow_samples}
  if defense in ("ldp_gaussian", "ldp_laplace"):
    return {"clip": CLIP, "noise_multiplier": level / CLIP}
  layer = DATASETS[dataset].get("soteria_layer")
  return {"p": level, **({"layer": layer} if defense == "soteria" and layer else {})}


class Experiment:
  """Runs on one data set, each in its own folder under `runs`."""

  def __init__(self, args, dataset: str, runs: str):
    self.args, self.runs, self.dataset = args, runs, dataset
    self.histories = {}  # (curve, level) -> the metrics of its run
    spec = DATASETS[dataset]
    self.common = dict(
        method="fedsgd", dataset=dataset, model=spec["model"],
        model_kwargs=spec["model_kwargs"], partition="one_per_client",
        clients=args.clients, batch_size=1, seed=args.seed,
        method_kwargs={"server_learning_rate": spec["learning_rate"]},
        attribute_adversaries=tuple(args.adversaries),
        attribute_shadow_samples=args.shadow_samples)

  def run(self, name: str, rounds: int, capture: tuple[int, ...],
          attributes: tuple[str, ...], defense=None, kwargs=None,
          clients_per_round=None, adaptive: bool = False) -> list[dict]:
    """The metrics of run `name`, trained unless already complete."""
    config = runner.RunConfig(
        out=os.path.join(self.runs, name), rounds=rounds, capture_rounds=capture,
        infer_attributes=attributes,
        clients_per_round=clients_per_round or self.args.clients_per_round,
        defense=defense, defense_kwargs=kwargs or {}, adaptive_adversaries=adaptive,
        **self.common)
    return trained(config, f"{name}: {defense or 'no defence'} {kwargs or ''}",
                   self.args.quiet)

  def point(self, defense: str, level, rounds=ROUNDS, attributes=None,
            adaptive: bool = False, curve: str = None, **recupfl) -> list[dict]:
    """Rows (one per captured round, attribute and adversary) of one
    defence setting, labelled `curve`; `adaptive`: with the adaptive
    adversaries' rates too."""
    attributes = attributes or (self.args.attribute,)
    kwargs = None if defense == "none" else {
        **defense_kwargs(defense, level, self.args, self.args.attribute,
                         self.dataset), **recupfl}
    named = {k: v for k, v in sorted(recupfl.items())
             if RECUPFL_DEFAULTS.get(k, self.args.attribute) != v}
    name = "_".join([defense] + ([f"{level:g}"] if level is not None else [])
                    + [f"{k}{v}" for k, v in named.items()]
                    + (["adaptive"] if adaptive else []) + [f"r{max(rounds)}"])
    name = name.replace("=", "").replace(",", "+")
    history = self.run(name, max(rounds), tuple(rounds), tuple(attributes),
                       None if defense == "none" else defense, kwargs,
                       adaptive=adaptive)
    self.histories[(curve or LABELS[defense], level)] = history
    rows = []
    for entry in history:
      if entry["round"] not in rounds:
        continue
      for a in attributes:
        for adversary in self.args.adversaries:
          rows.append({
              "curve": curve or LABELS[defense], "defense": defense,
              "level": level, "round": entry["round"], "attribute": a,
              "adversary": adversary, "learning_loss": entry["test_loss"],
              "update_cosine": entry.get("update_cosine"),
              "update_relative_error": entry.get("update_relative_error"),
              **_rates(entry, a, adversary),
              "chance": entry[f"asr/{a}/chance"],
              "balanced_chance": entry[f"balanced_asr/{a}/chance"],
              **{k: v for k, v in recupfl.items()}})
    return rows

  def undefended_losses(self, seed: int, rounds: int) -> list[float]:
    """The test loss after each round of the undefended run at `seed` (no
    capture): one sample of the learning loss's seed-to-seed noise."""
    if seed == self.args.seed:
      history = self.histories[("no defence", None)]
    else:
      config = runner.RunConfig(
          out=os.path.join(self.runs, f"none_seed{seed}_r{rounds}"), rounds=rounds,
          clients_per_round=self.args.clients_per_round,
          **dict(self.common, seed=seed))
      history = trained(config, f"none_seed{seed}: no defence, seed {seed}",
                        self.args.quiet)
    return [e["test_loss"] for e in history]


def trained(config: runner.RunConfig, announce: str, quiet: bool) -> list[dict]:
  """The metrics of the run `config` describes: read back when its folder
  holds all its rounds, else trained (resumed) after printing `announce`.

  Raises:
    SystemExit: in one line, when the folder holds a run made with another
      config (e.g. by an older version of a defence).
  """
  try:
    runner.check_config(config)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  path = os.path.join(config.out, "metrics.json")
  if os.path.exists(path) and len(io.read_json(path)) == config.rounds:
    return io.read_json(path)
  print(announce, flush=True)
  history = runner.run(config, progress=not quiet)
  runtime.renew()  # a worker's memory grows with every run it serves
  return history


def _rates(entry: dict, attribute: str, adversary: str) -> dict:
  """The ASRs of `ASR_KINDS` the entry holds for (attribute, adversary),
  each with its 95% confidence interval ('<kind>_low', '<kind>_high')."""
  out = {}
  for kind in ASR_KINDS:
    key = f"{kind}/{attribute}/{adversary}"
    if key in entry:
      low, high = entry[f"{kind}_ci/{attribute}/{adversary}"]
      out.update({kind: entry[key], f"{kind}_low": low, f"{kind}_high": high})
  return out


def interpolate_at(value: float, rows: list[dict], key: str,
                   axis: str = "learning_loss", log: bool = False) -> float:
  """The curve of `rows` (`axis`, `key`) read at `value`, linear between its
  two nearest measured points (in log10 of the axis with `log`); NaN
  outside their range."""
  points = sorted((r[axis], r[key]) for r in rows)
  xs, ys = [p[0] for p in points], [p[1] for p in points]
  if not xs or not xs[0] <= value <= xs[-1]:
    return math.nan
  if log:
    if xs[0] <= 0:
      return math.nan
    return float(np.interp(math.log10(value), np.log10(xs), ys))
  return float(np.interp(value, xs, ys))


def tradeoff_settings(args) -> list[tuple[str, str, float, dict]]:
  """(curve, defence, level, RECUP-FL settings) of every trade-off point:
  no defence; RECUP-FL protecting the attribute (M = 1) and, where the
  data set has a second one, both (M = 2, gamma 1 each); DP Gaussian, DP
  Laplace and any --tradeoff-extra defences over their ranges."""
  ranges = DATASETS[args.dataset]["ranges"]
  settings = [("no defence", "none", None, {})]
  protections = [(f"RECUP-FL ({args.attribute})", {})]
  if args.second:
    protections.append((f"RECUP-FL ({args.attribute}, {args.second})",
                        {"protect": f"{args.attribute},{args.second}"}))
  for curve, extra in protections:
    budgets = levels("recupfl", *ranges["recupfl"], args.levels)
    if extra and args.two_attribute_levels:
      budgets = args.two_attribute_levels
    elif not extra and args.recupfl_levels:
      budgets = args.recupfl_levels
    settings += [(curve, "recupfl", level, extra) for level in budgets]
  for defense in ("ldp_gaussian", "ldp_laplace") + tuple(args.tradeoff_extra):
    chosen = levels(defense, *ranges[defense], args.levels)
    if defense in ("ldp_gaussian", "ldp_laplace") and args.dp_levels:
      chosen = args.dp_levels
    settings += [(LABELS[defense], defense, level, {}) for level in chosen]
  return settings


def tradeoff(exp: Experiment) -> tuple[list[dict], str]:
  """The trade-off points, their figures and the equal-utility tables."""
  args = exp.args
  attributes = (args.attribute,) + ((args.second,) if args.second else ())
  rows = []
  for curve, defense, level, extra in tradeoff_settings(args):
    rows += exp.point(defense, level, attributes=attributes,
                      adaptive=defense != "none",
                      curve=curve, **extra)
  losses = np.array([exp.undefended_losses(args.seed + k, max(ROUNDS))
                     for k in range(args.noise_seeds + 1)])
  noise = {"learning_loss": {r: float(np.std(losses[:, r - 1], ddof=1))
                             for r in ROUNDS},
           "update_relative_error": {r: 0.0 for r in ROUNDS}}
  for a in attributes:
    for kind in ("asr", "balanced_asr"):
      _plot_tradeoff(rows, args, a, kind)
  _plot_loss_curves(exp.histories, args)
  text = "\n".join(equal_utility_table(rows, args, a, kind, noise)
                   for a in attributes for kind in ("asr", "balanced_asr"))
  return rows, _noise_note(losses) + "\n" + text


def _noise_note(losses: np.ndarray) -> str:
  lines = ["### Seed-to-seed noise of the learning loss (no defence)", "",
           "| round | " + " | ".join(f"seed +{k}" for k in range(len(losses)))
           + " | std |", "|---|" + "---|" * (len(losses) + 1)]
  for r in ROUNDS:
    column = losses[:, r - 1]
    lines.append(f"| {r} | " + " | ".join(f"{v:.6f}" for v in column)
                 + f" | {np.std(column, ddof=1):.2e} |")
  return "\n".join(lines) + "\n"


def _fmt(value: float) -> str:
  return "-" if math.isnan(value) else f"{value:.3f}"


def _interval(value: float, low: float, high: float) -> str:
  if math.isnan(value):
    return "-"
  return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def verdict(ours: tuple[float, float], theirs: tuple[float, float]) -> str:
  """'lower' or 'higher' where RECUP-FL's 95% interval `ours` lies wholly
  below or above `theirs`, else 'overlap' (or '-' for no reading)."""
  if any(math.isnan(v) for v in theirs):
    return "-"
  if ours[1] < theirs[0]:
    return "lower"
  if ours[0] > theirs[1]:
    return "higher"
  return "overlap"


def noise_robust_verdict(row: dict, kind: str, curve: list[dict], key: str,
                         axis: str, log: bool, sigma: float) -> str:
  """`verdict` of `row`'s `kind` interval against the baseline `curve`'s
  `key` interval read at `row`'s utility, and at that utility -+ 2 `sigma`
  (where the curve reaches): 'within noise' when they disagree, since the
  axis cannot say which of those utilities is the equal one."""
  ours = (row[f"{kind}_low"], row[f"{kind}_high"])
  said = set()
  for value in sorted({row[axis] - 2 * sigma, row[axis], row[axis] + 2 * sigma}):
    bounds = tuple(interpolate_at(value, curve, k, axis, log)
                   for k in (f"{key}_low", f"{key}_high"))
    if value == row[axis] or not math.isnan(bounds[0]):
      said.add(verdict(ours, bounds))
  centre = verdict(ours, tuple(interpolate_at(row[axis], curve, k, axis, log)
                               for k in (f"{key}_low", f"{key}_high")))
  return centre if centre == "-" or len(said - {"-"}) == 1 else "within noise"


def equal_utility_table(rows: list[dict], args, attribute: str, kind: str,
                        noise: dict) -> str:
  """Each RECUP-FL point's `kind` ASR of `attribute` (its clean-shadow and
  adaptive adversaries) beside DP Gaussian's and DP Laplace's (theirs)
  read at the same utility, on each axis of `UTILITY_AXES`, at rounds 1,
  3, 5; verdicts compare clean-shadow with clean-shadow and adaptive with
  adaptive adversaries.

  A baseline's ASR and its interval bounds are interpolated between the two
  measured points that bracket RECUP-FL's utility (in log10 of the update
  error); a verdict that changes within -+ twice the axis's noise of that
  utility reads 'within noise' (`noise_robust_verdict`). Where the spread of an axis over a round's defended points is
  below twice its noise (`noise[axis][round]`, the learning loss's
  seed-to-seed standard deviation without defence; 0 for the update error,
  which is paired: the same clients at the same model), the axis cannot
  order the defences and the table says so instead of reading it.
  """
  title = "plain ASR" if kind == "asr" else "balanced ASR"
  lines = [f"### RECUP-FL vs DP at equal utility: {title} of {attribute}", ""]
  columns = [f"{c}{suffix}" for c in DP_CURVES for suffix in ("", " (adaptive)")]
  counts = {}
  for axis, label, log in UTILITY_AXES:
    lines += [f"#### at equal {label}", "",
              "| round | adversary | RECUP-FL | level | " + label + " | "
              + " | ".join(["RECUP-FL ASR", "RECUP-FL ASR (adaptive)"] + columns)
              + " |", "|---" * (7 + len(columns)) + "|"]
    for round_num in ROUNDS:
      pick = [r for r in rows if r["round"] == round_num and r["attribute"] == attribute
              and r["defense"] != "none" and r.get(axis) is not None]
      values = [r[axis] for r in pick]
      if not values:
        lines.append(f"| {round_num} | all | - | - | not measured | |")
        continue
      spread = max(values) - min(values)
      if spread <= 2 * noise[axis][round_num]:
        lines.append(f"| {round_num} | all | - | - | spread {spread:.2e} is below "
                     f"twice its noise {noise[axis][round_num]:.2e}: it does not "
                     "separate the defences | |")
        continue
      for adversary in args.adversaries:
        mine = [r for r in pick if r["adversary"] == adversary]
        ours = sorted((r for r in mine if r["defense"] == "recupfl"),
                      key=lambda r: (r["curve"], r["level"]))
        for r in ours:
          cells = []
          for curve in DP_CURVES:
            curve_rows = [c for c in mine if c["curve"] == curve]
            for prefix in ("", "adaptive_"):
              key = prefix + kind
              if not curve_rows or key not in curve_rows[0]:
                cells.append("-")
                continue
              read = [interpolate_at(r[axis], curve_rows, k, axis, log)
                      for k in (key, f"{key}_low", f"{key}_high")]
              said = "-" if key not in r else noise_robust_verdict(
                  r, key, curve_rows, key, axis, log, noise[axis][round_num])
              counts[(axis, curve + (" (adaptive)" if prefix else ""), said)] = (
                  counts.get((axis, curve + (" (adaptive)" if prefix else ""), said),
                             0) + 1)
              cells.append(_interval(*read) + ("" if said == "-"
                                               else f" (RECUP-FL {said})"))
          own = [_interval(r[k], r[k + "_low"], r[k + "_high"]) if k in r else "-"
                 for k in (kind, "adaptive_" + kind)]
          lines.append(f"| {round_num} | {adversary} | {r['curve']} | {r['level']:g} | "
                       f"{r[axis]:.6g} | " + " | ".join(own + cells) + " |")
    lines.append("")
  lines += ["Verdicts (RECUP-FL's 95% interval below / overlapping / above the "
            "baseline's, interpolated; against a baseline's adaptive adversaries, "
            "RECUP-FL's adaptive ones): "
            + "; ".join(f"{axis} vs {curve}: " + ", ".join(
                f"{said} {counts.get((axis, curve, said), 0)}"
                for said in ("lower", "overlap", "higher", "within noise"))
                for axis, _, _ in UTILITY_AXES
                for curve in [c + s for c in DP_CURVES for s in ("", " (adaptive)")]),
            "", "'-': the baseline's measured points do not reach that utility."]
  return "\n".join(lines) + "\n"


def _plot_tradeoff(rows: list[dict], args, attribute: str, kind: str) -> None:
  """tradeoff_<attribute>_<kind>.png: ASR with its 95% intervals against
  each utility axis (columns: axis x adversary; rows: rounds 1, 3, 5);
  dashed: each defence's adaptive adversaries."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  from matplotlib.ticker import MaxNLocator
  curves = list(dict.fromkeys(r["curve"] for r in rows))
  colours = {c: f"C{i}" for i, c in enumerate(curves)}
  columns = [(axis, label, log, adversary) for axis, label, log in UTILITY_AXES
             for adversary in args.adversaries]
  fig, axes = plt.subplots(len(ROUNDS), len(columns), squeeze=False,
                           figsize=(3.3 * len(columns), 2.9 * len(ROUNDS)))
  for i, round_num in enumerate(ROUNDS):
    for j, (axis, label, log, adversary) in enumerate(columns):
      ax = axes[i][j]
      pick = [r for r in rows if r["round"] == round_num and r["attribute"] == attribute
              and r["adversary"] == adversary and r.get(axis) is not None]
      for r in pick:
        if r["defense"] == "none":  # its update error is rounding alone
          ax.axhline(r[kind], color=colours[r["curve"]], linewidth=1,
                     label=r["curve"])
      for curve in curves:
        if curve == "no defence":
          continue
        for prefix, style in (("", "o-"), ("adaptive_", "s--")):
          key = prefix + kind
          points = sorted((r[axis], r[key], r[key + "_low"], r[key + "_high"])
                          for r in pick if r["curve"] == curve and key in r
                          and (not log or r[axis] > 0))
          if not points:
            continue
          x, y, low, high = (np.array(v) for v in zip(*points))
          ax.errorbar(x, y, yerr=[np.maximum(y - low, 0), np.maximum(high - y, 0)],
                      fmt=style, markersize=3,
                      capsize=2, linewidth=1, color=colours[curve],
                      label=curve + (" (adaptive)" if prefix else ""))
      if pick:
        ax.axhline(pick[0]["chance" if kind == "asr" else "balanced_chance"],
                   color="grey", linestyle=":", linewidth=1)
      if log:
        ax.set_xscale("log")
      else:
        ax.xaxis.set_major_locator(MaxNLocator(3))
      ax.set_title(f"round {round_num}, {adversary}", fontsize=9)
      ax.set_xlabel(label, fontsize=8)
      ax.set_ylabel(kind.replace("_", " "), fontsize=8)
      ax.tick_params(labelsize=7)
  handles, names = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, names, loc="lower center", ncol=min(len(names), 6), fontsize=8)
  fig.suptitle(f"{args.dataset}: {kind.replace('_', ' ')} of {attribute} against "
               "utility (bars: 95% intervals; dotted: chance)")
  fig.tight_layout(rect=(0, 0.05, 1, 0.97))
  _save_figure(fig, os.path.join(args.out, f"tradeoff_{attribute}_{kind}.png"))


def _plot_loss_curves(histories: dict, args) -> None:
  """loss_curves.png: the learning loss over the rounds of every trade-off
  run (the paper's loss curves), one panel per defence, no defence in each."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  curves = [c for c in dict.fromkeys(c for c, _ in histories) if c != "no defence"]
  fig, axes = plt.subplots(1, len(curves), squeeze=False,
                           figsize=(3.6 * len(curves), 3.2), sharey=True)
  for ax, curve in zip(axes[0], curves):
    for (name, level), history in histories.items():
      if name in (curve, "no defence"):
        ax.plot([e["round"] for e in history], [e["test_loss"] for e in history],
                "k--" if level is None else "o-", markersize=3, linewidth=1,
                label="no defence" if level is None else f"{level:g}")
    ax.set_title(curve, fontsize=9)
    ax.set_xlabel("round", fontsize=8)
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.legend(fontsize=6)
  axes[0][0].set_ylabel("learning loss", fontsize=8)
  fig.tight_layout()
  _save_figure(fig, os.path.join(args.out, "loss_curves.png"))


def adaptive(exp: Experiment) -> list[dict]:
  """Round 1 of every defence over its trade-off levels, attacked by the
  paper's adversaries (clean shadow uploads) and by adaptive ones (shadow
  uploads through the same defence)."""
  rows = []
  for defense, (low, high) in DATASETS[exp.args.dataset]["ranges"].items():
    for level in levels(defense, low, high, exp.args.levels):
      rows += exp.point(defense, level, rounds=(1,), adaptive=True)
  return rows


IMAGE_DATASET = "mnist5k_parity"


def reconstruction(exp: Experiment) -> tuple[list[dict], str]:
  """Inverting Gradients on round-1 image uploads under each defence (Fig. 6).

  One captured FedSGD round on the bundled digits per defence setting (the
  trade-off's levels); IG attacks the first --ig-victims uploads. The MSE is
  between each victim's image and its reconstruction (higher: less leakage).
  """
  args = exp.args
  images = Experiment(args, IMAGE_DATASET, os.path.join(args.out, "reconstruction"))
  attribute = DATASETS[IMAGE_DATASET]["attribute"]
  settings = [("none", None)] + [
      (defense, level) for defense, (low, high)
      in DATASETS[IMAGE_DATASET]["ranges"].items()
      for level in levels(defense, low, high, args.levels)]
  if ("recupfl", args.epsilon) not in settings:
    settings.append(("recupfl", args.epsilon))
  rows = [_attacked_point(images, defense, level, attribute)
          for defense, level in settings]
  _reconstruction_grid(rows, args)
  return rows, _equal_utility_reconstruction(rows, args)


def _attacked_point(exp: Experiment, defense: str, level, attribute: str) -> dict:
  """Learning loss, aggregate-update error and IG scores of one defence
  setting, cached in row.json."""
  args = exp.args
  name = "_".join([defense] + ([f"{level:g}"] if level is not None else []))
  folder = os.path.join(args.out, "reconstruction", name)
  path = os.path.join(folder, "row.json")
  attack = {"ig_iterations": args.ig_iterations, "ig_victims": args.ig_victims,
            "seed": args.seed}
  if os.path.exists(path) and io.read_json(path).get("attack") == attack:
    row = io.read_json(path)
    if "update_relative_error" not in row:  # cached before it was read
      entry = io.read_json(os.path.join(folder, "metrics.json"))[0]
      row["update_relative_error"] = entry.get("update_relative_error")
      io.write_json(path, row)
    return row
  kwargs = (None if defense == "none"
            else defense_kwargs(defense, level, args, attribute, IMAGE_DATASET))
  history = exp.run(name, 1, (1,), (), None if defense == "none" else defense,
                    kwargs)
  updates = os.path.join(folder, "updates")
  victims = UpdateStore(updates).clients(1)[:args.ig_victims]
  result = evaluate.attack_round(updates, 1, os.path.join(folder, "ig"), "ig",
                                 clients=victims,
                                 attack_kwargs={"iterations": args.ig_iterations},
                                 seed=args.seed)
  row = {"defense": defense, "level": level,
         "learning_loss": history[0]["test_loss"],
         "update_relative_error": history[0].get("update_relative_error"),
         **{k: result["mean"][k] for k in ("mse", "ssim", "psnr")},
         "victims": len(victims), "victim_clients": victims,
         "ig_seconds": result["seconds"], "attack": attack}
  io.write_json(path, row)
  return row


def _nearest(rows: list[dict], value: float, axis: str, log: bool) -> dict:
  """The row whose `axis` is nearest `value` (in log10 with `log`)."""
  scale = (lambda v: math.log10(max(v, 1e-30))) if log else (lambda v: v)
  return min(rows, key=lambda r: abs(scale(r[axis]) - scale(value)))


def _equal_utility_reconstruction(rows: list[dict], args) -> str:
  """Each baseline's IG MSE and SSIM read at RECUP-FL's (--epsilon)
  utility, on each axis of `UTILITY_AXES`, and its nearest measured level.
  The learning loss after one round spreads little over the settings
  (its spread is printed); the update error is paired and separates
  them."""
  ours = next(r for r in rows if r["defense"] == "recupfl"
              and r["level"] == args.epsilon)
  losses = [r["learning_loss"] for r in rows]
  lines = [f"### IG at RECUP-FL's utility ({IMAGE_DATASET}, round 1, RECUP-FL "
           f"epsilon {args.epsilon:g}: MSE {ours['mse']:.4f}, SSIM "
           f"{ours['ssim']:.3f})", "",
           f"The learning loss after one round spans {min(losses):.6f} to "
           f"{max(losses):.6f} over all settings (spread "
           f"{max(losses) - min(losses):.2e}).", ""]
  for axis, label, log in UTILITY_AXES:
    lines += [f"#### at equal {label} (RECUP-FL: {_value(ours.get(axis))})", "",
              f"| defence | IG MSE | IG SSIM | nearest level | its {label} | its MSE "
              "| its SSIM |", "|---" * 7 + "|"]
    for defense in DATASETS[IMAGE_DATASET]["ranges"]:
      curve = [r for r in rows if r["defense"] == defense and r.get(axis) is not None]
      if defense == "recupfl" or not curve or ours.get(axis) is None:
        continue
      near = _nearest(curve, ours[axis], axis, log)
      lines.append(
          f"| {LABELS[defense]} | "
          f"{_fmt(interpolate_at(ours[axis], curve, 'mse', axis, log))} | "
          f"{_fmt(interpolate_at(ours[axis], curve, 'ssim', axis, log))} | "
          f"{near['level']:g} | {_value(near[axis])} | {near['mse']:.4f} | "
          f"{near['ssim']:.3f} |")
    lines.append("")
  lines += ["'-': the defence's measured points do not reach RECUP-FL's utility "
            "(higher MSE, lower SSIM: less leakage)."]
  return "\n".join(lines) + "\n"


def _value(value) -> str:
  return "not measured" if value is None else f"{value:.6g}"


def _reconstruction_grid(rows: list[dict], args) -> None:
  """Originals, then the reconstructions under no defence, RECUP-FL at
  --epsilon and each baseline at the level whose aggregate-update error is
  nearest RECUP-FL's (its learning loss where the error was not measured)."""
  ours = next(r for r in rows if r["defense"] == "recupfl"
              and r["level"] == args.epsilon)
  shown = [("no defence", next(r for r in rows if r["defense"] == "none")),
           (f"RECUP-FL {args.epsilon:g}", ours)]
  for defense in DATASETS[IMAGE_DATASET]["ranges"]:
    if defense != "recupfl":
      curve = [r for r in rows if r["defense"] == defense]
      measured = ours.get("update_relative_error") is not None and all(
          r.get("update_relative_error") is not None for r in curve)
      near = (_nearest(curve, ours["update_relative_error"], "update_relative_error",
                       log=True) if measured
              else _nearest(curve, ours["learning_loss"], "learning_loss", log=False))
      shown.append((f"{LABELS[defense]} {near['level']:g}", near))
  victims = {str(row["victim_clients"]) for _, row in shown}
  if len(victims) != 1:
    raise ValueError("reconstruction.png shows one column per victim: the "
                     f"settings attacked different clients ({sorted(victims)})")
  images = {}
  for label, row in shown:
    name = "_".join([row["defense"]] + ([f"{row['level']:g}"]
                                        if row["level"] is not None else []))
    with np.load(os.path.join(args.out, "reconstruction", name, "ig",
                              "reconstructions.npz")) as f:
      images.setdefault("original", list(f["original"]))
      images[label] = list(f["reconstructed"])
  manifest = io.read_json(os.path.join(args.out, "reconstruction", "none", "updates",
                                       "manifest.json"))
  report.save_grid(images, os.path.join(args.out, "reconstruction.png"),
                   manifest["run"]["value_range"],
                   title="IG, round 1")


def round_one(exp: Experiment, variants: list[tuple[str, dict]],
              attributes=None) -> list[dict]:
  rows = []
  for label, recupfl in variants:
    for r in exp.point("recupfl", exp.args.epsilon, rounds=(1,),
                       attributes=attributes, **recupfl):
      rows.append({"setting": label, **r})
  return rows


def participation(exp: Experiment) -> list[dict]:
  rows = []
  for ratio in (0.2, 0.4, 0.6, 0.8, 1.0):
    per_round = max(1, round(ratio * exp.args.participation_clients))
    name = f"participation_{ratio:g}"
    common = dict(exp.common, clients=exp.args.participation_clients)
    history = trained(runner.RunConfig(
        out=os.path.join(exp.args.out, "runs", name),
        rounds=exp.args.participation_rounds, clients_per_round=per_round,
        defense="recupfl", defense_kwargs=defense_kwargs(
            "recupfl", exp.args.epsilon, exp.args, exp.args.attribute,
            exp.dataset), **common),
        f"{name}: RECUP-FL, {per_round} clients per round", exp.args.quiet)
    rows += [{"ratio": ratio, "round": e["round"], "learning_loss": e["test_loss"]}
             for e in history]
  _plot_participation(rows, exp.args)
  return rows


def _plot_participation(rows, args) -> None:
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  from matplotlib.ticker import MaxNLocator
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for ratio in sorted({r["ratio"] for r in rows}):
    curve = [(r["round"], r["learning_loss"]) for r in rows if r["ratio"] == ratio]
    ax.plot(*zip(*curve), "o-", markersize=3, label=f"{ratio:.0%} of clients")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_xlabel("round")
  ax.set_ylabel("learning loss")
  ax.set_title(f"RECUP-FL (epsilon {args.epsilon:g}) on {args.dataset}")
  ax.legend(fontsize=8)
  fig.tight_layout()
  _save_figure(fig, os.path.join(args.out, "participation.png"))


def _save_figure(fig, path: str) -> None:
  from matplotlib import pyplot as plt
  with io.atomic_path(path) as tmp:
    fig.savefig(tmp, format="png", dpi=110)
  plt.close(fig)


def markdown(title: str, rows: list[dict], columns: list[str]) -> str:
  lines = [f"### {title}", "", "| " + " | ".join(columns) + " |",
           "|" + "---|" * len(columns)]
  for r in rows:
    lines.append("| " + " | ".join(_cell(r.get(c)) for c in columns) + " |")
  return "\n".join(lines) + "\n"


def _cell(value) -> str:
  if isinstance(value, float):
    return f"{value:.6g}"
  return "-" if value is None else str(value)


def save(out: str, stem: str, rows: list[dict], text: str) -> None:
  columns = list(dict.fromkeys(k for r in rows for k in r))
  io.write_csv(os.path.join(out, f"{stem}.csv"), rows, columns)
  text += provenance.footnote(out)
  io.write_text(os.path.join(out, f"{stem}.md"), text)
  print(text, flush=True)


ASR_COLUMNS = ["setting", "attribute", "adversary", "learning_loss", "asr",
               "balanced_asr", "chance", "balanced_chance"]


# the arguments every run under --out was made with
RUN_SETTINGS = ("dataset", "clients", "clients_per_round", "adversaries",
                "shadow_samples", "zoo_epochs", "zoo_refresh", "seed",
                "participation_clients")


def check_settings(args) -> None:
  """Refuses an --out whose runs were made with other run settings (they
  are read back, not retrained); records the settings on first use."""
  path = os.path.join(args.out, "settings.json")
  settings = {k: getattr(args, k) for k in RUN_SETTINGS}
  if os.path.exists(path):
    stored = io.read_json(path)
    changed = [k for k in RUN_SETTINGS if stored.get(k) != settings[k]]
    if changed:
      raise SystemExit(
          f"--out {args.out}: its runs were made with "
          + ", ".join(f"{k}={stored.get(k)!r}" for k in changed)
          + "; give the same settings or another --out")
  else:
    io.write_json(path, settings)


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", default="adult", choices=sorted(DATASETS))
  parser.add_argument("--tables", default=",".join(TABLES),
                      help=f"comma-separated, from {', '.join(TABLES)}")
  parser.add_argument("--levels", type=int,
                      help="settings per defence in the trade-off curves")
  parser.add_argument("--clients", type=int, default=1000)
  parser.add_argument("--clients-per-round", type=int, default=400,
                      help="the victims attacked per captured round")
  parser.add_argument("--adversaries", default=",".join(ADVERSARIES))
  parser.add_argument("--shadow-samples", type=int, default=1000,
                      help="training records the adversaries and RECUP-FL's "
                      "zoo train on")
  parser.add_argument("--scale", choices=sorted(SCALES), default="small",
                      help="defaults of the settings below: 'small' (20 zoo "
                      "epochs, zoo retrained at rounds 1, 3, 5, 4 levels) or "
                      "'paper' (80 epochs, retrained every round, 5 levels, "
                      "sparsification and Soteria in the trade-off, IG 2,000 "
                      "iterations)")
  parser.add_argument("--zoo-epochs", type=int,
                      help="epochs of each defender model (paper: 80)")
  parser.add_argument("--zoo-refresh", type=int,
                      help="rounds between retrainings of RECUP-FL's zoo")
  parser.add_argument("--noise-seeds", type=int, default=2,
                      help="extra undefended runs whose spread is the learning "
                      "loss's noise")
  parser.add_argument("--two-attribute-levels",
                      help="RECUP-FL's budgets protecting both attributes "
                      "(comma-separated; default: the trade-off's levels)")
  parser.add_argument("--recupfl-levels",
                      help="RECUP-FL's budgets protecting the attribute alone "
                      "(comma-separated; default: the trade-off's levels)")
  parser.add_argument("--dp-levels",
                      help="DP Gaussian's and Laplace's noise levels sigma "
                      "(comma-separated; default: the trade-off's levels)")
  parser.add_argument("--tradeoff-extra",
                      help="defences beside DP Gaussian and Laplace in the "
                      "trade-off: sparsification, soteria (comma-separated)")
  parser.add_argument("--epsilon", type=float, default=1e-3,
                      help="RECUP-FL's budget outside the trade-off curves")
  parser.add_argument("--participation-clients", type=int, default=200)
  parser.add_argument("--participation-rounds", type=int, default=10)
  parser.add_argument("--ig-victims", type=int, default=2,
                      help="uploads Inverting Gradients attacks per setting")
  parser.add_argument("--ig-iterations", type=int)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", help="default: results/recupfl_<dataset>")
  parser.add_argument("--quiet", action="store_true")
  args = parser.parse_args()
  for name, value in SCALES[args.scale].items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  args.tradeoff_extra = [d for d in args.tradeoff_extra.split(",") if d]
  for name in ("two_attribute_levels", "recupfl_levels", "dp_levels"):
    flag = "--" + name.replace("_", "-")
    try:
      values = [float(v) for v in (getattr(args, name) or "").split(",") if v]
    except ValueError:
      values = [math.nan]
    if any(not v > 0 for v in values):
      parser.error(f"{flag} takes comma-separated levels > 0")
    setattr(args, name, values)
  if set(args.tradeoff_extra) - {"sparsification", "soteria"}:
    parser.error("--tradeoff-extra takes sparsification, soteria")
  tables = [t for t in args.tables.split(",") if t]
  unknown = sorted(set(tables) - set(TABLES))
  if unknown:
    parser.error(f"--tables {unknown} unknown; choose from {', '.join(TABLES)}")
  args.adversaries = [a for a in args.adversaries.split(",") if a]
  if not args.adversaries or set(args.adversaries) - set(ADVERSARIES):
    parser.error(f"--adversaries takes names from {', '.join(ADVERSARIES)}")
  for name in ("levels", "clients", "clients_per_round", "shadow_samples",
               "zoo_epochs", "zoo_refresh", "participation_clients",
               "participation_rounds", "ig_victims", "ig_iterations"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1")
  if not args.epsilon > 0:
    parser.error("--epsilon must be > 0")
  if args.noise_seeds < 1:
    parser.error("--noise-seeds must be >= 1 (the noise is a standard deviation)")
  spec = DATASETS[args.dataset]
  args.attribute, second = spec["attribute"], spec["second"]
  args.second = second
  args.out = args.out or os.path.join("results", f"recupfl_{args.dataset}")
  check_settings(args)
  import tensorflow as tf
  tf.get_logger().setLevel("ERROR")  # IG's per-record graphs warn of retracing
  runtime.start()
  exp = Experiment(args, args.dataset, os.path.join(args.out, "runs"))
  if "tradeoff" in tables:
    rows, equal = tradeoff(exp)
    text = markdown("Utility and ASR per defence setting, rounds 1, 3, 5 (95% "
                    "intervals in tradeoff.csv)", rows,
                    ["curve", "level", "round", "attribute", "adversary",
                     "learning_loss", "update_relative_error", "update_cosine",
                     "asr", "balanced_asr", "adaptive_asr",
                     "adaptive_balanced_asr", "chance", "balanced_chance"])
    save(args.out, "tradeoff", rows, equal + "\n" + text)
  both = (args.attribute, second) if second else (args.attribute,)
  if "gamma" in tables and second:
    settings = [(f"gamma_{args.attribute}={g:g}",
                 {"protect": f"{args.attribute}={g:g},{second}={1 - g:g}"})
                for g in (0.0, 0.25, 0.5, 0.75, 1.0)]
    rows = round_one(exp, settings, both)
    save(args.out, "gamma", rows, markdown(
        f"Two attributes with gamma_{second} = 1 - gamma_{args.attribute}, "
        f"epsilon {args.epsilon:g}, round 1", rows, ASR_COLUMNS))
  if "attributes" in tables and second:
    rows = round_one(exp, [("M=1", {}), ("M=2", {"protect": f"{args.attribute},{second}"})],
                     both)
    save(args.out, "attributes", rows, markdown(
        f"Protected attributes M, epsilon {args.epsilon:g}, round 1", rows,
        ASR_COLUMNS))
  if "zoo" in tables:
    rows = round_one(exp, [(f"zoo_size={n}", {"zoo_size": n}) for n in (5, 10, 15, 20)])
    save(args.out, "zoo", rows, markdown(
        f"Zoo size, epsilon {args.epsilon:g}, round 1", rows, ASR_COLUMNS))
  if "fgsm" in tables:
    from tff_privacy.defenses.recupfl import VARIANTS
    rows = round_one(exp, [(f"fgsm={v}", {"fgsm": v}) for v in VARIANTS])
    save(args.out, "fgsm", rows, markdown(
        f"FGSM variants, epsilon {args.epsilon:g}, round 1", rows, ASR_COLUMNS))
  if "participation" in tables:
    rows = participation(exp)
    last = [r for r in rows if r["round"] == args.participation_rounds]
    save(args.out, "participation", rows, markdown(
        f"Learning loss after {args.participation_rounds} rounds by participation",
        last, ["ratio", "round", "learning_loss"]))
  if "adaptive" in tables:
    rows = adaptive(exp)
    save(args.out, "adaptive", rows, markdown(
        f"Clean-shadow vs adaptive adversaries ({args.attribute}), round 1", rows,
        ["defense", "level", "adversary", "learning_loss", "asr", "adaptive_asr",
         "balanced_asr", "adaptive_balanced_asr", "chance", "balanced_chance"]))
  if "reconstruction" in tables:
    rows, text = reconstruction(exp)
    save(args.out, "reconstruction", rows, markdown(
        f"IG on round-1 uploads of {IMAGE_DATASET}", rows,
        ["defense", "level", "learning_loss", "mse", "ssim", "psnr", "victims"])
        + "\n" + text)
  runtime.stop()


if __name__ == "__main__":
  main()
