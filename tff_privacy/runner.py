"""The training loop: rounds, evaluation, metric release, checkpoints, capture.

`run(config)` trains one federated method and writes, under `config.out`:

* `config.json`: the run's configuration, written once every argument has been
  checked (a re-run with another config into the same folder is refused),
  with HyperFL-LPM's backbone pinned by its fingerprint (model_kwargs
  `backbone_fingerprint`: a resume refuses a replaced backbone file) and
  the clients' split pinned by its SHA-256 (`split_sha256`, for a split
  file's or ClientData's clients: a resume refuses a changed split), and
  the code versions that trained it (`provenance.KEY`: git commit, dirty
  tree and diff hash, one more for each resume by other code);
* `metrics.json`: one entry per finished round (`test_<metric>` of the
  global model on the test set for every metric of the data set's task:
  `test_accuracy` and `test_loss` for classification, `test_iou`,
  `test_precision`, `test_recall`, `test_f_score` and `test_loss` for
  segmentation, and `samples_tested`, how many test samples they score; `personal_<metric>_mean` for every metric, with
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
  intervals), rewritten atomically each round;
* `tensorboard/`: the numeric metrics as TensorBoard scalars;
* `checkpoints/`: the algorithm state after every `checkpoint_every` rounds
  and the last, with every client's
  private state for personalised methods
  (`tff.program.FileProgramStateManager`); re-running the same command resumes
  after the last checkpointed round and ends with the same numbers as an
  uninterrupted run, because every random choice (client sampling, local
  shuffling, initial weights) is a function of (seed, round, client);
* `updates/` and `ground_truth/` for the rounds in `capture_rounds`;
* `model_weights.npz` (the final global model) or, for personalised methods,
  `personal_models.npz` (every client's final model).

`run` uses TFF's current execution context; programs start it first with
`tff_privacy.runtime.start()` (the CLI, tests, benchmarks and experiment
scripts do), or install their own.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import fcntl
import functools
import gc
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
import tqdm

from tff_privacy import (algorithms, data, defenses, evaluate, io, models,
                         params, pretrained, provenance, runtime, tasks)
from tff_privacy.aggregation import wide_sum
from tff_privacy.attacks import attribute as attribute_inference
from tff_privacy.attacks import functional
from tff_privacy.dp import accounting
from tff_privacy.metrics.updates import UndefinedFidelity, aggregate_fidelity
from tff_privacy.models.lpm import LPM_MODELS
from tff_privacy.protocol import local_batch_sizes
from tff_privacy.updates import ClientPlacedCapture, GroundTruthStore, UpdateStore

_EVAL_BATCH = 64  # samples evaluated at once: a U-Net's activations bound the memory
_EVAL_CHUNK = 16 * _EVAL_BATCH  # samples an evaluation holds at once
EVALUATIONS = ("global", "local-after-training")
LOCAL_AFTER_TRAINING = EVALUATIONS[1]


def default_model(dataset: str) -> str:
  """The model of a run on `dataset` that names none: its task's
  (`tff_privacy.tasks.Task.default_model`)."""
  return tasks.get(data.sources.task_of(dataset)).default_model


def _model_help() -> str:
  """--model's help, with each task's default model and data sets."""
  by_task = collections.defaultdict(list)
  for name, task in sorted(data.sources.DATASET_TASKS.items()):
    by_task[task].append(name)
  return ("model builder; default by the data set's task: " + ", ".join(
      f"{tasks.get(t).default_model} for {t} ({', '.join(names)})"
      for t, names in sorted(by_task.items()))
      + f", {tasks.get('classification').default_model} for classification "
      "(the other data sets)")


RUN_PARAMETERS = params.Params(
    params.Param("method", str, "fedavg", "federated method",
                 choices=algorithms.METHODS),
    params.Param("dataset", str, "mnist5k", "data set", choices=data.DATASETS),
    params.Param("data_dir", str, None, "tensorflow_datasets data directory, or "
                 "the folder of a data set read from its published files "
                 "(audiomnist, lfw)"),
    params.Param("model", str, None, _model_help(),
                 choices=tuple(sorted(models.MODELS))),
    params.Param("clients", int, 10, "number of clients (a split file's "
                 "partition gives its own)", minimum=1),
    params.Param("clients_per_round", int, None,
                 "clients drawn (without replacement) per round; default all",
                 minimum=1),
    params.Param("rounds", int, 20, "training rounds", minimum=1),
    params.Param("batch_size", int, 32, "local batch size", minimum=1),
    params.Param("partition", str, "iid", "how the training set is split: "
                 f"one of {', '.join(data.PARTITIONS)}, or "
                 f"{data.splits.PREFIX}SPLIT.json, each client's train and test "
                 f"indices into the data set's arrays, as JSON "
                 f"{data.splits.EXAMPLE}"),
    params.Param("alpha", float, 0.5, "Dirichlet concentration of the "
                 "'dirichlet' partition", minimum=0, exclusive_minimum=True),
    params.Param("samples_per_client", int, None, "training samples per client "
                 "of the 'label_groups' and 'groups' partitions; default: the "
                 "training set divided among the clients", minimum=1),
    params.Param("seed", int, 0, "seed of every random choice of the run"),
    params.Param("defense", str, None, "defence: applied by every client to its "
                 "upload, or by the server's aggregator for dp_fedavg",
                 choices=defenses.DEFENSES),
    params.Param("dp_delta", float, 1e-5, "delta at which DP runs report epsilon",
                 minimum=0, maximum=1, exclusive_minimum=True,
                 exclusive_maximum=True),
    params.Param("positive_weight", float, 1.0, "segmentation data sets: "
                 "weight of the positive (tampered) pixels in the cross-entropy "
                 "(1: the plain mean)", minimum=0, exclusive_minimum=True),
    params.Param("attribute_shadow_samples", int, 1000, "records the "
                 "attribute-inference adversaries train on (infer_attributes)",
                 minimum=2),
    params.Param("attribute_shadow_pool", str, "train", "where those records "
                 "come from: 'train', a seeded sample of the training split, which "
                 "RECUP-FL's zoo trains on too (the paper's adversary), or "
                 "'disjoint_test', the test split's last, class-balanced, "
                 "disjoint from the zoo's", choices=attribute_inference.SHADOW_POOLS),
    params.Param("evaluate_every", int, 1, "rounds between evaluations of the "
                 "model(s) (test and per-client metrics); the last round is "
                 "always evaluated", minimum=1),
    params.Param("checkpoint_every", int, 1, "rounds between checkpoints of "
                 "the state (a resumed run goes on from the last one; the last "
                 "round is always checkpointed); no effect on results",
                 minimum=1),
    params.Param("evaluate", str, "global", "what is evaluated: 'global', the "
                 "global model on the test set and on each client's test split "
                 "(personalised methods: each client's own model after the "
                 "round); 'local-after-training' adds each round's clients' "
                 "models after their local training, before aggregation, each "
                 "on its own test split (the HyperFL paper's Table 1)",
                 choices=EVALUATIONS),
    params.Param("adaptive_adversaries", bool, False, "infer_attributes "
                 "also by adaptive adversaries, whose shadow uploads go "
                 "through the run's client defence with its parameters "
                 "(metrics adaptive_asr/...)"))


def _run_default(name: str):
  return RUN_PARAMETERS[name].default


@dataclasses.dataclass(frozen=True)
class DatasetProtocol:
  """A data set's declared training protocol: the values a run on it takes
  for the run fields and method parameters that its configuration leaves
  out (`with_protocol`).

  Attributes:
    fields: RunConfig fields, e.g. clients, rounds; dict fields (data_kwargs)
      merge key by key.
    method_kwargs: method parameters, given to every method that declares
      them.
  """

  fields: dict[str, Any]
  method_kwargs: dict[str, Any]

  def describe(self) -> str:
    """The protocol's values, e.g. 'clients 10, rounds 20'."""
    return ", ".join(f"{name} {value}" for name, value in
                     {**self.fields, **self.method_kwargs}.items())


DATASET_PROTOCOLS: dict[str, DatasetProtocol] = {
    # FedRE's clients (10, lr 0.005), each holding one document format; the
    # paper states no rounds, local steps, batch or optimizer. At 64x64,
    # FedAvg over 8 such clients reached test F-score 0.007 in 20 rounds; at
    # 32x32 it reaches 0.33, in under 3 minutes on 2 cores
    # (experiments/fedre_tables.py's docs setting). FedRE's PSI scores
    # (clients' and PDA-PAM's, 20 per round) by the unbiased estimator on 16
    # of the region's 64 pixels: exact, a round takes several minutes here
    "docs": DatasetProtocol(
        fields={"clients": 10, "partition": "groups", "rounds": 20,
                "batch_size": 16, "positive_weight": 10.0,
                "data_kwargs": {"size": 32}},
        method_kwargs={"client_optimizer": "adam", "client_learning_rate": 0.005,
                       "local_epochs": 2, "psi_pixels": 16}),
}


def with_protocol(fields: dict[str, Any]) -> dict[str, Any]:
  """RunConfig `fields` completed by their data set's declared protocol
  (`DATASET_PROTOCOLS`): every run field and method parameter of the
  protocol that `fields` do not give (method parameters only where the
  method declares them)."""
  protocol = DATASET_PROTOCOLS.get(fields.get("dataset", _run_default("dataset")))
  if protocol is None:
    return fields
  out = {**protocol.fields, **fields}
  if "clients" not in fields and str(fields.get("partition", "")).startswith(
      data.splits.PREFIX):
    out.pop("clients", None)  # the split file gives them
  for name, value in protocol.fields.items():
    if isinstance(value, dict):
      out[name] = {**value, **fields.get(name, {})}
  declared = algorithms.method(
      fields.get("method", _run_default("method"))).parameters.names
  out["method_kwargs"] = {
      **{k: v for k, v in protocol.method_kwargs.items() if k in declared},
      **fields.get("method_kwargs", {})}
  return out


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One training run. Defaults: FedAvg on the bundled MNIST digits with
  the data set's task's model (`default_model`); the scalar fields are
  declared in `RUN_PARAMETERS`."""

  out: str
  method: str = _run_default("method")
  dataset: str = _run_default("dataset")
  model: Optional[str] = None  # None: `default_model(dataset)`
  model_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  clients: Optional[int] = None  # None: the split file's, else the default
  clients_per_round: Optional[int] = None  # None: every client, every round
  rounds: int = _run_default("rounds")
  batch_size: int = _run_default("batch_size")
  # the method's declared parameters (e.g. FedAvg's local_epochs, FedEM's
  # rho_max); the method's paper defaults for the rest. See
  # `tff_privacy.algorithms.METHODS[method].parameters`.
  method_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  partition: str = _run_default("partition")
  alpha: float = _run_default("alpha")
  samples_per_client: Optional[int] = None
  seed: int = _run_default("seed")
  capture_rounds: tuple[int, ...] = ()
  # sensitive attributes inferred from every captured round's uploads by
  # `attribute_adversaries` (tff_privacy.evaluate.infer_attributes_round);
  # the attack success rates go into metrics.json
  infer_attributes: tuple[str, ...] = ()
  attribute_adversaries: tuple[str, ...] = attribute_inference.ADVERSARIES
  data_dir: Optional[str] = None
  # the data set's options, e.g. {"max_per_speaker": 50} (audiomnist); see
  # `tff_privacy.data.sources.DATA_PARAMETERS`
  data_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  defense: Optional[str] = None  # see tff_privacy.defenses
  defense_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  dp_delta: float = _run_default("dp_delta")
  positive_weight: float = _run_default("positive_weight")
  attribute_shadow_samples: int = _run_default("attribute_shadow_samples")
  attribute_shadow_pool: str = _run_default("attribute_shadow_pool")
  adaptive_adversaries: bool = _run_default("adaptive_adversaries")
  evaluate_every: int = _run_default("evaluate_every")
  # SHA-256 of the split file or of the ClientData the clients come from
  # (partitions 'file:...' and 'client_data'); a split file's is read from it
  split_sha256: Optional[str] = None
  evaluate: str = _run_default("evaluate")
  checkpoint_every: int = _run_default("checkpoint_every")

  def __post_init__(self):
    self._resolve_federation()
    checked = RUN_PARAMETERS.check(
        **{name: getattr(self, name) for name in RUN_PARAMETERS.names})
    for name, value in checked.items():
      object.__setattr__(self, name, value)
    if self.model is None:
      object.__setattr__(self, "model", default_model(self.dataset))
    if not isinstance(self.out, str) or not self.out:
      raise ValueError(f"out must name a folder, got {self.out!r}")
    for name in ("model_kwargs", "data_kwargs", "method_kwargs", "defense_kwargs"):
      if not isinstance(getattr(self, name), dict):
        raise ValueError(f"{name} must be a JSON object (dict), got "
                         f"{getattr(self, name)!r}")
    self._check_capture_rounds()
    self._check_attribute_inference()
    if self.samples_per_client is not None and self.partition not in (
        "label_groups", "groups"):
      raise ValueError("samples_per_client applies to partitions 'label_groups' "
                       "and 'groups' "
                       f"only, got partition={self.partition!r}")
    if self.clients_per_round is not None and self.clients_per_round > self.clients:
      raise ValueError(f"clients_per_round must be in [1, clients={self.clients}]"
                       f", got {self.clients_per_round}")
    models.builders.check_kwargs(self.model, self.model_kwargs)
    if data.sources.resolve_data_kwargs(self.dataset,
                                        self.data_kwargs).get("normalize"):
      _check_pixel_units(self)
    if (self.model in LPM_MODELS
        and self.model_kwargs.get("backbone_weights") is None):
      pretrained.check_dataset(
          "model_kwargs pretrain_dataset",
          self.model_kwargs.get("pretrain_dataset", "digits"), self.dataset)
    algorithms.method(self.method).resolve(self.method_kwargs)
    if self.defense is not None:
      defenses.resolve(self.defense, self.defense_kwargs)
    elif self.defense_kwargs:
      raise ValueError(f"defense_kwargs {sorted(self.defense_kwargs)} given "
                       "without a defense")
    if self.adaptive_adversaries:
      _check_adaptive(self)

  def _resolve_federation(self) -> None:
    """Checks the partition; takes the clients and the split's SHA-256 from
    a split file, refusing other given values."""
    partition = RUN_PARAMETERS["partition"].check(self.partition)
    path = data.splits.path_of(partition)
    if path is None:
      if partition not in (*data.PARTITIONS, data.CLIENT_DATA):
        raise ValueError(f"partition={partition!r}; choose one of "
                         f"{', '.join(data.PARTITIONS)}, or "
                         f"{data.splits.PREFIX}SPLIT.json")
      if self.split_sha256 is not None and partition != data.CLIENT_DATA:
        raise ValueError(f"split_sha256 belongs to a split file's or "
                         f"ClientData's clients, not partition={partition!r}")
      if self.clients is None:
        object.__setattr__(self, "clients", _run_default("clients"))
      return
    count, digest = data.splits.describe(path)
    if self.clients is not None and self.clients != count:
      raise ValueError(f"clients={self.clients}, but split file {path} holds "
                       f"{count} clients; leave clients out")
    if self.split_sha256 not in (None, digest):
      raise ValueError(f"split file {path} has changed: its SHA-256 is {digest}, "
                       f"not split_sha256={self.split_sha256}")
    object.__setattr__(self, "clients", count)
    object.__setattr__(self, "split_sha256", digest)

  def _check_capture_rounds(self) -> None:
    rounds = self.capture_rounds
    if not isinstance(rounds, (list, tuple)) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in rounds):
      raise ValueError(f"capture_rounds must be a list of round numbers, got "
                       f"{rounds!r}")
    object.__setattr__(self, "capture_rounds", tuple(sorted(set(rounds))))
    bad = [r for r in self.capture_rounds if not 1 <= r <= self.rounds]
    if bad:
      raise ValueError(f"capture_rounds must lie in [1, rounds={self.rounds}], "
                       f"got {bad}")

  def _check_attribute_inference(self) -> None:
    for name in ("infer_attributes", "attribute_adversaries"):
      value = getattr(self, name)
      if not isinstance(value, (list, tuple)) or not all(
          isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of names, got {value!r}")
      object.__setattr__(self, name, tuple(value))
    if self.infer_attributes and not self.capture_rounds:
      raise ValueError("infer_attributes attacks captured uploads: give "
                       "capture_rounds too")
    unknown = sorted(set(self.attribute_adversaries)
                     - set(attribute_inference.ADVERSARIES))
    if unknown or not self.attribute_adversaries:
      raise ValueError(f"attribute_adversaries {unknown or '(none)'}: choose "
                       f"from {', '.join(attribute_inference.ADVERSARIES)}")

  @property
  def sampled_per_round(self) -> int:
    return self.clients_per_round or self.clients

  def to_json(self) -> dict[str, Any]:
    """The configuration as it reads back from config.json (`out` aside),
    with every method and defence parameter resolved (defaults filled in),
    so that equivalent configs compare equal."""
    d = dataclasses.asdict(self)
    d.pop("out")
    d.pop("checkpoint_every")  # where it stops, not what it computes
    d["method_kwargs"] = algorithms.method(self.method).resolve(self.method_kwargs)
    # the options that differ from their defaults, none written when all do
    # not (so that runs from before the field existed resume)
    options = data.sources.DATA_PARAMETERS[self.dataset]
    d["data_kwargs"] = {
        k: v for k, v in data.sources.resolve_data_kwargs(
            self.dataset, self.data_kwargs).items() if v != options[k].default}
    if not d["data_kwargs"]:
      d.pop("data_kwargs")
    if self.defense is not None:
      d["defense_kwargs"] = defenses.resolve(self.defense, self.defense_kwargs)
    for name in ("evaluate_every", "evaluate"):  # as runs from before them
      if d[name] == _run_default(name):
        d.pop(name)
    if not self.infer_attributes:  # no effect; runs from before it resume
      d.pop("attribute_shadow_pool")
    if self.split_sha256 is None:  # as runs from before the field existed
      d.pop("split_sha256")
    return io.canonical(d)


def sample_clients(config: RunConfig, round_num: int) -> np.ndarray:
  """The clients of `round_num`: sorted, without replacement, from (seed, round)."""
  if config.sampled_per_round == config.clients:
    return np.arange(config.clients)
  rng = np.random.default_rng([config.seed, round_num, 0])
  return np.sort(rng.choice(config.clients, config.sampled_per_round,
                            replace=False))


def local_order(num_samples: int, algorithm: algorithms.Algorithm,
                config: RunConfig, round_num: int, client: int) -> np.ndarray:
  """Indices of a client's samples in the order it uses them this round:
  one batch (FedSGD) or a fresh permutation per local epoch."""
  rng = np.random.default_rng([config.seed, round_num, client + 1])
  if algorithm.local_data == "one_batch":
    return rng.permutation(num_samples)[: config.batch_size]
  return np.concatenate([rng.permutation(num_samples)
                         for _ in range(algorithm.local_epochs)])


def local_batches(num_samples: int, algorithm: algorithms.Algorithm,
                  config: RunConfig) -> list[int]:
  """The batch sizes of a client's round (`protocol.local_batch_sizes`)."""
  return local_batch_sizes(num_samples, config.batch_size, algorithm.local_epochs,
                           one_batch=algorithm.local_data == "one_batch")


def client_dataset(x: np.ndarray, y: np.ndarray, batch_sizes: Sequence[int],
                   extra: Optional[dict[str, np.ndarray]] = None) -> tf.data.Dataset:
  """(x, y) in order, cut into consecutive batches of `batch_sizes`; `extra`
  per-client inputs join every batch."""
  # Dataset.batch cuts each run of equal batches ending in a smaller one (a
  # local epoch). Joining `extra` needs Dataset.map, whose function would be
  # traced for every client: `_batches_with` traces it once per signature.
  if not extra:
    return _concatenated_runs(batch_sizes, lambda start, count, size: (
        tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
            x=x[start:start + count], y=y[start:start + count])).batch(size)))
  extra = _as_arrays(extra)
  join = _batches_with(_spec_of(x), _spec_of(y), _specs_of(extra))
  return _concatenated_runs(batch_sizes, lambda start, count, size: join(
      x[start:start + count], y[start:start + count], size, extra))


def _concatenated_runs(batch_sizes: Sequence[int], run_of: Callable) -> tf.data.Dataset:
  """The datasets `run_of(start, count, size)` of each run of equal batches
  (`_batch_runs`: `count` samples from `start` cut into batches of `size`),
  concatenated."""
  ds, start = None, 0
  for size, count in _batch_runs(batch_sizes):
    run = run_of(start, count, size)
    ds = run if ds is None else ds.concatenate(run)
    start += count
  return ds


def _as_arrays(extra: dict) -> collections.OrderedDict:
  return collections.OrderedDict((k, np.asarray(v)) for k, v in extra.items())


def _specs_of(extra: collections.OrderedDict) -> tuple:
  """(name, spec) of each of `extra`'s arrays: a hashable signature."""
  return tuple((k, tf.TensorSpec(v.shape, tf.as_dtype(v.dtype)))
               for k, v in extra.items())


def _joined(batches: tf.data.Dataset, extra) -> tf.data.Dataset:
  """`batches` with the tensors of `extra` joined to each batch."""
  consts = tf.data.Dataset.from_tensors(extra).repeat()
  return tf.data.Dataset.zip((batches, consts)).map(
      lambda batch, c: collections.OrderedDict(**batch, **c))


class ClientFiles:
  """Each client's training samples in files that the TFF workers read, so
  that a round's datasets carry a folder and a sample order, not the
  samples: the driver and the worker then hold only the batches in flight,
  whatever the number of samples (`file_client_dataset`). A client's
  folder, one file per sample (its x then its y, raw bytes), is written at
  its first round, in a private temporary folder removed by `close`, when
  this object is collected or at exit.

  The folder holds `LOCK`, locked (``flock``) for as long as this object
  lives: the kernel releases the lock when the process ends in any way, so
  the next `ClientFiles` removes the folders whose lock it can take, even
  those of processes in other PID namespaces sharing the temporary folder
  (containers, Bazel's sandboxes), whose PIDs say nothing here. Only for
  workers on this machine."""

  PREFIX = "tff-privacy-clients-"
  LOCK = ".lock"

  def __init__(self, x: np.ndarray, y: np.ndarray,
               client_indices: Sequence[np.ndarray]):
    self.x, self.y, self.client_indices = x, y, client_indices
    parent = tempfile.gettempdir()
    _remove_orphaned_client_files(parent)
    self._folder, lock = _locked_folder(parent, self.PREFIX, self.LOCK)
    self._finalizer = weakref.finalize(self, _remove_locked_folder, self._folder, lock)
    self._written: set[int] = set()

  def folder(self, client: int) -> str:
    """The folder of `client`'s samples x[indices], y[indices] (its
    `client_indices`): file k holds the k-th; written if new."""
    folder = os.path.join(self._folder, f"client_{client}")
    if client not in self._written:
      # whole or not at all; a half-written one goes with the run's folder
      tmp = tempfile.mkdtemp(dir=self._folder, prefix=".tmp-")
      for k, i in enumerate(self.client_indices[client]):
        with open(os.path.join(tmp, str(k)), "wb") as f:
          f.write(np.ascontiguousarray(self.x[i]).tobytes())
          f.write(np.ascontiguousarray(self.y[i]).tobytes())
      os.replace(tmp, folder)
      self._written.add(client)
    return folder

  def close(self) -> None:
    self._finalizer()


def _locked_folder(parent: str, prefix: str, lock_name: str) -> tuple[str, int]:
  """A new private folder `prefix`* in `parent` holding the file `lock_name`,
  locked by the returned descriptor. Made under another name and renamed
  once locked, so no cleaner ever sees one of its folders unlocked while
  its process lives.

  Raises:
    OSError: the folder cannot be made or locked (a file system without
      flock); nothing is left behind.
  """
  making = tempfile.mkdtemp(dir=parent, prefix=f".{prefix}new-")
  lock = None
  try:
    lock = os.open(os.path.join(making, lock_name), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    folder = os.path.join(parent, prefix + os.path.basename(making)[len(f".{prefix}new-"):])
    os.rename(making, folder)
  except OSError:
    if lock is not None:
      os.close(lock)
    shutil.rmtree(making, ignore_errors=True)
    raise
  return folder, lock


def _remove_locked_folder(folder: str, lock: int) -> None:
  shutil.rmtree(folder, ignore_errors=True)
  os.close(lock)


def _remove_orphaned_client_files(parent: str) -> None:
  """Removes this user's `ClientFiles` folders in `parent` whose lock no
  process holds, and those of earlier versions (named by their process id,
  without a lock) whose process no longer runs. Any other folder without a
  lock file is left alone."""
  for name in os.listdir(parent):
    if not name.startswith(ClientFiles.PREFIX):
      continue
    path = os.path.join(parent, name)
    try:
      status = os.lstat(path)
      if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid():
        continue
      lock = os.open(os.path.join(path, ClientFiles.LOCK), os.O_RDONLY)
    except FileNotFoundError:
      if _ended_unlocked(name[len(ClientFiles.PREFIX):]):
        shutil.rmtree(path, ignore_errors=True)
      continue
    except OSError:
      continue
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # its process still runs
      os.close(lock)
      continue
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock)


def _ended_unlocked(suffix: str) -> bool:
  """Whether an unlocked folder named `suffix` after the prefix is an earlier
  version's ('PID-random') whose process no longer runs."""
  pid, dash, _ = suffix.partition("-")
  return bool(dash) and pid.isdigit() and not _process_runs(int(pid))


def _process_runs(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def file_client_dataset(folder: str, specs: tuple[tf.TensorSpec, ...],
                        order: np.ndarray, batch_sizes: Sequence[int],
                        extra: Optional[dict[str, np.ndarray]] = None
                        ) -> tf.data.Dataset:
  """`client_dataset` of the samples x[order], y[order], read one at a time
  from `folder` (`ClientFiles.folder`; x and y with `specs`) when the
  dataset is iterated."""
  extra = _as_arrays(extra or {})
  batches = _file_batches(*specs, _specs_of(extra))
  order = np.asarray(order, np.int64)
  return _concatenated_runs(batch_sizes, lambda start, count, size: batches(
      folder, order[start:start + count], size, extra))


@functools.lru_cache(maxsize=None)
def _file_batches(x_spec, y_spec, extra_specs: tuple) -> Callable:
  """A tf.function (folder, order, batch size, extra) -> batches of the
  samples `order` read from the folder's files, joined by `extra`; traced
  once for these specs."""
  extra_spec = collections.OrderedDict(extra_specs)
  shapes = [s.shape[1:] for s in (x_spec, y_spec)]
  sizes = [s.dtype.size * shape.num_elements() for s, shape in zip((x_spec, y_spec), shapes)]

  def decoded(raw, start, spec, shape, size):
    return tf.reshape(tf.io.decode_raw(tf.strings.substr(raw, start, size), spec.dtype,
                                       little_endian=sys.byteorder == "little"), shape)

  def sample(folder, k):
    raw = tf.io.read_file(tf.strings.join([folder, tf.strings.as_string(k)], "/"))
    checked = tf.debugging.assert_equal(  # a file of other specs fails, not garbles
        tf.strings.length(raw), sum(sizes), message="a client sample file of other specs")
    with tf.control_dependencies([checked]):
      raw = tf.identity(raw)
    return collections.OrderedDict(
        x=decoded(raw, 0, x_spec, shapes[0], sizes[0]),
        y=decoded(raw, sizes[0], y_spec, shapes[1], sizes[1]))

  @tf.function(input_signature=(tf.TensorSpec([], tf.string), tf.TensorSpec([None], tf.int64),
                                tf.TensorSpec([], tf.int64), extra_spec))
  def batches(folder, order, size, extra):
    samples = tf.data.Dataset.from_tensor_slices(order).map(
        lambda k: sample(folder, k), num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True).batch(size)
    return _joined(samples, extra) if extra_spec else samples

  return batches


def _spec_of(samples: np.ndarray) -> tf.TensorSpec:
  """The spec of `samples`, their number left open."""
  return tf.TensorSpec((None, *samples.shape[1:]), tf.as_dtype(samples.dtype))


@functools.lru_cache(maxsize=None)
def _batches_with(x_spec, y_spec, extra_specs: tuple) -> Callable:
  """A tf.function (x, y, batch size, extra) -> batches of (x, y) joined by
  `extra`, traced once for these specs."""
  extra_spec = collections.OrderedDict(extra_specs)

  @tf.function(input_signature=(x_spec, y_spec, tf.TensorSpec([], tf.int64),
                                extra_spec))
  def batches(x, y, size, extra):
    ds = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(x=x, y=y))
    return _joined(ds.batch(size), extra)

  return batches


def _batch_runs(batch_sizes: Sequence[int]) -> list[tuple[int, int]]:
  """(batch size, samples) of each run of equal batches that Dataset.batch
  cuts alike: a run ends after a smaller batch, e.g. [4, 4, 2, 4, 4, 2] ->
  [(4, 10), (4, 10)]."""
  runs: list[list] = []  # [size, samples, ended]
  for b in batch_sizes:
    if runs and not runs[-1][2] and b <= runs[-1][0]:
      runs[-1][1] += b
      runs[-1][2] = b < runs[-1][0]
    else:
      runs.append([b, b, False])
  return [(size, count) for size, count, _ in runs]


class _NotRetracing(logging.Filter):
  """Drops TensorFlow's retracing warning about Evaluator functions: each
  Evaluator traces its functions once, and TensorFlow's detector counts
  those traces over every instance (a leaderboard process makes one per
  row), which is not retracing."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ("triggered tf.function retracing" in message
                and "Evaluator." in message)


def _quiet_retracing_warnings() -> None:
  logger = tf.get_logger()
  if not any(isinstance(f, _NotRetracing) for f in logger.filters):
    logger.addFilter(_NotRetracing())


def _eval_chunks(count: int, indices: Optional[np.ndarray]):
  """(positions, samples) of each `_EVAL_CHUNK` of `count` samples: a slice
  of the positions, and the samples' indices there (the slice itself
  where `indices` is None)."""
  for start in range(0, count, _EVAL_CHUNK):
    positions = slice(start, start + _EVAL_CHUNK)
    yield positions, positions if indices is None else indices[positions]


class Evaluator:
  """The task's metrics (`tff_privacy.tasks`) of a model given its weights
  on given samples, in plain TensorFlow (one trace for every weights and
  sample count)."""

  def __init__(self, spec: models.ModelSpec):
    self._model = spec.keras()
    self.task = spec.task_object
    weights = [tf.TensorSpec(v.shape, v.dtype)
               for v in self._model.trainable_variables]
    _quiet_retracing_warnings()
    self._sums = tf.function(self._sums_fn, input_signature=[
        weights, tf.TensorSpec((None,) + spec.input_shape, tf.float32),
        tf.TensorSpec((None,) + self.task.label_shape(spec.input_shape), tf.int32)])
    self._group_sums = tf.function(self._group_sums_fn, input_signature=[
        weights, tf.TensorSpec((None,) + spec.input_shape, tf.float32),
        tf.TensorSpec((None,) + self.task.label_shape(spec.input_shape), tf.int32),
        tf.TensorSpec((None,), tf.int32), tf.TensorSpec((), tf.int32)])

  def _sums_fn(self, weights, x, y):
    for v, w in zip(self._model.trainable_variables, weights):
      v.assign(w)
    totals = tf.zeros([len(self.task.sum_names)])
    for xb, yb in tf.data.Dataset.from_tensor_slices((x, y)).batch(_EVAL_BATCH):
      totals += tf.stack(self.task.sums(self._model(xb, training=False), yb))
    return totals

  def _group_sums_fn(self, weights, x, y, groups, num_groups):
    for v, w in zip(self._model.trainable_variables, weights):
      v.assign(w)
    totals = tf.zeros([num_groups, len(self.task.sum_names)])
    for xb, yb, gb in tf.data.Dataset.from_tensor_slices((x, y, groups)).batch(_EVAL_BATCH):
      per_sample = tf.vectorized_map(
          lambda pair: tf.stack(self.task.sums(pair[0][None], pair[1][None])),
          (self._model(xb, training=False), yb))
      totals += tf.math.unsorted_segment_sum(per_sample, gb, num_groups)
    return totals

  def scores(self, weights: Sequence[np.ndarray], x: np.ndarray,
             y: np.ndarray, indices: Optional[np.ndarray] = None
             ) -> dict[str, float]:
    """Every metric of the task on (x, y), or on its samples `indices`; an
    empty set is refused. Reads `_EVAL_CHUNK` samples at a time, so the
    memory it takes does not grow with the set (x may be a memmap)."""
    count = len(y) if indices is None else len(indices)
    if not count:
      raise ValueError("no samples to score: a model has no metrics on an "
                       "empty set")
    weights = [tf.constant(w) for w in weights]
    sums = np.zeros(len(self.task.sum_names))
    for _, samples in _eval_chunks(count, indices):
      sums += self._sums(weights, x[samples], y[samples]).numpy()
    return self.task.scores([float(v) for v in sums], count)

  def scores_by_group(self, weights: Sequence[np.ndarray], x: np.ndarray,
                      y: np.ndarray, groups: np.ndarray, num_groups: int,
                      indices: Optional[np.ndarray] = None
                      ) -> list[Optional[dict[str, float]]]:
    """Every metric of the task on each group of (x, y), or of its samples
    `indices` (`groups` holds each of those samples' group in [0,
    num_groups)), one model, in one pass: the same as `scores` on each
    group's samples, without a call per group; None for a group without
    samples."""
    weights = [tf.constant(w) for w in weights]
    groups = np.asarray(groups, np.int32)
    sums = np.zeros((num_groups, len(self.task.sum_names)))
    for positions, samples in _eval_chunks(len(groups), indices):
      sums += self._group_sums(weights, x[samples], y[samples],
                               groups[positions], num_groups).numpy()
    counts = np.bincount(groups, minlength=num_groups)
    return [self.task.scores([float(v) for v in sums[g]], int(counts[g]))
            if counts[g] else None for g in range(num_groups)]

  def __call__(self, weights: Sequence[np.ndarray], x: np.ndarray,
               y: np.ndarray) -> tuple[float, float]:
    """(the task's primary metric, e.g. accuracy; mean loss) on (x, y)."""
    scores = self.scores(weights, x, y)
    return scores[self.task.primary_metric], scores["loss"]


def stacked_capture(uploads, weights) -> collections.OrderedDict:
  """The `captured` measurements a `CaptureFactory` reports, from uploads and
  weights returned CLIENTS-placed (one list of tensors and one weight per
  client, in client order)."""
  return collections.OrderedDict(
      num_uploads=np.int32(len(uploads)),
      uploads=[np.stack([np.asarray(u[k]) for u in uploads])
               for k in range(len(uploads[0]))],
      upload_weights=np.asarray(weights, np.float32))


def _spread(prefix: str, primary: str,
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


def _scalar_metrics(tree, prefix: str = "") -> dict[str, float]:
  """Flattens TFF's nested training metrics to 'a/b': float for scalars."""
  out = {}
  if isinstance(tree, dict):
    for k, v in tree.items():
      out.update(_scalar_metrics(v, f"{prefix}{k}/"))
  elif np.ndim(tree) == 0:
    out[prefix[:-1]] = float(tree)
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class RoundClient:
  """A client sampled for a round: its index; `samples`, its distinct
  samples' indices into the run's training arrays (`source`), in their
  first-epoch order; the dataset it trains on (those samples in training
  order, every local epoch); the sensitive attributes of its distinct
  samples, by name (empty if the data set has none). `x` and `y` (the
  ground truth) gather the samples when asked, so a round holds none of
  them beforehand."""

  index: int
  samples: np.ndarray
  dataset: Any
  attributes: dict[str, np.ndarray]
  source: data.Source = dataclasses.field(repr=False)

  @property
  def x(self) -> np.ndarray:
    return self.source.x_train[self.samples]

  @property
  def y(self) -> np.ndarray:
    return self.source.y_train[self.samples]


class Run:
  """A configured run: data, model, algorithm and output folders; `fed`,
  the clients of a 'client_data' partition (`with_client_data`)."""

  def __init__(self, config: RunConfig, fed: Optional[data.FederatedData] = None):
    if (config.partition == data.CLIENT_DATA) != (fed is not None):
      raise ValueError(f"partition={data.CLIENT_DATA!r} goes with the clients' "
                       "ClientData: give train_data and test_data to runner.run")
    self.fed = fed or data.load(config.dataset, config.clients, config.partition,
                                config.alpha, config.seed, config.data_dir,
                                config.samples_per_client, config.data_kwargs)
    task_kwargs = {}
    if config.positive_weight != 1.0:
      if self.fed.source.task != "segmentation":
        raise ValueError(f"positive_weight applies to segmentation data sets; "
                         f"{config.dataset!r} is {self.fed.source.task}")
      task_kwargs["positive_weight"] = config.positive_weight
    spec = models.ModelSpec(config.model, self.fed.source.input_shape,
                            self.fed.source.num_classes, config.model_kwargs,
                            self.fed.source.task, task_kwargs)
    spec.check_builds()
    self.spec = spec.pinned()
    # with the backbone's fingerprint, for config.json
    self.config = dataclasses.replace(config, model_kwargs=self.spec.kwargs)
    defense = (defenses.build(config.defense, self.spec, self.fed, config.out,
                              **config.defense_kwargs)
               if config.defense else None)
    # Server-side defences replace the aggregator; client-side ones go into
    # the method's client work.
    self.central = defense if isinstance(defense, defenses.DPFedAvg) else None
    self.client_defense = None if self.central else defense
    self.algorithm = algorithms.get(
        config.method, self.spec, batch_size=config.batch_size,
        seed=config.seed, defense=None if self.central else defense,
        federation=algorithms.Federation(
            config.rounds, tuple(len(i) for i in self.fed.client_indices),
            self.fed.test, config.dp_delta, self.fed),
        **config.method_kwargs)
    if (self.central and self.central.audit_canaries and (
        self.algorithm.upload_kind not in ("gradient", "model_delta")
        or self.algorithm.private_state is not None)):
      raise ValueError(f"audit_canaries: method {config.method!r} uploads "
                       f"{self.algorithm.upload_kind}; canary clients audit a "
                       "model that steps along the aggregate of its clients' "
                       "model deltas or gradients")
    if self.central and not self.algorithm.aggregates_uploads:
      raise ValueError(f"defense {config.defense!r} transforms the aggregate, "
                       f"which method {config.method!r} does not use; choose "
                       "a method that averages its uploads")
    if config.evaluate == LOCAL_AFTER_TRAINING and (
        self.algorithm.local_model is None or self.central):
      what = f"method {config.method!r}" + (
          f" with defense {config.defense!r}" if config.defense else "")
      raise ValueError(f"evaluate={LOCAL_AFTER_TRAINING!r}: the uploads of {what} "
                       "do not give the models its clients reached by their "
                       "local training; use evaluate='global'")
    attributes = self.fed.source.attributes
    missing = [a for a in config.infer_attributes
               if attributes is None or a not in attributes.classes]
    if missing:
      raise ValueError(f"infer_attributes {missing}: data set {config.dataset!r} "
                       f"has sensitive attributes "
                       f"{sorted(attributes.classes) if attributes else 'none'}")
    if config.capture_rounds and self.algorithm.upload_kind == "none":
      raise ValueError(f"capture_rounds: method {config.method!r} uploads "
                       "nothing; leave --capture-rounds out")
    self._processes: dict[bool, tff.templates.IterativeProcess] = {}

  @property
  def uploads_evaluated(self) -> bool:
    """Whether evaluated rounds need the clients' uploads
    ('local-after-training' of a method that uploads something)."""
    return (self.config.evaluate == LOCAL_AFTER_TRAINING
            and self.algorithm.upload_kind != "none")

  def evaluated(self, round_num: int) -> bool:
    """Whether round `round_num` is evaluated (`evaluate_every`, and the last)."""
    c = self.config
    return round_num % c.evaluate_every == 0 or round_num == c.rounds

  def returns_uploads(self, round_num: int) -> bool:
    """Whether round `round_num` runs on the capturing process: captured, or
    evaluated on the clients' uploads."""
    return (round_num in self.config.capture_rounds
            or (self.evaluated(round_num) and self.uploads_evaluated))

  def needed_processes(self) -> list[bool]:
    """The `process(capture)` flags that the run's rounds use: a process is
    built (and its computations traced) only where some round runs on it."""
    return sorted({self.returns_uploads(k) for k in range(1, self.config.rounds + 1)})

  @property
  def personalized(self) -> bool:
    """Whether clients keep private state (a `PersonalizedProcess`)."""
    return self.algorithm.private_state is not None

  def process(self, capture: bool) -> tff.templates.IterativeProcess:
    """The method's process; with `capture`, its aggregator reports uploads.

    Both share one state type, so either can run any round, and serve
    `initial_state` and `server_weights` alike.
    """
    if capture not in self._processes:
      n = self.config.sampled_per_round
      inner = (self.central.aggregator(n, self.config.seed, self.config.clients)
               if self.central
               else wide_sum.wide_mean_factory())
      view = self.central.server_view if self.central else None
      aggregator = ClientPlacedCapture(inner, n, view) if capture else inner
      self._processes[capture] = self.algorithm.build_process(aggregator)
    return self._processes[capture]

  def initial_state(self):
    """The state before round 1: the process's server state, with (for
    personalised methods) every client's initial private state."""
    process = self._built_process()
    if self.personalized:
      return collections.OrderedDict(
          server=process.initialize(),
          clients=[self.algorithm.private_state.initial(c)
                   for c in range(self.config.clients)])
    return process.set_model_weights(
        process.initialize(),
        tff.learning.models.ModelWeights(self.spec.initial_weights(self.config.seed),
                                         []))

  def checkpoint_form(self, state):
    """`state` as checkpoints hold it: personalised methods' private states
    stacked leaf by leaf over clients (a checkpoint of one tensor per client
    and leaf takes seconds to write)."""
    if not self.personalized:
      return state
    return collections.OrderedDict(server=state["server"], clients=tf.nest.map_structure(
        lambda *leaves: np.stack(leaves), *state["clients"], check_types=False))

  def from_checkpoint(self, saved):
    """The state that `checkpoint_form` gave `saved`."""
    if not self.personalized:
      return saved
    stacked = saved["clients"]
    return collections.OrderedDict(server=saved["server"], clients=[
        tf.nest.map_structure(lambda leaf, i=i: leaf[i], stacked)
        for i in range(self.config.clients)])

  def server_weights(self, state) -> list[np.ndarray]:
    """The model the server holds and broadcasts (a personalised method's
    shared part, e.g. HyperFL's hypernetwork)."""
    if self.personalized:
      return list(self._built_process().get_model_weights(state["server"]))
    return list(self._built_process().get_model_weights(state).trainable)

  def _built_process(self) -> tff.templates.IterativeProcess:
    """A process already built, the plain one first (either serves)."""
    return self.process(bool(self._processes) and False not in self._processes)

  def step(self, state, clients, capture: bool):
    """One round on `clients` (from `round_data`); returns (state, metrics).
    Private states go in and come back CLIENTS-placed, in client order."""
    datasets = [c.dataset for c in clients]
    if not self.personalized:
      output = self.process(capture).next(state, datasets)
      return output.state, output.metrics
    table = list(state["clients"])
    output = self.process(capture).run_round(
        state["server"], datasets, [table[c.index] for c in clients])
    for c, new in zip(clients, output["client_states"]):
      table[c.index] = new
    metrics = output["metrics"]
    if "uploads" in output:  # `ClientPlacedCapture`: returned, not aggregated
      metrics = collections.OrderedDict(metrics, aggregator=collections.OrderedDict(
          inner=metrics["aggregator"],
          captured=stacked_capture(output["uploads"], output["upload_weights"])))
    return collections.OrderedDict(server=output["state"], clients=table), metrics

  def sent_models(self, state, clients) -> Optional[dict[int, list[np.ndarray]]]:
    """What each of `clients` (from `round_data`) is sent this round, for
    methods whose server sends each client its own model; else None (they
    all get `server_weights`)."""
    private = self.algorithm.private_state
    if private is None or private.sent is None:
      return None
    weights = self.server_weights(state)
    return {c.index: private.sent(weights, state["clients"][c.index])
            for c in clients}

  @functools.cached_property
  def _client_tests(self) -> tuple[np.ndarray, np.ndarray, int]:
    """Every client's test samples in one index array into the test set,
    each one's client, and the number of clients."""
    indices = self.fed.client_test_indices
    flat = np.concatenate(indices).astype(np.int64)
    groups = np.repeat(np.arange(len(indices)), [len(i) for i in indices])
    return flat, groups, len(indices)

  def personal_weights(self, state) -> list[list[np.ndarray]]:
    """Every client's own model: for personalised methods from its private
    state, for the others the global model."""
    weights = self.server_weights(state)
    if not self.personalized:
      return [weights] * self.config.clients
    return [self.algorithm.private_state.personal_weights(weights, own)
            for own in state["clients"]]

  def evaluate(self, evaluator: Evaluator, state) -> dict[str, Any]:
    """Personalised evaluation (each client's own model on its own test
    split: mean, spread and minimum over the clients that have test samples,
    the primary metric of each of them, and how many have none) and, for
    methods with one global model, that model on the whole test set."""
    entry = {}
    tested = [c for c, idx in enumerate(self.fed.client_test_indices) if len(idx)]
    if not self.personalized:
      source = self.fed.source
      entry.update({f"test_{k}": v for k, v in evaluator.scores(
          self.server_weights(state), source.x_test, source.y_test,
          indices=self.fed.test_indices).items()})
      entry["samples_tested"] = len(source.y_test if self.fed.test_indices is None
                                  else self.fed.test_indices)
    if self.personalized:
      weights = self.personal_weights(state)
      per_client = [evaluator.scores(weights[c], *self.fed.client_test_arrays(c))
                    for c in tested]
    else:
      flat, groups, num_clients = self._client_tests
      by_client = evaluator.scores_by_group(
          self.server_weights(state), self.fed.source.x_test,
          self.fed.source.y_test, groups, num_clients, indices=flat)
      per_client = [by_client[c] for c in tested]
    primary = evaluator.task.primary_metric
    entry["clients_without_test_data"] = self.config.clients - len(tested)
    entry.update(_spread("personal", primary, per_client))
    entry[f"personal_{primary}_by_client"] = [s[primary] for s in per_client]
    return entry

  def evaluate_local(self, evaluator: Evaluator, broadcast, clients, metrics,
                     state) -> dict[str, float]:
    """'local-after-training' evaluation of a round: the model each of
    `clients` (from `round_data`) reached by its local training, before
    aggregation (`Algorithm.local_model` of its upload in the round's
    `metrics` and its private state in `state` after the round), on its own
    test split: mean, spread and minimum over those with test samples
    (`local_after_training_<metric>_mean`, ...), and how many they were."""
    uploads = (metrics["aggregator"]["captured"]["uploads"]
               if self.algorithm.upload_kind != "none" else None)
    per_client = []
    for i, c in enumerate(clients):
      if not len(self.fed.client_test_indices[c.index]):
        continue
      weights = self.algorithm.local_model(
          broadcast, None if uploads is None else [u[i] for u in uploads],
          state["clients"][c.index] if self.personalized else None)
      per_client.append(evaluator.scores(weights, *self.fed.client_test_arrays(c.index)))
    return {"local_after_training_clients": len(per_client),
            **_spread("local_after_training", evaluator.task.primary_metric,
                      per_client)}

  def round_data(self, round_num: int) -> list["RoundClient"]:
    """Every client sampled for `round_num`, as a `RoundClient`. Its dataset
    may read files this `Run` owns: use it while the `Run` lives."""
    out = []
    attributes = self.fed.source.attributes
    x, y = self.fed.source.x_train, self.fed.source.y_train
    for client in sample_clients(self.config, round_num):
      idx = self.fed.client_indices[client]
      order = local_order(len(idx), self.algorithm, self.config, round_num, client)
      extra = (self.algorithm.client_inputs(int(client), round_num)
               if self.algorithm.client_inputs else None)
      distinct = idx[order[: min(len(idx), len(order))]]
      sizes = local_batches(len(distinct), self.algorithm, self.config)
      if runtime.runs_on_this_machine() and len(order) >= len(idx):
        dataset = file_client_dataset(self._client_files.folder(int(client)),
                                      (_spec_of(x), _spec_of(y)), order, sizes, extra)
      else:  # workers elsewhere; or a round on part of the client's samples
        dataset = client_dataset(x[idx[order]], y[idx[order]], sizes, extra)
      out.append(RoundClient(
          int(client), distinct, dataset,
          {a: v[distinct] for a, v in attributes.train.items()} if attributes else {},
          self.fed.source))
    return out

  @functools.cached_property
  def _client_files(self) -> ClientFiles:
    return ClientFiles(self.fed.source.x_train, self.fed.source.y_train,
                       self.fed.client_indices)

  @functools.cached_property
  def _num_params(self) -> int:
    return sum(int(np.prod(w.shape)) for w in self.spec.initial_weights(0))

  @functools.cached_property
  def round_dp_event(self) -> Optional[accounting.RoundEvent]:
    """The DP event of one round, if the run uses a DP mechanism that
    `dp_accounting` models."""
    if self.central:
      return self.central.round_event(self.config.clients,
                                      self.config.sampled_per_round)
    event = self.algorithm.dp_event(self._num_params) if self.algorithm.dp_event else None
    if event is None:
      return None
    return accounting.RoundEvent(
        event, self.algorithm.dp_relation or self._defense_class.dp_relation,
        _LOCAL_SAMPLING)

  @property
  def _defense_class(self):
    return defenses.defense_class(self.config.defense)

  def privacy_spent(self, rounds: int,
                    history: Sequence[dict] = ()) -> dict[str, Any]:
    """(epsilon, delta) spent after `rounds` rounds, with the neighbouring
    relation (`dp_relation`) and the client sampling (`dp_sampling`) they
    assume. Local DP: each client's mechanism composed over every round,
    see `accounting.largest_rounds_epsilon`; pure-DP mechanisms outside
    `dp_accounting` (LDP-Fed) by the basic composition theorem, with delta
    0. Central DP-FedAvg: user-level, see `DPFedAvg.round_event`. With what
    the method states of its privacy (`Algorithm.stated_privacy`, given
    the metrics `history` of those rounds), which may also be all there is
    (a null epsilon and why); empty for runs without a DP mechanism."""
    stated = (self.algorithm.stated_privacy(rounds, history)
              if self.algorithm.stated_privacy else {})
    round_event = self.round_dp_event
    if round_event is None:
      pure = (self.algorithm.pure_epsilon(self._num_params)
              if self.algorithm.pure_epsilon else None)
      if pure is None:
        return stated
      eps, delta = accounting.simple_composition([pure] * rounds)
      return {"epsilon": eps, "delta": delta,
              "dp_relation": self._defense_class.dp_relation,
              "dp_sampling": _LOCAL_SAMPLING + "; basic composition"}
    eps, delta = accounting.largest_rounds_epsilon(round_event, rounds,
                                                   self.config.dp_delta)
    return {"epsilon": eps, "delta": delta, "dp_relation": round_event.relation,
            "dp_sampling": round_event.sampling, **stated}

  def run_metadata(self) -> dict[str, Any]:
    """The store's run metadata; 'normalize' only for normalised data
    (`tff_privacy.data.normalization`), so that stores of other runs keep
    their metadata."""
    src = self.fed.source
    normalized = ({"normalize": src.normalization.to_json()}
                  if src.normalization else {})
    return {"method": self.algorithm.name,
            "upload_kind": self.algorithm.upload_kind,
            "defense": (self.algorithm.defense or
                        ({"name": self.central.name, **self.central.params()}
                         if self.central else None)),
            "model": self.spec.to_json(), "dataset": src.name,
            "value_range": list(src.value_range), "raw_max": src.raw_max,
            **normalized, "protocol": self.algorithm.protocol}


# Local DP is accounted per client over every round, sampled or not.
_LOCAL_SAMPLING = ("none assumed: every round counts for every client (an upper "
                   "bound when clients are sampled)")


def _check_pixel_units(config: RunConfig) -> None:
  """Refuses data_kwargs 'normalize' for the input perturbations stated in
  the pixel units of [0, 1] images (FedEM's radius and clipping, FedRE's
  perturbation='pixels'), which would act on normalised values."""
  method = algorithms.method(config.method).resolve(config.method_kwargs)
  if config.method == "fedem" or method.get("perturbation") == "pixels":
    raise ValueError(f"data_kwargs 'normalize' and method {config.method!r}: "
                     "its input perturbation is stated in pixel units of "
                     "[0, 1] images; leave normalize out")


def check_workers(config: RunConfig, remote: bool) -> None:
  """Refuses workers on other machines (`remote`) for a defence whose
  clients read files the run writes (`reads_run_files`): those workers do
  not see them.

  Raises:
    ValueError: naming the defence.
  """
  if remote and getattr(defenses.DEFENSES.get(config.defense),
                        "reads_run_files", False):
    raise ValueError(f"--defense {config.defense} and --worker-addresses: its "
                     f"clients read files the run writes under {config.out}, "
                     "which workers elsewhere do not see; use --workers N")


def check_config(config: RunConfig) -> None:
  """Refuses an output path that is a file, or a folder holding a run made
  with another config, naming every differing key with both values. The
  exception is `rounds` above the rounds done, which resumes (except for
  methods sized by the run, `Method.needs_federation`); fewer would leave
  metrics.json and the final models at the rounds done."""
  if os.path.exists(config.out) and not os.path.isdir(config.out):
    raise ValueError(f"out={config.out!r} is a file; give a folder (new or "
                     "holding this run)")
  path = os.path.join(config.out, "config.json")
  if not os.path.exists(path):
    return
  old, new = io.read_json(path), config.to_json()
  old.pop(provenance.KEY, None)  # which code trained it: not its config
  done = _rounds_done(config.out)
  sized = algorithms.method(config.method).needs_federation
  resumes = new["rounds"] > done and not sized
  changed = _differences({**old, "rounds": None} if resumes else old,
                         {**new, "rounds": None} if resumes else new)
  if changed:
    why = (f" (method {config.method!r} sizes itself by them: its noise spends "
           "its budget over the run)" if sized else
           f" ({done} done: a run resumes to more rounds only)")
    raise ValueError(
        f"{config.out} holds a run with another config (differs in "
        + "; ".join(d + (why if d.startswith("rounds:") else "") for d in changed)
        + "); choose another --out or delete it")


_UNSET = object()  # a key that one config lacks


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
  """'key: OLD there, NEW now' for every key whose value differs between
  `old` and `new`, in key order; JSON objects on both sides compared key by
  key ('method_kwargs.local_epochs: ...')."""
  out = []
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key, _UNSET), new.get(key, _UNSET)
    if a == b:
      continue
    if isinstance(a, dict) and isinstance(b, dict):
      out.extend(_differences(a, b, f"{prefix}{key}."))
    else:
      out.append(f"{prefix}{key}: {_shown(a)} there, {_shown(b)} now")
  return out


def _shown(value: Any) -> str:
  return "unset" if value is _UNSET else json.dumps(value)


def _checkpoints(out: str) -> tff.program.FileProgramStateManager:
  """The state manager of run folder `out` (it makes its folder)."""
  return tff.program.FileProgramStateManager(
      os.path.join(out, "checkpoints"), keep_total=2, keep_first=False)


def _load_latest(manager, structure, config) -> tuple:
  """(the last checkpointed state, its round), or (None, 0).

  Raises:
    ValueError: naming the folder, for a checkpoint of a state of another
      form (one that another version of the method wrote)."""
  try:
    return asyncio.run(manager.load_latest(structure))
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"{os.path.join(config.out, 'checkpoints')}: its last checkpoint holds "
        f"another form of {config.method}'s state than this version's, so the "
        f"run cannot go on from it; remove that folder to train from round 1 "
        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _rounds_done(out: str) -> int:
  """The last round checkpointed in run folder `out`; 0 for none."""
  if not os.path.isdir(os.path.join(out, "checkpoints")):
    return 0
  return max(asyncio.run(_checkpoints(out).get_versions()) or [0])


def _recorded_config(config: RunConfig) -> dict[str, Any]:
  """What config.json holds: `config.to_json()` and, under
  `provenance.KEY`, the code versions that trained the run's checkpointed
  rounds, this process's added when it has rounds left to train."""
  path = os.path.join(config.out, "config.json")
  done = _rounds_done(config.out)
  saved = io.read_json(path) if done and os.path.exists(path) else {}
  earlier = provenance.versions_of(saved) if done else []
  now = [provenance.code_version()] if config.rounds > done else []
  return {**config.to_json(), provenance.KEY: provenance.merged(earlier, now)}


def _pinned_as_saved(config: RunConfig) -> RunConfig:
  """`config` with the backbone fingerprint that the run in its folder
  recorded (config.json's model_kwargs), unless it gives its own: a resumed
  run refuses another backbone file."""
  path = os.path.join(config.out, "config.json")
  if "backbone_fingerprint" in config.model_kwargs or not os.path.isfile(path):
    return config
  saved = io.read_json(path).get("model_kwargs", {}).get("backbone_fingerprint")
  if config.model not in LPM_MODELS or saved is None:
    return config
  return dataclasses.replace(
      config, model_kwargs={**config.model_kwargs, "backbone_fingerprint": saved})


def with_client_data(
    config: RunConfig, train_data: tff.simulation.datasets.ClientData,
    test_data: tff.simulation.datasets.ClientData
) -> tuple[RunConfig, data.FederatedData]:
  """`config` for the clients of `train_data` and `test_data`
  (`tff_privacy.data.from_client_data`, on the samples of `config.dataset`'s
  kind), and those clients: partition 'client_data', their number of
  clients and the SHA-256 of their samples (`FederatedData.sha256`).

  Raises:
    ValueError: for a partition other than the default or 'client_data'.
  """
  if config.partition not in (_run_default("partition"), data.CLIENT_DATA):
    raise ValueError(f"partition={config.partition!r} and train_data: the "
                     "ClientData gives the clients; leave partition out")
  source = data.load_source(config.dataset, config.data_dir, config.data_kwargs)
  fed = data.from_client_data(source, train_data, test_data)
  return dataclasses.replace(config, partition=data.CLIENT_DATA,
                             clients=fed.num_clients,
                             split_sha256=fed.sha256()), fed


def run(config: RunConfig, progress: bool = True,
        train_data: Optional[tff.simulation.datasets.ClientData] = None,
        test_data: Optional[tff.simulation.datasets.ClientData] = None,
        federation: Optional[data.FederatedData] = None) -> list[dict[str, Any]]:
  """Trains (or resumes) the run described by `config`; returns its metrics.

  The clients are `config`'s partition of its data set, or given as TFF
  ClientData, `train_data` and `test_data` together (`with_client_data`:
  config.json then records partition 'client_data' and their SHA-256, and
  a resume needs the same ClientData). `federation` is such clients already
  read, with the config that `with_client_data` returned beside them (how
  the leaderboard hands them to the processes that train its rows).
  Nothing is written under `config.out` until the data, model, defence and
  method's processes have been built from the config without error.
  Computations run on the runtime's workers: those started by
  `runtime.start`, or a private local one where TFF's own context would run
  them (`runtime.install_over_tffs_own`)."""
  fed = federation
  if train_data is not None or test_data is not None:
    if train_data is None or test_data is None:
      raise ValueError("train_data and test_data: give both ClientData")
    if federation is not None:
      raise ValueError("federation: give it or train_data and test_data, not both")
    config, fed = with_client_data(config, train_data, test_data)
  elif federation is not None and (config.partition != data.CLIENT_DATA or
                                   config.split_sha256 != federation.sha256()):
    raise ValueError("federation: its config is the one with_client_data "
                     "returned with it (partition 'client_data', its SHA-256)")
  config = _pinned_as_saved(config)
  runtime.install_over_tffs_own()
  check_workers(config, runtime.serves_remotely())
  check_config(config)
  r = Run(config, fed)
  if (config.infer_attributes
      and r.algorithm.upload_kind not in attribute_inference.UPLOAD_KINDS):
    raise ValueError(f"infer_attributes: method {config.method!r} uploads "
                     f"{r.algorithm.upload_kind}, and the adversaries simulate "
                     f"uploads of the model's weights "
                     f"({', '.join(attribute_inference.UPLOAD_KINDS)})")
  what = f"method {config.method!r}" + (
      f" with defense {config.defense!r}" if config.defense else "")
  for capture in r.needed_processes():
    # Built before any eager Keras model: tracing a TFF computation that builds
    # Keras layers invalidates Keras models made earlier in eager mode.
    runtime.check_mergeable(r.process(capture).next,
                            what + (" and capture" if capture else ""))
  os.makedirs(config.out, exist_ok=True)
  io.write_json(os.path.join(config.out, "config.json"), _recorded_config(r.config))
  manager = _checkpoints(config.out)
  runtime.limit_concurrent_calls(r.algorithm.concurrent_clients)
  initial = r.initial_state()
  saved, done = _load_latest(manager, r.checkpoint_form(initial), config)
  state = initial if saved is None else r.from_checkpoint(saved)
  metrics_path = os.path.join(config.out, "metrics.json")
  history = []
  if done and os.path.exists(metrics_path):
    history = [m for m in io.read_json(metrics_path) if m["round"] <= done]
  evaluator = Evaluator(r.spec)
  writer = tf.summary.create_file_writer(os.path.join(config.out, "tensorboard"))
  bar = tqdm.tqdm(range(done + 1, config.rounds + 1), disable=not progress,
                  initial=done, total=config.rounds, desc=config.method,
                  unit="round")
  shown = {}
  for round_num in bar:
    start = time.perf_counter()
    capture = round_num in config.capture_rounds
    broadcast = r.server_weights(state)
    if r.client_defense is not None:  # first: it may write the clients' inputs
      r.client_defense.prepare_round(round_num, broadcast, r.algorithm.upload_kind,
                                     r.algorithm.protocol)
    clients = r.round_data(round_num)
    sent = r.sent_models(state, clients) if capture else None
    evaluated = r.evaluated(round_num)
    state, metrics = r.step(state, clients, r.returns_uploads(round_num))
    if r.central is not None and r.central.audit_canaries:
      _record_canary_cosines(r, round_num, broadcast, r.server_weights(state))
    entry = {"round": round_num}
    if evaluated:
      entry.update(r.evaluate(evaluator, state))
      if config.evaluate == LOCAL_AFTER_TRAINING:
        entry.update(r.evaluate_local(evaluator, broadcast, clients, metrics, state))
      shown = _shown_metrics(r.spec.task_object.primary_metric, entry)
    entry.update(train_measurements(metrics["client_work"]["train"]))
    entry.update(client_defense_measurements(metrics, [c.index for c in clients]))
    entry.update(r.privacy_spent(round_num, history + [entry]))
    entry.update(server_step_measurements(metrics))
    if capture:
      captured = metrics["aggregator"]["captured"]
      _write_capture(r, round_num, None if sent else broadcast, clients,
                     captured, sent)
      entry.update(update_fidelity(r, broadcast, clients, captured))
      entry.update(_attribute_inference(r, round_num))
    entry["seconds"] = time.perf_counter() - start
    history.append(entry)
    io.write_json(metrics_path, history)
    with writer.as_default(step=round_num):
      for k, v in entry.items():
        if k != "round" and isinstance(v, (int, float, np.number)):
          tf.summary.scalar(k, v)
    writer.flush()
    if round_num % config.checkpoint_every == 0 or round_num == config.rounds:
      asyncio.run(manager.save(r.checkpoint_form(state), round_num))
      # TF's SavedModel writer leaves the saved copy of the state in reference
      # cycles, alive until the cyclic collector runs: up to several states
      # at once (HyperFL's is 60 MB). They are young: collecting the younger
      # generations frees them in milliseconds (a full collection: 0.5 s).
      gc.collect(1)
    bar.set_postfix({**shown, "loss": f"{entry['train_loss']:.4f}"})
  _write_final_models(r, state)
  return history


def _shown_metrics(primary: str, entry: dict) -> dict[str, str]:
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


def _record_canary_cosines(r: Run, round_num: int, before, after) -> None:
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


def _write_final_models(r: Run, state) -> None:
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


def _write_capture(r: Run, round_num: int, broadcast, clients, captured,
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


def _check_adaptive(config: RunConfig) -> None:
  if not config.infer_attributes:
    raise ValueError("adaptive_adversaries is a kind of infer_attributes: "
                     "give the attributes too")
  if config.defense is None:
    raise ValueError("adaptive_adversaries re-apply the clients' defence to "
                     "their shadow uploads: give a client defence (--defense)")
  cls = defenses.defense_class(config.defense)
  if config.defense == defenses.DPFedAvg.name or (
      getattr(cls, "needs_data", False) and not getattr(cls, "adaptive_from_run", False)):
    raise ValueError(f"adaptive_adversaries re-apply the run's client defence "
                     f"to their shadow uploads; defense={config.defense!r} "
                     "cannot be re-applied from its parameters alone")


def _attribute_inference(r: Run, round_num: int) -> dict[str, float]:
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
