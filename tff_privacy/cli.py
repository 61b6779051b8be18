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
  from tff_privacy import algorithms, data, models  # deferred: imports TF
  p = sub.add_parser("train", help="train a federated method, capturing uploads")
  p.add_argument("--config", help="JSON file of RunConfig fields; flags override")
  p.add_argument("--out", help="output folder (required here or in --config)")
  p.add_argument("--method", choices=sorted(algorithms.METHODS))
  p.add_argument("--dataset", choices=data.DATASETS)
  p.add_argument("--data-dir", help="tensorflow_datasets data directory")
  p.add_argument("--model", choices=sorted(models.MODELS))
  p.add_argument("--model-kwargs", type=json.loads,
                 help='model builder arguments as JSON, e.g. \'{"weight_init": "default"}\'')
  p.add_argument("--clients", type=int)
  p.add_argument("--clients-per-round", type=int)
  p.add_argument("--rounds", type=int)
  p.add_argument("--batch-size", type=int)
  p.add_argument("--local-epochs", type=int)
  p.add_argument("--client-lr", type=float)
  p.add_argument("--server-lr", type=float)
  p.add_argument("--partition", choices=data.PARTITIONS)
  p.add_argument("--alpha", type=float, help="Dirichlet concentration (> 0)")
  p.add_argument("--seed", type=int)
  p.add_argument("--capture-rounds", type=parse_rounds,
                 help="rounds whose uploads are written to OUT/updates, e.g. 1,5")
  p.add_argument("--quiet", action="store_true", help="no progress bar")


def _config_from_args(args):
  from tff_privacy.runner import RunConfig
  fields = {}
  if args.config:
    with open(args.config) as f:
      fields.update(json.load(f))
  for name in ("out", "method", "dataset", "data_dir", "model", "model_kwargs",
               "clients", "clients_per_round", "rounds", "batch_size",
               "local_epochs", "client_lr", "server_lr", "partition", "alpha",
               "seed", "capture_rounds"):
    value = getattr(args, name)
    if value is not None:
      fields[name] = value
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
  print(f"method={config.method} dataset={config.dataset} model={config.model} "
        f"rounds={last.get('round')} test_accuracy={last.get('test_accuracy'):.4f} "
        f"test_loss={last.get('test_loss'):.4f}")
  print(f"results in {config.out}: metrics.json, tensorboard/"
        + (", updates/manifest.json, ground_truth/" if config.capture_rounds else ""))
  return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog="tff-privacy",
      description="Federated learning defences against gradient leakage, and "
                  "the attacks that measure them.")
  sub = parser.add_subparsers(dest="command", required=True)
  _train_parser(sub)
  args = parser.parse_args(argv)
  try:
    return {"train": _train}[args.command](args)
  except ValueError as e:
    print(f"tff-privacy {args.command}: error: {e}", file=sys.stderr)
    return 2
  finally:
    from tff_privacy import runtime
    runtime.stop()


if __name__ == "__main__":
  sys.exit(main())
