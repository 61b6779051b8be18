"""HyperFL's Tables 1, 2 and 3 (Guo et al.): personalised accuracy of HyperFL,
HyperFL-LPM and their baselines on the label-group non-IID split, and how
much their uploads leak to gradient inversion; small by default.

Table 1 (utility).
Every method trains on the same clients and is scored the paper's way, "the
average test accuracy of all local models": the mean over clients of each
client's model after its local training in the last round, before the
server aggregates (`--evaluate local-after-training`), on its own test split
(drawn like its training samples), for every method but pFedHN, as the
authors' code scores them; pFedHN's and pFedHN-PC's clients (whose models
the server generates, outside the authors' code) are scored with their own
model after the round. Each table names the evaluation of every row. Every row is trained
with each of `--seeds` (default 0, 1, 2): the table gives the mean over
seeds, their spread (std) and range, and per seed the spread over clients
and the worst client, averaged. Two settings, as in the paper:

* "20 clients": 20 clients, all in every round;
* "100 clients": 100 clients, 30 sampled per round.

`--split FILE` trains Table 1 on the clients of a split file instead (all in
every round; `experiments/write_split.py` writes one by the authors'
procedure), in one setting named after its number of clients.

Methods and their paper settings (the HyperFL authors' code): Local-only,
FedAvg (SGD lr 0.02, momentum 0.5, weight decay 5e-4, 5 local epochs),
pFedHN and pFedHN-PC (pFedHN's own
settings, see `tff_privacy.algorithms.pfedhn`; Table 1 of the paper lists
pFedHN only), DP-FedAvg, CENTAUR and PPSGD (DP-SGD, clip 0.04, noise
calibrated for epsilon 4, delta 1e-5 over the run), HyperFL. The paper's
rows for Fashion-MNIST and EMNIST are printed beside ours: its numbers come
from 200 rounds on the full data sets, ours from `--rounds` rounds on the
data set chosen here, so they are context, not a reproduction target.

Table 2 (HyperFL-LPM). 20 clients, all in every round, batch 16, on
`lpm_resnet` (`tff_privacy.models.lpm`): a small ResNet frozen after
pre-training on bundled data that is not the task's (scikit-learn's digits
by default; `--backbone-weights` gives another, e.g. one pre-trained with
`python -m tff_privacy.models.backbone`), where the paper freezes ImageNet
ResNet-18 and ViT-S. Rows as the paper's columns: Local-only and FedAvg,
each with a fixed feature extractor (only the classifier trains) and with
adapter fine-tuning (adapters and classifier train; SGD lr 0.01, momentum
0.5, 5 local epochs, the authors' ResNet settings), and HyperFL-LPM
(hypernetwork step 0.01). Scored and seeded as Table 1.

Table 3 (leakage). Each method trains `--leak-round` rounds (default 5,
the first of `--seeds`) on
`--leak-clients` clients with `--leak-samples` samples each (one batch), and
the last round's uploads are captured and attacked with what fits them (at
round 1 a freshly initialised hypernetwork generates badly scaled models,
training loss above 100 for pFedHN, which says more about the start than
about the method):
* Inverting Gradients ('ig') and ROG ('rog', Yue et al. 2023: a search in a
  low-resolution image space with its own 100 iterations, then a prior
  trained on bundled digits; the paper reports it in its appendix's Table 5)
  on FedAvg's, pFedHN's and DP-FedAvg's model deltas (pFedHN's against the
  model the server generated for the client);
* IG with the classifier unknown ('ig_body') on pFedHN-PC's, CENTAUR's and
  PPSGD's feature extractors;
* on HyperFL's hypernetwork, IG on the hypernetwork update (eq. 8,
  'ig_hyperfl') and the tailored attack (eqs. 9-10, 'tailored_hyperfl').
Every attack but ROG runs `--attack-iterations` iterations. PSNR and SSIM
of the reconstructions against the true samples (after matching), LPIPS
only where weights are given (`--lpips-weights`), and reconstructions.png:
originals, then each method's reconstructions.
The Table 4 timing ratios come from `benchmarks/hyperfl_round_time.py`.

Each run lives in OUT/<setting>/<method>/seed<S>/ (with --split:
OUT/split_<file name>/<method>/seed<S>/; Table 2: OUT/lpm/<row>/seed<S>/,
or OUT/lpm_<weights file name>/<row>/seed<S>/ with --backbone-weights) and
resumes where it stopped; row.json there caches its result. The runs
evaluate their last round only. Tables:
OUT/table1.md, OUT/table2.md, OUT/table3.md and their .csv.

  python experiments/hyperfl_tables.py                  # small: mnist5k
  python experiments/hyperfl_tables.py --dataset fashion_mnist --scale full
  python experiments/hyperfl_tables.py --dataset emnist --scale full
  python experiments/write_split.py --out split.json
  python experiments/hyperfl_tables.py --tables 1 --split split.json \\
      --methods Local-only,FedAvg,HyperFL
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse

import numpy as np

from tff_privacy import evaluate, io, provenance, runner, runtime
from tff_privacy.data import splits
from tff_privacy.metrics import report

METHODS = {  # label -> (method, method_kwargs)
    "Local-only": ("local_only", {}),
    "FedAvg": ("fedavg", {"client_learning_rate": 0.02, "client_momentum": 0.5,
                          "weight_decay": 5e-4, "local_epochs": 5}),
    "pFedHN": ("pfedhn", {}),
    "pFedHN-PC": ("pfedhn_pc", {}),
    "DP-FedAvg": ("dp_sgd_fedavg", {}),
    "CENTAUR": ("centaur", {}),
    "PPSGD": ("ppsgd", {}),
    "HyperFL": ("hyperfl", {}),
}
# Table 1 of the paper: setting -> method -> (Fashion-MNIST, EMNIST)
PAPER_TABLE1 = {
    "20 clients": {"Local-only": (85.93, 73.41), "FedAvg": (85.67, 72.77),
                   "pFedHN": (87.64, 80.86), "DP-FedAvg": (59.88, 35.12),
                   "CENTAUR": (83.07, 68.82), "PPSGD": (84.47, 71.16),
                   "HyperFL": (88.28, 76.29)},
    "100 clients": {"Local-only": (87.01, 75.68), "FedAvg": (88.11, 78.87),
                    "pFedHN": (89.80, 77.37), "DP-FedAvg": (68.29, 45.73),
                    "CENTAUR": (79.77, 67.24), "PPSGD": (82.94, 71.18),
                    "HyperFL": (90.41, 80.22)}}
# (clients, clients per round, samples per client) by scale
SETTINGS = {"small": {"20 clients": (20, 20, 150), "100 clients": (100, 30, 40)},
            "full": {"20 clients": (20, 20, 600), "100 clients": (100, 30, 600)}}
ROUNDS = {"small": 20, "full": 200}
# Table 3: label -> attacks on the method of METHODS[label]
ATTACKS = {"FedAvg": ("ig", "rog"), "pFedHN": ("ig", "rog"),
           "pFedHN-PC": ("ig_body",), "DP-FedAvg": ("ig", "rog"),
           "CENTAUR": ("ig_body",), "PPSGD": ("ig_body",),
           "HyperFL": ("ig_hyperfl", "tailored_hyperfl")}
# Table 3 of the paper, IG: (PSNR, SSIM) on EMNIST
PAPER_IG = {"FedAvg": (32.64, 0.8925), "pFedHN": (31.24, 0.8701),
            "pFedHN-PC": (28.38, 0.8713), "DP-FedAvg": (7.74, 0.2978),
            "CENTAUR": (9.52, 0.2136), "PPSGD": (9.73, 0.1889),
            "HyperFL": (7.85, 0.3010)}
MODELS = {"cifar10": "hyperfl_cnn_cifar"}
# Table 2: label -> (method, method_kwargs, lpm_resnet kwargs); the
# baselines' SGD is the authors' ResNet setting
_LPM_SGD = {"momentum": 0.5, "local_epochs": 5}
LPM_METHODS = {
    "Local-only (fixed)": ("local_only", {"learning_rate": 0.01, **_LPM_SGD},
                           {"adapters": False}),
    "Local-only (adapters)": ("local_only", {"learning_rate": 0.01, **_LPM_SGD},
                              {}),
    "FedAvg (fixed)": ("fedavg", {"client_learning_rate": 0.01,
                                  "client_momentum": 0.5, "weight_decay": 5e-4,
                                  "local_epochs": 5},
                       {"adapters": False}),
    "FedAvg (adapters)": ("fedavg", {"client_learning_rate": 0.01,
                                     "client_momentum": 0.5, "weight_decay": 5e-4,
                                     "local_epochs": 5},
                          {}),
    "HyperFL-LPM": ("hyperfl_lpm", {}, {}),
}
# Table 2 of the paper, ResNet rows: (EMNIST, CIFAR-10)
PAPER_LPM = {"Local-only (fixed)": (72.83, 68.57),
             "Local-only (adapters)": (80.35, 73.57),
             "FedAvg (fixed)": (68.99, 62.35), "FedAvg (adapters)": (75.21, 75.57),
             "HyperFL-LPM": (80.32, 75.03)}


# the methods whose clients' models after local training the runs score
# (the authors' code scores these so); the others' own models after the round
LOCAL_AFTER_TRAINING = ("local_only", "fedavg", "dp_sgd_fedavg", "centaur",
                        "ppsgd", "hyperfl", "hyperfl_lpm")
EVALUATIONS = {runner.LOCAL_AFTER_TRAINING: "local models after training",
               "global": "own models after the round"}


def _trained_row(args, out: str, title: str, row: dict, **config) -> dict:
  """The row of the runs in OUT/seed<S> for each of `args.seeds` (trained
  with `config` on the label-group split unless row.json there has it):
  `row` plus the final accuracy over seeds (`over_seeds`), epsilon and
  seconds per round."""
  evaluate = ("global" if config["method"] not in LOCAL_AFTER_TRAINING
              else runner.LOCAL_AFTER_TRAINING)
  runs = [_seed_run(args, os.path.join(out, f"seed{seed}"), f"{title}, seed {seed}",
                    dict(config, seed=seed, evaluate=evaluate))
          for seed in args.seeds]
  return {**row, "evaluation": EVALUATIONS[evaluate], **over_seeds(runs),
          "epsilon": runs[0]["epsilon"],
          "seconds_per_round": float(np.mean([r["seconds_per_round"] for r in runs]))}


def _seed_run(args, out: str, title: str, config: dict) -> dict:
  """One seed's run in `out`: the accuracy of its evaluation after the last
  round (mean, spread and minimum over clients), epsilon and seconds per
  round, cached in row.json."""
  path = os.path.join(out, "row.json")
  if os.path.exists(path):
    return io.read_json(path)
  print(title, flush=True)
  history = runner.run(runner.RunConfig(
      out=out, dataset=args.dataset, data_dir=args.data_dir,
      evaluate_every=args.rounds, **config),
      progress=not args.quiet)
  runtime.renew()  # a worker's memory grows with every run it serves
  last = history[-1]
  prefix = ("local_after_training" if config["evaluate"] == runner.LOCAL_AFTER_TRAINING
            else "personal")
  result = {**{k: last[f"{prefix}_accuracy_{k}"] for k in ("mean", "std", "min")},
            "epsilon": last.get("epsilon"),
            "seconds_per_round": sum(h["seconds"] for h in history) / len(history)}
  io.write_json(path, result)
  return result


def over_seeds(runs: list[dict]) -> dict:
  """The accuracy of one row over its seeds' `runs`: the mean and spread
  (std) of the seeds' mean accuracies, their range, and the mean over seeds
  of each seed's spread over clients and worst client."""
  means = np.array([r["mean"] for r in runs])
  return {"accuracy": float(means.mean()), "seed_std": float(means.std()),
          "seed_min": float(means.min()), "seed_max": float(means.max()),
          "client_std": float(np.mean([r["std"] for r in runs])),
          "worst_client": float(np.mean([r["min"] for r in runs])),
          "seeds": len(runs)}


def run_row(args, setting: str, label: str) -> dict:
  """Table 1's row `label` in `setting`: the label-group split drawn by the
  runner, or with `args.split` the clients of that split file, all in every
  round (`setting` is then `split_setting`'s)."""
  method, kwargs = METHODS[label]
  if getattr(args, "split", None):
    folder = "split_" + os.path.splitext(os.path.basename(args.split))[0]
    clients = dict(partition=f"file:{args.split}")
  else:
    folder = setting.replace(" ", "_")
    n, per_round, samples = SETTINGS[args.scale][setting]
    clients = dict(partition="label_groups", clients=n,
                   clients_per_round=per_round, samples_per_client=samples)
  return _trained_row(
      args, os.path.join(args.out, folder, method),
      f"{setting}: {label}", {"setting": setting, "method": label},
      method=method, method_kwargs=kwargs,
      model=MODELS.get(args.dataset, "hyperfl_cnn"), rounds=args.rounds,
      batch_size=50, **clients)


def split_setting(path: str) -> str:
  """Table 1's setting of split file `path`: 'N clients' for its N clients
  (compared with the paper's row of that name where there is one)."""
  return f"{splits.describe(path)[0]} clients"


def _lpm_folder(args) -> str:
  """Table 2's runs of one backbone: 'lpm' (the default), or 'lpm_<file>'."""
  if not args.backbone_weights:
    return "lpm"
  name = os.path.splitext(os.path.basename(args.backbone_weights))[0]
  return f"lpm_{name}"


def lpm_row(args, label: str) -> dict:
  """Table 2's row `label` (20 clients, all in every round)."""
  clients, _, samples = SETTINGS[args.scale]["20 clients"]
  method, kwargs, model_kwargs = LPM_METHODS[label]
  if args.backbone_weights:
    model_kwargs = {**model_kwargs, "backbone_weights": args.backbone_weights}
  slug = label.lower().replace(" ", "_").replace("(", "").replace(")", "")
  return _trained_row(
      args, os.path.join(args.out, _lpm_folder(args), slug),
      f"Table 2: {label}", {"method": label}, method=method,
      method_kwargs=kwargs, model="lpm_resnet", model_kwargs=model_kwargs,
      clients=clients, rounds=args.rounds, batch_size=16,
      partition="label_groups", samples_per_client=samples)


def write_lpm_table(args, rows: list[dict]) -> str:
  columns = ["method", *ACCURACY_COLUMNS, "s/round", "paper EMNIST ResNet",
             "paper CIFAR-10 ResNet"]
  backbone = args.backbone_weights or "the default backbone (pre-trained on digits)"
  lines = [f"### Table 2: HyperFL-LPM, test accuracy of the clients' models "
           f"({args.dataset}, {args.rounds} rounds, 20 clients, {backbone}, "
           f"{_seeds_text(args.seeds)})", "",
           "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for r in rows:
    lines.append("| " + " | ".join([
        r["method"], *_accuracy_cells(r), f"{r['seconds_per_round']:.1f}",
        *(f"{p:.2f}" for p in PAPER_LPM[r["method"]])]) + " |")
  text = "\n".join(lines + ["", EVALUATION_NOTE]) + "\n" + provenance.footnote(args.out)
  io.write_text(os.path.join(args.out, "table2.md"), text)
  io.write_csv(os.path.join(args.out, "table2.csv"), rows, list(rows[0]))
  return text


def leak_rows(args, label: str) -> list[dict]:
  """Table 3's rows of one method: its capture at --leak-round, each attack."""
  method, kwargs = METHODS[label]
  base = os.path.join(args.out, f"leakage_round{args.leak_round}", method)
  run = os.path.join(base, "run")
  if not os.path.exists(os.path.join(run, "updates", "manifest.json")):
    print(f"leakage: {label}", flush=True)
    runner.run(runner.RunConfig(
        out=run, method=method, method_kwargs=kwargs, dataset=args.dataset,
        model=MODELS.get(args.dataset, "hyperfl_cnn"), clients=args.leak_clients,
        rounds=args.leak_round, batch_size=args.leak_samples,
        partition="label_groups", samples_per_client=args.leak_samples,
        seed=args.seeds[0], data_dir=args.data_dir,
        capture_rounds=(args.leak_round,)), progress=False)
    runtime.renew()
  rows = []
  for attack in ATTACKS[label]:
    path = os.path.join(base, attack, "row.json")
    if not os.path.exists(path):
      result = evaluate.attack_round(
          os.path.join(run, "updates"), args.leak_round,
          os.path.join(base, attack), attack,
          attack_kwargs={} if attack == "rog" else {
              "iterations": args.attack_iterations},
          lpips_weights=args.lpips_weights, progress=not args.quiet)
      io.write_json(path, {"method": label, "attack": attack,
                           **{k: result["mean"].get(k) for k in
                              ("psnr", "ssim", "lpips", "label_accuracy")},
                           "seconds": result["seconds"]})
    rows.append(io.read_json(path))
  return rows


def write_leak_table(args, rows: list[dict]) -> str:
  columns = ["method", "attack", "PSNR", "SSIM", "LPIPS", "label acc.",
             "paper IG PSNR (EMNIST)", "paper IG SSIM (EMNIST)"]
  lines = [f"### Table 3: reconstructions from round-{args.leak_round} uploads "
           f"({args.dataset}, "
           f"{args.leak_clients} clients x {args.leak_samples} samples, "
           f"{args.attack_iterations} attack iterations)", "",
           "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for r in rows:
    # the paper's IG row; its ROG and tailored attack's are in its appendix
    paper = (PAPER_IG.get(r["method"], (None, None))
             if r["attack"] in ("ig", "ig_hyperfl", "ig_body") else (None, None))
    lines.append("| " + " | ".join([
        r["method"], r["attack"], f"{r['psnr']:.2f}", f"{r['ssim']:.4f}",
        "not computed" if r["lpips"] is None else f"{r['lpips']:.4f}",
        f"{r['label_accuracy']:.2f}",
        *("-" if p is None else f"{p:g}" for p in paper)]) + " |")
  lines += ["", "ROG runs its own 100 iterations. LPIPS needs pretrained "
            "weights (--lpips-weights)."]
  text = "\n".join(lines) + "\n" + provenance.footnote(args.out)
  io.write_text(os.path.join(args.out, "table3.md"), text)
  io.write_csv(os.path.join(args.out, "table3.csv"), rows, list(rows[0]))
  images = {}
  for r in rows:
    folder = os.path.join(args.out, f"leakage_round{args.leak_round}",
                          METHODS[r["method"]][0], r["attack"])
    with np.load(os.path.join(folder, "reconstructions.npz")) as f:
      images.setdefault("original", list(f["original"]))
      images[f"{r['method']} ({r['attack']})"] = list(f["reconstructed"])
  report.save_grid(images, os.path.join(args.out, "reconstructions.png"),
                   (0.0, 1.0), title=f"round-{args.leak_round} reconstructions "
                   f"({args.dataset})")
  return text


ACCURACY_COLUMNS = ["evaluation", "accuracy (%)", "seed std", "seed range",
                    "client std", "worst client"]
EVALUATION_NOTE = (
    "Accuracy: the mean over seeds of the mean over clients, each on its own "
    "test split, of the models the evaluation names: 'local models after "
    "training', each client's model after its local training in the last "
    "round, before aggregation (the paper's \"average test accuracy of all "
    "local models\"); 'own models after the round', each client's own model "
    "after the server's step. Seed std and range: of the seeds' accuracies; "
    "client std and worst client: over clients, averaged over seeds.")


def _accuracy_cells(r: dict) -> list[str]:
  """A row's evaluation and accuracy cells (`ACCURACY_COLUMNS`), in %."""
  return [r["evaluation"], f"{100 * r['accuracy']:.2f}",
          f"{100 * r['seed_std']:.2f}",
          f"{100 * r['seed_min']:.2f}-{100 * r['seed_max']:.2f}",
          f"{100 * r['client_std']:.2f}", f"{100 * r['worst_client']:.2f}"]


def _seeds_text(seeds: list[int]) -> str:
  return f"seeds {', '.join(str(s) for s in seeds)}"


def write_table(out: str, rows: list[dict], dataset: str, rounds: int,
                seeds: list[int], split: str | None = None) -> str:
  columns = ["setting", "method", *ACCURACY_COLUMNS, "epsilon", "s/round",
             "paper FMNIST", "paper EMNIST"]
  lines = [f"### Table 1: test accuracy of the clients' models ({dataset}, "
           f"{rounds} rounds, "
           f"{f'split file {split}' if split else 'label-group split'}, "
           f"{_seeds_text(seeds)})", "",
           "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for r in rows:
    paper = PAPER_TABLE1.get(r["setting"], {}).get(r["method"], (None, None))
    eps = r["epsilon"]
    lines.append("| " + " | ".join([
        r["setting"], r["method"], *_accuracy_cells(r),
        "-" if eps is None else f"{eps:.2f}", f"{r['seconds_per_round']:.1f}",
        *("-" if p is None else f"{p:.2f}" for p in paper)]) + " |")
  text = "\n".join(lines + ["", EVALUATION_NOTE]) + "\n" + provenance.footnote(out)
  io.write_text(os.path.join(out, "table1.md"), text)
  io.write_csv(os.path.join(out, "table1.csv"), rows, list(rows[0]))
  return text


def parse_seeds(text: str) -> list[int]:
  """'0,1,2' as [0, 1, 2]; a one-line `ValueError` unless distinct integers."""
  try:
    seeds = [int(s) for s in text.split(",") if s.strip()]
  except ValueError:
    raise ValueError(f"--seeds: {text!r}; give comma-separated integers, "
                     "e.g. 0,1,2") from None
  if not seeds or len(set(seeds)) != len(seeds):
    raise ValueError(f"--seeds: {text!r}; give one or more distinct integers, "
                     "e.g. 0,1,2")
  return seeds


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", default="mnist5k",
                      choices=("mnist5k", "fashion_mnist", "emnist", "cifar10"))
  parser.add_argument("--scale", default="small", choices=tuple(SETTINGS))
  parser.add_argument("--rounds", type=int,
                      help=f"default: {ROUNDS['small']} (small), "
                      f"{ROUNDS['full']} (full)")
  parser.add_argument("--settings",
                      help="comma-separated, from: " + ", ".join(SETTINGS["small"])
                      + " (default: both)")
  parser.add_argument("--split", help="Table 1: train on the clients of this "
                      "split file (experiments/write_split.py), all in every "
                      "round, instead of drawing the label-group split; "
                      "replaces --settings")
  parser.add_argument("--methods", default=",".join(METHODS),
                      help="comma-separated, from: " + ", ".join(METHODS))
  parser.add_argument("--tables", default="1,2,3",
                      help="comma-separated, from 1, 2, 3")
  parser.add_argument("--lpm-methods", default=",".join(LPM_METHODS),
                      help="Table 2's rows, comma-separated, from: "
                      + ", ".join(LPM_METHODS))
  parser.add_argument("--backbone-weights", help="Table 2: a backbone weights "
                      "file (default: pre-trained on bundled digits)")
  parser.add_argument("--leak-round", type=int, default=5,
                      help="the round whose uploads are attacked")
  parser.add_argument("--leak-clients", type=int, default=4)
  parser.add_argument("--leak-samples", type=int, default=4,
                      help="samples per client in the leakage runs (one batch)")
  parser.add_argument("--attack-iterations", type=int, default=2000)
  parser.add_argument("--lpips-weights", help="LPIPS weights file (optional)")
  parser.add_argument("--seeds", default="0,1,2", help="seeds of Tables 1 "
                      "and 2's runs, comma-separated; the tables give the mean "
                      "and spread over them (Table 3 runs the first)")
  parser.add_argument("--data-dir", help="tensorflow_datasets data directory "
                      "(full scale; downloads when the data set is missing)")
  parser.add_argument("--out", help="default: results/hyperfl_<dataset>_<scale>")
  parser.add_argument("--quiet", action="store_true")
  args = parser.parse_args()
  if args.split and args.settings:
    parser.error("--split: replaces --settings; give one of them")
  settings = [s.strip() for s in (args.settings or ",".join(SETTINGS["small"])
                                   ).split(",") if s.strip()]
  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  lpm_methods = [m.strip() for m in args.lpm_methods.split(",") if m.strip()]
  for given, known, flag in ((settings, SETTINGS["small"], "--settings"),
                             (methods, METHODS, "--methods"),
                             (lpm_methods, LPM_METHODS, "--lpm-methods")):
    unknown = [g for g in given if g not in known]
    if unknown or not given:
      parser.error(f"{flag}: {unknown or 'none given'}; choose from "
                   f"{', '.join(known)}")
  try:
    args.seeds = parse_seeds(args.seeds)
  except ValueError as e:
    parser.error(str(e))
  args.rounds = args.rounds or ROUNDS[args.scale]
  args.out = args.out or os.path.join("results",
                                      f"hyperfl_{args.dataset}_{args.scale}")
  tables = {t.strip() for t in args.tables.split(",") if t.strip()}
  if not tables or tables - {"1", "2", "3"}:
    parser.error(f"--tables: {sorted(tables)}; choose from 1, 2, 3")
  if args.backbone_weights and not os.path.isfile(args.backbone_weights):
    parser.error(f"--backbone-weights: {args.backbone_weights!r} is not a file")
  if args.split:
    try:
      settings = [split_setting(args.split)]
    except ValueError as e:
      parser.error(str(e))
  runtime.start()
  try:
    if "1" in tables:
      rows = [run_row(args, s, m) for s in settings for m in methods]
      print(write_table(args.out, rows, args.dataset, args.rounds, args.seeds,
                        args.split))
    if "2" in tables:
      print(write_lpm_table(args, [lpm_row(args, m) for m in lpm_methods]))
    if "3" in tables:
      rows = [r for m in methods if m in ATTACKS for r in leak_rows(args, m)]
      print(write_leak_table(args, rows))
  except ValueError as e:  # a run's configuration, refused before it starts
    parser.exit(2, f"{parser.prog}: error: {' '.join(str(e).split())}\n")
  finally:
    runtime.stop()


if __name__ == "__main__":
  main()
