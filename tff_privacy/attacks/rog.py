"""ROG (Yue et al. 2023, "Gradient Obfuscation Gives a False Sense of
Security in Federated Learning"): gradient matching in a low-resolution
image space, then a learned image prior.

The search, as in the authors' code: the unknown is a low-resolution image
z of 1/`scale_factor` the input's height and width (their 4), started from
U(0, 1) (on normalised data, uniform in the model's input range,
`Target.bounds`; the prior below then sees the images in pixel units); the
model sees its bicubic upsampling, unclamped; the objective is the
squared L2 distance between the simulated and the captured upload (for
FedAvg deltas, the client's local steps simulated, as their multi-step
attack); Adam at `lr` 0.05, cosine-annealed to a tenth of it over
`iterations` 100. Labels are recovered analytically from the upload (the
authors' code hands the attack the true labels; an honest-but-curious
server has none). The best iterate by the objective is kept.

The prior: the authors post-process the upsampled reconstruction with a
U-Net generator and a super-resolution network trained on ImageNet (their
weights are a download, RGB and 128x128). Here the prior is a small residual
convolutional denoiser (`ImagePrior`, DnCNN-shaped: `depth` 3x3
convolutions of `width` channels with ReLU, predicting the correction added
to its input), trained on bundled data that is not the attacked task's
(`prior_dataset`, scikit-learn's digits by default; `--prior-weights` gives
another) to undo exactly this degradation: images resized to the task's
input shape, zoomed out and shifted at random, then bicubic-downsampled by
`scale_factor`, upsampled back and noised (sigma up to 0.1), mapped to the
originals. Trained on first use and cached (`tff_privacy.pretrained`).
`prior=False` reports the upsampled search result itself.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from tff_privacy import pretrained
from tff_privacy.data import normalization
from tff_privacy.attacks.inversion import (GradientInversion, Target,
                                           _MAX_EXAMPLES, _RESTARTS, _iterations,
                                           adam_step, l2_distance,
                                           search_steps)
from tff_privacy.params import Param, Params
from tff_privacy.registry import ATTACKS

_FORMAT = "tff_privacy.rog_prior/1"


def cosine_learning_rate(step, iterations: int, lr: float,
                         floor: float = 0.1):
  """The authors' schedule: `lr` at step 0, cosine-annealed to
  `floor * lr` at step `iterations` (0-based steps)."""
  low = floor * lr
  progress = tf.cast(step, tf.float32) / iterations
  return low + (lr - low) * 0.5 * (1.0 + tf.cos(math.pi * progress))


def low_resolution(input_shape: Sequence[int], scale_factor: int) -> tuple[int, int]:
  """(height, width) of the search space: the input's over `scale_factor`,
  rounded up."""
  return (math.ceil(input_shape[0] / scale_factor),
          math.ceil(input_shape[1] / scale_factor))


def upsample(z: tf.Tensor, input_shape: Sequence[int]) -> tf.Tensor:
  """Bicubic upsampling of NHWC `z` to the input's height and width."""
  return tf.image.resize(z, input_shape[:2], method="bicubic")


@dataclasses.dataclass(frozen=True)
class ImagePrior:
  """The residual denoiser of the module docstring for `channels`-channel
  images."""

  channels: int
  width: int = 32
  depth: int = 5

  @property
  def shapes(self) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight, in order."""
    out, c_in = {}, self.channels
    for i in range(1, self.depth + 1):
      c_out = self.channels if i == self.depth else self.width
      out[f"conv{i}/kernel"], out[f"conv{i}/bias"] = (3, 3, c_in, c_out), (c_out,)
      c_in = c_out
    return out

  def initial_weights(self, seed: int) -> dict[str, np.ndarray]:
    """He-normal kernels (the last one scaled by 0.1), zero biases."""
    rng = np.random.default_rng([seed, 9])
    out = {}
    for name, shape in self.shapes.items():
      std = 0.0 if name.endswith("bias") else np.sqrt(2.0 / np.prod(shape[:-1]))
      out[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    out[f"conv{self.depth}/kernel"] *= 0.1  # start near the identity map
    return out

  def __call__(self, weights, x: tf.Tensor) -> tf.Tensor:
    """The prior at `weights` on NHWC `x`: x plus its correction."""
    h = x
    for i in range(1, self.depth + 1):
      h = tf.nn.conv2d(h, weights[f"conv{i}/kernel"], 1, "SAME") + \
          weights[f"conv{i}/bias"]
      if i < self.depth:
        h = tf.nn.relu(h)
    return x + h

  def check(self, weights: dict[str, np.ndarray], origin: str) -> None:
    """Raises `ValueError` naming `origin` unless `weights` has exactly
    this architecture's names and shapes."""
    pretrained.check_shapes(weights, self.shapes, origin,
                            f"a ROG prior for {self.channels}-channel images "
                            f"(width {self.width}, depth {self.depth})")


def _zoomed(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """Each image shrunk by a random factor in [0.6, 1] and pasted at a random
  place on a background of its own minimum."""
  n, height, width, _ = images.shape
  out = np.empty_like(images)
  for i in range(n):
    scale = rng.uniform(0.6, 1.0)
    h, w = max(1, round(height * scale)), max(1, round(width * scale))
    small = tf.image.resize(images[i:i + 1], (h, w)).numpy()[0]
    out[i] = images[i].min()
    top, left = rng.integers(0, height - h + 1), rng.integers(0, width - w + 1)
    out[i, top:top + h, left:left + w] = small
  return out


def degrade(x: tf.Tensor, scale_factor: int, noise: tf.Tensor) -> tf.Tensor:
  """What ROG's search returns at best: `x` bicubic-downsampled by
  `scale_factor`, upsampled back, plus `noise`."""
  shape = tuple(x.shape[1:])
  small = tf.image.resize(x, low_resolution(shape, scale_factor), method="bicubic",
                          antialias=True)
  return upsample(small, shape) + noise


def train_prior(prior: ImagePrior, input_shape: Sequence[int], dataset: str,
                scale_factor: int, epochs: int, seed: int = 0
                ) -> tuple[dict[str, np.ndarray], dict]:
  """Trains `prior` (Adam, lr 1e-3, batch 64, mean squared error) to undo
  `degrade` on `dataset`'s training images, three zoomed copies of each;
  returns (weights, metadata with the test split's PSNR before and after)."""
  from tff_privacy.data import sources
  from tff_privacy.metrics.image import image_scores
  source = sources.load_source(dataset)
  rng = np.random.default_rng([seed, 10])
  train = pretrained.resized(source.x_train, input_shape)
  train = np.concatenate([_zoomed(train, rng) for _ in range(3)])
  test = _zoomed(pretrained.resized(source.x_test, input_shape), rng)
  weights = {k: tf.Variable(v) for k, v in prior.initial_weights(seed).items()}
  variables = list(weights.values())
  optimizer = tf.keras.optimizers.Adam(1e-3)

  @tf.function
  def step(x, noise):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(
          prior(weights, degrade(x, scale_factor, noise)) - x))
    optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss

  def noise_for(x):
    sigma = rng.uniform(0, 0.1, (len(x), 1, 1, 1))
    return (sigma * rng.standard_normal(x.shape)).astype(np.float32)

  for _ in range(epochs):
    order = rng.permutation(len(train))
    for start in range(0, len(order), 64):
      batch = train[order[start:start + 64]]
      step(batch, noise_for(batch))
  degraded = degrade(tf.constant(test), scale_factor, noise_for(test))
  restored = prior(weights, degraded).numpy()

  def mean_psnr(images):
    return float(np.mean([s["psnr"] for s in image_scores(test, images, (0, 1))]))

  meta = {"format": _FORMAT, "dataset": dataset, "epochs": epochs, "seed": seed,
          "input_shape": list(input_shape), "scale_factor": scale_factor,
          "test_psnr_degraded": mean_psnr(degraded.numpy()),
          "test_psnr_restored": mean_psnr(restored)}
  return {k: v.numpy() for k, v in weights.items()}, meta


def prior_weights(prior: ImagePrior, input_shape, scale_factor: int,
                  path: Optional[str], dataset: str, epochs: int):
  """The prior's weights: from `path`, or the cached default."""
  if path is not None:
    weights = pretrained.load(path, "prior_weights")
    prior.check(weights, f"prior_weights={path!r}")
    return weights
  key = {"format": _FORMAT, "input_shape": [int(d) for d in input_shape],
         "dataset": dataset, "scale_factor": scale_factor, "epochs": epochs,
         "width": prior.width, "depth": prior.depth}
  weights = pretrained.cached(
      "rog_priors", key,
      lambda: train_prior(prior, input_shape, dataset, scale_factor, epochs))
  prior.check(weights, "the cached default prior")
  return weights


@ATTACKS.register
class ROG(GradientInversion):
  """ROG: see the module docstring."""

  name = "rog"
  PARAMETERS = Params(
      _iterations(100),
      Param("lr", float, 0.05, "Adam learning rate, cosine-annealed to a "
            "tenth", minimum=0, exclusive_minimum=True),
      Param("scale_factor", int, 4, "input size over the search space's",
            minimum=1),
      Param("prior", bool, True, "post-process with the learned prior"),
      Param("prior_weights", str, None, "the prior's weights file (default: "
            "trained on prior_dataset)"),
      Param("prior_dataset", str, "digits", "bundled data the default prior "
            "is trained on (not the attacked task's)",
            choices=pretrained.BUNDLED_DATASETS),
      Param("prior_epochs", int, 10, "training epochs of the default prior",
            minimum=1),
      _RESTARTS, _MAX_EXAMPLES)

  def check_records(self, records) -> None:
    """Also refuses a default prior trained on the attacked data set, and
    reads (or trains) the prior before any search."""
    super().check_records(records)
    if not self.prior:
      return
    for record in records:
      if self.prior_weights is None:
        pretrained.check_dataset("prior_dataset", self.prior_dataset,
                                 record.metadata.get("dataset"))
      self._prior(record.model_spec.input_shape)

  def _prior(self, input_shape):
    """(the prior, its weights) for inputs of `input_shape`."""
    prior = ImagePrior(input_shape[-1])
    return prior, prior_weights(prior, input_shape, self.scale_factor,
                                self.prior_weights, self.prior_dataset,
                                self.prior_epochs)

  def _build(self, target: Target):
    shape = target.record.model_spec.input_shape

    def objective(z, y_soft, upload, broadcast):
      with tf.GradientTape() as tape:
        tape.watch(z)
        loss = l2_distance(target.simulate(broadcast, upsample(z, shape), y_soft),
                           upload)
      return loss, tape.gradient(loss, z)

    def step(t, state, arguments):
      z, m, v, best_z, best_loss = state
      loss, grad = objective(z, *arguments)
      better = loss < best_loss
      best_z = tf.where(better, z, best_z)
      best_loss = tf.where(better, loss, best_loss)
      lr = cosine_learning_rate(t, self.iterations, self.lr)
      moved = adam_step(z, grad, m, v, tf.cast(t + 1, tf.float32), lr)
      return (*moved, best_z, best_loss), (z, m, v, best_z, best_loss)

    def advance(z, m, v, best_z, best_loss, done, steps, y_soft, upload, broadcast):
      arguments = (y_soft, upload, broadcast)
      return search_steps(lambda t, state: step(t, state, arguments), done,
                          steps, (z, m, v, best_z, best_loss))
    return advance

  def _start(self, target, rng):
    spec = target.record.model_spec
    lo, hi = target.bounds
    z = tf.constant(rng.uniform(lo, hi, (target.num_examples,)
                                + low_resolution(spec.input_shape, self.scale_factor)
                                + (spec.input_shape[-1],)), tf.float32)
    labels = target.recovered_labels()
    return {"z": z, "m": tf.zeros_like(z), "v": tf.zeros_like(z), "best_z": z,
            "best_loss": tf.constant(np.inf, tf.float32), "labels": labels,
            "y_soft": tf.one_hot(labels, target.num_classes)}

  def _advance(self, target, state, done, steps):
    advance = self.function(target, "adam", self._build)
    keys = ("z", "m", "v", "best_z", "best_loss")
    values = advance(*(state[k] for k in keys), tf.constant(done),
                     tf.constant(steps), state["y_soft"], target.upload,
                     target.broadcast)
    return {**state, **dict(zip(keys, values))}, False

  def _finish(self, target, state):
    shape = target.record.model_spec.input_shape
    x = upsample(state["best_z"], shape).numpy()
    if self.prior:
      # the prior restores images in the data's own range
      prior, weights = self._prior(shape)
      norm = normalization.of_metadata(target.record.metadata)
      pixels = x if norm is None else norm.undo(x)
      x = prior(weights, tf.constant(pixels, tf.float32)).numpy()
      x = x if norm is None else norm.apply(x)
    return x, state["labels"], float(state["best_loss"])
