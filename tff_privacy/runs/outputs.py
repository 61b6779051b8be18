"""What a round reports and a run leaves: measurements of the round's
clients and server step, the captured uploads and their fidelity, the
attack success rates of attribute inference, and the final models.

`metrics.json` holds one entry per finished round (`test_<metric>` of the
global model on the test set for every metric of the data set's task:
`test_accuracy` and `test_loss` for classification, `test_iou`,
`test_precision`, `test_recall`, `test_f_score` and `test_loss` for
segmentation, and `samples_tested`, how many test samples they score;
`personal_<metric>_mean` for every metric, with
`personal_<primary metric>_std` / `_min`, of each client's own model on
its own test split, over the clients that have test samples,
`personal_<primary metric>_by_client`, the list of each of those
clients' own values in client order (not a TensorBoard scalar), and
`clients_without_test_data`, how many were left out; with evaluate
'local-after-training', the same `local_after_training_<metric>_mean`,
`_std` and `_min` of the round's clients' models after their local
training, before aggregation (the HyperFL paper's "local models"), and
`local_after_training_clients`, how many were scored;
`train_loss`, `seconds`, ...; with a client-side defence that acts on
the update (not an input perturbation such as FedRE's 'pixels')
`unperturbed_share`, the share of the round's uploads it left exactly
unchanged, and its own measurements as `<defence>/<name>`, e.g.
`recupfl/zero_gradient_steps`, those it keeps per client as {client
index: value} of the round's clients, e.g. `fedre/tensor_epsilons`
(`client_defense_measurements`); at
captured rounds the aggregate update's
`update_cosine` and `update_relative_error` against the clients' clean
uploads, or `update_error_unavailable` and why (`update_fidelity`), and
with `infer_attributes` the attack success rates with their 95%
intervals).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import tensorflow as tf

from tff_privacy import data, evaluate, io, models
from tff_privacy.attacks import attribute as attribute_inference
from tff_privacy.attacks import functional
from tff_privacy.metrics.updates import UndefinedFidelity, aggregate_fidelity
from tff_privacy.updates import GroundTruthStore, UpdateStore

if TYPE_CHECKING:  # annotations only: the runner imports this module
  from tff_privacy.runner import Run


def spread(prefix: str, primary: str,
           per_client: list[dict[str, float]]) -> dict[str, float]:
  """'<prefix>_<metric>_mean' of every metric over clients' scores, and
  '_std' and '_min' of the `primary` one; empty without clients."""
  out = {}
  for name in per_client[0] if per_client else ():
    values = np.array([s[name] for s in per_client])
    out[f"{prefix}_{name}_mean"] = float(values.mean())
    if name == primary:
      out.update({f"{prefix}_{primary}_std": float(values.std()),
                  f"{prefix}_{primary}_min": float(values.min())})
  return out


def shown_metrics(primary: str, entry: dict) -> dict[str, str]:
  """The progress bar's view of an evaluated round: the primary metric of
  the global model, else of the clients' own models."""
  value = entry.get(f"test_{primary}", entry.get(f"personal_{primary}_mean"))
  return {} if value is None else {primary: f"{value:.4f}"}


def server_step_measurements(metrics) -> dict:
  """What a round's server step reports, for metrics.json:
  `server_update_rejected` (1 when TFF's finalizer rejected a non-finite
  aggregate, so the global model did not move) and a custom server
  aggregation's measurements (`server_aggregation/<name>`, per tensor
  lists as they come)."""
  out = {}
  finalizer = metrics.get("finalizer") or {}
  if "update_non_finite" in finalizer:
    out["server_update_rejected"] = int(finalizer["update_non_finite"])
  for name, value in (metrics.get("server_aggregation") or {}).items():
    value = np.asarray(value)
    out[f"server_aggregation/{name}"] = (value.item() if value.ndim == 0
                                         else value.tolist())
  return out


def train_measurements(train) -> dict[str, float]:
  """A round's train loss and accuracy (`train`: the client work's train
  metrics), NaN where no client's training stayed finite: TFF's client work
  drops the metrics of a client whose model change is not finite, and its
  Keras means read the empty sums as 0."""
  if "num_examples" in train and float(train["num_examples"]) == 0:
    return {"train_loss": float("nan"), "train_accuracy": float("nan")}
  return {"train_loss": float(train["loss"]),
          "train_accuracy": float(train["sparse_categorical_accuracy"])}


def client_defense_measurements(metrics, clients: Sequence[int] = ()) -> dict:
  """What a round's client-side defence reports, for metrics.json, averaged
  over the round's clients: `unperturbed_share` (the share of uploads it
  left exactly as they were; only from a defence that acts on the update,
  `UpdateDefense.acts_on_update`) and its own measurements as
  '<defence>/<name>' (`tff_privacy.algorithms.defended`); its
  `per_client_measurements` as '<defence>/<name>': {client index (a
  string): its row, as a list} for each of the round's `clients`."""
  out = {}
  for name, value in (metrics["client_work"].get("defense") or {}).items():
    if isinstance(value, dict):
      out.update({f"{name}/{k}": float(v) for k, v in value.items()})
    else:
      out[name] = float(value)
  for name, value in (metrics["client_work"].get("defense_per_client")
                      or {}).items():
    out.update({f"{name}/{k}": {str(c): np.asarray(rows)[c].tolist()
                                for c in clients}
                for k, rows in value.items()})
  return out


MODEL_WEIGHTS = "model_weights.npz"  # the final global model, by variable name


PERSONAL_MODELS = "personal_models.npz"  # personalised: 'client_0003/conv1/kernel'


# DP-FedAvg's canary clients: each round's cosines, 'cosines' [rounds, canaries]
CANARY_COSINES = "canary_cosines.npz"


def record_canary_cosines(r: Run, round_num: int, before, after) -> None:
  """Round `round_num`'s cosine between each canary client's direction and
  the model's descent, appended to CANARY_COSINES (rows past the rounds a
  resumed run kept are dropped), for the audit of every round's model
  (`tff_privacy.audit.clients.audit_training`)."""
  from tff_privacy.audit import clients  # here: tff_privacy.audit imports the runner
  path = os.path.join(r.config.out, CANARY_COSINES)
  kept = np.load(path)["cosines"][:round_num - 1] if os.path.exists(path) else []
  now = clients.canary_cosines(r.central.audit_canaries, r.config.seed, before, after)
  io.write_npz(path, {"cosines": np.concatenate([np.reshape(kept, (-1, len(now))),
                                                 now[None]])})


def write_final_models(r: Run, state) -> None:
  names = r.spec.variable_names()
  if not r.personalized:
    io.write_npz(os.path.join(r.config.out, MODEL_WEIGHTS),
                 dict(zip(names, r.server_weights(state))))
    return
  io.write_npz(os.path.join(r.config.out, PERSONAL_MODELS), {
      f"{data.client_id(c)}/{name}": w
      for c, weights in enumerate(r.personal_weights(state))
      for name, w in zip(names, weights)})


def load_model_weights(out: str, spec: models.ModelSpec) -> list[np.ndarray]:
  """The final global model of the run in `out`, in the model's order."""
  with np.load(os.path.join(out, MODEL_WEIGHTS)) as f:
    return [f[name] for name in spec.variable_names()]


def write_capture(r: Run, round_num: int, broadcast, clients, captured,
                   sent=None) -> None:
  count = int(captured["num_uploads"])
  if count != len(clients):
    raise RuntimeError(f"captured {count} uploads from {len(clients)} clients")
  uploads = [(c.index, data.client_id(c.index), [u[i] for u in captured["uploads"]],
              captured["upload_weights"][i], len(c.samples))
             for i, c in enumerate(clients)]
  meta = r.run_metadata()
  defense_round = (r.client_defense.defense_round(round_num)
                   if r.client_defense is not None else None)
  UpdateStore(os.path.join(r.config.out, "updates")).write_round(
      round_num, None if broadcast is None else list(broadcast), uploads, meta,
      sent, defense_round)
  GroundTruthStore(os.path.join(r.config.out, "ground_truth")).write_round(
      round_num, [(c.index, c.x, c.y, c.attributes) for c in clients],
      {"dataset": meta["dataset"], "value_range": meta["value_range"],
       **{k: meta[k] for k in ("normalize",) if k in meta},
       **_attribute_classes(r.fed.source)})


def clean_uploads_unavailable(r: Run, clients) -> Optional[str]:
  """Why `functional.simulate_upload` cannot reproduce exactly, from their
  samples in their order, the uploads that `clients` (from `round_data`)
  would send without a defence, decided by construction of the protocol;
  None where it can: one gradient of the client's batch (FedSGD), or local
  SGD over the client's samples in the order `local_order` drew them, which
  one epoch keeps (and more epochs keep where every client's samples fit
  one batch)."""
  a, method = r.algorithm, f"method {r.config.method!r}"
  if r.personalized:
    return f"{method} keeps private client state: its clients train their own models"
  if a.upload_kind not in attribute_inference.UPLOAD_KINDS:
    return f"{method} uploads {a.upload_kind}, which is not simulated"
  if r.central:
    return (f"defense {r.config.defense!r} noises the aggregate on the server, "
            "after the uploads")
  if "dp_sample_rate" in a.protocol:
    return (f"{method} draws its DP-SGD batches at random and clips and noises "
            "every step")
  if a.protocol.get("aggregation", "mean") != "mean":
    return (f"the server aggregates by {a.protocol['aggregation']}, not by a "
            "weighted mean")
  if (a.upload_kind == "model_delta" and a.local_epochs > 1
      and any(len(c.samples) > r.config.batch_size for c in clients)):
    return (f"each of the {a.local_epochs} local epochs shuffles a client's "
            "samples into new batches")
  return None


def update_fidelity(r: Run, broadcast: Sequence[np.ndarray], clients,
                    captured) -> dict[str, Any]:
  """metrics.json's utility of a captured round's aggregate update: the
  weighted mean of the captured uploads (weights as the server's
  aggregator got them) against the same weighted mean of the same clients'
  clean uploads at the same `broadcast` model (`functional.simulate_upload`
  from their samples), as 'update_cosine' and 'update_relative_error'
  (`tff_privacy.metrics.updates.aggregate_fidelity`); without a defence,
  cosine 1 and error 0 up to rounding. Clients of weight 0 (TFF's for a
  non-finite update, which it sends as zeros) are left out of both means.
  Where the clean uploads cannot be reproduced
  (`clean_uploads_unavailable`), no client has a positive weight, or an
  aggregate is zero or not finite, 'update_error_unavailable' says why
  instead."""
  reason = clean_uploads_unavailable(r, clients)
  if reason is None:
    defended = [[u[i] for u in captured["uploads"]] for i in range(len(clients))]
    try:
      return aggregate_fidelity(_clean_uploads(r, broadcast, clients), defended,
                                captured["upload_weights"][:len(clients)])
    except UndefinedFidelity as e:
      reason = str(e)
  return {"update_error_unavailable": reason}


def _clean_uploads(r: Run, broadcast, clients) -> list[list[np.ndarray]]:
  """What each of `clients` uploads without a defence at `broadcast`."""
  model, weights = r.spec.keras(), [tf.constant(w) for w in broadcast]
  return [[u.numpy() for u in functional.simulate_upload(
      model, weights, tf.constant(c.x), tf.one_hot(c.y, r.spec.num_classes),
      r.algorithm.upload_kind, r.algorithm.protocol, task=r.spec.task_object)]
          for c in clients]


def round_attribute_rates(r: Run, round_num: int) -> dict[str, float]:
  """metrics.json's attack success rates of the round's captured uploads:
  'asr/<attribute>/<adversary>', 'balanced_asr/<attribute>/<adversary>',
  their 95% intervals [low, high] ('asr_ci/...', 'balanced_asr_ci/...';
  lists, which TensorBoard leaves out) and their chance rates
  ('.../chance'); with `adaptive_adversaries`, the same rates and intervals
  of the adaptive adversaries prefixed 'adaptive_'."""
  entry = {}
  for adaptive in (False, True)[:1 + r.config.adaptive_adversaries]:
    prefix = "adaptive_" if adaptive else ""
    for a in r.config.infer_attributes:
      result = evaluate.infer_attributes_round(
          os.path.join(r.config.out, "updates"), round_num, a,
          adversaries=r.config.attribute_adversaries,
          shadow_samples=r.config.attribute_shadow_samples,
          shadow_pool=r.config.attribute_shadow_pool, seed=r.config.seed,
          source=r.fed.source, adaptive=adaptive)
      for kind in ("asr", "balanced_asr", "asr_ci", "balanced_asr_ci"):
        entry.update({f"{prefix}{kind}/{a}/{n}": v for n, v in result[kind].items()})
      if not adaptive:
        entry[f"asr/{a}/chance"] = result["chance"]
        entry[f"balanced_asr/{a}/chance"] = result["balanced_chance"]
  return entry


def _attribute_classes(source) -> dict[str, Any]:
  if source.attributes is None:
    return {}
  return {"attributes": {a: list(c) for a, c in source.attributes.classes.items()}}
