"""Local-only training: every client trains its own model on its own data
and nothing leaves it (the HyperFL paper's "Local-only" baseline).

Each round, client i runs `local_epochs` epochs of PyTorch's SGD
(`learning_rate`, `momentum`, coupled `weight_decay`; fresh each round, as
in the HyperFL authors' code) on its private model, which all clients start
from one seeded initialisation; `client_optimizer='adam'` runs TFF's Adam
instead (moments fresh each round, like FedAvg's clients; `momentum` unused,
`weight_decay` an L2 term on the gradient), for models that plain SGD barely
moves in a few rounds (FedRE's U-Net). Nothing is broadcast, uploaded or
aggregated (upload kind 'none'), so there is nothing for an attacker on the
server to capture; rounds only pace training and evaluation.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import params, tasks
from tff_privacy.algorithms import local_dp_sgd, personalized
from tff_privacy.algorithms.base import (CLIENT_OPTIMIZER, Algorithm, Method,
                                         PrivateState, build_client_optimizer,
                                         check_positive, refuse_defense)
from tff_privacy.registry import METHODS

PARAMETERS = params.Params(
    local_dp_sgd.LEARNING_RATE,
    local_dp_sgd.LOCAL_EPOCHS,
    *local_dp_sgd.SGD_PARAMETERS,
    CLIENT_OPTIMIZER)


def build_local_only(
    keras_model_fn: Callable[[], tf.keras.Model],
    *,
    learning_rate: float = 0.02,
    momentum: float = 0.5,
    weight_decay: float = 5e-4,
    label_shape: tuple[int, ...] = (),
    client_optimizer: str = "sgd",
    task: Optional[tasks.Task] = None,
) -> personalized.PersonalizedProcess:
  """Builds local-only training as a `PersonalizedProcess` (see the module
  docstring) whose client states are `OrderedDict(model=[weights...])`;
  `label_shape` is one sample's label's (a segmentation mask's [H, W]),
  `task` the `tff_privacy.tasks.Task` trained for (default:
  classification).

  Raises:
    ValueError: for a non-positive learning rate or an unknown
      `client_optimizer`.
  """
  check_positive(learning_rate=learning_rate)
  optimizer = build_client_optimizer(
      client_optimizer, learning_rate, momentum if client_optimizer == "sgd" else 0.0)
  with tf.Graph().as_default():
    model = keras_model_fn()
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    input_shape = tuple(model.input_shape[1:])
  state_type = collections.OrderedDict(
      model=[tff.TensorType(np.float32, s) for s in shapes])
  data_type = tff.SequenceType(collections.OrderedDict(
      x=tff.TensorType(np.float32, (None,) + input_shape),
      y=tff.TensorType(np.int32, (None,) + tuple(label_shape))))

  def local_training(shared, state, dataset):
    del shared  # nothing is shared
    w, sums = personalized.local_steps(keras_model_fn(), state["model"], dataset,
                                       optimizer, weight_decay, task)
    return [], None, collections.OrderedDict(model=w), sums

  return personalized.build_personalized_process(
      initial_shared=[], client_state_type=state_type, data_type=data_type,
      local_training=local_training)


def algorithm(spec, *, batch_size: int, seed: int, defense, learning_rate: float,
              local_epochs: int, momentum: float, weight_decay: float,
              client_optimizer: str) -> Algorithm:
  """Local-only training as the runner drives it."""
  refuse_defense("local_only", defense)
  check_positive(batch_size=batch_size)
  initial = spec.initial_weights(seed)
  return Algorithm(
      name="local_only", upload_kind="none", local_data="epochs",
      local_epochs=local_epochs,
      build_process=lambda aggregator: build_local_only(
          spec.keras, learning_rate=learning_rate, momentum=momentum,
          weight_decay=weight_decay,
          label_shape=spec.task_object.label_shape(spec.input_shape),
          client_optimizer=client_optimizer, task=spec.task_object),
      protocol={"learning_rate": learning_rate, "local_epochs": local_epochs,
                "momentum": momentum if client_optimizer == "sgd" else None,
                "weight_decay": weight_decay, "batch_size": batch_size,
                "client_optimizer": ("sgd_momentum_coupled_weight_decay"
                                     if client_optimizer == "sgd"
                                     else "adam_l2_weight_decay")},
      private_state=PrivateState(
          initial=lambda client: collections.OrderedDict(
              model=[w.copy() for w in initial]),
          personal_weights=lambda shared, state: list(state["model"])),
      local_model=lambda broadcast, upload, state: list(state["model"]))


METHOD = Method("local_only", PARAMETERS, algorithm,
                "every client trains its own model; nothing is uploaded")
METHODS.register(METHOD)
