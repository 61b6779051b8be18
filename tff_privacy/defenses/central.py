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
from tff_privacy.dp import accounting, dp_sgd
from tff_privacy.dp import SeededGaussianSumQuery
from tff_privacy.dp.queries import CanaryClientsQuery
from tff_privacy.disclosure import Disclosure
from tff_privacy.listing import Listing
from tff_privacy.params import Param, Params
from tff_privacy.registry import DEFENSES

AUDIT_CANARIES = Param(
    "audit_canaries", int, 0, "canary clients in the noised sum for "
    "`tff-privacy audit` of the whole training (Andrew et al.): half of them "
    "take part, each round with a client's chance; 0: none. They steer the "
    "model too: keep the inserted half x clients_per_round / clients small "
    "against clients_per_round. Memory: canaries x parameters floats a round",
    minimum=0)


@DEFENSES.register
class DPFedAvg:
  name = "dp_fedavg"
  PARAMETERS = Params(CLIP, NOISE_MULTIPLIER, AUDIT_CANARIES)
  DISCLOSURE = Disclosure(no_adaptive_attack=(
      "its noise is added to the aggregate on the server, after the server's "
      "view of each upload, which is the client's clipped update: plain IG "
      "is the attack that knows it"))
  LISTING = Listing("DP-FedAvg", "noise_multiplier", 1.0, (0.1, 0.5, 1.0, 2.0),
                    method="fedavg", kwargs={"clip": 1.0}, seconds=46.2)
  dp_relation = ("central DP, user level: adding or removing one client's "
                 "data (sensitivity of the sum: the clip)")

  def __init__(self, clip: float, noise_multiplier: float, audit_canaries: int = 0):
    self.clip, self.noise_multiplier, self.audit_canaries = self.PARAMETERS.check(
        clip=clip, noise_multiplier=noise_multiplier,
        audit_canaries=audit_canaries).values()
    if self.audit_canaries == 1:
      raise ValueError("audit_canaries must be 0 or at least 2, got 1")

  def params(self) -> dict[str, Any]:
    return {"clip": self.clip, "noise_multiplier": self.noise_multiplier,
            **({"audit_canaries": self.audit_canaries} if self.audit_canaries else {})}

  def aggregator(self, clients_per_round: int, seed: int = 0,
                 num_clients: Optional[int] = None
                 ) -> tff.aggregators.WeightedAggregationFactory:
    """Clip, sum, noise, divide by `clients_per_round` (unweighted, as in
    the paper; client weights are ignored). With `audit_canaries`, the sum
    holds canary clients that take part at the rate clients_per_round /
    `num_clients` (`CanaryClientsQuery`, seeded by `seed`)."""
    stddev = self.clip * self.noise_multiplier
    summed = (CanaryClientsQuery(self.clip, stddev, seed, canaries=self.audit_canaries,
                                 rate=self.canary_rate(clients_per_round, num_clients))
              if self.audit_canaries else
              SeededGaussianSumQuery(self.clip, stddev, seed))
    query = NormalizedQuery(summed, denominator=float(clients_per_round))
    return tff.aggregators.as_weighted_aggregator(
        tff.aggregators.DifferentiallyPrivateFactory(query))

  @staticmethod
  def canary_rate(clients_per_round: int, num_clients: Optional[int]) -> float:
    """A canary client's chance to take part in a round: a real client's."""
    if num_clients is None:
      raise ValueError("audit_canaries needs the run's number of clients")
    return min(1.0, clients_per_round / num_clients)

  def canary_event(self, num_clients: int, clients_per_round: int,
                   rounds: int) -> Optional[dp_accounting.DpEvent]:
    """What the run claims for one canary client, which takes part in each
    of `rounds` rounds independently at `canary_rate`: the Poisson-sampled
    Gaussian mechanism at multiplier z, composed (adding or removing it
    moves the sum by C). None without noise."""
    if self.noise_multiplier == 0:
      return None
    return dp_sgd.steps_event(self.noise_multiplier,
                              self.canary_rate(clients_per_round, num_clients), rounds)

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
