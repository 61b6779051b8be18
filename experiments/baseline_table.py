"""Utility and leakage of each defence baseline at two strengths.

For every baseline of `tff_privacy.defenses` (and no defence), at a weak and
a strong setting:

* utility: FedSGD on mnist5k, 10 IID clients, batch 32, 20 rounds (server
  learning rate 0.1, the cnn) -> final test accuracy, and the (epsilon, delta)
  the run reports for DP mechanisms;
* leakage: FedSGD round 1 with 8 clients holding one image each, the uploads
  captured through TFF (for dp_fedavg: the clipped updates the server sees)
  and attacked with Inverting Gradients (4800 iterations) -> mean SSIM, PSNR
  and MSE of the reconstructions, and label accuracy.

The strengths are set against the scale of this model's uploads (round-1
gradient: global L2 norm about 0.5, median |entry| about 2e-4, 99th
percentile about 7e-3), so that the weak setting barely changes the update
and the strong one visibly does.

Writes OUT/summary.md and OUT/summary.csv (one row per setting) and keeps
each setting's runs and attack outputs under OUT/<defense>_<strength>/. A
setting whose row.json exists is not recomputed (delete it to redo).

  python experiments/baseline_table.py [--out results/baselines] [--only ldp_fed,soteria]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the CUDA plugin lines

import argparse

from tff_privacy import evaluate, io, provenance, runner, runtime

BASELINES = [
    ("none", "-", {}),
    ("ldp_gaussian", "weak", {"clip": 1.0, "noise_multiplier": 0.001}),
    ("ldp_gaussian", "strong", {"clip": 1.0, "noise_multiplier": 0.01}),
    ("ldp_laplace", "weak", {"clip": 1.0, "noise_multiplier": 0.001}),
    ("ldp_laplace", "strong", {"clip": 1.0, "noise_multiplier": 0.01}),
    ("dp_clip", "weak", {"clip": 1.0}),
    ("dp_clip", "strong", {"clip": 0.1}),
    ("sparsification", "weak", {"p": 0.9}),
    ("sparsification", "strong", {"p": 0.99}),
    ("soteria", "weak", {"p": 0.5}),
    ("soteria", "strong", {"p": 0.9}),
    ("dp_fedavg", "weak", {"clip": 1.0, "noise_multiplier": 0.01}),
    ("dp_fedavg", "strong", {"clip": 1.0, "noise_multiplier": 0.1}),
    ("ldp_fed", "weak", {"alpha": 1.0, "clip": 0.01, "precision": 4}),
    ("ldp_fed", "strong", {"alpha": 0.1, "clip": 0.01, "precision": 4}),
]

COLUMNS = ["defense", "strength", "params", "test_accuracy", "epsilon", "delta",
           "ssim", "psnr", "mse", "label_accuracy"]


def run_setting(out: str, defense: str, kwargs: dict, rounds: int,
                iterations: int) -> dict:
  common = dict(method="fedsgd", dataset="mnist5k", model="cnn", seed=0,
                defense=None if defense == "none" else defense,
                defense_kwargs=kwargs)
  utility = runner.run(runner.RunConfig(
      out=os.path.join(out, "utility"), clients=10, batch_size=32,
      rounds=rounds, **common), progress=False)[-1]
  runner.run(runner.RunConfig(
      out=os.path.join(out, "leakage"), clients=8, partition="one_per_client",
      batch_size=1, rounds=1, capture_rounds=(1,), **common), progress=False)
  runtime.renew()  # a worker's memory grows with every run it serves
  attack = evaluate.attack_round(os.path.join(out, "leakage", "updates"), 1,
                                 os.path.join(out, "attack"), "ig",
                                 attack_kwargs={"iterations": iterations})
  m = attack["mean"]
  return {"test_accuracy": utility["test_accuracy"],
          "epsilon": utility.get("epsilon"), "delta": utility.get("delta"),
          "ssim": m["ssim"], "psnr": m["psnr"], "mse": m["mse"],
          "label_accuracy": m["label_accuracy"]}


def _fmt(value, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def write_tables(out: str, rows: list[dict], rounds: int) -> str:
  lines = [f"| defense | strength | parameters | test acc. ({rounds} rounds) | epsilon "
           "(delta) | IG SSIM | IG PSNR (dB) | IG MSE | label acc. |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    privacy = ("-" if r["epsilon"] is None
               else f"{r['epsilon']:.3g} ({r['delta']:g})")
    lines.append(f"| {r['defense']} | {r['strength']} | {r['params']} | "
                 f"{r['test_accuracy']:.4f} | {privacy} | {r['ssim']:.4f} | "
                 f"{r['psnr']:.2f} | {r['mse']:.4f} | "
                 f"{_fmt(r['label_accuracy'], '.2f')} |")
  text = "\n".join(lines) + "\n" + provenance.footnote(out)
  io.write_text(os.path.join(out, "summary.md"), text)
  io.write_csv(os.path.join(out, "summary.csv"), rows, COLUMNS)
  return text


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="results/baselines")
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--ig-iterations", type=int, default=4800)
  parser.add_argument("--only", default="",
                      help="comma-separated defence names (default: all)")
  args = parser.parse_args()
  runtime.start()
  only = set(filter(None, args.only.split(",")))
  unknown = only - {name for name, _, _ in BASELINES}
  if unknown:
    parser.error(f"--only: unknown defences {sorted(unknown)}")
  rows = []
  for defense, strength, kwargs in BASELINES:
    if only and defense not in only:
      continue
    folder = os.path.join(args.out, f"{defense}_{strength}".replace("_-", ""))
    row_path = os.path.join(folder, "row.json")
    if os.path.exists(row_path):
      row = io.read_json(row_path)
    else:
      print(f"{defense} ({strength}) {kwargs} ...", flush=True)
      row = {"defense": defense, "strength": strength,
             "params": " ".join(f"{k}={v}" for k, v in kwargs.items()) or "-",
             **run_setting(folder, defense, kwargs, args.rounds, args.ig_iterations)}
      io.write_json(row_path, row)
    print(row, flush=True)
    rows.append(row)
  print(write_tables(args.out, rows, args.rounds))
  runtime.stop()


if __name__ == "__main__":
  main()
