"""FedRE's Tables 1-3 and Figs. 4-6 (Xiao et al., ICMR 2025), small
scale on offline data by default, or on the paper's data sets.

Settings (`--dataset`):
* docs (default): the paper's task, pixel-level tamper segmentation, on the
  bundled synthetic documents (`tff_privacy.data.documents`), a small U-Net,
  in the documents' protocol of `tff-privacy train --dataset docs`
  (`tff_privacy.runner.DATASET_PROTOCOLS`): 32x32 images, the paper's 10
  clients, each holding one document format (the 'groups' partition: the
  paper's data categories), 20 rounds in which clients train 2 local
  epochs of Adam at the paper's lr 0.005 with batch 16 (the paper names
  no optimizer, rounds, local steps or batch size; SGD barely moves the
  U-Net in tens of rounds here), the tampered pixels weighted 10 in the
  cross-entropy (the paper's L_CE is unweighted; with about 2% tampered
  pixels at 64x64, Central on the plain cross-entropy still predicted no
  tampered pixel after 20 rounds, F-score 0.0, against 0.29 after 10
  rounds with the weight). At 64x64, FedAvg over 8 one-format clients
  reached test F-score 0.007 in 20 rounds (Central about 0.2): there the
  U-Net marks no tampered pixel before hundreds of Adam steps (Central:
  none after 240 steps of batch 16), more than one-format clients of 64
  documents take in affordable local epochs (10 clients, 5 epochs: F-score
  0.0 after 5 rounds of about a minute each). At 32x32 Central marks them
  after 80 steps, and FedAvg in this protocol reaches test F-score 0.33
  after 20 rounds, in under 3 minutes on 2 cores.
  Every client's region is its privacy preference 'numbers' (amounts,
  phone and ID numbers: Fig. 1); scores are F-score, IoU, precision and
  recall of the tampered class. PSI is cut down to fit a CPU: 2 samples
  per client and round, 2 public samples per client for PDA-PAM, and the
  unbiased estimator over 8 sampled region pixels per sample (the paper:
  10 samples, all pixels). At 64x64, one JVP through the U-Net's gradient
  (a pixel and a channel) costs about 6 ms on 2 cores once compiled
  (`benchmarks/psi_speed.py --dataset docs`), and a client's 'numbers'
  region covers 275 to 530 pixels, so exact scores cost about 10 s per
  sample: some 40 s per client and round with the server's scoring,
  against about 2 s for the estimator.
* digits: the classification stand-in, bundled scikit-learn digits (8x8), a
  small ReLU CNN, 10 IID clients, client SGD at lr 0.05, the central box
  2,2,6,6 as every client's region, scored by test accuracy.
* doctamper, tsroie: the docs setting on the paper's data sets, read from
  `--data-dir` (`--data-kwargs`: their size, default 64, samples read,
  default DocTamper's first 1,000 per split, and the JSON file of the
  privacy-sensitive boxes, which the sets do not ship: its element classes
  must include the region's, by default 'numbers' = amount, phone,
  id_number). They have no formats, so clients hold IID shares and Table
  2's clients one random image each.
`--rounds`, `--clients`, `--client-lr`, `--region` and `--data-kwargs`
override the setting; delta is 1e-5 per client (the paper states none) and
C_l 0.15.

* Table 1 (utility, mean +- std over `--seeds`): Central (FedAvg on the
  pooled data, one client, no DP), FedAvg (the setting's clients, no DP:
  what the DP rows lose utility against) and Localset (each client alone)
  at epsilon = inf; at epsilon 50 and 10 (and, by `--table1-epsilons`, 1000
  and 10000, where utility returns): LDP-Fed (alpha-CLDP, its alpha set
  so that the basic composition of every entry over every round spends the
  same total epsilon), FedRE (its defaults: noise scaled to one sample's
  sensitivity 2 C_l / |D_k|, eq. 6 over layers, clip and noise on the
  model change, the normalised PDA-PAM rule), FedRE without PSI (even
  split), FedRE without PDA-PAM (plain mean), FedRE with eq. 11 as written,
  FedRE whose PDA-PAM weighs by score ratios (log S in eq. 10), FedRE whose
  noise the accountant calibrates to really spend epsilon, FedRE with eq. 8
  on the whole clipped update (std C_l sigma_l), FedRE clipping and noising
  the local gradient that eq. 11's eta scales (eta at the server) and FedRE
  scoring and budgeting each tensor alone (per-tensor budget). Central, FedAvg and the DP rows
  report the global model's scores, Localset the mean of each client's own
  model on its own test split.
  Every method trains with the setting's client optimizer and local
  epochs (Localset: the local-only method with the same, plus its default
  weight decay 5e-4). BLUR+LUS (Cheng et al., CVPR 2022) is not included:
  its equations and defaults could not be read here.
* Table 2 (leakage): 8 clients holding one image each (one digit, or one
  document of one format) train one round of one local SGD step, so the
  upload is the step on one image, under no defence, LDP-Fed, FedRE without
  PSI and FedRE at epsilon 50 and 10 (`--table2-epsilons`; larger ones
  where the defences leak at all), each with its budget planned for
  `--rounds` rounds (FedRE's `budget_rounds`, LDP-Fed's alpha), of which
  round 1 is run; each upload is attacked with Inverting Gradients
  (`--attack-iterations`, default 1000) and, for the defended rows, by
  every attack that knows the defence (`attacks.adaptive_attacks`: the
  noise-aware IG, which weighs each tensor by the inverse of its noise
  level), scored inside that client's region and on the whole image (MSE,
  PSNR, SSIM; LPIPS with `--lpips-weights`); a second table names each
  row's strongest attack in the region. Labels: the digit attacker
  recovers the label from the upload; the document attacker is given the
  true tamper mask (an upper bound on leakage: a segmentation mask cannot
  be recovered analytically). Fig. 4: originals, then reconstructions
  without defence and with FedRE. On the documents' U-Net these attacks
  recover nothing even without a defence (8 clients: region SSIM 0.008 +-
  0.043, image SSIM 0.07, although the upload is the true gradient, cosine
  1.0 at the true image; on client 0, 3,000 iterations, learning rate
  0.01, TV weight 1e-2, a uniform start and 300 iterations of DLG did no
  better), so there the table cannot rank the defences and says so; on
  digits the undefended upload leaks (region SSIM 0.76).
* Table 3 (the paper's Tables 3-4): FedRE at epsilon 50 for C_l in 0.25,
  0.20, 0.15, 0.07, 0.05, 0.03, beside the paper's values.
* Fig. 5: noise on the gradient against noise on the region's pixels. The
  Table 2 clients' round-1 uploads of FedRE at `--fig-epsilons` and of
  FedRE's pixel alternative (`perturbation='pixels'`, std 0.05 to 3.2) are
  attacked with `--fig5-iterations` (the paper's 2000) of Inverting
  Gradients; each epsilon is matched with the pixel std of the closest
  region SSIM, and no noise (FedAvg), the epsilon and its matched std are
  trained as in Table 1, all aggregated by the plain mean (the gradient
  arm also clips each tensor to C_l). On docs a training client's region
  is the union of its elements over all its images, so the pixel arm
  noises more of each training image than of the one-image client it was
  matched on. The documents' U-Net is not inverted even without noise
  (Table 2), so there the matching says nothing (the table prints what
  the least pixel noise leaves); on digits it does.
* Fig. 6: FedRE's primary score with PDA-PAM (eq. 11 as written, and the
  normalised rule) minus without, for 2, 5 and 10 clients at
  `--fig-epsilons` (the paper's 50 and 10).

Each run lives in OUT/<table>/<row>/ and resumes; row.json (Table 2:
ig/client_<k>/attack.json) caches its result. Tables: OUT/table1.md ...
table3.md, fig5.md, fig6.md, with .csv, fig4.png, fig5.png and fig6.png.

  python experiments/fedre_tables.py [--dataset docs|digits|doctamper|tsroie]
      [--data-dir DIR --data-kwargs JSON] [--tables 1,2,3,5,6] [--seeds 0,1]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import dataclasses
import math
from typing import Optional

import numpy as np

from tff_privacy import (attacks, data, evaluate, io, models, provenance, runner,
                         runtime)
from tff_privacy.algorithms import fedre
from tff_privacy.attacks.adaptive import defense_name
from tff_privacy.cli import json_object
from tff_privacy.data import sources
from tff_privacy.metrics import report

CLIPS = (0.25, 0.20, 0.15, 0.07, 0.05, 0.03)
FIG6_CLIENTS = (2, 5, 10)
# Fig. 6's runs: eq. 11 as written (its step grows with the number of
# clients), the normalised rule (a mean's step) and the plain mean
FIG6_AGGREGATIONS = {"pda_pam": {"aggregation": "pda_pam", "pda_pam_rule": "paper"},
                     "pda_pam_normalized": {"aggregation": "pda_pam",
                                            "pda_pam_rule": "normalized"},
                     "mean": {"aggregation": "mean"}}


@dataclasses.dataclass(frozen=True)
class Setting:
  """One data set's experiment: model, clients, training, metrics, region."""

  dataset: str
  model: tuple[str, dict]
  input_shape: tuple[int, ...]
  num_classes: int
  metrics: tuple[str, ...]   # reported; the first is the primary one
  partition: str             # of Table 1, 3 and Fig. 6's clients
  client_optimizer: str
  client_lr: float
  local_epochs: int
  region: str                # FedRE's `regions` default
  label_knowledge: str       # the Table 2 attacker's
  fedre_kwargs: dict         # FedRE settings beyond the paper's defaults
  positive_weight: float     # of tampered pixels in the cross-entropy
  clients: int               # of Table 1, 3 and Fig. 5 (--clients)
  rounds: int                # of every training run (--rounds)
  batch_size: int            # of Table 1, 3, Fig. 5 and 6's clients
  data_kwargs: dict          # the data set's options (--data-kwargs adds)

  @property
  def task(self) -> str:
    return ("segmentation" if self.dataset in sources.SEGMENTATION_DATASETS
            else "classification")


# the documents' protocol, that of `tff-privacy train --dataset docs`
_DOCS = runner.DATASET_PROTOCOLS["docs"]
_DOCS_SIZE = _DOCS.fields["data_kwargs"]["size"]
SETTINGS = {
    "docs": Setting("docs", ("unet", {"widths": [8, 16, 32]}),
                    (_DOCS_SIZE, _DOCS_SIZE, 3), 2,
                    ("f_score", "iou", "precision", "recall"),
                    _DOCS.fields["partition"],
                    _DOCS.method_kwargs["client_optimizer"],
                    _DOCS.method_kwargs["client_learning_rate"],
                    _DOCS.method_kwargs["local_epochs"], "numbers",
                    "true", {"psi_pixels": 8, "psi_samples": 2,
                             "public_samples": 2},
                    _DOCS.fields["positive_weight"], _DOCS.fields["clients"],
                    _DOCS.fields["rounds"], _DOCS.fields["batch_size"],
                    _DOCS.fields["data_kwargs"]),
    "digits": Setting("digits", ("cnn", {"filters": 8, "dense": 32}), (8, 8, 1),
                      10, ("accuracy",), "iid", "sgd", 0.05, 1, "2,2,6,6", "auto",
                      {}, 1.0, 10, 20, 16, {}),
}
# the real sets, read from --data-dir: the docs setting on their own splits
# at their own size, which have no formats, so clients hold IID shares
SETTINGS.update({name: dataclasses.replace(SETTINGS["docs"], dataset=name,
                                           partition="iid", data_kwargs={})
                 for name in ("doctamper", "tsroie")})
LDP_FED = {"clip": 0.05, "precision": 3}
# Table 1 rows at a finite epsilon: label -> fedre kwargs (None: LDP-Fed)
DP_ROWS = {"LDP-Fed": None,
           "FedRE": {},
           "FedRE w/o PSI": {"budget_split": "even"},
           "FedRE w/o PDA-PAM": {"aggregation": "mean"},
           "FedRE (eq. 11 as written)": {"pda_pam_rule": "paper"},
           "FedRE (log-score PDA-PAM)": {"pda_pam_scores": "log"},
           "FedRE (accountant noise)": {"noise_calibration": "accountant"},
           "FedRE (whole-update sensitivity)": {"sensitivity": "update"},
           "FedRE (eta at the server)": {"eta_placement": "server"},
           "FedRE (per-tensor budget)": {"budget_unit": "tensor"}}
TABLE1_METHODS = ("Central", "FedAvg", "Localset", *DP_ROWS)
# Table 1 of the paper (T-SROIE, DocTamper): (IoU, F-score)
PAPER_TABLE1 = {("inf", "Central"): ((0.721, 0.838), (0.575, 0.729)),
                ("inf", "Localset"): ((0.408, 0.585), (0.345, 0.635)),
                ("50", "LDP-Fed"): ((0.523, 0.667), (0.498, 0.682)),
                ("50", "FedRE"): ((0.601, 0.673), (0.524, 0.683)),
                ("10", "LDP-Fed"): ((0.430, 0.593), (0.424, 0.608)),
                ("10", "FedRE"): ((0.448, 0.624), (0.457, 0.645))}
# Tables 4 and 3 of the paper, FedRE at epsilon 50 by C_l: (IoU, F-score)
# on T-SROIE and on DocTamper (None: C_l not in that table)
PAPER_CLIPS = {0.25: ((0.593, 0.671), None), 0.20: ((0.601, 0.673), (0.535, 0.702)),
               0.15: ((0.322, 0.465), (0.524, 0.683)), 0.07: (None, (0.283, 0.428)),
               0.05: (None, (0.260, 0.384)), 0.03: (None, (0.000, 0.000))}
# Table 2 of the paper, SSIM in the PSI region (T-SROIE, DocTamper)
PAPER_SSIM = {("50", "LDP-Fed"): (0.937, 0.897), ("50", "FedRE"): (0.808, 0.888),
              ("10", "LDP-Fed"): (0.792, 0.768), ("10", "FedRE"): (0.676, 0.653)}


def _num_params(setting: Setting) -> int:
  spec = models.ModelSpec(setting.model[0], setting.input_shape,
                          setting.num_classes, setting.model[1], task=setting.task)
  return sum(int(np.prod(w.shape)) for w in spec.initial_weights(0))


def ldp_fed_alpha(setting: Setting, epsilon: float, rounds: int) -> float:
  """LDP-Fed's alpha whose basic composition over every entry and round is
  `epsilon` (each entry costs 2 alpha clip 10^precision per round)."""
  half_width = LDP_FED["clip"] * 10 ** LDP_FED["precision"]
  return epsilon / (rounds * _num_params(setting) * 2 * half_width)


def method_config(setting: Setting, label: str, epsilon: float, rounds: int) -> dict:
  """The RunConfig fields of a DP row whose budget covers `rounds` rounds."""
  if DP_ROWS[label] is None:
    return {"method": "fedavg", "defense": "ldp_fed",
            "defense_kwargs": {**LDP_FED, "alpha": ldp_fed_alpha(
                setting, epsilon, rounds)}}
  return {"method": "fedre", "method_kwargs": {"epsilon": epsilon,
                                               "budget_rounds": rounds,
                                               **DP_ROWS[label]}}


def _with_training(args, config: dict, optimizer: str,
                   local_epochs: int = 1) -> dict:
  """`config` with the clients' learning rate, `optimizer` and
  `local_epochs` (for fedre also the setting's PSI options)."""
  kwargs = dict(config.get("method_kwargs", {}))
  kwargs.update(client_optimizer=optimizer, local_epochs=local_epochs)
  if config["method"] in ("fedavg", "fedre"):
    kwargs["client_learning_rate"] = args.client_lr
  if config["method"] == "fedre":
    kwargs = {**args.setting.fedre_kwargs, **kwargs}
  elif config["method"] == "local_only":
    kwargs["learning_rate"] = args.client_lr
  return {**config, "method_kwargs": kwargs}


def trained(args, out: str, row: dict, **config) -> dict:
  """`row` plus the final metrics of the run in `out` (the run cached in
  row.json)."""
  path = os.path.join(out, "row.json")
  if os.path.exists(path):
    return _with_final_scores(args, io.read_json(path), out)
  print(f"{out}", flush=True)
  history = runner.run(run_config(args, out, **config), progress=not args.quiet)
  runtime.renew()  # a worker's memory grows with every run it serves
  last = history[-1]
  row = {**row, "epsilon_accountant": last.get("epsilon"),
         "epsilon_paper": last.get("paper_epsilon"),
         "seconds_per_round": sum(h["seconds"] for h in history) / len(history)}
  io.write_json(path, row)
  return _with_final_scores(args, row, out)


def run_config(args, out: str, **config) -> runner.RunConfig:
  """The RunConfig of a trained row in `out`: the setting's data, model and
  training (clients, rounds, partition, clients' optimizer, ...) with
  `config`'s fields over them."""
  setting = args.setting
  config = _with_training(args, config, setting.client_optimizer,
                          setting.local_epochs)
  if config["method"] == "fedre":
    config["method_kwargs"].setdefault("regions", args.region)
  return runner.RunConfig(
      out=out, dataset=setting.dataset, model=setting.model[0],
      model_kwargs=setting.model[1], batch_size=setting.batch_size,
      **_data(args), positive_weight=setting.positive_weight,
      **{"clients": args.clients, "rounds": args.rounds,
         "partition": setting.partition, **config})


def _with_final_scores(args, row: dict, out: str) -> dict:
  """`row` with the run's last scores, read from its metrics.json: the
  setting's metrics (of the global model, or for Localset the mean over the
  clients' own models), the last test loss (NaN or huge: the model
  diverged), its rounds whose aggregate TFF rejected as non-finite (the
  global model stayed put) and, with PDA-PAM, its rounds where it left
  every upload out as non-finite."""
  history = io.read_json(os.path.join(out, "metrics.json"))
  last = history[-1]
  row = {**row, **{m: last.get(f"test_{m}", last.get(f"personal_{m}_mean", float("nan")))
                   for m in args.setting.metrics}}
  recorded = all("server_update_rejected" in m for m in history)
  excluded = [m.get("server_aggregation/excluded_uploads") for m in history]
  return {**row, "final_test_loss": last.get("test_loss", last["personal_loss_mean"]),
          "rejected_rounds": (sum(m["server_update_rejected"] for m in history)
                              if recorded else None),
          "all_excluded_rounds": (None if None in excluded else sum(
              min(e) >= _run_clients(out) for e in excluded))}


def _run_clients(out: str) -> int:
  """The clients per round of the run in `out`."""
  config = io.read_json(os.path.join(out, "config.json"))
  return config.get("clients_per_round") or config["clients"]


def table1_rows(args) -> list[dict]:
  rows, chosen = [], args.table1_methods
  for seed in args.seeds:
    if "Central" in chosen:
      rows.append(trained(args, os.path.join(args.out, "table1", f"central_s{seed}"),
                          {"epsilon": "inf", "method": "Central", "seed": seed},
                          method="fedavg", clients=1, partition="iid", seed=seed))
    if "FedAvg" in chosen:
      rows.append(trained(args, os.path.join(args.out, "table1", f"fedavg_s{seed}"),
                          {"epsilon": "inf", "method": "FedAvg", "seed": seed},
                          method="fedavg", seed=seed))
    if "Localset" in chosen:
      rows.append(trained(args, os.path.join(args.out, "table1", f"localset_s{seed}"),
                          {"epsilon": "inf", "method": "Localset", "seed": seed},
                          method="local_only", seed=seed))
    for eps in args.table1_epsilons:
      for label in (m for m in DP_ROWS if m in chosen):
        slug = label.lower().replace(" ", "_").replace("/", "").replace("(", "").replace(")", "")
        rows.append(trained(
            args, os.path.join(args.out, "table1", f"{slug}_e{eps:g}_s{seed}"),
            {"epsilon": f"{eps:g}", "method": label, "seed": seed}, seed=seed,
            **method_config(args.setting, label, eps, args.rounds)))
  return rows


def _save(args, name: str, lines: list[str], rows: list[dict],
          csv_name: Optional[str] = None) -> str:
  """Writes OUT/<name>.md from `lines` and OUT/<csv_name or name>.csv from
  `rows`; returns the markdown."""
  text = "\n".join(lines) + "\n" + provenance.footnote(args.out)
  io.write_text(os.path.join(args.out, f"{name}.md"), text)
  io.write_csv(os.path.join(args.out, f"{csv_name or name}.csv"), rows, list(rows[0]))
  return text


def _mean_std(values) -> str:
  return f"{np.mean(values):.3f} +- {np.std(values):.3f}"


def _scores(args, mine: list[dict]) -> str:
  """'mean +- std' of each metric of the setting, ' | '-joined."""
  return " | ".join(_mean_std([r[m] for r in mine]) for m in args.setting.metrics)


def write_table1(args, rows: list[dict]) -> str:
  metrics = args.setting.metrics
  lines = [f"### Table 1 ({args.setting.dataset}): test {', '.join(metrics)}, "
           f"{args.rounds} rounds, {args.clients} clients, seeds {args.seeds}", "",
           "| epsilon | method | " + " | ".join(metrics) + " | final test loss | "
           "rejected rounds | rounds all left out | accountant epsilon | "
           "paper IoU, F (T-SROIE) | paper IoU, F (DocTamper) |",
           "|---|---|" + "---|" * len(metrics) + "---|---|---|---|---|---|"]
  keys = list(dict.fromkeys((r["epsilon"], r["method"]) for r in rows))
  summary = []
  for eps, label in keys:
    mine = [r for r in rows if (r["epsilon"], r["method"]) == (eps, label)]
    accountant = mine[0]["epsilon_accountant"]
    paper = PAPER_TABLE1.get((eps, label))
    losses = ", ".join(f"{r['final_test_loss']:.3g}" for r in mine)
    rejected, left_out = (", ".join("-" if r[key] is None else str(r[key])
                                    for r in mine)
                          for key in ("rejected_rounds", "all_excluded_rounds"))
    lines.append(f"| {eps} | {label} | {_scores(args, mine)} | {losses} | "
                 f"{rejected} | {left_out} | "
                 f"{'-' if accountant is None else f'{accountant:.3g}'} | "
                 + (" | ".join(f"{p[0]:.3f}, {p[1]:.3f}" for p in paper)
                    if paper else "- | -") + " |")
    summary.append({"epsilon": eps, "method": label, **{
        f"{m}_{stat}": fn([r[m] for r in mine]) for m in metrics
        for stat, fn in (("mean", np.mean), ("std", np.std))},
        "epsilon_accountant": accountant})
  lines += ["", "Rejected rounds (per seed): rounds whose aggregate was not "
            "finite, which TFF's finalizer refuses to apply, so the global "
            "model did not move (eq. 11 as written multiplies by e^(M - m) "
            "over the spread of the clients' scores); '-' where the run has "
            "no global model (Localset) or did not record it. Rounds all "
            "left out: rounds where PDA-PAM found no upload and score finite "
            "and kept the model where it was ('-' without PDA-PAM).",
            "", "Accountant epsilon: what dp_accounting (RDP, the row's "
            "relation: sample-level with the assumed sensitivity 2 C_l / |D_k|, "
            "a heuristic, or local DP of the whole update for the "
            "whole-update row; delta 1e-5) computes for the noise added: for FedRE with eq. 9 and "
            "the PSI split the bound over every split, for the even split and "
            "the accountant-calibrated noise the exact value; LDP-Fed's is pure "
            "DP by the basic composition theorem (delta 0), the row's epsilon "
            "by construction. Rows of one epsilon are therefore equal in the "
            "paper's accounting, not in the accountant's: compare FedRE "
            "(accountant noise) for noise that really spends the row's epsilon."]
  text = _save(args, "table1", lines, summary)
  return text


LEAKAGE_CLIENTS = 8


def table2_attacks(config: dict) -> list[str]:
  """Table 2's attacks on the uploads of a row's `config`: Inverting
  Gradients, and every attack that knows the row's defence
  (`attacks.adaptive_attacks`: for LDP-Fed and FedRE the noise-aware IG)."""
  defense = defense_name(config["method"], config.get("defense"))
  return ["ig", *(attacks.adaptive_attacks(defense) if defense else [])]


def leakage_rows(args) -> tuple[list[dict], dict]:
  """Table 2's rows (one per row and attack) and Fig. 4's images (IG's)."""
  setting = args.setting
  rows, images = [], {}
  configs = [("none", "No defence", {"method": "fedavg"})]
  for eps in args.table2_epsilons:
    for label in ("LDP-Fed", "FedRE w/o PSI", "FedRE"):
      configs.append((f"{eps:g}", label,
                      method_config(setting, label, eps, args.rounds)))
  for eps, label, config in configs:
    slug = label.lower().replace(" ", "_").replace("/", "")
    base = os.path.join(args.out, "table2", f"{slug}_e{eps}")
    for attack in table2_attacks(config):
      samples, originals, reconstructed = _leakage(
          args, base, config, args.attack_iterations, attack)
      if attack == "ig":
        images.setdefault("original", originals)
        images[f"{label} ({eps})"] = reconstructed
      rows.append({"epsilon": eps, "method": label, "attack": attack,
                   **_leakage_scores(samples)})
  return rows, images


def _leakage(args, base: str, config: dict, iterations: int, attack: str = "ig"):
  """Round 1 of `config` on Table 2's one-image clients (in `base`/run),
  each upload attacked by `attack` (`base`/<attack>/client_<k>); returns
  (per-sample scores, originals, reconstructions)."""
  setting = args.setting
  run = os.path.join(base, "run")
  if not os.path.exists(os.path.join(run, "updates", "manifest.json")):
    config = _with_training(args, config, "sgd")
    if config["method"] == "fedre":
      config["method_kwargs"].update(regions=args.region, psi_samples=1)
    print(f"{base}", flush=True)
    runner.run(runner.RunConfig(
        out=run, dataset=setting.dataset, model=setting.model[0],
        model_kwargs=setting.model[1], positive_weight=setting.positive_weight,
        clients=LEAKAGE_CLIENTS, rounds=1, batch_size=1,
        **_leakage_partition(setting), **_data(args), seed=args.seeds[0],
        capture_rounds=(1,),
        **config), progress=False)
    runtime.renew()
  samples, originals, reconstructed = [], [], []
  for client, region in enumerate(args.leakage_regions):
    out = os.path.join(base, attack, f"client_{client}")
    samples += _attacked(args, run, out, client, region, iterations,
                         attack)["samples"]
    pairs = np.load(os.path.join(out, "reconstructions.npz"))
    originals += list(pairs["original"])
    reconstructed += list(pairs["reconstructed"])
  return samples, originals, reconstructed


def _leakage_scores(samples: list[dict]) -> dict:
  m = report.mean_scores(samples)
  return {**{k: m[k] for k in ("region_mse", "region_psnr", "region_ssim",
                               "mse", "psnr", "ssim")},
          "lpips": (float(np.mean([r["lpips"] for r in samples]))
                    if "lpips" in samples[0] else None)}


def _leakage_partition(setting: Setting) -> dict:
  """One image per client: of one class (digits), one format (docs) or any
  (the real sets, which have no formats)."""
  if setting.partition == "groups":
    return {"partition": "groups", "samples_per_client": 1}
  if setting.task == "classification":
    return {"partition": "label_groups", "samples_per_client": 1}
  return {"partition": "one_per_client"}


def _data(args) -> dict:
  """The RunConfig fields that locate and shape the setting's data."""
  return {"data_dir": args.data_dir, "data_kwargs": args.data_kwargs or {}}


def _leakage_regions(args, fed: data.FederatedData) -> list[np.ndarray]:
  """Each Table 2 client's region in `fed` (Table 2's one-image clients),
  as FedRE computes it for that client; ValueError if one is not valid."""
  shape = args.setting.input_shape[:2]
  regions = fedre.client_regions(args.region, LEAKAGE_CLIENTS, *shape, data=fed)
  for region in regions:
    evaluate.region_mask(region, *shape)
  return regions


def _attacked(args, run: str, out: str, client: int, region: np.ndarray,
              iterations: int, attack: str = "ig") -> dict:
  """`attack` (an Inverting Gradients) on `client`'s round-1 upload
  (cached attack.json)."""
  cached = os.path.join(out, "attack.json")
  if os.path.exists(cached):
    return io.read_json(cached)
  return evaluate.attack_round(
      os.path.join(run, "updates"), 1, out, attack, clients=[client],
      attack_kwargs={"iterations": iterations,
                     "label_knowledge": args.setting.label_knowledge},
      lpips_weights=args.lpips_weights, region=region)


def worst_case_rows(rows: list[dict]) -> list[dict]:
  """Per Table 2 row (epsilon, method): the attack of the highest region
  SSIM, with that SSIM and IG's."""
  worst = {}
  for r in rows:
    key = (r["epsilon"], r["method"])
    if key not in worst or r["region_ssim"] > worst[key]["region_ssim"]:
      worst[key] = r
  ig = {(r["epsilon"], r["method"]): r["region_ssim"] for r in rows
        if r["attack"] == "ig"}
  return [{"epsilon": eps, "method": label, "attack": r["attack"],
           "region_ssim": r["region_ssim"], "region_ssim_ig": ig[eps, label]}
          for (eps, label), r in worst.items()]


def write_table2(args, rows: list[dict], images: dict) -> str:
  lines = [f"### Table 2 ({args.setting.dataset}): Inverting Gradients and the "
           f"attacks that know each defence ({args.attack_iterations} iterations, "
           f"labels: {args.setting.label_knowledge}) on round-1 uploads of "
           f"{LEAKAGE_CLIENTS} one-image clients; region {args.region}", "",
           "| epsilon | method | attack | region MSE | region PSNR | region SSIM | "
           "image MSE | image PSNR | image SSIM | paper region SSIM (T-SROIE, "
           "DocTamper) |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    paper = (PAPER_SSIM.get((r["epsilon"], r["method"])) if r["attack"] == "ig"
             else None)
    lines.append(f"| {r['epsilon']} | {r['method']} | {r['attack']} | "
                 f"{r['region_mse']:.4f} | {r['region_psnr']:.2f} | "
                 f"{r['region_ssim']:.4f} | {r['mse']:.4f} | {r['psnr']:.2f} | "
                 f"{r['ssim']:.4f} | "
                 + (f"{paper[0]:.3f}, {paper[1]:.3f}" if paper else "-") + " |")
  lines += ["", "Worst case in the region: the attack that recovers it best "
            "(highest region SSIM) for each row.", "",
            "| epsilon | method | strongest attack | region SSIM | IG's |",
            "|---|---|---|---|---|"]
  lines += [f"| {w['epsilon']} | {w['method']} | {w['attack']} | "
            f"{w['region_ssim']:.4f} | {w['region_ssim_ig']:.4f} |"
            for w in worst_case_rows(rows)]
  undefended = [r["region_ssim"] for r in rows if r["method"] == "No defence"]
  if undefended:
    lines += ["", f"Without a defence IG reaches region SSIM {undefended[0]:.4f}: "
              "where that is near 0, these attacks do not invert this model's "
              "uploads at all, and the defended rows cannot rank the defences."]
  lines += ["", "The paper's region SSIM (T-SROIE, DocTamper) is printed on "
            "the IG rows; Table 2 does not name its attack (Fig. 5 uses DLG). "
            "LPIPS: "
            + ("computed" if args.lpips_weights else
               "not computed (needs pretrained weights: --lpips-weights)")]
  text = _save(args, "table2", lines, rows)
  shown = {k: v for k, v in images.items()
           if k == "original" or k.startswith(("No defence", "FedRE ("))}
  report.save_grid(shown, os.path.join(args.out, "fig4.png"), (0.0, 1.0),
                   title="Fig. 4: originals, no defence, FedRE at each epsilon")
  return text


FIG5_PIXEL_NOISE = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)
FIG5_MATCH_GAP = 0.05  # region SSIMs closer than this count as matched


def _fig5_config(arm: str, level: float, rounds: int) -> dict:
  """Fig. 5's FedRE runs, all aggregated by the plain mean: 'gradient' at
  epsilon `level` (budget over `rounds`), 'pixels' with pixel noise of std
  `level`."""
  if arm == "gradient":
    kwargs = {"epsilon": level, "budget_rounds": rounds}
  else:
    kwargs = {"perturbation": "pixels", "pixel_noise": level}
  return {"method": "fedre", "method_kwargs": {**kwargs, "aggregation": "mean"}}


def fig5_rows(args) -> tuple[list[dict], list[dict]]:
  """Fig. 5: (the leakage of every noise level, the utility of each matched
  pair). Each epsilon of FedRE's gradient noise is matched with the pixel
  noise level whose Inverting Gradients region SSIM (`--fig5-iterations`)
  is closest; then no noise (FedAvg), the gradient noise and its matched
  pixel noise are trained as in Table 1. Gradient noise at
  `--fig-epsilons`."""
  levels = ([("gradient", eps) for eps in args.fig_epsilons]
            + [("pixels", std) for std in FIG5_PIXEL_NOISE])
  leakage = []
  for arm, level in levels:
    base = os.path.join(args.out, "fig5", f"leak_{arm}_{level:g}_it"
                        f"{args.fig5_iterations}_r{args.rounds}")
    samples, _, _ = _leakage(args, base, _fig5_config(arm, level, args.rounds),
                             args.fig5_iterations)
    leakage.append({"arm": arm, "level": level, **_leakage_scores(samples)})
  pixels = [r for r in leakage if r["arm"] == "pixels"]
  seed = args.seeds[0]
  plain = trained(args, os.path.join(args.out, "fig5", "train_none"),
                  {"arm": "none"}, method="fedavg", seed=seed)
  utility = []
  for grad in (r for r in leakage if r["arm"] == "gradient"):
    match = min(pixels, key=lambda r: abs(r["region_ssim"] - grad["region_ssim"]))
    row = {"epsilon": grad["level"], "pixel_noise": match["level"],
           "ssim_gradient": grad["region_ssim"], "ssim_pixels": match["region_ssim"]}
    for arm, level in (("gradient", grad["level"]), ("pixels", match["level"])):
      result = trained(args, os.path.join(args.out, "fig5", f"train_{arm}_{level:g}"),
                       {}, seed=seed, **_fig5_config(arm, level, args.rounds))
      row.update({f"{m}_{arm}": result[m] for m in args.setting.metrics})
    row.update({f"{m}_none": plain[m] for m in args.setting.metrics})
    utility.append(row)
  return leakage, utility


def write_fig5(args, leakage: list[dict], utility: list[dict]) -> str:
  import matplotlib.pyplot as plt
  metrics = args.setting.metrics
  lines = [f"### Fig. 5 ({args.setting.dataset}): noise on the gradient (FedRE) "
           "vs noise on the region's pixels", "",
           f"Leakage: Inverting Gradients ({args.fig5_iterations} iterations) on "
           f"round-1 uploads of {LEAKAGE_CLIENTS} one-image clients, scored in "
           f"each client's region ({args.region}).", "",
           "| noise | level | region SSIM | region PSNR | image SSIM |",
           "|---|---|---|---|---|"]
  lines += [f"| {r['arm']} | {'epsilon' if r['arm'] == 'gradient' else 'std'} "
            f"{r['level']:g} | {r['region_ssim']:.4f} | {r['region_psnr']:.2f} | "
            f"{r['ssim']:.4f} |" for r in leakage]
  lines += ["", f"Utility ({args.rounds} rounds, {args.clients} clients, seed "
            f"{args.seeds[0]}; all aggregated by the plain mean) of each epsilon "
            "and the pixel noise whose region SSIM is closest:", "",
            "| epsilon | pixel std | region SSIM gradient, pixels | matched | "
            + " | ".join(f"{m}: none, gradient, pixels" for m in metrics) + " |",
            "|---|---|---|---|" + "---|" * len(metrics)]
  lines += [f"| {r['epsilon']:g} | {r['pixel_noise']:g} | {r['ssim_gradient']:.4f}, "
            f"{r['ssim_pixels']:.4f} | "
            f"{'yes' if abs(r['ssim_gradient'] - r['ssim_pixels']) <= FIG5_MATCH_GAP else 'no'}"
            " | " + " | ".join(
                f"{r[f'{m}_none']:.3f}, {r[f'{m}_gradient']:.3f}, {r[f'{m}_pixels']:.3f}"
                for m in metrics) + " |" for r in utility]
  lines += ["", f"Matched: the region SSIMs differ by at most {FIG5_MATCH_GAP}; "
            "otherwise no pixel noise level of the grid leaks as little (or as "
            "much) as that gradient noise, and the row compares the closest "
            "one only. The gradient arm also clips each tensor to C_l, which "
            "the others do not."]
  least = min((r for r in leakage if r["arm"] == "pixels"), key=lambda r: r["level"])
  lines += ["", f"With the least pixel noise (std {least['level']:g}) the attack "
            f"reaches region SSIM {least['region_ssim']:.4f}: where that is near "
            "0 it does not invert this model's uploads, and the matching says "
            "nothing."]
  if args.setting.task == "segmentation":
    lines += ["", "In training a client's region is the union of its elements "
              "over all its images, larger than each image's own elements that "
              "the one-image leakage clients were matched on: the pixel arm "
              "trains with more noise than its match."]
  text = _save(args, "fig5", lines, leakage, csv_name="fig5_leakage")
  io.write_csv(os.path.join(args.out, "fig5.csv"), utility, list(utility[0]))
  fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.5),
                           squeeze=False)
  for ax, m in zip(axes[0], metrics):
    x = np.arange(len(utility))
    for i, arm in enumerate(("none", "gradient", "pixels")):
      ax.bar(x + (i - 1) * 0.27, [r[f"{m}_{arm}"] for r in utility], 0.27,
             label={"none": "no noise", "gradient": "gradient noise (FedRE)",
                    "pixels": "region pixel noise"}[arm])
    ax.set_xticks(x, [f"eps {r['epsilon']:g} / std {r['pixel_noise']:g}"
                      for r in utility])
    ax.set_ylabel(m)
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  with io.atomic_path(os.path.join(args.out, "fig5.png")) as tmp:
    fig.savefig(tmp, format="png", dpi=100)
  plt.close(fig)
  return text


def table3_rows(args) -> list[dict]:
  return [trained(args, os.path.join(args.out, "table3", f"clip{clip:g}"),
                  {"clip": clip}, method="fedre", seed=args.seeds[0],
                  method_kwargs={"epsilon": 50.0, "clip": clip})
          for clip in CLIPS]


def write_table3(args, rows: list[dict]) -> str:
  metrics = args.setting.metrics
  lines = [f"### Table 3 ({args.setting.dataset}): FedRE at epsilon 50 by C_l",
           "", "| C_l | " + " | ".join(metrics) + " | final test loss | paper "
           "IoU, F (T-SROIE) | paper IoU, F (DocTamper) |",
           "|---|" + "---|" * len(metrics) + "---|---|---|"]
  lines += [f"| {r['clip']:.2f} | " + " | ".join(f"{r[m]:.3f}" for m in metrics)
            + f" | {r['final_test_loss']:.3g} | "
            + " | ".join("-" if p is None else f"{p[0]:.3f}, {p[1]:.3f}"
                         for p in PAPER_CLIPS[r["clip"]]) + " |" for r in rows]
  lines += ["", "The paper's Table 4 (T-SROIE) also has C_l 0.14 (IoU 0.311, "
            "F 0.435) and 0.13 (0, 0); its runs have 10 clients."]
  text = _save(args, "table3", lines, rows)
  return text


def fig6_rows(args) -> list[dict]:
  rows = []
  for eps in args.fig_epsilons:
    for clients in FIG6_CLIENTS:
      accs = {}
      for name, kwargs in FIG6_AGGREGATIONS.items():
        accs[name] = trained(
            args, os.path.join(args.out, "fig6", f"{name}_e{eps:g}_k{clients}"),
            {}, method="fedre", clients=clients, seed=args.seeds[0],
            method_kwargs={"epsilon": eps, **kwargs})[args.setting.metrics[0]]
      rows.append({"epsilon": eps, "clients": clients, **accs,
                   "gain_paper": accs["pda_pam"] - accs["mean"],
                   "gain_normalized": accs["pda_pam_normalized"] - accs["mean"]})
  return rows


def write_fig6(args, rows: list[dict]) -> str:
  import matplotlib.pyplot as plt
  metric = args.setting.metrics[0]
  lines = [f"### Fig. 6 ({args.setting.dataset}): {metric} gain of PDA-PAM "
           "over the plain mean", "",
           "| epsilon | clients | PDA-PAM (eq. 11) | PDA-PAM (normalized) | mean "
           "| gain eq. 11 | gain normalized |", "|---|---|---|---|---|---|---|"]
  lines += [f"| {r['epsilon']:g} | {r['clients']} | {r['pda_pam']:.3f} | "
            f"{r['pda_pam_normalized']:.3f} | {r['mean']:.3f} | "
            f"{r['gain_paper']:+.3f} | {r['gain_normalized']:+.3f} |" for r in rows]
  lines += ["", "Eq. 11's step is at least K times a mean's, so its gain mixes "
            "the aggregation weights with a K-fold larger server step; the "
            "normalized rule keeps a mean's step."]
  text = _save(args, "fig6", lines, rows)
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for eps in dict.fromkeys(r["epsilon"] for r in rows):
    mine = [r for r in rows if r["epsilon"] == eps]
    for key, style in (("gain_paper", "o-"), ("gain_normalized", "s--")):
      ax.plot([r["clients"] for r in mine], [r[key] for r in mine], style,
              label=f"epsilon {eps:g}, {key[5:]}")
  ax.axhline(0, color="grey", lw=0.5)
  ax.set_xlabel("clients")
  ax.set_ylabel(f"{metric} gain of PDA-PAM")
  ax.legend()
  fig.tight_layout()
  with io.atomic_path(os.path.join(args.out, "fig6.png")) as tmp:
    fig.savefig(tmp, format="png", dpi=100)
  plt.close(fig)
  return text


def _epsilons(text: str) -> Optional[list[float]]:
  """The comma-separated epsilons of `text`; None unless every one is a
  finite number > 0 and there is one at least."""
  try:
    epsilons = [float(e) for e in text.split(",") if e.strip()]
  except ValueError:
    return None
  if not epsilons or min(epsilons) <= 0 or not all(map(math.isfinite, epsilons)):
    return None
  return epsilons


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", choices=sorted(SETTINGS), default="docs",
                      help="docs: the synthetic documents (default); digits: "
                      "the classification stand-in; doctamper, tsroie: the "
                      "paper's sets from --data-dir")
  parser.add_argument("--tables", default="1,2,3,5,6",
                      help="comma-separated, from 1, 2, 3, 5 (Fig. 5), 6 (Fig. 6)")
  parser.add_argument("--seeds", default="0,1", help="Table 1's seeds")
  parser.add_argument("--rounds", type=int, help="rounds of every training "
                      "run (default: the setting's, 20)")
  parser.add_argument("--clients", type=int, help="Table 1 and 3's clients "
                      "(default: the setting's, 10)")
  parser.add_argument("--table1-epsilons", default="50,10,1000,10000",
                      help="Table 1's finite epsilons (the paper's 50 and 10, "
                      "then larger ones that show where utility returns)")
  parser.add_argument("--table2-epsilons", default="50,10",
                      help="Table 2's epsilons (the paper's 50 and 10; larger "
                      "ones where the defences leak at all, to compare them)")
  parser.add_argument("--fig-epsilons", default="50,10",
                      help="Figs. 5 and 6's epsilons (the paper's 50 and 10)")
  parser.add_argument("--table1-methods", default=",".join(TABLE1_METHODS),
                      help="Table 1's rows, comma-separated (default: all)")
  parser.add_argument("--client-lr", type=float,
                      help="clients' learning rate (default: the document sets "
                      "0.005 with Adam, digits 0.05 with SGD)")
  parser.add_argument("--region", help="FedRE's regions (default: the "
                      "document sets 'numbers', digits '2,2,6,6')")
  parser.add_argument("--attack-iterations", type=int, default=1000)
  parser.add_argument("--fig5-iterations", type=int, default=2000,
                      help="attack iterations of Fig. 5's matching (the paper's 2000)")
  parser.add_argument("--lpips-weights", help="LPIPS weights file (optional)")
  parser.add_argument("--out", help="default: results/fedre_<dataset>")
  parser.add_argument("--data-dir", help="the folder of doctamper's LMDB "
                      "splits or tsroie's train/ and test/")
  parser.add_argument("--data-kwargs", type=json_object, help="the data set's "
                      "options as JSON, e.g. '{\"regions\": \"boxes.json\", "
                      "\"size\": 64}' (see tff-privacy train --help), over "
                      "the setting's (docs: size 32)")
  parser.add_argument("--quiet", action="store_true")
  args = parser.parse_args()
  args.setting = setting = SETTINGS[args.dataset]
  args.data_kwargs = {**setting.data_kwargs, **(args.data_kwargs or {})}
  if setting.task == "segmentation":  # the images' side is a data option
    try:
      size = sources.resolve_data_kwargs(args.dataset, args.data_kwargs)["size"]
    except ValueError as e:
      parser.error(f"--data-kwargs: {e}")
    args.setting = setting = dataclasses.replace(setting, input_shape=(size, size, 3))
  args.clients = setting.clients if args.clients is None else args.clients
  args.rounds = setting.rounds if args.rounds is None else args.rounds
  args.client_lr = args.client_lr or setting.client_lr
  args.region = args.region or setting.region
  args.out = args.out or os.path.join("results", f"fedre_{args.dataset}")
  tables = {t.strip() for t in args.tables.split(",") if t.strip()}
  if not tables or tables - {"1", "2", "3", "5", "6"}:
    parser.error(f"--tables: {sorted(tables)}; choose from 1, 2, 3, 5, 6")
  try:
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
  except ValueError:
    parser.error(f"--seeds: {args.seeds!r}; give comma-separated integers")
  for flag in ("table1_epsilons", "table2_epsilons", "fig_epsilons"):
    epsilons = _epsilons(getattr(args, flag))
    if epsilons is None:
      parser.error(f"--{flag.replace('_', '-')}: {getattr(args, flag)!r}; give "
                   "comma-separated finite numbers > 0")
    setattr(args, flag, epsilons)
  args.table1_methods = [m.strip() for m in args.table1_methods.split(",")
                         if m.strip()]
  if not args.table1_methods or set(args.table1_methods) - set(TABLE1_METHODS):
    parser.error(f"--table1-methods: {args.table1_methods}; choose from "
                 f"{', '.join(TABLE1_METHODS)}")
  if not args.seeds or args.rounds < 1 or not args.client_lr > 0 or \
      args.attack_iterations < 1 or not math.isfinite(args.client_lr) or \
      args.clients < 1 or args.fig5_iterations < 1:
    parser.error("--seeds must not be empty; --rounds, --clients, --client-lr, "
                 "--attack-iterations and --fig5-iterations must be > 0")
  try:  # also checks the data set's files and options
    fed = data.load(setting.dataset, LEAKAGE_CLIENTS, seed=args.seeds[0],
                    **_leakage_partition(setting), **_data(args))
  except ValueError as e:
    parser.error(f"--dataset {args.dataset} (--data-dir, --data-kwargs): "
                 f"{' '.join(str(e).split())}")
  try:
    args.leakage_regions = _leakage_regions(args, fed)
  except ValueError as e:
    parser.error(f"--region: {' '.join(str(e).split())}")
  runtime.start()
  try:
    if "1" in tables:
      print(write_table1(args, table1_rows(args)))
    if "2" in tables:
      print(write_table2(args, *leakage_rows(args)))
    if "3" in tables:
      print(write_table3(args, table3_rows(args)))
    if "5" in tables:
      print(write_fig5(args, *fig5_rows(args)))
    if "6" in tables:
      print(write_fig6(args, fig6_rows(args)))
  except ValueError as e:
    parser.exit(2, f"{parser.prog}: error: {' '.join(str(e).split())}\n")
  finally:
    runtime.stop()


if __name__ == "__main__":
  main()
