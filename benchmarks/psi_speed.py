"""FedRE's PSI scores: the forward-mode path against the nested-tape
reference (eq. 3 as written), measured in one process on the same model,
samples and region.

Two task models (`--dataset`): a ReLU CNN on bundled 28x28 MNIST digits
(`mnist5k`, default `cnn`, about 110k parameters) and FedRE's own task, the
U-Net (8, 16, 32) segmenting 64x64 synthetic documents (`docs`). The region
is the central square of `--box` pixels a side, by default a quarter of
each side (1/16 of the image). Both paths run as compiled `tf.function`s;
each is timed on a second call (the ratio `speedup_over_nested_tape`) and
on its first, tracing included (`speedup_first_call`).

  python benchmarks/psi_speed.py [--dataset mnist5k|docs] [--model M]
      [--samples 1] [--box B]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the CUDA plugin lines

import argparse
import time

import numpy as np
import tensorflow as tf

from tff_privacy import data, models, psi, runtime

DEFAULT_MODELS = {"mnist5k": ("cnn", {}), "docs": ("unet", {"widths": [8, 16, 32]})}


def timed(fn):
  start = time.perf_counter()
  result = fn()
  return result, time.perf_counter() - start


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", default="mnist5k", choices=sorted(DEFAULT_MODELS))
  parser.add_argument("--model", choices=sorted(models.MODELS),
                      help="default: cnn on mnist5k, unet on docs")
  parser.add_argument("--samples", type=int, default=1)
  parser.add_argument("--box", type=int,
                      help="side of the central square region, in pixels "
                      "(default: a quarter of the image's side)")
  args = parser.parse_args()
  src = data.load_source(args.dataset)
  height, width = src.input_shape[:2]
  if args.box is None:
    args.box = min(height, width) // 4
  if not 1 <= args.box <= min(height, width):
    parser.error(f"--box must lie in [1, {min(height, width)}], got {args.box}")
  name, kwargs = ((args.model, {}) if args.model
                  else DEFAULT_MODELS[args.dataset])
  try:
    spec = models.ModelSpec(name, src.input_shape, src.num_classes, kwargs,
                            task=src.task)
  except ValueError as e:
    parser.error(str(e))
  loss = spec.task_object.loss
  model = spec.keras()
  weights = [tf.constant(w) for w in spec.initial_weights(0)]
  x, y = src.x_train[:args.samples], src.y_train[:args.samples]
  top, left = (height - args.box) // 2, (width - args.box) // 2
  mask = psi.box_mask([[left, top, left + args.box, top + args.box]], height, width)
  masks = np.repeat(mask[None], len(x), axis=0)

  fast = tf.function(lambda: psi.psi_scores(model, weights, x, y, masks, loss).scores)
  reference = tf.function(
      lambda: psi.psi_scores_nested_tape(model, weights, x, y, masks, loss))
  _, fast_first = timed(fast)
  scores, fast_warm = timed(fast)
  _, reference_first = timed(reference)
  expected, reference_warm = timed(reference)
  scores, expected = scores.numpy(), expected.numpy()
  difference = np.max(np.abs(scores - expected) / np.maximum(np.abs(expected), 1e-30))
  params = sum(int(np.prod(w.shape)) for w in weights)
  print(f"dataset={args.dataset} model={name} parameters={params} tensors={len(weights)} "
        f"samples={len(x)} region_pixels={int(mask.sum())} "
        f"image_pixels={height * width}")
  print(f"nested_tape_s={reference_warm:.2f} (first call {reference_first:.2f}) "
        f"fast_s={fast_warm:.3f} (first call {fast_first:.2f})")
  print(f"speedup_over_nested_tape={reference_warm / fast_warm:.1f}")
  print(f"speedup_first_call={reference_first / fast_first:.1f}")
  print(f"max_relative_difference={difference:.2e}")


if __name__ == "__main__":
  main()
