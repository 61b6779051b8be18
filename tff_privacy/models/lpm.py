"""The HyperFL-LPM model: a frozen pre-trained backbone with adapters.

`lpm_resnet` stacks the stages of `tff_privacy.models.backbone.Backbone`
(frozen, applied as constants by `FrozenStage`), an `Adapter` after each
stage, a global average pool and the classifier `fc`. Its trainable tensors
are the adapters' and the classifier's, so HyperFL's hypernetwork, built for
the model as usual, generates exactly the adapters (Guo et al., Sec. 3.3);
with `adapters=False` only the classifier is trainable (a fixed feature
extractor, Table 2's first baselines).

The adapter is the HyperFL authors' ViT adapter (a Houlsby et al. 2019
bottleneck) on feature maps, after each stage:

```text
y = x + (1 + g) * LN(U ReLU(D x + d) + u) + b,
```

D (c -> c / `adapter_reduction`) and U (back to c) 1x1 convolutions, LN the
normalisation over channels at each pixel (no statistics kept), g and b its
per-channel scale and shift. The scale is parametrised as an offset from 1
(LayerNorm's initial weight), so that every tensor starts near 0 in a fresh
hypernetwork's output. (The authors' ResNet adapter instead wraps a 1x1
convolution in two batch normalisations, which need batch statistics that a
frozen backbone applied as constants does not keep; in their code its
generated weights are never loaded, their names not matching the model's.)
A trainable adapter starts as PyTorch's layers would: D, d, U, u ~
U(-1/sqrt(fan_in), 1/sqrt(fan_in)), g = b = 0.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

from tff_privacy import pretrained
from tff_privacy.models import backbone as backbone_lib

LPM_MODELS = ("lpm_resnet",)  # builders of adapter models on a frozen backbone
ADAPTER_TENSORS = ("down/kernel", "down/bias", "up/kernel", "up/bias",
                   "norm/scale", "norm/shift")


def adapter_forward(weights: Sequence[tf.Tensor], h: tf.Tensor) -> tf.Tensor:
  """The adapter of the module docstring at `weights` (in `ADAPTER_TENSORS`
  order) on NHWC `h`."""
  down, down_bias, up, up_bias, scale, shift = weights
  z = tf.nn.relu(tf.nn.conv2d(h, down, 1, "VALID") + down_bias)
  z = tf.nn.conv2d(z, up, 1, "VALID") + up_bias
  mean, var = tf.nn.moments(z, axes=[-1], keepdims=True)
  return h + (1.0 + scale) * (z - mean) * tf.math.rsqrt(var + 1e-5) + shift


class Adapter(tf.keras.layers.Layer):
  """A trainable adapter (see the module docstring) on a `channels`-channel
  feature map, with a bottleneck of `channels // reduction` (at least 1)."""

  def __init__(self, channels: int, reduction: int, seed: int, **kwargs):
    super().__init__(**kwargs)
    self.channels, self.seed = channels, seed
    self.bottleneck = max(1, channels // reduction)

  def build(self, input_shape):
    c, r = self.channels, self.bottleneck
    shapes = {"down/kernel": (1, 1, c, r), "down/bias": (r,),
              "up/kernel": (1, 1, r, c), "up/bias": (c,),
              "norm/scale": (c,), "norm/shift": (c,)}
    self._tensors = []
    for i, name in enumerate(ADAPTER_TENSORS):
      fan_in = c if name.startswith("down") else r
      bound = 1.0 / np.sqrt(fan_in)
      init = ("zeros" if name.startswith("norm") else
              tf.keras.initializers.RandomUniform(-bound, bound,
                                                  seed=self.seed * 10 + i))
      self._tensors.append(self.add_weight(
          name=name.replace("/", "_"), shape=shapes[name], initializer=init,
          trainable=True))
    super().build(input_shape)

  def call(self, h):
    return adapter_forward(self._tensors, h)

  def call_with_weights(self, weights: Sequence[tf.Tensor], h: tf.Tensor):
    """The layer at given weights (the functional forward pass)."""
    return adapter_forward(weights, h)


class FrozenStage(tf.keras.layers.Layer):
  """Stage `stage` of a frozen `backbone_lib.Backbone`: its weights are
  constants, so the layer has no variables."""

  def __init__(self, backbone: backbone_lib.Backbone,
               weights: dict[str, np.ndarray], stage: int, **kwargs):
    super().__init__(trainable=False, **kwargs)
    self.backbone, self.stage = backbone, stage
    prefixes = ("stem/",) * (stage == 1) + (f"block{stage}/",)
    self._frozen = {k: v for k, v in weights.items() if k.startswith(prefixes)}

  def call(self, h):
    constants = {k: tf.constant(v) for k, v in self._frozen.items()}
    return self.backbone.stage(constants, self.stage, h)


def frozen_weights(backbone: backbone_lib.Backbone, input_shape,
                   path: Optional[str], pretrain_dataset: str,
                   pretrain_epochs: int,
                   fingerprint: Optional[str] = None) -> dict[str, np.ndarray]:
  """The frozen weights: from `path`, or the cached default; with
  `fingerprint`, refused (`pretrained.FingerprintMismatch`, naming the
  file) unless they are the weights it identifies."""
  if path is not None:
    weights, origin = backbone_lib.load(path, backbone), f"backbone_weights={path!r}"
  else:
    if pretrain_epochs < 1:
      raise ValueError(f"pretrain_epochs must be >= 1, got {pretrain_epochs}")
    weights = backbone_lib.default_weights(backbone, input_shape, pretrain_dataset,
                                           pretrain_epochs)
    origin = "the default backbone " + backbone_lib.default_path(
        backbone, input_shape, pretrain_dataset, pretrain_epochs)
  pretrained.check_fingerprint(weights, fingerprint, origin)
  return weights


def pinned_kwargs(input_shape, kwargs: dict[str, Any]) -> dict[str, Any]:
  """`lpm_resnet`'s keyword `kwargs` with `backbone_fingerprint` set to the
  fingerprint of the backbone they select (the file's, or the cached
  default's), so that a model built from them later or elsewhere refuses
  another backbone."""
  bound = inspect.signature(lpm_resnet).bind(input_shape, 2, **kwargs)
  bound.apply_defaults()
  args = bound.arguments
  backbone = backbone_lib.Backbone(int(input_shape[-1]), tuple(args["widths"]))
  weights = frozen_weights(backbone, input_shape, args["backbone_weights"],
                           args["pretrain_dataset"], args["pretrain_epochs"],
                           args["backbone_fingerprint"])
  return {**kwargs, "backbone_fingerprint": pretrained.fingerprint(weights)}


def lpm_resnet(input_shape, num_classes, seed: int = 0,
               backbone_weights: Optional[str] = None,
               widths: tuple[int, ...] = (16, 32, 64), adapters: bool = True,
               adapter_reduction: int = 4, pretrain_dataset: str = "digits",
               pretrain_epochs: int = 10,
               backbone_fingerprint: Optional[str] = None) -> tf.keras.Model:
  """HyperFL-LPM's client model (see the module docstring).

  Args:
    input_shape: (height, width, channels) of the inputs.
    num_classes: outputs of the classifier `fc`.
    seed: fixes the adapters' and the classifier's initial weights (not the
      backbone's, which are pre-trained).
    backbone_weights: a weights file (`tff_privacy.pretrained` format, e.g.
      from `python -m tff_privacy.models.backbone`) of a backbone of these
      `widths`; None for the default backbone.
    widths: the backbone's stage widths.
    adapters: an adapter after each stage (adapter fine-tuning, HyperFL-LPM)
      or none (a fixed feature extractor).
    adapter_reduction: channels over bottleneck width (the authors' ViT
      adapters use 16 on 384 channels; 4 suits these narrow stages).
    pretrain_dataset: the bundled data set the default backbone is
      pre-trained on (it must not be the federated task's; the runner
      checks).
    pretrain_epochs: the epochs of that pre-training.
    backbone_fingerprint: the `tff_privacy.pretrained.fingerprint` of the
      backbone a run or record was made with (`pinned_kwargs`; runs record
      it in their config.json and update store); other weights are refused.

  Returns:
    An uncompiled Keras model producing logits whose trainable variables
    are the adapters' (in stage order, `ADAPTER_TENSORS` each) and `fc`'s.

  Raises:
    ValueError: for a weights file that is missing, unreadable, of another
      architecture or fingerprint, or a bad width, reduction or pre-training
      setting.
  """
  if adapter_reduction < 1:
    raise ValueError(f"adapter_reduction must be >= 1, got {adapter_reduction}")
  backbone = backbone_lib.Backbone(int(input_shape[-1]), tuple(widths))
  weights = frozen_weights(backbone, input_shape, backbone_weights,
                           pretrain_dataset, pretrain_epochs, backbone_fingerprint)
  layers = [tf.keras.layers.InputLayer(input_shape)]
  for j, width in enumerate(backbone.widths, start=1):
    layers.append(FrozenStage(backbone, weights, j, name=f"stage{j}"))
    if adapters:
      layers.append(Adapter(width, adapter_reduction, seed * 1000 + j,
                            name=f"adapter{j}"))
  bound = 1.0 / np.sqrt(backbone.widths[-1])
  layers += [tf.keras.layers.GlobalAveragePooling2D(name="pool"),
             tf.keras.layers.Dense(
                 num_classes, name="fc",
                 kernel_initializer=tf.keras.initializers.RandomUniform(
                     -bound, bound, seed=seed * 1000),
                 bias_initializer=tf.keras.initializers.RandomUniform(
                     -bound, bound, seed=seed * 1000 + 1))]
  return tf.keras.Sequential(layers, name="lpm_resnet")
