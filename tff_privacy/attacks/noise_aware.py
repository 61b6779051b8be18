"""Noise-aware Inverting Gradients: the inversion that knows the upload's noise.

A defence that adds Gaussian or Laplace noise to the upload leaves in it the
client's signal plus independent noise of std s_l on every entry of tensor
l. Plain IG's cosine counts every entry alike, so where the levels differ
the noisiest tensors drown the others. `NoiseAwareInvertingGradients`
('ig_noise_aware') multiplies both uploads' tensor l by 1 / s_l before the
cosine (`upload_mask`): the squared terms of tensor l get the weight
1 / s_l^2, the inverse of their noise variance, so every tensor counts by
its signal-to-noise ratio. For one level over the whole upload the weights
are constant and the cosine is IG's: the attack equals IG by construction.

The levels are what each defense declares (`noise_levels` of its
`tff_privacy.disclosure.Disclosure`); the attack names no defense. Those
that declare them here:
* 'ldp_gaussian' (std z C) and 'ldp_laplace' (scale z C, std sqrt(2) z C):
  one public level, from the clip C and multiplier z in the metadata;
* 'ldp_fed': alpha-CLDP's ordinal noise, one level for every entry (a
  two-sided geometric of ratio q = exp(-alpha / 2) on the grid of step
  10^-precision, std sqrt(2 q) / (1 - q) steps before truncation);
* 'fedre' with its gradient noise on the update: tensor l gets Gaussian
  noise of std eta C_l sigma_l k, sigma_l by eq. 9 (or the accountant) of
  the tensor's epsilon_l, k = 2 / |D_k| ('sample', |D_k| the client's
  samples, the record's `num_examples`) or 1. FedRE's 'pixels'
  perturbation (noise on the training images, not the upload) and
  noise_on='steps' (noise inside the local steps, of levels that depend on
  the client's Poisson batches) are refused by its declaration.
Not declared: 'dp_clip' and 'sparsification' (no noise), 'soteria' (prunes,
see 'ig_masked'), 'recupfl' (a deterministic perturbation) and 'dp_fedavg'
(its noise is added to the aggregate, after the server's view that the
store records).

FedRE's levels: with the even split epsilon_l, and so s_l, is public and is
computed from the metadata. The PSI split (eq. 6) depends on the client's
PSI scores, averaged over its own samples inside its region under the
broadcast model. Recomputing them on public data gives another set of
scores (the compact protocol averages just 2 samples), and a wrong split
weights the tensors wrongly with nothing to tell. The upload itself shows
the level instead: tensor l is its clipped signal (norm at most eta C_l,
so a mean square at most (eta C_l)^2 / n_l over its n_l entries) plus the
noise, so s_l^2 ~ mean(u_l^2) - (eta C_l)^2 / n_l, exact in expectation
when the clip binds, as it does for a local epoch's update. The estimate's
relative error is about sqrt(2 / n_l); where the noise is below what the
estimate resolves (the difference under sqrt(2 / n_l) mean(u_l^2)) the
level is taken at that resolution (`estimated_levels`). On an even-split
upload of a kernel of 2,048 entries the estimate lies within 5% of the
public level where the noise dominates, within 15% where it is of the
signal's size (tests/test_noise_aware_attack.py).

FedRE's region (`region_tv_weight`, the `sensitive_region` a defense
declares): FedRE's evaluation attacks with DLG and scores the similarity
of the recovered privacy-sensitive region to the client's (Table 2;
`tff-privacy attack --region run` scores it here); the attack itself has
no term of its own for the region. FedRE puts its
budget where the region's information is, so the tensors that carry the
region are the noisiest ones and the region's pixels are the ones the
weighted match pins least. `region_tv_weight` > 0 adds a second TV term
over the region's pixels (the run's public regions, boxes or the default
box; the metadata carries them): a stronger prior where the data term is
weakest. It is a parameter of this attack, not a class of its own: the
search, the weights and the defences answered are the same.

Measured on the compact leaderboard's protocol (MLP on mnist5k_parity,
round 1 captured, the first 4 captured clients, 300 iterations, seed 0;
mean SSIM, IG -> ig_noise_aware on the same uploads): LDP Gaussian at
clip 1 and z 0.1: 0.147 -> 0.147, z 0.01: 0.677 -> 0.677 (one level: the
same search); FedRE at epsilon 50: 0.035 -> 0.034 (the noise buries every
tensor), epsilon 10000: 0.113 -> 0.151, inside the region 0.168 -> 0.194.
region_tv_weight 1e-3 and 1e-2 at epsilon 10000 leave the region's SSIM
at 0.192 and 0.194 (MSE 0.219 -> 0.203 and 0.205), so it is off by
default. With one level, neither a larger tv_weight (1e-3, 1e-2: 0.675
and 0.681 at z 0.01, 0.144 and 0.145 at z 0.1) nor the Gaussian
likelihood helps: with the clip binding, ||u - C g / ||g||||^2 is
||u||^2 + C^2 - 2 C ||u|| cos(g, u), the cosine again.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import tensorflow as tf

from tff_privacy.attacks.inversion import InvertingGradients, Target
from tff_privacy.params import Param, Params
from tff_privacy.registry import ATTACKS


def estimated_levels(upload: Sequence[np.ndarray], bound: float) -> list[float]:
  """Each tensor's noise std estimated from the upload: mean square less
  the clipped signal's at most bound^2 / n_l, and at least the estimate's
  resolution sqrt(2 / n_l) times the mean square (see the module)."""
  levels = []
  for u in upload:
    n = u.size
    square = float(np.mean(np.square(u, dtype=np.float64)))
    levels.append(math.sqrt(max(square - bound**2 / n, math.sqrt(2 / n) * square)))
  return levels


@ATTACKS.register
class NoiseAwareInvertingGradients(InvertingGradients):
  """Inverting Gradients with each tensor weighted by the inverse of its
  declared noise level, and optionally a TV prior on the declared
  sensitive region (see the module docstring); the search is IG's."""

  name = "ig_noise_aware"
  READS = "noise_levels"
  PARAMETERS = Params(
      *InvertingGradients.PARAMETERS,
      Param("region_tv_weight", float, 0.0, "TV weight over the privacy-"
            "sensitive region the defense declares (FedRE's boxes in the "
            "metadata), beside tv_weight over the whole image; 0: none",
            minimum=0))

  def reads(self) -> tuple[str, ...]:
    """The noise levels, and the region where `region_tv_weight` > 0."""
    return super().reads() + (("sensitive_region",) if self.region_tv_weight > 0
                              else ())

  def upload_mask(self, target: Target) -> list[tf.Tensor]:
    """1 / s_l on tensor l, scaled so that the least noisy tensor weighs 1;
    ones where the upload carries no noise."""
    levels = np.asarray(target.disclosed["noise_levels"], np.float64)
    if not np.all(levels > 0):
      return [tf.ones_like(u) for u in target.upload]
    weights = levels.min() / levels
    return [tf.fill(tf.shape(u), tf.cast(w, u.dtype))
            for u, w in zip(target.upload, weights)]

  def region_prior(self, target: Target) -> list[tf.Tensor]:
    if self.region_tv_weight == 0:
      return []
    return [tf.constant(self.region_tv_weight, tf.float32),
            tf.constant(target.disclosed["sensitive_region"], tf.float32)]
