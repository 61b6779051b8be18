"""Client-side transformations of an update before it leaves the client.

Each defence maps a client's update (tensors in the model's variable order)
and a stateless-RNG seed to the update it uploads (RECUP-FL Sec. 3.1's
phi(grad w), FedEM Appendix B.3). Clipping and noise go through the
`DPQuery` classes of `tff_privacy.dp`, run on the single record; the seed
makes the noise reproducible per (run, round, client).

* `LocalGaussian` ('ldp_gaussian'): clip to L2 norm B, add N(0, (z B)^2).
* `LocalLaplace` ('ldp_laplace'): clip to norm B (L2 as in the papers, or L1),
  add Laplace noise of scale b = z B.
* `ClipOnly` ('dp_clip'): clip to L2 norm B, no noise (FedEM's DP-clip).
* `Sparsification` ('sparsification'): keep exactly the ceil((1 - p) d) entries
  of largest magnitude among all d entries, zero the rest (phi_s).

Defences that look at more than the update (Soteria needs the client's data
and the broadcast model) set `needs_client_view`; the client work then passes
a `ClientView` to `apply`. Those that need the architecture set
`needs_model_spec` and receive the `ModelSpec` as `model` when built.
Soteria and LDP-Fed live in their own modules.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Optional, Sequence

import dp_accounting
import tensorflow as tf
from tensorflow_privacy.privacy.dp_query import dp_query

from tff_privacy.dp import LaplaceSumQuery, SeededGaussianSumQuery, with_seed


def run_local_query(query: dp_query.DPQuery, record, seed):
  """The noised result of `query` over the single `record`, under `seed`;
  returns (result, DP event)."""
  state = with_seed(query, query.initial_global_state(), seed)
  params = query.derive_sample_params(state)
  sample = query.accumulate_record(params, query.initial_sample_state(record), record)
  result, _, event = query.get_noised_result(sample, state)
  return result, event


@dataclasses.dataclass
class ClientView:
  """What a data-dependent defence sees on the client: the broadcast model's
  trainable weights and the client's local data set (batches of 'x', 'y')."""

  weights: list[tf.Tensor]
  dataset: tf.data.Dataset


class UpdateDefense(abc.ABC):
  """A transformation applied by the client to its update."""

  name = "defense"
  needs_client_view = False
  needs_model_spec = False

  @abc.abstractmethod
  def apply(self, update: Sequence[tf.Tensor], seed,
            client: Optional[ClientView] = None) -> list[tf.Tensor]:
    """The update the client uploads instead of `update`."""

  def params(self) -> dict[str, Any]:
    """The defence's parameters, for run metadata."""
    return {k.lstrip("_"): v for k, v in vars(self).items()}

  def dp_event(self, num_params: int) -> Optional[dp_accounting.DpEvent]:
    """The DP event of one application to an update of `num_params` entries,
    if the defence is a DP mechanism that `dp_accounting` models."""
    return None

  def pure_epsilon(self, num_params: int) -> Optional[float]:
    """The pure-DP epsilon of one application, for DP mechanisms that
    `dp_accounting` does not model (composed over rounds by the basic
    theorem)."""
    return None


def check_positive(name: str, value: float) -> None:
  if not value > 0:
    raise ValueError(f"{name} must be > 0, got {value}")


def check_non_negative(name: str, value: float) -> None:
  if not value >= 0:
    raise ValueError(f"{name} must be >= 0, got {value}")


class LocalGaussian(UpdateDefense):
  name = "ldp_gaussian"

  def __init__(self, clip: float, noise_multiplier: float):
    check_positive("clip", clip)
    check_non_negative("noise_multiplier", noise_multiplier)
    self.clip, self.noise_multiplier = clip, noise_multiplier

  def _query(self):
    return SeededGaussianSumQuery(self.clip, self.clip * self.noise_multiplier)

  def apply(self, update, seed, client=None):
    return list(run_local_query(self._query(), list(update), seed)[0])

  def dp_event(self, num_params: int):
    return (dp_accounting.GaussianDpEvent(self.noise_multiplier)
            if self.noise_multiplier > 0 else None)


class ClipOnly(LocalGaussian):
  name = "dp_clip"

  def __init__(self, clip: float):
    super().__init__(clip, 0.0)


class LocalLaplace(UpdateDefense):
  name = "ldp_laplace"

  def __init__(self, clip: float, noise_multiplier: float, norm: str = "l2"):
    check_positive("clip", clip)
    check_non_negative("noise_multiplier", noise_multiplier)
    LaplaceSumQuery(clip, clip * noise_multiplier, norm)  # validates norm
    self.clip, self.noise_multiplier, self.norm = clip, noise_multiplier, norm

  def apply(self, update, seed, client=None):
    query = LaplaceSumQuery(self.clip, self.clip * self.noise_multiplier, self.norm)
    return list(run_local_query(query, list(update), seed)[0])

  def dp_event(self, num_params: int):
    """Laplace mechanism with noise multiplier b / (L1 sensitivity): the L1
    sensitivity is the clip for norm 'l1' and sqrt(d) times it for 'l2'."""
    if self.noise_multiplier == 0:
      return None
    scale = math.sqrt(num_params) if self.norm == "l2" else 1.0
    return dp_accounting.LaplaceDpEvent(self.noise_multiplier / scale)


def check_fraction(name: str, value: float) -> None:
  if not 0 <= value < 1:
    raise ValueError(f"{name} must lie in [0, 1), got {value}")


def top_fraction_mask(scores: tf.Tensor, fraction: float) -> tf.Tensor:
  """1 at the ceil(fraction * n) largest of the n `scores`, 0 elsewhere."""
  keep = int(math.ceil(fraction * scores.shape.num_elements()))
  _, index = tf.math.top_k(scores, k=keep)
  return tf.scatter_nd(index[:, None], tf.ones([keep], scores.dtype),
                       tf.shape(scores))


def flatten(update: Sequence[tf.Tensor]) -> tf.Tensor:
  """All entries of an update as one vector, in the update's order."""
  return tf.concat([tf.reshape(u, [-1]) for u in update], 0)


def unflatten(flat: tf.Tensor, like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
  """`flat` cut back into tensors shaped like `like` (inverse of `flatten`)."""
  sizes = [u.shape.num_elements() for u in like]
  return [tf.reshape(part, tf.shape(u))
          for part, u in zip(tf.split(flat, sizes), like)]


class Sparsification(UpdateDefense):
  name = "sparsification"

  def __init__(self, p: float):
    check_fraction("p", p)
    self.p = p

  def apply(self, update, seed=None, client=None):
    flat = flatten(update)
    return unflatten(flat * top_fraction_mask(tf.abs(flat), 1 - self.p), update)


DEFENSES = {cls.name: cls for cls in (LocalGaussian, LocalLaplace, ClipOnly,
                                      Sparsification)}

