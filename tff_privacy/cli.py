"""`tff-privacy`: command-line entry point.

  tff-privacy train --method fedsgd --dataset mnist5k --model lenet \\
      --clients 10 --rounds 20 --batch-size 32 --seed 0 --capture-rounds 1 \\
      --out results/run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


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


def _train_parser(sub) -> None:
  from tff_privacy import algorithms, data, defenses, models  # deferred: TF
  p = sub.add_parser("train", help="train a federated method, capturing uploads")
  p.add_argument("--config", help="JSON file of RunConfig fields; flags override")
  p.add_argument("--out", help="output folder (required here or in --config)")
  p.add_argument("--method", choices=sorted(algorithms.METHODS))
  p.add_argument("--dataset", choices=data.DATASETS)
  p.add_argument("--data-dir", help="tensorflow_datasets data directory")
  p.add_argument("--model", choices=sorted(models.MODELS))
  p.add_argument("--model-kwargs", type=json.loads,
                 help='model builder arguments as JSON, e.g. \'{"weight_init": "default"}\'')
  p.add_argument("--clients", type=int, help="number of clients (default 10)")
  p.add_argument("--clients-per-round", type=int, help="default: all")
  p.add_argument("--rounds", type=int, help="default 20")
  p.add_argument("--batch-size", type=int, help="default 32")
  p.add_argument("--local-epochs", type=int, help="(fedavg) default 1")
  p.add_argument("--client-lr", type=float, help="(fedavg) default 0.1")
  p.add_argument("--server-lr", type=float,
                 help="default: 0.1 for fedsgd, 1.0 for fedavg")
  p.add_argument("--partition", choices=data.PARTITIONS)
  p.add_argument("--alpha", type=float, help="Dirichlet concentration (> 0)")
  p.add_argument("--seed", type=int)
  p.add_argument("--capture-rounds", type=parse_rounds,
                 help="rounds whose uploads are written to OUT/updates, e.g. 1,5")
  p.add_argument("--defense", choices=sorted(defenses.DEFENSES),
                 help="defence: applied by every client to its upload, or by "
                 "the server's aggregator for dp_fedavg")
  for flag, (_, names, kind, text) in _DEFENSE_FLAGS.items():
    extra = {"choices": kind} if isinstance(kind, tuple) else {"type": kind}
    p.add_argument("--" + flag.replace("_", "-"), help=f"({', '.join(names)}) {text}",
                   **extra)
  p.add_argument("--method-kwargs", type=json.loads,
                 help="further method parameters as JSON, e.g. "
                 "'{\"perturb_steps\": 10}'")
  for flag, (_, kind, text) in _METHOD_FLAGS.items():
    extra = {"choices": kind} if isinstance(kind, tuple) else {"type": kind}
    p.add_argument("--" + flag.replace("_", "-"), help=f"(fedem) {text}", **extra)
  p.add_argument("--dp-delta", type=float,
                 help="delta at which DP runs report epsilon (default 1e-5)")
  p.add_argument("--quiet", action="store_true", help="no progress bar")


# --flag -> (keyword of the defence's constructor, defences taking it,
#            type or choices, help)
_DEFENSE_FLAGS = {
    "clip": ("clip", ("ldp_gaussian", "ldp_laplace", "dp_clip", "dp_fedavg", "ldp_fed"),
             float, "clipping bound B (ldp_fed: values clipped to [-B, B], default 0.05)"),
    "noise_multiplier": ("noise_multiplier", ("ldp_gaussian", "ldp_laplace", "dp_fedavg"),
                         float, "noise std or scale over B"),
    "laplace_norm": ("norm", ("ldp_laplace",), ("l1", "l2"),
                     "norm of the clipping (default l2)"),
    "sparsity": ("p", ("sparsification",), float,
                 "fraction p of entries zeroed, in [0, 1)"),
    "prune_rate": ("p", ("soteria",), float,
                   "fraction p of the defended layer's representation pruned, "
                   "in [0, 1) (default 0.8)"),
    "defended_layer": ("layer", ("soteria",), str,
                       "dense layer to defend (default: the first)"),
    "cldp_alpha": ("alpha", ("ldp_fed",), float, "alpha of alpha-CLDP (default 1)"),
    "cldp_precision": ("precision", ("ldp_fed",), int,
                       "decimal digits of the output grid (default 3)"),
    "share_fraction": ("fraction", ("ldp_fed",), float,
                       "fraction of entries each client shares, in (0, 1] "
                       "(default 1)"),
}


# FedEM's --flag -> (keyword of `algorithms.fedem.algorithm`, type or choices,
# help)
_METHOD_FLAGS = {
    "perturb_steps": ("perturb_steps", int, "N, perturbation iterations (default 5)"),
    "perturb_lr": ("perturb_lr", float, "alpha_u, sign step on the perturbation "
                   "(default 0.01)"),
    "local_model_lr": ("model_lr", float, "eta_u, step of the local model copy "
                       "(default 0.01)"),
    "rho_min": ("rho_min", float, "lower bound of each perturbation entry's "
                "magnitude (linf) or sample's L2 norm (default 0)"),
    "rho_max": ("rho_max", float, "upper bound of the same, on [0, 1] data "
                "(default 8/255)"),
    "perturb_norm": ("norm", ("linf", "l2"), "norm of the bounds (default linf)"),
}


def _method_kwargs(args, method: str) -> dict:
  given = {_METHOD_FLAGS[flag][0]: getattr(args, flag) for flag in _METHOD_FLAGS
           if getattr(args, flag) is not None}
  if given and method != "fedem":
    flags = ", ".join("--" + f.replace("_", "-") for f in _METHOD_FLAGS
                      if getattr(args, f) is not None)
    raise ValueError(f"{flags} apply to --method fedem only")
  return {**(args.method_kwargs or {}), **given}


def _defense_kwargs(args) -> dict:
  given = {flag: getattr(args, flag) for flag in _DEFENSE_FLAGS
           if getattr(args, flag) is not None}
  if given and not args.defense:
    raise ValueError(f"--{next(iter(given)).replace('_', '-')} needs --defense")
  for flag in given:
    if args.defense not in _DEFENSE_FLAGS[flag][1]:
      raise ValueError(f"--{flag.replace('_', '-')} does not apply to "
                       f"--defense {args.defense}; it applies to "
                       f"{', '.join(_DEFENSE_FLAGS[flag][1])}")
  return {_DEFENSE_FLAGS[flag][0]: value for flag, value in given.items()}


def _config_from_args(args):
  from tff_privacy.runner import RunConfig
  fields = {}
  if args.config:
    with open(args.config) as f:
      fields.update(json.load(f))
  for name in ("out", "method", "dataset", "data_dir", "model", "model_kwargs",
               "clients", "clients_per_round", "rounds", "batch_size",
               "local_epochs", "client_lr", "server_lr", "partition", "alpha",
               "seed", "capture_rounds", "defense", "dp_delta"):
    value = getattr(args, name)
    if value is not None:
      fields[name] = value
  kwargs = _defense_kwargs(args)
  if kwargs:
    fields["defense_kwargs"] = kwargs
  method_kwargs = _method_kwargs(
      args, fields.get("method", RunConfig.__dataclass_fields__["method"].default))
  if method_kwargs:
    fields["method_kwargs"] = {**fields.get("method_kwargs", {}), **method_kwargs}
  if "out" not in fields:
    raise ValueError("--out is required (or 'out' in --config)")
  unknown = sorted(set(fields) - set(RunConfig.__dataclass_fields__))
  if unknown:
    raise ValueError(f"unknown config fields: {', '.join(unknown)}")
  return RunConfig(**fields)


def _train(args) -> int:
  from tff_privacy import runner
  config = _config_from_args(args)
  history = runner.run(config, progress=not args.quiet)
  last = history[-1] if history else {}
  privacy = (f" epsilon={last['epsilon']:.4g} delta={last['delta']:g}"
             if "epsilon" in last else "")
  print(f"method={config.method} dataset={config.dataset} model={config.model} "
        f"defense={config.defense} rounds={last.get('round')} "
        f"test_accuracy={last.get('test_accuracy'):.4f} "
        f"test_loss={last.get('test_loss'):.4f}{privacy}")
  print(f"results in {config.out}: metrics.json, tensorboard/"
        + (", updates/manifest.json, ground_truth/" if config.capture_rounds else ""))
  return 0


_ATTACK_FLAGS = ("iterations", "restarts", "lr", "tv_weight", "init", "history",
                 "tolerance")


def _attack_parser(sub) -> None:
  from tff_privacy import attacks  # deferred: imports TF
  p = sub.add_parser("attack", help="invert captured client uploads")
  p.add_argument("--updates", required=True, help="an update store (RUN/updates)")
  p.add_argument("--ground-truth", help="ground-truth store for scoring "
                 "(default: ground_truth/ beside --updates)")
  p.add_argument("--round", type=int, required=True)
  p.add_argument("--client", default="all",
                 help="a captured client index, or 'all' (default)")
  p.add_argument("--attack", choices=sorted(attacks.ATTACKS), default="ig")
  p.add_argument("--iterations", type=int)
  p.add_argument("--restarts", type=int, help="random restarts, best kept")
  p.add_argument("--tolerance", type=float,
                 help="(dlg, idlg) stop when the gradient max-norm is below this")
  p.add_argument("--lr", type=float, help="(ig) Adam learning rate")
  p.add_argument("--tv-weight", type=float, help="(ig) total-variation weight")
  p.add_argument("--history", type=int, help="(dlg, idlg) L-BFGS history")
  p.add_argument("--init", choices=attacks.inversion.INITS)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--device", help="TensorFlow device, e.g. /GPU:0 or /CPU:0")
  p.add_argument("--lpips-weights",
                 help="LPIPS (AlexNet) weights .npz; without it LPIPS is not computed")
  p.add_argument("--out", required=True)


def _attack(args) -> int:
  import inspect

  from tff_privacy import attacks, evaluate
  kwargs = {k: getattr(args, k) for k in _ATTACK_FLAGS
            if getattr(args, k) is not None}
  accepted = inspect.signature(attacks.ATTACKS[args.attack]).parameters
  wrong = sorted(k for k in kwargs if k not in accepted)
  if wrong:
    raise ValueError(f"--{wrong[0].replace('_', '-')} does not apply to "
                     f"--attack {args.attack}")
  clients = None if args.client == "all" else [_client_index(args.client)]
  result = evaluate.attack_round(args.updates, args.round, args.out, args.attack,
                                 clients, kwargs, args.device, args.seed,
                                 args.ground_truth, args.lpips_weights)
  m = result["mean"]
  print(f"attack={args.attack} records={len(result['clients'])} "
        f"samples={len(result['samples'])} mse={m['mse']:.4f} "
        f"psnr={m['psnr']:.2f} ssim={m['ssim']:.4f} "
        f"label_accuracy={m['label_accuracy']:.2f} seconds={result['seconds']:.1f}")
  print(f"lpips: {m['lpips']:.4f}" if "lpips" in m else f"lpips: {result['lpips']}")
  print(f"results in {args.out}: attack.json, reconstructions.png")
  return 0


def _demo_parser(sub) -> None:
  p = sub.add_parser("demo", help="train FedSGD on bundled digits, then invert "
                     "its round-1 uploads and print utility beside leakage")
  p.add_argument("--out", default="results/demo")
  p.add_argument("--rounds", type=int, default=100)
  p.add_argument("--iterations", type=int, default=1000,
                 help="Inverting Gradients iterations per client")
  p.add_argument("--quiet", action="store_true")


def _demo(args) -> int:
  from tff_privacy import evaluate, io, runner
  config = runner.RunConfig(
      out=os.path.join(args.out, "train"), method="fedsgd", dataset="mnist5k",
      model="cnn", clients=10, rounds=args.rounds, batch_size=4, server_lr=0.2,
      seed=0, capture_rounds=(1,))
  history = runner.run(config, progress=not args.quiet)
  result = evaluate.attack_round(
      os.path.join(config.out, "updates"), 1, os.path.join(args.out, "attack"),
      "ig", attack_kwargs={"iterations": args.iterations})
  m = result["mean"]
  table = ("| method | test accuracy | attack | mean PSNR (dB) | mean SSIM | "
           "label accuracy |\n|---|---|---|---|---|---|\n"
           f"| fedsgd | {history[-1]['test_accuracy']:.4f} | ig, round 1, "
           f"{len(result['clients'])} clients x {config.batch_size} images | "
           f"{m['psnr']:.2f} | {m['ssim']:.4f} | {m['label_accuracy']:.2f} |\n")
  io.write_text(os.path.join(args.out, "summary.md"), table)
  print(table)
  print(f"results in {args.out}: summary.md, train/metrics.json, train/updates/, "
        "attack/attack.json, attack/reconstructions.png")
  return 0


def _client_index(text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"--client takes a client index or 'all', got {text!r}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog="tff-privacy",
      description="Federated learning defences against gradient leakage, and "
                  "the attacks that measure them.")
  sub = parser.add_subparsers(dest="command", required=True)
  _train_parser(sub)
  _attack_parser(sub)
  _demo_parser(sub)
  args = parser.parse_args(argv)
  try:
    return {"train": _train, "attack": _attack, "demo": _demo}[args.command](args)
  except (ValueError, FileNotFoundError) as e:
    print(f"tff-privacy {args.command}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    from tff_privacy import runtime
    if runtime.failure() is None:
      raise
    print(f"tff-privacy {args.command}: error: {runtime.failure()}", file=sys.stderr)
    return 1
  finally:
    from tff_privacy import runtime
    runtime.stop()


if __name__ == "__main__":
  sys.exit(main())
