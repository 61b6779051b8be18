"""How much of FedRE's PSI work an implementation exploiting the one-hot
tangents' sparsity would still do, against the dense count of
`fedre_round_time.py`.

Each PSI JVP differentiates one sample's gradient along one (pixel,
channel) of its input. For every convolution and dense layer l of the
run's model, with c_l its multiply-adds per sample, an implementation that
skipped the tangents' zero entries would still compute
* the layer's forward tangent from the nonzero entries of its input's
  tangent, each costing c_l / (entries of the input): f_l c_l, f_l the
  nonzero share of those entries;
* the tangent of the gradient with respect to the layer's input at its
  nonzero entries, each costing c_l / (entries of the input): b_l c_l;
* the tangent of the weight gradient, left out here (so the estimate is
  low);
where forward-over-reverse with dense tangents does the forward pass, the
input gradient and the weight gradient in full, 3 c_l. The benchmark
measures f_l and b_l at the region pixels of the samples client 0 scores
(`fedre_round_time.scoring`: its own PSI samples, at `psi_pixels` of its
region), at the run's initial weights, and prints each layer's shares and

  sparse_over_dense = sum_l c_l (f_l + b_l) / sum_l 3 c_l

then that share of `fedre_round_time.round_flops`' dense count over the
client's training (`psi_sparse_estimate_over_training`): about what PSI
would still add to FedAvg's client work, in operations, however its
sparsity were used.

  python benchmarks/psi_tangent_support.py [--setting docs|digits]
      [--data-kwargs JSON]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import functools

import numpy as np
import tensorflow as tf

import fedre_round_time  # this folder's
from tff_privacy import runtime
from tff_privacy.models.functional import forward

_WEIGHTED = (tf.keras.layers.Conv2D, tf.keras.layers.Dense)


def multiply_adds(layer, input_shape) -> int:
  """Multiply-adds of `layer` (a Conv2D or Dense) on one sample whose input
  to the layer has `input_shape` (without the batch axis)."""
  if isinstance(layer, tf.keras.layers.Dense):
    return int(np.prod(input_shape)) * layer.units
  rows, cols = layer.compute_output_shape((1, *input_shape))[1:3]
  kernel = int(np.prod(layer.kernel_size))
  return rows * cols * kernel * int(input_shape[-1]) * layer.filters


def nonzero_shares(model, weights, loss, layer_name, x1, y1, triple):
  """(f, b): the nonzero shares of the tangents of `layer_name`'s input and
  of the loss gradient with respect to that input, along the one-hot
  tangent at `triple` (row, column, channel) of the sample `x1`."""
  tangent = tf.scatter_nd(triple[None], [1.0], tf.shape(x1))
  with tf.autodiff.ForwardAccumulator(x1, tangent) as acc:
    with tf.GradientTape() as tape:
      tape.watch(x1)
      logits, tapped = forward(model, weights, x1[None], tap=layer_name)
      value = loss(logits, y1[None])
    grad = tape.gradient(value, tapped)
  share = lambda t: tf.reduce_mean(tf.cast(tf.not_equal(t, 0.0), tf.float32))
  return share(acc.jvp(tapped)), share(acc.jvp(grad))


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
  config = fedre_round_time.config(args.setting, "fedre", "unused", {},
                                   args.data_kwargs)
  scored = fedre_round_time.scoring(config)
  if scored is None or not scored.own:
    parser.error("the run scores none of its clients' samples")
  run, spec = scored.run, scored.run.spec
  model = spec.keras()
  weights = [tf.constant(w) for w in spec.initial_weights(config.seed)]
  client = run.round_data(1)[0]
  x, y = client.x[:scored.samples], client.y[:scored.samples]
  rng = np.random.default_rng(0)
  coords = np.argwhere(scored.mask)
  layers = [l for l in model.layers if isinstance(l, _WEIGHTED)]
  costs, forward_shares, backward_shares = [], [], []
  for layer in layers:
    shape = forward(model, weights, tf.constant(x[:1], tf.float32), tap=layer.name)[1].shape[1:]
    costs.append(multiply_adds(layer, shape))
    shares = []
    compiled = tf.function(functools.partial(
        nonzero_shares, model, weights, spec.task_object.loss, layer.name))
    for x1, y1 in zip(x, y):
      take = rng.choice(len(coords), min(scored.pixels or len(coords), len(coords)),
                        replace=False)
      for row, col in coords[take]:
        for channel in range(x1.shape[-1]):
          shares.append([float(v) for v in compiled(
              tf.constant(x1, tf.float32), tf.constant(y1),
              tf.constant([row, col, channel], tf.int32))])
    forward_shares.append(np.mean([s[0] for s in shares]))
    backward_shares.append(np.mean([s[1] for s in shares]))
    print(f"{layer.name}: multiply_adds={costs[-1]} input_tangent_nonzero="
          f"{forward_shares[-1]:.3g} input_gradient_tangent_nonzero="
          f"{backward_shares[-1]:.3g}", flush=True)
  costs = np.array(costs, float)
  fraction = float(np.sum(costs * (np.array(forward_shares) + np.array(backward_shares)))
                   / (3 * np.sum(costs)))
  training, _, dense = fedre_round_time.round_flops(config)
  print(f"sparse_over_dense={fraction:.3f}")
  print(f"psi_dense_over_training={dense / training:.2f} "
        f"psi_sparse_estimate_over_training={fraction * dense / training:.2f}")


if __name__ == "__main__":
  main()
