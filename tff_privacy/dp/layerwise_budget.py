"""FedRE's layer-wise privacy budget (eqs. 6 and 9, Corollary 1).

A client with total budget (epsilon, delta) over T rounds and PSI scores S_l
of its L model tensors:

```text
eq. 6  epsilon_l = epsilon (1 / S_l) / sum_t (1 / S_t)
       (tensors that react more to the private region get less budget)
Corollary 1: sum_l delta_l = delta; here delta_l = delta / L (the paper
       leaves the split open; an even split is the choice, see `split_delta`)
eq. 9  sigma_l = sqrt(2 T ln(1 / delta_l)) / epsilon_l
       (layer l is clipped to C_l and gets Gaussian noise of std sigma_l
       times its sensitivity, eq. 8)
```

Zero scores. Eq. 6 divides by S_l, and a tensor whose gradient does not
react to the region at all (a layer of dead ReLUs) scores S_l = 0. Its
literal limit hands that tensor the whole budget and leaves every other
tensor epsilon_l near 0, i.e. noise without bound. Here a zero score counts
as the largest score of the client's other tensors, so such a tensor takes
the smallest share: its gradient carries nothing about the region and
nothing else to learn from, and the budget stays with the tensors that
learn. All scores zero give the even split (`layerwise_budget`).

Sensitivity. The noise std is sigma_l times the sensitivity the mechanism
assumes (`SENSITIVITIES`):
* 'sample' (FedRE's default): 2 C_l / |D_k| for a client holding |D_k|
  samples, the contribution of one sample to the client's clipped update in
  the analysis eq. 9 cites (Wei et al.), which eq. 7's "maximum
  contribution of a training sample" describes. That analysis bounds it for
  a model trained to the client's optimum; for a few local steps it is not
  proven, so an epsilon under this reading is a heuristic, labelled so.
* 'update': 2 C_l, two clipped uploads of one client as neighbours (local
  DP of the whole upload): noise std C_l sigma_l, eq. 8 as written.
Under either, a layer's Gaussian event has noise multiplier (std over
sensitivity) sigma_l times `MULTIPLIER_PER_SIGMA`: 1 for 'sample', 1/2 for
'update'.

The paper's epsilon is then sum_l epsilon_l = epsilon by simple composition
(Theorem 1). Over rounds, eq. 9 composes inside its square root, not by
adding the rounds' epsilons: it is the bound epsilon_l^2 = 2 ln(1 /
delta_l) sum_r 1 / sigma_{l,r}^2 of rounds r of noise sigma_{l,r}, T equal
ones giving eq. 9. Round r's noise, eq. 9's for that round's share
epsilon_{l,r} of a budget planned over T rounds (`paper_layer_epsilons`
recovers it from any sigma), has therefore spent, after rounds 1..t,

```text
sum_l sqrt(sum_{r <= t} epsilon_{l,r}^2 / T)    (`paper_epsilon_spent`)
```

which is epsilon sqrt(t / T) when every round splits epsilon alike (epsilon
at round T, more past it) and, by Cauchy-Schwarz, more than that when the
split changes from round to round, as the PSI split does. What
`dp_accounting` says of the same noise is `layerwise_event` composed over
rounds. Gaussian events compose like one Gaussian whose multiplier z
satisfies 1 / z^2 = sum_l 1 / (m sigma_l)^2 (m = `MULTIPLIER_PER_SIGMA`),
which gives two data-independent facts used below:

* with eq. 9 and even deltas, 1 / z^2 = sum_l epsilon_l^2 / (m^2 2 T ln(L /
  delta)) <= epsilon^2 / (m^2 2 T ln(L / delta)) whatever the scores are
  (`paper_round_multiplier_bound`);
* `calibrated_noise_multipliers` keeps eq. 9's shape sigma_l proportional to
  1 / epsilon_l but scales it so that every round is exactly the Gaussian
  event of multiplier z*, the one whose T-fold composition the RDP
  accountant prices at (epsilon, delta): the same epsilon with the least
  noise that shape allows.

Caveat, stated because the paper does not: the split is computed from the
client's private data, so the noise scale itself depends on that data. The
accountant's epsilon assumes a split fixed in advance (it holds for every
split, since the bound and the calibration do not depend on it, but not for
what the choice of split reveals).
"""

from __future__ import annotations

import math
from typing import Sequence

import dp_accounting
import numpy as np
import tensorflow as tf


SENSITIVITIES = ("sample", "update")
MULTIPLIER_PER_SIGMA = {"sample": 1.0, "update": 0.5}


def _check_budget(epsilon: float, delta: float, rounds: int) -> None:
  if not epsilon > 0 or not math.isfinite(epsilon):
    raise ValueError(f"epsilon must be a finite number > 0, got {epsilon}")
  if not 0 < delta < 1:
    raise ValueError(f"delta must lie in (0, 1), got {delta}")
  if rounds < 1:
    raise ValueError(f"rounds must be >= 1, got {rounds}")


def layerwise_budget(scores, epsilon: float) -> tf.Tensor:
  """Eq. 6: each tensor's epsilon_l from its PSI score S_l ([L] -> [L]); a
  zero score counts as the largest of the others (see the module), all
  scores 0 give the even split. Non-finite scores (a model that diverged)
  give NaN budgets, so the divergence shows in the upload and the run's
  metrics instead of hiding behind some other split. Runs on tensors inside
  graphs too."""
  scores = tf.cast(scores, tf.float32)
  top = tf.reduce_max(scores)
  raised = tf.where(scores > 0, scores, top)
  inverse = tf.where(top > 0, 1.0 / tf.where(top > 0, raised, 1.0),
                     tf.ones_like(scores))
  budget = epsilon * inverse / tf.reduce_sum(inverse)
  finite = tf.reduce_all(tf.math.is_finite(scores))
  return tf.where(finite, budget, tf.fill(tf.shape(budget), float("nan")))


def split_delta(delta: float, num_layers: int) -> float:
  """Corollary 1's delta_l: the even split delta / L (sum_l delta_l = delta)."""
  if num_layers < 1:
    raise ValueError(f"num_layers must be >= 1, got {num_layers}")
  return delta / num_layers


def paper_noise_multipliers(layer_epsilons, layer_delta: float,
                            rounds: int) -> tf.Tensor:
  """Eq. 9: sigma_l = sqrt(2 T ln(1 / delta_l)) / epsilon_l."""
  return (math.sqrt(2 * rounds * math.log(1 / layer_delta))
          / tf.cast(layer_epsilons, tf.float32))


def paper_layer_epsilons(noise_multipliers, layer_delta: float,
                         rounds: int) -> tf.Tensor:
  """Eq. 9 solved for epsilon_l: the share sqrt(2 T ln(1 / delta_l)) /
  sigma_l of a budget planned over T = `rounds` rounds that noise
  multipliers sigma_l spend in one round (eq. 9 is its own inverse)."""
  return paper_noise_multipliers(noise_multipliers, layer_delta, rounds)


def paper_epsilon_spent(layer_epsilons, planned_rounds: int) -> float:
  """The paper's epsilon spent by rounds whose tensors' shares were
  `layer_epsilons` ([rounds, L], row r: round r's epsilon_{l,r} of a budget
  planned over T = `planned_rounds`; a round the client sat out is a row
  of zeros): eq. 9 composed over the rounds per tensor, summed over tensors
  (Theorem 1), sum_l sqrt(sum_r epsilon_{l,r}^2 / T)."""
  if planned_rounds < 1:
    raise ValueError(f"planned_rounds must be >= 1, got {planned_rounds}")
  spent = np.asarray(layer_epsilons, np.float64)
  if spent.ndim != 2:
    raise ValueError("layer_epsilons must be [rounds, tensors], got shape "
                     f"{spent.shape}")
  return float(np.sqrt((spent ** 2).sum(0) / planned_rounds).sum())


def round_multiplier(epsilon: float, delta: float, rounds: int) -> float:
  """z*: the Gaussian noise multiplier whose `rounds`-fold composition the
  RDP accountant prices at exactly (epsilon, delta)."""
  _check_budget(epsilon, delta, rounds)
  return float(dp_accounting.calibrate_dp_mechanism(
      dp_accounting.rdp.RdpAccountant,
      lambda z: dp_accounting.SelfComposedDpEvent(
          dp_accounting.GaussianDpEvent(z), rounds),
      epsilon, delta))


def _per_sigma(sensitivity: str) -> float:
  if sensitivity not in SENSITIVITIES:
    raise ValueError(f"sensitivity={sensitivity!r}; choose one of {SENSITIVITIES}")
  return MULTIPLIER_PER_SIGMA[sensitivity]


def calibrated_noise_multipliers(layer_epsilons, multiplier: float,
                                 sensitivity: str = "update") -> tf.Tensor:
  """sigma_l = z* sqrt(sum_t epsilon_t^2) / (m epsilon_l) with z* =
  `multiplier` (from `round_multiplier`) and m = `MULTIPLIER_PER_SIGMA`:
  one round's layer events then compose to exactly the Gaussian event of
  multiplier z*."""
  eps = tf.cast(layer_epsilons, tf.float32)
  return multiplier * tf.norm(eps) / (_per_sigma(sensitivity) * eps)


def paper_round_multiplier_bound(epsilon: float, delta: float, rounds: int,
                                 num_layers: int, sensitivity: str = "update") -> float:
  """The smallest per-round Gaussian multiplier that eq. 9 with even deltas
  can produce, whatever the split: m sqrt(2 T ln(L / delta)) / epsilon,
  m = `MULTIPLIER_PER_SIGMA`."""
  _check_budget(epsilon, delta, rounds)
  return (_per_sigma(sensitivity)
          * math.sqrt(2 * rounds * math.log(num_layers / delta)) / epsilon)


def layerwise_event(noise_multipliers: Sequence[float],
                    sensitivity: str = "update") -> dp_accounting.DpEvent:
  """One round of per-layer Gaussian noise: layer l's event has multiplier
  m sigma_l (m = `MULTIPLIER_PER_SIGMA`: 1/2 for 'update', whose
  sensitivity is 2 C_l; 1 for 'sample', whose noise is scaled to its own)."""
  m = _per_sigma(sensitivity)
  return dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(float(s) * m) for s in noise_multipliers])

