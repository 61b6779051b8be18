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
whose channel groups are the records), dense layers are batched matmuls, and
stateless layers see the records folded into the batch. The gradient of a
sum of per-record losses with respect to the stacked weights is then every
record's own gradient, which is how attacks search many records in one
compiled computation without vectorising a per-record graph.
"""

from __future__ import annotations

from typing import Optional, Sequence

import tensorflow as tf

from tff_privacy.models.lpm import Adapter, FrozenStage

L = tf.keras.layers
_PASS_THROUGH = (L.InputLayer, L.Dropout)
_WEIGHTED = (L.Conv2D, L.Dense)
_STATELESS = (L.MaxPool2D, L.Flatten, L.Activation, L.LeakyReLU, L.ReLU,
              L.ZeroPadding2D, L.GlobalAveragePooling2D, L.Concatenate, L.Add,
              FrozenStage)


def _conv(layer, h, kernel, bias, records):
  """`layer`'s convolution plus bias; with `records` R, h is [R*B, H, W, C],
  the kernel [R, kh, kw, C, O] and the bias [R, O], applied as one
  convolution of R channel groups."""
  conv = lambda inputs, k: tf.nn.conv2d(
      inputs, k, strides=layer.strides, padding=layer.padding.upper(),
      dilations=layer.dilation_rate)
  if not records:
    h = conv(h, kernel)
    return h if bias is None else h + bias
  _, rows, cols, c = h.shape
  kh, kw, _, o = kernel.shape[1:]
  grouped = tf.transpose(tf.reshape(h, [records, -1, rows, cols, c]), [1, 2, 3, 0, 4])
  k = tf.reshape(tf.transpose(kernel, [1, 2, 3, 0, 4]), [kh, kw, c, records * o])
  out = conv(tf.reshape(grouped, [-1, rows, cols, records * c]), k)
  if bias is not None:
    out += tf.reshape(bias, [records * o])
  _, rows, cols, _ = out.shape
  out = tf.transpose(tf.reshape(out, [-1, rows, cols, records, o]), [3, 0, 1, 2, 4])
  return tf.reshape(out, [-1, rows, cols, o])


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
  i). `records`: the number of records whose weights are stacked (0: none)."""
  if isinstance(layer, _WEIGHTED):
    kernel = weights[i]
    bias = weights[i + 1] if layer.use_bias else None
    i += 2 if layer.use_bias else 1
    affine = _conv if isinstance(layer, L.Conv2D) else _dense
    return layer.activation(affine(layer, h, kernel, bias, records)), i
  if isinstance(layer, L.UpSampling2D) and layer.interpolation == "nearest":
    # repeats, not TensorFlow's resize op, whose gradient has no gradient:
    # PSI and attacks differentiate twice through this layer
    rows, cols = layer.size
    return tf.repeat(tf.repeat(h, rows, axis=1), cols, axis=2), i
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
    count = x.shape[0]
    if count is None:
      raise ValueError("records=True needs a static number of records")
    x = tf.reshape(x, [-1] + x.shape[2:].as_list())
  walk = (_forward_sequential if isinstance(model, tf.keras.Sequential)
          else _forward_graph)
  h, i, tapped = walk(model, weights, x, tap, count)
  if i != len(weights):
    raise ValueError(f"model uses {i} weight tensors, {len(weights)} were given")
  if records:
    unfold = lambda t: tf.reshape(t, tf.concat([[count, -1], tf.shape(t)[1:]], 0))
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
