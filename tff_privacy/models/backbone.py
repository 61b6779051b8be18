"""A small pre-trained residual backbone, frozen, for HyperFL-LPM.

HyperFL-LPM (Guo et al., Sec. 3.3) fine-tunes a large pre-trained model
through adapters. Pre-trained ImageNet weights cannot be downloaded here, so
the backbone is this module's small ResNet, whose weights come from a file:

* one the user supplies (`--model-kwargs '{"backbone_weights": "b.npz"}'`),
  e.g. written by `python -m tff_privacy.models.backbone --dataset
  fashion_mnist --out b.npz` on a machine that has that data set;
* by default, one pre-trained here on a bundled data set that is not the
  federated task's: scikit-learn's 8x8 digits, resized to the task's input
  shape (see `default_weights`). It is cached after the first use
  (`tff_privacy.pretrained`).

Architecture (`Backbone`): a 3x3 stem convolution, then one basic residual
block per stage (two 3x3 convolutions, ReLU, an identity shortcut or a 1x1
projection when the shape changes; stride 2 from the second stage on), and a
global average pool. Pre-training puts batch normalisation after each
convolution; its moving statistics are then folded into the convolutions,
so that the frozen network is a fixed function of its input (a ResNet in
inference mode). Stage j is the stem (first stage only) and block
j; HyperFL-LPM's adapters follow each stage.

The weights are numpy arrays applied as constants (`Backbone.stage`): the
frozen part has no variables, travels through no TFF computation as state,
and is differentiable with respect to its input for attacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from tff_privacy import pretrained

_FORMAT = "tff_privacy.backbone/2"


@dataclasses.dataclass(frozen=True)
class Backbone:
  """The backbone's architecture for inputs with `channels` channels.

  Attributes:
    channels: input channels.
    widths: output channels of each stage.
  """

  channels: int
  widths: tuple[int, ...] = (16, 32, 64)

  def __post_init__(self):
    try:
      widths = tuple(int(w) for w in self.widths)
    except (TypeError, ValueError):
      widths = ()
    if not widths or min(widths) < 1:
      raise ValueError("widths must be a list of positive channel counts, got "
                       f"{self.widths!r}")
    object.__setattr__(self, "widths", widths)

  @property
  def shapes(self) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight, in order."""
    out, c_in = {}, self.channels
    for j, width in enumerate(self.widths, start=1):
      if j == 1:
        out["stem/kernel"], out["stem/bias"] = (3, 3, c_in, width), (width,)
        c_in = width
      out[f"block{j}/conv1/kernel"] = (3, 3, c_in, width)
      out[f"block{j}/conv1/bias"] = (width,)
      out[f"block{j}/conv2/kernel"] = (3, 3, width, width)
      out[f"block{j}/conv2/bias"] = (width,)
      if self._stride(j) != 1 or c_in != width:
        out[f"block{j}/shortcut/kernel"] = (1, 1, c_in, width)
        out[f"block{j}/shortcut/bias"] = (width,)
      c_in = width
    return out

  @staticmethod
  def _stride(stage: int) -> int:
    return 1 if stage == 1 else 2

  def initial_weights(self, seed: int) -> dict[str, np.ndarray]:
    """He-normal kernels, zero biases."""
    return pretrained.he_normal(self.shapes, np.random.default_rng([seed, 7]))

  def convolutions(self) -> list[str]:
    """The convolutions' names ('stem', 'block1/conv1', ...)."""
    return [k[:-len("/kernel")] for k in self.shapes if k.endswith("/kernel")]

  def stage(self, weights, j: int, h: tf.Tensor, norm=None) -> tf.Tensor:
    """Stage `j` (1-based) of the backbone at `weights` (name -> array or
    tensor) on NHWC `h`; `norm(name, y)`, if given, follows each
    convolution (batch normalisation in pre-training)."""
    def conv(name, x, stride=1):
      y = tf.nn.conv2d(x, weights[f"{name}/kernel"], stride, "SAME") + \
          weights[f"{name}/bias"]
      return y if norm is None else norm(name, y)

    if j == 1:
      h = tf.nn.relu(conv("stem", h))
    stride = self._stride(j)
    y = tf.nn.relu(conv(f"block{j}/conv1", h, stride))
    y = conv(f"block{j}/conv2", y)
    shortcut = (conv(f"block{j}/shortcut", h, stride)
                if f"block{j}/shortcut/kernel" in weights else h)
    return tf.nn.relu(y + shortcut)

  def features(self, weights, h: tf.Tensor, norm=None) -> tf.Tensor:
    """Every stage, then the global average pool."""
    for j in range(1, len(self.widths) + 1):
      h = self.stage(weights, j, h, norm)
    return tf.reduce_mean(h, axis=[1, 2])

  def check(self, weights: dict[str, np.ndarray], origin: str) -> None:
    """Raises `ValueError` naming `origin` unless `weights` has exactly this
    architecture's names and shapes."""
    pretrained.check_shapes(weights, self.shapes, origin,
                            f"a backbone of widths {self.widths} for "
                            f"{self.channels}-channel inputs")


def load(path: str, backbone: Backbone) -> dict[str, np.ndarray]:
  """The backbone weights in file `path` (`tff_privacy.pretrained` format),
  checked against `backbone`; `ValueError` naming the file otherwise."""
  weights = pretrained.load(path, "backbone_weights")
  backbone.check(weights, f"backbone_weights={path!r}")
  return weights


class _BatchNorm:
  """Batch normalisation after each convolution during pre-training, with
  batch statistics; their moving averages (momentum 0.9) are folded into
  the convolutions at the end (`fold`), so that the frozen backbone is
  plain convolutions."""

  def __init__(self, backbone: Backbone, epsilon: float = 1e-5):
    self.epsilon = epsilon
    width = {name: backbone.shapes[f"{name}/bias"][0]
             for name in backbone.convolutions()}
    self.gamma = {n: tf.Variable(tf.ones(w)) for n, w in width.items()}
    self.beta = {n: tf.Variable(tf.zeros(w)) for n, w in width.items()}
    self.mean = {n: tf.Variable(tf.zeros(w), trainable=False)
                 for n, w in width.items()}
    self.var = {n: tf.Variable(tf.ones(w), trainable=False)
                for n, w in width.items()}

  @property
  def trainable(self) -> list[tf.Variable]:
    return list(self.gamma.values()) + list(self.beta.values())

  def __call__(self, name: str, y: tf.Tensor) -> tf.Tensor:
    mean, var = tf.nn.moments(y, axes=[0, 1, 2])
    self.mean[name].assign(0.9 * self.mean[name] + 0.1 * mean)
    self.var[name].assign(0.9 * self.var[name] + 0.1 * var)
    return tf.nn.batch_normalization(y, mean, var, self.beta[name],
                                     self.gamma[name], self.epsilon)

  def fold(self, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The convolutions with the normalisation (moving averages) folded in."""
    out = dict(weights)
    for name in self.gamma:
      scale = (self.gamma[name] / tf.sqrt(self.var[name] + self.epsilon)).numpy()
      out[f"{name}/kernel"] = weights[f"{name}/kernel"] * scale
      out[f"{name}/bias"] = ((weights[f"{name}/bias"] - self.mean[name].numpy())
                             * scale + self.beta[name].numpy())
    return {k: v.astype(np.float32) for k, v in out.items()}


def pretrain(backbone: Backbone, input_shape: Sequence[int], dataset: str,
             epochs: int, seed: int = 0, progress: bool = False
             ) -> tuple[dict[str, np.ndarray], dict]:
  """Trains `backbone`, with batch normalisation after each convolution
  and a linear head, on `dataset`'s training split resized to
  `input_shape` (channels repeated or averaged), with Adam (lr 1e-3, batch
  64); returns (the backbone's weights with the normalisation folded in,
  metadata with the folded network's test accuracy). Eager; deterministic
  for a seed."""
  from tff_privacy.data import sources
  source = sources.load_source(dataset)
  x_train = pretrained.resized(source.x_train, input_shape)
  x_test = pretrained.resized(source.x_test, input_shape)
  rng = np.random.default_rng([seed, 8])
  weights = {k: tf.Variable(v) for k, v in backbone.initial_weights(seed).items()}
  norm = _BatchNorm(backbone)
  bound = 1.0 / np.sqrt(backbone.widths[-1])
  head = [tf.Variable(rng.uniform(-bound, bound, (backbone.widths[-1],
                                                  source.num_classes))
                      .astype(np.float32)),
          tf.Variable(np.zeros(source.num_classes, np.float32))]
  variables = list(weights.values()) + norm.trainable + head
  optimizer = tf.keras.optimizers.Adam(1e-3)

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      logits = tf.matmul(backbone.features(weights, x, norm), head[0]) + head[1]
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
          y, logits))
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss

  for epoch in range(epochs):
    order = rng.permutation(len(x_train))
    for start in range(0, len(order), 64):
      idx = order[start:start + 64]
      loss = step(x_train[idx], source.y_train[idx])
    if progress:
      print(f"pretrain epoch {epoch + 1}/{epochs}: loss {float(loss):.4f}",
            file=sys.stderr)
  folded = norm.fold({k: v.numpy() for k, v in weights.items()})
  predictions = np.concatenate([
      np.argmax((tf.matmul(backbone.features(folded, x_test[i:i + 256]),
                           head[0]) + head[1]).numpy(), 1)
      for i in range(0, len(x_test), 256)])
  meta = {"dataset": dataset, "epochs": epochs, "seed": seed,
          "input_shape": list(input_shape), "widths": list(backbone.widths),
          "test_accuracy": float(np.mean(predictions == source.y_test))}
  return folded, meta


def _default_key(backbone: Backbone, input_shape, dataset: str,
                 epochs: int) -> dict:
  return {"format": _FORMAT, "input_shape": [int(d) for d in input_shape],
          "widths": list(backbone.widths), "dataset": dataset, "epochs": epochs}


def default_path(backbone: Backbone, input_shape, dataset: str = "digits",
                 epochs: int = 10) -> str:
  """Where `default_weights` caches the default backbone."""
  return pretrained.cache_path(
      "backbones", _default_key(backbone, input_shape, dataset, epochs))


def default_weights(backbone: Backbone, input_shape, dataset: str = "digits",
                    epochs: int = 10) -> dict[str, np.ndarray]:
  """The default backbone: pre-trained on bundled `dataset` (seed 0) on
  first use, then read from the cache (`tff_privacy.pretrained.cached`)."""
  pretrained.check_dataset("pretrain_dataset", dataset, None)
  weights = pretrained.cached(
      "backbones", _default_key(backbone, input_shape, dataset, epochs),
      lambda: pretrain(backbone, input_shape, dataset, epochs))
  backbone.check(weights, "the cached default backbone")
  return weights


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Pre-trains a backbone and writes it to a weights file."""
  from tff_privacy.data import sources
  parser = argparse.ArgumentParser(
      prog="python -m tff_privacy.models.backbone",
      description="pre-train the HyperFL-LPM backbone and write its weights")
  parser.add_argument("--dataset", required=True, choices=[d for d in sources.DATASETS
                               if d not in sources.SEGMENTATION_DATASETS])
  parser.add_argument("--input-shape", default="28,28,1",
                      help="the federated task's input shape, e.g. 32,32,3")
  parser.add_argument("--widths", default="16,32,64")
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", required=True, help="the .npz file to write")
  args = parser.parse_args(argv)
  try:
    input_shape = tuple(int(v) for v in args.input_shape.split(","))
    widths = tuple(int(v) for v in args.widths.split(","))
  except ValueError:
    parser.error("--input-shape and --widths take integers like 28,28,1")
  if len(input_shape) != 3 or args.epochs < 1:
    parser.error("--input-shape takes height,width,channels; --epochs >= 1")
  try:
    backbone = Backbone(input_shape[-1], widths)
  except ValueError as e:
    parser.error(f"--widths: {e}")
  weights, meta = pretrain(backbone, input_shape, args.dataset, args.epochs,
                           args.seed, progress=True)
  pretrained.save(args.out, weights, {"format": _FORMAT, **meta})
  print(json.dumps({"out": args.out, **meta}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
