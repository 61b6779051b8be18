"""Personalised methods: clients keep private state across rounds.

A `tff.learning.templates.LearningProcess` returns only SERVER-placed values,
so per-client state that must never leave its client (HyperFL's classifier
and embedding, a local-only model) cannot travel through one. A
`PersonalizedProcess` is the `tff.templates.IterativeProcess` such methods
build instead::

```text
initialize: ( -> S@SERVER)
next: (<S@SERVER, {D}@CLIENTS, {P}@CLIENTS>
       -> <state=S@SERVER, client_states={P}@CLIENTS, metrics=M@SERVER>)
get_model_weights: (S -> W), the server's model, which it broadcasts
```

The private states P enter and leave the computation CLIENTS-placed, in the
order of the clients' data sets, and reach neither the aggregator nor the
server: only what the method's client work hands to the aggregator is
uploaded. The runner keeps each client's P between rounds, keyed by client,
and checkpoints them with S (the TFF runtime holds no state between calls).

The metrics M follow the `LearningProcess` layout the runner reads:
`client_work/train/{loss, sparse_categorical_accuracy}` (example-weighted
over every local step of every client) and `aggregator` (the aggregation
process's measurements, where an upload-capturing aggregator reports the
uploads). Given a `ClientPlacedCapture` as its model aggregator,
`build_personalized_process` instead returns every client's upload and
weight CLIENTS-placed (`uploads`, `upload_weights`), in client order, and
aggregates with the capture's inner aggregator.

A round can also run in several calls (`run_round`, for a process built with
`clients_per_call`): TFF's runtime holds every client's upload of a call
until the call ends (for HyperFL's CNN 60 MB each, see
`hyperfl.UPLOAD_BYTES_PER_CALL`; with a `CompactUpload`, the uploads'
compact forms, except in rounds whose uploads a capture returns).
Each call but the last returns its clients' results and the float64 totals
of the default mean (`aggregation.wide_sum`); the last adds them to
its own and finishes the round as `next` does.

Also here: the local optimiser the personalised papers use (PyTorch's SGD
with momentum and coupled weight decay, `sgd_step`), and the training-metric
sums every client reports.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import tasks
from tff_privacy.aggregation import wide_sum
from tff_privacy.data import reads
from tff_privacy.models.functional import forward
from tff_privacy.updates.capture import ClientPlacedCapture

CLASSIFICATION = tasks.get("classification")


class RoundInCalls(NamedTuple):
  """A round of a `PersonalizedProcess` cut into calls of at most
  `clients_per_call` clients: `update` (`next`'s parameters -> the clients'
  part of `next`'s result and `totals@SERVER`, which add over calls), then
  for the last clients `finish` (<the earlier calls' summed totals, `next`'s
  parameters> -> `next`'s result for those clients, the round's `state`
  and `metrics`)."""
  clients_per_call: int
  update: tff.Computation
  finish: tff.Computation


class CompactUpload(NamedTuple):
  """An upload that a client's `local_training` returns in a smaller form
  from which the server, knowing the shared part S it broadcast, forms the
  upload exactly: `rows(compact, S, leaf, first, end)` (TensorFlow) forms
  rows [first, end) of the upload's `leaf`-th tensor (a scalar is its one
  row) as the client would have formed them.

  The default mean then forms each client's upload part by part inside its
  fold (`wide_sum.federated_weighted_totals`), so that TFF's runtime holds
  the round's compact forms rather than its uploads; other aggregators, and
  a capture's returned uploads, get the uploads formed whole. What the
  upload is, and what attacks read, does not change."""
  rows: Callable


class PersonalizedProcess(tff.templates.IterativeProcess):
  """An `IterativeProcess` whose clients keep private state across rounds
  (see the module docstring for the type signatures).

  `run_round` runs one round as `next` does, in several calls where the
  process was built with `in_calls`: TFF's runtime holds every client's
  upload of a call until the call ends, so a round of N clients in calls of
  k holds k uploads, not N."""

  def __init__(self, initialize_fn: tff.Computation, next_fn: tff.Computation,
               get_model_weights: tff.Computation,
               in_calls: Optional[RoundInCalls] = None,
               initial_state_fn: Optional[Callable[[], Any]] = None):
    super().__init__(initialize_fn, next_fn)
    self._in_calls = in_calls
    self._initial_state_fn = initial_state_fn
    state_type = initialize_fn.type_signature.result
    params = next_fn.type_signature.parameter
    result = next_fn.type_signature.result
    if len(params) != 3 or params[2].placement is not tff.CLIENTS:
      raise TypeError("next_fn must take (server state, client data, client "
                      f"states@CLIENTS), got {params}")
    if not result.client_states.is_equivalent_to(params[2]):
      raise TypeError("next_fn must return the client states with the type it "
                      f"takes them: {params[2]} in, {result.client_states} out")
    if not get_model_weights.type_signature.parameter.is_assignable_from(
        state_type.member):
      raise TypeError("get_model_weights must take the server state "
                      f"{state_type.member}")
    self._get_model_weights = get_model_weights

  @property
  def get_model_weights(self) -> tff.Computation:
    return self._get_model_weights

  def initial_state(self):
    """The value `initialize()` returns; assembled in Python where the
    process was built with `initial_state_fn`. `initialize`'s computation
    holds the initial shared part as a constant, of which TFF's compiler
    (in this process) and its worker keep copies once it has run: for
    HyperFL's 57 MiB hypernetwork about 0.3 GB in this process and 0.4 GB
    in the worker (measured once, after the call)."""
    if self._initial_state_fn is None:
      return self.initialize()
    return self._initial_state_fn()

  def run_round(self, state, data: Sequence, client_states: Sequence):
    """`next(state, data, client_states)`, in calls of at most
    `in_calls.clients_per_call` clients where the process has them: the
    calls' float64 totals are added in client order and the last call
    finishes the round, so the result is `next`'s wherever those float64
    sums are exact (see `aggregation.wide_sum` on grouping)."""
    calls = self._in_calls
    if calls is None or len(data) <= calls.clients_per_call:
      return self.next(state, data, client_states)
    k = calls.clients_per_call
    last = (len(data) - 1) // k * k
    totals, clients = None, collections.defaultdict(list)
    for first in range(0, last, k):
      out = calls.update(state, data[first:first + k], client_states[first:first + k])
      totals = out.pop("totals") if totals is None else tf.nest.map_structure(
          np.add, totals, out.pop("totals"))
      for name, values in out.items():
        clients[name].extend(values)
    out = calls.finish(totals, state, data[last:], client_states[last:])
    for name in clients:
      out[name] = clients[name] + list(out[name])
    return out


def sgd_step(params: Sequence[tf.Tensor], grads: Sequence[tf.Tensor],
             buffers: Sequence[tf.Tensor], learning_rate: float, momentum: float,
             weight_decay: float) -> tuple[tuple[tf.Tensor, ...], tuple[tf.Tensor, ...]]:
  """One step of PyTorch's `torch.optim.SGD` (no dampening, no Nesterov):
  g' = g + weight_decay * p; b = momentum * b + g'; p = p - lr * b. The
  buffers start at zero, so the first step's b is g' as in PyTorch.

  Returns:
    (new params, new buffers), tuples (which `tf.data.Dataset.reduce` keeps
    as structures, where it would stack a list into one tensor).
  """
  new_params, new_buffers = [], []
  for p, g, b in zip(params, grads, buffers):
    b = momentum * b + (g + weight_decay * p)
    new_params.append(p - learning_rate * b)
    new_buffers.append(b)
  return tuple(new_params), tuple(new_buffers)


def batch_loss(model: tf.keras.Model, weights: Sequence[tf.Tensor], batch,
               task: Optional[tasks.Task] = None):
  """(mean loss, `train_sums`) of `model` with `weights` on a batch, by the
  `task`'s loss and predictions (default: classification's)."""
  task = task or CLASSIFICATION
  logits = forward(model, list(weights), batch["x"])
  loss = task.loss(logits, batch["y"])
  return loss, train_sums(loss, task.predict(logits), batch["y"])


def local_sgd(model: tf.keras.Model, weights: Sequence[tf.Tensor], dataset,
              learning_rate: float, momentum: float, weight_decay: float,
              task: Optional[tasks.Task] = None):
  """`sgd_step`s on every weight over the batches of `dataset`, buffers
  fresh (TFF's SGD with momentum, the same arithmetic); returns (weights,
  summed `train_sums`)."""
  return local_steps(model, weights, dataset, tff.learning.optimizers.build_sgdm(
      learning_rate, momentum=momentum or None), weight_decay, task)


def local_steps(model: tf.keras.Model, weights: Sequence[tf.Tensor], dataset,
                optimizer: tff.learning.optimizers.Optimizer, weight_decay: float,
                task: Optional[tasks.Task] = None):
  """One step of the TFF `optimizer` per batch of `dataset`, its state
  fresh, `weight_decay` added to the gradient as an L2 term (PyTorch's
  coupled weight decay, also for Adam); returns (weights, summed
  `train_sums`)."""
  w = tuple(weights)

  def step(carry, batch):
    w, state, sums = carry
    with tf.GradientTape() as tape:
      tape.watch(w)
      loss, batch_sums = batch_loss(model, w, batch, task)
    grads = tuple(g + weight_decay * v for g, v in zip(tape.gradient(loss, w), w))
    state, w = optimizer.next(state, w, grads)
    return w, state, sums + batch_sums

  state = optimizer.initialize(tuple(tf.TensorSpec(v.shape, v.dtype) for v in w))
  w, _, sums = reads.loop_over(dataset, (w, state, tf.zeros([3])), step)
  return list(w), sums


def zeros_like(tensors: Sequence[tf.Tensor]) -> tuple[tf.Tensor, ...]:
  """Zero momentum buffers for `tensors` (a tuple, see `sgd_step`)."""
  return tuple(tf.zeros_like(t) for t in tensors)


def train_sums(loss: tf.Tensor, predicted: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
  """[loss sum, correct, examples] of one batch (mean `loss` over it,
  `predicted` classes); a sample with a label per pixel counts the share of
  its pixels right."""
  n = tf.shape(y)[0]
  hits = tf.cast(tf.equal(predicted, y), tf.float32)
  correct = tf.reduce_sum(tf.reduce_mean(tf.reshape(hits, [n, -1]), 1))
  n = tf.cast(n, tf.float32)
  # an empty batch (Poisson sampling) has a NaN mean loss and adds nothing
  return tf.stack([tf.math.multiply_no_nan(loss, n), correct, n])


SUMS_TYPE = tff.TensorType(tf.float32.as_numpy_dtype, [3])


@tff.tensorflow.computation(SUMS_TYPE)
def train_metrics(sums):
  """The `client_work` measurements from summed `train_sums`."""
  n = tf.maximum(sums[2], 1.0)
  return collections.OrderedDict(train=collections.OrderedDict(
      loss=sums[0] / n, sparse_categorical_accuracy=sums[1] / n))


def build_personalized_process(
    *,
    initial_shared: Sequence[np.ndarray],
    client_state_type: tff.types.Type,
    data_type: tff.Type,
    local_training: Callable,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    clients_per_call: Optional[int] = None,
    compact_upload: Optional[CompactUpload] = None,
) -> PersonalizedProcess:
  """The `PersonalizedProcess` of a method whose server holds one shared
  part (HyperFL's hypernetwork, PPSGD's and CENTAUR's feature extractor) and
  replaces it each round by the weighted mean of the clients' uploads.

  Round t: the server broadcasts the shared part S; each client runs
  `local_training(S, own_state, data) -> (upload, weight, new_state,
  sums)` (a TensorFlow function of the client's data of `data_type`: the
  upload has the shape of S, `sums` is the sum of its `train_sums`); the model aggregator combines the uploads with
  the weights, and its result is the next S. With no shared part
  (`initial_shared` empty: local-only training) nothing is broadcast,
  uploaded or aggregated, and `local_training` receives an empty list.

  Args:
    initial_shared: S before round 1.
    client_state_type: the TFF type of one client's private state.
    data_type: the TFF type of one client's data: a data set, or a data
      set beside its inputs (`client_data.data_type`).
    local_training: one client's round, see above.
    model_aggregator: aggregates the uploads, weighted (default
      `aggregation.wide_sum.wide_mean_factory`); a `ClientPlacedCapture`:
      its inner aggregator does, and `next` also returns the uploads and
      their weights CLIENTS-placed.
    clients_per_call: if set, `run_round` runs a round's clients in calls
      of at most this many (`PersonalizedProcess`), bounding the uploads
      TFF's runtime holds at once. Only the default mean adds over calls:
      with another model aggregator the round runs in one call.
    compact_upload: if set, `local_training` returns its upload's compact
      form (see `CompactUpload`).

  Returns:
    A `PersonalizedProcess` whose server state is
    `OrderedDict(shared=S, aggregator=...)` (`OrderedDict()` when nothing is
    shared), whose `get_model_weights` returns S and whose `initial_state()`
    assembles `initialize()`'s value from `initial_shared` in Python.
  """
  shared_type = [tff.TensorType(np.float32, np.shape(w)) for w in initial_shared]
  if not shared_type:
    return _unshared_process(client_state_type, data_type, local_training)
  if clients_per_call is not None and clients_per_call < 1:
    raise ValueError(f"clients_per_call={clients_per_call}; give a positive "
                     "number of clients, or None for one call per round")
  to_driver = isinstance(model_aggregator, ClientPlacedCapture)
  if to_driver:
    model_aggregator = model_aggregator.inner
  factory = model_aggregator or wide_sum.wide_mean_factory()
  aggregator = factory.create(tff.to_type(shared_type), tff.TensorType(np.float32))

  @tff.tensorflow.computation(shared_type, client_state_type, data_type)
  def client_update(shared, state, data):
    upload, weight, new_state, sums = local_training(list(shared), state, data)
    return (upload if compact_upload else list(upload)), weight, new_state, sums

  uploads_of = _Uploads(compact_upload, shared_type,
                        *client_update.type_signature.result[:2])

  @tff.tensorflow.computation
  def initial_shared_fn():
    return [tf.constant(w, tf.float32) for w in initial_shared]

  @tff.federated_computation
  def initialize():
    return tff.federated_zip(collections.OrderedDict(
        shared=tff.federated_eval(initial_shared_fn, tff.SERVER),
        aggregator=aggregator.initialize()))

  state_type = initialize.type_signature.result

  @tff.federated_computation(state_type, tff.FederatedType(data_type, tff.CLIENTS),
                             tff.FederatedType(client_state_type, tff.CLIENTS))
  def next_fn(state, data, client_states):
    shared = tff.federated_broadcast(state.shared)
    uploads, weights, new_states, sums = tff.federated_map(
        client_update, (shared, client_states, data))
    folded = compact_upload and isinstance(factory, wide_sum.WideMeanFactory)
    whole = None if folded and not to_driver else uploads_of.whole(uploads, shared)
    if folded:
      aggregated = tff.templates.MeasuredProcessOutput(
          state=state.aggregator,
          result=tff.federated_map(uploads_of.mean, uploads_of.totals(
              uploads, shared, weights)),
          measurements=tff.federated_value(wide_sum.MEAN_MEASUREMENTS, tff.SERVER))
    else:
      aggregated = aggregator.next(state.aggregator, whole, weights)
    new_state = tff.federated_zip(collections.OrderedDict(
        shared=aggregated.result, aggregator=aggregated.state))
    metrics = tff.federated_zip(collections.OrderedDict(
        client_work=tff.federated_map(train_metrics,
                                      wide_sum.federated_wide_sum(sums)),
        aggregator=aggregated.measurements))
    result = collections.OrderedDict(state=new_state, client_states=new_states,
                                     metrics=metrics)
    if to_driver:
      result.update(uploads=whole, upload_weights=weights)
    return result

  @tff.tensorflow.computation(state_type.member)
  def get_model_weights(state):
    return state["shared"]

  def initial_state():
    return collections.OrderedDict(
        shared=[np.asarray(w, np.float32) for w in initial_shared],
        aggregator=aggregator.initialize())

  in_calls = None
  if clients_per_call is not None and isinstance(factory, wide_sum.WideMeanFactory):
    in_calls = _round_in_calls(clients_per_call, state_type, data_type,
                               client_state_type, client_update, to_driver,
                               uploads_of)
  return PersonalizedProcess(initialize, next_fn, get_model_weights, in_calls,
                             initial_state)


class _Uploads:
  """The uploads of `build_personalized_process`'s clients, whole or in a
  `CompactUpload`'s form: their default mean's float64 `totals` and its
  `mean`, and the uploads formed `whole`."""

  def __init__(self, compact: Optional[CompactUpload], shared_type, upload_type,
               weight_type):
    self._compact = compact
    self.mean = wide_sum.mean_of_totals(
        tff.to_type(shared_type) if compact else upload_type, weight_type)
    if compact:
      sizes = [s.shape[0] if s.shape else 1 for s in shared_type]

      @tff.tensorflow.computation(upload_type, shared_type)
      def form(upload, shared):
        return [compact.rows(upload, list(shared), i, 0, n)
                for i, n in enumerate(sizes)]
      self._form = form
      self._expansion = wide_sum.Expansion(
          tff.to_type(shared_type),
          lambda pair, leaf, first, end: compact.rows(
              pair[0], list(pair[1]), leaf, first, end))

  def totals(self, uploads, shared, weights):
    """`wide_sum.federated_weighted_totals` of the uploads."""
    if not self._compact:
      return wide_sum.federated_weighted_totals(uploads, weights)
    return wide_sum.federated_weighted_totals(
        tff.federated_zip((uploads, shared)), weights, self._expansion)

  def whole(self, uploads, shared):
    """The CLIENTS-placed uploads, formed whole."""
    if not self._compact:
      return uploads
    return tff.federated_map(self._form, (uploads, shared))


def _round_in_calls(clients_per_call, state_type, data_type, client_state_type,
                    client_update, to_driver, uploads_of) -> RoundInCalls:
  """`next_fn` of `build_personalized_process` with the default mean, cut
  into `RoundInCalls`: the uploads' and training sums' float64 totals are
  what add over calls."""

  def clients_part(state, data, client_states):
    """The federated values of one call's clients: (totals, the
    CLIENTS-placed results)."""
    shared = tff.federated_broadcast(state.shared)
    uploads, weights, new_states, sums = tff.federated_map(
        client_update, (shared, client_states, data))
    totals = tff.federated_zip(collections.OrderedDict(
        uploads=uploads_of.totals(uploads, shared, weights),
        sums=wide_sum.federated_wide_total(sums)))
    clients = collections.OrderedDict(client_states=new_states)
    if to_driver:
      clients.update(uploads=uploads_of.whole(uploads, shared),
                     upload_weights=weights)
    return totals, clients

  clients_types = (state_type, tff.FederatedType(data_type, tff.CLIENTS),
                   tff.FederatedType(client_state_type, tff.CLIENTS))

  @tff.federated_computation(*clients_types)
  def update(state, data, client_states):
    totals, clients = clients_part(state, data, client_states)
    return collections.OrderedDict(totals=totals, **clients)

  totals_type = update.type_signature.result.totals
  narrow_sums = wide_sum.narrow_total(SUMS_TYPE)

  @tff.tensorflow.computation(totals_type.member, totals_type.member)
  def add(earlier, later):
    return tf.nest.map_structure(tf.add, earlier, later)

  @tff.federated_computation(totals_type, *clients_types)
  def finish(earlier, state, data, client_states):
    totals, clients = clients_part(state, data, client_states)
    totals = tff.federated_map(add, (earlier, totals))
    new_state = tff.federated_zip(collections.OrderedDict(
        shared=tff.federated_map(uploads_of.mean, totals.uploads),
        aggregator=state.aggregator))
    metrics = tff.federated_zip(collections.OrderedDict(
        client_work=tff.federated_map(train_metrics, tff.federated_map(
            narrow_sums, totals.sums)),
        aggregator=tff.federated_value(wide_sum.MEAN_MEASUREMENTS, tff.SERVER)))
    return collections.OrderedDict(state=new_state, metrics=metrics, **clients)

  return RoundInCalls(clients_per_call, update, finish)


def _unshared_process(client_state_type, data_type, local_training):
  """`build_personalized_process` with nothing shared (see there)."""

  @tff.tensorflow.computation(client_state_type, data_type)
  def client_update(state, data):
    _, _, new_state, sums = local_training([], state, data)
    return new_state, sums

  @tff.federated_computation
  def initialize():
    return tff.federated_value(collections.OrderedDict(), tff.SERVER)

  state_type = initialize.type_signature.result

  @tff.federated_computation(state_type, tff.FederatedType(data_type, tff.CLIENTS),
                             tff.FederatedType(client_state_type, tff.CLIENTS))
  def next_fn(state, data, client_states):
    new_states, sums = tff.federated_map(client_update, (client_states, data))
    metrics = tff.federated_zip(collections.OrderedDict(
        client_work=tff.federated_map(train_metrics,
                                      wide_sum.federated_wide_sum(sums))))
    return collections.OrderedDict(state=state, client_states=new_states,
                                   metrics=metrics)

  @tff.tensorflow.computation(state_type.member)
  def get_model_weights(state):
    del state  # nothing is shared
    return []

  return PersonalizedProcess(initialize, next_fn, get_model_weights)
