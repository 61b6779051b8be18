"""A perturbation-aware inversion of FedEM's uploads.

A FedEM client uploads the gradient of t(x + delta), its batch perturbed
within rho_max of x per entry ('linf') or per sample in L2 ('l2'), where t
clips to the data's range (`tff_privacy.algorithms.fedem`). Inverting
Gradients recovers t(x + delta), not x. The run's public configuration (the
record's metadata['protocol']) names rho_max and the norm, and t only moves
x + delta towards x, so the clean x lies within rho_max of what the search
recovers: an attacker may change the reconstruction by up to rho_max to
remove the perturbation, and no further.

FedEM declares that bound (`input_perturbation` of its
`tff_privacy.disclosure.Disclosure`), and this attack reads it: any defense
that perturbs the training inputs within a declared bound is answered.
`DenoisedInvertingGradients` ('ig_denoised') runs IG's search, then
median-filters the reconstruction (each channel over a `median_size` square
window) and projects the filtered image back into that ball around the
reconstruction (each entry within rho_max for 'linf', the sample's L2 ball
for 'l2') and the data's range. On a dark background t clips most of the
perturbation away and leaves scattered bright entries (a quarter of the
background pixels at rho_max 8/255), which a median removes; the projection
undoes what the median takes beyond rho_max (thin strokes, corners).

The denoiser was chosen on FedEM's round-1 uploads in the compact
leaderboard's setting (mnist5k_parity, an MLP of 64, batch 1, 300 IG
iterations), SSIM against the clean image: on 16 clients at rho_max 8/255,
undenoised 0.875, median windows 3/5/7/15 then the projection 0.977/0.990/
0.988/0.993, while total-variation denoising (Chambolle, weights 0.02-1) and
Gaussian blurs never gained more than 0.011; the default, 5, is the smallest
window on that plateau. Confirmed at rho_max 32/255 on the same clients:
0.694 undenoised, 0.860 with a window of 5. On the leaderboard's 4 victims
(other clients of the same uploads) IG reaches 0.887 and 0.703 at 8/255 and
32/255, this attack 0.991 and 0.874. MSE and PSNR barely move: the errors
the median leaves at strokes' edges, each within rho_max, weigh about as
much as the background's it removes, while SSIM, which a bright speck on a
dark background lowers most, rises.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage

from tff_privacy.attacks.inversion import InvertingGradients, Target
from tff_privacy.params import Param, Params
from tff_privacy.registry import ATTACKS


def median_filter(x: np.ndarray, size: int) -> np.ndarray:
  """Each channel of NHWC images `x` median-filtered over a `size` x `size`
  window (edges extended by their nearest pixel)."""
  return ndimage.median_filter(x, size=(1, size, size, 1), mode="nearest")


def project_to_ball(x: np.ndarray, center: np.ndarray, radius: float,
                    norm: str) -> np.ndarray:
  """The nearest point to each sample of `x` (leading axis) within `radius`
  of the same sample of `center`: every entry within `radius` ('linf'), or
  the L2 ball ('l2')."""
  if norm == "linf":
    return np.clip(x, center - radius, center + radius)
  change = x - center
  size = np.sqrt(np.sum(np.square(change), axis=tuple(range(1, x.ndim)),
                        keepdims=True))
  return center + change * np.minimum(1.0, radius / np.maximum(size, 1e-12))


@ATTACKS.register
class DenoisedInvertingGradients(InvertingGradients):
  """Inverting Gradients, then the reconstruction median-filtered within
  FedEM's perturbation bound (see the module docstring)."""

  name = "ig_denoised"
  READS = "input_perturbation"
  PARAMETERS = Params(
      *InvertingGradients.PARAMETERS,
      Param("median_size", int, 5, "side of the median filter's window that "
            "removes the input perturbation from the reconstruction (1: none)",
            minimum=1))

  def denoise(self, target: Target, x: np.ndarray) -> np.ndarray:
    """`x` median-filtered, then moved back within the perturbation's
    bound (rho_max in its norm, as the defense declares it) of `x`."""
    return project_to_ball(median_filter(x, self.median_size), x,
                           *target.disclosed["input_perturbation"])

  def _reconstruction(self, target, x, labels, objective, snapshots=None):
    return super()._reconstruction(
        target, self.denoise(target, x), labels, objective,
        {k: self.denoise(target, v) for k, v in (snapshots or {}).items()})
