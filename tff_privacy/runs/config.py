"""What a run is: its configuration (`RunConfig`), the parameters it
declares for the command line, and the checks made before anything is
written (`check_config`, `check_workers`)."""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any, Optional


from tff_privacy import (algorithms, data, defenses, io, models, params, pretrained,
                         provenance, tasks)
from tff_privacy.attacks import attribute as attribute_inference
from tff_privacy.models.lpm import LPM_MODELS
from tff_privacy.runs.checkpoints import differences, rounds_done


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


def run_default(name: str):
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
  protocol = DATASET_PROTOCOLS.get(fields.get("dataset", run_default("dataset")))
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
      fields.get("method", run_default("method"))).parameters.names
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
  method: str = run_default("method")
  dataset: str = run_default("dataset")
  model: Optional[str] = None  # None: `default_model(dataset)`
  model_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  clients: Optional[int] = None  # None: the split file's, else the default
  clients_per_round: Optional[int] = None  # None: every client, every round
  rounds: int = run_default("rounds")
  batch_size: int = run_default("batch_size")
  # the method's declared parameters (e.g. FedAvg's local_epochs, FedEM's
  # rho_max); the method's paper defaults for the rest. See
  # `tff_privacy.algorithms.METHODS[method].parameters`.
  method_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  partition: str = run_default("partition")
  alpha: float = run_default("alpha")
  samples_per_client: Optional[int] = None
  seed: int = run_default("seed")
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
  dp_delta: float = run_default("dp_delta")
  positive_weight: float = run_default("positive_weight")
  attribute_shadow_samples: int = run_default("attribute_shadow_samples")
  attribute_shadow_pool: str = run_default("attribute_shadow_pool")
  adaptive_adversaries: bool = run_default("adaptive_adversaries")
  evaluate_every: int = run_default("evaluate_every")
  # SHA-256 of the split file or of the ClientData the clients come from
  # (partitions 'file:...' and 'client_data'); a split file's is read from it
  split_sha256: Optional[str] = None
  evaluate: str = run_default("evaluate")
  checkpoint_every: int = run_default("checkpoint_every")

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
        object.__setattr__(self, "clients", run_default("clients"))
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
      if d[name] == run_default(name):
        d.pop(name)
    if not self.infer_attributes:  # no effect; runs from before it resume
      d.pop("attribute_shadow_pool")
    if self.split_sha256 is None:  # as runs from before the field existed
      d.pop("split_sha256")
    return io.canonical(d)


# Local DP is accounted per client over every round, sampled or not.
LOCAL_SAMPLING = ("none assumed: every round counts for every client (an upper "
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
  done = rounds_done(config.out)
  sized = algorithms.method(config.method).needs_federation
  resumes = new["rounds"] > done and not sized
  changed = differences({**old, "rounds": None} if resumes else old,
                         {**new, "rounds": None} if resumes else new)
  if changed:
    why = (f" (method {config.method!r} sizes itself by them: its noise spends "
           "its budget over the run)" if sized else
           f" ({done} done: a run resumes to more rounds only)")
    raise ValueError(
        f"{config.out} holds a run with another config (differs in "
        + "; ".join(d + (why if d.startswith("rounds:") else "") for d in changed)
        + "); choose another --out or delete it")


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
