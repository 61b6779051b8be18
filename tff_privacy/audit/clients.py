"""Audit of a client-level (central DP) claim, one round's aggregation at a
time, after Andrew et al. (ICLR 2024, "One-shot Empirical Privacy
Estimation for Federated Learning").

m canary clients take part in one call of the defence's own TFF
aggregation process (`DPFedAvg.aggregator`: clipping, the noised sum,
the division by the clients of a round). Canary j's update is a random
unit direction scaled to twice the clip norm, so that clipping acts; each
canary is included with probability 1/2, and an excluded one uploads
zeros, which is the same sum as its absence under a fixed denominator. In
high dimension random directions are nearly orthogonal, so every canary is
scored in the one released aggregate: the score is the aggregate's inner
product with the canary's direction. `one_run.audit_scores` gives Steinke
et al.'s lower bound on the epsilon of one round for adding or removing
one client, beside the round's claimed epsilon and `one_shot`'s estimate.

This audits the mechanism each round applies, without client sampling,
for adding or removing one client (its sum moves by C: the Gaussian
mechanism at multiplier z). A run that samples a fixed number of clients
accounts each round for replacing one client instead (the sum moves by 2C:
multiplier z / 2, then amplified by sampling) and composes the rounds;
one round's add-or-remove audit checks the noise and clipping those
claims rest on, not the composition. Memory: the canaries' directions,
canaries x parameters float32, and their updates as much again.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import numpy as np
import tensorflow_federated as tff

from tff_privacy.audit import one_run, one_shot
from tff_privacy.audit.uploads import DEFAULT_CANARIES
from tff_privacy.defenses.central import DPFedAvg
from tff_privacy.dp import accounting, queries

_PAST_CLIP = 2.0  # canaries' norm over the clip norm


def audit_round(defense: DPFedAvg, shapes: Sequence[Sequence[int]], delta: float,
                clients_per_round: int, canaries: int = DEFAULT_CANARIES,
                seed: int = 0, confidence: float = one_run.CONFIDENCE) -> dict:
  """The one-round audit of `defense` on updates of tensors `shapes`.

  Returns:
    {'epsilon_claimed' (one round, all clients taking part), 'epsilon_estimate'
    with its interval 'epsilon_estimate_ci' (`one_shot.reported_fields`),
    'relation', 'unit': "a client's data", 'applied_to': 'one round', and
    `one_run.Audit`'s fields}.

  Raises:
    ValueError: canaries < 2, or as `one_run.audit_scores`.
  """
  if not isinstance(canaries, int) or canaries < 2:
    raise ValueError(f"canaries must be an integer >= 2, got {canaries!r}")
  rng = np.random.default_rng(seed)
  num_params = sum(math.prod(s) for s in shapes)
  directions = rng.standard_normal((canaries, num_params), dtype=np.float32)
  directions /= np.linalg.norm(directions, axis=1, keepdims=True)
  included = rng.random(canaries) < 0.5
  updates = [_split(defense.clip * _PAST_CLIP * direction * keep, shapes)
             for direction, keep in zip(directions, included)]
  # the round's own canaries only, without a training's canary clients
  plain = DPFedAvg(defense.clip, defense.noise_multiplier)
  process = plain.aggregator(clients_per_round, seed).create(
      tff.to_type([tff.TensorType(np.float32, s) for s in shapes]),
      tff.TensorType(np.float32))
  released = process.next(process.initialize(), updates, [1.0] * canaries).result
  flat = np.concatenate([np.ravel(t) for t in released])
  scores = directions @ flat
  audit = one_run.audit_scores(scores, included, delta, confidence)
  claimed = (None if defense.noise_multiplier == 0 else
             accounting.gaussian_epsilon_once(defense.noise_multiplier, delta))
  return {"epsilon_claimed": claimed,
          **one_shot.reported_fields(scores, included, delta),
          "relation": defense.dp_relation,
          "unit": accounting.protected(defense.dp_relation),
          "applied_to": "one round", **audit.to_json()}


TRAINING_RELATION = ("central DP, user level: adding or removing one canary "
                     "client, which takes part in each round independently "
                     "with a client's chance")


@functools.lru_cache(maxsize=1)
def _directions(shapes: tuple, count: int, seed: int) -> np.ndarray:
  """[count, parameters]: `queries.canary_directions`, flat (kept for a
  run's rounds: canaries x parameters float32)."""
  return np.concatenate([d.numpy().reshape(count, -1) for d in
                         queries.canary_directions(shapes, count, seed)], axis=1)


def canary_cosines(count: int, seed: int, before: Sequence[np.ndarray],
                   after: Sequence[np.ndarray]) -> np.ndarray:
  """The cosine between each of `count` canary clients' directions (seeded
  by `seed`) and the model's descent from `before` to `after`, before -
  after: the server steps against the aggregate, which holds C u_j in the
  rounds canary j took part in."""
  shapes = tuple(tuple(np.shape(w)) for w in before)
  descent = np.concatenate([np.ravel(a) - np.ravel(b) for a, b in zip(before, after)])
  return _directions(shapes, count, seed) @ descent / max(
      float(np.linalg.norm(descent)), 1e-30)


def audit_training(defense: DPFedAvg, initial: Sequence[np.ndarray],
                   final: Sequence[np.ndarray], num_clients: int,
                   clients_per_round: int, rounds: int, delta: float, seed: int,
                   every_round: Optional[np.ndarray] = None,
                   confidence: float = one_run.CONFIDENCE) -> dict:
  """The audit of a whole DP-FedAvg training that ran with canary clients
  (`defense.audit_canaries`, `tff_privacy.dp.queries.CanaryClientsQuery`
  seeded by the run's `seed`), from its `initial` and `final` models: each
  canary is scored by its cosine with the model's descent w_0 - w_T
  (`canary_cosines`), inserted canaries against held-out ones, as Andrew
  et al. do with the final model. Given `every_round`, the runner's
  cosines of each round's descent ([rounds, canaries]), an adversary who
  sees every round's model scores each canary by the largest of its
  cosines. The claim, the same for both, is the training's for one canary
  client (`DPFedAvg.canary_event`).

  Returns:
    As `audit_round`, with 'applied_to': 'the whole training'; with
    `every_round`, 'every_round': the same fields of that adversary's
    audit.

  Raises:
    ValueError: the run had no canary clients, or as
      `one_run.audit_scores`.
  """
  count = defense.audit_canaries
  if count < 2:
    raise ValueError("the run trained without canary clients (audit_canaries)")
  included = queries.inserted_canaries(count, seed)

  def scored(scores) -> dict:
    return {**one_shot.reported_fields(scores, included, delta),
            **one_run.audit_scores(scores, included, delta, confidence).to_json()}

  event = defense.canary_event(num_clients, clients_per_round, rounds)
  result = {"epsilon_claimed": None if event is None else
            accounting.epsilon(event, delta, "pld"),
            "relation": TRAINING_RELATION, "unit": accounting.protected(TRAINING_RELATION),
            "applied_to": "the whole training",
            **scored(canary_cosines(count, seed, initial, final))}
  if every_round is not None:
    result["every_round"] = scored(np.max(every_round, axis=0))
  return result


def _split(flat: np.ndarray, shapes: Sequence[Sequence[int]]) -> list[np.ndarray]:
  sizes = [math.prod(s) for s in shapes]
  parts = np.split(flat.astype(np.float32), np.cumsum(sizes)[:-1])
  return [p.reshape(s) for p, s in zip(parts, shapes)]
