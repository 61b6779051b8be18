"""FedRE (Xiao et al., ICMR 2025): layer-wise local DP from PSI scores, with
PDA-PAM aggregation on a public set.

Round t (Algorithm 1): the server broadcasts w~; client k
1. trains locally as in FedAvg (`local_epochs` passes of SGD, or Adam by
   `client_optimizer`, at `client_learning_rate` eta, the paper's lr 0.005)
   and forms its local gradient g = (w~ - w^k) / eta, the sum of its steps
   (TFF's sign convention);
2. scores every model tensor l by PSI (eqs. 3-5, `tff_privacy.psi`) on
   `psi_samples` of its samples (the paper averages 10 per data format) with
   its own privacy-sensitive region, under the broadcast model w~;
3. splits its budget (epsilon, delta): epsilon_l by eq. 6 (`budget_split=
   'psi'`; 'even' is FedRE without PSI; a zero score takes the smallest
   share, see `tff_privacy.dp.layerwise_budget`) over the model's layers
   (`budget_unit`, below), delta_l = delta / L per tensor (Corollary 1
   leaves the split open);
4. clips tensor l of g to C_l = `clip` (eq. 7) and adds Gaussian noise of
   std sigma_l times the sensitivity (eq. 8) through
   `tff_privacy.dp.LayerwiseGaussianQuery`, sigma_l from eq. 9
   (`noise_calibration='paper'`) or scaled so that the RDP accountant prices
   T rounds at exactly (epsilon, delta) ('accountant'), and uploads the
   result times eta, i.e. in the model's units.
The server aggregates by PDA-PAM (eqs. 10-11, `tff_privacy.aggregation`)
with the uploads' PSI scores on public samples and the same regions
(`aggregation='mean'` is FedRE without PDA-PAM) and applies w = w~ -
server_learning_rate * aggregate (1: eq. 11's eta is already in the
uploads).

Sensitivity (`sensitivity`, see `tff_privacy.dp.layerwise_budget`): the
paper's eq. 8 reads "variance C_l^2 sigma_l^2", while eq. 7 calls C_l the
largest contribution of one training sample and eq. 9 cites an analysis
(Wei et al.) whose noise is scaled to the sensitivity 2 C_l / |D_k| of the
clipped update to one of the client's |D_k| samples. 'sample' (default)
follows the cited source: std 2 C_l sigma_l / |D_k|; its epsilon is the
paper's heuristic (proven there for a client's optimum, not for a few local
steps) and a run labels it so in `privacy_guarantee`. 'update' is eq. 8 on
the whole clipped update, std C_l sigma_l: local DP of each upload, which
on the documents leaves a signal-to-noise ratio near 0.002 per client and
round whatever the client's data size.

Layers (`budget_unit`): the paper scores and budgets "the l-th layer".
'layer' (default) scores a Keras layer's tensors together (eq. 4's norm
over the kernel's and the bias's entries, `psi.layer_groups`), splits
epsilon over the layers by eq. 6 and gives each tensor of a layer an equal
part of the layer's epsilon_l; clipping and noise stay per tensor. 'tensor'
scores and budgets every tensor alone. A tensor's score grows with its
number of entries, so per tensor eq. 6 hands most of the budget to the
biases: on the documents' U-Net at the start, biases score 1e-5 and kernels
1e-3, and the kernels get sigma_l of 77 to 473 against 10.6 for the even
split (the model then diverges).

Where eta acts (`eta_placement`): 'client' (default) clips and noises the
model change w~ - w^k itself, so C_l bounds how far a tensor moves in a
round. 'server' reads eq. 11 literally: clip and noise the local gradient
(model change / eta), which eq. 11's eta then scales (in the model's units
the clip is eta C_l and the noise eta times its std). With SGD the two
differ only by the units of C_l; with Adam, whose steps have a size near
eta per weight whatever the gradient, 'server' bounds a tensor's move to
eta C_l = 7.5e-4 per round: on the documents' protocol FedRE then learns
nothing even without noise (F 0.000 after 20 rounds, against 0.237 with
'client' and 0.241 for FedAvg, in a plain-TensorFlow replica of the round).

Fig. 5's alternative (`perturbation='pixels'`): instead of steps 2-4, the
client adds Gaussian noise of standard deviation `pixel_noise` to the
pixels of its region in every training image and uploads its update as it
is. The paper says only that noise is infused into the regions of each
image; here it is drawn once per image (seeded by the run's seed and the
image's content, so every pass and round sees the same noisy copy, as a
sanitised data set would) and not clipped to the pixel range. No DP
guarantee is claimed for it, so such runs report no epsilon.

DP-SGD instead (`noise_on='steps'`): step 4 moves into the local steps.
The client trains by SGD at eta on Poisson batches (every sample joins a
step's batch with probability q = batch size / |D_k|, `local_dp_sgd`); at
each step every example's gradient of tensor l is clipped to C_l, the
batch's sum gets Gaussian noise of std C_l sigma_l and is divided by the
expected batch size. Eq. 6 splits the budget on the round's PSI scores as
in step 3 (once per round, before the steps, under the broadcast model);
sigma_l keeps eq. 9's shape 1 / epsilon_l, scaled so that each step is one
Gaussian mechanism of multiplier z, 1 / z^2 = sum_l 1 / sigma_l^2, with z
the multiplier whose Poisson-sampled steps over the planned rounds the RDP
accountant prices at (epsilon, delta) (`dp_sgd.noise_multiplier_for`,
clients of unequal sizes as `local_dp_sgd.client_samplings` groups them).
The upload is the model change, unclipped and not noised again; the
epsilon reported is the accountant's for the steps taken, a proven
sample-level bound (up to what the data-dependent split reveals). Only
with plain SGD and the defaults of `sensitivity`, `noise_calibration` and
`eta_placement`, which concern the noise on the update.

The client's total delta is the run's `dp_delta`. Privacy reported per round:
the paper's epsilon spent so far, `paper_epsilon` (below), and what
`dp_accounting` computes for the noise added under the sensitivity's
relation (`dp_relation`): for 'paper' the bound that holds for every split
eq. 6 can produce, for 'accountant' the exact target. Both treat the split
as fixed in advance, which the PSI split, computed from private data, is
not (see `tff_privacy.dp.layerwise_budget`). `privacy_guarantee` says in
words which of them is proven: under 'sample' neither (see above).

The paper's epsilon is composed from what each client spent. Every round,
each client records the epsilon_{l,r} eq. 9 assigns to the noise sigma_l
it added to tensor l (`fedre/tensor_epsilons` in metrics.json, {client
index: [epsilon_{l,r} per tensor]} for the round's clients): its eq. 6
share under 'paper' calibration; under 'accountant', eq. 9 solved for
epsilon_l at the accountant's sigma_l (`paper_layer_epsilons` of
`tff_privacy.dp.layerwise_budget`), so that both are priced by the same
formula. A client's epsilon after t rounds composes eq. 9 over its rounds
per tensor and sums the tensors (Theorem 1), sum_l sqrt(sum_{r <= t}
epsilon_{l,r}^2 / T) (`paper_epsilon_spent`; a round it sat out adds
nothing); `paper_epsilon` is the largest over the clients (None, and
why in `paper_epsilon_unknown`, for a resumed run whose earlier rounds were
trained by a version that did not record them). It is epsilon
sqrt(t / T) for a split that stays the same (the even split): epsilon
after T rounds, more past them (a run longer than `budget_rounds`
is refused unless `allow_over_budget`); a PSI split that changes from
round to round spends more than that (Cauchy-Schwarz).

Regions (`regions`): every client's privacy-sensitive region on its images
(its privacy preference, Fig. 1), either boxes `x_min,y_min,x_max,y_max`
(maxima exclusive, ';' between boxes) or element classes of a data set with
element maps (the documents): a preference of
`tff_privacy.data.documents.PRIVACY_PREFERENCES` ('numbers', 'marks') or
class names 'amount,stamp'. The same for every client, or per client from a
JSON file `{"default": ..., "clients": {"3": ..., ...}}` whose values are
lists of boxes or such strings. Default: the central box of a quarter of
the image's height and width. With element classes, a client's region is the
union of those elements over its training images; with the 'groups'
partition each client holds one document format (its data category), so
that union is the format's layout of the chosen elements. PDA-PAM scores a
client's upload on public samples of its category, each with its own
elements of the client's classes.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Optional, Sequence

import dp_accounting
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import data, params, psi
from tff_privacy.aggregation import (SCORE_SCALES, UPDATE_RULES, PublicRegions,
                                     build_pda_pam,
                                     compose_with_server_aggregation)
from tff_privacy.aggregation.wide_sum import wide_sum_then_finalize
from tff_privacy.algorithms import defended, local_dp_sgd, personalized
from tff_privacy.algorithms.base import (CLIENT_OPTIMIZER, Algorithm, Federation,
                                         Method, build_client_optimizer,
                                         check_positive, refuse_defense,
                                         server_learning_rate)
from tff_privacy.algorithms import client_data
from tff_privacy.algorithms.client_data import SEED_KEY, client_seed
from tff_privacy.data.documents import PRIVACY_PREFERENCES
from tff_privacy.defenses.updates import (LOCAL_RELATION, ClientView,
                                          UpdateDefense, per_tensor_at_norm,
                                          run_local_query)
from tff_privacy.dp import LayerwiseGaussianQuery, dp_sgd
from tff_privacy.dp import layerwise_budget as budget
from tff_privacy.models.functional import forward
from tff_privacy.attacks import noise_aware
from tff_privacy.attacks.refusal import UploadRefused
from tff_privacy.disclosure import Disclosure
from tff_privacy.listing import Listing
from tff_privacy.registry import METHODS

MASK_KEY = "psi_mask"
PROFILE_KEY = "public_profile"  # which public set PDA-PAM scores a client on
CLIENT_KEY = "client_index"  # the row of a client's per-client measurements
# the measurement of each client's per-tensor epsilons of a round, and
# where metrics.json holds it (the runner's '<defence>/<name>')
SPENT_KEY = "tensor_epsilons"
METRIC_KEY = f"fedre/{SPENT_KEY}"
BUDGET_SPLITS = ("psi", "even")
BUDGET_UNITS = ("layer", "tensor")
ETA_PLACEMENTS = ("server", "client")
NOISE_CALIBRATIONS = ("paper", "accountant")
AGGREGATIONS = ("pda_pam", "mean")
PERTURBATIONS = ("gradient", "pixels")
NOISE_ON = ("update", "steps")
# folded into the round's seed for the PSI estimator of noise_on='steps'
# (the steps' noise and Poisson draws fold in step numbers and
# `local_dp_sgd.SAMPLING_STREAM`)
PSI_STREAM = 2**31 - 2
DEFAULT_PIXEL_NOISE = 0.1

PARAMETERS = params.Params(
    params.Param("epsilon", float, 50.0, "each client's total privacy budget "
                 "(eq. 6; the paper's tables: 50 and 10)", minimum=0,
                 exclusive_minimum=True),
    params.Param("clip", float, 0.15, "clipping threshold C_l of every "
                 "tensor (eq. 7; the paper's DocTamper setting)", minimum=0,
                 exclusive_minimum=True, flag="layer-clip"),
    params.Param("budget_split", str, "psi", "psi: eq. 6; even: the same "
                 "epsilon split evenly (FedRE without PSI)", choices=BUDGET_SPLITS),
    params.Param("budget_unit", str, "layer", "layer: eq. 6 over the model's "
                 "layers (a layer's kernel and bias scored together, its "
                 "epsilon_l shared equally); tensor: every tensor scored and "
                 "budgeted alone", choices=BUDGET_UNITS),
    params.Param("perturbation", str, "gradient", "gradient: FedRE's layer-"
                 "wise noise on the update; pixels: Gaussian noise of std "
                 "pixel_noise on the region's pixels instead (Fig. 5)",
                 choices=PERTURBATIONS),
    params.Param("pixel_noise", float, None, "std of the region pixel noise "
                 "of perturbation='pixels' (pixel values in [0, 1]; default "
                 f"{DEFAULT_PIXEL_NOISE})", minimum=0),
    params.Param("noise_on", str, "update", "update: the round's clipped "
                 "update noised once (eqs. 7-8); steps: DP-SGD, each local "
                 "step's per-example gradients clipped per tensor to C_l and "
                 "their sum noised with eq. 9's shape, calibrated by the RDP "
                 "accountant (a proven sample-level epsilon, Poisson batches)",
                 choices=NOISE_ON),
    params.Param("noise_calibration", str, "paper", "paper: sigma_l by eq. 9; "
                 "accountant: scaled to spend exactly epsilon by RDP",
                 choices=NOISE_CALIBRATIONS),
    params.Param("sensitivity", str, "sample", "sample: noise std 2 C_l "
                 "sigma_l / |D_k|, one sample's contribution as in the source "
                 "eq. 9 cites (a heuristic epsilon); update: std C_l sigma_l, "
                 "local DP of the whole clipped update (eq. 8 as written)",
                 choices=budget.SENSITIVITIES),
    params.Param("eta_placement", str, "client", "client: clip and noise the "
                 "model change itself; server: clip and noise the local "
                 "gradient (model change / client learning rate), which eq. "
                 "11's eta scales", choices=ETA_PLACEMENTS),
    params.Param("budget_rounds", int, None, "rounds the budget covers "
                 "(eq. 9's T; default: the run's rounds), for runs that stop "
                 "early, e.g. to attack round 1 of a longer plan", minimum=1),
    params.Param("allow_over_budget", bool, False, "train past "
                 "budget_rounds, spending more than epsilon (paper_epsilon "
                 "reports how much)"),
    params.Param("psi_samples", int, 10, "samples per client and round whose "
                 "PSI scores are averaged", minimum=1),
    params.Param("psi_pixels", int, None, "region pixels per sample for the "
                 "PSI estimator (default: all, exact)", minimum=2),
    params.Param("regions", str, None, "privacy-sensitive regions: boxes "
                 "'x0,y0,x1,y1[;...]', element classes ('numbers', 'marks' "
                 "or 'amount,stamp' on docs) or a JSON file of them per "
                 "client (default: the central box of a quarter of each side)"),
    params.Param("aggregation", str, "pda_pam", "pda_pam: eqs. 10-11; mean: "
                 "FedRE without PDA-PAM", choices=AGGREGATIONS),
    params.Param("pda_pam_rule", str, "normalized", "normalized: softmax(-S) "
                 "weights, a mean's step size; paper: eq. 11 as written, whose "
                 "step is K times a mean's when the scores agree",
                 choices=UPDATE_RULES),
    params.Param("pda_pam_scores", str, "linear", "linear: the PSI score in "
                 "eq. 10 as written; log: its log, weights by score ratios",
                 choices=SCORE_SCALES),
    params.Param("public_samples", int, 10, "public samples the server scores "
                 "uploads with (PDA-PAM)", minimum=1),
    params.Param("client_learning_rate", float, 0.005, "learning rate of the "
                 "clients' local SGD (the paper's 0.005)", minimum=0,
                 exclusive_minimum=True, flag="client-lr"),
    server_learning_rate(1.0),
    params.Param("local_epochs", int, 1, "local passes over each client's data",
                 minimum=1),
    CLIENT_OPTIMIZER)


def default_box(height: int, width: int) -> list[int]:
  """The central box of a quarter of each side (at least 2 pixels)."""
  h, w = max(2, height // 4), max(2, width // 4)
  y0, x0 = (height - h) // 2, (width - w) // 2
  return [x0, y0, x0 + w, y0 + h]


def client_regions(regions: Optional[str], num_clients: int, height: int,
                   width: int, data=None) -> list[np.ndarray]:
  """Every client's [height, width] region mask from the `regions` parameter
  (see the module docstring); each holds at least one pixel. Element classes
  need `data` (a `tff_privacy.data.FederatedData` with element maps): a
  client's region is every pixel its training images have an element of
  those classes on (the union over its samples, so that the region covers
  the sensitive content of each)."""
  masks = []
  for c, (kind, value) in enumerate(region_specs(regions, num_clients)):
    if kind == "default":
      mask = psi.box_mask([default_box(height, width)], height, width)
    elif kind == "boxes":
      mask = psi.box_mask(value, height, width, name=f"regions[{c}]")
    else:
      _check_element_maps(data, value, regions)
      mask = _element_masks(data, value, regions, "train",
                            data.client_indices[c]).any(0)
    masks.append(psi.check_mask(mask, height, width, name=f"regions of client {c}"))
  return masks


def region_specs(regions: Optional[str], num_clients: int) -> list[tuple[str, list]]:
  """Each client's region as ('boxes', boxes), ('classes', element
  classes) or ('default', None)."""
  if regions is None:
    return [("default", None)] * num_clients
  return params.per_client(regions, num_clients, "regions", _region_spec)


def _region_spec(value, name: str) -> tuple[str, list]:
  """Boxes (a list, or 'x0,y0,x1,y1[;...]') or element classes (a
  preference of `PRIVACY_PREFERENCES` or 'class[,class...]')."""
  if not isinstance(value, str):
    return "boxes", value
  if not any(ch.isalpha() for ch in value):
    return "boxes", psi.parse_boxes(value, name=name)
  if value in PRIVACY_PREFERENCES:
    return "classes", list(PRIVACY_PREFERENCES[value])
  return "classes", [c.strip() for c in value.split(",")]


def _element_masks(data, classes, regions, split: str = "train",
                   indices: Optional[np.ndarray] = None) -> np.ndarray:
  """The element masks of `classes` (`ElementMaps.masks`), with `regions`
  named in the error; after `_check_element_maps`."""
  try:
    return data.source.elements.masks(classes, split, indices)
  except ValueError as e:
    raise ValueError(f"regions={regions!r}: {e}") from None


def _check_element_maps(data, classes, regions) -> None:
  if data is None or data.source.elements is None:
    raise ValueError(f"regions={regions!r} names element classes {classes}; "
                     "that needs a data set with element maps ('docs', or "
                     "'doctamper'/'tsroie' with a boxes file as data_kwargs "
                     "'regions'), else give boxes")


def run_regions(run_dir: str) -> list[np.ndarray]:
  """Every client's region in the FedRE run saved in `run_dir` (its
  config.json), rebuilt from the run's data split: what an attack scores
  inside. `ValueError` in one line for a folder without a FedRE run."""
  path = os.path.join(run_dir, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"region='run': {path} does not exist; give the folder "
                     "of a run's updates/ or boxes")
  with open(path) as f:
    config = json.load(f)
  if config.get("method") != "fedre":
    raise ValueError(f"region='run': {run_dir} holds a {config.get('method')!r} "
                     "run, which has no privacy regions; give boxes")
  fed = data.load(config["dataset"], config["clients"], config["partition"],
                  config["alpha"], config["seed"], config["data_dir"],
                  config["samples_per_client"], config.get("data_kwargs"))
  return client_regions(config["method_kwargs"]["regions"], config["clients"],
                        *fed.source.input_shape[:2], data=fed)


# the neighbouring relation of the epsilon of 'sample'
SAMPLE_RELATION = ("sample-level local DP, heuristic: two data sets of one "
                   "client that differ in one sample are neighbours, the "
                   "clipped update's sensitivity taken as 2 C_l / |D_k| as in "
                   "the analysis eq. 9 cites (not proven for local steps)")
GUARANTEES = {
    "sample": "heuristic: eq. 9's noise scaled to a per-sample sensitivity "
              "2 C_l / |D_k| that is assumed, not proven, for several local "
              "steps; neither epsilon is a proven bound",
    "update": "local DP of each upload: the accountant's epsilon is a proven "
              "bound for a split fixed in advance"}
STEPS_GUARANTEE = ("proven: sample-level DP-SGD on Poisson batches, every step "
                   "the Gaussian mechanism of one noise multiplier whatever "
                   "the layer split, priced by the RDP accountant; what the "
                   "PSI split, computed from private samples, reveals is not "
                   "accounted")
# what noise_on='steps' leaves to the steps, refused beside it
STEPS_FIXED = {"perturbation": "gradient", "sensitivity": "sample",
               "noise_calibration": "paper", "eta_placement": "client"}


class FedREMechanism(UpdateDefense):
  """Steps 2-4 of FedRE's client (see the module docstring) on one update,
  the model change w~ - w^k of `local_epochs` passes at `learning_rate`,
  for a federation of `num_clients` clients (the rows of its per-tensor
  epsilons, `SPENT_KEY`)."""

  name = "fedre"
  needs_client_view = True

  def __init__(self, spec, *, epsilon: float, delta: float, rounds: int,
               clip: float, budget_split: str, noise_calibration: str,
               psi_samples: int, psi_pixels: Optional[int],
               sensitivity: str = "sample", eta_placement: str = "client",
               budget_unit: str = "layer",
               learning_rate: float = 0.005, local_epochs: int = 1,
               perturbation: str = "gradient", pixel_noise: Optional[float] = None,
               seed: int = 0, noise_on: str = "update",
               steps: Optional[local_dp_sgd.DPSGD] = None,
               num_clients: int = 1):
    if noise_on not in NOISE_ON:
      raise ValueError(f"noise_on={noise_on!r}; choose one of {NOISE_ON}")
    if noise_on == "steps":
      _check_steps(steps, perturbation=perturbation, sensitivity=sensitivity,
                   noise_calibration=noise_calibration,
                   eta_placement=eta_placement)
    if perturbation not in PERTURBATIONS:
      raise ValueError(f"perturbation={perturbation!r}; choose one of {PERTURBATIONS}")
    if sensitivity not in budget.SENSITIVITIES:
      raise ValueError(f"sensitivity={sensitivity!r}; choose one of "
                       f"{budget.SENSITIVITIES}")
    if eta_placement not in ETA_PLACEMENTS:
      raise ValueError(f"eta_placement={eta_placement!r}; choose one of "
                       f"{ETA_PLACEMENTS}")
    if budget_unit not in BUDGET_UNITS:
      raise ValueError(f"budget_unit={budget_unit!r}; choose one of {BUDGET_UNITS}")
    check_positive(learning_rate=learning_rate, local_epochs=local_epochs,
                   num_clients=num_clients)
    self.sensitivity, self.eta_placement = sensitivity, eta_placement
    self.learning_rate, self.local_epochs = learning_rate, local_epochs
    self.dp_relation = SAMPLE_RELATION if sensitivity == "sample" else LOCAL_RELATION
    if perturbation == "gradient" and pixel_noise is not None:
      raise ValueError("pixel_noise applies to perturbation='pixels'; FedRE's "
                       "gradient noise is set by epsilon")
    if pixel_noise is None:
      pixel_noise = DEFAULT_PIXEL_NOISE
    self.spec = spec
    self.perturbation, self.pixel_noise, self.seed = perturbation, pixel_noise, seed
    # 'pixels': transform_batch; 'steps': the local steps
    self.acts_on_update = perturbation == "gradient" and noise_on == "update"
    self.per_client_measurements = (SPENT_KEY,) if self.acts_on_update else ()
    self.num_clients = num_clients
    self.noise_on, self.steps = noise_on, steps
    if steps is not None:
      self.dp_relation = dp_sgd.RELATION
    self.num_layers = len(spec.initial_weights(0))
    self.budget_unit = budget_unit
    # each tensor's group: its Keras layer, or itself
    self.groups = (psi.layer_groups(spec.keras()) if budget_unit == "layer"
                   else list(range(self.num_layers)))
    self.epsilon, self.delta, self.rounds, self.clip = epsilon, delta, rounds, clip
    self.budget_split, self.noise_calibration = budget_split, noise_calibration
    self.psi_samples, self.psi_pixels = psi_samples, psi_pixels
    self.layer_delta = budget.split_delta(delta, self.num_layers)
    self.round_multiplier = (budget.round_multiplier(epsilon, delta, rounds)
                             if noise_calibration == "accountant" else None)
    # the model units of gradient units: eq. 11's eta, or 1 when the
    # client's model change is noised as it is
    self.eta = learning_rate if eta_placement == "server" else 1.0
    height, width = spec.input_shape[:2]
    # the profile only travels with the data, for the server's PDA-PAM
    self.client_input_types = {MASK_KEY: tff.TensorType(np.float32, [height, width]),
                               PROFILE_KEY: tff.TensorType(np.int32),
                               CLIENT_KEY: tff.TensorType(np.int32)}

  @property
  def view_samples(self) -> int:
    """The PSI samples, read with the client's inputs where the update is
    noised by the PSI split ('pixels' trains on other samples than its data
    set's, by `transform_batch`, and scores none; 'steps' reads its own)."""
    return (self.psi_samples if self.acts_on_update and self.budget_split == "psi"
            else 0)

  def params(self):
    if self.perturbation == "pixels":  # no update noise, no budget
      return {"perturbation": "pixels", "pixel_noise": self.pixel_noise}
    return {"epsilon": self.epsilon, "delta": self.delta, "rounds": self.rounds,
            "clip": self.clip,
            "budget_split": self.budget_split, "budget_unit": self.budget_unit,
            "noise_calibration": self.noise_calibration,
            "psi_samples": self.psi_samples, "psi_pixels": self.psi_pixels,
            "sensitivity": self.sensitivity, "eta_placement": self.eta_placement,
            "learning_rate": self.learning_rate,
            "local_epochs": self.local_epochs, "perturbation": "gradient",
            "noise_on": self.noise_on,
            **({"noise_multiplier": self.steps.noise_multiplier}
               if self.steps else {})}

  def transform_batch(self, batch, inputs):
    """'pixels': each image plus N(0, pixel_noise^2) on the region's pixels,
    the noise a function of the run's seed and the image's content."""
    if self.perturbation != "pixels":
      return batch
    region = tf.cast(inputs[MASK_KEY], tf.float32)[None, :, :, None]

    def noise(image):
      content = tf.strings.to_hash_bucket_fast(tf.io.serialize_tensor(image), 2**62)
      return tf.random.stateless_normal(
          tf.shape(image), tf.stack([content, tf.constant(self.seed, tf.int64)]))

    x = batch["x"]
    noisy = x + self.pixel_noise * region * tf.map_fn(noise, x)
    return type(batch)((k, noisy if k == "x" else v) for k, v in batch.items())

  def per_tensor(self, group_epsilons) -> tf.Tensor:
    """Each tensor's epsilon: an equal part of its group's."""
    counts = np.bincount(self.groups).astype(np.float32)
    return tf.gather(tf.cast(group_epsilons, tf.float32) / counts, self.groups)

  def even_epsilons(self) -> tf.Tensor:
    """The even split (FedRE without PSI) over the budget's units."""
    num_groups = max(self.groups) + 1
    return self.per_tensor(tf.fill([num_groups], self.epsilon / num_groups))

  def layer_epsilons(self, client: ClientView, seed) -> tf.Tensor:
    """Each tensor's epsilon_l: eq. 6 on the PSI scores (of its layer, or
    of itself by `budget_unit`) of the client's first `psi_samples` samples
    under the broadcast model, or the even split (also that of a client
    without samples, which has no scores)."""
    if self.budget_split == "even":
      return self.even_epsilons()
    batch = client.head(self.psi_samples)
    num = tf.shape(batch["x"])[0]
    model = self.spec.keras()
    masks = tf.tile(client.inputs[MASK_KEY][None] > 0.5, [num, 1, 1])

    def scored():
      scores = psi.psi_scores(model, client.weights, batch["x"],
                              batch["y"], masks, self.spec.task_object.loss,
                              pixels=self.psi_pixels, seed=seed,
                              groups=(self.groups if self.budget_unit == "layer"
                                      else None)).scores
      return self.per_tensor(
          budget.layerwise_budget(tf.reduce_mean(scores, 0), self.epsilon))

    return tf.cond(num > 0, scored, self.even_epsilons)

  def step_noise_multipliers(self, client: ClientView, seed) -> tf.Tensor:
    """noise_on='steps': every local step's sigma_l, eq. 9's shape 1 /
    epsilon_l (eq. 6 on the round's PSI scores under the broadcast model)
    scaled so that a step is the Gaussian mechanism of multiplier z =
    `steps.noise_multiplier`: z ||epsilon|| / epsilon_l."""
    return budget.calibrated_noise_multipliers(
        self.layer_epsilons(client, seed), self.steps.noise_multiplier, "sample")

  def noise_multipliers(self, layer_epsilons) -> tf.Tensor:
    if self.round_multiplier is not None:
      return budget.calibrated_noise_multipliers(
          layer_epsilons, self.round_multiplier, self.sensitivity)
    return budget.paper_noise_multipliers(layer_epsilons, self.layer_delta,
                                          self.rounds)

  def sensitivity_per_clip(self, client: ClientView) -> tf.Tensor:
    """The sensitivity over C_l: 2 / |D_k| ('sample', |D_k| the client's
    distinct samples: one local epoch of its data set) or 1 ('update',
    whose eq. 8 noise is C_l sigma_l)."""
    if self.sensitivity == "update":
      return tf.constant(1.0)
    seen = client.sample_count()
    return 2.0 * self.local_epochs / tf.cast(tf.maximum(seen, 1), tf.float32)

  def apply(self, update, seed, client: Optional[ClientView] = None):
    if not self.acts_on_update:
      return list(update)
    return self._noised(update, seed, client)[0]

  def apply_measured(self, update, seed, client: Optional[ClientView] = None):
    """`apply`'s upload and, for noise on the update, `SPENT_KEY`: a
    [num_clients, L] array holding, in the client's row (its `CLIENT_KEY`
    input), the epsilon_l eq. 9 assigns to each tensor's noise this round
    (`spent_epsilons`), zeros elsewhere; all zeros for a client without
    samples, whose upload depends on no data."""
    if not self.acts_on_update:
      return list(update), {}
    upload, spent = self._noised(update, seed, client)
    row = tf.cast(client.inputs[CLIENT_KEY], tf.int32)
    rows = tf.scatter_nd([[row]], spent[None], [self.num_clients, self.num_layers])
    has_data = client.sample_count() > 0
    return upload, {SPENT_KEY: tf.where(has_data, rows, tf.zeros_like(rows))}

  def _noised(self, update, seed, client: Optional[ClientView]):
    """The noised upload of `apply` and its `spent_epsilons`."""
    psi_seed, noise_seed = tf.unstack(
        tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 2))
    layer_epsilons, sigmas, stddevs = self._noise(client, psi_seed)
    upload = self._clipped_noised(update, noise_seed, stddevs)
    return upload, self.spent_epsilons(layer_epsilons, sigmas)

  def _noise(self, client: Optional[ClientView], psi_seed):
    """(epsilon_l, sigma_l, noise std) of every tensor for `client`'s
    update: eq. 6's split under `psi_seed`, eq. 9 (or the accountant) and
    eq. 8's std in the model's units."""
    if client is None:
      raise ValueError("fedre needs the client's data, region and model (a ClientView)")
    layer_epsilons = self.layer_epsilons(client, psi_seed)
    sigmas = self.noise_multipliers(layer_epsilons)
    # eqs. 7-8 in gradient units, scaled by eta into the model's units
    stddevs = self.eta * self.clip * sigmas * self.sensitivity_per_clip(client)
    return layer_epsilons, sigmas, stddevs

  def _clipped_noised(self, update, noise_seed, stddevs) -> list[tf.Tensor]:
    """Eqs. 7-8: every tensor clipped to eta C_l, plus noise of `stddevs`."""
    clip = self.eta * self.clip
    query = LayerwiseGaussianQuery([clip] * self.num_layers, [1.0] * self.num_layers)
    return list(run_local_query(query, list(update), noise_seed, stddevs=stddevs)[0])

  def for_client(self, client: ClientView, seed) -> UpdateDefense:
    """The mechanism `client`'s round runs, with what it reads of the
    client's data fixed as under its round seed `seed`, for the per-upload
    audit (`tff_privacy.audit.uploads`), which applies it many times:
    noise_on='update', `FixedFedRENoise` (the PSI split, |D_k|); 'steps',
    `local_dp_sgd.StepsCanary` at the round's per-tensor multipliers.

    Raises:
      ValueError: perturbation='pixels', which claims no DP guarantee."""
    seed = tf.cast(seed, tf.int64)
    if self.perturbation == "pixels":
      raise ValueError("fedre with perturbation='pixels' claims no DP guarantee")
    if self.steps is not None:
      return local_dp_sgd.StepsCanary(
          self.steps, self.delta, self.step_noise_multipliers(
              client, tf.random.experimental.stateless_fold_in(seed, PSI_STREAM)),
          [w.shape for w in self.spec.initial_weights(0)])
    psi_seed, _ = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    return FixedFedRENoise(self, self._noise(client, psi_seed)[2])

  def spent_epsilons(self, layer_epsilons, sigmas) -> tf.Tensor:
    """Each tensor's epsilon_l that eq. 9 assigns to a round's noise
    multipliers `sigmas`: the eq. 6 shares `layer_epsilons` they came from
    under 'paper' calibration, eq. 9 solved for epsilon_l under
    'accountant' (whose sigmas are not eq. 9's)."""
    if self.round_multiplier is None:
      return tf.cast(layer_epsilons, tf.float32)
    return budget.paper_layer_epsilons(sigmas, self.layer_delta, self.rounds)

  def dp_event(self, num_params: int) -> dp_accounting.DpEvent:
    """One round under `dp_relation` (the sensitivity's): exact for
    'accountant' and for the even split (fixed in advance); for eq. 9 with
    the PSI split, the bound over every split
    (`paper_round_multiplier_bound`). None for 'pixels', which claims no DP
    guarantee."""
    if self.perturbation == "pixels":
      return None
    if self.steps is not None:
      return self.steps.round_event()
    if self.round_multiplier is not None:
      return dp_accounting.GaussianDpEvent(self.round_multiplier)
    if self.budget_split == "even":
      sigmas = budget.paper_noise_multipliers(self.even_epsilons(),
                                              self.layer_delta, self.rounds)
      return budget.layerwise_event(sigmas.numpy(), self.sensitivity)
    return dp_accounting.GaussianDpEvent(budget.paper_round_multiplier_bound(
        self.epsilon, self.delta, self.rounds, self.num_layers, self.sensitivity))


class FixedFedRENoise(UpdateDefense):
  """FedRE's eqs. 7-8 at one client's noise std per tensor (`stddevs`,
  `FedREMechanism.for_client`), as a mechanism of the update alone: the
  same clipping, `LayerwiseGaussianQuery` and claim (`dp_event`,
  `dp_relation`) as the client's round.

  Its canary (`canary`): every tensor's part of the direction at the clip
  norm eta C_l, whose negation is its farthest neighbour, 2 eta C_l away in
  every tensor. Under sensitivity 'update' (any two uploads of a client)
  that is the claim's own relation. Under 'sample' (two data sets that
  differ in one sample) it is the white-box gradient canary: a sample whose
  loss is linear in the weights, its gradient +M or -M times the direction
  wherever the model is, M large enough that its steps move the model past
  the clip norm, beside samples whose loss does not depend on the weights,
  so that the two clipped updates are the canary and its negation. FedRE
  clips the update, not each sample's gradient, so such a sample is in its
  relation."""

  name = "fedre"

  def __init__(self, mechanism: FedREMechanism, stddevs):
    self.mechanism = mechanism
    self.stddevs = tf.constant(stddevs, tf.float32)
    self.dp_relation = mechanism.dp_relation
    self._sizes = [int(np.prod(w.shape)) for w in mechanism.spec.initial_weights(0)]
    self._variances = np.repeat(self.stddevs.numpy() ** 2, self._sizes)

  def apply(self, update, seed, client=None):
    return self.mechanism._clipped_noised(update, seed, self.stddevs)

  def dp_event(self, num_params: int):
    return self.mechanism.dp_event(num_params)

  def canary(self, direction):
    return per_tensor_at_norm(direction, self._sizes,
                              self.mechanism.eta * self.mechanism.clip)

  def canary_score(self, uploads: np.ndarray, canaries: np.ndarray) -> np.ndarray:
    """The Gaussian likelihood ratio's statistic: each tensor's inner
    product over its noise variance (the tensors' noise differs by the
    split)."""
    return np.sum(uploads * canaries / np.maximum(self._variances, 1e-30), axis=1)


def _check_steps(steps: Optional[local_dp_sgd.DPSGD], **settings) -> None:
  if steps is None or not steps.poisson:
    raise ValueError("noise_on='steps' needs its DP-SGD on Poisson batches "
                     "(`local_dp_sgd.configure` of the run)")
  for name, value in settings.items():
    if value != STEPS_FIXED[name]:
      raise ValueError(f"{name}={value!r} applies to noise_on='update'; "
                       f"noise_on='steps' runs DP-SGD ({name}="
                       f"{STEPS_FIXED[name]!r})")


def check_steps_optimizer(client_optimizer: str) -> None:
  """noise_on='steps' takes plain SGD steps on the noisy mean gradient."""
  if client_optimizer != "sgd":
    raise ValueError(f"client_optimizer={client_optimizer!r}: noise_on='steps' "
                     "runs DP-SGD, whose steps are plain SGD; use 'sgd'")


def per_example_gradients(model: tf.keras.Model, weights: Sequence[tf.Tensor],
                          batch, loss) -> list[tf.Tensor]:
  """The gradient of `loss(logits, labels)` for each example of the batch
  alone, one tensor per weight with the batch on axis 0 (one vectorised
  map)."""

  def one_example(example):
    x, y = example
    with tf.GradientTape() as tape:
      free = list(weights)
      tape.watch(free)
      value = loss(forward(model, free, x[tf.newaxis]), y[tf.newaxis])
    return tape.gradient(value, free)

  return tf.vectorized_map(one_example, (batch["x"], batch["y"]))


def steps_client_update(spec, mechanism: FedREMechanism, weights_type,
                        learning_rate: float) -> tff.Computation:
  """noise_on='steps': a client's round, (ClientResult, summed train sums).
  The layer noise multipliers come first (`step_noise_multipliers` under
  the broadcast model), then SGD at `learning_rate` on the DP-SGD gradient
  of each Poisson batch (`local_dp_sgd.poisson_batches`): per-example,
  per-tensor clipping to `clip`, noise of std clip sigma_l on the sum, over
  the expected batch size. The update is the model change. The client's
  data carry its seed and `client_input_types` as for 'update'."""
  task, epochs, clip = spec.task_object, mechanism.local_epochs, mechanism.clip
  data_type = client_data.seeded_type(
      collections.OrderedDict((k, tff.TensorType(v.dtype.as_numpy_dtype, v.shape))
                              for k, v in spec.input_spec.items()),
      mechanism.client_input_types)

  @tff.tensorflow.computation(weights_type, data_type)
  def client_update(weights, data):
    dataset, inputs = client_data.split(data)
    model = spec.keras()
    start = list(weights.trainable)
    view = ClientView(start, dataset, {MASK_KEY: inputs[MASK_KEY]})
    sigmas = mechanism.step_noise_multipliers(
        view, tf.random.experimental.stateless_fold_in(inputs[SEED_KEY], PSI_STREAM))

    def step(carry, batch):
      w, sums, i = carry
      _, batch_sums = personalized.batch_loss(model, w, batch, task)
      grads = dp_sgd.layerwise_private_gradient(
          per_example_gradients(model, w, batch, task.loss), clip, sigmas,
          local_dp_sgd.step_seed(inputs[SEED_KEY], i),
          batch[local_dp_sgd.EXPECTED_SIZE_KEY])
      return (tuple(p - learning_rate * g for p, g in zip(w, grads)),
              sums + batch_sums, i + 1)

    w, sums, _ = local_dp_sgd.poisson_batches(dataset, epochs, inputs[SEED_KEY]).reduce(
        (tuple(start), tf.zeros([3]), tf.constant(0, tf.int64)), step)
    return (tff.learning.templates.ClientResult(
        update=[s - e for s, e in zip(start, w)],
        update_weight=local_dp_sgd.examples_per_pass(dataset, epochs)), sums)

  return client_update


def _client_work(spec, mechanism: FedREMechanism, weights_type, model_fn,
                 client_optimizer: str, learning_rate: float):
  """noise_on='update': FedAvg's local training and the mechanism on the
  update (`defended.with_update_defense`); 'steps': DP-SGD steps
  (`steps_client_update`), the same client data."""
  if mechanism.noise_on == "update":
    return defended.with_update_defense(
        defended.model_delta_update(
            model_fn, build_client_optimizer(client_optimizer, learning_rate)),
        mechanism, wide_sum_then_finalize)
  check_steps_optimizer(client_optimizer)
  return local_dp_sgd.local_training_client_work(steps_client_update(
      spec, mechanism, weights_type, learning_rate))


def build_fedre(spec, mechanism: FedREMechanism, *,
                client_learning_rate: float = 0.005,
                server_learning_rate: float = 1.0,
                client_optimizer: str = "sgd",
                public: Optional[Sequence[PublicRegions]] = None,
                pda_pam_rule: str = "normalized",
                pda_pam_scores: str = "linear",
                model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
                ) -> tff.learning.templates.LearningProcess:
  """Builds FedRE's `LearningProcess` for the model of `spec` (a
  `tff_privacy.models.ModelSpec`).

  Args:
    spec: the model the clients train.
    mechanism: the clients' `FedREMechanism` (budget, clip, PSI settings).
    client_learning_rate: the clients' local learning rate.
    server_learning_rate: the server's SGD step on the aggregate.
    client_optimizer: 'sgd' (the paper is silent; FedAvg's) or 'adam' (not
      with the mechanism's noise_on='steps').
    public: the server's public samples and regions, one set per profile
      (a client's 'public_profile' input indexes them); None aggregates by
      the plain example-weighted mean (FedRE without PDA-PAM).
    pda_pam_rule: 'normalized' or 'paper' (see `tff_privacy.aggregation`).
    pda_pam_scores: 'linear' (eq. 10) or 'log' (see `tff_privacy.aggregation`).
    model_aggregator: the weighted aggregator of the uploads (e.g. a capture
      wrapper); with `public`, it runs for its measurements only.

  Returns:
    A `tff.learning.templates.LearningProcess` whose client data carry a
    'seed', a 'psi_mask', a 'public_profile' and a 'client_index' beside
    the batches (`tff_privacy.algorithms.client_data`).

  Raises:
    ValueError: for a learning rate <= 0, an unknown `pda_pam_rule` or
      `pda_pam_scores`, Adam with noise_on='steps'.
  """
  check_positive(client_learning_rate=client_learning_rate,
                 server_learning_rate=server_learning_rate)
  model_fn = spec.tff_model_fn()

  @tff.tensorflow.computation()
  def initial_model_weights_fn():
    return tff.learning.models.ModelWeights.from_model(model_fn())

  client_work = _client_work(spec, mechanism,
                             initial_model_weights_fn.type_signature.result,
                             model_fn, client_optimizer, client_learning_rate)
  server_optimizer = tff.learning.optimizers.build_sgdm(server_learning_rate)
  if public is None:
    return defended.compose_from_weights(initial_model_weights_fn, client_work,
                                         server_optimizer, model_aggregator)

  one_set = one_public_set(public)
  if one_set is not None:  # every profile scores alike: no client reads its own
    public, client_profile = one_set, None
  else:
    @tff.tensorflow.computation(client_work.next.type_signature.parameter[2].member)
    def client_profile(data):
      return client_data.split(data)[1][PROFILE_KEY]

  return compose_with_server_aggregation(
      initial_model_weights_fn, client_work,
      build_pda_pam(spec, public, rule=pda_pam_rule, score_scale=pda_pam_scores,
                    pixels=mechanism.psi_pixels,
                    loss_fn=spec.task_object.loss),
      server_optimizer, client_profile, model_aggregator)


def one_public_set(public: Sequence[PublicRegions]) -> Optional[PublicRegions]:
  """The set every profile holds where `public`'s sets are all equal (the
  same samples, labels and regions, e.g. clients of one data category with
  one default region), else None. PDA-PAM then scores every upload on it
  and no client's profile is read from its inputs (a computation of its
  own per client)."""
  if not public:
    return None
  first = public[0]
  same = all(np.array_equal(p.x, first.x) and np.array_equal(p.y, first.y)
             and np.array_equal(p.masks, first.masks) for p in public[1:])
  return first if same else None


def public_regions(federation: Federation, regions: Optional[str],
                   masks: list[np.ndarray], count: int) -> list[PublicRegions]:
  """Each client's public set for PDA-PAM: the run's test split (no client
  trains on it), restricted, where samples have groups, to the groups
  (data categories) of the client's training samples; each sample with the
  client's region: its boxes (`masks`), or the sample's own elements of the
  client's classes. The first `count` samples whose region is not empty,
  the same number for every client (the smallest client's)."""
  if federation.public_data is None:
    raise ValueError("aggregation='pda_pam' needs a public data set; build "
                     "fedre inside a run, or set aggregation='mean'")
  x, y = federation.public_data
  data = federation.data
  # each public sample's place in the source's test set (a split file's
  # pooled test splits are part of it, in their own order)
  in_test = (np.arange(len(x)) if data is None or data.test_indices is None
             else np.asarray(data.test_indices))
  chosen = []
  for c, (kind, classes) in enumerate(region_specs(regions, len(masks))):
    idx = np.arange(len(x))
    if data is not None and data.source.groups is not None:
      train_groups, test_groups = data.source.groups
      idx = idx[np.isin(test_groups[in_test], train_groups[data.client_indices[c]])]
    if kind == "classes":
      _check_element_maps(data, classes, regions)
      sample_masks = _element_masks(data, classes, regions, "test", in_test[idx])
    else:
      sample_masks = np.repeat(masks[c][None], len(idx), axis=0)
    keep = sample_masks.any(axis=(1, 2))
    chosen.append((idx[keep][:count], sample_masks[keep][:count]))
  size = min(len(idx) for idx, _ in chosen)
  if size == 0:
    raise ValueError(f"regions={regions!r}: a client has no public sample "
                     "with a pixel of its region for PDA-PAM")
  return [PublicRegions(x[idx[:size]], y[idx[:size]], m[:size])
          for idx, m in chosen]


def algorithm(spec, *, batch_size: int, seed: int, defense, federation,
              epsilon: float, clip: float, budget_split: str, budget_unit: str,
              noise_calibration: str, budget_rounds: Optional[int],
              sensitivity: str, eta_placement: str,
              psi_samples: int, psi_pixels: Optional[int],
              regions: Optional[str], aggregation: str, pda_pam_rule: str,
              pda_pam_scores: str,
              public_samples: int, client_learning_rate: float,
              server_learning_rate: float, local_epochs: int,
              client_optimizer: str, perturbation: str,
              pixel_noise: Optional[float], allow_over_budget: bool,
              noise_on: str) -> Algorithm:
  """FedRE as the runner drives it."""
  refuse_defense("fedre", defense)
  check_positive(batch_size=batch_size)
  if noise_on == "steps":
    check_steps_optimizer(client_optimizer)
  federation = federation or Federation(rounds=1, client_sizes=(0,))
  planned = budget_rounds or federation.rounds
  if (perturbation == "gradient" and federation.rounds > planned
      and not allow_over_budget):
    raise ValueError(
        f"budget_rounds={planned} plans epsilon={epsilon:g} over {planned} "
        f"rounds and the run has rounds={federation.rounds}; set "
        "allow_over_budget (--allow-over-budget) to spend more than epsilon, "
        "or plan the budget over the run")
  delta = federation.dp_delta
  steps = None if noise_on == "update" else local_dp_sgd.configure(
      "fedre", dataclasses.replace(federation, rounds=planned), batch_size,
      local_epochs, l2_norm_clip=clip, noise_multiplier=None,
      target_epsilon=epsilon, target_delta=delta, batch_sampling="poisson")
  masks = client_regions(regions, len(federation.client_sizes),
                         *spec.input_shape[:2], data=federation.data)
  mechanism = FedREMechanism(
      spec, epsilon=epsilon, delta=delta,
      rounds=planned, clip=clip,
      budget_split=budget_split, budget_unit=budget_unit,
      noise_calibration=noise_calibration,
      psi_samples=psi_samples, psi_pixels=psi_pixels,
      sensitivity=sensitivity, eta_placement=eta_placement,
      learning_rate=client_learning_rate, local_epochs=local_epochs,
      perturbation=perturbation, pixel_noise=pixel_noise, seed=seed,
      noise_on=noise_on, steps=steps, num_clients=len(federation.client_sizes))
  public = (public_regions(federation, regions, masks, public_samples)
            if aggregation == "pda_pam" else None)
  return Algorithm(
      name="fedre", upload_kind="model_delta", local_data="epochs",
      local_epochs=local_epochs,
      build_process=lambda aggregator: build_fedre(
          spec, mechanism, client_learning_rate=client_learning_rate,
          server_learning_rate=server_learning_rate,
          client_optimizer=client_optimizer, public=public,
          pda_pam_rule=pda_pam_rule, pda_pam_scores=pda_pam_scores,
          model_aggregator=aggregator),
      protocol={"client_learning_rate": client_learning_rate,
                "server_learning_rate": server_learning_rate,
                "local_epochs": local_epochs, "batch_size": batch_size,
                "client_optimizer": client_optimizer,
                "delta_convention": "broadcast_minus_local",
                "aggregation": aggregation, "pda_pam_rule": pda_pam_rule,
                "pda_pam_scores": pda_pam_scores, "noise_on": noise_on,
                **(steps.protocol() if steps else {})},
      client_inputs=lambda client, round_num: {
          SEED_KEY: client_seed(seed, round_num, client),
          MASK_KEY: masks[client].astype(np.float32),
          PROFILE_KEY: np.int32(client), CLIENT_KEY: np.int32(client)},
      # the regions are the run's public configuration: adaptive attacks
      # score and regularise them
      defense={"name": mechanism.name, **mechanism.params(), "regions": regions},
      dp_event=mechanism.dp_event, dp_relation=mechanism.dp_relation,
      audited_mechanism=None if perturbation == "pixels" else mechanism,
      # a client's PSI scores (and PDA-PAM's of an upload) of the documents'
      # U-Net need 1.4 GB: one client at a time
      concurrent_clients=1 if aggregation == "pda_pam" or (
          perturbation == "gradient" and budget_split == "psi") else -1,
      stated_privacy=_stated_privacy(mechanism))


def _stated_privacy(mechanism: FedREMechanism):
  """`Algorithm.stated_privacy`: for noise_on='update' the paper's epsilon
  and its accounting, for 'steps' the batch sampling; both with
  `privacy_guarantee`. None for 'pixels', which claims no DP guarantee."""
  m = mechanism
  if m.perturbation == "pixels":
    return None
  if m.steps is not None:
    return lambda rounds, history: {"privacy_guarantee": STEPS_GUARANTEE,
                                    **m.steps.stated_privacy()}
  return lambda rounds, history: {
      **paper_epsilon(history, m.rounds),
      "paper_delta": m.delta,
      "paper_accounting": "eq. 9 per tensor composed over the rounds of "
      f"noise planned for {m.rounds}, sqrt(sum_r epsilon_(l,r)^2 / "
      f"{m.rounds}) from {METRIC_KEY}, simple composition over tensors "
      "(Theorem 1, Corollary 1), the largest over clients",
      "privacy_guarantee": GUARANTEES[m.sensitivity]}


def paper_epsilon(history: Sequence[dict], planned_rounds: int) -> dict:
  """{'paper_epsilon': the largest over clients of the paper's epsilon
  they spent in the rounds of `history` (metrics entries), composed from
  their recorded per-tensor epsilons (`METRIC_KEY`) by
  `layerwise_budget.paper_epsilon_spent`}; empty where none are recorded
  (no round has run). None, with why as 'paper_epsilon_unknown', where a
  round of `history` recorded none: a resumed run's rounds trained by a
  version that did not record them spent a budget that is not known."""
  unrecorded = [entry["round"] for entry in history if METRIC_KEY not in entry]
  if unrecorded:
    return {"paper_epsilon": None, "paper_epsilon_unknown": (
        f"{_rounds_text(unrecorded)} trained by a version that did not record "
        f"per-tensor epsilons ({METRIC_KEY})")}
  spent = collections.defaultdict(list)
  for entry in history:
    for client, epsilons in entry[METRIC_KEY].items():
      spent[client].append(epsilons)
  if not spent:
    return {}
  return {"paper_epsilon": float(np.max([  # NaN where a client's is
      budget.paper_epsilon_spent(rows, planned_rounds)
      for rows in spent.values()]))}


def _rounds_text(rounds: Sequence[int]) -> str:
  """'round 3', or 'rounds 1-5, 8': consecutive rounds as ranges."""
  spans = []
  for r in rounds:
    if spans and r == spans[-1][1] + 1:
      spans[-1][1] = r
    else:
      spans.append([r, r])
  text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
  return f"round {text}" if len(rounds) == 1 else f"rounds {text}"


def _noise_place(defense: dict) -> str:
  """Where a FedRE run puts its noise: 'update', 'pixels' or 'steps'."""
  if defense.get("perturbation") == "pixels":
    return "pixels"
  return defense["noise_on"]


def _even_split_levels(record) -> list[float]:
  """The std of FedRE's noise on each tensor of an even-split upload, from
  the run's public parameters (eq. 9 or the accountant's calibration)."""
  d = record.metadata["defense"]
  mechanism = FedREMechanism(
      record.model_spec, epsilon=d["epsilon"], delta=d["delta"],
      rounds=d["rounds"], clip=d["clip"], budget_split="even",
      budget_unit=d["budget_unit"], noise_calibration=d["noise_calibration"],
      psi_samples=d["psi_samples"], psi_pixels=d["psi_pixels"],
      sensitivity=d["sensitivity"], eta_placement=d["eta_placement"],
      learning_rate=d["learning_rate"], local_epochs=d["local_epochs"])
  sigmas = mechanism.noise_multipliers(mechanism.even_epsilons()).numpy()
  # 'sample': the sensitivity 2 C_l / |D_k| over the client's distinct samples
  per_clip = 2.0 / record.num_examples if d["sensitivity"] == "sample" else 1.0
  return list(mechanism.eta * d["clip"] * sigmas * per_clip)


def noise_levels(record) -> list[float]:
  """The std of the noise on each tensor of a FedRE upload, as an attacker
  who knows FedRE computes it: from the public parameters with the even
  split; estimated from the upload itself with the PSI split, whose scores
  are the client's (`tff_privacy.attacks.noise_aware`'s docstring).

  Raises:
    UploadRefused: the run's noise is not on the upload (FedRE's 'pixels'
      perturbation, or noise inside the local steps).
  """
  d = record.metadata["defense"]
  if _noise_place(d) != "update":
    raise UploadRefused(
        f"FedRE declares its noise levels for noise on the update; round "
        f"{record.round_num} client {record.client_index} was uploaded with "
        f"its noise on the {_noise_place(d)}: use 'ig'")
  if d["budget_split"] == "even":
    return _even_split_levels(record)
  eta = d["learning_rate"] if d["eta_placement"] == "server" else 1.0
  return noise_aware.estimated_levels(record.upload, eta * d["clip"])


def sensitive_region(record) -> np.ndarray:
  """The run's region as [1, H, W, 1] 0/1 pixels: its boxes or the
  default box.

  Raises:
    UploadRefused: regions the metadata alone cannot rebuild (element
      classes, a file of regions per client).
  """
  defense = record.metadata["defense"]
  regions = defense.get("regions")
  height, width = record.model_spec.input_shape[:2]
  # element classes or a file name, or a run that did not publish them
  if "regions" not in defense or regions and any(c.isalpha() for c in regions):
    raise UploadRefused(f"FedRE declares its region as boxes only; round "
                        f"{record.round_num} client {record.client_index} "
                        f"was uploaded with regions={regions!r}")
  boxes = (psi.parse_boxes(regions, name="regions") if regions else
           [default_box(height, width)])
  return psi.box_mask(boxes, height, width).astype(np.float32)[None, :, :, None]


METHOD = Method("fedre", PARAMETERS, algorithm,
                "layer-wise local DP split by PSI scores of a private region, "
                "PDA-PAM aggregation", needs_federation=True,
                disclosure=Disclosure(noise_levels=noise_levels,
                                      sensitive_region=sensitive_region),
                # the leaderboards' region is the digit's centre; PSI on few
                # samples and pixels keeps the compact row near a minute
                listing=Listing(
                    "FedRE", "epsilon", 50.0, (10.0, 50.0, 1000.0, 10000.0),
                    kwargs={"regions": "7,7,21,21", "psi_samples": 2,
                            "psi_pixels": 8, "public_samples": 2,
                            "client_learning_rate": 0.05},
                    full_kwargs={"psi_samples": 10, "psi_pixels": None,
                                 "public_samples": 10},
                    seconds=88.4))
METHODS.register(METHOD)
