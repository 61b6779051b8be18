"""The training loop: rounds, evaluation, metric release, checkpoints, capture.

A run's pieces live in `tff_privacy.runs`, one question each: what a run
is and its checks (`config`), each client's samples (`clients`), the test
set's evaluation (`evaluation`), resuming (`checkpoints`), and what a
round reports and a run leaves (`outputs`); this module is the round loop
that puts them together.

`run(config)` trains one federated method and writes, under `config.out`:

* `config.json`: the run's configuration, written once every argument has been
  checked (a re-run with another config into the same folder is refused),
  with HyperFL-LPM's backbone pinned by its fingerprint (model_kwargs
  `backbone_fingerprint`: a resume refuses a replaced backbone file) and
  the clients' split pinned by its SHA-256 (`split_sha256`, for a split
  file's or ClientData's clients: a resume refuses a changed split), and
  the code versions that trained it (`provenance.KEY`: git commit, dirty
  tree and diff hash, one more for each resume by other code);
* `metrics.json`: one entry per finished round, rewritten atomically each
  round (its fields: `tff_privacy.runs.outputs`);
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
import functools
import gc
import os
import time
from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
import tqdm

from tff_privacy import algorithms, data, defenses, io, models, runtime
from tff_privacy.aggregation import wide_sum
from tff_privacy.algorithms import client_data
from tff_privacy.attacks import attribute as attribute_inference
from tff_privacy.dp import accounting
from tff_privacy.runs.checkpoints import (checkpoint_manager, load_latest,
                                          pinned_as_saved, recorded_config)
from tff_privacy.runs.clients import (ClientFiles, client_dataset,
                                      file_client_dataset, local_batches,
                                      local_order, sample_clients, spec_of)
from tff_privacy.runs.config import (DATASET_PROTOCOLS, LOCAL_AFTER_TRAINING,
                                     LOCAL_SAMPLING, RUN_PARAMETERS,
                                     DatasetProtocol, RunConfig, check_config,
                                     check_workers, default_model, run_default,
                                     with_protocol)
from tff_privacy.runs.evaluation import Evaluator
from tff_privacy.runs.outputs import (CANARY_COSINES, MODEL_WEIGHTS,
                                      PERSONAL_MODELS, spread,
                                      clean_uploads_unavailable,
                                      client_defense_measurements,
                                      load_model_weights, record_canary_cosines,
                                      round_attribute_rates,
                                      server_step_measurements, shown_metrics,
                                      train_measurements, update_fidelity,
                                      write_capture, write_final_models)
from tff_privacy.updates import ClientPlacedCapture

# the run's public names, those of the modules it is made of included
# (`tff_privacy.runs`), so that `runner.RunConfig` and `runner.run` serve
__all__ = [
    "CANARY_COSINES", "ClientFiles", "DATASET_PROTOCOLS", "DatasetProtocol",
    "Evaluator", "LOCAL_AFTER_TRAINING", "MODEL_WEIGHTS", "PERSONAL_MODELS",
    "RUN_PARAMETERS", "RoundClient", "Run", "RunConfig", "check_config",
    "check_workers", "checkpoint_manager", "clean_uploads_unavailable",
    "client_dataset", "client_defense_measurements", "default_model",
    "file_client_dataset",
    "load_model_weights", "local_batches", "local_order", "run",
    "sample_clients", "server_step_measurements", "stacked_capture",
    "train_measurements", "update_fidelity", "with_client_data",
    "with_protocol"]


def stacked_capture(uploads, weights) -> collections.OrderedDict:
  """The `captured` measurements a `CaptureFactory` reports, from uploads and
  weights returned CLIENTS-placed (one list of tensors and one weight per
  client, in client order)."""
  return collections.OrderedDict(
      num_uploads=np.int32(len(uploads)),
      uploads=[np.stack([np.asarray(u[k]) for u in uploads])
               for k in range(len(uploads[0]))],
      upload_weights=np.asarray(weights, np.float32))


@dataclasses.dataclass(frozen=True, eq=False)
class RoundClient:
  """A client sampled for a round: its index; `samples`, its distinct
  samples' indices into the run's training arrays (`source`), in their
  first-epoch order; the dataset it trains on (those samples in training
  order, every local epoch); the sensitive attributes of its distinct
  samples, by name (empty if the data set has none); the method's inputs
  for it this round (`Algorithm.client_inputs`; None without). `x` and `y`
  (the ground truth) gather the samples when asked, so a round holds none
  of them beforehand."""

  index: int
  samples: np.ndarray
  dataset: Any
  attributes: dict[str, np.ndarray]
  source: data.Source = dataclasses.field(repr=False)
  inputs: Optional[dict[str, np.ndarray]] = None

  @property
  def process_data(self):
    """What the method's process takes as this client's data: `dataset`,
    with `inputs` beside it where there are any
    (`tff_privacy.algorithms.client_data`)."""
    if not self.inputs:
      return self.dataset
    return client_data.with_inputs(self.dataset, self.inputs)

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
    # what the method may size itself by (FedRE: its public sets)
    self.federation = algorithms.Federation(
        config.rounds, tuple(len(i) for i in self.fed.client_indices),
        self.fed.test, config.dp_delta, self.fed)
    self.algorithm = algorithms.get(
        config.method, self.spec, batch_size=config.batch_size,
        seed=config.seed, defense=None if self.central else defense,
        federation=self.federation, **config.method_kwargs)
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
          server=process.initial_state(),
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
    datasets = [c.process_data for c in clients]
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
    entry.update(spread("personal", primary, per_client))
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
            **spread("local_after_training", evaluator.task.primary_metric,
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
      inputs = (self.algorithm.client_inputs(int(client), round_num)
                if self.algorithm.client_inputs else None)
      distinct = idx[order[: min(len(idx), len(order))]]
      sizes = local_batches(len(distinct), self.algorithm, self.config)
      if runtime.runs_on_this_machine() and len(order) >= len(idx):
        dataset = file_client_dataset(self._client_files.folder(int(client)),
                                      (spec_of(x), spec_of(y)), order, sizes)
      else:  # workers elsewhere; or a round on part of the client's samples
        dataset = client_dataset(x[idx[order]], y[idx[order]], sizes)
      out.append(RoundClient(
          int(client), distinct, dataset,
          {a: v[distinct] for a, v in attributes.train.items()} if attributes else {},
          self.fed.source, inputs))
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
        LOCAL_SAMPLING)

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
              "dp_sampling": LOCAL_SAMPLING + "; basic composition"}
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
  if config.partition not in (run_default("partition"), data.CLIENT_DATA):
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
  config = pinned_as_saved(config)
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
  io.write_json(os.path.join(config.out, "config.json"), recorded_config(r.config))
  manager = checkpoint_manager(config.out)
  runtime.limit_concurrent_calls(r.algorithm.concurrent_clients)
  initial = r.initial_state()
  saved, done = load_latest(manager, r.checkpoint_form(initial), config)
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
      record_canary_cosines(r, round_num, broadcast, r.server_weights(state))
    entry = {"round": round_num}
    if evaluated:
      entry.update(r.evaluate(evaluator, state))
      if config.evaluate == LOCAL_AFTER_TRAINING:
        entry.update(r.evaluate_local(evaluator, broadcast, clients, metrics, state))
      shown = shown_metrics(r.spec.task_object.primary_metric, entry)
    entry.update(train_measurements(metrics["client_work"]["train"]))
    entry.update(client_defense_measurements(metrics, [c.index for c in clients]))
    entry.update(r.privacy_spent(round_num, history + [entry]))
    entry.update(server_step_measurements(metrics))
    if capture:
      captured = metrics["aggregator"]["captured"]
      write_capture(r, round_num, None if sent else broadcast, clients,
                     captured, sent)
      entry.update(update_fidelity(r, broadcast, clients, captured))
      entry.update(round_attribute_rates(r, round_num))
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
  write_final_models(r, state)
  return history

