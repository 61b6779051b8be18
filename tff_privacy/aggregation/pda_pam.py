"""PDA-PAM (FedRE eqs. 10-11): aggregation weighted by each upload's PSI
score on a public data set.

Round t, K clients, the server's model w~ and uploads d_k (TFF's sign
convention: d_k = w~ - w^k = eta g_k, the client's noisy gradient g_k times
eq. 11's eta, see `tff_privacy.algorithms.fedre`):

```text
eq. 10  alpha_l^k = exp(S_l(w^k; D)) / sum_j exp(S_l(w^j; D)), where
        S_l(w^k; D) is the PSI score (eqs. 3-5) of tensor l of the
        client's model w^k = w~ - d_k on the public set D with its regions
eq. 11  'paper':      aggregate_l = (1 / K) sum_k d_l^k / alpha_l^k
        'normalized' (default): aggregate_l = sum_k beta_l^k d_l^k with
                      beta_l^k = (1 / alpha_l^k) / sum_j (1 / alpha_l^j),
                      i.e. softmax(-S_l) over clients
```

and the server's optimizer applies w = w~ - lr * aggregate (lr 1 gives eq.
11 with eta folded into d_k). Both rules favour uploads whose model reacts
less to the public regions. Eq. 11 as written divides by weights that sum to
1, so its step is sum_k 1 / (K alpha_l^k) >= K times a weighted mean (K when
all scores agree); 'normalized' keeps the step size of a plain mean. The
measurements report that factor per tensor (`paper_step_scale`). Scores of
a U-Net under moderate noise span 1e-6 to 0.1, so eq. 10's softmax is
near uniform and eq. 11's step is K times the mean's: a sum, not a
preference. Hence 'normalized' is the default and eq. 11 as written an
ablation.

Eq. 10 exponentiates the raw score, so the weights depend on the score's
unit: two clients whose scores differ by 20 get weights e^20 apart, whatever
the scores' size. Under the paper's noise a U-Net's scores reach 1e20, and
every weight but the lowest-scoring client's vanishes. `score_scale='log'`
puts log S_l in eq. 10 instead, alpha_l^k = S_l^k / sum_j S_l^j, which
depends only on the scores' ratios; 'linear' (the default) is eq. 10.

Non-finite uploads. The paper does not say what happens when a score or an
upload is not finite (a diverged client, or a noisy model whose derivatives
overflow). Here tensor l of client k is left out of that tensor's sums when
S_l^k or d_l^k is not finite, which is eq. 10's limit as S_l^k grows (its
1 / alpha_l^k, relative to the others', goes to 0), and K in eq. 11 counts
the clients kept; a tensor no client kept aggregates to 0 (the model stays
put there). The measurement `excluded_uploads` counts the clients left out
per tensor.

Where it runs. TFF's aggregator interface (`tff.aggregators`) sees the
uploads but not the broadcast model, which eq. 10 needs. PDA-PAM is
therefore a federated computation of (the server's model, the uploads),
and `compose_with_server_aggregation` builds a `LearningProcess` around any
method's client work with it; the method's ordinary aggregator still runs on
the same uploads, so upload capture and its measurements work unchanged,
but its result is replaced (a plain mean, which measures nothing, is not
run at all). TFF 0.87 has no `federated_collect`, so the
scoring of each upload, a function of that upload, the broadcast model and
the public set only (no client data), is mapped where the uploads are, and
only the scores and weighted sums reach the server, in the form

```text
sum_k d_k / alpha^k = e^(M - m) (sum_j e^(S^j - M)) (sum_k e^(m - S^k) d_k)
```

with M and m the largest and smallest score (`federated_max`/`min`), which
never overflows except through e^(M - m) itself: that factor is capped at
e^80 (a spread that large makes eq. 11's step meaningless anyway) and the
measurement `spread_capped` is 1 for each tensor where the cap applied.

Trust: the mapped scoring is the server's computation, placed beside the
uploads only because of that TFF limitation; in this simulation no client
code touches it. A deployment must run it on the server over the uploads it
received: scores reported by clients would let a client claim the lowest
score and, under eq. 11, a weight of at least e^(M - m).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence, Union

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import psi
from tff_privacy.aggregation.wide_sum import (MEAN_MEASUREMENTS, WideMeanFactory,
                                             federated_wide_sum, wide_mean_factory)

UPDATE_RULES = ("paper", "normalized")
SCORE_SCALES = ("linear", "log")
MAX_LOG_SPREAD = 80.0


@dataclasses.dataclass(frozen=True)
class PublicRegions:
  """The server's public samples of one data category with their regions:
  x [N, H, W, C], labels y [N, ...] and boolean region masks [N, H, W]."""

  x: np.ndarray
  y: np.ndarray
  masks: np.ndarray

  def __post_init__(self):
    if not (len(self.x) == len(self.y) == len(self.masks)) or not len(self.x):
      raise ValueError(f"public set: x, y and masks need the same, non-zero "
                       f"length; got {len(self.x)}, {len(self.y)}, {len(self.masks)}")
    if self.masks.shape != self.x.shape[:3] or not self.masks.any(axis=(1, 2)).all():
      raise ValueError(f"public set: masks must have shape {self.x.shape[:3]} and "
                       "select at least one pixel per sample")


def build_pda_pam(spec, public: Union[PublicRegions, Sequence[PublicRegions]],
                  *, rule: str = "normalized", score_scale: str = "linear",
                  pixels: Optional[int] = None,
                  loss_fn: psi.scores.LossFn = psi.scores.CLASSIFICATION_LOSS
                  ) -> tff.Computation:
  """PDA-PAM as a federated computation.

  Args:
    spec: the `tff_privacy.models.ModelSpec` of the uploads.
    public: the public samples and regions the server scores with, one set
      per profile (a client's data category and privacy preference), all of
      the same size; a single set serves every client.
    rule: 'normalized' (default) or 'paper' (eq. 11 as written, see the
      module).
    score_scale: 'linear' (eq. 10 as written) or 'log' (log S in eq. 10,
      see the module).
    pixels: region pixels per public sample for the PSI estimator (None:
      exact).
    loss_fn: the task's loss, as in `tff_privacy.psi.psi_scores`.

  Returns:
    A `tff.Computation` (server weights@SERVER, uploads@CLIENTS, each
    upload's profile index@CLIENTS) -> (aggregate@SERVER,
    measurements@SERVER).

  Raises:
    ValueError: for an unknown `rule` or `score_scale`, or public sets of
      different sizes.
  """
  if rule not in UPDATE_RULES:
    raise ValueError(f"rule={rule!r}; choose one of {UPDATE_RULES}")
  if score_scale not in SCORE_SCALES:
    raise ValueError(f"score_scale={score_scale!r}; choose one of {SCORE_SCALES}")
  sets = [public] if isinstance(public, PublicRegions) else list(public)
  if not sets or len({len(p.x) for p in sets}) != 1:
    raise ValueError(f"public sets: need at least one, all of one size; got "
                     f"sizes {[len(p.x) for p in sets]}")
  trainable = tff.types.tensorflow_to_type(
      [tf.TensorSpec(w.shape, tf.float32) for w in spec.initial_weights(0)])
  public_x = np.stack([p.x for p in sets]).astype(np.float32)
  public_y = np.stack([p.y for p in sets])
  public_masks = np.stack([p.masks for p in sets])

  # scoring and its exponents in one computation: each call of a
  # computation per client costs a round trip through TFF's executor
  @tff.tensorflow.computation(trainable, trainable, np.int32)
  def usable(server_weights, update, profile):
    """Each tensor's exponent of eq. 10 (its PSI score on the public
    samples of the client's profile) where it and its upload are finite;
    -inf (for the max) and inf (for the min) elsewhere."""
    client_model = [w - d for w, d in zip(server_weights, update)]
    scores = tf.reduce_mean(psi.psi_scores(
        spec.keras(), client_model, tf.gather(public_x, profile),
        tf.gather(public_y, profile), tf.gather(public_masks, profile),
        loss_fn, pixels=pixels).scores, 0)
    if score_scale == "log":
      scores = tf.math.log(scores)
    ok = _finite(update, scores)
    return tf.where(ok, scores, -np.inf), tf.where(ok, scores, np.inf)

  score_type = usable.type_signature.result[0]

  @tff.tensorflow.computation(trainable, usable.type_signature.result,
                              (score_type, score_type))
  def weigh(update, exponents, bounds):
    high, low = bounds
    scores = exponents[0]
    ok = tf.math.is_finite(scores)
    down = tf.where(ok, tf.exp(low - scores), 0.0)
    return collections.OrderedDict(
        updates=[tf.where(ok[l], d * down[l], 0.0) for l, d in enumerate(update)],
        down=down, up=tf.where(ok, tf.exp(scores - high), 0.0),
        count=tf.cast(ok, tf.float32), clients=tf.ones_like(scores))

  @tff.tensorflow.computation(weigh.type_signature.result, score_type, score_type)
  def combine(sums, high, low):
    spread = tf.exp(tf.minimum(high - low, MAX_LOG_SPREAD))
    if rule == "normalized":
      scale = tf.math.divide_no_nan(1.0, sums["down"])
    else:
      scale = tf.math.divide_no_nan(spread * sums["up"], sums["count"])
    aggregate = [d * scale[l] for l, d in enumerate(sums["updates"])]
    step = tf.math.divide_no_nan(spread * sums["up"] * sums["down"], sums["count"])
    capped = tf.cast(high - low > MAX_LOG_SPREAD, tf.float32)
    return aggregate, collections.OrderedDict(
        score_max=high, score_min=low, paper_step_scale=step,
        spread_capped=capped, excluded_uploads=sums["clients"] - sums["count"])

  @tff.federated_computation(tff.FederatedType(trainable, tff.SERVER),
                             tff.FederatedType(trainable, tff.CLIENTS),
                             tff.FederatedType(np.int32, tff.CLIENTS))
  def aggregate(server_weights, updates, profiles):
    exponents = tff.federated_map(usable, (tff.federated_broadcast(server_weights),
                                           updates, profiles))
    high = tff.federated_max(exponents[0])
    low = tff.federated_min(exponents[1])
    bounds = tff.federated_broadcast(tff.federated_zip((high, low)))
    sums = federated_wide_sum(tff.federated_map(weigh, (updates, exponents, bounds)))
    return tff.federated_map(combine, (sums, high, low))

  return aggregate


def _finite(update, scores) -> tf.Tensor:
  """[L]: whether tensor l's score and all of its upload are finite."""
  return tf.logical_and(tf.math.is_finite(scores), tf.stack(
      [tf.reduce_all(tf.math.is_finite(d)) for d in update]))


def compose_with_server_aggregation(
    initial_model_weights_fn: tff.Computation, client_work, server_aggregation,
    server_optimizer, client_profile_fn: Optional[tff.Computation],
    model_aggregator=None) -> tff.learning.templates.LearningProcess:
  """A `LearningProcess` like `tff.learning.templates.compose_learning_process`
  whose server step uses `server_aggregation` (e.g. `build_pda_pam`'s) on
  (the broadcast model, the uploads, the clients' profiles) instead of the
  model aggregator's result. `client_profile_fn` maps a client's data to
  its profile index, which the client declares (its data category, public
  like the region it chose for the server's scoring); None gives every
  client profile 0 without reading its data, for a `server_aggregation`
  built on one public set (with several, every client would be scored on
  the first).
  `model_aggregator` (a weighted factory, default a mean) still runs on the
  uploads for its measurements, e.g. upload capture; a plain
  `WideMeanFactory`, which measures nothing, keeps its state and does not
  run."""
  weights_type = initial_model_weights_fn.type_signature.result
  # a plain mean's result is replaced and it measures nothing: not run
  mean_unused = model_aggregator is None or isinstance(model_aggregator, WideMeanFactory)
  distributor = tff.learning.templates.build_broadcast_process(weights_type)
  aggregator = (model_aggregator or wide_mean_factory()).create(
      weights_type.trainable, tff.TensorType(np.float32))
  finalizer = tff.learning.templates.build_apply_optimizer_finalizer(
      server_optimizer, weights_type)
  State = tff.learning.templates.LearningAlgorithmState

  @tff.tensorflow.computation(weights_type)
  def trainable_of(weights):
    return weights.trainable

  @tff.federated_computation()
  def init_fn():
    return tff.federated_zip(State(
        tff.federated_eval(initial_model_weights_fn, tff.SERVER),
        distributor.initialize(), client_work.initialize(),
        aggregator.initialize(), finalizer.initialize()))

  state_type = init_fn.type_signature.result
  data_type = client_work.next.type_signature.parameter[2]

  @tff.federated_computation(state_type, data_type)
  def next_fn(state, data):
    sent = distributor.next(state.distributor, state.global_model_weights)
    work = client_work.next(state.client_work, sent.result, data)
    if mean_unused:
      mean = tff.templates.MeasuredProcessOutput(
          state.aggregator, None, tff.federated_value(MEAN_MEASUREMENTS, tff.SERVER))
    else:
      mean = aggregator.next(state.aggregator, work.result.update,
                             work.result.update_weight)
    trainable = tff.federated_map(trainable_of, state.global_model_weights)
    profiles = (tff.federated_value(np.int32(0), tff.CLIENTS)
                if client_profile_fn is None
                else tff.federated_map(client_profile_fn, data))
    aggregate, server_measurements = server_aggregation(
        trainable, work.result.update, profiles)
    final = finalizer.next(state.finalizer, state.global_model_weights, aggregate)
    new_state = tff.federated_zip(State(final.result, sent.state, work.state,
                                        mean.state, final.state))
    metrics = tff.federated_zip(collections.OrderedDict(
        distributor=sent.measurements, client_work=work.measurements,
        aggregator=mean.measurements, server_aggregation=server_measurements,
        finalizer=final.measurements))
    return tff.learning.templates.LearningProcessOutput(new_state, metrics)

  model_weights_type = state_type.member.global_model_weights

  @tff.tensorflow.computation(state_type.member)
  def get_model_weights(state):
    return state.global_model_weights

  @tff.tensorflow.computation(state_type.member, model_weights_type)
  def set_model_weights(state, weights):
    return State(weights, state.distributor, state.client_work,
                 state.aggregator, state.finalizer)

  return tff.learning.templates.LearningProcess(init_fn, next_fn,
                                                get_model_weights,
                                                set_model_weights)

