"""FedSGD (Shokri & Shmatikov 2015; McMahan et al. 2017's baseline).

Round t: the server broadcasts w_t; client k computes the mean loss gradient
g_k over one local batch of `batch_size` samples and uploads it; the server
forms the example-weighted mean g and applies w_{t+1} = w_t -
server_learning_rate * g. The single-batch gradient is exactly what
gradient-inversion attacks (DLG, iDLG, Inverting Gradients) invert.

This is TFF's own `build_fed_sgd`; defences enter through `model_aggregator`.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow_federated as tff

from tff_privacy.algorithms.base import Algorithm, check_positive


def build_fedsgd(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    *,
    server_learning_rate: float = 0.1,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
) -> tff.learning.templates.LearningProcess:
  """Builds the FedSGD `LearningProcess`."""
  check_positive(server_learning_rate=server_learning_rate)
  return tff.learning.algorithms.build_fed_sgd(
      model_fn,
      server_optimizer_fn=tff.learning.optimizers.build_sgdm(server_learning_rate),
      model_aggregator=model_aggregator or tff.aggregators.MeanFactory())


def algorithm(model_fn, *, server_learning_rate: float = 0.1,
              batch_size: int = 32) -> Algorithm:
  """FedSGD as the runner drives it: one batch per client and round."""
  check_positive(batch_size=batch_size)
  return Algorithm(
      name="fedsgd", upload_kind="gradient", local_data="one_batch",
      build_process=lambda aggregator: build_fedsgd(
          model_fn, server_learning_rate=server_learning_rate,
          model_aggregator=aggregator),
      protocol={"server_learning_rate": server_learning_rate,
                "batch_size": batch_size, "local_steps": 1,
                "gradient_of": "mean loss over the batch"})
