"""How much of FedRE's PSI work an implementation skipping the zeros of
its one-hot tangents would still do, against the dense count of
`fedre_round_time.py`: an estimate.

Each PSI JVP differentiates one sample's weight gradient along one (pixel,
channel) of its input. For every convolution and dense layer l of the
run's model, with c_l its multiply-adds per sample, x_l its input and z_l
its output before the activation, let f_l be the nonzero share of the
tangent of x_l and s_l that of the tangent of the loss gradient with
respect to z_l. The multiply-adds whose tangent operand is nonzero (the
primal operands, the weights and x_l and z_l's gradient, count as dense)
are then
* f_l c_l for the forward tangent (scattered from x_l's nonzero entries);
* s_l c_l for the tangent of the gradient with respect to x_l (scattered
  from the nonzero entries of z_l's), where x_l depends on a weight (PSI
  never needs the gradient with respect to the model's input);
* (f_l + s_l) c_l for the tangent of the weight gradient, the sum over
  positions of x_l times z_l's gradient (one term per factor's tangent);
where `fedre_round_time.round_flops` counts a JVP as the sample's forward
and backward pass, (2 + [x_l depends on a weight]) c_l: a floor for dense
tangents, whose weight-gradient tangent alone takes 2 c_l, so the share
below can exceed 1. The benchmark measures f_l and s_l (z_l's gradient
read as the gradient of a per-position copy of the layer's bias) at the
region pixels client 0 scores
(`fedre_round_time.scoring`: its first PSI samples, `psi_pixels` of its
region each), at the run's initial weights, and prints each layer's shares,

  sparse_over_dense = sum of the multiply-adds above / the dense count

and that share of `round_flops`' dense count over the client's training
(`psi_sparse_estimate_over_training`). It is an estimate, not a bound:
the shares are those of the initial model and of the client's own samples,
also applied to PDA-PAM's public ones, and a cleverer scheme could skip
more than zeros.

  python benchmarks/psi_tangent_support.py [--setting docs|digits]
      [--data-kwargs JSON]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import functools
import json

import numpy as np
import tensorflow as tf

import fedre_round_time  # this folder's
from tff_privacy import runtime
from tff_privacy.models.functional import forward, kernel_index

_AFFINE = (tf.keras.layers.Conv2D, tf.keras.layers.Dense)


def output_shape(layer, input_shape) -> tuple:
  """`layer`'s output shape on one sample whose input has `input_shape`."""
  return tuple(layer.compute_output_shape((1, *input_shape))[1:])


def multiply_adds(layer, input_shape) -> int:
  """Multiply-adds of `layer` (a Conv2D or Dense) on one sample whose input
  to the layer has `input_shape` (without the batch axis)."""
  out = output_shape(layer, input_shape)
  if isinstance(layer, tf.keras.layers.Dense):
    return int(np.prod(out)) * int(input_shape[-1])
  kernel = int(np.prod(layer.kernel_size))
  return int(np.prod(out)) * kernel * int(input_shape[-1])


def with_spatial_bias(model, weights, layer, input_shape):
  """`weights` with `layer`'s bias copied to every output position (the
  same outputs; the gradient with respect to the copy is the gradient with
  respect to the layer's output before its activation), and the copy's
  index."""
  index = kernel_index(model, layer.name) + 1
  spatial = tf.broadcast_to(weights[index], output_shape(layer, input_shape))
  return weights[:index] + [spatial] + weights[index + 1:], index


def nonzero_shares(model, weights, loss, layer_name, bias_index, x1, y1, triple):
  """(f, s): the nonzero shares of the tangents of `layer_name`'s input and
  of the loss gradient with respect to `weights[bias_index]` (the layer's
  bias, per position: `with_spatial_bias`), along the one-hot tangent at
  `triple` (row, column, channel) of the sample `x1`."""
  tangent = tf.scatter_nd(triple[None], [1.0], tf.shape(x1))
  with tf.autodiff.ForwardAccumulator(x1, tangent) as acc:
    with tf.GradientTape() as tape:
      tape.watch([x1, weights[bias_index]])
      logits, tapped = forward(model, weights, x1[None], tap=layer_name)
      value = loss(logits, y1[None])
    output_gradient = tape.gradient(value, weights[bias_index])
  share = lambda t: tf.reduce_mean(tf.cast(tf.not_equal(t, 0.0), tf.float32))
  return share(acc.jvp(tapped)), share(acc.jvp(output_gradient))


def depends_on_weights(model, weights, layer_name, x) -> bool:
  """Whether `layer_name`'s input on `x` depends on any of `weights`."""
  with tf.GradientTape() as tape:
    tape.watch(weights)
    tapped = forward(model, weights, tf.constant(x), tap=layer_name)[1]
  return any(g is not None for g in tape.gradient(tapped, weights))


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--setting", choices=fedre_round_time.SETTINGS, default="docs")
  parser.add_argument("--data-kwargs", type=fedre_round_time._json_object, default={},
                      help="the documents' generator's arguments beside the "
                      "protocol's, a JSON object (docs only)")
  args = parser.parse_args()
  if args.data_kwargs and args.setting != "docs":
    parser.error("--data-kwargs: takes the documents' arguments; --setting docs only")
  try:  # an argument the documents lack: one line, not a traceback
    config = fedre_round_time.config(args.setting, "fedre", "unused", {},
                                     args.data_kwargs)
    scored = fedre_round_time.scoring(config)
  except ValueError as e:
    parser.error(f"--data-kwargs: {e}")
  print(f"setting: {args.setting}"
        + (f", documents {json.dumps(args.data_kwargs)}" if args.data_kwargs else ""))
  spec, fed = scored.run.spec, scored.run.fed
  model = spec.keras()
  weights = [tf.constant(w) for w in spec.initial_weights(config.seed)]
  own = fed.client_indices[0][:scored.samples]
  x, y = fed.source.x_train[own].astype(np.float32), fed.source.y_train[own]
  coords = np.argwhere(scored.mask)
  rng = np.random.default_rng(0)
  pixels = [coords[rng.choice(len(coords), min(scored.pixels or len(coords), len(coords)),
                              replace=False)] for _ in x]
  layers = [layer for layer in model.layers if isinstance(layer, _AFFINE)]
  unbiased = [layer.name for layer in layers if not layer.use_bias]
  if unbiased:
    parser.error(f"layers {unbiased} have no bias, whose gradient this reads")
  sparse = dense = 0.0
  for layer in layers:
    shape = forward(model, weights, x[:1], tap=layer.name)[1].shape[1:]
    cost = multiply_adds(layer, shape)
    layer_weights, bias = with_spatial_bias(model, weights, layer, shape)
    compiled = tf.function(functools.partial(
        nonzero_shares, model, layer_weights, spec.task_object.loss, layer.name, bias))
    shares = np.array([
        [float(v) for v in compiled(tf.constant(x1), tf.constant(y1),
                                    tf.constant([row, col, channel], tf.int32))]
        for x1, y1, chosen in zip(x, y, pixels)
        for row, col in chosen for channel in range(x1.shape[-1])])
    f, s = shares.mean(0)
    needs_input_gradient = depends_on_weights(model, weights, layer.name, x[:1])
    sparse += cost * (f + needs_input_gradient * s + f + s)
    dense += cost * (2 + needs_input_gradient)
    print(f"{layer.name}: multiply_adds={cost} input_tangent_nonzero={f:.3g} "
          f"output_gradient_tangent_nonzero={s:.3g}", flush=True)
  training, _, dense_flops = fedre_round_time.round_flops(config)
  print(f"sparse_over_dense={sparse / dense:.3f}")
  print(f"psi_dense_over_training={dense_flops / training:.2f} "
        f"psi_sparse_estimate_over_training={sparse / dense * dense_flops / training:.2f}")


if __name__ == "__main__":
  main()
