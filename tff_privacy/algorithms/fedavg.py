"""FedAvg (McMahan et al. 2017): local SGD epochs, server averages model deltas.

Round t: the server broadcasts w_t; client k runs `local_epochs` passes of
minibatch SGD (rate `client_learning_rate`, momentum `client_momentum`,
coupled `weight_decay`) over its data from w_t, reaching
w_k, and uploads the model delta d_k = w_t - w_k (TFF's sign convention: a
pseudo-gradient); the server forms the example-weighted mean d and applies
w_{t+1} = w_t - server_learning_rate * d.

This is TFF's own `build_weighted_fed_avg`; server-side defences enter
through `model_aggregator`, client-side ones (`defense`) wrap TFF's model-delta
client work (see `tff_privacy.algorithms.defended`).
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow_federated as tff

from tff_privacy import params
from tff_privacy.aggregation.wide_sum import wide_mean_factory, wide_sum_then_finalize
from tff_privacy.algorithms import defended
from tff_privacy.algorithms.base import (CLIENT_OPTIMIZER, Algorithm, Method,
                                         broadcast_minus_upload,
                                         build_client_optimizer, check_positive,
                                         defense_fields, server_learning_rate)
from tff_privacy.defenses import UpdateDefense
from tff_privacy.listing import Listing
from tff_privacy.registry import METHODS

PARAMETERS = params.Params(
    params.Param("client_learning_rate", float, 0.1,
                 "learning rate of the clients' local SGD", minimum=0,
                 exclusive_minimum=True, flag="client-lr"),
    server_learning_rate(1.0),
    params.Param("local_epochs", int, 1, "local passes over each client's data",
                 minimum=1),
    params.Param("client_momentum", float, 0.0, "momentum of the clients' "
                 "local SGD (the HyperFL paper's FedAvg: 0.5)", minimum=0,
                 maximum=1, exclusive_maximum=True),
    params.Param("weight_decay", float, 0.0, "coupled weight decay of the "
                 "clients' local SGD, PyTorch's (the HyperFL paper's FedAvg: "
                 "5e-4)", minimum=0),
    CLIENT_OPTIMIZER)


def build_fedavg(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    *,
    client_learning_rate: float = 0.1,
    server_learning_rate: float = 1.0,
    client_momentum: float = 0.0,
    weight_decay: float = 0.0,
    client_optimizer: str = "sgd",
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
    defense: Optional[UpdateDefense] = None,
) -> tff.learning.templates.LearningProcess:
  """Builds the FedAvg `LearningProcess` (clients use SGD, with
  `client_momentum` and coupled `weight_decay` if > 0, or Adam by
  `client_optimizer`, its state fresh each round); with `defense`, every
  client transforms its model delta before uploading it."""
  check_positive(client_learning_rate=client_learning_rate,
                 server_learning_rate=server_learning_rate)
  client_optimizer = build_client_optimizer(
      client_optimizer, client_learning_rate, client_momentum, weight_decay)
  server_optimizer = tff.learning.optimizers.build_sgdm(server_learning_rate)
  if defense is None:
    return tff.learning.algorithms.build_weighted_fed_avg(
        model_fn, client_optimizer_fn=client_optimizer,
        server_optimizer_fn=server_optimizer,
        model_aggregator=model_aggregator or wide_mean_factory(),
        metrics_aggregator=wide_sum_then_finalize,
        loop_implementation=defended.CLIENT_LOOP)
  client_work = defended.with_update_defense(
      defended.model_delta_update(model_fn, client_optimizer), defense,
      wide_sum_then_finalize)
  return defended.compose_defended(model_fn, client_work, server_optimizer,
                                   model_aggregator)


def algorithm(spec, *, batch_size: int, seed: int,
              defense: Optional[UpdateDefense], client_learning_rate: float,
              server_learning_rate: float, local_epochs: int,
              client_momentum: float, weight_decay: float,
              client_optimizer: str) -> Algorithm:
  """FedAvg as the runner drives it."""
  check_positive(batch_size=batch_size)
  return Algorithm(
      name="fedavg", upload_kind="model_delta", local_data="epochs",
      local_epochs=local_epochs,
      build_process=lambda aggregator: build_fedavg(
          spec.tff_model_fn(), client_learning_rate=client_learning_rate,
          server_learning_rate=server_learning_rate,
          client_momentum=client_momentum, weight_decay=weight_decay,
          client_optimizer=client_optimizer, model_aggregator=aggregator,
          defense=defense),
      protocol={"client_learning_rate": client_learning_rate,
                "server_learning_rate": server_learning_rate,
                "local_epochs": local_epochs, "batch_size": batch_size,
                "client_optimizer": client_optimizer,
                "client_momentum": client_momentum,
                "weight_decay": weight_decay,
                "delta_convention": "broadcast_minus_local"},
      local_model=None if defense else broadcast_minus_upload,
      **defense_fields(defense, seed))


METHOD = Method("fedavg", PARAMETERS, algorithm,
                "local SGD epochs per client, the server averages model deltas",
                listing=Listing("FedAvg", kwargs={"client_learning_rate": 0.05},
                                seconds=40.6))
METHODS.register(METHOD)
