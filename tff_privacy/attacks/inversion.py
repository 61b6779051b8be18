"""Gradient-inversion attacks on captured client uploads.

Each attack reads an `UpdateRecord` (the broadcast model, the upload, the
number of examples behind it and the public protocol facts in its metadata)
and searches for inputs whose simulated upload matches the captured one. The
client's true samples are never read here. Attacks:

* `DLG` (Zhu et al. 2019): squared L2 distance between uploads, L-BFGS over
  dummy inputs and dummy soft labels jointly (one per pixel for a
  segmentation model).
* `IDLG` (Zhao et al. 2020): labels recovered analytically from the last
  layer (`labels.recover_labels`), then DLG's L-BFGS over the inputs alone.
* `InvertingGradients` (Geiping et al. 2020): 1 - cosine similarity of the
  uploads (all layers as one vector) plus a total-variation prior, Adam on the
  sign of the gradient with step decay, inputs boxed to the data range,
  several restarts of which the best by the matching objective is kept.

For FedAvg model deltas the attacks simulate the client's local SGD steps
(learning rate, epochs, batch size from the record's protocol) inside the
objective. Every attack keeps the best iterate by its own objective.

What the attacker knows of the labels is a parameter (`label_knowledge`):
'auto' is each attack's own assumption (DLG optimises the labels; iDLG and
IG recover class labels analytically, and, since a segmentation mask cannot
be recovered that way, take every pixel as class 0, the attacker's prior that
a document is untampered); 'true' hands the attack the client's labels (an
upper bound on leakage; the caller reads them from the ground truth, the
attack itself never does); 'background' labels everything class 0.

The search runs in compiled chunks of `CHUNK` iterations; the broadcast
weights and the upload are arguments of the compiled functions, so records of
different models (rounds, personalised clients) share one trace when their
architecture, protocol and batch size agree. Between chunks a progress bar
advances. An upload that stands for more than `max_examples` examples is
refused: inverting hundreds of images from one update is slow and recovers
little (Geiping et al. report recognisable images for batches up to about a
hundred only on large models), so the limit is 64 unless raised.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_probability as tfp
import tqdm
from tensorflow_probability.python.optimizer import lbfgs as tfp_lbfgs

from tff_privacy import tasks
from tff_privacy.attacks import adaptive, functional
from tff_privacy.attacks.labels import recover_labels
from tff_privacy.attacks.refusal import UploadRefused, refusing_unreadable
from tff_privacy.data import normalization
from tff_privacy.params import Param, Params
from tff_privacy.registry import ATTACKS
from tff_privacy.updates import UpdateRecord

INITS = ("randn", "uniform")
LABEL_KNOWLEDGE = ("auto", "true", "background")
MAX_EXAMPLES = 64


@dataclasses.dataclass(frozen=True)
class Target:
  """What the attacker holds about one upload, as tensors."""

  record: UpdateRecord
  model: tf.keras.Model  # the architecture; weights come from `broadcast`
  broadcast: list[tf.Tensor]
  upload: list[tf.Tensor]
  true_labels: Optional[np.ndarray] = None  # given to the attacker, if at all
  # what the record's defense discloses, by declaration (an adaptive
  # attack's `reads()`; `tff_privacy.disclosure`)
  disclosed: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def from_record(cls, record: UpdateRecord,
                  true_labels: Optional[np.ndarray] = None,
                  disclosed: Optional[dict] = None) -> "Target":
    if record.num_examples < 1:
      raise UploadRefused(f"record round {record.round_num} client "
                          f"{record.client_index} stands for {record.num_examples} "
                          "examples: nothing to reconstruct")
    if true_labels is not None:
      true_labels = np.asarray(true_labels, np.int32)
    target = cls(record, record.model_spec.keras(),
                 [tf.constant(w) for w in record.broadcast],
                 [tf.constant(u) for u in record.upload], true_labels,
                 dict(disclosed or {}))
    if true_labels is not None and true_labels.shape != target.label_shape:
      raise ValueError(f"round {record.round_num} client {record.client_index}: "
                       f"the given labels have shape {true_labels.shape}, the "
                       f"upload's have {target.label_shape}")
    return target

  @property
  def num_examples(self) -> int:
    return self.record.num_examples

  @property
  def input_shape(self) -> tuple[int, ...]:
    return (self.num_examples,) + tuple(self.record.model_spec.input_shape)

  @property
  def num_classes(self) -> int:
    return self.record.model_spec.num_classes

  @property
  def task(self) -> tasks.Task:
    return self.record.model_spec.task_object

  @property
  def label_shape(self) -> tuple[int, ...]:
    """The shape of the labels behind the upload (one per sample or per
    pixel)."""
    return (self.num_examples,) + self.task.label_shape(self.input_shape[1:])

  @property
  def bounds(self) -> tuple[Any, Any]:
    """(lo, hi) of the model's inputs: the data's value range, or for a
    normalised run its normalised image, one bound per channel
    (`normalization.input_bounds`)."""
    return normalization.input_bounds(self.record.metadata)

  def recovered_labels(self) -> np.ndarray:
    """Labels inferred analytically from the upload (`recover_labels`)."""
    if not self.task.labels_recoverable:
      raise UploadRefused(f"{self.task.name} labels cannot be recovered from an "
                          "upload; give the attack label_knowledge 'true' or "
                          "'background'")
    return recover_labels(self.model, self.record.broadcast, self.record.upload,
                          self.num_examples, self.record.upload_kind,
                          self.record.metadata["protocol"], self.bounds)

  def simulate(self, weights, x, y_soft, records: bool = False):
    """The upload of (x, y_soft) from broadcast `weights` under the record's
    protocol; with `records`, of several records sharing this one's cache
    key, stacked on a leading axis (`functional.simulate_upload`)."""
    return functional.simulate_upload(
        self.model, weights, x, y_soft, self.record.upload_kind,
        self.record.metadata["protocol"], self.num_examples, self.task, records)

  def cache_key(self) -> str:
    """What a compiled attack function depends on besides its arguments."""
    meta = self.record.metadata
    return json.dumps([meta["model"], meta["upload_kind"], meta["protocol"],
                       meta["value_range"], meta.get("normalize"),
                       self.num_examples], sort_keys=True)


@dataclasses.dataclass(frozen=True)
class Reconstruction:
  """An attack's output for one record."""

  round_num: int
  client_index: int
  x: np.ndarray           # reconstructed inputs, clipped to `Target.bounds`
  labels: np.ndarray      # recovered or optimised labels
  objective: float        # the attack's own objective at the kept iterate
  # {iterations: inputs kept after that many} at a quarter, a half and all
  # of the search's iterations (`GradientInversion.checkpoints`), `x` last
  snapshots: dict = dataclasses.field(default_factory=dict)


def l2_distance(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> tf.Tensor:
  return tf.add_n([tf.reduce_sum(tf.square(x - y)) for x, y in zip(a, b)])


def _reduce(fn, t: tf.Tensor, records: bool) -> tf.Tensor:
  """fn over all of t, or with `records` over all but its leading axis."""
  return fn(t, axis=list(range(1, t.shape.rank))) if records else fn(t)


def norm(tensors: Sequence[tf.Tensor], records: bool = False) -> tf.Tensor:
  """L2 norm of the concatenated tensors (per record with `records`)."""
  return tf.sqrt(tf.add_n([_reduce(tf.reduce_sum, tf.square(t), records)
                           for t in tensors]))


def cosine_distance(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor],
                    records: bool = False,
                    b_norm: Optional[tf.Tensor] = None) -> tf.Tensor:
  """1 - cosine similarity of the concatenated tensors; with `records`, one
  per record of tensors stacked on a leading record axis. `b_norm`: `b`'s
  `norm`, where a search compares many `a` with one `b`."""
  dot = tf.add_n([_reduce(tf.reduce_sum, x * y, records) for x, y in zip(a, b)])
  nb = norm(b, records) if b_norm is None else b_norm
  return 1.0 - dot / (norm(a, records) * nb + 1e-12)


def total_variation(x: tf.Tensor, records: bool = False,
                    weights: Optional[tf.Tensor] = None) -> tf.Tensor:
  """Mean absolute difference of neighbouring pixels (Geiping et al.'s TV) of
  NHWC images; with `records`, one per record of [R, N, H, W, C]. `weights`
  (broadcast to x) weighs each difference by the product of its two pixels'
  weights: 0/1 weights count only the pairs inside a region."""
  dx = tf.abs(x[..., 1:, :] - x[..., :-1, :])
  dy = tf.abs(x[..., 1:, :, :] - x[..., :-1, :, :])
  if weights is not None:
    dx *= weights[..., 1:, :] * weights[..., :-1, :]
    dy *= weights[..., 1:, :, :] * weights[..., :-1, :, :]
  return _reduce(tf.reduce_mean, dx, records) + _reduce(tf.reduce_mean, dy, records)


def check_device(device: Optional[str]) -> None:
  """Raises `ValueError` if `device` is not one TensorFlow can see (TF would
  otherwise fall back to another device silently)."""
  if device is None:
    return
  def kind_and_index(name: str) -> str:  # '/job:x/device:GPU:0' -> 'GPU:0'
    return name.split("device:")[-1].lstrip("/").upper()

  seen = [kind_and_index(d.name) for d in tf.config.list_logical_devices()]
  if kind_and_index(device) not in seen:
    raise ValueError(f"device={device!r} is not available; TensorFlow sees "
                     f"{', '.join(seen)}")


_B1, _B2, _EPS = 0.9, 0.999, 1e-8


def adam_step(p, g, m, v, step, lr):
  """One Adam step (beta1 0.9, beta2 0.999, eps 1e-8) on `p` at the 1-based
  `step`; returns (p, m, v). Written out so that a chunk of iterations is one
  compiled call whose state is passed in and out."""
  m = _B1 * m + (1 - _B1) * g
  v = _B2 * v + (1 - _B2) * tf.square(g)
  p = p - lr * (m / (1 - _B1 ** step)) / (tf.sqrt(v / (1 - _B2 ** step)) + _EPS)
  return p, m, v


def search_steps(step: Callable, done: tf.Tensor, steps: tf.Tensor, state):
  """`steps` iterations of a search from `state`, then one evaluation of the
  objective at the last iterate, as one loop whose body traces the
  objective once (tracing a second copy of it for the final evaluation
  costs as long again as the first, seconds for an unrolled local epoch).

  `step(t, state) -> (moved, kept)`: iteration t's next state, and the
  state that keeps what evaluating the current iterate taught (its loss
  against the best so far) without moving it; the last pass returns
  `kept`. Both have `state`'s structure and shapes."""
  def body(i, state):
    moved, kept = step(done + i, state)
    last = i >= steps
    return i + 1, tf.nest.map_structure(
        lambda a, b: tf.where(last, b, a), moved, kept)
  _, state = tf.while_loop(lambda i, _: i <= steps, body,
                           (tf.constant(0), state))
  return state


def _initial(shape, init: str, bounds, rng: np.random.Generator) -> tf.Tensor:
  if init == "randn":
    return tf.constant(rng.standard_normal(shape), tf.float32)
  lo, hi = bounds
  return tf.constant(rng.uniform(lo, hi, shape), tf.float32)


def _iterations(default: int) -> Param:
  return Param("iterations", int, default, "optimizer iterations per restart",
               minimum=1)


_RESTARTS = Param("restarts", int, 1, "random restarts, the best kept", minimum=1)
_ATTACKS_BY_KIND = {"hypernetwork_weights": "'ig_hyperfl' or 'tailored_hyperfl'",
                    "body_weights": "'ig_body'", "body_delta": "'ig_body'"}
_INIT = Param("init", str, "randn", "start of the dummy inputs", choices=INITS)
_LABEL_KNOWLEDGE = Param(
    "label_knowledge", str, "auto", "labels the attacker uses: auto (the "
    "attack's own: DLG optimises them, iDLG and IG recover class labels and "
    "take segmentation pixels as class 0), true (the client's labels are "
    "given: an upper bound), background (class 0 everywhere)",
    choices=LABEL_KNOWLEDGE)
_MAX_EXAMPLES = Param("max_examples", int, MAX_EXAMPLES,
                      "largest number of examples behind one upload that the "
                      "attack will try to reconstruct", minimum=1)


class GradientInversion(abc.ABC):
  """Common driver: limits, device placement, seeding, restarts, compiled
  chunks, progress, many records per call.

  A subclass declares `PARAMETERS` (set as attributes by the constructor)
  and implements one search run: `_start` (its state from a random start),
  `_advance` (a chunk of iterations) and `_finish` (inputs, labels and
  objective of the best iterate).
  """

  name = "inversion"
  UPLOAD_KINDS = ("gradient", "model_delta")  # what `Target.simulate` covers
  TASKS = ("classification",)  # the models whose uploads it can invert
  PARAMETERS = Params()
  OPTIMISES_LABELS = False  # 'auto' labels: optimised, or recovered/class 0
  # the declaration of a defense that an adaptive attack reads
  # (`tff_privacy.disclosure.DECLARATIONS`): it answers every defense that
  # makes it; None: an attack unaware of any defense
  READS: Optional[str] = None
  label_knowledge = "auto"  # see the module docstring
  CHUNK = 100  # iterations per compiled call

  def __init__(self, compiled: bool = True, **kwargs: Any):
    for key, value in self.PARAMETERS.resolve(f"attack {self.name!r}",
                                              kwargs).items():
      setattr(self, key, value)
    self.compiled = compiled
    self._functions: dict[tuple[str, str], Callable] = {}

  def targets(self, records: Sequence[UpdateRecord],
              labels: Optional[Sequence[np.ndarray]] = None) -> list[Target]:
    """The records as targets (see `check_records`), with the clients'
    `labels` when the attacker is given them (`label_knowledge='true'`)."""
    self.check_records(records)
    if self.label_knowledge == "true" and labels is None:
      raise ValueError(f"attack {self.name!r} with label_knowledge='true' "
                       "needs the clients' labels")
    if labels is None or self.label_knowledge != "true":
      labels = [None] * len(records)
    disclosed = adaptive.read(self.name, records, self.reads())
    return [Target.from_record(r, y, d)
            for r, y, d in zip(records, labels, disclosed)]

  def reads(self) -> tuple[str, ...]:
    """The declarations read of each record's defense before any search
    (`Target.disclosed`): `READS`'s, and those the attack's options need."""
    return (self.READS,) if self.READS else ()

  def fixed_labels(self, target: Target) -> Optional[np.ndarray]:
    """The labels the search holds fixed (`label_knowledge`), or None where
    it optimises them."""
    if self.label_knowledge == "true":
      return target.true_labels
    if self.label_knowledge == "background":
      return np.zeros(target.label_shape, np.int32)
    return self._own_labels(target)

  def _own_labels(self, target: Target) -> Optional[np.ndarray]:
    """'auto': None where the attack optimises the labels, else class labels
    recovered analytically and segmentation pixels taken as class 0."""
    if self.OPTIMISES_LABELS:
      return None
    if target.task.labels_recoverable:
      return target.recovered_labels()
    return np.zeros(target.label_shape, np.int32)

  def check_records(self, records: Sequence[UpdateRecord]) -> None:
    """Raises `UploadRefused` for an upload of a kind or a model's task the
    attack does not handle, of more than `max_examples` examples, or, for
    an adaptive attack, of a defense that does not declare what it reads
    (`reads`; read again for `targets`)."""
    for record in records:
      if record.model_spec.task not in self.TASKS:
        raise UploadRefused(
            f"attack {self.name!r} inverts uploads of {' and '.join(self.TASKS)} "
            f"models; round {record.round_num} client {record.client_index} "
            f"trained a {record.model_spec.task} model: use 'dlg', 'idlg' or 'ig'")
      if record.upload_kind not in self.UPLOAD_KINDS:
        raise UploadRefused(
            f"attack {self.name!r} handles {', '.join(self.UPLOAD_KINDS)} "
            f"uploads; method {record.metadata['method']!r} uploads "
            f"{record.upload_kind!r}: use "
            f"{_ATTACKS_BY_KIND.get(record.upload_kind, 'none here')}")
      if record.num_examples > self.max_examples:
        raise UploadRefused(
            f"round {record.round_num} client {record.client_index}: the upload "
            f"stands for {record.num_examples} examples, more than "
            f"max_examples={self.max_examples} (inverting that many images is "
            "slow and recovers little; raise --max-examples to try anyway)")
    adaptive.read(self.name, records, self.reads())

  def plan(self, records: Sequence[UpdateRecord]) -> str:
    """One line: what the attack will do."""
    sizes = sorted({r.num_examples for r in records})
    per = "/".join(str(s) for s in sizes)
    return (f"{self.name}: {len(records)} record(s), {per} image(s) per record, "
            f"{self.iterations} iterations x {self.restarts} restart(s) each")

  def estimate_seconds(self, records: Sequence[UpdateRecord],
                       device: Optional[str] = None) -> float:
    """Rough wall time of `__call__(records)`: a few timed iterations on the
    first record (after compiling), scaled to every record's iterations;
    searched one record at a time, so an upper bound with `group_size` > 1."""
    target = self.targets(records[:1])[0]
    steps = min(10, self.iterations)
    with tf.device(device):
      state = self._start(target, self.rng(target, 0))
      state, _ = self._advance(target, state, 0, 1)  # compiles the first chunk
      state, _ = self._advance(target, state, 1, 1)  # and the later ones
      begin = time.perf_counter()
      self._advance(target, state, 2, steps)
    per_iteration = (time.perf_counter() - begin) / steps
    return per_iteration * self.iterations * self.restarts * len(records)

  def __call__(self, records: Sequence[UpdateRecord], device: Optional[str] = None,
               seed: int = 0, progress: bool = False,
               labels: Optional[Sequence[np.ndarray]] = None
               ) -> list[Reconstruction]:
    """Attacks every record, on `device` (e.g. '/GPU:0') or TF's choice;
    with `progress`, a bar over all records' iterations. `labels` (one
    array per record) are read only with `label_knowledge='true'`."""
    check_device(device)
    targets = self.targets(records, labels)
    total = len(targets) * self.restarts * self.iterations
    out = [None] * len(targets)
    with tqdm.tqdm(total=total, disable=not progress, unit="it",
                   desc=self.name) as bar:
      for group in self.groups(targets):
        with tf.device(device):
          if len(group) == 1:
            done = [self.reconstruct(targets[group[0]], seed, bar.update)]
          else:
            done = self.reconstruct_group([targets[i] for i in group], seed,
                                          bar.update)
        for i, reconstruction in zip(group, done):
          out[i] = reconstruction
    return out

  def groups(self, targets: Sequence[Target]) -> list[list[int]]:
    """Indices of the targets attacked together: up to `group_size` (an
    attack's parameter where it supports groups; else 1) that share a
    compiled function (`Target.cache_key`), in the order given."""
    size = getattr(self, "group_size", 1)
    by_key: dict[str, list[int]] = {}
    for i, target in enumerate(targets):
      by_key.setdefault(target.cache_key(), []).append(i)
    return [members[k:k + size] for members in by_key.values()
            for k in range(0, len(members), size)]

  def rng(self, target: Target, seed: int, restart: int = 0) -> np.random.Generator:
    return np.random.default_rng(
        [seed, target.record.round_num, target.record.client_index, restart])

  def function(self, target: Target, name: str, build: Callable[[Target], Callable]):
    """A (compiled) function per model/protocol/batch size: no retracing
    between records that share them, whatever their weights."""
    key = (name, target.cache_key())
    if key not in self._functions:
      fn = build(target)
      # The search loops are written with tf.while_loop: without autograph
      # a trace converts none of the Keras and model code it calls, about a
      # third of tracing an unrolled local epoch.
      self._functions[key] = (tf.function(fn, autograph=False)
                              if self.compiled else fn)
    return self._functions[key]

  def checkpoints(self) -> list[int]:
    """The iteration counts after which a search keeps what it has found
    (`Reconstruction.snapshots`): a quarter, a half and all of them, so
    that a search still improving when it stopped can be told."""
    return sorted({max(1, self.iterations // 4), max(1, self.iterations // 2),
                   self.iterations})

  def _chunks(self):
    """(done, steps) of the compiled calls of one search: at most `CHUNK`
    iterations each, ending at every checkpoint."""
    done, ends = 0, self.checkpoints()
    while done < self.iterations:
      steps = min(self.CHUNK, next(e for e in ends if e > done) - done)
      yield done, steps
      done += steps

  def reconstruct(self, target: Target, seed: int,
                  on_steps: Callable[[int], Any] = lambda n: None) -> Reconstruction:
    """The best of `restarts` searches for `target`'s inputs, with that
    search's snapshots at the `checkpoints`."""
    best = None
    for restart in range(self.restarts):
      state = self._start(target, self.rng(target, seed, restart))
      snapshots = {}
      for done, steps in self._chunks():
        state, stop = self._advance(target, state, done, steps)
        on_steps(steps)
        if stop:  # converged: what it has is what it would keep
          on_steps(self.iterations - done - steps)
          found = self._finish(target, state)
          snapshots.update({e: found[0] for e in self.checkpoints() if e > done})
          break
        if done + steps in self.checkpoints():
          found = self._finish(target, state)
          snapshots[done + steps] = found[0]
      if best is None or found[2] < best[0][2]:
        best = (found, snapshots)
    return self._reconstruction(target, *best[0], best[1])

  def reconstruct_group(self, targets: Sequence[Target], seed: int,
                        on_steps: Callable[[int], Any] = lambda n: None
                        ) -> list[Reconstruction]:
    """`reconstruct` for several targets sharing a compiled function, their
    searches advanced together by one batched computation
    (`_advance_group`). Each target's start is seeded as when it is
    attacked alone."""
    best: list = [None] * len(targets)
    for restart in range(self.restarts):
      state = self._stack([self._start(t, self.rng(t, seed, restart))
                           for t in targets])
      snapshots: list = [{} for _ in targets]
      for done, steps in self._chunks():
        state = self._advance_group(targets, state, done, steps)
        on_steps(steps * len(targets))
        if done + steps in self.checkpoints():
          found = [self._finish(t, {k: v[i] for k, v in state.items()})
                   for i, t in enumerate(targets)]
          for kept, f in zip(snapshots, found):
            kept[done + steps] = f[0]
      for i, f in enumerate(found):
        if best[i] is None or f[2] < best[i][0][2]:
          best[i] = (f, snapshots[i])
    return [self._reconstruction(t, *b[0], b[1]) for t, b in zip(targets, best)]

  @staticmethod
  def _stack(states: Sequence[dict]) -> dict:
    """One state of the group: tensors stacked on a new leading axis, other
    entries (numpy labels) kept as a list."""
    return {k: (tf.stack([s[k] for s in states]) if tf.is_tensor(states[0][k])
                else [s[k] for s in states]) for k in states[0]}

  def _advance_group(self, targets: Sequence[Target], state: dict, done: int,
                     steps: int) -> dict:
    raise NotImplementedError(f"attack {self.name!r} attacks one record at a time")

  @staticmethod
  def _reconstruction(target: Target, x, labels, objective,
                      snapshots: Optional[dict] = None) -> Reconstruction:
    lo, hi = target.bounds
    return Reconstruction(target.record.round_num, target.record.client_index,
                          np.clip(x, lo, hi), np.asarray(labels, np.int32),
                          objective, {k: np.clip(v, lo, hi)
                                      for k, v in (snapshots or {}).items()})

  @abc.abstractmethod
  def _start(self, target: Target, rng: np.random.Generator) -> dict:
    """The state of a search from a random start."""

  @abc.abstractmethod
  def _advance(self, target: Target, state: dict, done: int,
               steps: int) -> tuple[dict, bool]:
    """`steps` more iterations after `done`; (state, converged)."""

  @abc.abstractmethod
  def _finish(self, target: Target, state: dict) -> tuple[np.ndarray, np.ndarray, float]:
    """(inputs, labels, objective) of the best iterate of the search."""


@ATTACKS.register
class DLG(GradientInversion):
  """Deep Leakage from Gradients: L-BFGS on inputs and soft labels jointly.

  Follows Zhu et al.'s code: inputs and label logits start from N(0, 1),
  squared L2 distance between uploads, L-BFGS with history 100. Their loop
  makes 300 optimizer steps of up to 20 L-BFGS iterations each and stops an
  L-BFGS run when the gradient's largest entry falls below 1e-7; here
  `iterations` counts L-BFGS iterations (tensorflow-probability, with a
  Hager-Zhang line search), 6000 by default (300 x 20), with the same
  gradient tolerance. Inputs are not boxed during the search;
  reconstructions are clipped to the data range afterwards. `restarts` > 1
  (not in the paper, whose single run sometimes ends in a poor local minimum)
  keeps the run with the lowest objective. On ReLU networks such as the
  U-Net the line search fails within tens of iterations (the objective is
  only piecewise smooth in the inputs) and the search stops there;
  Inverting Gradients is the attack for them.
  """

  name = "dlg"
  TASKS = tasks.TASKS
  PARAMETERS = Params(
      _iterations(6000),
      Param("history", int, 100, "L-BFGS history (correction pairs)", minimum=1),
      _RESTARTS,
      Param("tolerance", float, 1e-7,
            "stop when the gradient's largest entry is below this", minimum=0),
      _INIT, _LABEL_KNOWLEDGE, _MAX_EXAMPLES)
  OPTIMISES_LABELS = True

  def _build(self, target: Target, fixed_labels: bool):
    """(start, minimize): the L-BFGS state at a starting point, and more
    iterations from a state. One trace of the L-BFGS loop serves every
    chunk, the first included."""
    n_x = int(np.prod(target.input_shape))
    shape, c = target.input_shape, target.num_classes
    label_logits_shape = target.label_shape + (c,)

    def objective(flat, y_fixed, upload, broadcast):
      x = tf.reshape(flat[:n_x], shape)
      y_soft = y_fixed if fixed_labels else tf.nn.softmax(
          tf.reshape(flat[n_x:], label_logits_shape))
      return l2_distance(target.simulate(broadcast, x, y_soft), upload)

    def value_and_gradient_fn(y_fixed, upload, broadcast):
      def value_and_gradient(flat):
        with tf.GradientTape() as tape:
          tape.watch(flat)
          loss = objective(flat, y_fixed, upload, broadcast)
        return loss, tape.gradient(loss, flat)
      return value_and_gradient

    def start(flat, y_fixed, upload, broadcast):
      # tfp's own constructor of the state lbfgs_minimize starts from (its
      # public API starts and runs in one call; tfp is pinned, see
      # requirements.lock)
      return tfp_lbfgs._get_initial_state(  # pylint: disable=protected-access
          value_and_gradient_fn(y_fixed, upload, broadcast), flat,
          self.history, self.tolerance)

    def minimize(state, max_iterations, y_fixed, upload, broadcast):
      # Line-search steps only ever lower the objective, so the current
      # position is the best iterate.
      return tfp.optimizer.lbfgs_minimize(
          value_and_gradient_fn(y_fixed, upload, broadcast),
          initial_position=None, previous_optimizer_results=state,
          max_iterations=max_iterations,
          num_correction_pairs=self.history, tolerance=self.tolerance,
          x_tolerance=0.0, f_relative_tolerance=0.0)
    return start, minimize

  def _start(self, target, rng):
    labels = self.fixed_labels(target)
    fixed = labels is not None
    c = target.num_classes
    parts = [tf.reshape(_initial(target.input_shape, self.init,
                                 target.bounds, rng), [-1])]
    if not fixed:
      parts.append(tf.constant(rng.standard_normal(
          int(np.prod(target.label_shape)) * c), tf.float32))
    y_fixed = (tf.one_hot(labels, c) if fixed else
               tf.zeros(target.label_shape + (c,)))
    start = self.function(target, f"lbfgs-start-{fixed}",
                          lambda t: self._build(t, fixed)[0])
    results = start(tf.concat(parts, 0), y_fixed, target.upload, target.broadcast)
    return {"results": results, "labels": labels, "y_fixed": y_fixed}

  def _advance(self, target, state, done, steps):
    fixed = state["labels"] is not None
    minimize = self.function(target, f"lbfgs-{fixed}",
                             lambda t: self._build(t, fixed)[1])
    results = minimize(state["results"], tf.constant(done + steps),
                       state["y_fixed"], target.upload, target.broadcast)
    stop = bool(results.converged) or bool(results.failed)
    return {**state, "results": results}, stop

  def _finish(self, target, state):
    flat = state["results"].position.numpy()
    n_x = int(np.prod(target.input_shape))
    labels = state["labels"]
    if labels is None:
      labels = np.argmax(
          flat[n_x:].reshape(target.label_shape + (target.num_classes,)), -1)
    return (flat[:n_x].reshape(target.input_shape), labels,
            float(state["results"].objective_value))


@ATTACKS.register
class IDLG(DLG):
  """iDLG: analytic label recovery, then DLG's L-BFGS over the inputs."""

  name = "idlg"
  OPTIMISES_LABELS = False


@ATTACKS.register
class InvertingGradients(GradientInversion):
  """Inverting Gradients (Geiping et al. 2020).

  Objective: 1 - cos(simulated upload, captured upload) + tv_weight * TV(x).
  Adam (beta1 0.9, beta2 0.999) with learning rate `lr` divided by 10 at 3/8,
  5/8 and 7/8 of the iterations, stepping on the sign of the gradient
  (`signed`), inputs clipped to the data range after every step (`boxed`).
  Labels are recovered analytically first. Of `restarts` runs from random
  starts the one with the lowest objective is kept, and within a run the best
  iterate. Defaults: inversefed's lr 0.1, 1 restart, 'randn' start; 4,800
  iterations as in its default config. Its TV weight varies between
  1e-1 (library default) and 1e-6 (CIFAR examples) for images normalised by
  the data set's mean and std; on the [0, 1] grey images here 1e-4 keeps edges
  sharp while suppressing noise, and is the default.

  A subclass may match only some coordinates of the upload (`upload_mask`):
  both uploads are multiplied by a 0/1 mask before the cosine, so the
  coordinates the mask drops count in neither; other weights weigh each
  coordinate's squared terms by the square of its weight. It may add a
  second TV term over part of the image (`region_prior`).
  """

  name = "ig"
  TASKS = tasks.TASKS
  PARAMETERS = Params(
      _iterations(4800),
      Param("lr", float, 0.1, "Adam learning rate", minimum=0,
            exclusive_minimum=True),
      Param("tv_weight", float, 1e-4, "total-variation weight", minimum=0),
      _RESTARTS,
      Param("signed", bool, True, "step on the sign of the gradient", cli=False),
      Param("boxed", bool, True, "clip inputs to the data range after each step",
            cli=False),
      Param("lr_decay", bool, True, "divide lr by 10 at 3/8, 5/8, 7/8", cli=False),
      Param("group_size", int, 1, "records searched together in one batched "
            "computation (those sharing model, protocol and batch size); each "
            "search is the one-at-a-time search up to float rounding", minimum=1),
      _INIT, _LABEL_KNOWLEDGE, _MAX_EXAMPLES)

  def _build(self, target: Target, grouped: bool = False):
    """A chunk of iterations; `grouped`: of a group's searches at once, each
    argument stacked on a leading record axis, the objective one per record
    (one pass of the record-batched forward, `Target.simulate(records=
    True)`)."""
    lo, hi = target.bounds
    milestones = tf.constant([int(self.iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)])

    def objective(x, y_soft, upload, upload_norm, broadcast, mask, region):
      with tf.GradientTape() as tape:
        tape.watch(x)
        simulated = target.simulate(broadcast, x, y_soft, grouped)
        if mask:
          simulated = [s * m for s, m in zip(simulated, mask)]
        loss = cosine_distance(simulated, upload, grouped, upload_norm)
        loss += self.tv_weight * total_variation(x, grouped)
        if region:
          weight, pixels = region
          loss += weight * total_variation(x, grouped, pixels)
        # records' objectives are independent: the gradient of their sum is
        # each one's own
        total = tf.reduce_sum(loss)
      return loss, tape.gradient(total, x)

    def keep_best(x, loss, best_x, best_loss):
      better = loss < best_loss
      pick = tf.reshape(better, tf.concat([tf.shape(better), tf.ones(
          tf.rank(x) - tf.rank(better), tf.int32)], 0))
      return tf.where(pick, x, best_x), tf.where(better, loss, best_loss)

    def step(t, state, arguments):
      x, m, v, best_x, best_loss = state
      loss, grad = objective(x, *arguments)
      best_x, best_loss = keep_best(x, loss, best_x, best_loss)
      g = tf.sign(grad) if self.signed else grad
      lr = self.lr
      if self.lr_decay:
        passed = tf.reduce_sum(tf.cast(t >= milestones, tf.float32))
        lr = self.lr * tf.pow(0.1, passed)
      moved_x, moved_m, moved_v = adam_step(x, g, m, v, tf.cast(t + 1, tf.float32), lr)
      if self.boxed:
        moved_x = tf.clip_by_value(moved_x, lo, hi)
      return ((moved_x, moved_m, moved_v, best_x, best_loss),
              (x, m, v, best_x, best_loss))

    def advance(x, m, v, best_x, best_loss, done, steps, y_soft, upload,
                broadcast, mask, region):
      upload = [u * k for u, k in zip(upload, mask)] if mask else upload
      arguments = (y_soft, upload, norm(upload, grouped), broadcast, mask,
                   region)
      return search_steps(lambda t, state: step(t, state, arguments), done,
                          steps, (x, m, v, best_x, best_loss))
    return advance

  def targets(self, records: Sequence[UpdateRecord],
              labels: Optional[Sequence[np.ndarray]] = None) -> list[Target]:
    """`GradientInversion.targets`, whose `upload_mask` and `region_prior`
    are read once first: a store they cannot read is refused
    (`refusing_unreadable`) before any search."""
    targets = super().targets(records, labels)
    for target in targets:
      with refusing_unreadable(self.name, target.record, "upload_mask"):
        self.upload_mask(target)
      with refusing_unreadable(self.name, target.record, "region_prior"):
        self.region_prior(target)
    return targets

  def upload_mask(self, target: Target) -> list[tf.Tensor]:
    """0/1 per coordinate of the upload: 1 where the objective matches it;
    empty: every coordinate (Inverting Gradients as published)."""
    return []

  def region_prior(self, target: Target) -> list[tf.Tensor]:
    """[weight, pixels]: a second TV term, `weight` times the TV of the
    neighbouring pairs whose pixels are both 1 in `pixels` ([1, H, W, 1]);
    empty: none (Inverting Gradients as published)."""
    return []

  def _start(self, target, rng):
    x = _initial(target.input_shape, self.init, target.bounds, rng)
    labels = self.fixed_labels(target)
    return {"x": x, "m": tf.zeros_like(x), "v": tf.zeros_like(x), "best_x": x,
            "best_loss": tf.constant(np.inf, tf.float32), "labels": labels,
            "y_soft": tf.one_hot(labels, target.num_classes)}

  def _advance(self, target, state, done, steps):
    advance = self.function(target, "adam", self._build)
    keys = ("x", "m", "v", "best_x", "best_loss")
    values = advance(*(state[k] for k in keys), tf.constant(done),
                     tf.constant(steps), state["y_soft"], target.upload,
                     target.broadcast, self.upload_mask(target),
                     self.region_prior(target))
    return {**state, **dict(zip(keys, values))}, False

  def _advance_group(self, targets, state, done, steps):
    advance = self.function(targets[0], "adam_group",
                            lambda t: self._build(t, grouped=True))
    keys = ("x", "m", "v", "best_x", "best_loss")
    stacked = [[tf.stack(ws) for ws in zip(*tensors)] for tensors in (
        [t.upload for t in targets], [t.broadcast for t in targets],
        [self.upload_mask(t) for t in targets],
        [self.region_prior(t) for t in targets])]
    values = advance(*(state[k] for k in keys), tf.constant(done),
                     tf.constant(steps), state["y_soft"], *stacked)
    return {**state, **dict(zip(keys, values))}

  def _finish(self, target, state):
    return (state["best_x"].numpy(), state["labels"],
            float(state["best_loss"]))
