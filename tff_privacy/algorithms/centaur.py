"""CENTAUR (Shen et al., "Share Your Representation Only", 2023) as the
HyperFL paper runs it: a private classifier trained first, then a shared
feature extractor trained with DP-SGD.

Client i holds its classifier phi_i; round t:

1. the server broadcasts the body theta;
2. `classifier_epochs` epochs of SGD on phi_i with theta fixed, at
   `classifier_learning_rate`, without noise;
3. `local_epochs` epochs of DP-SGD on theta with phi_i fixed, at
   `learning_rate` (each example's body gradient clipped to
   `l2_norm_clip`, Gaussian noise, see `tff_privacy.algorithms.local_dp_sgd`);
4. client i uploads theta (upload kind 'body_weights'); the server sets the
   body to the example-weighted mean of the uploads.

Both optimisers are PyTorch's SGD (`momentum`, coupled `weight_decay`),
fresh each round, as in the HyperFL authors' code. The noise is calibrated
over the DP epochs only (rounds x `local_epochs`): the classifier's epochs
are local and never uploaded.

The two phases split the client's batches of the round: the runner passes
`classifier_epochs + local_epochs` epochs of batches, every epoch cut the
same way, so the first `classifier_epochs` / total of them are the
classifier's; the DP phase steps through the rest, or as many Poisson
samples of the client's examples (the default `batch_sampling`, see
`tff_privacy.algorithms.local_dp_sgd`).
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import params
from tff_privacy.algorithms import local_dp_sgd, personalized
from tff_privacy.algorithms.base import (Algorithm, Method, check_positive,
                                         model_from_upload, refuse_defense)
from tff_privacy.data import reads
from tff_privacy.registry import METHODS

PARAMETERS = params.Params(
    local_dp_sgd.CLASSIFIER_LEARNING_RATE,
    params.Param("classifier_epochs", int, 1, "epochs of the classifier "
                 "phase", minimum=1),
    local_dp_sgd.LEARNING_RATE,
    local_dp_sgd.LOCAL_EPOCHS,
    *local_dp_sgd.SGD_PARAMETERS, *local_dp_sgd.PARAMETERS)


def build_centaur(
    keras_model_fn: Callable[[], tf.keras.Model],
    *,
    noise_multiplier: float,
    l2_norm_clip: float = 0.04,
    classifier_learning_rate: float = 0.1,
    classifier_epochs: int = 1,
    learning_rate: float = 0.02,
    local_epochs: int = 5,
    momentum: float = 0.5,
    weight_decay: float = 5e-4,
    batch_sampling: str = "poisson",
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
) -> personalized.PersonalizedProcess:
  """Builds CENTAUR's `PersonalizedProcess` (see the module docstring).

  Args:
    keras_model_fn: returns the model (uncompiled, logits), initialised as
      the server's body and every client's classifier start; its last dense
      layer is the private classifier.
    noise_multiplier: the body's DP-SGD noise multiplier sigma.
    l2_norm_clip: the body's DP-SGD clip C.
    classifier_learning_rate: the classifier phase's step (0.1).
    classifier_epochs: the classifier phase's epochs (1).
    learning_rate: the DP phase's step on the body (0.02).
    local_epochs: the DP phase's epochs (5).
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
                 classifier_epochs=classifier_epochs,
                 learning_rate=learning_rate, local_epochs=local_epochs,
                 l2_norm_clip=l2_norm_clip)
  if noise_multiplier < 0:
    raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
  dp = local_dp_sgd.DPSGD(l2_norm_clip, noise_multiplier,
                          batch_sampling=batch_sampling)
  total_epochs = classifier_epochs + local_epochs

  def local_training(target, body, head, dataset, seed):
    num_batches = reads.count_batches(dataset)
    classifier_batches = num_batches // total_epochs * classifier_epochs

    def classifier_step(carry, batch):
      head, buffers, sums = carry
      with tf.GradientTape() as tape:
        tape.watch(head)
        loss, batch_sums = personalized.batch_loss(
            target, list(body) + list(head), batch)
      head, buffers = personalized.sgd_step(
          head, tape.gradient(loss, head), buffers, classifier_learning_rate,
          momentum, weight_decay)
      return head, buffers, sums + batch_sums

    def body_step(carry, batch):
      body, buffers, sums, i = carry
      weights = list(body) + list(head)
      _, batch_sums = personalized.batch_loss(target, weights, batch)
      grad = local_dp_sgd.private_gradient(target, weights, range(len(body)),
                                           batch, dp, i, seed)
      body, buffers = personalized.sgd_step(body, grad, buffers, learning_rate,
                                            momentum, weight_decay)
      return body, buffers, sums + batch_sums, i + 1

    zeros = personalized.zeros_like
    head, _, sums = dataset.take(classifier_batches).reduce(
        (tuple(head), zeros(head), tf.zeros([3])), classifier_step)
    dp_part = local_dp_sgd.dp_batches(dataset.skip(classifier_batches), dp,
                                      local_epochs, seed)
    body, _, sums, _ = dp_part.reduce(
        (tuple(body), zeros(body), sums, tf.constant(0, tf.int64)), body_step)
    return list(body), list(head), sums

  return local_dp_sgd.build_body_head_process(
      keras_model_fn, local_training, total_epochs, model_aggregator)


def algorithm(spec, *, batch_size: int, seed: int, defense, federation,
              **declared) -> Algorithm:
  """CENTAUR as the runner drives it (`declared`: the parameters of
  `PARAMETERS`); CENTAUR is its own defence."""
  refuse_defense("centaur", defense)
  check_positive(batch_size=batch_size)
  sgd, dp_declared = local_dp_sgd.split_declared(declared)
  dp = local_dp_sgd.configure("centaur", federation, batch_size,
                              sgd["local_epochs"], **dp_declared)
  private = local_dp_sgd.private_classifier(spec, seed)
  return Algorithm(
      name="centaur", upload_kind="body_weights", local_data="epochs",
      local_epochs=sgd["classifier_epochs"] + sgd["local_epochs"],
      build_process=lambda aggregator: build_centaur(
          lambda: spec.keras(seed), noise_multiplier=dp.noise_multiplier,
          l2_norm_clip=dp.l2_norm_clip, batch_sampling=dp.batch_sampling,
          model_aggregator=aggregator, **sgd),
      protocol={**sgd, **dp.protocol(), "batch_size": batch_size,
                "client_optimizer": "sgd_momentum_coupled_weight_decay"},
      **local_dp_sgd.algorithm_fields(dp, seed, federation),
      private_state=private,
      # what the client trained: its uploaded body and its classifier
      local_model=model_from_upload(private))


METHOD = Method("centaur", PARAMETERS, algorithm,
                "a private classifier epoch, then DP-SGD epochs on the shared "
                "feature extractor; only the extractor is uploaded",
                needs_federation=True)
METHODS.register(METHOD)
