"""PSI scores (FedRE eqs. 3-5): how strongly each model tensor's gradient
reacts to the pixels of a privacy-sensitive region.

For one sample x with label y and model tensors w_1..w_L:

```text
eq. 3  J_l(x) = d g_l(x) / d x,  g_l = d loss(x, y; w) / d w_l
eq. 4  J_l^R(x)[a, b] = || J_l(x)[..., a, b, :] ||_F   (over w_l's entries
       and the channels, one value per pixel (a, b) of the region R)
eq. 5  S_l = mean of J_l^R(x) over the region's pixels
```

Two exact implementations and one estimator:

* `psi_scores_nested_tape`: the reference, eq. 3 as written: an outer
  `tf.GradientTape` takes the full Jacobian of the inner tape's gradient
  with respect to the whole image (one backward pass per entry of the
  gradient), then eqs. 4-5 keep the region.
* `psi_scores` (default, exact): forward-mode derivatives through the inner
  gradient, `tf.autodiff.ForwardAccumulator` around the inner tape, one
  Jacobian-vector product per (region pixel, channel), vectorised with
  `tf.vectorized_map` in chunks. Its cost grows with the region's size, not
  with the image's or the model's.
* `psi_scores(..., pixels=m)`: an unbiased estimator of eq. 5 that averages
  m region pixels drawn uniformly without replacement; its standard error
  (sample standard deviation with the finite-population correction) comes
  back with it.

Scores are per sample; `mean_by_format` averages them per data format, as
the paper does with 10 samples per document format.

Layers. Eq. 4's norm runs over the entries of "the l-th layer's" gradient.
`psi_scores(..., groups=...)` scores groups of tensors (a Keras layer's
kernel and bias: `layer_groups`) by the norm over all their entries, per
pixel, before eq. 5's mean; without `groups` every tensor is scored alone.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tff_privacy import tasks
from tff_privacy.models import functional

LossFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]
PsiScores = collections.namedtuple("PsiScores", ["scores", "standard_error"])


# the default loss: classification's mean cross-entropy on logits
CLASSIFICATION_LOSS = tasks.get("classification").loss


@contextlib.contextmanager
def _quiet_vectorization():
  """Silences `tf.vectorized_map`'s warnings about ops it converts with a
  while loop (Conv2DBackpropFilter, ScatterNd): slower, still exact."""
  logger = tf.get_logger()
  level = logger.level
  logger.setLevel("ERROR")
  try:
    yield
  finally:
    logger.setLevel(level)


def _sum_of_squares(values: tf.Tensor, axis=None) -> tf.Tensor:
  """Sum of squares in float64: derivatives of a noisy model's gradient
  reach 1e20 and more, whose float32 squares would overflow to inf."""
  return tf.reduce_sum(tf.square(tf.cast(values, tf.float64)), axis=axis)


def _gradient(model, weights, loss_fn, x1, y1) -> list[tf.Tensor]:
  """g_l of one sample, for every model tensor (zeros where unconnected)."""
  with tf.GradientTape() as tape:
    tape.watch(weights)
    loss = loss_fn(functional.forward(model, weights, x1[None]), y1[None])
  return tape.gradient(loss, weights,
                       unconnected_gradients=tf.UnconnectedGradients.ZERO)


def pixel_norms_nested_tape(model, weights, x1, y1,
                            loss_fn: LossFn = CLASSIFICATION_LOSS,
                            chunk: int = 512) -> tf.Tensor:
  """Eq. 4 at every pixel of one sample, [L, H, W], from the full Jacobian
  of eq. 3 taken by nested tapes: one backward pass of the outer tape per
  entry of g_l, `chunk` of them vectorised at once and reduced as they come
  (what `GradientTape.jacobian` computes, without its memory peak on large
  layers). Chunks run in a `tf.map_fn`, so the function compiles once in a
  graph."""
  weights = [tf.convert_to_tensor(w) for w in weights]
  x1 = tf.cast(x1, tf.float32)
  with tf.GradientTape(persistent=True) as outer:
    outer.watch(x1)
    grads = _gradient(model, weights, loss_fn, x1, y1)
  norms = []
  for g in grads:
    size = int(np.prod(g.shape))

    def chunk_squares(c, g=g, size=size):
      basis = tf.one_hot(c * chunk + tf.range(chunk), size)  # rows past size: 0
      rows = tf.vectorized_map(
          lambda e: outer.gradient(g, x1, output_gradients=tf.reshape(e, g.shape),
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO),
          basis)
      return _sum_of_squares(rows, axis=[0, len(x1.shape)])

    with _quiet_vectorization():
      squares = tf.map_fn(chunk_squares, tf.range((size + chunk - 1) // chunk),
                          fn_output_signature=tf.TensorSpec(x1.shape[:-1], tf.float64))
    norms.append(tf.cast(tf.sqrt(tf.reduce_sum(squares, 0)), tf.float32))
  return tf.stack(norms)


def psi_scores_nested_tape(model: tf.keras.Model, weights: Sequence[tf.Tensor],
                           x, y, masks, loss_fn: LossFn = CLASSIFICATION_LOSS
                           ) -> tf.Tensor:
  """Eqs. 3-5 by nested tapes: [N, L] scores of N samples `x` [N, H, W, C]
  with labels `y` and region masks `masks` [N, H, W]."""
  x = tf.cast(x, tf.float32)
  masks = tf.cast(masks, tf.float32)
  rows = []
  for i in range(x.shape[0]):
    norms = pixel_norms_nested_tape(model, weights, x[i], y[i], loss_fn)
    rows.append(tf.reduce_sum(norms * masks[i], axis=[1, 2])
                / tf.reduce_sum(masks[i]))
  return tf.stack(rows)


def region_pixel_norms(model: tf.keras.Model, weights: Sequence[tf.Tensor],
                       x1: tf.Tensor, y1: tf.Tensor, coords: tf.Tensor,
                       loss_fn: LossFn = CLASSIFICATION_LOSS,
                       chunk: int = 64) -> tf.Tensor:
  """Eq. 4 at the pixels `coords` ([P, 2] rows and columns) of one sample, by
  forward-mode JVPs through the inner gradient: [P, L]."""
  weights = [tf.convert_to_tensor(w) for w in weights]
  x1 = tf.cast(x1, tf.float32)
  channels = x1.shape[-1]
  coords = tf.cast(coords, tf.int32)
  num = tf.shape(coords)[0] * channels
  # One (row, column, channel) triple per JVP, padded to whole chunks.
  triples = tf.concat([tf.repeat(coords, channels, axis=0),
                       tf.tile(tf.range(channels), [tf.shape(coords)[0]])[:, None]], 1)
  padded = (num + chunk - 1) // chunk * chunk
  triples = tf.concat([triples, tf.zeros([padded - num, 3], tf.int32)], 0)

  def column(triple):
    return pixel_jvp_squares(model, weights, x1, y1, triple, loss_fn)

  # parallel_iterations=1 here and over the samples: a graph's map_fn would
  # otherwise run 10 iterations at once, each holding a chunk of JVPs
  # through the model (10 documents on the U-Net: 2.5 GB instead of 1.4 GB)
  with _quiet_vectorization():
    squares = tf.map_fn(lambda c: tf.vectorized_map(column, c),
                        tf.reshape(triples, [-1, chunk, 3]),
                        fn_output_signature=tf.TensorSpec([chunk, len(weights)],
                                                          tf.float64),
                        parallel_iterations=1)
  squares = tf.reshape(squares, [-1, len(weights)])[:num]
  per_pixel = tf.reduce_sum(tf.reshape(squares, [-1, channels, len(weights)]), 1)
  return tf.cast(tf.sqrt(per_pixel), tf.float32)


def pixel_jvp_squares(model: tf.keras.Model, weights: Sequence[tf.Tensor],
                      x1: tf.Tensor, y1: tf.Tensor, triple: tf.Tensor,
                      loss_fn: LossFn = CLASSIFICATION_LOSS) -> tf.Tensor:
  """[L] float64: the squared norm of d g_l / d x1[row, column, channel]
  for every tensor l at one (row, column, channel) `triple` of the sample
  `x1` (float32), by one Jacobian-vector product through the gradient."""
  tangent = tf.scatter_nd(triple[None], [1.0], tf.shape(x1))
  with tf.autodiff.ForwardAccumulator(x1, tangent) as acc:
    grads = _gradient(model, weights, loss_fn, x1, y1)
  return tf.stack([_sum_of_squares(acc.jvp(
      g, unconnected_gradients=tf.UnconnectedGradients.ZERO)) for g in grads])


def layer_groups(model: tf.keras.Model) -> list[int]:
  """For each of `model`'s trainable tensors, in order, the index of the
  top-level layer that holds it (layers holding no trainable tensor are
  skipped, so the indices run 0..G-1)."""
  owner = {}
  for layer in model.layers:
    for v in layer.trainable_weights:
      owner.setdefault(v.ref(), layer.name)
  names = [owner[v.ref()] for v in model.trainable_variables]
  order = {name: i for i, name in enumerate(dict.fromkeys(names))}
  return [order[name] for name in names]


def _group_norms(norms: tf.Tensor, groups: Optional[Sequence[int]]) -> tf.Tensor:
  """[P, L] per-tensor norms -> [P, G] norms over each group's entries."""
  if groups is None:
    return norms
  squares = tf.math.unsorted_segment_sum(tf.transpose(tf.square(norms)),
                                         tf.constant(groups), max(groups) + 1)
  return tf.sqrt(tf.transpose(squares))


def _chosen_pixels(mask: tf.Tensor, pixels: Optional[int], seed) -> tf.Tensor:
  """The region's pixel coordinates, or `pixels` of them drawn uniformly
  without replacement (all of them when the region is not larger)."""
  coords = tf.where(mask)
  if pixels is None:
    return coords
  keys = tf.random.stateless_uniform([tf.shape(coords)[0]], seed)
  take = tf.minimum(pixels, tf.shape(coords)[0])
  return tf.gather(coords, tf.math.top_k(keys, take).indices)


@tf.autograph.experimental.do_not_convert
def psi_scores(model: tf.keras.Model, weights: Sequence[tf.Tensor], x, y, masks,
               loss_fn: LossFn = CLASSIFICATION_LOSS, *,
               pixels: Optional[int] = None, seed=(0, 0),
               chunk: int = 64,
               groups: Optional[Sequence[int]] = None) -> PsiScores:
  """Eqs. 3-5 for N samples `x` [N, H, W, C], labels `y` and region masks
  `masks` [N, H, W], by forward-mode JVPs over the region's pixels.

  Args:
    model: the Keras model (its layers; weights come from `weights`).
    weights: the model's trainable tensors, in order; one score per tensor.
    loss_fn: maps (outputs, labels) of a one-sample batch to the loss.
    pixels: None for the exact score; else the estimator's number of region
      pixels per sample (>= 2), drawn with `seed` (a stateless-RNG seed).
    chunk: JVPs vectorised at once (memory: chunk x the model's parameters),
      at most those of one sample (`pixels` or H W, times C).
    groups: None to score each tensor; else each tensor's group index
      (0..G-1, e.g. `layer_groups(model)`), scoring each group as one layer.

  Returns:
    `PsiScores(scores, standard_error)`, both [N, L] (or [N, G]); the
    standard error is 0 for the exact score and for regions no larger than
    `pixels`.

  Raises:
    ValueError: for `pixels` < 2, `chunk` < 1, or `groups` that do not give
      every tensor an index in 0..G-1 with every group used.
  """
  if pixels is not None and pixels < 2:
    raise ValueError(f"pixels must be >= 2 (or None for the exact score), got {pixels}")
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1, got {chunk}")
  _check_groups(groups, len(weights))
  width = len(weights) if groups is None else max(groups) + 1
  x = tf.cast(x, tf.float32)
  masks = tf.cast(masks, tf.bool)
  chunk = min(chunk, _most_jvps(x.shape, pixels))
  seeds = tf.random.experimental.stateless_split(
      tf.cast(tf.convert_to_tensor(seed), tf.int64), tf.shape(x)[0])

  def one(args):
    x1, y1, mask, s = args
    coords = _chosen_pixels(mask, pixels, s)
    norms = _group_norms(
        region_pixel_norms(model, weights, x1, y1, coords, loss_fn, chunk), groups)
    score = tf.reduce_mean(norms, 0)
    m = tf.cast(tf.shape(norms)[0], tf.float32)
    population = tf.reduce_sum(tf.cast(mask, tf.float32))
    variance = tf.reduce_sum(tf.square(norms - score), 0) / tf.maximum(m - 1, 1)
    error = tf.sqrt(variance / m * tf.maximum(1 - m / population, 0.0))
    return score, error

  scores, errors = tf.map_fn(
      one, (x, tf.convert_to_tensor(y), masks, seeds),
      fn_output_signature=(tf.TensorSpec([width]),) * 2,
      parallel_iterations=1)
  return PsiScores(scores, errors)


def _most_jvps(shape: tf.TensorShape, pixels: Optional[int]) -> int:
  """The most JVPs one sample of `shape` [N, H, W, C] takes (a padded JVP
  costs as much as a real one, so no chunk needs to be wider); a large
  number where the shape is not known when traced."""
  height, width, channels = shape[1:]
  if None in (height, width, channels):
    return np.iinfo(np.int32).max
  return (height * width if pixels is None else pixels) * channels


def _check_groups(groups: Optional[Sequence[int]], num_tensors: int) -> None:
  if groups is None:
    return
  groups = list(groups)
  used = sorted(set(groups))
  if len(groups) != num_tensors or used != list(range(len(used))):
    raise ValueError(f"groups must give each of the {num_tensors} tensors a group "
                     f"index, using every index 0..G-1; got {groups}")


def mean_by_format(scores: np.ndarray, formats: Sequence) -> dict:
  """{format: mean score [L]} over the samples of each format."""
  scores = np.asarray(scores)
  formats = np.asarray(formats)
  if len(formats) != len(scores):
    raise ValueError(f"formats has {len(formats)} entries for {len(scores)} scores")
  return {f.item() if hasattr(f, "item") else f: scores[formats == f].mean(0)
          for f in np.unique(formats)}
