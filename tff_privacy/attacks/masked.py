"""Masked Inverting Gradients: the inversion that knows which coordinates
an upload transmits.

A defense that zeroes part of the upload (sparsification keeps the largest
entries, Soteria prunes whole rows of a layer's kernel) declares the
coordinates it transmits (`tff_privacy.disclosure.Disclosure.
transmitted_mask`). `MaskedInvertingGradients` ('ig_masked') matches only
those: both uploads are multiplied by the mask before the cosine. Plain IG
instead asks the dummy's upload to be zero wherever the defense zeroed the
client's, which no image near the client's satisfies. The exact zeros also
drop the coordinates that were zero before the defense: where a dense first
layer reads the pixels, those of a dark background, whose zeros pin the
background for plain IG. On such models a mildly sparsified upload can be
matched better by plain IG, so a judge takes the worse of the two.
"""

from __future__ import annotations

import tensorflow as tf

from tff_privacy.attacks.inversion import InvertingGradients, Target
from tff_privacy.registry import ATTACKS


@ATTACKS.register
class MaskedInvertingGradients(InvertingGradients):
  """Inverting Gradients on the coordinates the defense transmits (see the
  module docstring); the search is IG's."""

  name = "ig_masked"
  READS = "transmitted_mask"

  def upload_mask(self, target: Target) -> list[tf.Tensor]:
    """The transmitted coordinates, as the defense declares them."""
    return [tf.cast(m, u.dtype) for m, u in
            zip(target.disclosed["transmitted_mask"], target.upload)]
