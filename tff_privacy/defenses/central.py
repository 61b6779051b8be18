"""Server-side defences: aggregators the server runs over clients' uploads.

* `DPFedAvg` ('dp_fedavg', McMahan et al. 2018): each client's update is
  clipped to L2 norm C (on the client, as TFF's `DifferentiallyPrivateFactory`
  preprocesses records there), the server sums the clipped updates, adds
  N(0, (z C)^2) and divides by the expected number of clients. This is central
  DP: it protects against whoever sees the released model, not against the
  server, which legitimately receives the clipped, un-noised updates; that is
  what the update store records (`server_view`).

The noise comes from `tff_privacy.dp.SeededGaussianSumQuery`, whose seed lives
in the aggregator's state (checkpointed with the run), so runs are
reproducible and resumable.
"""

from __future__ import annotations

from typing import Any, Sequence

import dp_accounting
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_privacy.privacy.dp_query.normalized_query import NormalizedQuery

from tff_privacy.dp import SeededGaussianSumQuery


class DPFedAvg:
  name = "dp_fedavg"

  def __init__(self, clip: float, noise_multiplier: float):
    if not clip > 0:
      raise ValueError(f"clip must be > 0, got {clip}")
    if not noise_multiplier >= 0:
      raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    self.clip, self.noise_multiplier = clip, noise_multiplier

  def params(self) -> dict[str, Any]:
    return {"clip": self.clip, "noise_multiplier": self.noise_multiplier}

  def aggregator(self, clients_per_round: int,
                 seed: int = 0) -> tff.aggregators.WeightedAggregationFactory:
    """Clip, sum, noise, divide by `clients_per_round` (unweighted, as in
    the paper; client weights are ignored)."""
    query = NormalizedQuery(
        SeededGaussianSumQuery(self.clip, self.clip * self.noise_multiplier, seed),
        denominator=float(clients_per_round))
    return tff.aggregators.as_weighted_aggregator(
        tff.aggregators.DifferentiallyPrivateFactory(query))

  def server_view(self, update: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """What the server receives from one client: the clipped update."""
    return list(tf.clip_by_global_norm(list(update), self.clip)[0])

  def dp_event(self, sampling_probability: float):
    """One round's event; Poisson sampling approximates uniform sampling."""
    if self.noise_multiplier == 0:
      return None
    event = dp_accounting.GaussianDpEvent(self.noise_multiplier)
    if sampling_probability < 1:
      event = dp_accounting.PoissonSampledDpEvent(sampling_probability, event)
    return event
