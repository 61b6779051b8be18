"""The built-in grids: `compact` (`make demo`: each entry at its default
strength only, to keep near ten minutes on 2 cores: 578 s with 16 victims
a row in a worktree), `cnn` (the same under a small CNN at batches of 1
and 8, each attack for 1000 iterations, where Inverting Gradients
converges on a CNN's uploads), and `full` (three or four strengths of
each defence, more rounds, clients and shadow samples, each attack for
the iterations at which its source reports results, HyperFL's baselines,
every row under all three protocols and with 3 seeds). All
attack 16 victims a row; `cnn` and `full` run each DP entry once more at
the strength that spends epsilon 8 at delta 1e-5 (`equal_epsilon`), which
`compact` leaves to `--equal-epsilon 8` to keep near its ten minutes.

`compact` is the analytic regime: an MLP trained on batch-1 gradients,
whose first dense layer's gradient hands the image over exactly. The
protocol of gradient-inversion papers and of the defences' own
evaluations is a CNN at batches of 1 to 8: `cnn` and `full` run it. Its
CNN is `models.builders.cnn` (ReLU, two conv-maxpool blocks): DLG's
sigmoid LeNet with its U(-0.5, 0.5) initialisation stays at chance (test
accuracy 0.50 at batch 1, 0.57 at batch 8) after the compact protocol's 20
FedSGD rounds at learning rate 0.2, where this CNN reaches 0.75 and 0.73.

The data set is mnist5k_parity, the bundled MNIST digits with the task
digit >= 5 and parity as the sensitive attribute, so that image
reconstruction and attribute inference judge every row on the same
uploads. FedSGD-style entries upload one batch's gradient; FedAvg-style
ones a local epoch's delta over the client's samples, the leakage their
own protocol exposes.
"""

from __future__ import annotations

import copy

from tff_privacy.leaderboard.grid import SOURCE_ITERATIONS

_REGION = "7,7,21,21"  # FedRE's privacy-sensitive region: the digit's centre
# plain SGD on 15-20 single-image gradients a step reaches about 0.8 test
# accuracy in 20 steps at 0.2 (0.5 and above diverge on some seeds)
_FEDSGD = {"server_learning_rate": 0.2}

_ENTRIES = [
    {"name": "FedSGD", "method": "fedsgd", "method_kwargs": _FEDSGD},
    # rows start in this order, two at a time: after the reference, the
    # slowest first, so that both processes finish near together (the
    # compact grid's 13 rows: 578 s in the order FedSGD, the papers',
    # FedEM, FedAvg, the classic defences, DP-FedAvg last, which kept one
    # process alone for its last 78 s)
    # HyperFL trains 1 + 5 local epochs each round: at batch 1 that is 120
    # steps per client, so it trains on batches of 10
    {"name": "HyperFL", "method": "hyperfl", "attacks": ["ig_hyperfl", "tailored_hyperfl"],
     "protocol": {"batch_size": 10}},
    {"name": "FedRE", "method": "fedre",
     "method_kwargs": {"regions": _REGION, "psi_samples": 2, "psi_pixels": 8,
                       "public_samples": 2, "client_learning_rate": 0.05},
     "sweep": {"epsilon": [50.0]}, "default": 50.0},
    {"name": "RECUP-FL", "method": "fedsgd", "method_kwargs": _FEDSGD,
     "defense": "recupfl",
     "defense_kwargs": {"protect": "parity", "zoo_size": 5, "zoo_epochs": 5,
                        "shadow_samples": 200, "zoo_refresh": 5},
     "sweep": {"perturbation_budget": [0.001]}, "default": 0.001},
    {"name": "FedAvg", "method": "fedavg", "method_kwargs": {"client_learning_rate": 0.05}},
    {"name": "DP-FedAvg", "method": "fedavg", "method_kwargs": {"client_learning_rate": 0.05},
     "defense": "dp_fedavg", "defense_kwargs": {"clip": 1.0},
     "sweep": {"noise_multiplier": [1.0]}, "default": 1.0},
    {"name": "FedEM", "method": "fedem", "method_kwargs": _FEDSGD,
     "sweep": {"rho_max": [8 / 255]}, "default": 8 / 255},
    {"name": "LDP-Fed", "method": "fedsgd", "method_kwargs": _FEDSGD,
     "defense": "ldp_fed", "sweep": {"alpha": [1.0]}, "default": 1.0},
    {"name": "Soteria", "method": "fedsgd", "method_kwargs": _FEDSGD,
     "defense": "soteria", "sweep": {"p": [0.8]}, "default": 0.8},
    {"name": "Sparsification", "method": "fedsgd",
     "method_kwargs": _FEDSGD, "defense": "sparsification",
     "sweep": {"p": [0.9]}, "default": 0.9},
    {"name": "LDP Laplace", "method": "fedsgd", "method_kwargs": _FEDSGD,
     "defense": "ldp_laplace", "defense_kwargs": {"clip": 1.0},
     "sweep": {"noise_multiplier": [0.1]}, "default": 0.1},
    {"name": "LDP Gaussian", "method": "fedsgd", "method_kwargs": _FEDSGD,
     "defense": "ldp_gaussian", "defense_kwargs": {"clip": 1.0},
     "sweep": {"noise_multiplier": [0.1]}, "default": 0.1},
    {"name": "DP clip", "method": "fedsgd", "method_kwargs": _FEDSGD,
     "defense": "dp_clip", "sweep": {"clip": [1.0]}, "default": 1.0},
]

COMPACT = {
    "protocol": {"dataset": "mnist5k_parity", "model": "mlp",
                 "model_kwargs": {"hidden": [64]}, "clients": 200,
                 # 16 clients a round, the 16 victims (not 20): the grid's
                 # time
                 "clients_per_round": 16, "rounds": 20, "batch_size": 1, "seed": 0,
                 # a killed row trains again from its start (about a minute)
                 "evaluate_every": 20, "checkpoint_every": 20},
    "attacks": {"inversion": ["ig"], "iterations": 300, "victims": 16,
                "attribute": "parity", "shadow_samples": 100},
    "reference": "FedSGD",
    "utility_target": 0.9,
    # no equal-epsilon rows, so that `make demo` keeps near ten minutes;
    # `--equal-epsilon 8` adds them (`full` and `cnn` have them)
    "equal_epsilon": None,
    "entries": _ENTRIES,
}

# the DP entries once more, each calibrated to spend epsilon 8 at delta 1e-5
_EQUAL_EPSILON = {"epsilon": 8.0, "delta": 1e-5}

_FULL_SWEEPS = {
    "FedEM": [4 / 255, 8 / 255, 16 / 255, 32 / 255],
    "FedRE": [10.0, 50.0, 1000.0, 10000.0],
    "RECUP-FL": [0.0001, 0.001, 0.01, 0.1],
    "LDP Gaussian": [0.001, 0.01, 0.1, 1.0],
    "LDP Laplace": [0.001, 0.01, 0.1, 1.0],
    "DP clip": [0.01, 0.1, 1.0],
    "Sparsification": [0.5, 0.9, 0.99],
    "Soteria": [0.5, 0.8, 0.95],
    "LDP-Fed": [1.0, 10.0, 100.0],
    "DP-FedAvg": [0.1, 0.5, 1.0, 2.0],
}


def _full() -> dict:
  grid = copy.deepcopy(COMPACT)
  grid["equal_epsilon"] = copy.deepcopy(_EQUAL_EPSILON)
  grid["protocol"].update(rounds=50, clients=500, clients_per_round=50,
                          checkpoint_every=5)
  grid["attacks"].update(inversion=["idlg", "ig"], iterations=SOURCE_ITERATIONS,
                         shadow_samples=1000)
  for entry in grid["entries"]:
    if entry["name"] in _FULL_SWEEPS:
      entry["sweep"] = {next(iter(entry["sweep"])): _FULL_SWEEPS[entry["name"]]}
    if entry["name"] == "RECUP-FL":
      entry["defense_kwargs"].update(zoo_size=20, zoo_epochs=20, shadow_samples=1000,
                                     zoo_refresh=1)
    if entry["name"] == "FedRE":
      entry["method_kwargs"].update(psi_samples=10, psi_pixels=None, public_samples=10)
  grid["entries"] += [
      {"name": "pFedHN", "method": "pfedhn", "attacks": ["ig"]},
      {"name": "DP-SGD FedAvg", "method": "dp_sgd_fedavg",
       "sweep": {"noise_multiplier": [0.5, 1.0]}, "default": 1.0},
  ]
  grid["protocols"] = [copy.deepcopy(_ANALYTIC), *copy.deepcopy(_CNN)]
  grid["seeds"] = 3
  return grid


_ANALYTIC = {"name": "MLP, batch 1", "model": "mlp", "model_kwargs": {"hidden": [64]},
             "batch_size": 1}
_CNN = [{"name": f"CNN, batch {b}", "model": "cnn", "model_kwargs": {},
         "batch_size": b} for b in (1, 8)]


# Inverting Gradients on FedSGD's CNN uploads at batch 1 (the `cnn` grid's
# reference row, seed 0, 16 victims): mean SSIM at a quarter, a half and
# all of 300 iterations 0.543, 0.625, 0.666 (still rising, 0.042 over the
# last half: `attack_converged` false); of 1000: 0.677, 0.709, 0.722 (0.013,
# converged); of 2000: 0.707, 0.742, 0.748
_CNN_ITERATIONS = 1000


def _cnn() -> dict:
  grid = copy.deepcopy(COMPACT)
  grid["equal_epsilon"] = copy.deepcopy(_EQUAL_EPSILON)
  grid["attacks"]["iterations"] = _CNN_ITERATIONS
  grid["protocols"] = copy.deepcopy(_CNN)
  return grid


GRIDS = {"compact": COMPACT, "cnn": _cnn(), "full": _full()}


def grid(scale: str) -> dict:
  """The built-in grid `scale` (one of `GRIDS`), as JSON data."""
  if scale not in GRIDS:
    raise ValueError(f"scale={scale!r}; choose one of {', '.join(GRIDS)}")
  return copy.deepcopy(GRIDS[scale])
