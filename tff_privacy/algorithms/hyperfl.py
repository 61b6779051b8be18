"""HyperFL (Guo et al., "A New Federated Learning Framework Against Gradient
Inversion Attacks"): clients share a hypernetwork, never their models.

Client i keeps a private embedding v_i and classifier phi_i; its feature
extractor is generated, theta_i = h(v_i; varphi), by the shared hypernetwork
(`tff_privacy.models.hypernetwork`). Round t:

1. the server broadcasts varphi; client i sets varphi_i = varphi;
2. (eq. 4) with theta_i = h(v_i; varphi_i) fixed, `classifier_epochs` epochs
   of SGD on phi_i (lr `classifier_learning_rate`);
3. (eq. 5) with phi_i fixed, `hypernetwork_epochs` epochs of SGD on varphi_i
   and v_i through the generated weights (lr `hypernetwork_learning_rate` for
   both), the gradients of varphi_i and of v_i each clipped to global norm
   `max_grad_norm`;
4. client i uploads varphi_i (upload kind 'hypernetwork_weights'); the server
   sets varphi = sum_i n_i varphi_i / sum_i n_i (eq. 6) over the round's
   clients and broadcasts it to all. In the simulation the client hands
   varphi_i to the aggregation in a compact form that the server expands
   exactly, knowing the varphi it broadcast (`upload_rows`); what is
   recorded and attacked is varphi_i itself.

Both local optimisers are PyTorch's SGD with `momentum` and coupled
`weight_decay`, created afresh every round (as in the authors' code). All
clients start from one initial model: the same embedding (N(0, 1)),
hypernetwork (PyTorch's linear default) and classifier (the target model's
seeded initial classifier: for the HyperFL CNNs PyTorch's linear default,
as in the authors' code). v_i, phi_i and theta_i never leave the client.

The two phases split the client's batches of the round: the runner passes
`classifier_epochs + hypernetwork_epochs` epochs of batches, every epoch
cut the same way, so the first `classifier_epochs` / total of them are the
classifier's.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import params
from tff_privacy.algorithms import personalized
from tff_privacy.algorithms.base import (Algorithm, Method, PrivateState,
                                         check_positive, model_from_upload,
                                         refuse_defense)
from tff_privacy.data import reads
from tff_privacy.models.hypernetwork import Hypernetwork, num_extractor_tensors
from tff_privacy.disclosure import Disclosure
from tff_privacy.listing import Listing
from tff_privacy.registry import METHODS

PARAMETERS = params.Params(
    params.Param("embedding_dim", int, 64, "size of each client's embedding",
                 minimum=1),
    params.Param("hidden_dim", int, 128, "width of the hypernetwork's hidden "
                 "layer", minimum=1),
    params.Param("classifier_learning_rate", float, 0.1, "SGD step of the "
                 "classifier phase (eta_g)", minimum=0, exclusive_minimum=True,
                 flag="classifier-lr"),
    params.Param("classifier_epochs", int, 1, "epochs of the classifier phase",
                 minimum=1),
    params.Param("hypernetwork_learning_rate", float, 0.02, "SGD step of the "
                 "hypernetwork and embedding phase (eta_h = eta_v)", minimum=0,
                 exclusive_minimum=True, flag="hypernetwork-lr"),
    params.Param("hypernetwork_epochs", int, 5, "epochs of the hypernetwork "
                 "phase", minimum=1),
    params.Param("momentum", float, 0.5, "SGD momentum of both phases",
                 minimum=0, maximum=1, exclusive_maximum=True),
    params.Param("weight_decay", float, 5e-4, "SGD weight decay of both phases",
                 minimum=0),
    params.Param("max_grad_norm", float, 50.0, "clip norm of the hypernetwork's "
                 "and of the embedding's gradient", minimum=0,
                 exclusive_minimum=True))

_F32 = np.float32

# `PersonalizedProcess.run_round` runs a round in TFF calls of at most
# `clients_per_call_for` clients, whose float32 uploads (whole hypernetworks,
# which TFF's runtime holds until the call ends in rounds that capture them;
# other rounds hold their compact forms, see `upload_rows`) total at most
# this many bytes: 21 of hyperfl_cnn's 60 MB (14,943,424 parameters), so
# that the paper's 20 clients run in one call. Each further call re-sends
# the server state and the float64 totals through the Python client: at
# 02e765b, 20 clients x 150 samples, batch 50, one run each, calls of 7
# took 13.02 s a round at a 4,152 MiB peak, one call 5.57 s at 4,000 MiB
# (benchmarks/hyperfl_round_time.py)
UPLOAD_BYTES_PER_CALL = 1200 * 2**20


def clients_per_call_for(num_parameters: int) -> int:
  """Clients per call of a round whose uploads have `num_parameters`
  float32 entries each (see `UPLOAD_BYTES_PER_CALL`)."""
  return max(1, UPLOAD_BYTES_PER_CALL // (4 * num_parameters))


def _tensor_types(shapes):
  return [tff.TensorType(_F32, s) for s in shapes]


def build_hyperfl(
    keras_model_fn: Callable[[], tf.keras.Model],
    *,
    seed: int = 0,
    embedding_dim: int = 64,
    hidden_dim: int = 128,
    classifier_learning_rate: float = 0.1,
    classifier_epochs: int = 1,
    hypernetwork_learning_rate: float = 0.02,
    hypernetwork_epochs: int = 5,
    momentum: float = 0.5,
    weight_decay: float = 5e-4,
    max_grad_norm: float = 50.0,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    clients_per_call: Optional[int] = None,
) -> personalized.PersonalizedProcess:
  """Builds HyperFL's `PersonalizedProcess` (see the module docstring).

  Args:
    keras_model_fn: returns the target model (uncompiled, logits); its last
      dense layer is the private classifier, the rest is generated.
    seed: fixes the hypernetwork's initial weights.
    embedding_dim: the client embedding's size (paper: 64).
    hidden_dim: the hypernetwork's hidden width (paper: 128).
    classifier_learning_rate: eq. 4's step (0.1).
    classifier_epochs: eq. 4's epochs (1).
    hypernetwork_learning_rate: eq. 5's step (0.02).
    hypernetwork_epochs: eq. 5's epochs (5).
    momentum: both phases' SGD momentum (0.5).
    weight_decay: both phases' SGD weight decay (5e-4).
    max_grad_norm: the gradient clip norm of eq. 5's phase (50).
    model_aggregator: aggregates the uploaded hypernetworks, weighted by the
      clients' numbers of samples (default
      `aggregation.wide_sum.wide_mean_factory`).
    clients_per_call: `run_round` runs a round's clients in calls of at
      most this many (None: one call), so that TFF's runtime holds this many
      uploaded hypernetworks at once rather than all of them; the default
      mean gives the same result either way
      (`personalized.build_personalized_process`). The runner passes
      `clients_per_call_for(hypernetwork parameters)`.

  Returns:
    A `PersonalizedProcess` (`personalized.build_personalized_process`)
    sharing the hypernetwork, whose client states are
    `OrderedDict(classifier=[kernel, bias], embedding=[v])`.

  Raises:
    ValueError: for a non-positive learning rate, epoch count or clip norm.
  """
  check_positive(classifier_learning_rate=classifier_learning_rate,
                 hypernetwork_learning_rate=hypernetwork_learning_rate,
                 classifier_epochs=classifier_epochs,
                 hypernetwork_epochs=hypernetwork_epochs,
                 max_grad_norm=max_grad_norm)
  with tf.Graph().as_default():
    model = keras_model_fn()
    hyper = Hypernetwork.for_model(model, embedding_dim, hidden_dim)
    split = num_extractor_tensors(model)
    classifier_shapes = [tuple(v.shape) for v in model.trainable_variables[split:]]
    input_shape = tuple(model.input_shape[1:])
  client_state_type = collections.OrderedDict(
      classifier=_tensor_types(classifier_shapes),
      embedding=_tensor_types([(embedding_dim,)]))
  data_type = tff.SequenceType(collections.OrderedDict(
      x=tff.TensorType(_F32, (None,) + input_shape),
      y=tff.TensorType(np.int32, (None,))))

  settings = dict(
      classifier_learning_rate=classifier_learning_rate,
      classifier_epochs=classifier_epochs,
      hypernetwork_learning_rate=hypernetwork_learning_rate,
      hypernetwork_epochs=hypernetwork_epochs, momentum=momentum,
      weight_decay=weight_decay, max_grad_norm=max_grad_norm)

  def client_training(varphi, state, dataset):
    # in a tf.function, whose graph may loop over the data set's iterator;
    # the target is built outside it (its weights are given, none of its
    # variables is read), as tf.function refuses variables made per trace
    target = keras_model_fn()
    return tf.function(lambda *args: local_training(
        target, hyper, *args, **settings), autograph=False)(
            varphi, state, dataset)

  return personalized.build_personalized_process(
      initial_shared=hyper.initial_weights(seed),
      client_state_type=client_state_type, data_type=data_type,
      local_training=client_training, model_aggregator=model_aggregator,
      clients_per_call=clients_per_call,
      compact_upload=personalized.CompactUpload(upload_rows))


def local_training(target: tf.keras.Model, hyper: Hypernetwork, varphi, state,
                   dataset, *, classifier_learning_rate: float,
                   classifier_epochs: int, hypernetwork_learning_rate: float,
                   hypernetwork_epochs: int, momentum: float,
                   weight_decay: float, max_grad_norm: float):
  """Eqs. 4-5 on one client (what `build_hyperfl`'s client update runs):
  the classifier phase on the first `classifier_epochs` of the epochs of
  batches in `dataset`, then the hypernetwork phase on the rest. The
  keyword arguments are `build_hyperfl`'s.

  Args:
    target: the target model, whose weights are given functionally.
    hyper: the hypernetwork generating its feature extractor.
    varphi: the broadcast hypernetwork weights (`hyper.shapes`).
    state: the client's `OrderedDict(classifier=[...], embedding=[v])`.
    dataset: `classifier_epochs + hypernetwork_epochs` epochs of batches.

  Returns:
    (varphi_i in its compact form (`_hypernetwork_phase`), examples of one
    epoch, new state, summed `train_sums`).
  """
  phi, v = state["classifier"], state["embedding"]
  total_epochs = classifier_epochs + hypernetwork_epochs
  num_batches = reads.count_batches(dataset)
  classifier_batches = num_batches // total_epochs * classifier_epochs

  def loss_and_sums(extractor, phi, batch):
    return personalized.batch_loss(target, list(extractor) + list(phi), batch)

  extractor = hyper.generate(varphi, v[0])

  def classifier_step(carry, batch):
    phi, buffers, sums = carry
    with tf.GradientTape() as tape:
      tape.watch(phi)
      loss, batch_sums = loss_and_sums(extractor, phi, batch)
    phi, buffers = personalized.sgd_step(
        phi, tape.gradient(loss, phi), buffers, classifier_learning_rate,
        momentum, weight_decay)
    return phi, buffers, sums + batch_sums

  # one pass over the batches: the phases continue one iterator
  batches = iter(dataset)
  phi, _, sums = reads.loop_batches(
      batches, (tuple(phi), personalized.zeros_like(phi), tf.zeros([3])),
      classifier_step, classifier_batches)
  varphi, v, sums = _hypernetwork_phase(
      batches, varphi, v, phi, loss_and_sums, sums, hyper.target_shapes,
      hypernetwork_learning_rate, momentum, weight_decay, max_grad_norm)
  # sums[2] counts every example of every local epoch
  return (varphi, sums[2] / total_epochs,
          collections.OrderedDict(classifier=list(phi), embedding=list(v)), sums)


def _hypernetwork_phase(batches, varphi, v, phi, loss_and_sums, sums,
                        target_shapes, learning_rate, momentum, weight_decay,
                        max_grad_norm):
  """Eq. 5: SGD on (varphi, v) over the batches the iterator `batches` has
  left, with phi fixed; returns (varphi in its compact form, v, sums).

  The heads' kernels hold almost all of varphi (hidden x P numbers for P
  generated ones), and their gradient at each step is an outer product
  h_s g_s^T of the hidden activation and the clipped gradient g_s of the
  generated weights. So, exactly (up to float rounding), the concatenated
  head kernel K and its momentum buffer B stay of the form a K_0 + H^T C and
  b K_0 + H^T D, with K_0 the broadcast kernel, scalars a and b, and one row
  of H (h_s), C and D per step. SGD acts on each row's pair (c_s, d_s) by
  one fixed linear map (d <- m d + w c, then c <- c - lr d), and the pair
  starts as (-lr, 1) g_s, so c_s = gamma_s g_s at every step with a scalar
  gamma_s following the same map. A step updates the scalars and appends
  h_s and g_s, instead of updating the hidden x P kernel, buffer and
  gradient (or the S x P rows of C and D, S the steps so far), and each
  head's kernel is formed once at the end. The small tensors (hidden
  layer, head biases, embedding) take plain SGD steps. The global gradient
  norm that is clipped includes the kernels' |h_s| |g_s|.

  The client returns varphi_i in that form, `OrderedDict(coefficients=G per
  head, formed=False, head_biases, hidden=[kernel, bias], rows=diag(gamma)
  H, scale=a)`, with H^T C = rows^T G (for hyperfl_cnn and 15 steps
  7.1 MiB where varphi_i takes 57 MiB); `upload_rows` forms any rows of its
  tensors. After more steps than
  hidden units, the rows and G would be the larger; the client then forms
  rows^T G itself and hands it over as `coefficients`, with `formed=True`
  and no rows.

  K_0 is read head by head where it lies in `varphi`, never concatenated:
  a concatenated copy (57 MiB for hyperfl_cnn) would be held by every
  client the worker runs at once.
  """
  num_heads = len(target_shapes)
  sizes = [int(np.prod(shape)) for shape in target_shapes]
  kernels0 = [varphi[2 + 2 * i] for i in range(num_heads)]
  small = (varphi[0], varphi[1],
           tf.concat([varphi[3 + 2 * i] for i in range(num_heads)], axis=0))
  hidden_dim = kernels0[0].shape[0]

  def step(carry, batch):
    small, small_buffers, v, v_buffers, a, b, rows, grads, gammas, deltas, sums = carry
    hidden_kernel, hidden_bias, head_bias = small
    with tf.GradientTape() as tape:
      tape.watch([hidden_kernel, hidden_bias, v])
      h = tf.nn.relu(tf.linalg.matvec(hidden_kernel, v[0], transpose_a=True)
                     + hidden_bias)
      theta = (a * tf.concat([tf.linalg.matvec(k, h, transpose_a=True)
                              for k in kernels0], 0)
               + tf.linalg.matvec(grads, gammas * tf.linalg.matvec(rows, h),
                                  transpose_a=True)
               + head_bias)
      extractor = [tf.reshape(t, shape) for t, shape
                   in zip(tf.split(theta, sizes), target_shapes)]
      loss, batch_sums = loss_and_sums(extractor, phi, batch)
    g_kernel, g_bias, g_theta, g_v = tape.gradient(
        loss, [hidden_kernel, hidden_bias, theta, list(v)])
    # d loss / d head_bias = g_theta; d loss / dK = h g_theta^T
    norm = tf.sqrt(tf.reduce_sum(g_kernel ** 2) + tf.reduce_sum(g_bias ** 2)
                   + (tf.reduce_sum(h ** 2) + 1.0) * tf.reduce_sum(g_theta ** 2))
    scale = max_grad_norm / tf.maximum(norm, max_grad_norm)
    small, small_buffers = personalized.sgd_step(
        small, (scale * g_kernel, scale * g_bias, scale * g_theta),
        small_buffers, learning_rate, momentum, weight_decay)
    g_v, _ = tf.clip_by_global_norm(g_v, max_grad_norm)
    v, v_buffers = personalized.sgd_step(v, g_v, v_buffers, learning_rate,
                                         momentum, weight_decay)
    # the coupled SGD step on (K, B), in its scalars: the new row's gradient
    # enters the buffer with multiplier 1 and the kernel with 0
    b = momentum * b + weight_decay * a
    deltas = tf.concat([momentum * deltas + weight_decay * gammas, [1.0]], 0)
    a = a - learning_rate * b
    gammas = tf.concat([gammas, [0.0]], 0) - learning_rate * deltas
    rows = tf.concat([rows, h[tf.newaxis]], 0)
    grads = tf.concat([grads, scale * g_theta[tf.newaxis]], 0)
    return (small, small_buffers, v, v_buffers, a, b, rows, grads, gammas,
            deltas, sums + batch_sums)

  zeros = personalized.zeros_like
  no_steps = tf.zeros([0])
  small, _, v, _, a, _, rows, grads, gammas, _, sums = reads.loop_batches(
      batches,
      (small, zeros(small), tuple(v), zeros(v), tf.constant(1.0),
       tf.constant(0.0), tf.zeros([0, hidden_dim]), tf.zeros([0, sum(sizes)]),
       no_steps, no_steps, sums),
      step)
  rows = gammas[:, tf.newaxis] * rows
  coefficients = tf.split(grads, sizes, axis=1)
  # past hidden_dim steps rows^T G is the smaller: hand it over formed
  formed = tf.shape(rows)[0] > hidden_dim
  rows, coefficients = tf.cond(
      formed,
      lambda: (tf.zeros([0, hidden_dim]),
               [tf.matmul(rows, c, transpose_a=True) for c in coefficients]),
      lambda: (rows, coefficients))
  compact = collections.OrderedDict(
      coefficients=list(coefficients), formed=formed,
      head_biases=tf.split(small[2], sizes), hidden=[small[0], small[1]],
      rows=rows, scale=a)
  return compact, v, sums


def upload_rows(compact, varphi, leaf: int, first: int, end: int) -> tf.Tensor:
  """Rows [first, end) of the `leaf`-th tensor (in `Hypernetwork.shapes`'
  order) of the hypernetwork varphi_i a client uploads, formed from its
  compact form (`_hypernetwork_phase`) and the broadcast `varphi`: a head's
  kernel is a K_0 + rows^T G (K_0 its broadcast kernel; rows^T G given as
  `coefficients` where `formed`), the other tensors are in the compact form
  as they are. The
  default mean forms the rows it adds when it adds them
  (`personalized.CompactUpload`)."""
  if leaf < 2:
    return compact["hidden"][leaf][first:end]
  head, is_bias = divmod(leaf - 2, 2)
  if is_bias:
    return compact["head_biases"][head][first:end]
  coefficients = compact["coefficients"][head]
  kernel0 = varphi[leaf][first:end]
  low_rank = tf.cond(
      compact["formed"], lambda: coefficients[first:end],
      lambda: tf.matmul(compact["rows"][:, first:end], coefficients,
                        transpose_a=True))
  return compact["scale"] * kernel0 + tf.ensure_shape(low_rank, kernel0.shape)


def _private_state(spec, seed: int, hyper: Hypernetwork) -> PrivateState:
  """HyperFL's client state: every client starts from one classifier and
  one embedding; its own model is h(v_i; varphi) followed by phi_i."""
  initial = spec.initial_weights(seed)
  classifier = initial[len(hyper.target_shapes):]
  embedding = hyper.initial_embedding(seed)

  def personal_weights(varphi, state):
    extractor = hyper.generate([tf.constant(w) for w in varphi],
                               tf.constant(state["embedding"][0]))
    return [t.numpy() for t in extractor] + list(state["classifier"])

  return PrivateState(
      initial=lambda client: collections.OrderedDict(
          classifier=[c.copy() for c in classifier], embedding=[embedding.copy()]),
      personal_weights=personal_weights)


def algorithm(spec, *, batch_size: int, seed: int, defense,
              **declared) -> Algorithm:
  """HyperFL as the runner drives it (`declared`: the parameters of
  `PARAMETERS`). HyperFL is its own defence; `defense` must be None."""
  refuse_defense("hyperfl", defense)
  check_positive(batch_size=batch_size)
  with tf.Graph().as_default():
    hyper = Hypernetwork.for_model(spec.keras(), declared["embedding_dim"],
                                   declared["hidden_dim"])
  private_state = _private_state(spec, seed, hyper)
  return Algorithm(
      name="hyperfl", upload_kind="hypernetwork_weights", local_data="epochs",
      local_epochs=declared["classifier_epochs"] + declared["hypernetwork_epochs"],
      build_process=lambda aggregator: build_hyperfl(
          spec.keras, seed=seed, model_aggregator=aggregator,
          clients_per_call=clients_per_call_for(hyper.num_parameters),
          **declared),
      protocol={**declared, "batch_size": batch_size,
                "hypernetwork_parameters": hyper.num_parameters,
                "client_optimizer": "sgd_momentum_coupled_weight_decay"},
      private_state=private_state,
      # what the client trained: h(v_i; varphi_i), its own varphi_i, and phi_i
      local_model=model_from_upload(private_state))


def shared_hypernetwork(record) -> dict[str, int]:
  """The sizes of the hypernetwork a HyperFL upload holds (its public
  protocol's), which generates the client's feature extractor from the
  client's private embedding: theta = K^T relu(W v + b) + c per tensor
  (`tff_privacy.models.hypernetwork.Hypernetwork`)."""
  protocol = record.metadata["protocol"]
  return {"embedding_dim": protocol["embedding_dim"],
          "hidden_dim": protocol["hidden_dim"]}


METHOD = Method("hyperfl", PARAMETERS, algorithm,
                "a shared hypernetwork generates each client's feature "
                "extractor; classifier and embedding stay private",
                disclosure=Disclosure(hypernetwork=shared_hypernetwork),
                # 1 + 5 local epochs each round: at batch 1 that is 120
                # steps per client, so the leaderboards train it on batches
                # of 10; the common attacks cannot read its uploads
                listing=Listing("HyperFL", attacks=("ig_hyperfl", "tailored_hyperfl"),
                                protocol={"batch_size": 10}, seconds=103.0))
METHODS.register(METHOD)
