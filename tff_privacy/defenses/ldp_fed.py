"""LDP-Fed (Truex et al., EdgeSys 2020): condensed local DP on every upload.

LDP-Fed's LDP module perturbs each uploaded parameter with alpha-CLDP's
ordinal mechanism (Gursoy et al. 2019), an exponential mechanism over a
discretised range, after its selection module has chosen which parameters a
client shares. Reading of the published mechanism, per client and round:

1. selection: a uniformly random `fraction` of the update's entries is shared
   (LDP-Fed's random k-parameter selection with k = fraction * d); the others
   are sent as 0. Default 1.0: every entry is shared.
2. range and precision: each shared value is clipped to [-c, c] and expressed
   in units of 10^-precision, so the output universe is the integers
   U = {-c 10^rho, ..., c 10^rho}.
3. ordinal alpha-CLDP: value v (in those units, not rounded) is replaced by
   y in U drawn with Pr[y] proportional to exp(-alpha |v - y| / 2), and
   y 10^-rho is uploaded.

Privacy: alpha-CLDP bounds Pr[y | v] / Pr[y | v'] by exp(alpha |v - v'|);
since |v - v'| <= 2 c 10^rho, each shared entry is pure
(2 alpha c 10^rho)-LDP, and a round of k shared entries costs k times that
(`pure_epsilon`; the basic composition theorem, as LDP-Fed composes).
Sampling is a categorical draw over U per entry (memory: entries x |U|).
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tff_privacy.defenses.updates import (UpdateDefense, flatten,
                                          top_fraction_mask, unflatten)
from tff_privacy.disclosure import Disclosure
from tff_privacy.listing import Listing
from tff_privacy.params import Param, Params
from tff_privacy.registry import DEFENSES


def noise_std(alpha: float, precision: int) -> float:
  """alpha-CLDP's noise std before truncation to the clip's range: a
  two-sided geometric of ratio q = exp(-alpha / 2) on the grid of step
  10^-precision has std sqrt(2 q) / (1 - q) steps."""
  q = math.exp(-alpha / 2)
  return math.sqrt(2 * q) / (1 - q) * 10.0 ** -precision


@DEFENSES.register
class LDPFed(UpdateDefense):
  name = "ldp_fed"
  # one level on every entry, from the public alpha and precision
  DISCLOSURE = Disclosure(noise_levels=lambda record: [noise_std(
      record.metadata["defense"]["alpha"], record.metadata["defense"]["precision"])
  ] * len(record.upload))
  LISTING = Listing("LDP-Fed", "alpha", 1.0, (1.0, 10.0, 100.0), method="fedsgd",
                    seconds=29.3)
  PARAMETERS = Params(
      Param("alpha", float, 1.0, "alpha of alpha-CLDP", minimum=0,
            exclusive_minimum=True, flag="cldp-alpha"),
      Param("clip", float, 0.05, "each entry is clipped to [-clip, clip]",
            minimum=0, exclusive_minimum=True),
      Param("precision", int, 3, "decimal digits of the output grid", minimum=0,
            maximum=6, flag="cldp-precision"),
      Param("fraction", float, 1.0, "fraction of entries each client shares",
            minimum=0, maximum=1, exclusive_minimum=True, flag="share-fraction"))
  dp_relation = ("local DP: any two uploads of one client are neighbours (each "
                 "shared entry ranges over [-clip, clip], width 2 clip; the "
                 "shared entries compose)")

  def __init__(self, alpha: float = 1.0, clip: float = 0.05, precision: int = 3,
               fraction: float = 1.0):
    alpha, clip, precision, fraction = self.PARAMETERS.check(
        alpha=alpha, clip=clip, precision=precision, fraction=fraction).values()
    if clip * 10 ** precision < 1:
      raise ValueError(f"clip * 10**precision must be >= 1 so that the range "
                       f"holds more than one value; got clip={clip}, "
                       f"precision={precision}")
    self.alpha, self.clip, self.precision = alpha, clip, precision
    self.fraction = fraction

  @property
  def _half_width(self) -> int:
    return _half_width(self.clip, self.precision)

  def _perturb(self, values: tf.Tensor, seed) -> tf.Tensor:
    """Ordinal alpha-CLDP of a flat vector of values."""
    unit = 10.0 ** -self.precision
    scaled = tf.clip_by_value(values, -self.clip, self.clip) / unit
    universe = tf.range(-self._half_width, self._half_width + 1, dtype=tf.float32)
    logits = -self.alpha * tf.abs(scaled[:, None] - universe[None, :]) / 2
    index = tf.random.stateless_categorical(logits, 1, seed)[:, 0]
    return tf.gather(universe, index) * unit

  def apply(self, update, seed, client=None):
    noise_seed, select_seed = tf.unstack(
        tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 2))
    flat = flatten(update)
    noised = self._perturb(flat, noise_seed)
    if self.fraction < 1:
      shared = top_fraction_mask(
          tf.random.stateless_uniform(tf.shape(flat), select_seed), self.fraction)
      noised = noised * shared
    return unflatten(noised, update)

  def canary(self, direction):
    """Every entry at the edge of its range, +-clip, with `direction`'s
    signs."""
    return self.clip * np.where(direction < 0, -1.0, 1.0)

  def pure_epsilon(self, num_params: int) -> float:
    shared = math.ceil(self.fraction * num_params)
    return shared * self.alpha * 2 * self._half_width

  @classmethod
  def encoded_bytes(cls, params, upload):
    """Each entry as its index in the output grid U, ceil(log2 |U|) bits
    (the grid's unit and range are public parameters: no scale is sent);
    with `fraction` < 1 the smaller of that for every entry (unshared ones
    as 0) and (int32 flat index, code) for the shared entries only."""
    entries = sum(int(np.size(u)) for u in upload)
    bits = math.ceil(math.log2(2 * _half_width(params["clip"], params["precision"]) + 1))
    shared = math.ceil(params["fraction"] * entries)
    sparse = 4 * shared + math.ceil(shared * bits / 8)
    return min(math.ceil(entries * bits / 8), sparse)


def _half_width(clip: float, precision: int) -> int:
  """c 10^rho: the output grid's largest value, in its units."""
  return int(round(clip * 10 ** precision))
