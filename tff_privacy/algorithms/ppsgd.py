"""PPSGD (Bietti et al., "Personalization Improves Privacy-Accuracy Tradeoffs
in Federated Learning", 2022) as the HyperFL paper runs it: a shared
feature extractor trained with DP-SGD, a private classifier trained without
noise, both at every local step.

Client i holds its classifier phi_i; round t:

1. the server broadcasts the body theta;
2. `local_epochs` epochs over the client's batches (Poisson-sampled by
   default, `tff_privacy.algorithms.local_dp_sgd`); at each step, with the
   gradients taken at the step's starting point,
   phi_i <- SGD(phi_i, grad_phi L) at `classifier_learning_rate` (no noise),
   theta <- SGD(theta, DP-SGD gradient of L) at `learning_rate` (each
   example's body gradient clipped to `l2_norm_clip`, Gaussian noise, see
   `tff_privacy.algorithms.local_dp_sgd`);
3. client i uploads theta (upload kind 'body_weights'); the server sets the
   body to the example-weighted mean of the uploads.

Both optimisers are PyTorch's SGD (`momentum`, coupled `weight_decay`),
fresh each round, as in the HyperFL authors' code. That code computes the
classifier's and the body's gradients from one forward pass before either
step; here both are taken at the step's starting point as well.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import params
from tff_privacy.algorithms import local_dp_sgd, personalized
from tff_privacy.algorithms.base import (Algorithm, Method, check_positive,
                                         model_from_upload, refuse_defense)
from tff_privacy.registry import METHODS

PARAMETERS = params.Params(
    local_dp_sgd.CLASSIFIER_LEARNING_RATE,
    local_dp_sgd.LEARNING_RATE,
    local_dp_sgd.LOCAL_EPOCHS,
    *local_dp_sgd.SGD_PARAMETERS, *local_dp_sgd.PARAMETERS)


def build_ppsgd(
    keras_model_fn: Callable[[], tf.keras.Model],
    *,
    noise_multiplier: float,
    l2_norm_clip: float = 0.04,
    classifier_learning_rate: float = 0.1,
    learning_rate: float = 0.02,
    local_epochs: int = 5,
    momentum: float = 0.5,
    weight_decay: float = 5e-4,
    batch_sampling: str = "poisson",
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
) -> personalized.PersonalizedProcess:
  """Builds PPSGD's `PersonalizedProcess` (see the module docstring).

  Args:
    keras_model_fn: returns the model (uncompiled, logits), initialised as
      the server's body and every client's classifier start; its last dense
      layer is the private classifier.
    noise_multiplier: the body's DP-SGD noise multiplier sigma.
    l2_norm_clip: the body's DP-SGD clip C.
    classifier_learning_rate: the classifier's SGD step (0.1).
    learning_rate: the body's SGD step (0.02).
    local_epochs: passes over the client's batches per round (5); the data
      set a client receives holds them all.
    momentum: both optimisers' momentum (0.5).
    weight_decay: both optimisers' weight decay (5e-4).
    batch_sampling: how the DP steps' batches are drawn, 'poisson' or
      'shuffle' (see `tff_privacy.algorithms.local_dp_sgd`).
    model_aggregator: aggregates the uploaded bodies, weighted by examples.

  Returns:
    A `PersonalizedProcess` sharing the body, whose client states are
    `OrderedDict(classifier=[kernel, bias])`.

  Raises:
    ValueError: for a non-positive learning rate, epoch count or clip, or a
      negative noise multiplier.
  """
  check_positive(classifier_learning_rate=classifier_learning_rate,
                 learning_rate=learning_rate, local_epochs=local_epochs,
                 l2_norm_clip=l2_norm_clip)
  if noise_multiplier < 0:
    raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
  dp = local_dp_sgd.DPSGD(l2_norm_clip, noise_multiplier,
                          batch_sampling=batch_sampling)

  def local_training(target, body, head, dataset, seed):
    num_body = len(body)

    def step(carry, batch):
      body, head, body_buffers, head_buffers, sums, i = carry
      weights = list(body) + list(head)
      with tf.GradientTape() as tape:
        tape.watch(head)
        loss, batch_sums = personalized.batch_loss(target, weights, batch)
      head_grad = tape.gradient(loss, head)
      body_grad = local_dp_sgd.private_gradient(
          target, weights, range(num_body), batch, dp, i, seed)
      head, head_buffers = personalized.sgd_step(
          head, head_grad, head_buffers, classifier_learning_rate, momentum,
          weight_decay)
      body, body_buffers = personalized.sgd_step(
          body, body_grad, body_buffers, learning_rate, momentum, weight_decay)
      return body, head, body_buffers, head_buffers, sums + batch_sums, i + 1

    zeros = personalized.zeros_like
    batches = local_dp_sgd.dp_batches(dataset, dp, local_epochs, seed)
    body, head, _, _, sums, _ = batches.reduce(
        (tuple(body), tuple(head), zeros(body), zeros(head), tf.zeros([3]),
         tf.constant(0, tf.int64)), step)
    return list(body), list(head), sums

  return local_dp_sgd.build_body_head_process(
      keras_model_fn, local_training, local_epochs, model_aggregator)


def algorithm(spec, *, batch_size: int, seed: int, defense, federation,
              **declared) -> Algorithm:
  """PPSGD as the runner drives it (`declared`: the parameters of
  `PARAMETERS`); PPSGD is its own defence."""
  refuse_defense("ppsgd", defense)
  check_positive(batch_size=batch_size)
  sgd, dp_declared = local_dp_sgd.split_declared(declared)
  dp = local_dp_sgd.configure("ppsgd", federation, batch_size,
                              sgd["local_epochs"], **dp_declared)
  private = local_dp_sgd.private_classifier(spec, seed)
  return Algorithm(
      name="ppsgd", upload_kind="body_weights", local_data="epochs",
      local_epochs=sgd["local_epochs"],
      build_process=lambda aggregator: build_ppsgd(
          lambda: spec.keras(seed), noise_multiplier=dp.noise_multiplier,
          l2_norm_clip=dp.l2_norm_clip, batch_sampling=dp.batch_sampling,
          model_aggregator=aggregator, **sgd),
      protocol={**sgd, **dp.protocol(), "batch_size": batch_size,
                "client_optimizer": "sgd_momentum_coupled_weight_decay"},
      **local_dp_sgd.algorithm_fields(dp, seed, federation),
      private_state=private,
      # what the client trained: its uploaded body and its classifier
      local_model=model_from_upload(private))


METHOD = Method("ppsgd", PARAMETERS, algorithm,
                "DP-SGD on a shared feature extractor and a private "
                "classifier at every step; only the extractor is uploaded",
                needs_federation=True)
METHODS.register(METHOD)
