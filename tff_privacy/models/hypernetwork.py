"""HyperFL's hypernetwork: a client embedding in, a feature extractor out.

h(v; varphi) (Guo et al., Sec. 3.2 and the authors' code): a hidden layer
Linear(embedding_dim -> hidden_dim) with ReLU, then one linear head
Linear(hidden_dim -> numel(theta_t)) per generated tensor theta_t, reshaped
to the tensor's shape. The generated tensors are the target model's feature
extractor: every trainable tensor except the last dense layer (the
classifier), in the model's order.

The heads' outputs are reshaped straight into TensorFlow's layouts (HWIO
kernels, row-major flattening after NHWC convolutions) where the authors'
PyTorch code uses OIHW and NCHW. The two differ by a fixed permutation of each
head's output units, whose initial weights are i.i.d., so the generated
models are equal in distribution.

Weights are functional (lists of tensors), so that the same arithmetic runs
in the clients' TFF computations, in evaluation and in attacks.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Hypernetwork:
  """The architecture of h; see the module docstring.

  Attributes:
    target_shapes: shapes of the generated tensors, in the target's order.
    target_names: their names ('conv1/kernel', ...).
    embedding_dim: size of a client embedding v (the paper's 64).
    hidden_dim: width of the hidden layer (128).
  """

  target_shapes: tuple[tuple[int, ...], ...]
  target_names: tuple[str, ...]
  embedding_dim: int = 64
  hidden_dim: int = 128

  def __post_init__(self):
    for name in ("embedding_dim", "hidden_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

  @classmethod
  def for_model(cls, model: tf.keras.Model, embedding_dim: int = 64,
                hidden_dim: int = 128) -> "Hypernetwork":
    """The hypernetwork generating `model`'s feature extractor."""
    extractor = model.trainable_variables[:num_extractor_tensors(model)]
    return cls(tuple(tuple(v.shape) for v in extractor),
               tuple(v.name.split(":")[0] for v in extractor),
               embedding_dim, hidden_dim)

  @property
  def shapes(self) -> list[tuple[int, ...]]:
    """Shapes of h's weights: hidden kernel, hidden bias, then each head's
    kernel and bias."""
    out = [(self.embedding_dim, self.hidden_dim), (self.hidden_dim,)]
    for shape in self.target_shapes:
      out += [(self.hidden_dim, int(np.prod(shape))), (int(np.prod(shape)),)]
    return out

  @property
  def names(self) -> list[str]:
    out = ["hidden/kernel", "hidden/bias"]
    for name in self.target_names:
      out += [f"head_{name}/kernel", f"head_{name}/bias"]
    return out

  @property
  def num_parameters(self) -> int:
    return sum(int(np.prod(s)) for s in self.shapes)

  def initial_weights(self, seed: int) -> list[np.ndarray]:
    """PyTorch's `nn.Linear` default, as in the authors' code: kernel and
    bias of a layer with fan-in f drawn from U(-1/sqrt(f), 1/sqrt(f))."""
    rng = np.random.default_rng([seed, 1])
    out = []
    for shape in self.shapes:
      fan_in = self.embedding_dim if len(out) < 2 else self.hidden_dim
      bound = 1.0 / np.sqrt(fan_in)
      out.append(rng.uniform(-bound, bound, shape).astype(np.float32))
    return out

  def initial_embedding(self, seed: int) -> np.ndarray:
    """N(0, 1), PyTorch's `nn.Embedding` default."""
    return np.random.default_rng([seed, 2]).standard_normal(
        self.embedding_dim).astype(np.float32)

  def generate(self, weights: Sequence[tf.Tensor],
               embedding: tf.Tensor) -> list[tf.Tensor]:
    """theta = h(v; varphi): the generated extractor tensors."""
    hidden = tf.nn.relu(tf.linalg.matvec(weights[0], embedding, transpose_a=True)
                        + weights[1])
    out = []
    for i, shape in enumerate(self.target_shapes):
      kernel, bias = weights[2 + 2 * i], weights[3 + 2 * i]
      flat = tf.linalg.matvec(kernel, hidden, transpose_a=True) + bias
      out.append(tf.reshape(flat, shape))
    return out


def num_extractor_tensors(model: tf.keras.Model) -> int:
  """The trainable tensors before the last dense layer (the classifier)."""
  dense = [layer for layer in model.layers if isinstance(layer, tf.keras.layers.Dense)]
  if not dense:
    raise ValueError(f"model {model.name} has no dense classifier layer")
  classifier = len(dense[-1].trainable_variables)
  return len(model.trainable_variables) - classifier
