"""`tff-privacy`: command-line entry point.

```sh
tff-privacy train --method fedsgd --dataset mnist5k --model lenet \\
    --clients 10 --rounds 20 --batch-size 32 --seed 0 --capture-rounds 1 \\
    --out results/run
```

The flags of methods, defences and attacks are derived from their declared
parameters (`tff_privacy.params`): a flag belongs to the components that
declare it and is refused for the others. A user error ends in one line on
stderr that names the parameter or file, and exit code 2 (with
TFF_PRIVACY_DEBUG set, the traceback instead).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

EXIT_USAGE = 2
# set (to anything) to get the traceback of an error instead of one line
DEBUG_VARIABLE = "TFF_PRIVACY_DEBUG"


def parse_rounds(text: str) -> tuple[int, ...]:
  """'1,5,10-12' -> (1, 5, 10, 11, 12); '' -> ()."""
  rounds = []
  for part in filter(None, (p.strip() for p in text.split(","))):
    try:
      if "-" in part:
        lo, hi = (int(v) for v in part.split("-", 1))
        rounds.extend(range(lo, hi + 1))
      else:
        rounds.append(int(part))
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"--capture-rounds takes rounds like '1,5,10-12', got {text!r}") from None
  return tuple(rounds)


def parse_names(text: str) -> tuple[str, ...]:
  """'race,sex' -> ('race', 'sex')."""
  return tuple(filter(None, (p.strip() for p in text.split(","))))


def json_object(text: str) -> dict:
  """A JSON object given on the command line."""
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise argparse.ArgumentTypeError(
        f"takes a JSON object like '{{\"name\": 1}}', got {text!r} ({e})") from None
  if not isinstance(value, dict):
    raise argparse.ArgumentTypeError(
        f"takes a JSON object like '{{\"name\": 1}}', got {text!r}")
  return value


def _boolean(text: str) -> bool:
  if text.lower() in ("true", "1", "yes"):
    return True
  if text.lower() in ("false", "0", "no"):
    return False
  raise argparse.ArgumentTypeError(f"takes true or false, got {text!r}")


class ComponentFlags:
  """The flags of a family of components (methods, defences, attacks),
  derived from their declared parameters; a flag shared by several
  components (e.g. --clip) is added once."""

  def __init__(self, kind: str, components: dict[str, Any]):
    self.kind = kind  # 'method', 'defense', 'attack'
    self.table: dict[str, dict[str, Any]] = {}  # flag -> {component: Param}
    for name, declared in sorted(components.items()):
      for param in declared:
        if param.cli:
          self.table.setdefault(param.flag, {})[name] = param

  def add_to(self, parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(f"{self.kind} parameters")
    for flag, owners in sorted(self.table.items()):
      kinds = {p.kind for p in owners.values()}
      if len(kinds) != 1:
        raise TypeError(f"--{flag} is declared with different types {kinds}")
      param = next(iter(owners.values()))
      defaults = {p.default_text() for p in owners.values()}
      if len(defaults) > 1:
        default = "defaults " + ", ".join(f"{n}: {p.default_text()}"
                                          for n, p in owners.items())
      else:
        default = defaults.pop()
        default = default if default in ("required", "optional") else (
            "default " + default)
      text = f"({', '.join(owners)}) {param.help}; {param.accepted()}; {default}"
      extra: dict[str, Any] = {"type": param.kind}
      if param.kind is bool:  # the flag alone means true
        extra.update(type=_boolean, nargs="?", const=True)
      if param.choices:
        extra["choices"] = param.choices
      group.add_argument("--" + flag, dest=_dest(flag), help=text,
                         metavar=flag.upper().replace("-", "_"), **extra)

  def given(self, args: argparse.Namespace, component: Optional[str]) -> dict[str, Any]:
    """The keyword arguments of `component` set by flags; flags that do not
    apply to it are refused."""
    out = {}
    for flag, owners in sorted(self.table.items()):
      value = getattr(args, _dest(flag))
      if value is None:
        continue
      if component is None:
        raise ValueError(f"--{flag} needs --{self.kind} (or '{self.kind}' in "
                         "--config)")
      if component not in owners:
        raise ValueError(f"--{flag} does not apply to --{self.kind} {component}; "
                         f"it applies to {', '.join(owners)}")
      out[owners[component].name] = value
    return out


def _dest(flag: str) -> str:
  return "p_" + flag.replace("-", "_")


def _method_flags() -> ComponentFlags:
  from tff_privacy import algorithms
  return ComponentFlags("method", {n: m.parameters
                                   for n, m in algorithms.METHODS.items()})


def _defense_flags() -> ComponentFlags:
  from tff_privacy import defenses
  return ComponentFlags("defense", {n: c.PARAMETERS
                                    for n, c in defenses.DEFENSES.items()})


def _attack_flags() -> ComponentFlags:
  from tff_privacy import attacks
  return ComponentFlags("attack", {n: c.PARAMETERS
                                   for n, c in attacks.ATTACKS.items()})


def _train_parser(sub) -> None:
  from tff_privacy import runner  # deferred: imports TF
  p = sub.add_parser("train", help="train a federated method, capturing uploads",
                     description=_protocols_text())
  p.add_argument("--config", help="JSON file of RunConfig fields; flags override "
                 "single fields and merge into model_kwargs, data_kwargs, "
                 "method_kwargs and defense_kwargs")
  p.add_argument("--out", help="output folder (required here or in --config)")
  for param in runner.RUN_PARAMETERS:
    extra: dict[str, Any] = {"type": param.kind}
    if param.kind is bool:  # the flag alone means true
      extra.update(type=_boolean, nargs="?", const=True)
    if param.choices:
      extra["choices"] = param.choices
    p.add_argument("--" + param.flag, dest=param.name, help=param.describe(),
                   metavar=param.flag.upper().replace("-", "_"), **extra)
  p.add_argument("--model-kwargs", type=json_object,
                 help='model builder arguments as JSON, e.g. \'{"weight_init": "default"}\'')
  p.add_argument("--data-kwargs", type=json_object,
                 help="the data set's options as JSON, e.g. "
                 "'{\"max_per_speaker\": 50}'; " + _data_options_text())
  p.add_argument("--method-kwargs", type=json_object,
                 help="the method's parameters as JSON, e.g. "
                 "'{\"perturb_steps\": 10}' (the flags below override)")
  p.add_argument("--capture-rounds", type=parse_rounds,
                 help="rounds whose uploads are written to OUT/updates, e.g. 1,5")
  p.add_argument("--infer-attributes", type=parse_names,
                 help="sensitive attributes inferred from each captured round's "
                 "uploads, e.g. race,sex (adult); attack success rates go "
                 "into metrics.json")
  p.add_argument("--attribute-adversaries", type=parse_names,
                 help="attribute-inference adversaries, default all of "
                 "stru_nn,unknown_nn,svm,rf")
  p.add_argument("--quiet", action="store_true", help="no progress bar")
  workers = p.add_argument_group("workers (the results do not depend on them)")
  workers.add_argument("--workers", type=_positive_int, default=1,
                       help="TFF workers started on this machine; each round's "
                       "clients are split between them (default 1)")
  workers.add_argument("--worker-addresses", type=parse_names,
                       help="host:port or unix:PATH,... of TFF workers already "
                       "running ('tff-privacy worker --socket PATH' or "
                       "'--port P'), instead of --workers")
  workers.add_argument("--allow-remote-workers", action="store_true",
                       help="accept worker addresses off this machine: a worker "
                       "serves plaintext, unauthenticated gRPC, so anyone who "
                       "reaches its port can run code on it and read the data "
                       "sent to it, and this run trusts what the workers "
                       "return: a peer in the path can forge the model, the "
                       "metrics and the captured uploads; use SSH tunnels to "
                       "workers serving on loopback ('tff-privacy worker')")
  _method_flags().add_to(p)
  _defense_flags().add_to(p)


def _protocols_text() -> str:
  """The train command's description: each data set's declared protocol."""
  from tff_privacy.runner import DATASET_PROTOCOLS
  return ("A data set with a declared protocol gives a run the values of it "
          "that neither the flags nor --config set: " + "; ".join(
              f"{name}: {protocol.describe()}"
              for name, protocol in sorted(DATASET_PROTOCOLS.items())) + ".")


def _data_options_text() -> str:
  from tff_privacy.data import sources
  options = sources.DATA_PARAMETERS
  shared = ("test_fraction", "normalize")
  fixed = sorted(name for name, params in options.items()
                 if "test_fraction" not in params)
  own = [f"{name}: {', '.join(n for n in params.names if n not in shared)}"
         for name, params in sorted(options.items())
         if set(params.names) - set(shared)]
  return (f"test_fraction (all but {', '.join(fixed)}, which keep their "
          f"published splits); normalize (all but "
          f"{', '.join(sources.TABULAR_DATASETS)}: "
          f"{sources.normalization.ACCEPTED}, e.g. '{{\"normalize\": "
          f"\"mnist\"}}'); {'; '.join(own)}")


def _read_config(path: str) -> dict[str, Any]:
  try:
    with open(path) as f:
      fields = json.load(f)
  except OSError as e:
    raise ValueError(f"--config {path}: cannot be read ({e.strerror})") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"--config {path}: not valid JSON ({e})") from None
  if not isinstance(fields, dict):
    raise ValueError(f"--config {path}: must hold a JSON object of RunConfig fields")
  return fields


# the components of a run, with the field of their parameters
_COMPONENTS = {"model": "model_kwargs", "dataset": "data_kwargs",
               "method": "method_kwargs", "defense": "defense_kwargs"}


def _components(fields: dict[str, Any]) -> dict[str, Any]:
  """The components that RunConfig `fields` name, defaults filled in (the
  model's is the data set's task's)."""
  from tff_privacy.runner import RUN_PARAMETERS, default_model
  out = {c: fields.get(c, RUN_PARAMETERS[c].default) for c in _COMPONENTS}
  if out["model"] is None:
    out["model"] = default_model(RUN_PARAMETERS["dataset"].check(out["dataset"]))
  return out


def _config_from_args(args):
  """The RunConfig of `tff-privacy train`: the --config file's fields,
  overridden by single flags, dict fields merged key by key, then the data
  set's declared protocol for what neither gives (`runner.with_protocol`)."""
  from tff_privacy import provenance
  from tff_privacy.runner import RUN_PARAMETERS, RunConfig, with_protocol
  fields = _read_config(args.config) if args.config else {}
  fields.pop(provenance.KEY, None)  # a run's config.json: which code trained it
  accepted = set(RunConfig.__dataclass_fields__)
  unknown = sorted(set(fields) - accepted)
  if unknown:
    raise ValueError(f"--config {args.config}: unknown fields {', '.join(unknown)}; "
                     f"accepted: {', '.join(sorted(accepted))}")
  for name in _COMPONENTS.values():
    if not isinstance(fields.get(name, {}), dict):
      raise ValueError(f"--config {args.config}: {name} must be a JSON object")
  flags = {c: getattr(args, c) for c in _COMPONENTS if getattr(args, c) is not None}
  before, after = _components(fields), _components({**fields, **flags})
  for component, kwargs in _COMPONENTS.items():
    # a flag that changes a component (the default model also through the
    # data set) drops the file's parameters of the old one
    if after[component] != before[component]:
      fields.pop(kwargs, None)
  for name in ["out", "capture_rounds", "infer_attributes",
               "attribute_adversaries", *RUN_PARAMETERS.names]:
    if getattr(args, name) is not None:
      fields[name] = getattr(args, name)
  method = RUN_PARAMETERS["method"].check(
      fields.get("method", RUN_PARAMETERS["method"].default))
  defense = RUN_PARAMETERS["defense"].check(fields.get("defense"))
  fields["model_kwargs"] = {**fields.get("model_kwargs", {}),
                            **(args.model_kwargs or {})}
  fields["data_kwargs"] = {**fields.get("data_kwargs", {}),
                           **(args.data_kwargs or {})}
  fields["method_kwargs"] = {**fields.get("method_kwargs", {}),
                             **(args.method_kwargs or {}),
                             **_method_flags().given(args, method)}
  fields["defense_kwargs"] = {**fields.get("defense_kwargs", {}),
                              **_defense_flags().given(args, defense)}
  if "out" not in fields:
    raise ValueError("--out is required (or 'out' in --config)")
  return RunConfig(**with_protocol(fields))


def _train(args) -> int:
  from tff_privacy import runner, runtime
  config = _config_from_args(args)
  if args.worker_addresses and args.workers != 1:
    raise ValueError("--workers and --worker-addresses: give one of them")
  runner.check_workers(config, bool(args.worker_addresses))
  runtime.start(workers=args.workers, addresses=args.worker_addresses or (),
                allow_remote=args.allow_remote_workers)
  history = runner.run(config, progress=not args.quiet)
  last = history[-1] if history else {}
  privacy = privacy_summary(last)
  tested = {k: v for k, v in last.items() if k.startswith("test_")}
  global_model = "".join(f"{k}={v:.4f} " for k, v in tested.items())
  # the per-client metrics reported with a spread over clients (the task's
  # primary one): of the clients' own models and, when evaluated, of their
  # models after local training
  personal = "".join(
      f"{k[:-len('_std')]}={last[k[:-len('_std')] + '_mean']:.4f}+-{last[k]:.4f} "
      for k in last if k.startswith(("personal_", "local_after_training_"))
      and k.endswith("_std"))
  print(" ".join(f"method={config.method} dataset={config.dataset} "
                 f"model={config.model} defense={config.defense} rounds="
                 f"{last.get('round')} {global_model}{personal} {privacy}".split()))
  models_file = runner.MODEL_WEIGHTS if tested else runner.PERSONAL_MODELS
  print(f"results in {config.out}: config.json, metrics.json, {models_file}, "
        "tensorboard/, checkpoints/"
        + (", updates/manifest.json, ground_truth/" if config.capture_rounds else ""))
  return 0


def privacy_summary(last: dict[str, Any]) -> str:
  """The train summary's privacy fields of a run's last metrics: epsilon
  and delta, or for a DP run that reports none 'epsilon=none' and why; the
  DP-SGD batch sampling."""
  fields = []
  if last.get("epsilon") is not None:
    fields.append(f"epsilon={last['epsilon']:.4g} delta={last['delta']:g}")
  elif "epsilon" in last:
    fields.append(f"epsilon=none ({last['epsilon_note']})")
  if "batch_sampling" in last:
    fields.append(f"batch_sampling={last['batch_sampling']}")
  return " ".join(fields)


def _attack_parser(sub) -> None:
  from tff_privacy import attacks  # deferred: imports TF
  p = sub.add_parser("attack", help="invert captured client uploads")
  p.add_argument("--updates", required=True, help="an update store (RUN/updates)")
  p.add_argument("--ground-truth", help="ground-truth store for scoring "
                 "(default: ground_truth/ beside --updates)")
  p.add_argument("--round", type=int, required=True)
  p.add_argument("--client", default="all",
                 help="a captured client index, or 'all' (default)")
  p.add_argument("--attack", choices=attacks.ATTACKS, default="ig")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--device", help="TensorFlow device, e.g. /GPU:0 or /CPU:0")
  p.add_argument("--lpips-weights",
                 help="LPIPS (AlexNet) weights .npz; without it LPIPS is not computed")
  p.add_argument("--quiet", action="store_true",
                 help="no progress bar and no time estimate")
  p.add_argument("--region", type=_region, help="also score inside these "
                 "boxes 'x_min,y_min,x_max,y_max[;...]' (pixels, maxima "
                 "exclusive), or 'run': each client's own region in the FedRE "
                 "run the updates come from")
  p.add_argument("--shard", type=_shard, help="i/N: attack only every N-th "
                 "record from the i-th (0-based), for splitting a campaign "
                 "over N machines; join the results with merge-attacks")
  p.add_argument("--out", required=True)
  _attack_flags().add_to(p)


def _shard(text: str) -> tuple[int, int]:
  index, _, count = text.partition("/")
  try:
    index, count = int(index), int(count)
  except ValueError:
    index = count = -1
  if count < 1 or not 0 <= index < count:
    raise argparse.ArgumentTypeError(
        f"takes i/N with 0 <= i < N, e.g. 0/4, got {text!r}")
  return index, count


def _region(text: str):
  from tff_privacy import psi  # deferred: imports TF
  if text == "run":
    return text
  try:
    return psi.parse_boxes(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
        "takes boxes of four integers 'x_min,y_min,x_max,y_max[;...]' or "
        f"'run', got {text!r}") from None


def _attack(args) -> int:
  from tff_privacy import evaluate
  kwargs = _attack_flags().given(args, args.attack)
  clients = None if args.client == "all" else [_client_index(args.client)]
  result = evaluate.attack_round(args.updates, args.round, args.out, args.attack,
                                 clients, kwargs, args.device, args.seed,
                                 args.ground_truth, args.lpips_weights,
                                 progress=not args.quiet, region=args.region,
                                 shard=args.shard)
  _print_attack(result, args.out)
  return 0


def _print_attack(result: dict, out: str) -> None:
  m = result["mean"]
  print(f"attack={result['attack']} records={len(result['clients'])} "
        f"samples={len(result['samples'])} mse={m['mse']:.4f} "
        f"psnr={m['psnr']:.2f} ssim={m['ssim']:.4f} "
        f"label_accuracy={m['label_accuracy']:.2f} seconds={result['seconds']:.1f}")
  if result["region"] is not None:
    print(f"region_mse={m['region_mse']:.4f} region_psnr={m['region_psnr']:.2f} "
          f"region_ssim={m['region_ssim']:.4f}")
  print(f"lpips: {m['lpips']:.4f}" if "lpips" in m else f"lpips: {result['lpips']}")
  print(f"results in {out}: {', '.join(result['files'])}")


def _merge_parser(sub) -> None:
  p = sub.add_parser("merge-attacks", help="join the shards of an attack "
                     "campaign (attack --shard i/N) into one result")
  p.add_argument("shards", nargs="+", help="the shards' --out folders")
  p.add_argument("--out", required=True)


def _merge(args) -> int:
  from tff_privacy import evaluate
  _print_attack(evaluate.merge_attacks(args.shards, args.out), args.out)
  return 0


def _infer_parser(sub) -> None:
  from tff_privacy.attacks import attribute  # deferred: imports TF
  p = sub.add_parser("infer-attributes", help="infer a sensitive attribute of "
                     "each captured client from its upload")
  p.add_argument("--updates", required=True, help="an update store (RUN/updates)")
  p.add_argument("--ground-truth", help="ground-truth store for scoring "
                 "(default: the run's ground_truth folder)")
  p.add_argument("--round", type=int, required=True)
  p.add_argument("--attribute", required=True, help="e.g. race or sex (adult)")
  p.add_argument("--adversaries", type=parse_names,
                 default=("stru_nn", "unknown_nn", "svm", "rf"),
                 help="comma-separated; default all four")
  p.add_argument("--shadow-samples", type=int, default=1000,
                 help="records the adversaries train on")
  p.add_argument("--shadow-pool", choices=attribute.SHADOW_POOLS,
                 default="train", help="where those records come from: "
                 "'train', a seeded sample of the training split, which RECUP-FL's "
                 "zoo trains on too (the paper's adversary), or "
                 "'disjoint_test', the test split's last, class-balanced "
                 "(default train)")
  p.add_argument("--data-dir", help="the data set's folder, if the run read one "
                 "(default: the run's own)")
  p.add_argument("--adaptive", action="store_true", help="adaptive "
                 "adversaries: their shadow uploads go through the run's "
                 "client defence with its parameters (RECUP-FL: against the "
                 "zoo in the run's folder, so for the rounds it was used in; "
                 "train with --adaptive-adversaries for the others)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", required=True)


def _infer(args) -> int:
  from tff_privacy import evaluate
  result = evaluate.infer_attributes_round(
      args.updates, args.round, args.attribute, args.out, args.adversaries,
      args.shadow_samples, args.shadow_pool, seed=args.seed,
      ground_truth=args.ground_truth,
      data_dir=args.data_dir, adaptive=args.adaptive)
  print(f"attribute={args.attribute} round={args.round} victims={result['victims']} "
        f"adversaries={'adaptive' if args.adaptive else 'clean shadow'} "
        f"chance={result['chance']:.3f} balanced_chance={result['balanced_chance']:.3f}")
  for name in args.adversaries:
    print(f"  {name}: asr={result['asr'][name]:.3f} "
          f"{_interval(result['asr_ci'][name])} "
          f"balanced_asr={result['balanced_asr'][name]:.3f} "
          f"{_interval(result['balanced_asr_ci'][name])}")
  print(f"results in {args.out}")
  return 0


def _interval(bounds: Sequence[float]) -> str:
  """A 95% interval as printed: '[0.412, 0.733]'."""
  return f"[{bounds[0]:.3f}, {bounds[1]:.3f}]"


def _demo_parser(sub) -> None:
  p = sub.add_parser("demo", help="train FedSGD on bundled digits, then invert "
                     "its round-1 uploads and print utility beside leakage")
  p.add_argument("--out", default="results/demo")
  p.add_argument("--rounds", type=int, default=100)
  p.add_argument("--iterations", type=int, default=1000,
                 help="Inverting Gradients iterations per client")
  p.add_argument("--quiet", action="store_true")


def _demo(args) -> int:
  from tff_privacy import evaluate, io, runner, runtime
  config = runner.RunConfig(
      out=os.path.join(args.out, "train"), method="fedsgd", dataset="mnist5k",
      model="cnn", clients=10, rounds=args.rounds, batch_size=4,
      method_kwargs={"server_learning_rate": 0.2}, seed=0, capture_rounds=(1,))
  runtime.start()
  history = runner.run(config, progress=not args.quiet)
  result = evaluate.attack_round(
      os.path.join(config.out, "updates"), 1, os.path.join(args.out, "attack"),
      "ig", attack_kwargs={"iterations": args.iterations},
      progress=not args.quiet)
  m = result["mean"]
  table = ("| method | test accuracy | attack | mean PSNR (dB) | mean SSIM | "
           "label accuracy |\n|---|---|---|---|---|---|\n"
           f"| fedsgd | {history[-1]['test_accuracy']:.4f} | ig, round 1, "
           f"{len(result['clients'])} clients x {config.batch_size} images | "
           f"{m['psnr']:.2f} | {m['ssim']:.4f} | {m['label_accuracy']:.2f} |\n")
  io.write_text(os.path.join(args.out, "summary.md"), table)
  print(table)
  print(f"results in {args.out}: summary.md, train/metrics.json, train/updates/, "
        + ", ".join(f"attack/{f}" for f in result["files"]))
  return 0


def _leaderboard_parser(sub) -> None:
  p = sub.add_parser("leaderboard", help="train every method and defence on the "
                     "same data and protocol, attack every run alike, and write "
                     "OUT/report.md; a rerun resumes")
  p.add_argument("--out", required=True)
  p.add_argument("--scale", choices=("compact", "cnn", "full"), default="compact",
                 help="the built-in grid: compact (minutes on 2 cores; an MLP at "
                 "batch 1, the analytic regime), cnn (the same under a CNN at "
                 "batches of 1 and 8) or full (every strength, all three "
                 "protocols, 3 seeds)")
  p.add_argument("--equal-epsilon", type=_epsilon_target, metavar="EPSILON",
                 help="run each DP entry once more at the strength that spends "
                 "this epsilon (at the grid's delta, 1e-5 unless it sets one), for "
                 "the report's equal-privacy table; 'none' for no such rows "
                 "(default: the target an earlier run set in --out, else the "
                 "grid's; the compact grid has none, so that `make demo` keeps "
                 "to its time: add them with --equal-epsilon 8)")
  p.add_argument("--entries", type=_names,
                 help="comma-separated names of the grid's entries to run (the "
                 "reference entry runs too, since every row is compared with it)")
  p.add_argument("--config", help="a JSON grid instead of the built-in one "
                 "(see tff_privacy.leaderboard.grid)")
  p.add_argument("--jobs", type=_positive_int, default=min(2, os.cpu_count() or 1),
                 help="rows trained at once, each in its own process (default: "
                 "2, or 1 on a one-core machine); the rows' times per round are "
                 "then measured while they share the CPU: --jobs 1 for clean timings")
  p.add_argument("--quiet", action="store_true")


def _leaderboard(args) -> int:
  from tff_privacy import leaderboard, runtime
  grid = (leaderboard.grid.load(args.config) if args.config else
          leaderboard.grid.parse(leaderboard.defaults.grid(args.scale),
                                 f"--scale {args.scale}"))
  if args.equal_epsilon is not None:
    grid = leaderboard.grid.with_equal_epsilon(grid, args.equal_epsilon)
  else:  # a target set before in this folder stays, with its rows
    grid = leaderboard.board.with_recorded_target(grid, args.out)
  if args.entries:
    leaderboard.grid.only(grid, args.entries)  # checks the names before training
  runtime.start()
  start = time.perf_counter()
  ran = leaderboard.board.run(grid, args.out, progress=not args.quiet,
                              jobs=args.jobs, entries=args.entries)
  # every finished row, with the equal-epsilon rows as the run calibrated them
  code = _print_report(*leaderboard.board.read(args.out), args.out,
                       ["tff-privacy", *sys.argv[1:]])
  print(f"{len(ran)} rows in {time.perf_counter() - start:.0f} s")
  return code


def _report_parser(sub) -> None:
  p = sub.add_parser("report", help="rebuild a leaderboard's report.md, CSV, "
                     "JSON and figures from its finished rows")
  p.add_argument("out", help="the leaderboard's folder")


def _report(args) -> int:
  from tff_privacy import leaderboard
  grid, results = leaderboard.board.read(args.out)
  if not results:
    raise ValueError(f"{args.out}: no finished rows yet")
  return _print_report(grid, results, args.out, None)


def _print_report(grid, results, out, command) -> int:
  from tff_privacy import leaderboard
  path = leaderboard.report.write(grid, results, out, command)
  rows = leaderboard.report.table_rows(grid, results)
  swept = not all(r["default"] for r in rows if r["equal_epsilon"] is None)
  files = []
  for name, _ in grid.variants():
    print("\n".join(leaderboard.report.section(
        "At each entry's default strength" + (f" ({name})" if name else ""),
        [r for r in rows if r["default"] and r["protocol"] == name], matched=swept)))
    files += leaderboard.report.figures(name)
  print(f"report: {path} (figures: {', '.join(files)}; leaderboard.csv, "
        "leaderboard.json)")
  return 0


def _epsilon_target(text: str):
  """A target epsilon > 0, or False for 'none'."""
  if text == "none":
    return False
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if not 0 < value < float("inf"):
    raise argparse.ArgumentTypeError(f"takes an epsilon > 0 or 'none', got {text!r}")
  return value


def _names(text: str) -> list[str]:
  names = [n.strip() for n in text.split(",") if n.strip()]
  if not names:
    raise argparse.ArgumentTypeError(f"takes comma-separated names, got {text!r}")
  return names


def _int_at_least(low: int):
  """An argparse type: integers >= `low`."""
  def parse(text: str) -> int:
    if not text.isdigit() or int(text) < low:
      raise argparse.ArgumentTypeError(f"takes an integer >= {low}, got {text!r}")
    return int(text)
  return parse


_positive_int = _int_at_least(1)


def _port(text: str) -> int:
  if not text.isdigit() or not 0 < int(text) < 65536:
    raise argparse.ArgumentTypeError(f"takes a TCP port in 1..65535, got {text!r}")
  return int(text)


def _audit_parser(sub) -> None:
  p = sub.add_parser(
      "audit", help="audit a run's privacy claim: an empirical lower bound on "
      "epsilon from canaries beside the claimed one, and membership inference",
      description="Writes RUN/audit.json: the canary audit of a DP defence "
      "(Steinke et al.'s one-run lower bound on the epsilon of one upload of "
      "a local DP defence, or of one round of DP-FedAvg, from canaries each "
      "included with probability 1/2) and "
      "tensorflow_privacy's membership-inference attacks on the final model; "
      "with --leaderboard, for every row, into the leaderboard's report.")
  which = p.add_mutually_exclusive_group(required=True)
  which.add_argument("--run", help="a training run's folder (the --out of "
                     "'tff-privacy train')")
  which.add_argument("--leaderboard", help="a leaderboard's folder: audits each "
                     "finished row's run not audited yet, then rebuilds its "
                     "report with the audit columns")
  p.add_argument("--canaries", type=_int_at_least(2), default=1000,
                 help="canaries of the canary audit (1000: a bound of at most "
                 "4.8 to 5.3, what that many guesses can show)")
  p.add_argument("--mia-samples", type=_int_at_least(20), default=1000,
                 help="training and test samples each scored by the "
                 "membership-inference attacks")
  p.add_argument("--seed", type=int, default=0)


def _audit(args) -> int:
  from tff_privacy.audit import report
  if args.leaderboard:
    from tff_privacy import leaderboard
    leaderboard.board.audit(args.leaderboard, args.canaries, args.mia_samples,
                            args.seed)
    return _print_report(*leaderboard.board.read(args.leaderboard),
                         args.leaderboard, None)
  result = report.audit_run(args.run, args.canaries, args.mia_samples, args.seed)
  canary = result["canary_audit"]
  if canary["computed"]:
    low, high = result["epsilon_interval"]
    claimed = result["epsilon_claimed"]
    print(f"{result['applied_to']}, protecting {result['unit']}: epsilon claimed "
          f"{'none' if claimed is None else f'{claimed:.4g}'}"
          f", audited lower bound {result['epsilon_lower_bound']:.3f} "
          f"[{low:.3f}, {'unbounded' if high is None else f'{high:.3f}'}] at "
          f"{result['confidence']:.0%} from {result['canaries']} canaries"
          + (" -- claim refuted" if result["claim_refuted"] else ""))
  else:
    print(f"canary audit: not computed: {canary['reason']}")
  whole = result["canary_clients"]
  if not whole["computed"] and result["defense"] == "dp_fedavg":
    print(f"the whole training: not audited: {whole['reason']}")
  elif whole["computed"]:
    claimed = whole["epsilon_claimed"]
    print(f"the whole training, {whole['canaries']} canary clients: epsilon claimed "
          f"{'none' if claimed is None else f'{claimed:.4g}'}, audited lower bound "
          + _bound_text(whole) + (f"; seeing every round's model: "
                                  + _bound_text(whole["every_round"])
                                  if "every_round" in whole else ""))
  mia = result["membership_inference"]
  print(f"membership inference: AUC {mia['mia_auc']:.3f} ({mia['best_attack']}), "
        f"advantage {mia['mia_advantage']:.3f}" if mia["computed"]
        else f"membership inference: not computed: {mia['reason']}")
  print(f"audit: {os.path.join(args.run, report.AUDIT_FILE)}")
  return 0


def _bound_text(audit: dict) -> str:
  """A canary audit's bound, estimate and verdict, for `_audit`'s lines."""
  estimate, interval = audit["epsilon_estimate"], audit["epsilon_estimate_ci"]
  ends = ("" if interval is None else " [" + ", ".join(
      "unbounded" if e is None else f"{e:.3g}" for e in interval) + "]")
  return (f"{audit['epsilon_lower_bound']:.3f}, estimate "
          f"{'none' if estimate is None else f'{estimate:.3g}'}{ends}"
          + (" -- claim refuted" if audit["claim_refuted"] else ""))


def _worker_parser(sub) -> None:
  p = sub.add_parser(
      "worker", help="serve TFF's worker on this machine for "
      "'train --worker-addresses' elsewhere",
      description="Serves TFF's worker, from a network namespace of its own, "
      "on a Unix socket only you can open (--socket, reached from the "
      "driver's machine by an SSH tunnel of that socket) or on "
      "127.0.0.1:PORT (--port), which every user of this machine can reach. "
      "A peer that reaches it can run any TensorFlow graph on it, which reads "
      "and writes files as you, and sees every value sent to it.")
  where = p.add_mutually_exclusive_group(required=True)
  where.add_argument("--socket", help="path of the Unix socket to serve on "
                     "(mode 0600)")
  where.add_argument("--port", type=_port, help="a TCP port, 1..65535")
  p.add_argument("--max-concurrent-computation-calls", type=int, default=-1)
  p.add_argument("--listen-on-every-interface", action="store_true",
                 help="with --port: serve on every network interface of this "
                 "machine instead of loopback: anyone who reaches the port, "
                 "on any network this machine is on, can then run code as you")


def _worker(args) -> int:
  from tff_privacy import runtime
  if args.socket and args.listen_on_every_interface:
    raise ValueError("--listen-on-every-interface goes with --port, not --socket")
  if args.socket:
    path = os.path.abspath(args.socket)
    if not os.path.isdir(os.path.dirname(path)) or os.path.exists(path):
      raise ValueError(f"--socket: {args.socket!r} must be a new path in an "
                       "existing directory")
    listen = f"unix:{path}"
  elif args.listen_on_every_interface:
    listen = f"[::]:{args.port}"
  else:
    listen = f"127.0.0.1:{args.port}"
  # the worker's host states who can reach it once it knows (its stderr)
  command = runtime.private_worker_command(listen,
                                           args.max_concurrent_computation_calls)
  if os.environ.get(runtime.SHARED_NETWORK_VARIABLE) == "1":
    command.append("--shared-network")
  os.execv(command[0], command)


def _client_index(text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"--client takes a client index or 'all', got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="tff-privacy",
      description="Federated learning defences against gradient leakage, and "
                  "the attacks that measure them.")
  sub = parser.add_subparsers(dest="command", required=True)
  _train_parser(sub)
  _attack_parser(sub)
  _merge_parser(sub)
  _infer_parser(sub)
  _demo_parser(sub)
  _leaderboard_parser(sub)
  _report_parser(sub)
  _audit_parser(sub)
  _worker_parser(sub)
  return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
  # Level 3: TensorFlow's C++ log stays quiet (at import it reports three
  # CUDA plugin registrations as errors even on CPU-only machines); errors
  # that matter reach Python as exceptions.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  args = _parser().parse_args(argv)
  from tff_privacy import runtime
  runtime.install()
  try:
    return {"train": _train, "attack": _attack, "merge-attacks": _merge,
            "infer-attributes": _infer, "demo": _demo,
            "leaderboard": _leaderboard, "report": _report,
            "audit": _audit, "worker": _worker}[args.command](args)
  except (ValueError, OSError, runtime.WorkerError) as e:
    if os.environ.get(DEBUG_VARIABLE):
      raise
    print(f"tff-privacy {args.command}: error: {_one_line(e)}", file=sys.stderr)
    return EXIT_USAGE
  except KeyboardInterrupt:
    if runtime.failure() is None:
      raise
    print(f"tff-privacy {args.command}: error: {runtime.failure()}", file=sys.stderr)
    return 1
  finally:
    runtime.stop()


def _one_line(error: Exception) -> str:
  if isinstance(error, OSError) and error.filename and error.strerror:
    return f"{error.filename}: {error.strerror}"
  return " ".join(str(error).split())


if __name__ == "__main__":
  sys.exit(main())
