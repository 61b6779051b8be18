"""A Keras model's forward pass as a function of weights passed as tensors.

Attacks differentiate a client's upload with respect to its input through the
exact arithmetic the client ran, and client-side defences (Soteria, FedEM)
evaluate the broadcast model inside TFF computations without building Keras
variables. Keras layers hold their weights in variables, so this module
re-applies a model's layers to given weight tensors. It covers the layer types
of `tff_privacy.models` and raises for anything else.

With `records`, one pass runs R models at once: every weight tensor carries a
leading record axis and the inputs are [R, B, ...]. Record r's samples meet
only record r's weights: convolutions are grouped over records (one conv op
whose channel groups are the records, or one per record where TensorFlow
cannot differentiate grouped ones: `grouped_convolution_differentiable`),
dense layers are batched matmuls.
Between convolutions, layers that treat every channel alike keep the grouped
layout; the others see the records folded into the batch. The gradient of a
sum of per-record losses with respect to the stacked weights is then every
record's own gradient, which is how attacks search many records in one
compiled computation without vectorising a per-record graph.
"""

from __future__ import annotations

import functools
import threading
from typing import Optional, Sequence

import tensorflow as tf

from tff_privacy.models.lpm import Adapter, FrozenStage

L = tf.keras.layers
_PASS_THROUGH = (L.InputLayer, L.Dropout)
_WEIGHTED = (L.Conv2D, L.Dense)
_STATELESS = (L.MaxPool2D, L.Flatten, L.Activation, L.LeakyReLU, L.ReLU,
              L.ZeroPadding2D, L.GlobalAveragePooling2D, L.Concatenate, L.Add,
              FrozenStage)


class _Grouped:
  """A records-mode activation in the grouped layout [B, ..., R*C] (record
  r's channels at r*C..(r+1)*C), which convolutions read and write; plain
  tensors are in the folded layout [R*B, ..., C]. Layers that act on each
  channel alike keep the grouped layout, so consecutive convolutions need
  no transposes between them."""

  def __init__(self, tensor: tf.Tensor):
    self.tensor = tensor


def _grouped(h, records) -> tf.Tensor:
  if isinstance(h, _Grouped):
    return h.tensor
  inner, c = h.shape[1:-1].as_list(), h.shape[-1]
  axes = list(range(1, len(inner) + 2))
  moved = tf.transpose(tf.reshape(h, [records, -1, *inner, c]), axes + [0, len(inner) + 2])
  return tf.reshape(moved, [-1, *inner, records * c])


def _folded(h, records):
  """`h` (a tensor, a `_Grouped` or a list of them) in the folded layout."""
  if isinstance(h, list):
    return [_folded(t, records) for t in h]
  if not isinstance(h, _Grouped):
    return h
  t = h.tensor
  inner = t.shape[1:-1].as_list()
  split = tf.reshape(t, [-1, *inner, records, t.shape[-1] // records])
  rank = len(inner) + 3
  moved = tf.transpose(split, [rank - 2] + list(range(rank - 2)) + [rank - 1])
  return tf.reshape(moved, [-1, *inner, t.shape[-1] // records])


_PER_CHANNEL = (L.MaxPool2D, L.LeakyReLU, L.ReLU, L.ZeroPadding2D)
_ACROSS_CHANNELS = (tf.keras.activations.softmax,)  # the others act per entry


def _apply_grouped(layer, weights, i, h, records):
  """`_apply` in the grouped layout, or None where `layer` needs its inputs
  folded."""
  if isinstance(layer, L.Conv2D):
    kernel = weights[i]
    bias = weights[i + 1] if layer.use_bias else None
    out = _Grouped(_conv(layer, _grouped(h, records), kernel, bias, records))
    if layer.activation in _ACROSS_CHANNELS:
      return layer.activation(_folded(out, records)), i + (2 if layer.use_bias else 1)
    return _Grouped(layer.activation(out.tensor)), i + (2 if layer.use_bias else 1)
  inputs = h if isinstance(h, list) else [h]
  if not all(isinstance(t, _Grouped) for t in inputs):
    return None
  tensors = [t.tensor for t in inputs]
  if isinstance(layer, _PER_CHANNEL) or (
      isinstance(layer, L.Activation) and layer.activation not in _ACROSS_CHANNELS):
    return _Grouped(layer(tensors[0])), i
  if isinstance(layer, L.UpSampling2D) and layer.interpolation == "nearest":
    return _Grouped(_upsample(layer, tensors[0])), i
  if isinstance(layer, L.Add):
    return _Grouped(tf.add_n(tensors)), i
  if isinstance(layer, L.Concatenate) and layer.axis in (-1, tensors[0].shape.rank - 1):
    # each record's channels side by side: [..., R, C_k] joined on C
    parts = [tf.reshape(t, [-1, *t.shape[1:-1], records, t.shape[-1] // records])
             for t in tensors]
    joined = tf.concat(parts, -1)
    return _Grouped(tf.reshape(joined, [-1, *joined.shape[1:-2], records * joined.shape[-1]])), i
  return None


def _conv(layer, h, kernel, bias, records):
  """`layer`'s convolution plus bias; with `records` R, h is grouped
  [B, H, W, R*C] (see `_Grouped`), the kernel [R, kh, kw, C, O] and the bias
  [R, O], applied as one convolution of R channel groups, the output
  grouped too."""
  conv = lambda inputs, k: tf.nn.conv2d(
      inputs, k, strides=layer.strides, padding=layer.padding.upper(),
      dilations=layer.dilation_rate)
  if records:
    kh, kw, c, o = kernel.shape[1:]
    bias = None if bias is None else tf.reshape(bias, [records * o])
    if grouped_convolution_differentiable():
      h = conv(h, tf.reshape(tf.transpose(kernel, [1, 2, 3, 0, 4]),
                             [kh, kw, c, records * o]))
    else:
      h = tf.concat([conv(part, kernel[r]) for r, part in
                     enumerate(tf.split(h, records, axis=-1))], -1)
  else:
    h = conv(h, kernel)
  return h if bias is None else h + bias


@functools.lru_cache(maxsize=None)
def grouped_convolution_differentiable() -> bool:
  """Whether TensorFlow differentiates a grouped convolution on its default
  device. GPUs do; on CPU only oneDNN's kernels do, which TensorFlow 2.14
  turns on by default for CPUs with AVX512-VNNI or newer features, not for
  others (e.g. AMD EPYC), unless TF_ENABLE_ONEDNN_OPTS=1. Elsewhere records
  mode runs one convolution per record. Probed eagerly in a thread of its
  own: the caller may be tracing a graph, where nothing runs."""
  answer = []
  probe = threading.Thread(target=lambda: answer.append(_differentiate_grouped()))
  probe.start()
  probe.join()
  return answer[0]


def _differentiate_grouped() -> bool:
  x, kernel = tf.ones([1, 4, 4, 4]), tf.ones([3, 3, 2, 4])  # 2 groups
  try:
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.nn.conv2d(x, kernel, 1, "SAME")
    tape.gradient(y, x)
  except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError):
    return False
  return True


def _upsample(layer, h):
  # repeats, not TensorFlow's resize op, whose gradient has no gradient:
  # PSI and attacks differentiate twice through this layer
  rows, cols = layer.size
  return tf.repeat(tf.repeat(h, rows, axis=1), cols, axis=2)


def _dense(layer, h, kernel, bias, records):
  """A dense layer's affine map; with `records` R, h is [R*B, ..., I], the
  kernel [R, I, O] and the bias [R, O] (a batched matmul)."""
  if not records:
    h = tf.matmul(h, kernel)
    return h if bias is None else h + bias
  out = tf.matmul(tf.reshape(h, [records, -1, h.shape[-1]]), kernel)
  if bias is not None:
    out += bias[:, None]
  return tf.reshape(out, [-1] + h.shape[1:-1].as_list() + [kernel.shape[-1]])


def _apply(layer, weights, i, h, records=0):
  """Layer `layer` on `h` with weights from `weights[i:]`; returns (out, next
  i). `records`: the number of records whose weights are stacked (0: none);
  their activations may then be `_Grouped`."""
  if records:
    grouped = _apply_grouped(layer, weights, i, h, records)
    if grouped is not None:
      return grouped
    h = _folded(h, records)
  if isinstance(layer, _WEIGHTED):
    kernel = weights[i]
    bias = weights[i + 1] if layer.use_bias else None
    i += 2 if layer.use_bias else 1
    affine = _conv if isinstance(layer, L.Conv2D) else _dense
    return layer.activation(affine(layer, h, kernel, bias, records)), i
  if isinstance(layer, L.UpSampling2D) and layer.interpolation == "nearest":
    return _upsample(layer, h), i
  if isinstance(layer, Adapter):
    n = len(layer.trainable_weights)
    if not records:
      return layer.call_with_weights(weights[i:i + n], h), i + n
    parts = tf.split(h, records)
    return tf.concat([layer.call_with_weights([w[r] for w in weights[i:i + n]], part)
                      for r, part in enumerate(parts)], 0), i + n
  if isinstance(layer, _STATELESS):
    return layer(h), i
  raise ValueError(f"layer {layer.name} ({type(layer).__name__}) is not "
                   "supported by the functional forward pass")


# Python control flow on Python values only: converting it with autograph
# (which map_fn, vectorized_map and tf.data do by default) costs seconds of
# tracing and changes nothing.
@tf.autograph.experimental.do_not_convert
def forward(model: tf.keras.Model, weights: Sequence[tf.Tensor], x: tf.Tensor,
            tap: Optional[str] = None, records: bool = False):
  """Logits of `model` at trainable `weights` on `x`; with `tap` (a layer
  name), (logits, the input of that layer). With `records` (see the module
  docstring), weights are [R, ...], x is [R, B, ...] and the outputs are
  [R, B, ...]."""
  if tap is not None and tap not in [layer.name for layer in model.layers]:
    raise ValueError(f"tap={tap!r} is not a layer of {model.name}; layers: "
                     f"{[layer.name for layer in model.layers]}")
  count = 0
  if records:
    x = tf.convert_to_tensor(x)
    count = x.shape[0]
    if count is None or any(w.shape[0] != count for w in weights):
      raise ValueError(f"records=True needs inputs and every weight stacked on "
                       f"one static record axis; inputs {x.shape}, weights "
                       f"{[tuple(w.shape) for w in weights]}")
    x = tf.reshape(x, [-1] + x.shape[2:].as_list())
  walk = (_forward_sequential if isinstance(model, tf.keras.Sequential)
          else _forward_graph)
  h, i, tapped = walk(model, weights, x, tap, count)
  if i != len(weights):
    raise ValueError(f"model uses {i} weight tensors, {len(weights)} were given")
  if records:
    def unfold(t):
      if isinstance(t, list):
        return [unfold(part) for part in t]
      t = _folded(t, count)
      return tf.reshape(t, tf.concat([[count, -1], tf.shape(t)[1:]], 0))
    h, tapped = unfold(h), (None if tapped is None else unfold(tapped))
  return h if tap is None else (h, tapped)


def _forward_sequential(model, weights, x, tap, records):
  i, h, tapped = 0, x, None
  for layer in model.layers:
    if layer.name == tap:
      tapped = h
    if not isinstance(layer, _PASS_THROUGH):
      h, i = _apply(layer, weights, i, h, records)
  return h, i, tapped


def _forward_graph(model, weights, x, tap, records):
  """A functional (non-sequential) model with one input and one output:
  each layer, in `model.layers`' topological order (which is also the order
  of its trainable weights), reads the values of its inbound tensors."""
  if len(model.inputs) != 1 or len(model.outputs) != 1:
    raise ValueError(f"model {model.name} has {len(model.inputs)} inputs and "
                     f"{len(model.outputs)} outputs; one of each is supported")
  values = {id(model.inputs[0]): x}
  i, tapped = 0, None
  for layer in model.layers:
    if isinstance(layer, L.InputLayer):
      continue
    if len(layer.inbound_nodes) != 1:
      raise ValueError(f"layer {layer.name} is called {len(layer.inbound_nodes)} "
                       "times; shared layers are not supported")
    node = layer.inbound_nodes[0]
    inputs = [values[id(t)] for t in tf.nest.flatten(node.keras_inputs)]
    h = inputs[0] if len(inputs) == 1 else inputs
    if layer.name == tap:
      tapped = h
    if not isinstance(layer, _PASS_THROUGH):
      h, i = _apply(layer, weights, i, h, records)
    values[id(tf.nest.flatten(node.outputs)[0])] = h
  return values[id(model.outputs[0])], i, tapped


def dense_layers(model: tf.keras.Model) -> list[str]:
  """Names of the model's fully connected layers, input to output."""
  return [layer.name for layer in model.layers if isinstance(layer, L.Dense)]


def representation_dense_layers(model: tf.keras.Model) -> list[str]:
  """Names of the fully connected layers, input to output, whose input is a
  learned representation: computed by an earlier layer with learned weights
  (trainable, or a frozen pretrained stage), not by layers without weights
  (Flatten, pooling, activations) from the model's input alone."""
  learned, names = set(), []  # ids of the tensors that learned weights shaped
  for layer in model.layers:
    if isinstance(layer, L.InputLayer):
      continue
    node = layer.inbound_nodes[0]
    reads = any(id(t) in learned for t in tf.nest.flatten(node.keras_inputs))
    if reads and isinstance(layer, L.Dense):
      names.append(layer.name)
    if reads or layer.weights or isinstance(layer, FrozenStage):
      learned.update(id(t) for t in tf.nest.flatten(node.outputs))
  return names


def kernel_index(model: tf.keras.Model, layer_name: str) -> int:
  """Position of `layer_name`'s kernel among the trainable weights."""
  i = 0
  for layer in model.layers:
    if layer.name == layer_name:
      if not isinstance(layer, _WEIGHTED):
        raise ValueError(f"layer {layer_name!r} has no kernel")
      return i
    if isinstance(layer, _WEIGHTED):
      i += 2 if layer.use_bias else 1
    elif isinstance(layer, Adapter):
      i += len(layer.trainable_weights)
  raise ValueError(f"layer={layer_name!r} is not a layer of {model.name}; "
                   f"dense layers: {dense_layers(model)}")
