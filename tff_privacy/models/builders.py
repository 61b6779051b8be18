"""Keras model builders by name.

Every builder takes `input_shape`, `num_classes` and a `seed` that fixes the
initial weights, and returns an uncompiled `tf.keras.Model` producing logits.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tff_privacy.models.lpm import lpm_resnet

L = tf.keras.layers

# 'default': Keras' (Glorot-uniform kernels, zero biases); 'uniform': every
# weight U(-0.5, 0.5) (DLG's); 'pytorch': PyTorch's nn.Conv2d / nn.Linear
# default, kernel and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in))
WEIGHT_INITS = ("default", "uniform", "pytorch")


class _FanInUniform(tf.keras.initializers.Initializer):
  """U(-1/sqrt(f), 1/sqrt(f)) for a kernel of fan-in f (all axes but the
  last), remembering f for its layer's bias (`_BiasOf`), which Keras layers
  build after their kernel."""

  def __init__(self, seed: int):
    self.seed = seed
    self.fan_in = None

  def __call__(self, shape, dtype=None, **kwargs):
    self.fan_in = int(np.prod(shape[:-1]))
    return _uniform(shape, self.fan_in, self.seed, dtype)


class _BiasOf(tf.keras.initializers.Initializer):
  """U(-1/sqrt(f), 1/sqrt(f)) with f the fan-in of the layer's kernel."""

  def __init__(self, kernel: _FanInUniform, seed: int):
    self.kernel = kernel
    self.seed = seed

  def __call__(self, shape, dtype=None, **kwargs):
    return _uniform(shape, self.kernel.fan_in, self.seed, dtype)


def _uniform(shape, fan_in: int, seed: int, dtype) -> tf.Tensor:
  bound = 1.0 / np.sqrt(fan_in)
  return tf.keras.initializers.RandomUniform(-bound, bound, seed=seed)(shape, dtype)


def _initializers(weight_init: str, seed: int, uniform_scale: float = 0.5):
  """Yields (kernel, bias) initializer pairs with distinct, fixed seeds."""
  if weight_init not in WEIGHT_INITS:
    raise ValueError(
        f"weight_init={weight_init!r} is unknown; choose one of {WEIGHT_INITS}")
  for i in itertools.count():
    s = seed * 1000 + 2 * i
    if weight_init == "uniform":
      yield (tf.keras.initializers.RandomUniform(-uniform_scale, uniform_scale, seed=s),
             tf.keras.initializers.RandomUniform(-uniform_scale, uniform_scale, seed=s + 1))
    elif weight_init == "pytorch":
      kernel = _FanInUniform(s)
      yield kernel, _BiasOf(kernel, s + 1)
    else:
      yield tf.keras.initializers.GlorotUniform(seed=s), "zeros"


def lenet(input_shape, num_classes, seed: int = 0, activation: str = "sigmoid",
          weight_init: str = "uniform") -> tf.keras.Model:
  """The LeNet variant of DLG (Zhu et al. 2019): three 5x5 convolutions with 12
  channels (strides 2, 2, 1, 'same' padding), sigmoid activations, one dense
  layer. DLG initialises every weight and bias from U(-0.5, 0.5), which is the
  default here (`weight_init='uniform'`); `weight_init='default'` gives
  Glorot-uniform kernels and zero biases."""
  inits = _initializers(weight_init, seed)
  layers = [L.InputLayer(input_shape)]
  for i, stride in enumerate((2, 2, 1), start=1):
    k, b = next(inits)
    layers.append(L.Conv2D(12, 5, strides=stride, padding="same",
                           activation=activation, kernel_initializer=k,
                           bias_initializer=b, name=f"conv{i}"))
  k, b = next(inits)
  layers += [L.Flatten(), L.Dense(num_classes, kernel_initializer=k,
                                  bias_initializer=b, name="fc")]
  return tf.keras.Sequential(layers, name="lenet")


def _dense_head(inits, dense: int, num_classes: int) -> list:
  """Flatten, fc1 (`dense` units, ReLU) and fc2 (the logits)."""
  k1, b1 = next(inits)
  k2, b2 = next(inits)
  return [L.Flatten(),
          L.Dense(dense, activation="relu", kernel_initializer=k1,
                  bias_initializer=b1, name="fc1"),
          L.Dense(num_classes, kernel_initializer=k2, bias_initializer=b2,
                  name="fc2")]


def cnn(input_shape, num_classes, seed: int = 0, filters: int = 16,
        dense: int = 64, weight_init: str = "default") -> tf.keras.Model:
  """A small ReLU CNN: conv(3x3)-maxpool twice, then dense-ReLU and dense."""
  inits = _initializers(weight_init, seed)
  layers = [L.InputLayer(input_shape)]
  for i, f in enumerate((filters, 2 * filters), start=1):
    k, b = next(inits)
    layers += [L.Conv2D(f, 3, padding="same", activation="relu",
                        kernel_initializer=k, bias_initializer=b, name=f"conv{i}"),
               L.MaxPool2D(2)]
  layers += _dense_head(inits, dense, num_classes)
  return tf.keras.Sequential(layers, name="cnn")


def mlp(input_shape, num_classes, seed: int = 0, hidden: tuple[int, ...] = (200, 200),
        activation: str = "relu", weight_init: str = "default") -> tf.keras.Model:
  """A multilayer perceptron on the flattened input."""
  inits = _initializers(weight_init, seed)
  layers = [L.InputLayer(input_shape), L.Flatten()]
  for i, units in enumerate(hidden, start=1):
    k, b = next(inits)
    layers.append(L.Dense(units, activation=activation, kernel_initializer=k,
                          bias_initializer=b, name=f"fc{i}"))
  k, b = next(inits)
  layers.append(L.Dense(num_classes, kernel_initializer=k, bias_initializer=b,
                        name=f"fc{len(hidden) + 1}"))
  return tf.keras.Sequential(layers, name="mlp")


def _paper_cnn(name, input_shape, num_classes, seed, convs, leaky_slope,
               weight_init):
  """Convolutions (filters, kernel, zero padding) each followed by LeakyReLU
  and a 2x2 max-pool, then fc1 (128, LeakyReLU) and fc2 (the classifier)."""
  inits = _initializers(weight_init, seed)
  layers = [L.InputLayer(input_shape)]
  for i, (filters, kernel, pad) in enumerate(convs, start=1):
    k, b = next(inits)
    if pad:
      layers.append(L.ZeroPadding2D(pad, name=f"pad{i}"))
    layers += [L.Conv2D(filters, kernel, kernel_initializer=k, bias_initializer=b,
                        name=f"conv{i}"),
               L.LeakyReLU(leaky_slope, name=f"act{i}"), L.MaxPool2D(2)]
  k1, b1 = next(inits)
  k2, b2 = next(inits)
  layers += [L.Flatten(),
             L.Dense(128, kernel_initializer=k1, bias_initializer=b1, name="fc1"),
             L.LeakyReLU(leaky_slope, name="act_fc1"),
             L.Dense(num_classes, kernel_initializer=k2, bias_initializer=b2,
                     name="fc2")]
  return tf.keras.Sequential(layers, name=name)


def hyperfl_cnn(input_shape, num_classes, seed: int = 0, leaky_slope: float = 0.01,
                weight_init: str = "pytorch") -> tf.keras.Model:
  """HyperFL's target CNN for 28x28 inputs (Guo et al., Sec. 5.1): conv 16
  5x5, max-pool, conv 32 5x5 with padding 1, max-pool, fc 800 -> 128, fc
  128 -> classes, LeakyReLU (PyTorch's slope 0.01). The feature extractor is
  everything up to fc1, the classifier is fc2. Initialised as the authors'
  PyTorch code is, by PyTorch's layer defaults ('pytorch'; 'default' gives
  Glorot-uniform kernels and zero biases, whose classifier starts with
  logits about 2.4 times as large)."""
  return _paper_cnn("hyperfl_cnn", input_shape, num_classes, seed,
                    ((16, 5, 0), (32, 5, 1)), leaky_slope, weight_init)


def hyperfl_cnn_cifar(input_shape, num_classes, seed: int = 0,
                      leaky_slope: float = 0.01,
                      weight_init: str = "pytorch") -> tf.keras.Model:
  """HyperFL's target CNN for 32x32 colour inputs: conv 16 5x5, conv 32 5x5
  (padding 1), conv 64 3x3 (padding 1), each with a max-pool, then fc
  576 -> 128 and fc 128 -> classes, LeakyReLU; PyTorch's initialisation
  as `hyperfl_cnn`'s."""
  return _paper_cnn("hyperfl_cnn_cifar", input_shape, num_classes, seed,
                    ((16, 5, 0), (32, 5, 1), (64, 3, 1)), leaky_slope, weight_init)


def _conv_pool_net(name, input_shape, num_classes, seed, filters, stride, dense,
                   weight_init):
  """3x3 'same' convolutions with `stride`, each followed by a 2x2 max-pool
  (rounding odd sizes up) and ReLU, then a ReLU hidden layer of `dense`
  units and the output."""
  inits = _initializers(weight_init, seed)
  layers = [L.InputLayer(input_shape)]
  for i, f in enumerate(filters, start=1):
    k, b = next(inits)
    layers += [L.Conv2D(f, 3, strides=stride, padding="same", kernel_initializer=k,
                        bias_initializer=b, name=f"conv{i}"),
               L.MaxPool2D(2, padding="same"), L.ReLU(name=f"act{i}")]
  layers += _dense_head(inits, dense, num_classes)
  return tf.keras.Sequential(layers, name=name)


def recupfl_lfw(input_shape, num_classes, seed: int = 0,
                weight_init: str = "default") -> tf.keras.Model:
  """RECUP-FL's LFW CNN (Appendix Table 2), for 62 x 47 RGB faces: conv 32,
  64 and 128 3x3, each with a max-pool and ReLU, fc 256, and the output.
  The table's 'FC 2, sigmoid' is taken as two logits under the softmax
  cross-entropy, the same classifier for two classes."""
  return _conv_pool_net("recupfl_lfw", input_shape, num_classes, seed,
                        (32, 64, 128), 1, 256, weight_init)


def recupfl_celeba(input_shape, num_classes, seed: int = 0,
                   weight_init: str = "default") -> tf.keras.Model:
  """RECUP-FL's CelebA CNN for 32 x 32 RGB: conv 16, 32 and 64 3x3 with
  stride 1, each with a max-pool and ReLU, fc 128, and the output. Sec. 5.2
  says three convolutions; Appendix Table 2 lists four of stride 2 with
  pools, which would shrink a 32 x 32 input below one pixel, so the text's
  three are built, at stride 1."""
  return _conv_pool_net("recupfl_celeba", input_shape, num_classes, seed,
                        (16, 32, 64), 1, 128, weight_init)


def recupfl_audiomnist(input_shape, num_classes, seed: int = 0,
                       weight_init: str = "default") -> tf.keras.Model:
  """RECUP-FL's AudioMNIST CNN for 224 x 224 spectrograms: conv 16, 32 and
  64 3x3 with stride 2, each with a max-pool and ReLU, fc 32, and the output.
  Appendix Table 2 also normalises each convolution's batch; that is left
  out, as only trainable weights are federated here, so running statistics
  would never leave their initial values."""
  return _conv_pool_net("recupfl_audiomnist", input_shape, num_classes, seed,
                        (16, 32, 64), 2, 32, weight_init)


def unet(input_shape, num_classes, seed: int = 0, widths: tuple[int, ...] = (8, 16, 32),
         weight_init: str = "default") -> tf.keras.Model:
  """A small U-Net for pixel labelling (FedRE's tamper segmentation):
  per level two 3x3 ReLU convolutions, a 2x2 max-pool on the way down,
  nearest-neighbour upsampling and concatenation with the level's skip
  connection on the way up, and a 1x1 convolution to per-pixel logits
  [H, W, num_classes]. Height and width must be divisible by
  2^(len(widths) - 1)."""
  if not widths or any(w < 1 for w in widths):
    raise ValueError(f"widths must be a non-empty list of positive ints, got {widths}")
  factor = 2 ** (len(widths) - 1)
  if input_shape[0] % factor or input_shape[1] % factor:
    raise ValueError(f"unet with {len(widths)} levels needs height and width "
                     f"divisible by {factor}, got {tuple(input_shape[:2])}")
  inits = _initializers(weight_init, seed)

  def block(h, filters, name):
    for j in (1, 2):
      k, b = next(inits)
      h = L.Conv2D(filters, 3, padding="same", activation="relu",
                   kernel_initializer=k, bias_initializer=b, name=f"{name}_{j}")(h)
    return h

  inputs = L.Input(input_shape)
  h, skips = inputs, []
  for level, filters in enumerate(widths[:-1], start=1):
    h = block(h, filters, f"down{level}")
    skips.append(h)
    h = L.MaxPool2D(2, name=f"pool{level}")(h)
  h = block(h, widths[-1], "bottom")
  for level in range(len(widths) - 1, 0, -1):
    h = L.UpSampling2D(2, name=f"up{level}")(h)
    h = L.Concatenate(name=f"skip{level}")([h, skips[level - 1]])
    h = block(h, widths[level - 1], f"dec{level}")
  k, b = next(inits)
  logits = L.Conv2D(num_classes, 1, kernel_initializer=k, bias_initializer=b,
                    name="logits")(h)
  return tf.keras.Model(inputs, logits, name="unet")


MODELS: dict[str, Callable[..., tf.keras.Model]] = {
    "lenet": lenet,
    "cnn": cnn,
    "mlp": mlp,
    "hyperfl_cnn": hyperfl_cnn,
    "hyperfl_cnn_cifar": hyperfl_cnn_cifar,
    "lpm_resnet": lpm_resnet,
    "recupfl_audiomnist": recupfl_audiomnist,
    "recupfl_celeba": recupfl_celeba,
    "recupfl_lfw": recupfl_lfw,
    "unet": unet,
}
# models whose output is a label per pixel; every other one outputs one per sample
SEGMENTATION_MODELS = ("unet",)


def check_task(name: str, task: str) -> None:
  """Raises `ValueError` when model `name` does not output what `task`
  needs (per-pixel logits for segmentation, per-sample ones otherwise)."""
  pixelwise = name in SEGMENTATION_MODELS
  if pixelwise != (task == "segmentation"):
    fitting = (SEGMENTATION_MODELS if task == "segmentation" else
               sorted(set(MODELS) - set(SEGMENTATION_MODELS)))
    raise ValueError(f"model={name!r} does not fit the {task} task of the data "
                     f"set; choose one of {list(fitting)}")


def check(name: str, num_classes: int) -> None:
  """Raises `ValueError` for an unknown model name or fewer than 2 classes."""
  if name not in MODELS:
    raise ValueError(f"model={name!r} is unknown; choose one of {sorted(MODELS)}")
  if num_classes < 2:
    raise ValueError(f"num_classes must be >= 2, got {num_classes}")


def check_kwargs(name: str, kwargs: dict[str, Any]) -> None:
  """Raises `ValueError` for an unknown model or a keyword argument its
  builder does not take, naming the ones it takes."""
  if name not in MODELS:
    raise ValueError(f"model={name!r} is unknown; choose one of {sorted(MODELS)}")
  accepted = [p for p in inspect.signature(MODELS[name]).parameters
              if p not in ("input_shape", "num_classes", "seed")]
  unknown = sorted(set(kwargs) - set(accepted))
  if unknown:
    raise ValueError(f"model_kwargs: model {name!r} takes no {', '.join(unknown)}; "
                     f"its arguments: {', '.join(accepted)}")


def build(name: str, input_shape, num_outputs: int, seed: int = 0,
          **kwargs) -> tf.keras.Model:
  """Builds model `name` (one of `MODELS`) with `num_outputs` outputs per
  sample or pixel (the task's `output_units`: the number of classes, or 1
  for a sigmoid output) and builder keyword `kwargs`."""
  if name not in MODELS:
    raise ValueError(f"model={name!r} is unknown; choose one of {sorted(MODELS)}")
  if num_outputs < 1:
    raise ValueError(f"num_outputs must be >= 1, got {num_outputs}")
  check_kwargs(name, kwargs)
  return MODELS[name](tuple(input_shape), num_outputs, seed=seed, **kwargs)
