"""DP-SGD (Abadi et al. 2016) inside a client's local training.

Each step clips every example's gradient to L2 norm C, sums them, adds
Gaussian noise N(0, (sigma C)^2) to each coordinate and divides by the batch
size. Clipping and noise are a tensorflow-privacy `GaussianSumQuery` (seeded,
`SeededGaussianSumQuery`), the accounting is `dp_accounting`'s: T steps, each
the Gaussian mechanism on a Poisson sample of rate q = B / n, composed with
the RDP accountant. `noise_multiplier_for` finds the sigma that spends a
target (epsilon, delta) over T steps, as Opacus' `get_noise_multiplier` does
for the HyperFL paper's DP baselines.

The guarantee is sample-level: neighbouring data sets differ in one training
example of one client. It holds for batches drawn as the accountant assumes
(`poisson_sample`: every example joins a step's batch independently with
probability q, so batch sizes vary), whose noisy sum is divided by the
expected batch size q n, not by the batch's own size, as tensorflow-privacy
does. Shuffled fixed-size batches, what the papers' code steps through, are
not what the accountant describes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import dp_accounting
import tensorflow as tf

from tff_privacy.dp.queries import (LayerwiseGaussianQuery,
                                   SeededGaussianSumQuery, with_seed)

RELATION = ("sample-level: add or remove one training example of one client; "
            "every step's batch Poisson-sampled at rate batch_size / n")


def steps_event(noise_multiplier: float, sample_rate: float,
                steps: int) -> dp_accounting.DpEvent:
  """The DP event of `steps` DP-SGD steps at sampling rate `sample_rate`."""
  if not 0 < sample_rate <= 1:
    raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}")
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")
  step = dp_accounting.GaussianDpEvent(noise_multiplier)
  if sample_rate < 1:
    step = dp_accounting.PoissonSampledDpEvent(sample_rate, step)
  return dp_accounting.SelfComposedDpEvent(step, steps)


def noise_multiplier_for(target_epsilon: float, target_delta: float,
                         sample_rate: float, steps: int) -> float:
  """The smallest sigma (to 1e-3) whose `steps_event` spends at most
  (`target_epsilon`, `target_delta`) under the RDP accountant."""
  if not target_epsilon > 0:
    raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}")
  if not 0 < target_delta < 1:
    raise ValueError(f"target_delta must lie in (0, 1), got {target_delta}")
  steps_event(1.0, sample_rate, steps)  # checks the arguments
  return float(dp_accounting.calibrate_dp_mechanism(
      dp_accounting.rdp.RdpAccountant,
      lambda sigma: steps_event(sigma, sample_rate, steps),
      target_epsilon, target_delta,
      dp_accounting.mechanism_calibration.LowerEndpointAndGuess(1e-3, 1.0),
      tol=1e-3))


def poisson_sample(num_examples: tf.Tensor, rate: tf.Tensor,
                   seed: tf.Tensor) -> tf.Tensor:
  """bool[num_examples]: which examples join a step's batch, each
  independently with probability `rate` (a stateless draw from the int64[2]
  `seed`)."""
  draws = tf.random.stateless_uniform(tf.reshape(num_examples, [1]), seed,
                                      dtype=tf.float64)
  return draws < tf.cast(rate, tf.float64)


def private_gradient(per_example_grads: Sequence[tf.Tensor],
                     l2_norm_clip: float, noise_multiplier: tf.Tensor,
                     seed: tf.Tensor,
                     denominator: Optional[tf.Tensor] = None) -> list[tf.Tensor]:
  """One DP-SGD step's gradient from the batch's per-example gradients.

  Args:
    per_example_grads: one tensor per variable, the batch on axis 0.
    l2_norm_clip: C, the bound on each example's gradient (over all of the
      given variables together).
    noise_multiplier: sigma; the noise's std is sigma * C.
    seed: int64[2], the stateless seed of this step's noise.
    denominator: what the noisy sum is divided by: the expected batch size
      of a Poisson-sampled batch (which may be empty); default: the batch's
      size.

  Returns:
    (sum of clipped gradients + noise) / denominator, per variable.
  """
  query = SeededGaussianSumQuery(l2_norm_clip, 1.0)
  state = query.initial_global_state()._replace(
      stddev=tf.cast(noise_multiplier * l2_norm_clip, tf.float32))
  state = with_seed(query, state, seed)
  total = clipped_sum(per_example_grads, l2_norm_clip)
  noised, _, _ = query.get_noised_result(total, state)
  if denominator is None:
    denominator = tf.shape(per_example_grads[0])[0]
  return [t / tf.cast(denominator, tf.float32) for t in noised]


def clipped_sum(per_example_grads: Sequence[tf.Tensor],
                l2_norm_clip: float) -> list[tf.Tensor]:
  """Sum over the batch of each example's gradient clipped to global L2 norm
  `l2_norm_clip`: what `GaussianSumQuery.preprocess_record` and
  `accumulate_record` do record by record, here for the whole batch at once
  (its `tf.clip_by_global_norm` has no vectorised form)."""
  squares = [tf.reduce_sum(tf.reshape(g, [tf.shape(g)[0], -1]) ** 2, axis=1)
             for g in per_example_grads]
  norms = tf.sqrt(tf.add_n(squares))
  scale = l2_norm_clip / tf.maximum(norms, l2_norm_clip)
  return [tf.tensordot(scale, g, axes=1) for g in per_example_grads]


def layerwise_private_gradient(per_example_grads: Sequence[tf.Tensor],
                               l2_norm_clip: float, noise_multipliers: tf.Tensor,
                               seed: tf.Tensor,
                               denominator: tf.Tensor) -> list[tf.Tensor]:
  """One DP-SGD step's gradient with a clip and a noise multiplier per
  tensor: every example's gradient of tensor l clipped to L2 norm C =
  `l2_norm_clip` on its own, summed over the batch, plus Gaussian noise of
  std C sigma_l (`noise_multipliers` [L], a `LayerwiseGaussianQuery` seeded
  by the int64[2] `seed`), divided by `denominator` (a Poisson batch's
  expected size)."""
  num_layers = len(per_example_grads)
  query = LayerwiseGaussianQuery([l2_norm_clip] * num_layers, [1.0] * num_layers)
  state = with_seed(query, query.initial_global_state(), seed)
  stddevs = tf.unstack(l2_norm_clip * tf.cast(noise_multipliers, tf.float32),
                       num=num_layers)
  state = type(state)(s._replace(stddev=d) for s, d in zip(state, stddevs))
  total = [clipped_sum([g], l2_norm_clip)[0] for g in per_example_grads]
  noised, _, _ = query.get_noised_result(total, state)
  return [t / tf.cast(denominator, tf.float32) for t in noised]
