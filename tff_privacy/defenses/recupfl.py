"""RECUP-FL's defensive perturbation of an upload (Appendix Algorithm 1,
eqs. 4-9, and the FGSM variants of Appendix E).

A client protects attribute a of its data against an attacker who infers it
from its upload. It holds a zoo S of defender models, each mapping a
max-pooled upload (its bins' `first_maxima`, the adversaries' features:
`tff_privacy.attacks.attribute.pooled`) to logits over a's classes, and
moves its upload w so that they mispredict a. With P iterations of Q models
sampled from the zoo and budget epsilon, 'recupfl' (Algorithm 1) is, from
w^0 = w:

```text
for p = 1..P:
  x = w^(p-1)
  meta-train (eq. 5), q = 1..Q-1:  x = x + (epsilon / Q) sign(d CE(S_q(x), a) / dx)
  meta-test (eq. 6):               step = epsilon sign(d CE(S_Q(x), a) / dx)
  w^p = w^(p-1) + step             (eqs. 7-8, line 22)
```

and the attribute's perturbation is w^P - w. Only the meta-test steps reach
the upload; the meta-train steps choose where the meta-test gradient is
taken. Each entry therefore moves by a multiple of epsilon, at most P
epsilon. The defender's loss g_q of eq. 5 is taken to be the cross-entropy,
the loss the zoo is trained with, so meta-train and meta-test differ in
their step and their model only. The gradient reaches an upload entry only
through the first maximum of its pooling bin, as PyTorch's max_pool1d
routes it: a step moves at most one entry per bin, also where entries tie
(most entries of a one-record gradient are exactly 0).

The steps' signs are taken, by default (attack_loss 'logit_margin'), from
the gradient of L' = logsumexp_{c != a} z_c - z_a of the defender's logits
z at the true class a instead of CE = logsumexp_c z_c - z_a itself:
d CE / dz = (1 - p_a) d L' / dz with p = softmax(z), a positive factor, so
in exact arithmetic both give the same signs, hence the same steps (and the
same momentum directions, which are normalised). In float32 they part once
z_a leads the other logits by about 17 (the defenders standardise the
pooled upload by per-feature scales that are tiny for mostly-zero entries,
so budgets near 0.1 give logits in the thousands): p_a rounds to 1, so
CE's d / dz = p - e_a loses its entry at a, while the other p_c stay
positive until they underflow at a lead of about 87. CE's gradient at the
upload is then sum_{c != a} p_c J_c (J_c = d z_c / dx) without the -J_a
term: for a binary defender (logits [0, z], J_0 = 0) exactly 0 at a = 1 and
along L''s at a = 0; with more classes non-zero but pointing elsewhere than
L''s (so not counted by `measured_perturbation`'s zero-gradient share).
Beyond a lead of about 87 it is 0 in every entry. Either way CE's steps
vanish or stray and the upload leaves unprotected, while L' (-z for a
binary defender's [0, z] at a = 1) never saturates. attack_loss
'cross_entropy' takes the paper's CE.

Several attributes (eq. 9, Algorithm 1 line 23): the upload sent is
w + sum_m gamma_m (w^(P, m) - w), each attribute's perturbation computed
from the clean upload w. Eq. 9 as printed sums gamma_m times the perturbed
updates themselves, which would scale the upload; line 23 sums their
differences from w, which is read here. Line 23 sits inside the P loop in
the printout, but line 22 already carries the iterations forward, so the
difference is taken once, after the last one.

Appendix E's variants, each applied once (no P loop, as written there), Q
models sampled:
  'one_step':  w + epsilon sign(grad of one sampled model)          (eq. 10)
  'average':   w + (1/Q) sum_q epsilon sign(grad_q at w)              (eq. 11)
  'iterative': x_q = x_(q-1) + (epsilon / Q) sign(grad_q at x_(q-1))  (eq. 12)
  'momentum':  u_q = mu u_(q-1) + grad_q / ||grad_q||_1,
               x_q = x_(q-1) + (epsilon / Q) sign(u_q), mu = 0.9      (eqs. 13-14;
               the printed eq. 13 lacks the gradient's nabla in its
               numerator, which MI-FGSM has)

Models are drawn without replacement, independently per iteration, from a
stateless seed, so a (run, round, client) seed fixes the perturbation.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import params
from tff_privacy.attacks import attribute
from tff_privacy.defenses import defender_zoo
from tff_privacy.defenses.updates import ClientView, UpdateDefense
from tff_privacy.disclosure import Disclosure
from tff_privacy.listing import Listing
from tff_privacy.params import Param, Params
from tff_privacy.registry import DEFENSES

VARIANTS = ("recupfl", "one_step", "average", "iterative", "momentum")
ATTACK_LOSSES = ("logit_margin", "cross_entropy")
MOMENTUM = 0.9

Defender = Callable[[tf.Tensor], tf.Tensor]  # pooled [1, L] -> logits [1, C]


def pool_segments(size: int, length: int) -> np.ndarray:
  """The pooling bin of each of `size` entries: `length` contiguous bins
  as `np.array_split` cuts them (the first size % length one entry
  longer)."""
  if not 1 <= length <= size:
    raise ValueError(f"pool length must be in [1, {size}] (the upload's entries), "
                     f"got {length}")
  return np.concatenate([np.full(len(b), i) for i, b in
                         enumerate(np.array_split(np.arange(size), length))])


def first_maxima(flat: tf.Tensor, segments: np.ndarray) -> tf.Tensor:
  """The int64 index of each bin's first maximum, [length] (its first NaN
  if it holds one, where `np.max` gives NaN), as PyTorch's max_pool1d picks
  it: gathered, the max-pooled upload, through which the gradient reaches
  that one entry and not every tied one. `segments`: each entry's bin, the
  bins contiguous and in order (`pool_segments`)."""
  starts, table = _bin_table(segments)
  columns = _first_columns(tf.gather(flat, table))
  return tf.constant(starts, tf.int64) + tf.cast(columns, tf.int64)


def _first_columns(values: tf.Tensor) -> tf.Tensor:
  """The int32 column of each row's first maximum in `values` [rows,
  width], its first NaN if it holds one (columns in the entries' order; an
  entry repeated after its first place never counts twice)."""
  width = tf.shape(values)[1]
  column = tf.range(width)
  at_max = tf.equal(values, tf.reduce_max(values, axis=1, keepdims=True))
  # NaNs rank before maxima, maxima before the rest, each by column. An
  # all -inf row may match no maximum (TF's GPU kernel may start its
  # maximum from -FLT_MAX): its first column.
  rank = tf.where(tf.math.is_nan(values), column,
                  tf.where(at_max, column + width, column + 2 * width))
  return tf.reduce_min(rank, axis=1) % width


def _bin_table(segments: np.ndarray, pad: Optional[int] = None
               ) -> tuple[np.ndarray, np.ndarray]:
  """(each bin's first index, [bins, width] the indices of each bin's
  entries, filled up to the longest bin's width with `pad`, or with the
  bin's last entry where `pad` is None)."""
  segments = np.asarray(segments)
  starts = np.flatnonzero(np.r_[True, segments[1:] != segments[:-1]])
  lengths = np.diff(np.r_[starts, len(segments)])
  if not (np.all(np.diff(segments) >= 0) and len(starts) == segments[-1] + 1):
    raise ValueError("segments must number contiguous bins in order, from 0")
  columns = np.arange(lengths.max())[None]
  table = starts[:, None] + np.minimum(columns, lengths[:, None] - 1)
  if pad is not None:
    table = np.where(columns < lengths[:, None], table, pad)
  return starts, table.astype(np.int32 if len(segments) < 2**31 - 1 else np.int64)


def _candidates(flat: tf.Tensor, segments: np.ndarray, steps: int) -> tf.Tensor:
  """[bins, k] the indices of the entries of each bin that `steps` FGSM
  steps may move, in order, filled with the index len(flat) (read as
  -inf, never a bin's first maximum): all of them, or, for a finite
  upload, the k = `steps` largest of each bin (ties: the first). A step
  moves each bin's first maximum only, so after t steps at most t entries
  of a bin have moved; every entry that precedes the best unmoved one in
  (value, index) order has moved, so a bin's first maximum is always a
  moved entry or among its t + 1 best. The steps then read and write
  k entries a bin instead of the whole upload."""
  _, table = _bin_table(segments, pad=len(segments))
  if steps >= table.shape[1]:
    return tf.constant(table)

  def largest():
    values = tf.gather(_padded(flat), table)
    columns = tf.sort(tf.math.top_k(values, steps).indices, axis=1)
    return tf.gather(table, columns, batch_dims=1)

  # a NaN or inf ranks apart from the values: every entry of its bin stays
  return tf.cond(tf.reduce_all(tf.math.is_finite(flat)), largest,
                 lambda: tf.constant(table))


def _padded(flat: tf.Tensor) -> tf.Tensor:
  """`flat` and one -inf after it, read by `_candidates`' filler index."""
  return tf.concat([flat, tf.constant([-np.inf], flat.dtype)], 0)


def model_choices(seed, iterations: int, zoo_size: int, sampled: int) -> tf.Tensor:
  """[iterations, sampled] distinct zoo indices per iteration, drawn from a
  stateless `seed` (two int64 numbers)."""
  if not 1 <= sampled <= zoo_size:
    raise ValueError(f"sampled models Q must be in [1, {zoo_size}] (the zoo's "
                     f"size), got {sampled}")
  keys = tf.random.stateless_uniform([iterations, zoo_size], seed)
  return tf.argsort(keys, axis=1)[:, :sampled]


def logit_gradient(logits: tf.Tensor, label, attack_loss: str) -> tf.Tensor:
  """d loss / d logits, [1, C], of logits [1, C] at the true class `label`:
  softmax(z) - e_label for 'cross_entropy', and for 'logit_margin' (L' =
  logsumexp_{c != label} z_c - z_label) the same with the softmax taken over
  the other classes only (see the module)."""
  true = tf.equal(tf.range(tf.shape(logits)[-1]), label)
  if attack_loss == "logit_margin":
    logits = tf.where(true, tf.constant(-np.inf, logits.dtype), logits)
  return tf.nn.softmax(logits) - tf.cast(true, logits.dtype)


def _attack_gradient(defenders: Sequence[Defender], index, x, label,
                     attack_loss):
  """d loss(S_index(max-pooled x), label) / dx (`logit_gradient`) for x the
  upload's `_candidates`, [bins, k]: the gradient at the pooled upload,
  which reaches each bin's first maximum only, as (the [n, 2] (bin,
  column) indices of the entries that may be non-zero, their values)."""
  at = tf.stack([tf.range(tf.shape(x)[0]), _first_columns(x)], 1)
  pooled = tf.gather_nd(x, at)[None]

  def branch(defender):
    def gradient():
      with tf.GradientTape() as tape:
        tape.watch(pooled)
        logits = defender(pooled)
      return tape.gradient(logits, pooled, output_gradients=logit_gradient(
          logits, label, attack_loss))[0]
    return gradient

  return at, tf.switch_case(index, [branch(d) for d in defenders])


def _added(x: tf.Tensor, gradient, scale) -> tf.Tensor:
  """x + scale * sign(the sparse `gradient` of `_attack_gradient`)."""
  indices, values = gradient
  return tf.tensor_scatter_nd_add(x, indices, scale * tf.sign(values))


def _fgsm_steps(variant: str, iterations: int, sampled: int) -> int:
  """The gradients (FGSM steps) one perturbation takes: P Q for
  'recupfl', 1 for 'one_step', Q for the other variants."""
  if variant == "recupfl":
    return iterations * sampled
  return 1 if variant == "one_step" else sampled


def attribute_perturbation(flat: tf.Tensor, label, defenders: Sequence[Defender],
                           **kwargs) -> tf.Tensor:
  """The perturbation of `measured_perturbation` (the same arguments)."""
  return measured_perturbation(flat, label, defenders, **kwargs)[0]


def measured_perturbation(flat: tf.Tensor, label, defenders: Sequence[Defender], *,
                          epsilon: float, pool_length: int, seed,
                          iterations: int = 10, sampled: int = 5,
                          variant: str = "recupfl",
                          attack_loss: str = "logit_margin"
                          ) -> tuple[tf.Tensor, tf.Tensor]:
  """The perturbation (w' - w) of one flat upload `flat` that protects
  attribute value `label` against the zoo `defenders`, and the share of
  its FGSM steps whose gradient was zero in every entry (such a step may
  still move: with 'momentum' by the sign of the accumulated direction;
  and 'recupfl''s meta-train steps never move the upload, whatever their
  gradient).

  Args:
    flat: the upload, flattened to one vector.
    label: the client's class of the attribute (int).
    defenders: the zoo, functions from the pooled upload [1, pool_length]
      to logits [1, classes].
    epsilon: the perturbation budget (the paper: 1e-5 to 0.1 on Adult).
    pool_length: the pooled length the defenders read.
    seed: a stateless seed (two integers).
    iterations: P (recupfl only; paper 10).
    sampled: Q, models per iteration (paper 5; 'recupfl' needs 2 or more).
    variant: one of `VARIANTS` (see the module).
    attack_loss: one of `ATTACK_LOSSES`: whose gradient's signs the steps
      take (see the module; 'cross_entropy' is the paper's, whose steps
      vanish, or with more than two classes stray, where the defender's
      softmax saturates).

  Returns:
    A tensor shaped like `flat`, and a float32 scalar in [0, 1].

  Raises:
    ValueError: for a bad variant, attack loss, epsilon, P, Q or pool length.
  """
  if variant not in VARIANTS:
    raise ValueError(f"variant={variant!r}; choose one of {VARIANTS}")
  if attack_loss not in ATTACK_LOSSES:
    raise ValueError(f"attack_loss={attack_loss!r}; choose one of {ATTACK_LOSSES}")
  if not epsilon > 0:
    raise ValueError(f"epsilon must be > 0, got {epsilon}")
  if iterations < 1:
    raise ValueError(f"iterations P must be >= 1, got {iterations}")
  if variant == "recupfl" and sampled < 2:
    raise ValueError(f"sampled models Q must be >= 2 for meta-train and "
                     f"meta-test, got {sampled}")
  flat = tf.convert_to_tensor(flat, tf.float32)
  size = int(flat.shape[0])
  label = tf.cast(label, tf.int32)
  rounds = iterations if variant == "recupfl" else 1
  choices = model_choices(seed, rounds, len(defenders), sampled)
  steps = _fgsm_steps(variant, iterations, sampled)
  positions = _candidates(flat, pool_segments(size, pool_length), steps)
  entries = tf.gather(_padded(flat), positions)

  def grad(index, x):
    """The sparse gradient and 1 if it is zero in every entry, else 0."""
    g = _attack_gradient(defenders, index, x, label, attack_loss)
    return g, tf.cast(tf.reduce_all(tf.equal(g[1], 0)), tf.int32)

  if variant == "one_step":
    g, zeros = grad(choices[0, 0], entries)
    delta = _added(tf.zeros_like(entries), g, epsilon)
  elif variant == "recupfl":
    current, zeros = _meta_steps(entries, grad, choices, epsilon, sampled)
    delta = current - entries
  else:
    delta, zeros = _fgsm_variant(entries, grad, choices[0], epsilon, sampled, variant)
  # the filler's entries (one past the upload) are dropped
  delta = tf.scatter_nd(tf.reshape(positions, [-1, 1]), tf.reshape(delta, [-1]),
                        tf.constant([size + 1], positions.dtype))[:size]
  return delta, tf.cast(zeros, tf.float32) / steps


def _meta_steps(flat, grad, choices, epsilon, sampled):
  """Algorithm 1 lines 14-22 as one loop over (p, q), so that a graph holds
  one gradient per defender, not one per step; also the count of zero
  gradients."""
  def body(i, current, x, zeros):
    q = i % sampled
    g, zero = grad(choices[i // sampled, q], x)

    def meta_test():
      moved = _added(current, g, epsilon)
      return moved, moved

    current, x = tf.cond(tf.equal(q, sampled - 1), meta_test,
                         lambda: (current, _added(x, g, epsilon / sampled)))
    return i + 1, current, x, zeros + zero

  steps = choices.shape[0] * sampled
  _, current, _, zeros = tf.while_loop(lambda i, *_: i < steps, body,
                                       (tf.constant(0), flat, flat, tf.constant(0)))
  return current, zeros


def _fgsm_variant(flat, grad, chosen, epsilon, sampled, variant):
  """Appendix E's 'average', 'iterative' and 'momentum' over the `chosen`
  models: the perturbation and the count of zero gradients."""
  def body(q, x, u, total, zeros):
    g, zero = grad(chosen[q], flat if variant == "average" else x)
    if variant == "momentum":
      indices, values = g
      u = tf.tensor_scatter_nd_add(
          MOMENTUM * u, indices,
          values / tf.maximum(tf.reduce_sum(tf.abs(values)), 1e-30))
      return (q + 1, x + epsilon / sampled * tf.sign(u), u, total, zeros + zero)
    return (q + 1, _added(x, g, epsilon / sampled), u, _added(total, g, 1.0),
            zeros + zero)

  zeros = tf.zeros_like(flat)
  _, x, _, total, count = tf.while_loop(
      lambda q, *_: q < sampled, body,
      (tf.constant(0), flat, zeros, zeros, tf.constant(0)))
  return (epsilon * total / sampled if variant == "average" else x - flat), count


def client_protections(value, num_clients: int, attributes: Sequence[str],
                       name: str = "protect") -> list[dict[str, float]]:
  """Each client's attributes to protect with their protection levels gamma
  (its A_i, Sec. 4): 'race' (gamma 1), 'race=0.5,sex=0.25', or a JSON file
  of them per client (`tff_privacy.params.per_client`), e.g. half the
  clients 'race' and half 'sex' (Sec. 6.4); `attributes` are the data
  set's. gamma lies in [0, 1] (the paper's (0, 1); 0 is allowed for its
  sweep from 0).

  Raises:
    ValueError: naming `name` for an unknown attribute, a repeated one or a
      gamma outside [0, 1].
  """
  def parse(text, label):
    if not isinstance(text, str) or not text.strip():
      raise ValueError(f"{label}={text!r}: expected 'attribute[=gamma],...'")
    levels = {}
    for part in text.split(","):
      attribute, _, gamma = part.strip().partition("=")
      if attribute not in attributes:
        raise ValueError(f"{label}={text!r}: attribute {attribute!r} is not one "
                         f"of the data set's: {', '.join(attributes) or 'none'}")
      if attribute in levels:
        raise ValueError(f"{label}={text!r}: attribute {attribute!r} given twice")
      try:
        level = float(gamma) if gamma else 1.0
      except ValueError:
        level = math.nan
      if not 0 <= level <= 1:
        raise ValueError(f"{label}={text!r}: gamma of {attribute!r} must be a "
                         f"number in [0, 1], got {gamma!r}")
      levels[attribute] = level
    return levels

  return params.per_client(value, num_clients, name, parse)


def perturb_upload(upload: Sequence[tf.Tensor], protections, **kwargs
                   ) -> list[tf.Tensor]:
  """The upload of `measured_upload` (the same arguments)."""
  return measured_upload(upload, protections, **kwargs)[0]


def measured_upload(upload: Sequence[tf.Tensor], protections, **kwargs
                    ) -> tuple[list[tf.Tensor], tf.Tensor]:
  """The upload RECUP-FL sends (eq. 9, Algorithm 1 line 25): w + sum_m
  gamma_m * `attribute_perturbation` of attribute m, for `protections` a
  sequence of (label, defenders, gamma, seed); `kwargs` go to
  `measured_perturbation`. Also the share of the attributes' FGSM steps
  (of each attribute's, gamma 0 too) whose gradient was zero in every
  entry."""
  flat = tf.concat([tf.reshape(u, [-1]) for u in upload], 0)
  total, zero_shares = tf.zeros_like(flat), []
  for label, defenders, gamma, seed in protections:
    delta, zero_share = measured_perturbation(flat, label, defenders, seed=seed,
                                              **kwargs)
    total += gamma * delta
    zero_shares.append(zero_share)
  sizes = [int(np.prod(u.shape)) for u in upload]
  return ([tf.reshape(d, u.shape) + u for d, u in zip(tf.split(total, sizes), upload)],
          tf.reduce_mean(zero_shares))


def zoo_round(round_num: int, zoo_refresh: int) -> int:
  """The round at whose broadcast model the zoo used in `round_num` was
  trained, when it is retrained every `zoo_refresh` rounds from round 1."""
  return round_num - (round_num - 1) % zoo_refresh


def _round_zoo(folder: str, attribute: str, record, updates: str,
               zoo_refresh: int) -> defender_zoo.DefenderZoo:
  """The zoo saved in `folder` if the round of `record` (read from the
  store in `updates`) used it: trained at its last due round (`zoo_round`)
  or later, up to that round (a zoo missing at a round that is not due is
  retrained there, `RecupFL.prepare_round`), with the weights whose
  fingerprint the capture recorded (`RecupFL.defense_round`).

  Raises:
    ValueError: naming the folder, for a zoo of another round or one that
      records none (written by an older version); naming the folder and
      `updates`, for a zoo with other weights (another run's) or a round
      captured without a fingerprint (by an older version).
  """
  round_num = record.round_num
  trained = zoo_round(round_num, zoo_refresh)
  index = defender_zoo.read_index(folder)
  found = index.get("round")
  if found is None or not trained <= found <= round_num:
    held = ("records no training round (written by an older version)"
            if found is None else f"holds the one of round {found}")
    raise ValueError(f"adaptive adversaries of round {round_num} need the zoo "
                     f"of {attribute!r} trained at round {trained}; {folder} "
                     f"{held}: infer during training (adaptive_adversaries)")
  recorded = (record.metadata.get("defense_round") or {}).get(
      "zoo_fingerprints", {}).get(attribute)
  if recorded is None:
    raise ValueError(f"round {round_num} of updates={updates!r} records no "
                     f"fingerprint of the zoo of {attribute!r} (captured by an "
                     f"older version): zoo={folder!r} cannot be checked")
  if index.get("fingerprint") != recorded:
    raise ValueError(f"zoo={folder!r} is not the zoo of {attribute!r} that "
                     f"round {round_num} of updates={updates!r} was captured "
                     "with (its weights' fingerprint differs from the one "
                     "recorded): another run's zoo")
  # the weights read are checked against the recorded fingerprint too
  return defender_zoo.load_zoo(folder, index=index, fingerprint=recorded)


def _zoo_widths(size: int) -> tuple:
  """`size` of `defender_zoo.ZOO_WIDTHS`, a fixed spread of them."""
  order = np.random.default_rng(0).permutation(len(defender_zoo.ZOO_WIDTHS))
  return tuple(defender_zoo.ZOO_WIDTHS[i] for i in sorted(order[:size]))


@DEFENSES.register
class RecupFL(UpdateDefense):
  """RECUP-FL as a client-side defence (Algorithm 1, lines 10-25): each
  client perturbs its upload against the zoo of every attribute it protects
  (`client_protections`), weighted by its gammas (eq. 9).

  The server side: before every `zoo_refresh`-th round (and whenever a
  zoo is missing) the zoo of each protected attribute is retrained at that
  round's broadcast model (`prepare_round`) on `shadow_samples` records
  of the split `shadow_pool` names
  (`tff_privacy.attacks.attribute.shadow_split`): by default a seeded
  sample of the training split (`attribute.training_sample`), which the
  attribute-inference adversaries train on too (the paper's D_train, Sec.
  5.4; clients hold these records too), or the first records of the test
  split ('disjoint_test', an ablation), each one a shadow upload
  of a one-sample client (Sec. 5.1), and written to
  OUT/recupfl_zoo/<attribute>/; the paper pre-trains the zoo before
  training and does not say whether it follows the model. The client work
  reads the files when it runs (`defender_zoo.load_zoo(in_graph=True)`), so
  the computation holds paths, not weights, and checks them against the
  fingerprint the zoo was built with (a client input): a worker that reads
  other files (a stale zoo) fails instead of perturbing against them. The
  workers must therefore see this machine's files (`reads_run_files`; the
  CLI refuses --worker-addresses). Shipping the zoo instead (about 96 MB per
  attribute at 20 models on 1024 pooled entries, retrained every round)
  would resend it to every client in every round, or recompile the
  computation at every retraining. A client's class of an attribute is that
  of its samples (the most frequent one when they differ); it reaches the
  client work with its gamma as client inputs.
  Every attribute that some client protects has a zoo and is perturbed for
  on every client, with gamma 0 where the client does not protect it, so
  that all clients run one computation.
  """

  name = "recupfl"
  DISCLOSURE = Disclosure(no_adaptive_attack=(
      "no inversion that undoes its FGSM perturbation is known; its adaptive "
      "attribute adversaries train on shadow uploads sent through a copy of "
      "the defense (`adaptive_copy`)"))
  # the leaderboards protect the digits' parity; the compact zoo is small
  LISTING = Listing(
      "RECUP-FL", "perturbation_budget", 0.001, (0.0001, 0.001, 0.01, 0.1),
      method="fedsgd",
      kwargs={"protect": "parity", "zoo_size": 5, "zoo_epochs": 5,
              "shadow_samples": 200, "zoo_refresh": 5},
      full_kwargs={"zoo_size": 20, "zoo_epochs": 20, "shadow_samples": 1000,
                   "zoo_refresh": 1},
      seconds=39.3)
  needs_client_view = True
  needs_model_spec = True
  needs_data = True
  reads_run_files = True
  adaptive_from_run = True
  PARAMETERS = Params(
      Param("protect", str, help="attributes to protect, with gamma: 'race', "
            "'race=0.5,sex=0.5', or a JSON file of them per client"),
      Param("perturbation_budget", float, 0.001, "epsilon of the FGSM steps "
            "(Sec. 5.3: 1e-5 to 0.1 on Adult)", minimum=0, exclusive_minimum=True),
      Param("iterations", int, 10, "P: meta-train/meta-test iterations", minimum=1),
      Param("sampled_models", int, 5, "Q: zoo models per iteration", minimum=1),
      Param("fgsm", str, "recupfl", "recupfl (Algorithm 1) or an FGSM variant "
            "of Appendix E", choices=VARIANTS),
      Param("zoo_size", int, 20, "defender models per attribute (Fig. 8: 5 to 20)",
            minimum=2, maximum=len(defender_zoo.ZOO_WIDTHS)),
      Param("zoo_refresh", int, 1, "rounds between retrainings of the zoo at the "
            "broadcast model", minimum=1),
      Param("shadow_samples", int, 1000, "records the zoo is trained on",
            minimum=10),
      Param("shadow_pool", str, "train", "where those records come from: the "
            "seeded sample of the training split (the adversaries' too, Sec. 5.4) or, "
            "'disjoint_test', of the test split", choices=attribute.SHADOW_POOLS),
      Param("zoo_epochs", int, 80, "epochs of each defender's SGD", minimum=1),
      Param("pool_length", int, 1024, "max-pooled length of an upload, the "
            "defenders' input", minimum=1),
      Param("attack_loss", str, "logit_margin", "the loss whose gradient's signs "
            "the FGSM steps take: logit_margin (the cross-entropy's signs, without "
            "its saturation) or cross_entropy (the paper's: its steps vanish or "
            "stray where a defender's softmax rounds to 1)", choices=ATTACK_LOSSES))

  def __init__(self, model, data, out: str, *, protect: str,
               perturbation_budget: float = 0.001, iterations: int = 10,
               sampled_models: int = 5, fgsm: str = "recupfl", zoo_size: int = 20,
               zoo_refresh: int = 1, shadow_samples: int = 1000,
               shadow_pool: str = "train", zoo_epochs: int = 80,
               pool_length: int = 1024, attack_loss: str = "logit_margin"):
    self._settings = self.PARAMETERS.check(
        protect=protect, perturbation_budget=perturbation_budget,
        iterations=iterations, sampled_models=sampled_models, fgsm=fgsm,
        zoo_size=zoo_size, zoo_refresh=zoo_refresh, shadow_samples=shadow_samples,
        shadow_pool=shadow_pool, zoo_epochs=zoo_epochs, pool_length=pool_length,
        attack_loss=attack_loss)
    attributes = data.source.attributes
    if attributes is None:
      raise ValueError(f"defense='recupfl' needs a data set with sensitive "
                       f"attributes (e.g. adult, mnist5k_parity); "
                       f"{data.source.name!r} has none")
    if fgsm == "recupfl" and sampled_models < 2:
      raise ValueError("sampled_models must be >= 2 for fgsm='recupfl' "
                       f"(meta-train and meta-test), got {sampled_models}")
    if sampled_models > zoo_size:
      raise ValueError(f"sampled_models ({sampled_models}) exceeds zoo_size "
                       f"({zoo_size})")
    self._model, self._data = model, data
    self._levels = client_protections(protect, len(data.client_indices),
                                      tuple(attributes.classes))
    self._names = tuple(a for a in attributes.classes
                        if any(a in levels for levels in self._levels))
    self._classes = [{a: int(np.bincount(attributes.train[a][idx]).argmax())
                      for a in self._names} for idx in data.client_indices]
    self._widths = _zoo_widths(zoo_size)
    self._folder = os.path.join(out, "recupfl_zoo")
    self.client_input_types = {}
    for a in self._names:
      self.client_input_types[f"recupfl_class_{a}"] = tff.TensorType(np.int32)
      self.client_input_types[f"recupfl_gamma_{a}"] = tff.TensorType(np.float32)
      self.client_input_types[f"recupfl_zoo_{a}"] = tff.TensorType(np.int64)

  def params(self):
    return dict(self._settings, zoo_widths=[list(w) for w in self._widths])

  @classmethod
  def adaptive_copy(cls, record, updates, shadow_attributes, seed):
    """RECUP-FL as the victims' clients applied it, on a shadow upload:
    against the zoo the server trained for the record's round (read from
    recupfl_zoo/ beside the store `updates`, where it stays until the next
    retraining, so the adversary runs right after the round, as the
    runner's adaptive_adversaries do; refused unless its weights have the
    fingerprint the capture recorded), with the run's parameters and
    gammas, each shadow upload protecting its own samples' class of each
    attribute (the most frequent one, as a client's). The zoo's model
    sampling is seeded per shadow upload from `seed`.

    `shadow_attributes` lists the attributes in the data set's order, in
    which the clients fold their seeds (`apply_measured`).

    Raises:
      ValueError: per-client protection settings (a JSON file: each
        client's own choice, which the server is not told), or a zoo that
        is missing or is not the one the record's round used (`_round_zoo`).
    """
    meta = record.metadata["defense"]
    if str(meta["protect"]).endswith(".json"):
      raise ValueError(f"adaptive adversaries need the clients' protection "
                       f"settings; protect={meta['protect']!r} sets them per "
                       "client, which the server is not told")
    levels = client_protections(meta["protect"], 1, tuple(shadow_attributes))[0]
    run_dir = os.path.dirname(os.path.abspath(updates))
    protections = [(a, levels[a], defender_zoo.defenders(_round_zoo(
        os.path.join(run_dir, "recupfl_zoo", a), a, record, updates,
        meta["zoo_refresh"]))) for a in shadow_attributes if a in levels]
    settings = dict(epsilon=meta["perturbation_budget"],
                    pool_length=meta["pool_length"], iterations=meta["iterations"],
                    sampled=meta["sampled_models"], variant=meta["fgsm"],
                    attack_loss=meta["attack_loss"])

    @tf.function
    def perturb(upload, labels, seed_pair):
      return perturb_upload(upload, [
          (labels[k], defenders, gamma,
           tf.random.experimental.stateless_fold_in(seed_pair, k))
          for k, (_, gamma, defenders) in enumerate(protections)], **settings)

    def defend(upload, index, x, y):
      del x
      rows = slice(index * len(y), (index + 1) * len(y))
      labels = [np.bincount(shadow_attributes[a][rows]).argmax()
                for a, _, _ in protections]
      # four entries: never a client's (run seed, round, client) seed
      state = np.random.SeedSequence([seed, record.round_num, index, 2]
                                     ).generate_state(2)
      return perturb(list(upload), tf.constant(labels, tf.int32),
                     tf.constant(state.astype(np.int64)))
    return defend

  def zoo_folder(self, attribute: str) -> str:
    return os.path.join(self._folder, attribute)

  def client_inputs(self, client, round_num):
    """The client's class and gamma of each attribute, and the fingerprint
    its zoo was built with (its zoo.json, written by `prepare_round`)."""
    del round_num
    inputs = {}
    for a in self._names:
      inputs[f"recupfl_class_{a}"] = np.int32(self._classes[client][a])
      inputs[f"recupfl_gamma_{a}"] = np.float32(self._levels[client].get(a, 0.0))
      inputs[f"recupfl_zoo_{a}"] = np.int64(
          defender_zoo.read_index(self.zoo_folder(a))["fingerprint"])
    return inputs

  def defense_round(self, round_num):
    """{'zoo_fingerprints': {attribute: the weights' fingerprint of the zoo
    the round's clients perturbed against}}, from its zoo.json."""
    del round_num  # the zoos in the folder are this round's
    return {"zoo_fingerprints": {
        a: int(defender_zoo.read_index(self.zoo_folder(a))["fingerprint"])
        for a in self._names}}

  def _index(self, attribute):
    return defender_zoo.zoo_index(
        attribute, self._data.source.attributes.classes[attribute], self._widths,
        self._settings["pool_length"])

  def prepare_round(self, round_num, broadcast, upload_kind, protocol):
    """Retrains and writes each attribute's zoo when due (see the class)."""
    due = zoo_round(round_num, self._settings["zoo_refresh"]) == round_num
    source, n = self._data.source, self._settings["shadow_samples"]
    pool = self._settings["shadow_pool"]
    x, y, classes = attribute.shadow_split(source, pool)
    rows = (attribute.training_sample(len(y), n) if pool == "train"
            else np.arange(min(n, len(y))))
    features = None
    for a in self._names:
      if not due and self._has_zoo(a):
        continue
      if features is None:  # one-sample shadow uploads at the broadcast model
        features = attribute.shadow_features(
            self._model, broadcast, x[rows], y[rows], upload_kind, protocol,
            length=self._settings["pool_length"])
      pipelines = defender_zoo.fit_defenders(
          features, classes[a][rows], widths=self._widths,
          epochs=self._settings["zoo_epochs"], seed=round_num,
          progress=f"round {round_num}: zoo of {a}")
      defender_zoo.save_zoo(defender_zoo.zoo_from_pipelines(
          pipelines, a, source.attributes.classes[a]), self.zoo_folder(a),
          trained_round=round_num)

  def _has_zoo(self, attribute: str) -> bool:
    """Whether the attribute's zoo is saved with its fingerprint (one saved
    without, by an older version, is retrained)."""
    index = os.path.join(self.zoo_folder(attribute), defender_zoo.INDEX)
    return (os.path.isfile(index)
            and "fingerprint" in defender_zoo.read_index(self.zoo_folder(attribute)))

  def apply(self, update, seed, client: Optional[ClientView] = None):
    return self.apply_measured(update, seed, client)[0]

  def apply_measured(self, update, seed, client: Optional[ClientView] = None):
    """The upload, and the share of its FGSM steps whose gradient was zero
    (`measured_upload`) as 'zero_gradient_steps'."""
    if client is None:
      raise ValueError("recupfl needs the client's inputs (a ClientView)")
    protections = []
    for k, a in enumerate(self._names):
      zoo = defender_zoo.load_zoo(self.zoo_folder(a), in_graph=True,
                                  index=self._index(a),
                                  fingerprint=client.inputs[f"recupfl_zoo_{a}"])
      protections.append((client.inputs[f"recupfl_class_{a}"],
                          defender_zoo.defenders(zoo),
                          client.inputs[f"recupfl_gamma_{a}"],
                          tf.random.experimental.stateless_fold_in(seed, k)))
    s = self._settings
    upload, zero_share = measured_upload(
        update, protections, epsilon=s["perturbation_budget"],
        pool_length=s["pool_length"], iterations=s["iterations"],
        sampled=s["sampled_models"], variant=s["fgsm"], attack_loss=s["attack_loss"])
    return upload, {"zero_gradient_steps": zero_share}

