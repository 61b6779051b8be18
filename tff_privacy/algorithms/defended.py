"""Client-side defences inside TFF client work.

`with_update_defense` wraps any `ClientWorkProcess` so that each client
trains on its batches as `UpdateDefense.transform_batch` leaves them (an
input perturbation; by default unchanged) and
transforms its update with an `UpdateDefense` before it is returned, i.e.
before it leaves the client: the aggregator, the update store and any
eavesdropper see only the defended update. Defences with
`needs_client_view` (Soteria) also receive the broadcast weights and the
client's data set as a `ClientView`. Beside the inner client work's
measurements, the round reports under 'defense' the share of its clients
whose update the defence left exactly as it was ('unperturbed_share', for
a defence that acts on the update), and the defence's own measurements
(`UpdateDefense.apply_measured`) averaged over the clients, under its
name; its `per_client_measurements`, one row per client, are summed
instead, under 'defense_per_client'. The client's noise seed travels in its
data (a 'seed' entry in every batch, see `Algorithm.client_inputs`), so a
run is reproducible while every client and round gets fresh noise.

`compose_defended` builds the full `LearningProcess` around such a client
work with TFF's own distributor, aggregator and optimizer finalizer, the same
parts TFF's `build_fed_sgd` and `build_weighted_fed_avg` compose.
"""

from __future__ import annotations

import collections
from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy.aggregation.wide_sum import wide_mean_factory
from tff_privacy.defenses import ClientView, UpdateDefense

SEED_KEY = "seed"
SEED_TYPE = tff.TensorType(np.int64, [2])


def client_seed(run_seed: int, round_num: int, client: int) -> np.ndarray:
  """The stateless-RNG seed of one client in one round."""
  state = np.random.SeedSequence([run_seed, round_num, client]).generate_state(2)
  return state.astype(np.int64)


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


def with_update_defense(inner: tff.learning.templates.ClientWorkProcess,
                        defense: UpdateDefense) -> tff.learning.templates.ClientWorkProcess:
  """`inner` whose clients upload `defense.apply(update, seed)`; its
  measurements also hold the clients' mean of `measured_defense`'s under
  'defense' and, for a defence with `per_client_measurements`, their sum
  under 'defense_per_client'.

  The client's seed, and the per-client inputs the defence declares in
  `client_input_types` (e.g. FedRE's region mask), travel in every batch;
  the defence finds the latter in `ClientView.inputs`."""
  state_type, weights_type, data_type = inner.next.type_signature.parameter
  element = data_type.member.element
  names = [name for name, _ in tff.structure.iter_elements(element)]
  input_types = collections.OrderedDict(
      [(SEED_KEY, SEED_TYPE)] + list(defense.client_input_types.items()))
  seeded_element = collections.OrderedDict(
      [(k, element[k]) for k in names] + list(input_types.items()))
  seeded_data_type = tff.SequenceType(seeded_element)
  update_type = inner.next.type_signature.result.result.member.update

  @tff.tensorflow.computation(seeded_data_type)
  def strip_inputs(dataset):
    return dataset.map(lambda b: defense.transform_batch(
        collections.OrderedDict((k, b[k]) for k in names),
        {k: b[k] for k in input_types}))

  @tff.tensorflow.computation(seeded_data_type)
  def inputs_of(dataset):
    zero = collections.OrderedDict((k, tf.zeros(t.shape, t.dtype))
                                   for k, t in input_types.items())
    return dataset.reduce(zero, lambda _, b: collections.OrderedDict(
        (k, b[k]) for k in input_types))

  if defense.needs_client_view:
    @tff.tensorflow.computation(update_type, inputs_of.type_signature.result,
                                weights_type.member, data_type.member)
    def defend(update, inputs, weights, dataset):
      view = ClientView(list(weights.trainable), dataset, dict(inputs))
      return measured_defense(defense, list(update), inputs[SEED_KEY], view)
  else:
    @tff.tensorflow.computation(update_type, inputs_of.type_signature.result)
    def defend(update, inputs):
      return measured_defense(defense, list(update), inputs[SEED_KEY])

  inner_measurements = [
      name for name, _ in tff.structure.iter_elements(
          inner.next.type_signature.result.measurements.member)]

  @tff.federated_computation(state_type, weights_type,
                             tff.FederatedType(seeded_data_type, tff.CLIENTS))
  def next_fn(state, weights, data):
    stripped = tff.federated_map(strip_inputs, data)
    output = inner.next(state, weights, stripped)
    args = (output.result.update, tff.federated_map(inputs_of, data))
    if defense.needs_client_view:
      args += (weights, stripped)
    defended = tff.federated_map(defend, args)
    result = tff.federated_zip(tff.learning.templates.ClientResult(
        update=defended[0], update_weight=output.result.update_weight))
    measurements = collections.OrderedDict(
        [(name, output.measurements[name]) for name in inner_measurements]
        + [("defense", tff.federated_mean(defended[1]))]
        + ([("defense_per_client", tff.federated_sum(defended[2]))]
           if defense.per_client_measurements else []))
    return tff.templates.MeasuredProcessOutput(
        output.state, result, tff.federated_zip(measurements))

  return tff.learning.templates.ClientWorkProcess(inner.initialize, next_fn)


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
