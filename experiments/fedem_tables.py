"""FedEM's tables (Xu et al., Tables 1, 2, 3 and 5) at a small scale by default.

Every setting trains one model and attacks one capture:

* utility: `rounds` rounds on the data set's clients (4 IID clients, one batch
  of 32 per round, FedEM Sec. 4.1.2), then the final model's accuracy on two
  fixed halves of the test split: validation and test;
* leakage: round 1 of the same method with 8 clients holding one image each;
  the captured uploads are attacked with DLG (the paper's attack) and, as a
  stronger reference, Inverting Gradients: MSE, feature MSE, SSIM and PSNR of
  the reconstructions against the originals.

Tables (Markdown and CSV each, in OUT):
1. FedSGD vs FedEM (N = 5, rho_min = 0, rho_max = 8/255);
2. FedEM vs local DP: Gaussian, Laplace and clipping-only, (a) at matched
   perturbation radius: Gaussian std, Laplace scale and clip bound all equal
   rho_max (the Gaussian and Laplace clip B = 1), and (b) at matched utility:
   the setting of a small grid whose test accuracy is closest to FedEM's;
3. FedEM with N in {1, 5, 10};
5. FedEM with rho_min in {0, rho_max/8, rho_max/4}.
Plus reconstructions_<attack>.png: originals, then the reconstructions under
FedSGD, FedEM and local Gaussian DP at matched radius (the paper's Figure 3).

The model is LeNet with ReLU and Glorot initialisation: DLG's sigmoid LeNet
(U(-0.5, 0.5)) barely trains with one FedSGD step per round. A round here is
one FedSGD step, where the paper's rounds are whole local epochs, hence more
rounds. Each setting's runs live in OUT/<setting>/ and a setting whose
row.json exists is not recomputed.

  python experiments/fedem_tables.py                       # small: mnist5k
  python experiments/fedem_tables.py --dataset mnist --scale full
  python experiments/fedem_tables.py --dataset fashion_mnist --scale full
  python experiments/fedem_tables.py --dataset cifar10 --scale full
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the CUDA plugin lines

import argparse

import numpy as np

from tff_privacy import evaluate, io, provenance, runner, runtime
from tff_privacy.metrics import report

RHO_MAX = 8 / 255
MODEL = {"weight_init": "default", "activation": "relu"}
ROUNDS = {("small", "mnist5k"): 200, ("full", "mnist"): 1000,
          ("full", "fashion_mnist"): 1000, ("full", "cifar10"): 2000}
# local DP settings tried for the matched-utility rows, weakest first: noise
# std (Gaussian) or scale (Laplace) 1e-3, 1e-2, 3e-2 under a clip of 10 that
# rarely binds, and clip bounds for clipping alone
UTILITY_GRID = {
    "ldp_gaussian": [{"clip": 10.0, "noise_multiplier": z} for z in (1e-4, 1e-3, 3e-3)],
    "ldp_laplace": [{"clip": 10.0, "noise_multiplier": b} for b in (1e-4, 1e-3, 3e-3)],
    "dp_clip": [{"clip": c} for c in (10.0, 1.0, 0.1)],
}
LABELS = {"ldp_gaussian": "DP-Gaussian", "ldp_laplace": "DP-Laplace",
          "dp_clip": "DP-clip"}


def fedem(**kwargs) -> dict:
  return {"method": "fedem", "method_kwargs": kwargs}


def ldp(defense: str, kwargs: dict) -> dict:
  return {"method": "fedsgd", "defense": defense, "defense_kwargs": kwargs}


class Experiment:
  def __init__(self, args):
    self.args = args
    self.common = dict(dataset=args.dataset, model="lenet", model_kwargs=MODEL,
                       seed=args.seed, data_dir=args.data_dir)
    self._rows: dict[str, dict] = {}

  def utility(self, name: str, setting: dict) -> dict:
    out = os.path.join(self.args.out, name, "utility")
    config = runner.RunConfig(out=out, clients=4, batch_size=32,
                              rounds=self.args.rounds, **self.common, **setting)
    runner.run(config, progress=not self.args.quiet)
    runtime.renew()  # a worker's memory grows with every run it serves
    run = runner.Run(config)
    weights = runner.load_model_weights(out, run.spec)
    x, y = run.fed.test
    order = np.random.default_rng(0).permutation(len(y))
    val, test = order[: len(y) // 2], order[len(y) // 2:]
    evaluator = runner.Evaluator(run.spec)
    return {"test_accuracy": evaluator(weights, x[test], y[test])[0],
            "val_accuracy": evaluator(weights, x[val], y[val])[0]}

  def leakage(self, name: str, setting: dict) -> dict:
    out = os.path.join(self.args.out, name, "leakage")
    runner.run(runner.RunConfig(out=out, clients=8, partition="one_per_client",
                                batch_size=1, rounds=1, capture_rounds=(1,),
                                **self.common, **setting), progress=False)
    runtime.renew()
    row = {}
    for attack in self.args.attacks:
      kwargs = {"iterations": self.args.ig_iterations} if attack == "ig" else {}
      result = evaluate.attack_round(os.path.join(out, "updates"), 1,
                                     os.path.join(self.args.out, name, attack),
                                     attack, attack_kwargs=kwargs)
      for metric in ("mse", "feature_mse", "ssim", "psnr"):
        row[f"{attack}_{metric}"] = result["mean"][metric]
    return row

  def row(self, name: str, setting: dict, with_leakage: bool = True) -> dict:
    """The setting's scores, computed once (cached in OUT/<name>/row.json)."""
    if name in self._rows and (not with_leakage or any(
        k.endswith("_ssim") for k in self._rows[name])):
      return self._rows[name]
    path = os.path.join(self.args.out, name, "row.json")
    if os.path.exists(path):
      row = io.read_json(path)
    else:
      print(f"{name}: {setting}", flush=True)
      row = {"setting": name, **self.utility(name, setting)}
      io.write_json(path, row)
    if with_leakage and not any(k.endswith("_ssim") for k in row):
      row.update(self.leakage(name, setting))
      io.write_json(path, row)
    print(row, flush=True)
    self._rows[name] = row
    return row


def write_table(out: str, stem: str, title: str, rows: list[dict],
                attacks: list[str]) -> str:
  columns = ["test_accuracy", "val_accuracy"] + [
      f"{a}_{m}" for a in attacks for m in ("mse", "feature_mse", "ssim", "psnr")]
  head = ["method"] + columns
  lines = [f"### {title}", "", "| " + " | ".join(head) + " |",
           "|" + "---|" * len(head)]
  for r in rows:
    lines.append("| " + " | ".join([r["method"]] + [
        format(r[c], ".3g" if c.endswith("feature_mse") else ".4f")
        if c in r else "-" for c in columns]) + " |")
  text = "\n".join(lines) + "\n" + provenance.footnote(out)
  io.write_text(os.path.join(out, f"{stem}.md"), text)
  io.write_csv(os.path.join(out, f"{stem}.csv"), rows, ["method", "setting"] + columns)
  return text


def _grid_name(defense: str, kwargs: dict) -> str:
  return defense + "".join(f"_{k}{v:g}" for k, v in kwargs.items())


def labelled(label: str, row: dict) -> dict:
  return {"method": label, **row}


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", default="mnist5k",
                      choices=("mnist5k", "mnist", "fashion_mnist", "cifar10"))
  parser.add_argument("--scale", default="small", choices=("small", "full"))
  parser.add_argument("--rounds", type=int,
                      help="default: 200 (small), 1000 (full MNIST, FMNIST), "
                      "2000 (full CIFAR-10)")
  parser.add_argument("--attacks", default="dlg,ig",
                      help="comma-separated, from dlg, idlg, ig")
  parser.add_argument("--ig-iterations", type=int, default=4800)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--data-dir", help="tensorflow_datasets data directory "
                      "(full scale; downloads when the data set is missing)")
  parser.add_argument("--out", help="default: results/fedem_<dataset>_<scale>")
  parser.add_argument("--quiet", action="store_true")
  args = parser.parse_args()
  runtime.start()
  if args.rounds is None:
    if (args.scale, args.dataset) not in ROUNDS:
      parser.error(f"--scale {args.scale} with --dataset {args.dataset} needs "
                   "--rounds")
    args.rounds = ROUNDS[(args.scale, args.dataset)]
  args.attacks = [a for a in args.attacks.split(",") if a]
  args.out = args.out or os.path.join("results", f"fedem_{args.dataset}_{args.scale}")
  exp = Experiment(args)

  fedsgd = exp.row("fedsgd", {"method": "fedsgd"})
  fedem_row = exp.row("fedem_N5", fedem())
  tables = [write_table(args.out, "table1", "Table 1: FedSGD vs FedEM",
                        [labelled("FedSGD", fedsgd), labelled("FedEM", fedem_row)],
                        args.attacks)]

  radius = {"ldp_gaussian": {"clip": 1.0, "noise_multiplier": RHO_MAX},
            "ldp_laplace": {"clip": 1.0, "noise_multiplier": RHO_MAX},
            "dp_clip": {"clip": RHO_MAX}}
  rows = [labelled(f"{LABELS[d]} (radius)", exp.row(f"{d}_radius", ldp(d, k)))
          for d, k in radius.items()]
  for defense, grid in UTILITY_GRID.items():
    names = {_grid_name(defense, kwargs): kwargs for kwargs in grid}
    accuracy = {name: exp.row(name, ldp(defense, kwargs), with_leakage=False)[
        "test_accuracy"] for name, kwargs in names.items()}
    name = min(names, key=lambda n: abs(accuracy[n] - fedem_row["test_accuracy"]))
    params = " ".join(f"{k}={v}" for k, v in names[name].items())
    rows.append(labelled(f"{LABELS[defense]} (utility: {params})",
                         exp.row(name, ldp(defense, names[name]))))
  rows.append(labelled("FedEM", fedem_row))
  tables.append(write_table(args.out, "table2",
                            "Table 2: FedEM vs local DP at matched radius and "
                            "at matched utility", rows, args.attacks))

  rows = [labelled(f"N={n}", fedem_row if n == 5 else
                   exp.row(f"fedem_N{n}", fedem(perturb_steps=n)))
          for n in (1, 5, 10)]
  tables.append(write_table(args.out, "table3", "Table 3: perturbation iterations",
                            rows, args.attacks))

  rows = [labelled(f"rho_min=rho_max/{d}" if d else "rho_min=0",
                   exp.row(f"fedem_rhomin{d}", fedem(rho_min=RHO_MAX / d))
                   if d else fedem_row)
          for d in (0, 8, 4)]
  tables.append(write_table(args.out, "table5", "Table 5: perturbation lower bound",
                            rows, args.attacks))

  manifest = io.read_json(os.path.join(args.out, "fedsgd", "leakage", "updates",
                                       "manifest.json"))
  for attack in args.attacks:
    images = {}
    for label, name in (("FedSGD", "fedsgd"), ("FedEM", "fedem_N5"),
                        ("LDP", "ldp_gaussian_radius")):
      with np.load(os.path.join(args.out, name, attack, "reconstructions.npz")) as f:
        images.setdefault("original", list(f["original"]))
        images[label] = list(f["reconstructed"])
    report.save_grid(images, os.path.join(args.out, f"reconstructions_{attack}.png"),
                     manifest["run"]["value_range"],
                     title=f"{attack} reconstructions, round 1 ({args.dataset})")
  print("\n".join(tables))
  runtime.stop()


if __name__ == "__main__":
  main()
