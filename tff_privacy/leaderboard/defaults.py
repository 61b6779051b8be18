"""The built-in grids: `compact` (`make demo`: each entry at its default
strength only, to keep within ten minutes on 2 cores: 270 s with 16
victims a row in a worktree, 578 s on a machine half as fast), `cnn` (the same under a small CNN at batches of 1
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

The entries come from the registries when a grid is asked for: every
method and defense that declares a `tff_privacy.listing.Listing` (its
label, strengths, fixed parameters and protocol changes), a user's
included, the reference FedSGD first, then the slowest rows first.

The data set is mnist5k_parity, the bundled MNIST digits with the task
digit >= 5 and parity as the sensitive attribute, so that image
reconstruction and attribute inference judge every row on the same
uploads. FedSGD-style entries upload one batch's gradient; FedAvg-style
ones a local epoch's delta over the client's samples, the leakage their
own protocol exposes.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from tff_privacy.leaderboard.grid import SOURCE_ITERATIONS
from tff_privacy.listing import Listing
from tff_privacy.registry import DEFENSES, METHODS

REFERENCE = "fedsgd"  # the method every row is compared with

_COMPACT_PROTOCOL = {
    "dataset": "mnist5k_parity", "model": "mlp", "model_kwargs": {"hidden": [64]},
    # 16 clients a round, the 16 victims (not 20): the grid's time
    "clients": 200, "clients_per_round": 16, "rounds": 20, "batch_size": 1,
    "seed": 0,
    # a killed row trains again from its start (about a minute)
    "evaluate_every": 20, "checkpoint_every": 20}
_COMPACT_ATTACKS = {"inversion": ["ig"], "iterations": 300, "victims": 16,
                    "attribute": "parity", "shadow_samples": 100}

# the DP entries once more, each calibrated to spend epsilon 8 at delta 1e-5
_EQUAL_EPSILON = {"epsilon": 8.0, "delta": 1e-5}

# Inverting Gradients on FedSGD's CNN uploads at batch 1 (the `cnn` grid's
# reference row, seed 0, 16 victims): mean SSIM at a quarter, a half and
# all of 300 iterations 0.543, 0.625, 0.666 (still rising, 0.042 over the
# last half: `attack_converged` false); of 1000: 0.677, 0.709, 0.722 (0.013,
# converged); of 2000: 0.707, 0.742, 0.748
_CNN_ITERATIONS = 1000

_ANALYTIC = {"name": "MLP, batch 1", "model": "mlp", "model_kwargs": {"hidden": [64]},
             "batch_size": 1}
_CNN = [{"name": f"CNN, batch {b}", "model": "cnn", "model_kwargs": {},
         "batch_size": b} for b in (1, 8)]


def _listed() -> list[tuple[Listing, str, Optional[str]]]:
  """(listing, method, defense) of every registered method and defense
  that declares a listing."""
  out = [(m.listing, name, None) for name, m in METHODS.items()
         if getattr(m, "listing", None) is not None]
  for name, cls in DEFENSES.items():
    # its own: a subclass of a listed defense is not listed twice
    listing = vars(cls).get("LISTING")
    if listing is not None:
      if listing.method not in METHODS or METHODS[listing.method].listing is None:
        raise ValueError(f"defense {name!r}: its listing's method="
                         f"{listing.method!r} is not a listed method")
      out.append((listing, listing.method, name))
  return out


def entry(listing: Listing, method: str, defense: Optional[str],
          scale: str) -> dict[str, Any]:
  """The grid entry of a listed method (`defense` None) or defense at
  `scale`."""
  own = listing.parameters(scale)
  method_kwargs = own if defense is None else METHODS[method].listing.parameters(scale)
  out: dict[str, Any] = {"name": listing.label, "method": method}
  if method_kwargs:
    out["method_kwargs"] = copy.deepcopy(method_kwargs)
  if defense is not None:
    out["defense"] = defense
    if own:
      out["defense_kwargs"] = copy.deepcopy(own)
  if listing.parameter is not None:
    out["sweep"] = {listing.parameter: listing.strengths(scale)}
    out["default"] = listing.default
  if listing.protocol:
    out["protocol"] = copy.deepcopy(listing.protocol)
  if listing.attacks:
    out["attacks"] = list(listing.attacks)
  return out


def entries(scale: str) -> list[dict[str, Any]]:
  """The entries of the built-in grid `scale`: the reference first, then
  the slowest first (rows start in this order, two at a time, so that both
  processes finish near together).

  Raises:
    ValueError: two listings share a label, or a defense's listing names a
      method that is not listed.
  """
  listed = [x for x in _listed() if scale in x[0].scales]
  labels = [x[0].label for x in listed]
  twice = sorted({label for label in labels if labels.count(label) > 1})
  if twice:
    raise ValueError(f"listings share the labels {twice}; each entry needs its own")
  listed.sort(key=lambda x: (x[1] != REFERENCE or x[2] is not None,
                             -x[0].seconds))
  return [entry(*x, scale) for x in listed]


def _compact() -> dict:
  return {
      "protocol": copy.deepcopy(_COMPACT_PROTOCOL),
      "attacks": copy.deepcopy(_COMPACT_ATTACKS),
      "reference": METHODS[REFERENCE].listing.label,
      "utility_target": 0.9,
      # no equal-epsilon rows, so that `make demo` keeps near ten minutes;
      # `--equal-epsilon 8` adds them (`full` and `cnn` have them)
      "equal_epsilon": None,
      "entries": entries("compact"),
  }


def _cnn() -> dict:
  grid = _compact()
  grid["entries"] = entries("cnn")
  grid["equal_epsilon"] = copy.deepcopy(_EQUAL_EPSILON)
  grid["attacks"]["iterations"] = _CNN_ITERATIONS
  grid["protocols"] = copy.deepcopy(_CNN)
  return grid


def _full() -> dict:
  grid = _compact()
  grid["entries"] = entries("full")
  grid["equal_epsilon"] = copy.deepcopy(_EQUAL_EPSILON)
  grid["protocol"].update(rounds=50, clients=500, clients_per_round=50,
                          checkpoint_every=5)
  grid["attacks"].update(inversion=["idlg", "ig"], iterations=SOURCE_ITERATIONS,
                         shadow_samples=1000)
  grid["protocols"] = [copy.deepcopy(_ANALYTIC), *copy.deepcopy(_CNN)]
  grid["seeds"] = 3
  return grid


SCALES = {"compact": _compact, "cnn": _cnn, "full": _full}


def grid(scale: str) -> dict:
  """The built-in grid `scale` (one of `SCALES`), as JSON data, from the
  listings registered now."""
  if scale not in SCALES:
    raise ValueError(f"scale={scale!r}; choose one of {', '.join(SCALES)}")
  return SCALES[scale]()
