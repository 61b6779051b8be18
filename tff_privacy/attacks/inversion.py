"""Gradient-inversion attacks on captured client uploads.

Each attack reads an `UpdateRecord` (the broadcast model, the upload and the
public protocol facts in its metadata) and searches for inputs whose simulated
upload matches the captured one. The client's true samples are never read
here. Attacks:

* `DLG` (Zhu et al. 2019): squared L2 distance between uploads, L-BFGS over
  dummy inputs and dummy soft labels jointly.
* `IDLG` (Zhao et al. 2020): labels recovered analytically from the last
  layer (`labels.recover_labels`), then DLG's L-BFGS over the inputs alone.
* `InvertingGradients` (Geiping et al. 2020): 1 - cosine similarity of the
  uploads (all layers as one vector) plus a total-variation prior, Adam on the
  sign of the gradient with step decay, inputs boxed to the data range,
  several restarts of which the best by the matching objective is kept.

For FedAvg model deltas the attacks simulate the client's local SGD steps
(learning rate, epochs, batch size from the record's protocol) inside the
objective. Every attack keeps the best iterate by its own objective.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_probability as tfp

from tff_privacy.attacks import functional
from tff_privacy.attacks.labels import recover_labels
from tff_privacy.updates import UpdateRecord

INITS = ("randn", "uniform")


@dataclasses.dataclass(frozen=True)
class Target:
  """What the attacker holds about one upload, as tensors."""

  record: UpdateRecord
  model: tf.keras.Model
  broadcast: list[tf.Tensor]
  upload: list[tf.Tensor]
  num_examples: int

  @classmethod
  def from_record(cls, record: UpdateRecord) -> "Target":
    # TFF weighs a client by the examples it processed: every local epoch.
    epochs = (record.metadata["protocol"].get("local_epochs", 1)
              if record.upload_kind == "model_delta" else 1)
    n = int(round(record.weight / epochs))
    if n < 1:
      raise ValueError(f"record round {record.round_num} client "
                       f"{record.client_index} has weight {record.weight}: "
                       "no examples to reconstruct")
    return cls(record, record.model_spec.keras(),
               [tf.constant(w) for w in record.broadcast],
               [tf.constant(u) for u in record.upload], n)

  @property
  def input_shape(self) -> tuple[int, ...]:
    return (self.num_examples,) + tuple(self.record.model_spec.input_shape)

  @property
  def num_classes(self) -> int:
    return self.record.model_spec.num_classes

  @property
  def value_range(self) -> tuple[float, float]:
    lo, hi = self.record.metadata["value_range"]
    return float(lo), float(hi)

  def recovered_labels(self) -> np.ndarray:
    """Labels inferred analytically from the upload (`recover_labels`)."""
    return recover_labels(self.model, self.record.broadcast, self.record.upload,
                          self.num_examples, self.record.upload_kind,
                          self.record.metadata["protocol"], self.value_range)

  def simulate(self, x, y_soft):
    return functional.simulate_upload(
        self.model, self.broadcast, x, y_soft, self.record.upload_kind,
        self.record.metadata["protocol"], self.num_examples)

  def cache_key(self) -> str:
    meta = self.record.metadata
    return json.dumps([meta["model"], meta["upload_kind"], meta["protocol"],
                       self.num_examples], sort_keys=True)


@dataclasses.dataclass(frozen=True)
class Reconstruction:
  """An attack's output for one record."""

  round_num: int
  client_index: int
  x: np.ndarray           # reconstructed inputs, clipped to the data range
  labels: np.ndarray      # recovered or optimised labels
  objective: float        # the attack's own objective at the kept iterate


def l2_distance(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> tf.Tensor:
  return tf.add_n([tf.reduce_sum(tf.square(x - y)) for x, y in zip(a, b)])


def cosine_distance(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> tf.Tensor:
  """1 - cosine similarity of the concatenated tensors."""
  dot = tf.add_n([tf.reduce_sum(x * y) for x, y in zip(a, b)])
  na = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(x)) for x in a]))
  nb = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(y)) for y in b]))
  return 1.0 - dot / (na * nb + 1e-12)


def total_variation(x: tf.Tensor) -> tf.Tensor:
  """Mean absolute difference of neighbouring pixels (Geiping et al.'s TV)."""
  dx = tf.reduce_mean(tf.abs(x[:, :, 1:, :] - x[:, :, :-1, :]))
  dy = tf.reduce_mean(tf.abs(x[:, 1:, :, :] - x[:, :-1, :, :]))
  return dx + dy


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


def _initial(shape, init: str, value_range, rng: np.random.Generator) -> tf.Tensor:
  if init == "randn":
    return tf.constant(rng.standard_normal(shape), tf.float32)
  lo, hi = value_range
  return tf.constant(rng.uniform(lo, hi, shape), tf.float32)


class GradientInversion(abc.ABC):
  """Common driver: device placement, seeding, many records per call."""

  name = "inversion"

  def __init__(self, init: str = "randn", compiled: bool = True):
    if init not in INITS:
      raise ValueError(f"init={init!r}; choose one of {INITS}")
    self.init = init
    self.compiled = compiled
    self._functions: dict[str, Callable] = {}

  def __call__(self, records: Sequence[UpdateRecord], device: Optional[str] = None,
               seed: int = 0) -> list[Reconstruction]:
    """Attacks every record, on `device` (e.g. '/GPU:0') or TF's choice."""
    check_device(device)
    out = []
    for record in records:
      with tf.device(device):
        out.append(self.reconstruct(Target.from_record(record), seed))
    return out

  def rng(self, target: Target, seed: int, restart: int = 0) -> np.random.Generator:
    return np.random.default_rng(
        [seed, target.record.round_num, target.record.client_index, restart])

  def function(self, target: Target, build: Callable[[Target], Callable]):
    """A (compiled) function per model/protocol/batch: no retracing between
    records that share them."""
    key = target.cache_key()
    if key not in self._functions:
      fn = build(target)
      self._functions[key] = tf.function(fn) if self.compiled else fn
    return self._functions[key]

  @abc.abstractmethod
  def reconstruct(self, target: Target, seed: int) -> Reconstruction:
    ...


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
  keeps the run with the lowest objective.
  """

  name = "dlg"

  def __init__(self, iterations: int = 6000, history: int = 100,
               restarts: int = 1, tolerance: float = 1e-7, init: str = "randn",
               compiled: bool = True):
    super().__init__(init, compiled)
    for name, value in (("iterations", iterations), ("restarts", restarts)):
      if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    self.iterations, self.history = iterations, history
    self.restarts, self.tolerance = restarts, tolerance

  def _build(self, target: Target, fixed_labels: bool):
    n_x = int(np.prod(target.input_shape))
    shape, c = target.input_shape, target.num_classes

    def objective(flat, y_fixed, upload):
      x = tf.reshape(flat[:n_x], shape)
      y_soft = y_fixed if fixed_labels else tf.nn.softmax(
          tf.reshape(flat[n_x:], (shape[0], c)))
      return l2_distance(target.simulate(x, y_soft), upload)

    def minimize(flat0, y_fixed, upload):
      def value_and_gradient(flat):
        with tf.GradientTape() as tape:
          tape.watch(flat)
          loss = objective(flat, y_fixed, upload)
        return loss, tape.gradient(loss, flat)
      result = tfp.optimizer.lbfgs_minimize(
          value_and_gradient, flat0, max_iterations=self.iterations,
          num_correction_pairs=self.history, tolerance=self.tolerance,
          x_tolerance=0.0, f_relative_tolerance=0.0)
      # Line-search steps only ever lower the objective, so the final
      # position is the best iterate.
      return result.position, result.objective_value
    return minimize

  def _labels(self, target: Target) -> Optional[np.ndarray]:
    return None

  def _start(self, target: Target, fixed: bool, rng) -> tf.Tensor:
    x0 = _initial(target.input_shape, self.init, target.value_range, rng)
    parts = [tf.reshape(x0, [-1])]
    if not fixed:
      parts.append(tf.constant(rng.standard_normal(
          target.num_examples * target.num_classes), tf.float32))
    return tf.concat(parts, 0)

  def reconstruct(self, target: Target, seed: int) -> Reconstruction:
    labels = self._labels(target)
    fixed = labels is not None
    y_fixed = (tf.one_hot(labels, target.num_classes) if fixed else
               tf.zeros((target.num_examples, target.num_classes)))
    minimize = self.function(target, lambda t: self._build(t, fixed))
    best_flat, best_value = None, np.inf
    for restart in range(self.restarts):
      start = self._start(target, fixed, self.rng(target, seed, restart))
      flat, value = minimize(start, y_fixed, target.upload)
      if best_flat is None or float(value) < best_value:
        best_flat, best_value = flat.numpy(), float(value)
    n_x = int(np.prod(target.input_shape))
    x = best_flat[:n_x].reshape(target.input_shape)
    if not fixed:
      labels = np.argmax(best_flat[n_x:].reshape(target.num_examples, -1), 1)
    lo, hi = target.value_range
    return Reconstruction(target.record.round_num, target.record.client_index,
                          np.clip(x, lo, hi), np.asarray(labels, np.int32),
                          best_value)


class IDLG(DLG):
  """iDLG: analytic label recovery, then DLG's L-BFGS over the inputs."""

  name = "idlg"

  def _labels(self, target: Target) -> np.ndarray:
    return target.recovered_labels()


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
  """

  name = "ig"

  def __init__(self, iterations: int = 4800, lr: float = 0.1,
               tv_weight: float = 1e-4, restarts: int = 1, signed: bool = True,
               boxed: bool = True, lr_decay: bool = True, init: str = "randn",
               compiled: bool = True):
    super().__init__(init, compiled)
    for name, value in (("iterations", iterations), ("restarts", restarts)):
      if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    if not lr > 0:
      raise ValueError(f"lr must be > 0, got {lr}")
    if tv_weight < 0:
      raise ValueError(f"tv_weight must be >= 0, got {tv_weight}")
    self.iterations, self.lr, self.tv_weight = iterations, lr, tv_weight
    self.restarts, self.signed, self.boxed = restarts, signed, boxed
    self.lr_decay = lr_decay

  def _build(self, target: Target):
    lo, hi = target.value_range
    milestones = tf.constant([int(self.iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)])

    def objective(x, y_soft, upload):
      with tf.GradientTape() as tape:
        tape.watch(x)
        loss = cosine_distance(target.simulate(x, y_soft), upload)
        loss += self.tv_weight * total_variation(x)
      return loss, tape.gradient(loss, x)

    def optimize(x, y_soft, upload):
      # Adam written out so that the whole loop is one compiled function
      # whose state restarts with each call (no optimizer variables to reset).
      b1, b2, eps = 0.9, 0.999, 1e-8
      m, v = tf.zeros_like(x), tf.zeros_like(x)
      best_x, best_loss = x, tf.constant(np.inf, tf.float32)
      for t in tf.range(self.iterations):
        loss, grad = objective(x, y_soft, upload)
        better = loss < best_loss
        best_x = tf.where(better, x, best_x)
        best_loss = tf.where(better, loss, best_loss)
        g = tf.sign(grad) if self.signed else grad
        step = tf.cast(t + 1, tf.float32)
        lr = self.lr
        if self.lr_decay:
          passed = tf.reduce_sum(tf.cast(t >= milestones, tf.float32))
          lr = self.lr * tf.pow(0.1, passed)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * tf.square(g)
        x = x - lr * (m / (1 - b1 ** step)) / (tf.sqrt(v / (1 - b2 ** step)) + eps)
        if self.boxed:
          x = tf.clip_by_value(x, lo, hi)
      loss, _ = objective(x, y_soft, upload)
      better = loss < best_loss
      return tf.where(better, x, best_x), tf.where(better, loss, best_loss)
    return optimize

  def reconstruct(self, target: Target, seed: int) -> Reconstruction:
    labels = target.recovered_labels()
    y_soft = tf.one_hot(labels, target.num_classes)
    optimize = self.function(target, self._build)
    best_x, best_loss = None, np.inf
    for restart in range(self.restarts):
      x0 = _initial(target.input_shape, self.init, target.value_range,
                    self.rng(target, seed, restart))
      x, loss = optimize(x0, y_soft, target.upload)
      if float(loss) < best_loss:
        best_x, best_loss = x.numpy(), float(loss)
    lo, hi = target.value_range
    return Reconstruction(target.record.round_num, target.record.client_index,
                          np.clip(best_x, lo, hi), labels, best_loss)


ATTACKS = {"dlg": DLG, "idlg": IDLG, "ig": InvertingGradients}


def build(name: str, **kwargs) -> GradientInversion:
  """Attack `name` (one of `ATTACKS`) with its keyword arguments."""
  if name not in ATTACKS:
    raise ValueError(f"attack={name!r} is unknown; choose one of {sorted(ATTACKS)}")
  return ATTACKS[name](**kwargs)
