"""Soteria (Sun et al., CVPR 2021), as RECUP-FL Sec. 3.1 item (4) states it.

A fully connected "defended" layer L maps the representation r in R^l that
the feature extractor computes from input x to the classifier. For each
element r_i the client measures how strongly the input drives it,
iota_i = ||r_i (nabla_x r_i)^-1||, and prunes the p*l elements with the
largest iota. As in Soteria's reference code and RECUP-FL's
phi_sot(grad, p) = M (.) grad, the pruning acts on L's update only: the rows i
of L's kernel gradient (the weights that read a pruned r_i) are zeroed, and
every other tensor of the update is the client's own.

Reading of the details:
* iota_i is ranked through its inverse s_i = sum_b ||nabla_{x_b} r_{b,i}||_2 /
  (r_{b,i} + 0.1), summed over the client's samples b, as Soteria's reference
  code does (0.1 keeps the ratio finite where a ReLU or sigmoid feature is
  close to 0); the largest iota are the smallest s.
* Exactly l - ceil((1 - p) l) rows are pruned, the same rounding as
  `Sparsification`.
* The defended layer defaults to the model's first dense layer whose input
  is a learned representation (`functional.representation_dense_layers`):
  on a CNN the first dense layer, which reads the convolutional features
  (Soteria's choice on LeNet); on an MLP the second, since the first reads
  the flattened image: there s_i = 1 / (x_i + 0.1) ranks the pixels by
  brightness, and at any usual p the pruning removes the rows of all the
  image's bright pixels (a dark background's rows are zero already), so
  strengths would not differ. A layer that reads the input is refused, and
  so is a model without a representation to defend. The Jacobian is taken
  under the broadcast model the client received.
"""

from __future__ import annotations

import functools
import json
from typing import Optional

import numpy as np
import tensorflow as tf

from tff_privacy.defenses.updates import (ClientView, UpdateDefense,
                                          top_fraction_mask)
from tff_privacy.disclosure import Disclosure
from tff_privacy.listing import Listing
from tff_privacy.models import ModelSpec
from tff_privacy.models import functional
from tff_privacy.params import Param, Params
from tff_privacy.registry import DEFENSES


@functools.lru_cache(maxsize=16)
def _kernel_index(spec: str, layer: str) -> int:
  """The index of `layer`'s kernel among the weights of the model of
  `spec` (a `ModelSpec`'s JSON), built once."""
  with tf.Graph().as_default():  # the architecture only, no eager state
    return functional.kernel_index(ModelSpec.from_json(json.loads(spec)).keras(),
                                   layer)


def transmitted_rows(record) -> list[np.ndarray]:
  """1 everywhere but at the all-zero rows of the defended layer's kernel
  (the layer named in the record's metadata): the pruned rows."""
  index = _kernel_index(json.dumps(record.model_spec.to_json(), sort_keys=True),
                        record.metadata["defense"]["layer"])
  mask = [np.ones(np.shape(u), np.float32) for u in record.upload]
  kept = np.any(np.asarray(record.upload[index]) != 0, axis=1, keepdims=True)
  mask[index] = np.broadcast_to(kept, mask[index].shape).astype(np.float32)
  return mask


@DEFENSES.register
class Soteria(UpdateDefense):
  name = "soteria"
  # the pruned rows are the defended kernel's all-zero ones; every other
  # tensor is transmitted in full
  DISCLOSURE = Disclosure(transmitted_mask=transmitted_rows)
  LISTING = Listing("Soteria", "p", 0.8, (0.5, 0.8, 0.95), method="fedsgd",
                    seconds=24.4)
  needs_client_view = True
  needs_model_spec = True
  PARAMETERS = Params(
      Param("p", float, 0.8, "fraction of the defended layer's representation "
            "pruned", minimum=0, maximum=1, exclusive_maximum=True,
            flag="prune-rate"),
      Param("layer", str, None, "dense layer to defend, one whose input is a "
            "learned representation (default: the first such)",
            flag="defended-layer"))

  def __init__(self, model: ModelSpec, p: float = 0.8, layer: Optional[str] = None):
    p, layer = self.PARAMETERS.check(p=p, layer=layer).values()
    with tf.Graph().as_default():  # no eager Keras state before TFF traces
      keras = model.keras()
      dense = functional.dense_layers(keras)
      defensible = functional.representation_dense_layers(keras)
    if not defensible:
      raise ValueError(f"layer: {model.name} has no dense layer that reads a "
                       f"learned representation (dense layers: {dense or 'none'}); "
                       "soteria needs a hidden layer before a dense one")
    layer = layer or defensible[0]
    if layer not in dense:
      raise ValueError(f"layer={layer!r} is not a dense layer of {model.name}; "
                       f"choose one of {defensible}")
    if layer not in defensible:
      raise ValueError(f"layer={layer!r} reads {model.name}'s input, not a "
                       "learned representation (soteria would prune input "
                       f"pixels); choose one of {defensible}")
    self.model, self.p, self.layer = model, p, layer

  def params(self):
    return {"p": self.p, "layer": self.layer}

  def feature_scores(self, weights, x: tf.Tensor, model=None) -> tf.Tensor:
    """s_i = sum_b ||d r_{b,i} / d x_b|| / (r_{b,i} + 0.1) for one batch."""
    model = model or self.model.keras()
    with tf.GradientTape() as tape:
      tape.watch(x)
      _, r = functional.forward(model, weights, x, tap=self.layer)
    jacobian = tape.batch_jacobian(r, x)
    per_input = tf.norm(tf.reshape(jacobian, tf.concat([tf.shape(r), [-1]], 0)),
                        axis=-1)
    return tf.reduce_sum(per_input / (r + 0.1), axis=0)

  def mask(self, client: ClientView, model=None) -> tf.Tensor:
    """1 for the kept elements of r, 0 for the pruned ones."""
    model = model or self.model.keras()
    weights = list(client.weights)
    width = weights[functional.kernel_index(model, self.layer)].shape[0]
    # one sample at a time: the Jacobian of a whole batch holds l backward
    # passes of every sample at once (gigabytes for a CNN representation)
    scores = client.dataset.unbatch().batch(1).reduce(
        tf.zeros([width]),
        lambda total, batch: total + self.feature_scores(weights, batch["x"], model))
    # keep the largest s_i, i.e. prune the largest iota_i
    return top_fraction_mask(scores, 1 - self.p)

  def apply(self, update, seed=None, client: Optional[ClientView] = None):
    if client is None:
      raise ValueError("soteria needs the client's data and model (a ClientView)")
    model = self.model.keras()
    index = functional.kernel_index(model, self.layer)
    out = list(update)
    out[index] = out[index] * self.mask(client, model)[:, None]
    return out
