"""Client-side defences inside TFF client work.

`with_update_defense` builds the client work of a TFF algorithm's local
update (`LocalUpdate`: FedAvg's or FedSGD's, TFF's own code) in which each
client trains on its batches as `UpdateDefense.transform_batch` leaves them
(an input perturbation; by default unchanged) and
transforms its update with an `UpdateDefense` before it is returned, i.e.
before it leaves the client: the aggregator, the update store and any
eavesdropper see only the defended update. Defences with
`needs_client_view` (Soteria) also receive the broadcast weights and the
client's data set as a `ClientView`. Beside the local update's training
metrics, the round reports under 'defense' the share of its clients
whose update the defence left exactly as it was ('unperturbed_share', for
a defence that acts on the update), and the defence's own measurements
(`UpdateDefense.apply_measured`) averaged over the clients, under its
name; its `per_client_measurements`, one row per client, are summed
instead, under 'defense_per_client'. The client's noise seed travels beside
its batches (`tff_privacy.algorithms.client_data`, see
`Algorithm.client_inputs`), so a run is reproducible while every client
and round gets fresh noise.

`compose_defended` builds the full `LearningProcess` around such a client
work with TFF's own distributor, aggregator and optimizer finalizer, the same
parts TFF's `build_fed_sgd` and `build_weighted_fed_avg` compose.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
# TFF exports its algorithms' client updates only inside their client works;
# these are the ones `build_weighted_fed_avg` and `build_fed_sgd` run (TFF
# is pinned, see requirements.lock)
from tensorflow_federated.python.learning.algorithms import fed_sgd
from tensorflow_federated.python.learning.templates import model_delta_client_work

from tff_privacy.aggregation.wide_sum import wide_mean_factory
from tff_privacy.algorithms import client_data
from tff_privacy.algorithms.client_data import SEED_KEY
from tff_privacy.data import reads
from tff_privacy.defenses import ClientView, UpdateDefense

# How TFF's client updates step through a client's batches: a loop over
# the dataset's iterator (a graph while-loop over iterator ops) rather than
# TFF's default `Dataset.reduce`. The same batches in the same order, the
# same weights to the bit on CPU; a FedAvg round of HyperFL's MNIST setting
# takes about a third less time (benchmarks/hyperfl_authors_fedavg.py's TFF
# side: 1.66-2.01 s against 2.70-3.11 s).
CLIENT_LOOP = tff.learning.LoopImplementation.DATASET_ITERATOR


def measured_defense(defense: UpdateDefense, update: list[tf.Tensor], seed,
                     client=None) -> tuple[list[tf.Tensor], dict, dict]:
  """The defended `update`, its measurements to average over clients and
  those kept per client. The former: for a defence that acts on the update
  (`UpdateDefense.acts_on_update`; not an input perturbation, which leaves
  every update as it is) 'unperturbed_share' (1.0 where the defence left
  every entry exactly as it was, else 0.0) and, under the defence's name,
  its own (`UpdateDefense.apply_measured`) but the
  `per_client_measurements`, which the latter holds under its name."""
  defended, own = defense.apply_measured(update, seed, client)
  measured, per_client = collections.OrderedDict(), collections.OrderedDict()
  if defense.acts_on_update:
    same = tf.reduce_all([tf.reduce_all(tf.equal(d, u))
                          for d, u in zip(defended, update)])
    measured["unperturbed_share"] = tf.cast(same, tf.float32)
  averaged = [k for k in own if k not in defense.per_client_measurements]
  if averaged:
    measured[defense.name] = _as_float32(own, averaged)
  if defense.per_client_measurements:
    per_client[defense.name] = _as_float32(own, defense.per_client_measurements)
  return defended, measured, per_client


def _as_float32(measurements: dict, names) -> collections.OrderedDict:
  """`measurements[name]` as float32 for each of `names`, sorted by name."""
  return collections.OrderedDict(
      (k, tf.cast(measurements[k], tf.float32)) for k in sorted(names))


@dataclasses.dataclass(frozen=True)
class LocalUpdate:
  """A client's local work without a defence, as TFF's own algorithms run
  it: `build()`, called inside a TFF computation, returns a `tf.function`
  of (broadcast `ModelWeights`, the client's batches) to (`ClientResult`,
  the model's unfinalized metrics); `model_fn` builds the model it trains.
  """
  model_fn: Callable[[], tff.learning.models.VariableModel]
  build: Callable[[], Callable]


def model_delta_update(model_fn, optimizer: tff.learning.optimizers.Optimizer,
                       weighting=tff.learning.ClientWeighting.NUM_EXAMPLES) -> LocalUpdate:
  """FedAvg's local training: TFF's `build_model_delta_client_work`'s
  update (the optimizer at its own hyperparameters, fresh each round)."""
  def build():
    update = model_delta_client_work.build_model_delta_update_with_tff_optimizer(
        model_fn, weighting=weighting, loop_implementation=CLIENT_LOOP)
    return functools.partial(update, optimizer)
  return LocalUpdate(model_fn, build)


def fed_sgd_update(model_fn) -> LocalUpdate:
  """FedSGD's gradient: the update of TFF's `build_fed_sgd`."""
  return LocalUpdate(model_fn, lambda: fed_sgd._build_client_update(
      model_fn(), loop_implementation=CLIENT_LOOP))


def with_update_defense(local: LocalUpdate, defense: UpdateDefense,
                        metrics_aggregator) -> tff.learning.templates.ClientWorkProcess:
  """The stateless client work whose clients run `local` on their batches
  as `defense.transform_batch` leaves them and upload
  `defense.apply(update, seed)`, in one TensorFlow computation per client
  (a computation for each of those steps made FedRE's compact round about
  10 % slower); its
  measurements: 'train' (`metrics_aggregator` over the model's metrics),
  the clients' mean of `measured_defense`'s under 'defense' and, for a
  defence with `per_client_measurements`, their sum under
  'defense_per_client'.

  A client's data is `client_data.data_type`'s: its batches, and beside
  them its seed and the inputs the defence declares in
  `client_input_types` (e.g. FedRE's region mask), which the defence finds
  in `ClientView.inputs`. The view's sample count is the model's
  'num_examples' metric over the round (TFF's Keras models count every
  example they train on) where the model has one, else a read of the
  batches: the same number where `transform_batch` keeps batch sizes."""
  with tf.Graph().as_default():  # the model's variables stay out of the caller's graph
    model = local.model_fn()
    aggregate_metrics = metrics_aggregator(model.metric_finalizers())
  weights_type = tff.learning.models.weights_type_from_model(model)
  element = tff.types.tensorflow_to_type(model.input_spec)
  names = [name for name, _ in tff.structure.iter_elements(element)]
  data_type = client_data.seeded_type(element, defense.client_input_types)

  @tff.tensorflow.computation(weights_type, data_type)
  def client_update(weights, data):
    dataset, inputs = client_data.split(data)
    head = (reads.first_samples(dataset, defense.view_samples, names)
            if defense.view_samples else None)
    batches = dataset.map(lambda b: defense.transform_batch(b, inputs))
    result, model_outputs = local.build()(weights, batches)
    view = (ClientView(list(weights.trainable), batches, dict(inputs),
                       _trained_examples(model_outputs), head, defense.view_samples)
            if defense.needs_client_view else None)
    upload, measured, per_client = measured_defense(
        defense, list(result.update), inputs[SEED_KEY], view)
    return (tff.learning.templates.ClientResult(
        update=upload, update_weight=result.update_weight),
            model_outputs, measured, per_client)

  @tff.federated_computation
  def init_fn():
    return tff.federated_value((), tff.SERVER)

  @tff.federated_computation(init_fn.type_signature.result,
                             tff.FederatedType(weights_type, tff.CLIENTS),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def next_fn(state, weights, data):
    result, model_outputs, measured, per_client = tff.federated_map(
        client_update, (weights, data))
    measurements = collections.OrderedDict(
        [("train", aggregate_metrics(model_outputs)),
         ("defense", tff.federated_mean(measured))]
        + ([("defense_per_client", tff.federated_sum(per_client))]
           if defense.per_client_measurements else []))
    return tff.templates.MeasuredProcessOutput(
        state, result, tff.federated_zip(measurements))

  return tff.learning.templates.ClientWorkProcess(init_fn, next_fn)


def _trained_examples(model_outputs) -> Optional[tf.Tensor]:
  """The examples a round trained on (int32), from the model's unfinalized
  'num_examples' metric (a Keras `Sum`: [total]); None without one."""
  if "num_examples" not in model_outputs:
    return None
  return tf.cast(model_outputs["num_examples"][0], tf.int32)


def compose_defended(model_fn: Callable, client_work, server_optimizer,
                     model_aggregator) -> tff.learning.templates.LearningProcess:
  """A `LearningProcess` around `client_work`, composed from TFF's parts."""

  @tff.tensorflow.computation()
  def initial_model_weights_fn():
    return tff.learning.models.ModelWeights.from_model(model_fn())

  return compose_from_weights(initial_model_weights_fn, client_work,
                              server_optimizer, model_aggregator)


def compose_from_weights(initial_model_weights_fn: tff.Computation, client_work,
                         server_optimizer, model_aggregator
                         ) -> tff.learning.templates.LearningProcess:
  """`compose_defended` for a model given by its initial weights (a
  computation returning `tff.learning.models.ModelWeights`)."""
  weights_type = initial_model_weights_fn.type_signature.result
  aggregator = (model_aggregator or wide_mean_factory()).create(
      weights_type.trainable, tff.TensorType(np.float32))
  return tff.learning.templates.compose_learning_process(
      initial_model_weights_fn,
      tff.learning.templates.build_broadcast_process(weights_type),
      client_work, aggregator,
      tff.learning.templates.build_apply_optimizer_finalizer(
          server_optimizer, weights_type))
