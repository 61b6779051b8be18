"""pFedHN and pFedHN-PC (Shamsian et al., "Personalized Federated Learning
using Hypernetworks", 2021): a hypernetwork on the server generates each
client's model from the client's embedding, which the server holds too.

Round t, for each client i of the round:

1. the server generates theta_i = h(e_i; varphi) and sends it to client i;
2. client i runs `local_epochs` epochs of SGD (`learning_rate`, `momentum`,
   coupled `weight_decay`, PyTorch's, fresh each round) on theta_i, reaching
   theta_i', and uploads d_i = theta_i - theta_i' (upload kind
   'model_delta');
3. the server turns each upload into a step direction for varphi and e_i,
   the vector-Jacobian product (d theta_i / d(varphi, e_i))^T d_i, and
   takes one SGD step (`server_learning_rate`, `server_momentum`, coupled
   `server_weight_decay`; its momentum kept across rounds) on the sum of
   the round's directions (`server_aggregation`, see below).

pFedHN-PC (`personal_classifier=True`): the hypernetwork generates the
feature extractor only; each client keeps a private classifier, trained
with the extractor in step 2, and uploads the extractor's delta (upload
kind 'body_delta').

In TFF: the server state holds varphi, the embeddings and the momentum;
each client's private state holds its index (and its classifier). A value
per client can only be CLIENTS-placed, so the server's per-client work runs
inside the clients' mapped computation: generating theta_i from the
broadcast (varphi, embeddings) and row i, and the vector-Jacobian product
of step 3, which reads only d_i and what the server holds. What leaves the
client is d_i alone: it is what the model aggregator receives (and what an
upload-capturing aggregator records, beside the theta_i it was sent); the
mean of the products is the server's. The aggregator's own result is not
used, so server-side defences that transform the aggregate do not apply.

Choices where the papers leave room (documented defaults): the
hypernetwork has HyperFL's shape (one hidden ReLU layer, then a linear head
per generated tensor; pFedHN's code adds a second linear trunk layer), so
the two methods differ only in where the hypernetwork lives; embedding
dimension 1 + clients / 4, hidden width 100, inner SGD lr 5e-3, momentum
0.9, weight decay 5e-5, server SGD lr 1e-2, momentum 0.9, weight decay 1e-3
(pFedHN's code). pFedHN's code trains one client per server step; with the
round's clients in parallel, `server_aggregation='sum'` (default) sums their
directions, so that each upload moves the hypernetwork, and its client's
embedding, as far as one of those single-client steps (to first order);
'mean' divides the step by the round's clients, which leaves each embedding,
updated by its own client alone, that many times slower.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import params
from tff_privacy.aggregation.wide_sum import (federated_wide_mean,
                                              federated_wide_sum,
                                              wide_mean_factory)
from tff_privacy.algorithms import local_dp_sgd, personalized
from tff_privacy.algorithms.base import (Algorithm, Method, PrivateState,
                                         check_positive, refuse_defense)
from tff_privacy.models.hypernetwork import Hypernetwork, num_extractor_tensors
from tff_privacy.listing import Listing
from tff_privacy.registry import METHODS

PARAMETERS = params.Params(
    params.Param("embedding_dim", int, None, "size of each client's embedding "
                 "(default 1 + clients / 4)", minimum=1),
    params.Param("hidden_dim", int, 100, "width of the hypernetwork's hidden "
                 "layer", minimum=1),
    params.Param("learning_rate", float, 5e-3, local_dp_sgd.LEARNING_RATE.help,
                 minimum=0, exclusive_minimum=True, flag="lr"),
    local_dp_sgd.LOCAL_EPOCHS,
    params.Param("momentum", float, 0.9, "SGD momentum", minimum=0, maximum=1,
                 exclusive_maximum=True),
    params.Param("weight_decay", float, 5e-5, "SGD weight decay (coupled)",
                 minimum=0),
    params.Param("server_learning_rate", float, 1e-2, "learning rate of the "
                 "server's SGD step", minimum=0, exclusive_minimum=True,
                 flag="server-lr"),
    params.Param("server_momentum", float, 0.9, "momentum of the server's SGD "
                 "on the hypernetwork and embeddings", minimum=0, maximum=1,
                 exclusive_maximum=True),
    params.Param("server_weight_decay", float, 1e-3, "weight decay of the "
                 "server's SGD", minimum=0),
    params.Param("server_aggregation", str, "sum", "how the server combines "
                 "the round's step directions", choices=("sum", "mean")))


def hypernetwork_for(model: tf.keras.Model, personal_classifier: bool,
                     embedding_dim: int, hidden_dim: int) -> Hypernetwork:
  """The hypernetwork generating the whole model (pFedHN) or its feature
  extractor (pFedHN-PC)."""
  count = (num_extractor_tensors(model) if personal_classifier
           else len(model.trainable_variables))
  tensors = model.trainable_variables[:count]
  return Hypernetwork(tuple(tuple(v.shape) for v in tensors),
                      tuple(v.name.split(":")[0] for v in tensors),
                      embedding_dim, hidden_dim)


def initial_embeddings(num_clients: int, embedding_dim: int,
                       seed: int) -> np.ndarray:
  """N(0, 1) rows, PyTorch's `nn.Embedding` default."""
  return np.random.default_rng([seed, 3]).standard_normal(
      (num_clients, embedding_dim)).astype(np.float32)


def build_pfedhn(
    keras_model_fn: Callable[[], tf.keras.Model],
    *,
    num_clients: int,
    personal_classifier: bool = False,
    seed: int = 0,
    embedding_dim: Optional[int] = None,
    hidden_dim: int = 100,
    learning_rate: float = 5e-3,
    local_epochs: int = 5,
    momentum: float = 0.9,
    weight_decay: float = 5e-5,
    server_learning_rate: float = 1e-2,
    server_momentum: float = 0.9,
    server_weight_decay: float = 1e-3,
    server_aggregation: str = "sum",
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
) -> personalized.PersonalizedProcess:
  """Builds pFedHN's (or pFedHN-PC's) `PersonalizedProcess` (see the module
  docstring).

  Args:
    keras_model_fn: returns the target model (uncompiled, logits).
    num_clients: the number of clients (rows of the embedding table).
    personal_classifier: pFedHN-PC: generate the extractor only, keep a
      private classifier on each client.
    seed: fixes the hypernetwork's and the embeddings' initial values.
    embedding_dim: the client embedding's size (default 1 + num_clients / 4).
    hidden_dim: the hypernetwork's hidden width (default 100).
    learning_rate: the clients' SGD step.
    local_epochs: the clients' epochs.
    momentum: the clients' SGD momentum.
    weight_decay: the clients' SGD weight decay.
    server_learning_rate: the server's SGD step on the hypernetwork and
      embeddings.
    server_momentum: that SGD's momentum.
    server_weight_decay: that SGD's weight decay.
    server_aggregation: 'sum' or 'mean' of the round's directions.
    model_aggregator: receives the uploads (weighted by examples); only its
      measurements are used (an upload-capturing wrapper records there).

  Returns:
    A `PersonalizedProcess` whose server state holds the hypernetwork, the
    embeddings and the server's momentum, whose `get_model_weights` returns
    the hypernetwork's weights followed by the embedding table, and whose
    client states are `OrderedDict(index=i)` (pFedHN-PC: and
    `classifier=[kernel, bias]`).

  Raises:
    ValueError: for a non-positive learning rate, epoch count or client
      count, or an unknown `server_aggregation`.
  """
  check_positive(num_clients=num_clients, learning_rate=learning_rate,
                 local_epochs=local_epochs,
                 server_learning_rate=server_learning_rate)
  combine = {"sum": federated_wide_sum, "mean": federated_wide_mean}.get(
      server_aggregation)
  if combine is None:
    raise ValueError(f"server_aggregation={server_aggregation!r}; choose sum "
                     "or mean")
  embedding_dim = embedding_dim or 1 + num_clients // 4
  with tf.Graph().as_default():
    model = keras_model_fn()
    hyper = hypernetwork_for(model, personal_classifier, embedding_dim, hidden_dim)
    classifier_shapes = [tuple(v.shape) for v in
                         model.trainable_variables[len(hyper.target_shapes):]]
    input_shape = tuple(model.input_shape[1:])
  f32 = lambda shapes: [tff.TensorType(np.float32, s) for s in shapes]
  generator_type = f32(hyper.shapes + [(num_clients, embedding_dim)])
  state_type = collections.OrderedDict(index=tff.TensorType(np.int32, []))
  if personal_classifier:
    state_type["classifier"] = f32(classifier_shapes)
  data_type = tff.SequenceType(collections.OrderedDict(
      x=tff.TensorType(np.float32, (None,) + input_shape),
      y=tff.TensorType(np.int32, (None,))))
  upload_type = f32(hyper.target_shapes)
  aggregator = (model_aggregator or wide_mean_factory()).create(
      tff.to_type(upload_type), tff.TensorType(np.float32))
  initial = hyper.initial_weights(seed) + [
      initial_embeddings(num_clients, embedding_dim, seed)]

  def generate(generator, index):
    return hyper.generate(generator[:-1], generator[-1][index])

  @tff.tensorflow.computation(generator_type, state_type, data_type)
  def client_update(generator, state, dataset):
    target = keras_model_fn()
    sent = generate(generator, state["index"])
    own = list(state["classifier"]) if personal_classifier else []

    w, sums = personalized.local_sgd(target, sent + own, dataset, learning_rate,
                                     momentum, weight_decay)
    upload = [a - b for a, b in zip(sent, w)]
    new_state = collections.OrderedDict(index=state["index"])
    if personal_classifier:
      new_state["classifier"] = list(w[len(sent):])
    # the server's work on this upload: (d theta_i / d generator)^T d_i
    with tf.GradientTape() as tape:
      tape.watch(generator)
      theta = generate(generator, state["index"])
    direction = tape.gradient(theta, generator, output_gradients=upload)
    return upload, sums[2] / local_epochs, direction, new_state, sums

  @tff.tensorflow.computation(generator_type, generator_type, generator_type)
  def server_step(generator, buffers, direction):
    generator, buffers = personalized.sgd_step(
        generator, direction, buffers, server_learning_rate, server_momentum,
        server_weight_decay)
    return list(generator), list(buffers)

  @tff.tensorflow.computation
  def initial_generator():
    return [tf.constant(w) for w in initial], [tf.zeros_like(w) for w in initial]

  @tff.federated_computation
  def initialize():
    generator, buffers = tff.federated_eval(initial_generator, tff.SERVER)
    return tff.federated_zip(collections.OrderedDict(
        generator=generator, buffers=buffers, aggregator=aggregator.initialize()))

  server_state_type = initialize.type_signature.result

  @tff.federated_computation(server_state_type,
                             tff.FederatedType(data_type, tff.CLIENTS),
                             tff.FederatedType(state_type, tff.CLIENTS))
  def next_fn(state, data, client_states):
    generator = tff.federated_broadcast(state.generator)
    uploads, weights, directions, new_states, sums = tff.federated_map(
        client_update, (generator, client_states, data))
    aggregated = aggregator.next(state.aggregator, uploads, weights)
    new_generator, new_buffers = tff.federated_map(
        server_step, (state.generator, state.buffers,
                      combine(directions)))
    new_state = tff.federated_zip(collections.OrderedDict(
        generator=new_generator, buffers=new_buffers,
        aggregator=aggregated.state))
    metrics = tff.federated_zip(collections.OrderedDict(
        client_work=tff.federated_map(personalized.train_metrics,
                                      federated_wide_sum(sums)),
        aggregator=aggregated.measurements))
    return collections.OrderedDict(state=new_state, client_states=new_states,
                                   metrics=metrics)

  @tff.tensorflow.computation(server_state_type.member)
  def get_model_weights(state):
    return state["generator"]

  return personalized.PersonalizedProcess(initialize, next_fn, get_model_weights)


def _private_state(spec, hyper: Hypernetwork, personal_classifier: bool,
                   seed: int) -> PrivateState:
  head = spec.initial_weights(seed)[len(hyper.target_shapes):]

  def initial(client):
    state = collections.OrderedDict(index=np.int32(client))
    if personal_classifier:
      state["classifier"] = [h.copy() for h in head]
    return state

  def sent(generator, state):
    return [t.numpy() for t in hyper.generate(
        [tf.constant(w) for w in generator[:-1]],
        tf.constant(generator[-1][int(state["index"])]))]

  def personal_weights(generator, state):
    return sent(generator, state) + (list(state["classifier"])
                                     if personal_classifier else [])

  return PrivateState(initial=initial, personal_weights=personal_weights,
                      sent=sent)


def _factory(personal_classifier: bool):
  name = "pfedhn_pc" if personal_classifier else "pfedhn"

  def algorithm(spec, *, batch_size: int, seed: int, defense, federation,
                **declared) -> Algorithm:
    refuse_defense(name, defense)
    check_positive(batch_size=batch_size)
    if federation is None:
      raise ValueError(f"method {name!r} needs the run's number of clients")
    num_clients = len(federation.client_sizes)
    declared["embedding_dim"] = declared["embedding_dim"] or 1 + num_clients // 4
    with tf.Graph().as_default():
      hyper = hypernetwork_for(spec.keras(), personal_classifier,
                               declared["embedding_dim"], declared["hidden_dim"])
    return Algorithm(
        name=name, upload_kind="body_delta" if personal_classifier else "model_delta",
        local_data="epochs", local_epochs=declared["local_epochs"],
        build_process=lambda aggregator: build_pfedhn(
            lambda: spec.keras(seed), num_clients=num_clients,
            personal_classifier=personal_classifier, seed=seed,
            model_aggregator=aggregator, **declared),
        protocol={**declared, "batch_size": batch_size,
                  "client_optimizer": "sgd_momentum_coupled_weight_decay",
                  "delta_convention": "broadcast_minus_local"},
        private_state=_private_state(spec, hyper, personal_classifier, seed),
        aggregates_uploads=False)

  return algorithm


METHOD = Method("pfedhn", PARAMETERS, _factory(False),
                "a server-side hypernetwork generates each client's model from "
                "its embedding; clients upload their model's change",
                needs_federation=True,
                listing=Listing("pFedHN", attacks=("ig",), scales=("full",)))
METHODS.register(METHOD)
METHOD_PC = Method("pfedhn_pc", PARAMETERS, _factory(True),
                   "pFedHN generating the feature extractor; each client keeps "
                   "a private classifier", needs_federation=True)
METHODS.register(METHOD_PC)
