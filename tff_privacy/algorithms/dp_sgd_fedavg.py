"""DP-FedAvg as the HyperFL paper runs it: FedAvg whose clients train with
DP-SGD (sample-level DP inside local training; distinct from the defence
`dp_fedavg`, McMahan et al.'s user-level DP with server-side noise).

Round t: the server broadcasts w_t; client k runs `local_epochs` epochs of
DP-SGD from w_t (each example's gradient clipped to `l2_norm_clip`, Gaussian
noise, see `tff_privacy.algorithms.local_dp_sgd`; PyTorch's SGD with
`momentum` and coupled `weight_decay`, as in the authors' code), reaching
w_k, and uploads d_k = w_t - w_k (upload kind 'model_delta'); the server
applies w_{t+1} = w_t - server_learning_rate * (example-weighted mean of
d_k), which with the default rate 1 is the weighted mean of the w_k. Every
client is then evaluated with the one global model.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import params
from tff_privacy.algorithms import client_data, defended, local_dp_sgd, personalized
from tff_privacy.algorithms.client_data import SEED_KEY
from tff_privacy.algorithms.base import (Algorithm, Method,
                                         broadcast_minus_upload, check_positive,
                                         refuse_defense, server_learning_rate)
from tff_privacy.listing import Listing
from tff_privacy.registry import METHODS

PARAMETERS = params.Params(
    local_dp_sgd.LEARNING_RATE,
    local_dp_sgd.LOCAL_EPOCHS,
    server_learning_rate(1.0),
    *local_dp_sgd.SGD_PARAMETERS, *local_dp_sgd.PARAMETERS)


def build_dp_sgd_client_work(
    keras_model_fn: Callable[[], tf.keras.Model], weights_type, dp, *,
    learning_rate: float, local_epochs: int, momentum: float,
    weight_decay: float) -> tff.learning.templates.ClientWorkProcess:
  """The clients' DP-SGD epochs (on `dp`'s batches,
  `local_dp_sgd.dp_batches`); the update is the model delta, weighted by the
  client's examples per epoch."""
  input_shape = tuple(keras_model_fn().input_shape[1:])
  data_type = local_dp_sgd.data_type(input_shape)

  @tff.tensorflow.computation(weights_type, data_type)
  def client_update(weights, data):
    dataset, inputs = client_data.split(data)
    target = keras_model_fn()
    start = list(weights.trainable)
    every = range(len(start))

    def step(carry, batch):
      w, buffers, sums, i = carry
      _, batch_sums = personalized.batch_loss(target, w, batch)
      grad = local_dp_sgd.private_gradient(target, w, every, batch, dp, i,
                                           inputs[SEED_KEY])
      w, buffers = personalized.sgd_step(w, grad, buffers, learning_rate,
                                         momentum, weight_decay)
      return w, buffers, sums + batch_sums, i + 1

    w, _, sums, _ = local_dp_sgd.dp_batches(dataset, dp, local_epochs,
                                            inputs[SEED_KEY]).reduce(
        (tuple(start), personalized.zeros_like(start), tf.zeros([3]),
         tf.constant(0, tf.int64)), step)
    update = [s - e for s, e in zip(start, w)]
    return (tff.learning.templates.ClientResult(
        update=update,
        update_weight=local_dp_sgd.examples_per_pass(dataset, local_epochs)),
        sums)

  return local_dp_sgd.local_training_client_work(client_update)


def build_dp_sgd_fedavg(
    keras_model_fn: Callable[[], tf.keras.Model],
    *,
    noise_multiplier: float,
    l2_norm_clip: float = 0.04,
    learning_rate: float = 0.02,
    local_epochs: int = 5,
    momentum: float = 0.5,
    weight_decay: float = 5e-4,
    server_learning_rate: float = 1.0,
    batch_sampling: str = "poisson",
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
) -> tff.learning.templates.LearningProcess:
  """Builds the DP-SGD FedAvg `LearningProcess` (see the module docstring).

  Args:
    keras_model_fn: returns the model (uncompiled, logits), initialised as
      the server's first model.
    noise_multiplier: the clients' DP-SGD noise multiplier sigma.
    l2_norm_clip: the clients' DP-SGD clip C.
    learning_rate: the clients' SGD step (0.02).
    local_epochs: the clients' epochs (5; the data set a client receives
      holds them all).
    momentum: the clients' SGD momentum (0.5).
    weight_decay: the clients' SGD weight decay (5e-4).
    server_learning_rate: the server's step on the mean delta (1).
    batch_sampling: how the DP steps' batches are drawn, 'poisson' or
      'shuffle' (see `tff_privacy.algorithms.local_dp_sgd`).
    model_aggregator: aggregates the deltas, weighted by examples.

  Raises:
    ValueError: for a non-positive learning rate, epoch count or clip, or a
      negative noise multiplier.
  """
  check_positive(learning_rate=learning_rate, local_epochs=local_epochs,
                 l2_norm_clip=l2_norm_clip,
                 server_learning_rate=server_learning_rate)
  if noise_multiplier < 0:
    raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
  initial = [v.numpy() for v in keras_model_fn().trainable_variables]

  @tff.tensorflow.computation()
  def initial_model_weights_fn():
    return tff.learning.models.ModelWeights(
        trainable=[tf.constant(w) for w in initial], non_trainable=[])

  client_work = build_dp_sgd_client_work(
      keras_model_fn, initial_model_weights_fn.type_signature.result,
      local_dp_sgd.DPSGD(l2_norm_clip, noise_multiplier,
                         batch_sampling=batch_sampling),
      learning_rate=learning_rate, local_epochs=local_epochs,
      momentum=momentum, weight_decay=weight_decay)
  return defended.compose_from_weights(
      initial_model_weights_fn, client_work,
      tff.learning.optimizers.build_sgdm(server_learning_rate), model_aggregator)


def algorithm(spec, *, batch_size: int, seed: int, defense, federation,
              **declared) -> Algorithm:
  """DP-SGD FedAvg as the runner drives it (`declared`: the parameters of
  `PARAMETERS`); it is its own defence."""
  refuse_defense("dp_sgd_fedavg", defense)
  check_positive(batch_size=batch_size)
  sgd, dp_declared = local_dp_sgd.split_declared(declared)
  dp = local_dp_sgd.configure("dp_sgd_fedavg", federation, batch_size,
                              sgd["local_epochs"], **dp_declared)
  return Algorithm(
      name="dp_sgd_fedavg", upload_kind="model_delta", local_data="epochs",
      local_epochs=sgd["local_epochs"],
      build_process=lambda aggregator: build_dp_sgd_fedavg(
          lambda: spec.keras(seed), noise_multiplier=dp.noise_multiplier,
          l2_norm_clip=dp.l2_norm_clip, batch_sampling=dp.batch_sampling,
          model_aggregator=aggregator, **sgd),
      protocol={**sgd, **dp.protocol(), "batch_size": batch_size,
                "client_optimizer": "dp_sgd_momentum_coupled_weight_decay",
                "delta_convention": "broadcast_minus_local"},
      local_model=broadcast_minus_upload,
      **local_dp_sgd.algorithm_fields(dp, seed, federation))


METHOD = Method("dp_sgd_fedavg", PARAMETERS, algorithm,
                "FedAvg whose clients train with DP-SGD (per-example clipping "
                "and noise; sample-level DP)", needs_federation=True,
                listing=Listing("DP-SGD FedAvg", "noise_multiplier", 1.0,
                                (0.5, 1.0), scales=("full",)))
METHODS.register(METHOD)
