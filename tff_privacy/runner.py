"""The training loop: rounds, evaluation, metric release, checkpoints, capture.

`run(config)` trains one federated method and writes, under `config.out`:

* `config.json`: the run's configuration (a re-run with another config into the
  same folder is refused);
* `metrics.json`: one entry per finished round (`round`, `test_accuracy`,
  `test_loss`, `train_loss`, `seconds`, ...), rewritten atomically each round;
* `tensorboard/`: the same metrics as TensorBoard scalars;
* `checkpoints/`: the algorithm state after each round
  (`tff.program.FileProgramStateManager`); re-running the same command resumes
  after the last finished round and ends with the same numbers as an
  uninterrupted run, because every random choice (client sampling, local
  shuffling, initial weights) is a function of (seed, round, client);
* `updates/` and `ground_truth/` for the rounds in `capture_rounds`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import os
import time
from typing import Any, Optional, Sequence

import dp_accounting
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
import tqdm

from tff_privacy import algorithms, data, defenses, io, models, runtime
from tff_privacy.dp import accounting
from tff_privacy.updates import CaptureFactory, GroundTruthStore, UpdateStore

_EVAL_BATCH = 1000


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One training run. Defaults: FedAvg on the bundled MNIST digits."""

  out: str
  method: str = "fedavg"
  dataset: str = "mnist5k"
  model: str = "cnn"
  model_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  clients: int = 10
  clients_per_round: Optional[int] = None  # None: every client, every round
  rounds: int = 20
  batch_size: int = 32
  local_epochs: int = 1
  client_lr: float = 0.1
  server_lr: Optional[float] = None  # None: the method's default
  # further keyword arguments of the method's `algorithm` (e.g. FedEM's
  # perturb_steps, rho_max); see tff_privacy.algorithms
  method_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  partition: str = "iid"
  alpha: float = 0.5
  seed: int = 0
  capture_rounds: tuple[int, ...] = ()
  data_dir: Optional[str] = None
  defense: Optional[str] = None  # a client-side defence, see tff_privacy.defenses
  defense_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  dp_delta: float = 1e-5  # delta at which DP runs report their epsilon

  def __post_init__(self):
    object.__setattr__(self, "capture_rounds",
                       tuple(sorted(set(int(r) for r in self.capture_rounds))))
    for name in ("clients", "rounds", "batch_size", "local_epochs"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.clients_per_round is not None and not (
        1 <= self.clients_per_round <= self.clients):
      raise ValueError(f"clients_per_round must be in [1, clients={self.clients}]"
                       f", got {self.clients_per_round}")
    bad = [r for r in self.capture_rounds if not 1 <= r <= self.rounds]
    if bad:
      raise ValueError(f"capture_rounds must lie in [1, rounds={self.rounds}], "
                       f"got {bad}")
    if self.method not in algorithms.METHODS:
      raise ValueError(f"method={self.method!r} is unknown; choose one of "
                       f"{sorted(algorithms.METHODS)}")
    if self.dataset not in data.DATASETS:
      raise ValueError(f"dataset={self.dataset!r} is unknown; choose one of "
                       f"{', '.join(data.DATASETS)}")
    if self.defense is not None and self.defense not in defenses.DEFENSES:
      raise ValueError(f"defense={self.defense!r} is unknown; choose one of "
                       f"{sorted(defenses.DEFENSES)}")
    if not 0 < self.dp_delta < 1:
      raise ValueError(f"dp_delta must lie in (0, 1), got {self.dp_delta}")

  @property
  def sampled_per_round(self) -> int:
    return self.clients_per_round or self.clients

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["capture_rounds"] = list(self.capture_rounds)
    d.pop("out")
    return d


def sample_clients(config: RunConfig, round_num: int) -> np.ndarray:
  """The clients of `round_num`: sorted, without replacement, from (seed, round)."""
  if config.sampled_per_round == config.clients:
    return np.arange(config.clients)
  rng = np.random.default_rng([config.seed, round_num, 0])
  return np.sort(rng.choice(config.clients, config.sampled_per_round,
                            replace=False))


def local_order(num_samples: int, algorithm: algorithms.Algorithm,
                config: RunConfig, round_num: int, client: int) -> np.ndarray:
  """Indices of a client's samples in the order it uses them this round."""
  rng = np.random.default_rng([config.seed, round_num, client + 1])
  if algorithm.local_data == "one_batch":
    return rng.permutation(num_samples)[: config.batch_size]
  return np.concatenate([rng.permutation(num_samples)
                         for _ in range(config.local_epochs)])


def client_dataset(x: np.ndarray, y: np.ndarray, batch_size: int,
                   extra: Optional[dict[str, np.ndarray]] = None) -> tf.data.Dataset:
  """Batches (x, y) in order; `extra` per-client inputs join every batch."""
  elements = collections.OrderedDict(x=x, y=y)
  ds = tf.data.Dataset.from_tensor_slices(elements).batch(batch_size)
  if extra:
    consts = tf.data.Dataset.from_tensors(collections.OrderedDict(extra)).repeat()
    ds = tf.data.Dataset.zip((ds, consts)).map(
        lambda batch, c: collections.OrderedDict(**batch, **c))
  return ds


class Evaluator:
  """Test accuracy and loss of the global model, in plain TensorFlow."""

  def __init__(self, spec: models.ModelSpec, x: np.ndarray, y: np.ndarray):
    self._model = spec.keras()
    self._loss = models.loss_fn()
    self._data = tf.data.Dataset.from_tensor_slices((x, y)).batch(_EVAL_BATCH)
    self._n = len(y)

  @tf.function
  def _sums(self, weights):
    for v, w in zip(self._model.trainable_variables, weights):
      v.assign(w)
    loss_sum, correct = tf.constant(0.0), tf.constant(0)
    for xb, yb in self._data:
      logits = self._model(xb, training=False)
      loss_sum += self._loss(yb, logits) * tf.cast(tf.shape(yb)[0], tf.float32)
      correct += tf.reduce_sum(tf.cast(
          tf.equal(tf.argmax(logits, 1, output_type=tf.int32), yb), tf.int32))
    return loss_sum, correct

  def __call__(self, weights: Sequence[np.ndarray]) -> dict[str, float]:
    loss_sum, correct = self._sums([tf.constant(w) for w in weights])
    return {"test_accuracy": float(correct) / self._n,
            "test_loss": float(loss_sum) / self._n}


def _scalar_metrics(tree, prefix: str = "") -> dict[str, float]:
  """Flattens TFF's nested training metrics to 'a/b': float for scalars."""
  out = {}
  if isinstance(tree, dict):
    for k, v in tree.items():
      out.update(_scalar_metrics(v, f"{prefix}{k}/"))
  elif np.ndim(tree) == 0:
    out[prefix[:-1]] = float(tree)
  return out


class Run:
  """A configured run: data, model, algorithm and output folders."""

  def __init__(self, config: RunConfig):
    self.config = config
    self.fed = data.load(config.dataset, config.clients, config.partition,
                         config.alpha, config.seed, config.data_dir)
    self.spec = models.ModelSpec(config.model, self.fed.source.input_shape,
                                 self.fed.source.num_classes, config.model_kwargs)
    defense = (defenses.build(config.defense, self.spec, **config.defense_kwargs)
               if config.defense else None)
    # Server-side defences replace the aggregator; client-side ones go into
    # the method's client work.
    self.central = defense if isinstance(defense, defenses.DPFedAvg) else None
    hparams = {"batch_size": config.batch_size, "seed": config.seed,
               "defense": None if self.central else defense}
    if config.server_lr is not None:
      hparams["server_learning_rate"] = config.server_lr
    if config.method == "fedavg":
      hparams.update(client_learning_rate=config.client_lr,
                     local_epochs=config.local_epochs)
    hparams.update(config.method_kwargs)
    self.algorithm = algorithms.get(config.method, self.spec.tff_model_fn(),
                                    **hparams)
    self._processes: dict[bool, tff.learning.templates.LearningProcess] = {}

  def process(self, capture: bool) -> tff.learning.templates.LearningProcess:
    """The method's process; with `capture`, its aggregator reports uploads.

    Both share one state type, so either can run any round.
    """
    if capture not in self._processes:
      n = self.config.sampled_per_round
      inner = (self.central.aggregator(n, self.config.seed) if self.central
               else tff.aggregators.MeanFactory())
      view = self.central.server_view if self.central else None
      aggregator = CaptureFactory(inner, n, view) if capture else inner
      self._processes[capture] = self.algorithm.build_process(aggregator)
    return self._processes[capture]

  def round_data(self, round_num: int):
    """Per sampled client: (index, x, y, dataset). The dataset holds the
    samples in the order the client trains on them (every local epoch); x and
    y are its distinct samples in their first-epoch order (the ground truth)."""
    out = []
    for client in sample_clients(self.config, round_num):
      x, y = self.fed.client_arrays(client)
      order = local_order(len(y), self.algorithm, self.config, round_num, client)
      extra = (self.algorithm.client_inputs(int(client), round_num)
               if self.algorithm.client_inputs else None)
      distinct = order[: min(len(y), len(order))]
      out.append((int(client), x[distinct], y[distinct],
                  client_dataset(x[order], y[order], self.config.batch_size, extra)))
    return out

  @functools.cached_property
  def _num_params(self) -> int:
    return sum(int(np.prod(w.shape)) for w in self.spec.initial_weights(0))

  @functools.cached_property
  def round_dp_event(self) -> Optional[dp_accounting.DpEvent]:
    """The DP event of one round, if the run uses a DP mechanism that
    `dp_accounting` models."""
    if self.central:
      return self.central.dp_event(self.config.sampled_per_round /
                                   self.config.clients)
    if self.algorithm.dp_event:
      return self.algorithm.dp_event(self._num_params)
    return None

  def privacy_spent(self, rounds: int) -> dict[str, float]:
    """(epsilon, delta) spent after `rounds` rounds. Local DP: each client's
    mechanism composed over every round (an upper bound when clients are
    sampled), see `accounting.rounds_epsilon`; pure-DP mechanisms outside
    `dp_accounting` (LDP-Fed) by the basic composition theorem, with delta
    0. Central DP-FedAvg: user-level, with the sampling rate. Empty for runs
    without a DP mechanism."""
    event = self.round_dp_event
    if event is None:
      pure = (self.algorithm.pure_epsilon(self._num_params)
              if self.algorithm.pure_epsilon else None)
      if pure is None:
        return {}
      eps, delta = accounting.simple_composition([pure] * rounds)
      return {"epsilon": eps, "delta": delta}
    eps, delta = accounting.rounds_epsilon(event, rounds, self.config.dp_delta)
    return {"epsilon": eps, "delta": delta}

  def run_metadata(self) -> dict[str, Any]:
    src = self.fed.source
    return {"method": self.algorithm.name,
            "upload_kind": self.algorithm.upload_kind,
            "defense": (self.algorithm.defense or
                        ({"name": self.central.name, **self.central.params()}
                         if self.central else None)),
            "model": self.spec.to_json(), "dataset": src.name,
            "value_range": list(src.value_range), "raw_max": src.raw_max,
            "protocol": self.algorithm.protocol}


def _check_or_write_config(config: RunConfig) -> None:
  """Refuses to resume a run made with another config; `rounds` may grow."""
  path = os.path.join(config.out, "config.json")
  new = config.to_json()
  if os.path.exists(path):
    old = io.read_json(path)
    if {**old, "rounds": None} != {**new, "rounds": None}:
      changed = sorted(k for k in new if old.get(k) != new[k] and k != "rounds")
      raise ValueError(f"{config.out} holds a run with another config (differs in "
                       f"{', '.join(changed)}); choose another --out or delete it")
  io.write_json(path, new)


MODEL_WEIGHTS = "model_weights.npz"  # the final global model, by variable name


def run(config: RunConfig, progress: bool = True) -> list[dict[str, Any]]:
  """Trains (or resumes) the run described by `config`; returns its metrics."""
  os.makedirs(config.out, exist_ok=True)
  _check_or_write_config(config)
  runtime.start()
  r = Run(config)
  process = r.process(capture=False)
  if config.capture_rounds:
    # Built before any eager Keras model: tracing a TFF computation that builds
    # Keras layers invalidates Keras models made earlier in eager mode.
    r.process(capture=True)
  manager = tff.program.FileProgramStateManager(
      os.path.join(config.out, "checkpoints"), keep_total=2, keep_first=False)
  initial = process.set_model_weights(
      process.initialize(),
      tff.learning.models.ModelWeights(r.spec.initial_weights(config.seed), []))
  state, done = asyncio.run(manager.load_latest(initial))
  if state is None:
    state, done = initial, 0
  metrics_path = os.path.join(config.out, "metrics.json")
  history = []
  if done and os.path.exists(metrics_path):
    history = [m for m in io.read_json(metrics_path) if m["round"] <= done]
  evaluator = Evaluator(r.spec, *r.fed.test)
  writer = tf.summary.create_file_writer(os.path.join(config.out, "tensorboard"))
  bar = tqdm.tqdm(range(done + 1, config.rounds + 1), disable=not progress,
                  initial=done, total=config.rounds, desc=config.method,
                  unit="round")
  for round_num in bar:
    start = time.perf_counter()
    capture = round_num in config.capture_rounds
    clients = r.round_data(round_num)
    broadcast = process.get_model_weights(state).trainable
    output = r.process(capture).next(state, [c[3] for c in clients])
    state = output.state
    entry = {"round": round_num, **evaluator(process.get_model_weights(state).trainable)}
    train = output.metrics["client_work"]["train"]
    entry["train_loss"] = float(train["loss"])
    entry["train_accuracy"] = float(train["sparse_categorical_accuracy"])
    entry.update(r.privacy_spent(round_num))
    if capture:
      _write_capture(r, round_num, broadcast, clients,
                     output.metrics["aggregator"]["captured"])
    entry["seconds"] = time.perf_counter() - start
    history.append(entry)
    io.write_json(metrics_path, history)
    with writer.as_default(step=round_num):
      for k, v in entry.items():
        if k != "round":
          tf.summary.scalar(k, v)
    writer.flush()
    asyncio.run(manager.save(state, round_num))
    bar.set_postfix(acc=f"{entry['test_accuracy']:.4f}",
                    loss=f"{entry['test_loss']:.4f}")
  final = process.get_model_weights(state).trainable
  io.write_npz(os.path.join(config.out, MODEL_WEIGHTS),
               dict(zip(r.spec.variable_names(), final)))
  return history


def load_model_weights(out: str, spec: models.ModelSpec) -> list[np.ndarray]:
  """The final global model of the run in `out`, in the model's order."""
  with np.load(os.path.join(out, MODEL_WEIGHTS)) as f:
    return [f[name] for name in spec.variable_names()]


def _write_capture(r: Run, round_num: int, broadcast, clients, captured) -> None:
  count = int(captured["num_uploads"])
  if count != len(clients):
    raise RuntimeError(f"captured {count} uploads from {len(clients)} clients")
  uploads = [(index, data.client_id(index), [u[i] for u in captured["uploads"]],
              captured["upload_weights"][i])
             for i, (index, *_rest) in enumerate(clients)]
  meta = r.run_metadata()
  UpdateStore(os.path.join(r.config.out, "updates")).write_round(
      round_num, list(broadcast), uploads, meta)
  GroundTruthStore(os.path.join(r.config.out, "ground_truth")).write_round(
      round_num, [(index, x, y) for index, x, y, _ in clients],
      {"dataset": meta["dataset"], "value_range": meta["value_range"]})
