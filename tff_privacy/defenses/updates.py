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
"""

from __future__ import annotations

import abc
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


class UpdateDefense(abc.ABC):
  """A transformation applied by the client to its update."""

  name = "defense"

  @abc.abstractmethod
  def apply(self, update: Sequence[tf.Tensor], seed) -> list[tf.Tensor]:
    """The update the client uploads instead of `update`."""

  def params(self) -> dict[str, Any]:
    """The defence's parameters, for run metadata."""
    return {k.lstrip("_"): v for k, v in vars(self).items()}

  def dp_event(self, num_params: int) -> Optional[dp_accounting.DpEvent]:
    """The DP event of one application to an update of `num_params` entries,
    if the defence is a DP mechanism."""
    return None


def _positive(name: str, value: float) -> None:
  if not value > 0:
    raise ValueError(f"{name} must be > 0, got {value}")


def _non_negative(name: str, value: float) -> None:
  if not value >= 0:
    raise ValueError(f"{name} must be >= 0, got {value}")


class LocalGaussian(UpdateDefense):
  name = "ldp_gaussian"

  def __init__(self, clip: float, noise_multiplier: float):
    _positive("clip", clip)
    _non_negative("noise_multiplier", noise_multiplier)
    self.clip, self.noise_multiplier = clip, noise_multiplier

  def _query(self):
    return SeededGaussianSumQuery(self.clip, self.clip * self.noise_multiplier)

  def apply(self, update, seed):
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
    _positive("clip", clip)
    _non_negative("noise_multiplier", noise_multiplier)
    LaplaceSumQuery(clip, clip * noise_multiplier, norm)  # validates norm
    self.clip, self.noise_multiplier, self.norm = clip, noise_multiplier, norm

  def apply(self, update, seed):
    query = LaplaceSumQuery(self.clip, self.clip * self.noise_multiplier, self.norm)
    return list(run_local_query(query, list(update), seed)[0])

  def dp_event(self, num_params: int):
    """Laplace mechanism with noise multiplier b / (L1 sensitivity): the L1
    sensitivity is the clip for norm 'l1' and sqrt(d) times it for 'l2'."""
    if self.noise_multiplier == 0:
      return None
    scale = math.sqrt(num_params) if self.norm == "l2" else 1.0
    return dp_accounting.LaplaceDpEvent(self.noise_multiplier / scale)


class Sparsification(UpdateDefense):
  name = "sparsification"

  def __init__(self, p: float):
    if not 0 <= p < 1:
      raise ValueError(f"p must lie in [0, 1), got {p}")
    self.p = p

  def apply(self, update, seed=None):
    flat = tf.concat([tf.reshape(u, [-1]) for u in update], 0)
    keep = int(math.ceil((1 - self.p) * flat.shape.num_elements()))
    _, index = tf.math.top_k(tf.abs(flat), k=keep)
    mask = tf.scatter_nd(index[:, None], tf.ones([keep], flat.dtype), tf.shape(flat))
    out, start = [], 0
    for u in update:
      n = u.shape.num_elements()
      out.append(tf.reshape(mask[start:start + n], tf.shape(u)) * u)
      start += n
    return out


DEFENSES = {cls.name: cls for cls in (LocalGaussian, LocalLaplace, ClipOnly,
                                      Sparsification)}

