"""`Algorithm`: what the runner needs to know to drive a federated method, and
`Method`: how a method is declared and built by name.

A method module exposes a TFF-style `build_*` function returning a
`tff.learning.templates.LearningProcess`, its declared parameters
(`tff_privacy.params`) and an `algorithm` factory returning an `Algorithm`
that says how the runner feeds it and what its clients upload. New defences
plug in here without touching the runner:

* per-client configuration (a noise seed, a region box, attributes) comes
  from `client_inputs(client_index, round_num)`; the runner passes the
  returned arrays beside that client's batches, as a data set of one element
  (`tff_privacy.algorithms.client_data`: TFF's learning templates take a
  client's data as a structure of sequences only), where the method's
  client work reads them;
* what leaves a client is declared by `upload_kind`, recorded in the update
  store, so attacks know whether they face a gradient or a model delta;
* server-side resources (a public data set for the aggregator) are arguments of
  the method's builder, closed over by its aggregator;
* private per-client state kept across rounds (HyperFL's classifier and
  embedding) cannot travel through a `LearningProcess`, whose outputs are all
  SERVER-placed: such a method declares its `PrivateState` and builds a
  `tff_privacy.algorithms.personalized.PersonalizedProcess`, which takes and
  returns the state CLIENTS-placed; the runner keeps it per client id and
  checkpoints it with the server state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import dp_accounting
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import params
from tff_privacy.disclosure import Disclosure
from tff_privacy.listing import Listing
from tff_privacy.algorithms.client_data import SEED_KEY, client_seed

UPLOAD_KINDS = ("gradient", "model_delta", "hypernetwork_weights",
                "body_weights", "body_delta", "none")
LOCAL_DATA = ("one_batch", "epochs")

ProcessBuilder = Callable[[Optional[tff.aggregators.WeightedAggregationFactory]],
                          tff.templates.IterativeProcess]
ClientInputs = Callable[[int, int], dict[str, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Federation:
  """Facts of a run that a method may size itself by (a DP method calibrates
  its noise to spend its budget over the whole run).

  Attributes:
    rounds: the number of rounds.
    client_sizes: each client's number of training examples.
    public_data: (x, y) samples that no client trains on (the run's test
      split), for server-side resources such as PDA-PAM's public set.
    dp_delta: the delta at which the run reports epsilon (a method that
      splits a budget, FedRE, takes it as its total delta).
    data: the run's `tff_privacy.data.FederatedData`, for facts of the
      clients' samples a method configures itself by (FedRE's regions from
      element maps, its public sets by data category).
  """

  rounds: int
  client_sizes: tuple[int, ...]
  public_data: Optional[tuple[np.ndarray, np.ndarray]] = None
  dp_delta: float = 1e-5
  data: Any = None


@dataclasses.dataclass(frozen=True)
class PrivateState:
  """The private per-client state of a personalised method.

  Attributes:
    initial: maps a client index to its state before its first round (a list
      of arrays, a function of the run's seed and the client alone).
    personal_weights: maps (the server's model weights, one client's state)
      to that client's own model, as trainable weights in the `ModelSpec`'s
      order: what personalised evaluation tests on the client's test split.
    sent: for methods whose server sends each client a model of its own
      (pFedHN), maps (the server's weights, the client's state before the
      round) to what the client received, in the model's order (recorded
      with captured uploads); None when every client gets the broadcast.
  """

  initial: Callable[[int], list[np.ndarray]]
  personal_weights: Callable[[list[np.ndarray], list[np.ndarray]],
                             list[np.ndarray]]
  sent: Optional[Callable[[list[np.ndarray], Any], list[np.ndarray]]] = None


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """A federated method as the runner sees it.

  Attributes:
    name: the method's name (`--method`).
    upload_kind: one of `UPLOAD_KINDS`: what a client sends to the server
      ('body_weights': its new weights of every tensor but the classifier;
      'body_delta': their change, what it was sent minus what it reached;
      'none': nothing, the clients train alone).
    local_data: 'one_batch' (each client computes on one batch per round, as
      in FedSGD) or 'epochs' (each client passes over all its samples
      `local_epochs` times); `tff_privacy.protocol.local_batch_sizes` cuts
      the batches.
    build_process: maps an optional model aggregator (the runner passes an
      upload-capturing wrapper on capture rounds) to the method's process: a
      `LearningProcess`, or a `PersonalizedProcess` when `private_state` is
      set.
    protocol: public facts of the protocol (learning rates, local epochs...)
      written into every captured record's metadata.
    local_epochs: passes over the client's data per round ('epochs' only).
    client_inputs: optional per-client, per-round inputs for the client work.
    defense: the client-side defence's name and parameters, if any (public:
      written into the records' metadata).
    dp_event: maps the model's number of parameters to the DP event of one
      client's upload in one round, for methods whose clients run a DP
      mechanism; the runner composes it over rounds. A tuple holds one
      event per group of clients that spend alike, and the runner reports
      the largest epsilon.
    dp_relation: the neighbouring relation of `dp_event`, in words, for
      methods that run their own DP mechanism (default: the defence's).
    pure_epsilon: the same for pure-DP mechanisms that `dp_accounting` does
      not model: maps the number of parameters to one round's epsilon.
    audited_mechanism: the method's own DP mechanism as the per-upload
      audit (`tff_privacy.audit.uploads`) runs it, an `UpdateDefense` whose
      `for_client` fixes what it reads of a client's data: FedRE's noise on
      the update, or a round of DP-SGD steps fed a white-box gradient
      canary (`local_dp_sgd.StepsCanary`); None where the method claims
      nothing.
    private_state: for personalised methods, the per-client state the
      clients keep (see `PrivateState`); None for methods with one global
      model, which personalised evaluation tests on every client.
    aggregates_uploads: whether the server's next model is the model
      aggregator's result (False for pFedHN, whose server turns each upload
      into a hypernetwork step; server-side defences cannot apply).
    stated_privacy: maps the rounds done and the metrics history of those
      rounds (metrics.json's entries, the last one the current round's so
      far) to what the method states of its privacy after them, written
      into metrics beside the accountant's epsilon (e.g. FedRE's paper
      epsilon, eq. 9 composed over the per-tensor epsilons its clients
      recorded).
    concurrent_clients: at most this many clients' calls of one computation
      run at once on a worker (-1: no limit), for methods whose clients, or
      whose server per upload, need much memory each; the runner applies it
      (`tff_privacy.runtime.limit_concurrent_calls`).
    local_model: maps (the broadcast model, one client's upload (None for
      upload kind 'none'), its private state after the round (None without
      `private_state`)) to the model the client reached by its local
      training that round, before aggregation, as trainable weights in the
      model's order (the runner's 'local-after-training' evaluation); None
      where the upload does not determine it (a defence perturbed it).
  """

  name: str
  upload_kind: str
  local_data: str
  build_process: ProcessBuilder
  protocol: dict[str, Any]
  local_epochs: int = 1
  client_inputs: Optional[ClientInputs] = None
  defense: Optional[dict[str, Any]] = None
  dp_event: Optional[Callable[[int], "dp_accounting.DpEvent | tuple | None"]] = None
  dp_relation: Optional[str] = None
  pure_epsilon: Optional[Callable[[int], Optional[float]]] = None
  audited_mechanism: Optional[Any] = None
  private_state: Optional[PrivateState] = None
  aggregates_uploads: bool = True
  stated_privacy: Optional[Callable[[int, Sequence[dict]], dict[str, Any]]] = None
  concurrent_clients: int = -1
  local_model: Optional[Callable[[list[np.ndarray], Any, Any],
                                 list[np.ndarray]]] = None

  def __post_init__(self):
    if self.upload_kind not in UPLOAD_KINDS:
      raise ValueError(
          f"upload_kind={self.upload_kind!r}; choose one of {UPLOAD_KINDS}")
    if self.local_data not in LOCAL_DATA:
      raise ValueError(f"local_data={self.local_data!r}; choose one of {LOCAL_DATA}")


@dataclasses.dataclass(frozen=True)
class Method:
  """A method by name: its declared parameters and its `Algorithm` factory.

  `factory(spec, *, batch_size, seed, defense, **parameters)` receives the
  `tff_privacy.models.ModelSpec` the clients train and every declared
  parameter, resolved (checked, defaults filled in); with
  `needs_federation`, also `federation=` the run's `Federation` (None when
  the method is built outside a run). A method whose uploads carry its own
  defense (FedRE, FedEM, HyperFL) declares what that defense discloses to
  an attacker who knows it (`disclosure`, `tff_privacy.disclosure`); it is
  then judged like a defense, by the attacks that read those declarations.
  A method registers itself with `tff_privacy.registry.METHODS.register`.
  """

  name: str
  parameters: params.Params
  factory: Callable[..., Algorithm]
  summary: str
  needs_federation: bool = False
  disclosure: Optional[Disclosure] = None
  # its entry on the built-in leaderboards (`tff_privacy.listing`); None:
  # not on them
  listing: Optional[Listing] = None

  def resolve(self, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every parameter's value from the given `kwargs` (checked)."""
    return self.parameters.resolve(f"method {self.name!r}", kwargs)

  def build(self, spec, *, batch_size: int, seed: int, defense=None,
            federation: Optional[Federation] = None, **kwargs) -> Algorithm:
    extra = {"federation": federation} if self.needs_federation else {}
    return self.factory(spec, batch_size=batch_size, seed=seed,
                        defense=defense, **extra, **self.resolve(kwargs))


def server_learning_rate(default: float) -> params.Param:
  """The server optimizer's step, a parameter of every method."""
  return params.Param("server_learning_rate", float, default,
                      "learning rate of the server's SGD step", minimum=0,
                      exclusive_minimum=True, flag="server-lr")


CLIENT_OPTIMIZERS = ("sgd", "adam")
CLIENT_OPTIMIZER = params.Param(
    "client_optimizer", str, "sgd", "the clients' local optimizer, its state "
    "fresh each round: sgd, or TFF's adam (beta 0.9, 0.999, epsilon 1e-7)",
    choices=CLIENT_OPTIMIZERS)


def build_client_optimizer(name: str, learning_rate: float, momentum: float = 0.0,
                           weight_decay: float = 0.0) -> tff.learning.optimizers.Optimizer:
  """TFF's SGD (with `momentum` if > 0) or Adam for the clients' steps;
  SGD with `weight_decay` > 0 is PyTorch's SGD with coupled weight decay
  (`CoupledWeightDecay`)."""
  if name == "adam":
    for given, value in (("client_momentum", momentum),
                         ("weight_decay", weight_decay)):
      if value:
        raise ValueError(f"{given} applies to client_optimizer='sgd'; adam "
                         "keeps its own moments")
    return tff.learning.optimizers.build_adam(learning_rate)
  if name != "sgd":
    raise ValueError(f"client_optimizer={name!r}; choose one of {CLIENT_OPTIMIZERS}")
  sgd = tff.learning.optimizers.build_sgdm(learning_rate, momentum=momentum or None)
  return CoupledWeightDecay(sgd, weight_decay) if weight_decay else sgd


class CoupledWeightDecay(tff.learning.optimizers.Optimizer):
  """`inner` stepping on the gradient plus `weight_decay` times the weights
  (PyTorch's coupled weight decay: g' = g + weight_decay * w)."""

  def __init__(self, inner: tff.learning.optimizers.Optimizer, weight_decay: float):
    self._inner = inner
    self._weight_decay = weight_decay

  def initialize(self, specs):
    return self._inner.initialize(specs)

  def next(self, state, weights, gradients):
    decayed = tf.nest.map_structure(
        lambda g, w: g + self._weight_decay * w, gradients, weights)
    return self._inner.next(state, weights, decayed)

  def get_hparams(self, state):
    return self._inner.get_hparams(state)

  def set_hparams(self, state, hparams):
    return self._inner.set_hparams(state, hparams)


def broadcast_minus_upload(broadcast, upload, state=None) -> list[np.ndarray]:
  """The model a client reached, w_k = w_t - d_k, from its model delta d_k
  (an `Algorithm.local_model` for methods with one global model)."""
  del state  # one global model: no private state
  return [np.asarray(w) - np.asarray(d) for w, d in zip(broadcast, upload)]


def model_from_upload(private: PrivateState):
  """The `Algorithm.local_model` of a personalised method whose upload is
  the shared part a client trained (HyperFL's hypernetwork, a body): the
  client's own model built from its upload and its private state."""
  return lambda broadcast, upload, state: private.personal_weights(upload, state)


def refuse_defense(method: str, defense) -> None:
  """Raises `ValueError` if a client-side `defense` is given to a method that
  is its own defence."""
  if defense is not None:
    raise ValueError(f"method {method!r} takes no client-side defense, got "
                     f"{defense.name!r}")


def check_positive(**values: float) -> None:
  """Raises `ValueError` naming the first argument that is not > 0."""
  for name, value in values.items():
    if not value > 0:
      raise ValueError(f"{name} must be > 0, got {value}")


def defense_fields(defense, seed: int) -> dict[str, Any]:
  """The `Algorithm` fields for a client-side `UpdateDefense` (or none):
  its metadata, its DP event and the per-client noise seeds."""
  if defense is None:
    return {}
  return {"defense": {"name": defense.name, **defense.params()},
          "dp_event": defense.dp_event,
          "pure_epsilon": defense.pure_epsilon,
          "client_inputs": lambda client, round_num: {
              SEED_KEY: client_seed(seed, round_num, client),
              **defense.client_inputs(client, round_num)}}
