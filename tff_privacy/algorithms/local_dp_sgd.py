"""What the HyperFL paper's DP baselines share: local DP-SGD on the client.

DP-FedAvg (`dp_sgd_fedavg`), PPSGD (`ppsgd`) and CENTAUR (`centaur`) run
DP-SGD (`tff_privacy.dp.dp_sgd`) in their clients' local steps, as in the
authors' code: each example's gradient clipped to `l2_norm_clip` (0.04),
Gaussian noise of std `noise_multiplier * l2_norm_clip` added to the sum,
divided by the batch size (the expected one for Poisson batches, below).
Unless given, the noise multiplier is calibrated (RDP) so that a client
spends `target_epsilon` (4) at `target_delta` (1e-5) over all its DP steps
of the run: rounds x DP epochs per round x batches per epoch, each a
Poisson sample at rate batch_size / n. Clients of unequal sizes share one
noise multiplier. The smallest client (the highest sampling rate) does not
always spend the most: one whose epoch ends in a short batch takes an extra
step at nearly the same rate (batches of 10, one epoch, two rounds, the
noise for epsilon 4 at 30 examples: a client of 31 spends 4.39). So the
clients are grouped by their steps per round, each group priced at its
highest rate (`DPSGD.samplings`); the multiplier is the largest that any
group needs, and the epsilon reported is the largest group's, a bound for
every client.

How a DP step's batch is drawn (`batch_sampling`):

* 'poisson' (default), what the accountant assumes: a client with n
  examples takes as many steps as its batches of size B (`poisson_batches`),
  and every one of its n examples joins each step's batch independently
  with probability q = B / n, so batch sizes vary (a batch may be empty); the
  noisy sum is divided by the expected batch size q n = B;
* 'shuffle', the papers' code: the fixed-size batches of a shuffled pass.
  The accountant's Poisson sampling does not describe them, so such runs
  report no epsilon (null, with the reason); the noise is calibrated as for
  'poisson'.

Every DP step draws its noise and its Poisson sample from a seed of (run,
round, client, step), so runs are reproducible and a resumed run equals an
uninterrupted one.

Also here: the plumbing of the two methods that share a DP-trained feature
extractor (the "body": every tensor but the last dense layer) and keep the
classifier private (PPSGD, CENTAUR).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import math
from typing import Optional, Sequence

import dp_accounting
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import params
from tff_privacy.aggregation.wide_sum import federated_wide_sum
from tff_privacy.algorithms import personalized
from tff_privacy.algorithms.base import Federation, PrivateState
from tff_privacy.algorithms import client_data
from tff_privacy.algorithms.client_data import SEED_KEY, client_seed
from tff_privacy.data import reads
from tff_privacy.defenses.updates import UpdateDefense, per_tensor_at_norm
from tff_privacy.dp import accounting, dp_sgd
from tff_privacy.models.functional import forward
from tff_privacy.models.hypernetwork import num_extractor_tensors

BATCH_SAMPLINGS = ("poisson", "shuffle")
# why a run on shuffled batches reports no epsilon (metrics' epsilon_note)
SHUFFLE_NOTE = ("not accounted: the DP steps ran on fixed-size batches of a "
                "shuffled pass, which the accountant's Poisson sampling does "
                "not describe; batch_sampling 'poisson' is accounted")
# every Poisson batch carries its expected size, the noisy sum's divisor
EXPECTED_SIZE_KEY = "expected_batch_size"
# folded into the round's seed for the Poisson draws (noise folds in step
# numbers, which stay far below it)
SAMPLING_STREAM = 2**31 - 1

PARAMETERS = (
    params.Param("l2_norm_clip", float, 0.04, "C, the bound on each example's "
                 "gradient", minimum=0, exclusive_minimum=True, flag="dp-clip"),
    params.Param("noise_multiplier", float, None, "sigma, noise std over C "
                 "(default: calibrated to target_epsilon over the run)",
                 minimum=0, flag="dp-noise-multiplier"),
    params.Param("target_epsilon", float, 4.0, "epsilon a client spends over "
                 "the run (calibrates the noise)", minimum=0,
                 exclusive_minimum=True),
    params.Param("target_delta", float, 1e-5, "delta of target_epsilon",
                 minimum=0, maximum=1, exclusive_minimum=True,
                 exclusive_maximum=True),
    params.Param("batch_sampling", str, "poisson", "how a DP step's batch is "
                 "drawn: poisson (each example joins with probability "
                 "batch_size / n, what the epsilon accounts for) or shuffle "
                 "(fixed-size batches of a shuffled pass, as the papers' "
                 "code; reported without an epsilon)", choices=BATCH_SAMPLINGS))

# declared alike by the HyperFL paper's baselines (one help text per flag)
LEARNING_RATE = params.Param(
    "learning_rate", float, 0.02, "the clients' SGD step (of the feature "
    "extractor where the classifier has its own)", minimum=0,
    exclusive_minimum=True, flag="lr")
LOCAL_EPOCHS = params.Param(
    "local_epochs", int, 5, "local passes per round (centaur: of DP-SGD on "
    "the feature extractor, after the classifier's)", minimum=1)
CLASSIFIER_LEARNING_RATE = params.Param(
    "classifier_learning_rate", float, 0.1, "SGD step of the private "
    "classifier", minimum=0, exclusive_minimum=True, flag="classifier-lr")

SGD_PARAMETERS = (
    params.Param("momentum", float, 0.5, "SGD momentum", minimum=0, maximum=1,
                 exclusive_maximum=True),
    params.Param("weight_decay", float, 5e-4, "SGD weight decay (coupled)",
                 minimum=0))


@dataclasses.dataclass(frozen=True)
class DPSGD:
  """A client's DP-SGD: clip, noise and what one round costs.

  Attributes:
    l2_norm_clip: C.
    noise_multiplier: sigma.
    sample_rate: batch_size / n of the smallest client (None outside a run).
    steps_per_round: that client's DP steps per round (None outside a run).
    batch_sampling: one of `BATCH_SAMPLINGS` (see the module docstring).
    samplings: (sampling rate, DP steps per round) of each group of clients
      with the same steps, at the group's highest rate (`client_samplings`);
      empty outside a run.
  """

  l2_norm_clip: float
  noise_multiplier: float
  sample_rate: Optional[float] = None
  steps_per_round: Optional[int] = None
  batch_sampling: str = "poisson"
  samplings: tuple[tuple[float, int], ...] = ()

  def __post_init__(self):
    if self.batch_sampling not in BATCH_SAMPLINGS:
      raise ValueError(f"batch_sampling={self.batch_sampling!r}; choose one "
                       f"of {BATCH_SAMPLINGS}")

  @property
  def poisson(self) -> bool:
    return self.batch_sampling == "poisson"

  def round_event(self) -> Optional[tuple[dp_accounting.DpEvent, ...]]:
    """One round's DP event of each group of clients in `samplings` (None
    outside a run, without noise or on shuffled batches)."""
    if not self.samplings or self.noise_multiplier == 0 or not self.poisson:
      return None
    return tuple(dp_sgd.steps_event(self.noise_multiplier, rate, steps)
                 for rate, steps in self.samplings)

  def stated_privacy(self) -> dict:
    """What metrics report beside the epsilon: the batch sampling, and for
    noised shuffled batches a null epsilon with the reason."""
    if self.poisson or self.noise_multiplier == 0:
      return {"batch_sampling": self.batch_sampling}
    return {"batch_sampling": self.batch_sampling, "epsilon": None,
            "epsilon_note": SHUFFLE_NOTE}

  def protocol(self) -> dict:
    return {"l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "dp_sample_rate": self.sample_rate,
            "dp_steps_per_round": self.steps_per_round,
            "batch_sampling": self.batch_sampling}


class StepsCanary(UpdateDefense):
  """One client's round of DP-SGD steps (`dp`) as the per-upload audit
  (`tff_privacy.audit.uploads`) runs them: the white-box gradient canary.

  The audited record's per-example gradient is the canary, whatever the
  model, and every other record's is zero (losses that do not depend on
  the weights), so the upload depends on the record alone: over the
  round's steps it joins
  each Poisson batch with the group's probability q, its gradient clipped
  (`clipped_sum`) and Gaussian noise added to the batch's sum
  (`dp_sgd.private_gradient`, or per tensor `layerwise_private_gradient`
  at `noise_multipliers`, FedRE's noise_on='steps'), the same functions
  the clients' steps call. The upload is the sum of the steps' noisy
  gradients: the model change up to the factor learning rate over expected
  batch size, which the audit's score does not depend on. The relation is
  DP-SGD's, adding or removing one record, so the canary is told apart from
  zeros (`neighbour`). Audited: the group of clients (`DPSGD.samplings`)
  whose round claims the largest epsilon at `delta`. The upload sums the
  steps' outputs; a client's optimiser may weigh them otherwise (momentum),
  another post-processing of the same steps, which the claim covers
  alike."""

  name = "dp_sgd"
  dp_relation = dp_sgd.RELATION

  def __init__(self, dp: DPSGD, delta: float,
               noise_multipliers: Optional[Sequence[float]] = None,
               shapes: Sequence[Sequence[int]] = ()):
    if not dp.round_event():
      raise ValueError("DP-SGD without an accounted claim (no noise, shuffled "
                       "batches or outside a run) has nothing to audit")
    self.dp, self.delta, self.layerwise = dp, delta, noise_multipliers is not None
    self.noise_multipliers = (None if noise_multipliers is None else
                              np.asarray(noise_multipliers, np.float32))
    if self.layerwise and len(shapes) != len(self.noise_multipliers):
      raise ValueError(f"{len(self.noise_multipliers)} noise_multipliers need as "
                       f"many tensor shapes, got {len(shapes)}")
    # per-tensor clipping and noise: the tensors' `shapes`
    self._sizes = [int(np.prod(s)) for s in shapes]
    self._weights = (1.0 if noise_multipliers is None
                     else np.repeat(self.noise_multipliers ** -2.0, self._sizes))

  @functools.cached_property
  def _group(self) -> int:
    """The group whose round claims the most (priced when first needed:
    the PLD accountant takes a second or two a group)."""
    return int(np.argmax([accounting.epsilon(e, self.delta, "pld")
                          for e in self.dp.round_event()]))

  @functools.cached_property
  def event(self) -> dp_accounting.DpEvent:
    return self.dp.round_event()[self._group]

  @property
  def sample_rate(self) -> float:
    return self.dp.samplings[self._group][0]

  @property
  def steps(self) -> int:
    return self.dp.samplings[self._group][1]

  def apply(self, update, seed, client=None):
    seed = tf.cast(seed, tf.int64)
    clip = self.dp.l2_norm_clip

    def step(total, i):
      sampled = dp_sgd.poisson_sample(tf.constant(1), self.sample_rate,
                                      tf.random.experimental.stateless_fold_in(
                                          seed, SAMPLING_STREAM + i))
      per_example = [tf.boolean_mask(u[tf.newaxis], sampled) for u in update]
      noise_seed = tf.random.experimental.stateless_fold_in(seed, i)
      grads = (dp_sgd.layerwise_private_gradient(per_example, clip,
                                                 self.noise_multipliers,
                                                 noise_seed, 1.0)
               if self.layerwise else
               dp_sgd.private_gradient(per_example, clip, self.dp.noise_multiplier,
                                       noise_seed, 1.0))
      return [t + g for t, g in zip(total, grads)]

    return tf.foldl(step, tf.range(self.steps, dtype=tf.int64),
                    initializer=[tf.zeros_like(u) for u in update])

  def dp_event(self, num_params: int):
    return self.event

  def canary(self, direction):
    """`direction` at the clip norm, or each tensor's part of it for
    per-tensor clipping: a record's largest clipped gradient."""
    clip = self.dp.l2_norm_clip
    if not self.layerwise:
      return clip * direction / np.linalg.norm(direction)
    return per_tensor_at_norm(direction, self._sizes, clip)

  def neighbour(self, canary):
    return np.zeros_like(canary)

  def canary_score(self, uploads, canaries):
    """The inner product, per tensor over its noise variance where the
    tensors' noise differs."""
    return np.sum(uploads * canaries * self._weights, axis=1)

  def for_client(self, client, seed):
    return self


def configure(method: str, federation: Optional[Federation], batch_size: int,
              dp_epochs: int, *, l2_norm_clip: float,
              noise_multiplier: Optional[float], target_epsilon: float,
              target_delta: float, batch_sampling: str) -> DPSGD:
  """The run's `DPSGD` (see the module docstring).

  Raises:
    ValueError: if neither `noise_multiplier` nor `federation` is given.
  """
  if federation is None:
    if noise_multiplier is None:
      raise ValueError(f"method {method!r} outside a run needs "
                       "noise_multiplier (it calibrates from the run's rounds "
                       "and client sizes otherwise)")
    return DPSGD(l2_norm_clip, noise_multiplier, batch_sampling=batch_sampling)
  samplings = client_samplings(federation.client_sizes, batch_size, dp_epochs)
  if noise_multiplier is None:
    noise_multiplier = max(
        dp_sgd.noise_multiplier_for(target_epsilon, target_delta, rate,
                                    steps * federation.rounds)
        for rate, steps in samplings)
  sample_rate, steps = samplings[0]
  return DPSGD(l2_norm_clip, noise_multiplier, sample_rate, steps,
               batch_sampling, samplings)


def client_samplings(client_sizes: Sequence[int], batch_size: int,
                     dp_epochs: int) -> tuple[tuple[float, int], ...]:
  """(sampling rate, DP steps per round) of each group of clients that take
  the same number of steps, at the group's highest rate (its smallest
  client), from the smallest clients up. A client of the group spends at
  most what this pair does: the same steps, each at a rate no higher."""
  groups = {}
  for n in sorted(set(client_sizes)):
    groups.setdefault(math.ceil(n / batch_size) * dp_epochs,
                      min(1.0, batch_size / n))
  return tuple((rate, steps) for steps, rate in groups.items())


def algorithm_fields(dp: DPSGD, run_seed: int,
                     federation: Optional[Federation] = None) -> dict:
  """The `Algorithm` fields of a method whose clients run `dp`: their noise
  seeds, the DP event of a round, its neighbouring relation, its audit
  (`StepsCanary` at the `federation`'s delta, where it claims an epsilon)
  and the batch sampling."""
  audited = (StepsCanary(dp, federation.dp_delta)
             if federation is not None and dp.round_event() else None)
  return {"client_inputs": seed_inputs(run_seed),
          "dp_event": lambda num_params: dp.round_event(),
          "dp_relation": dp_sgd.RELATION, "audited_mechanism": audited,
          "stated_privacy": lambda rounds, history: dp.stated_privacy()}


def local_training_client_work(
    client_update: tff.Computation) -> tff.learning.templates.ClientWorkProcess:
  """A stateless client work whose clients run `client_update(weights,
  data) -> (ClientResult, summed train_sums)`: one TensorFlow computation
  over the broadcast weights and the client's whole data (its batches and
  inputs, `client_data`), so it may compute what the round needs before
  its local steps. Measurements: `personalized.train_metrics`."""
  weights_type, data_type = client_update.type_signature.parameter

  @tff.federated_computation
  def init_fn():
    return tff.federated_value((), tff.SERVER)

  @tff.federated_computation(init_fn.type_signature.result,
                             tff.FederatedType(weights_type, tff.CLIENTS),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def next_fn(state, weights, data):
    result, sums = tff.federated_map(client_update, (weights, data))
    measurements = tff.federated_map(personalized.train_metrics,
                                     federated_wide_sum(sums))
    return tff.templates.MeasuredProcessOutput(state, result, measurements)

  return tff.learning.templates.ClientWorkProcess(init_fn, next_fn)


def split_declared(declared: dict) -> tuple[dict, dict]:
  """(the optimisation parameters, the DP ones: `PARAMETERS`) of a method's
  resolved `declared` parameters."""
  names = {p.name for p in PARAMETERS}
  return ({k: v for k, v in declared.items() if k not in names},
          {k: v for k, v in declared.items() if k in names})


def data_type(input_shape: Sequence[int]) -> tff.StructType:
  """A client's data: batches of inputs and labels, and beside them the
  round's noise seed (`client_data.seeded_type`)."""
  return client_data.seeded_type(collections.OrderedDict(
      x=tff.TensorType(np.float32, (None,) + tuple(input_shape)),
      y=tff.TensorType(np.int32, (None,))))


def seed_inputs(run_seed: int):
  """`Algorithm.client_inputs`: each client's noise seed of the round."""
  return lambda client, round_num: {SEED_KEY: client_seed(run_seed, round_num,
                                                          client)}


def step_seed(seed: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
  """The noise seed of local step `step` of a client whose round's seed is
  `seed`."""
  return tf.random.experimental.stateless_fold_in(seed, step)


def examples_per_pass(dataset: tf.data.Dataset, passes: int) -> tf.Tensor:
  """A client's n (float32): the examples in `dataset`, which holds
  `passes` passes over them, divided by `passes`."""
  return tf.cast(reads.count_samples(dataset, "y"), tf.float32) / passes


def dp_batches(dataset: tf.data.Dataset, dp: DPSGD, passes: int,
               seed: tf.Tensor) -> tf.data.Dataset:
  """The batches of a client's DP steps: `dataset`'s own (shuffled, fixed
  size) or, for 'poisson', `poisson_batches` in their place, drawn under
  the client's round seed `seed`."""
  return poisson_batches(dataset, passes, seed) if dp.poisson else dataset


def poisson_batches(dataset: tf.data.Dataset, passes: int,
                    seed: tf.Tensor) -> tf.data.Dataset:
  """Poisson-sampled batches in place of `dataset`'s.

  `dataset` holds `passes` passes over a client's n examples in batches of
  B (its first batch holds min(B, n)). The result has as many batches;
  into each, every one of the n examples enters independently with
  probability q = min(B, n) / n (`dp_sgd.poisson_sample`, step s drawn
  from the client's round seed `seed` folded with `SAMPLING_STREAM`, then
  s as int64). Each batch carries its expected size q n
  (`EXPECTED_SIZE_KEY`).
  """
  first = dataset.take(1).get_single_element()
  steps = reads.count_batches(dataset)
  n = tf.cast(examples_per_pass(dataset, passes), tf.int64)
  x, y = dataset.map(lambda b: (b["x"], b["y"])).unbatch().take(n).batch(
      n).get_single_element()
  expected = tf.cast(tf.shape(first["y"])[0], tf.float32)
  key = tf.random.experimental.stateless_fold_in(seed, SAMPLING_STREAM)

  def draw(step):
    keep = dp_sgd.poisson_sample(
        n, expected / tf.cast(n, tf.float32),
        tf.random.experimental.stateless_fold_in(key, step))
    return collections.OrderedDict(
        x=tf.boolean_mask(x, keep), y=tf.boolean_mask(y, keep),
        **{EXPECTED_SIZE_KEY: expected})

  return tf.data.Dataset.range(steps).map(draw)


def private_gradient(model: tf.keras.Model, weights: Sequence[tf.Tensor],
                     wrt: Sequence[int], batch, dp: DPSGD,
                     step: tf.Tensor, seed: tf.Tensor) -> list[tf.Tensor]:
  """DP-SGD's gradient of the batch's loss for `weights[i]`, i in `wrt`
  (the others fixed) at local step `step` of a client whose round's seed
  is `seed`: per-example gradients (one vectorised map) clipped together
  and noised (`tff_privacy.dp.dp_sgd.private_gradient`), divided by a
  Poisson batch's expected size."""
  wrt = list(wrt)

  def one_example(example):
    x, y = example
    with tf.GradientTape() as tape:
      free = [weights[i] for i in wrt]
      tape.watch(free)
      full = list(weights)
      for i, t in zip(wrt, free):
        full[i] = t
      loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
          y[tf.newaxis], forward(model, full, x[tf.newaxis]))[0]
    return tape.gradient(loss, free)

  with _quiet_tf_logger():  # pfor warns of its while_loop for conv filters
    grads = tf.vectorized_map(one_example, (batch["x"], batch["y"]))
  return dp_sgd.private_gradient(
      grads, dp.l2_norm_clip, dp.noise_multiplier, step_seed(seed, step),
      batch[EXPECTED_SIZE_KEY] if dp.poisson else None)


@contextlib.contextmanager
def _quiet_tf_logger():
  logger = tf.get_logger()
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def split_index(keras_model_fn) -> int:
  """Where the classifier (the last dense layer) starts in the model's
  trainable tensors: the body is before, the head from there on."""
  with tf.Graph().as_default():
    return num_extractor_tensors(keras_model_fn())


def private_classifier(spec, seed: int) -> PrivateState:
  """The `PrivateState` of a shared-body, private-head method: each client's
  classifier, all starting from the seeded model's; a client's model is the
  server's body followed by its classifier."""
  initial = spec.initial_weights(seed)
  head = initial[split_index(spec.keras):]
  return PrivateState(
      initial=lambda client: collections.OrderedDict(
          classifier=[h.copy() for h in head]),
      personal_weights=lambda body, state: list(body) + list(state["classifier"]))


def build_body_head_process(keras_model_fn, local_training, epochs: int,
                            model_aggregator=None) -> personalized.PersonalizedProcess:
  """The `PersonalizedProcess` of a shared-body, private-head method: the
  server holds the body (initially `keras_model_fn()`'s), each client its
  classifier (`OrderedDict(classifier=[kernel, bias])`);
  `local_training(target, body, head, dataset, seed) -> (body, head,
  sums)` is a client's round over `epochs` passes under its round's noise
  seed; the client uploads its body, weighted by its examples per pass."""
  model = keras_model_fn()  # eager: its initial weights are the server's
  split = num_extractor_tensors(model)
  initial = [v.numpy() for v in model.trainable_variables]
  input_shape = tuple(model.input_shape[1:])
  head_type = collections.OrderedDict(classifier=[
      tff.TensorType(np.float32, w.shape) for w in initial[split:]])

  def client_round(body, state, data):
    dataset, inputs = client_data.split(data)
    body, head, sums = local_training(keras_model_fn(), body, state["classifier"],
                                      dataset, inputs[SEED_KEY])
    return (body, examples_per_pass(dataset, epochs),
            collections.OrderedDict(classifier=list(head)), sums)

  return personalized.build_personalized_process(
      initial_shared=initial[:split], client_state_type=head_type,
      data_type=data_type(input_shape), local_training=client_round,
      model_aggregator=model_aggregator)
