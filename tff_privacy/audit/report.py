"""`tff-privacy audit --run DIR`: every audit that applies to a run, in
DIR/audit.json.

* The canary audit: per upload (`uploads`) where the run's client-side
  defence declares a canary (its local DP claim) or its method runs a
  mechanism (`Algorithm.audited_mechanism`: FedRE's noise under either
  sensitivity, DP-SGD's steps; the largest client of the last round),
  per round (`clients`) for DP-FedAvg's client-level claim, and over the
  whole training where it ran with canary clients ('canary_clients',
  `clients.audit_training`): the claimed epsilon of that one application
  beside the lower bound on it, with interval and confidence, and the
  relation audited; 'claim_refuted' where the bound exceeds the claim.
* Membership inference on the final model (`membership`), for every run.
* Beside them, what the whole run claims (metrics.json's last epsilon,
  composed over its rounds, and its relation).

What does not apply, or cannot be computed, is named with the reason.
Claims made inside the local steps (DP-SGD: the DP-SGD baselines, FedRE
with noise_on='steps') are audited per upload of one record's white-box
gradient canary (`tff_privacy.algorithms.local_dp_sgd.StepsCanary`).
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tff_privacy import defenses, io, provenance, runner
from tff_privacy.algorithms.client_data import SEED_KEY
from tff_privacy.audit import clients, membership, uploads
from tff_privacy.defenses.central import DPFedAvg
from tff_privacy.defenses.updates import ClientView
from tff_privacy.updates import UpdateStore

AUDIT_FILE = "audit.json"
# audit.json's format: 2 audits methods' own mechanisms and canary clients
FORMAT = 2


def audit_run(run_dir: str, canaries: int = uploads.DEFAULT_CANARIES,
              mia_samples: int = membership.DEFAULT_SAMPLES,
              seed: int = 0) -> dict[str, Any]:
  """Audits the run in `run_dir` and writes `run_dir`/audit.json.

  Raises:
    ValueError: no run in `run_dir`, canaries < 2, mia_samples <
      `membership.FEWEST_SAMPLES`, or a weights file without the model's
      variables.
  """
  config = membership.run_config(run_dir)
  result = {"format": FORMAT, "run": os.path.abspath(run_dir), "method": config.method,
            "defense": config.defense,
            "defense_kwargs": config.defense_kwargs or {},
            **run_claim(run_dir),
            **_canary_audit(run_dir, config, canaries, seed),
            "canary_clients": _training_audit(run_dir, config),
            "membership_inference": membership.membership_inference(
                run_dir, mia_samples, seed),
            provenance.KEY: [provenance.code_version()]}
  mia = result["membership_inference"]
  result["mia_auc"] = mia.get("mia_auc")
  io.write_json(os.path.join(run_dir, AUDIT_FILE), result)
  return result


def run_claim(run_dir: str) -> dict[str, Any]:
  """What the whole run claims (its last round's epsilon, composed over the
  rounds, and relation, from metrics.json); None where it claims none."""
  path = os.path.join(run_dir, "metrics.json")
  last = io.read_json(path)[-1] if os.path.exists(path) else {}
  return {"epsilon_claimed_run": last.get("epsilon"), "delta": last.get("delta"),
          "relation_run": last.get("dp_relation")}


def _canary_audit(run_dir: str, config, canaries: int, seed: int) -> dict[str, Any]:
  """The canary audit's fields (per upload for a local DP defence, per
  round for a central one), or its reason for being left out."""
  if not isinstance(canaries, int) or canaries < 2:
    raise ValueError(f"canaries must be an integer >= 2, got {canaries!r}")
  audit, why = None, _not_audited(run_dir, config)
  if why is None and config.defense is None:
    audit, why = _method_audit(run_dir, config, canaries, seed)
  elif why is None and defenses.is_client_side(config.defense):
    audit = uploads.audit_defense(
        defenses.build(config.defense, **config.defense_kwargs),
        _shapes(run_dir, config), config.dp_delta, canaries, seed)
  elif why is None:
    audit = clients.audit_round(
        defenses.build(config.defense, **config.defense_kwargs),
        _shapes(run_dir, config), config.dp_delta, config.sampled_per_round,
        canaries, seed)
  if audit is None:
    return {"canary_audit": {"computed": False, "reason": why},
            "epsilon_claimed": None, "epsilon_lower_bound": None}
  claimed, bound = audit["epsilon_claimed"], audit["epsilon_lower_bound"]
  return {"canary_audit": {"computed": True, **audit},
          "epsilon_claimed": claimed, "epsilon_lower_bound": bound,
          "epsilon_interval": audit["epsilon_interval"],
          "confidence": audit["confidence"], "relation": audit["relation"],
          "unit": audit["unit"], "applied_to": audit["applied_to"],
          "canaries": audit["canaries"],
          "claim_refuted": _refuted(claimed, audit)}


def _training_audit(run_dir: str, config) -> dict[str, Any]:
  """The audit of the whole training by its canary clients (DP-FedAvg
  with audit_canaries, `clients.audit_training`), or why there is none."""
  if config.defense is None or defenses.defense_class(config.defense) is not DPFedAvg:
    return {"computed": False, "reason": "canary clients go with defense 'dp_fedavg'"}
  defense = defenses.build(config.defense, **config.defense_kwargs)
  if not defense.audit_canaries:
    return {"computed": False, "reason": "the run trained without canary clients "
            "(--audit-canaries)"}
  if not os.path.exists(os.path.join(run_dir, membership.MODEL_WEIGHTS)):
    return {"computed": False, "reason": "the run has not finished (no final model)"}
  spec = membership.spec_of(config)
  path = os.path.join(run_dir, runner.CANARY_COSINES)
  every_round = np.load(path)["cosines"] if os.path.exists(path) else None
  if every_round is not None and len(every_round) != config.rounds:
    every_round = None  # a run resumed past rounds trained without them
  audit = clients.audit_training(
      defense, spec.initial_weights(config.seed), runner.load_model_weights(run_dir, spec),
      config.clients, config.sampled_per_round, config.rounds, config.dp_delta,
      config.seed, every_round)
  claimed = audit["epsilon_claimed"]
  if "every_round" in audit:
    audit["every_round"]["claim_refuted"] = _refuted(claimed, audit["every_round"])
  return {"computed": True, **audit, "claim_refuted": _refuted(claimed, audit)}


def _refuted(claimed: Optional[float], audit: dict) -> Optional[bool]:
  """Whether `audit`'s lower bound exceeds the `claimed` epsilon; None
  without a claim."""
  return None if claimed is None else bool(audit["epsilon_lower_bound"] > claimed)


def _not_audited(run_dir: str, config) -> Optional[str]:
  """Why the run's claim has no canary audit here; None where it has."""
  if config.defense is None:
    return None  # the method's own claim, if any: `_method_audit`
  cls = defenses.defense_class(config.defense)
  if cls is DPFedAvg:
    return None
  if not defenses.is_client_side(config.defense):
    return f"defense {config.defense!r}: its claim is not audited yet"
  if cls.canary is defenses.UpdateDefense.canary:
    return f"defense {config.defense!r} makes no per-upload claim"
  return None


def _method_audit(run_dir: str, config, canaries: int, seed: int):
  """(audit, None) of the mechanism a method runs on its clients
  (`Algorithm.audited_mechanism`: FedRE's noise, DP-SGD's steps), per
  upload of the largest client of the run's last round, or (None, why
  not)."""
  run = runner.Run(config)
  mechanism, algorithm = run.algorithm.audited_mechanism, run.algorithm
  shapes = _shapes(run_dir, config)
  num_params = sum(math.prod(s) for s in shapes)
  claims = ((algorithm.dp_event and algorithm.dp_event(num_params)) is not None or (
      algorithm.pure_epsilon and algorithm.pure_epsilon(num_params)) is not None)
  if mechanism is None and not claims:
    return None, (f"the run has no defence and method {config.method!r} claims "
                  "no epsilon: no claim to audit")
  if mechanism is None:
    return None, (f"method {config.method!r} declares no mechanism to audit "
                  "(Algorithm.audited_mechanism)")
  last = runner.sample_clients(config, config.rounds)
  client = int(last[np.argmax([len(run.fed.client_indices[c]) for c in last])])
  view = _client_view(run, client, run_dir)
  # under the client's own round seed, as the run drew it
  fixed = mechanism.for_client(view, view.inputs[SEED_KEY])
  return uploads.audit_defense(fixed, shapes, config.dp_delta, canaries, seed), None


def _client_view(run: "runner.Run", client: int, run_dir: str) -> ClientView:
  """What client `client` sees at the run's last round: its batches and
  inputs, with the final global model (the initial one without it) in
  place of that round's broadcast, which the run does not keep. A data-
  dependent split (FedRE's PSI) is then one the run could have drawn, not
  the one it drew; the claims hold for every split."""
  config, indices = run.config, run.fed.client_indices[client]
  order = indices[runner.local_order(len(indices), run.algorithm, config,
                                     config.rounds, client)]
  source = run.fed.source
  dataset = runner.client_dataset(
      source.x_train[order], source.y_train[order],
      runner.local_batches(len(indices), run.algorithm, config))
  weights = (runner.load_model_weights(run_dir, run.spec)
             if os.path.exists(os.path.join(run_dir, membership.MODEL_WEIGHTS))
             else run.spec.initial_weights(config.seed))
  inputs = run.algorithm.client_inputs(client, config.rounds)
  return ClientView([tf.constant(w) for w in weights], dataset,
                    {k: tf.constant(v) for k, v in inputs.items()})


def _shapes(run_dir: str, config) -> list[tuple[int, ...]]:
  """The shapes of the run's uploads: a captured upload's, else the model's
  trainable variables'."""
  store = UpdateStore(os.path.join(run_dir, "updates"))
  rounds = store.rounds() if os.path.isdir(store.root) else []
  if rounds:
    record = store.read(rounds[0], store.clients(rounds[0])[0])
    return [tuple(u.shape) for u in record.upload]
  spec = membership.spec_of(config)
  return [tuple(v.shape) for v in spec.keras().trainable_variables]
