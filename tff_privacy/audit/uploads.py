"""Audits of a per-upload claim, one upload at a time.

A local mechanism's epsilon says how well the server can tell any two
uploads of a client apart. The audit makes it tell: each of m canaries is a
random direction taken to the edge of what the defence lets through
(`UpdateDefense.canary`: the clip norm along it), included with probability
1/2. The client's update is the canary where it is included and its
farthest neighbour where not (`UpdateDefense.neighbour`: its negation for
two uploads; zeros where the relation adds or removes a record); the
mechanism's own `apply` (its clipping and noise, its seeds) makes each
upload, and the attacker scores it by its inner product with the canary
(`UpdateDefense.canary_score`, weighted where the noise differs between
tensors). `one_run.audit_scores` turns the scores into Steinke et al.'s
lower bound on the epsilon of one upload, beside what the mechanism claims
for one upload (`claimed_epsilon`). The same runs methods' own mechanisms
(`Algorithm.audited_mechanism`), whose canaries are records: FedRE's
noise and DP-SGD's steps, fed a white-box gradient canary.

Each upload is a separate run of the mechanism with its own noise, so the
m trials are independent and the bound is about one upload's epsilon.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import dp_accounting
import numpy as np
import tensorflow as tf

from tff_privacy.audit import one_run, one_shot
from tff_privacy.defenses.updates import UpdateDefense, flatten, unflatten
from tff_privacy.dp import accounting

DEFAULT_CANARIES = 1000
_CHUNK = 64  # canaries noised in one call


def _uploads(defense: UpdateDefense, like: list[tf.Tensor]):
  """(flat updates [n, d], seeds [n, 2]) -> the defence's flat uploads, one
  application per row with its own seed."""
  def one(row):
    flat, seed = row
    return flatten(defense.apply(unflatten(flat, like), seed))
  return tf.function(
      lambda flats, seeds: tf.map_fn(one, (flats, seeds),
                                     fn_output_signature=tf.float32),
      autograph=False)


def claimed_epsilon(defense: UpdateDefense, num_params: int,
                    delta: float) -> Optional[float]:
  """What `defense` claims for one upload of `num_params` entries: its DP
  event's epsilon at `delta` (Gaussian and Laplace events in closed form,
  others by the PLD accountant: exact for the event), or its pure epsilon;
  None for a defence without a claim. The event is the defence's own
  reading: L2-clipped Laplace's L1 sensitivity 2 sqrt(d) C is attained
  only by a sign vector, and LDP-Fed composes its per-entry claims over
  every entry, so their claims are loose and may lie beyond what the
  canaries can show (`epsilon_reachable`)."""
  event = defense.dp_event(num_params)
  if isinstance(event, dp_accounting.GaussianDpEvent):
    return accounting.gaussian_epsilon_once(event.noise_multiplier, delta)
  if isinstance(event, dp_accounting.LaplaceDpEvent):
    return accounting.laplace_epsilon_once(event.noise_multiplier, delta)
  if event is not None:
    return accounting.epsilon(event, delta, "pld")
  return defense.pure_epsilon(num_params)


def audit_defense(defense: UpdateDefense, shapes: Sequence[Sequence[int]],
                  delta: float, canaries: int = DEFAULT_CANARIES, seed: int = 0,
                  confidence: float = one_run.CONFIDENCE) -> dict:
  """The per-upload audit of `defense` on updates of tensors `shapes`.

  Returns:
    {'epsilon_claimed' (one upload; None without a claim),
    'epsilon_estimate' (`one_shot`'s; None at delta 0, where `one_shot`
    gives none, or unbounded: no spread, no noise) with its interval
    'epsilon_estimate_ci' (`one_shot.reported_fields`), 'relation' (the
    defence's neighbouring relation), 'unit' (what it protects: one
    upload, or one record for FedRE's sensitivity 'sample'), 'applied_to':
    'one upload', and
    `one_run.Audit`'s fields: 'canaries', 'guesses', 'right',
    'epsilon_lower_bound', 'epsilon_interval', 'epsilon_reachable',
    'confidence', 'delta'}.

  Raises:
    ValueError: the defence declares no canary (no per-upload claim to
      audit), canaries < 2, or as `one_run.audit_scores`.
  """
  if not isinstance(canaries, int) or canaries < 2:
    raise ValueError(f"canaries must be an integer >= 2, got {canaries!r}")
  like = [tf.zeros(s, tf.float32) for s in shapes]
  num_params = sum(math.prod(s) for s in shapes)
  rng = np.random.default_rng(seed)
  if defense.canary(rng.standard_normal(num_params)) is None:
    raise ValueError(f"defense {defense.name!r} makes no per-upload claim to "
                     "audit (it declares no canary)")
  upload = _uploads(defense, like)
  included = rng.random(canaries) < 0.5
  scores = np.empty(canaries)
  for start in range(0, canaries, _CHUNK):
    rows = range(start, min(start + _CHUNK, canaries))
    marked = np.stack([defense.canary(rng.standard_normal(num_params))
                       for _ in rows]).astype(np.float32)
    inputs = np.where(included[start:rows.stop, None], marked,
                      defense.neighbour(marked)).astype(np.float32)
    seeds = np.array([[seed, j] for j in rows], np.int64)
    noised = upload(tf.constant(inputs), tf.constant(seeds)).numpy()
    scores[start:rows.stop] = defense.canary_score(noised, marked)
  audit = one_run.audit_scores(scores, included, delta, confidence)
  return {"epsilon_claimed": claimed_epsilon(defense, num_params, delta),
          **(one_shot.reported_fields(scores, included, delta) if delta > 0 else
             {"epsilon_estimate": None, "epsilon_estimate_ci": None}),
          "relation": defense.dp_relation, "unit": accounting.protected(
              defense.dp_relation), "applied_to": "one upload", **audit.to_json()}
