"""Server-side defences: aggregators the server runs over clients' uploads.

* `DPFedAvg` ('dp_fedavg', McMahan et al. 2018): each client's update is
  clipped to L2 norm C (on the client, as TFF's `DifferentiallyPrivateFactory`
  preprocesses records there), the server sums the clipped updates, adds
  N(0, (z C)^2) and divides by the fixed number of clients per round. This is central
  DP: it protects against whoever sees the released model, not against the
  server, which legitimately receives the clipped, un-noised updates; that is
  what the update store records (`server_view`).

The noise comes from `tff_privacy.dp.SeededGaussianSumQuery`, whose seed lives
in the aggregator's state (checkpointed with the run), so runs are
reproducible and resumable.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import dp_accounting
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_privacy.privacy.dp_query.normalized_query import NormalizedQuery

from tff_privacy.defenses.updates import CLIP, NOISE_MULTIPLIER
from tff_privacy.dp import accounting
from tff_privacy.dp import SeededGaussianSumQuery
from tff_privacy.params import Params


class DPFedAvg:
  name = "dp_fedavg"
  PARAMETERS = Params(CLIP, NOISE_MULTIPLIER)
  dp_relation = ("central DP, user level: adding or removing one client's "
                 "data (sensitivity of the sum: the clip)")

  def __init__(self, clip: float, noise_multiplier: float):
    self.clip, self.noise_multiplier = self.PARAMETERS.check(
        clip=clip, noise_multiplier=noise_multiplier).values()

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

  def round_event(self, num_clients: int,
                  clients_per_round: int) -> Optional[accounting.RoundEvent]:
    """One round's DP event as the runner samples clients.

    Every client each round: add/remove-one-client, the noised sum's
    sensitivity is C, a Gaussian mechanism with multiplier z. A fixed number
    m < N of clients drawn without replacement (the runner's sampling):
    dp_accounting's `SampledWithoutReplacementDpEvent`, whose RDP bound
    (Wang et al. 2019) holds for replace-one-client neighbours; replacing a
    client moves the clipped sum by up to 2C, so the inner Gaussian's
    multiplier is z / 2. None without noise.
    """
    if self.noise_multiplier == 0:
      return None
    gaussian = dp_accounting.GaussianDpEvent(self.noise_multiplier)
    if clients_per_round == num_clients:
      return accounting.RoundEvent(
          gaussian, self.dp_relation,
          f"none: all {num_clients} clients take part in every round")
    return accounting.RoundEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            num_clients, clients_per_round,
            dp_accounting.GaussianDpEvent(self.noise_multiplier / 2)),
        "central DP, user level: replacing one client's data (sensitivity of "
        "the sum: twice the clip)",
        f"{clients_per_round} of {num_clients} clients drawn uniformly without "
        "replacement each round",
        accounting.NeighborRel.REPLACE_ONE)
