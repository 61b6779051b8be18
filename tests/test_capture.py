"""CaptureFactory reports exactly what each client uploaded, in client order."""

import collections

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import algorithms, data, models
from tff_privacy.updates import CaptureFactory
from tff_privacy.updates.capture import stacking_computations

NUM_CLIENTS = 4


@pytest.fixture(scope="module")
def setup():
  fed = data.load("digits", NUM_CLIENTS, seed=0)
  spec = models.ModelSpec("mlp", fed.source.input_shape, 10, {"hidden": (16,)})
  batches = []
  for c in range(NUM_CLIENTS):
    x, y = fed.client_arrays(c)
    n = 3 + c  # different batch sizes make the weights tell clients apart
    batches.append((x[:n], y[:n]))
  datasets = [tf.data.Dataset.from_tensor_slices(
      collections.OrderedDict(x=x, y=y)).batch(16) for x, y in batches]
  return spec, batches, datasets


def _gradient(spec, weights, x, y):
  model = spec.keras()
  for v, w in zip(model.trainable_variables, weights):
    v.assign(w)
  with tf.GradientTape() as tape:
    loss = models.loss_fn()(y, model(x))
  return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


@pytest.mark.slow
def test_fedsgd_uploads_are_captured_in_client_order(setup):
  spec, batches, datasets = setup
  process = algorithms.build_fedsgd(
      spec.tff_model_fn(), model_aggregator=CaptureFactory(
          tff.aggregators.MeanFactory(), capacity=NUM_CLIENTS))
  state = process.initialize()
  broadcast = process.get_model_weights(state).trainable
  out = process.next(state, datasets)
  captured = out.metrics["aggregator"]["captured"]
  assert int(captured["num_uploads"]) == NUM_CLIENTS
  np.testing.assert_array_equal(captured["upload_weights"],
                                [len(y) for _, y in batches])
  for i, (x, y) in enumerate(batches):
    want = _gradient(spec, broadcast, x, y)
    for got, w in zip(captured["uploads"], want):
      np.testing.assert_allclose(got[i], w, atol=2e-6)
  # the wrapped aggregator still does its job: the server applied the mean
  mean = [np.average(u, axis=0, weights=captured["upload_weights"])
          for u in captured["uploads"]]
  new = process.get_model_weights(out.state).trainable
  for b, n, g in zip(broadcast, new, mean):
    np.testing.assert_allclose(n, b - 0.1 * g, atol=1e-6)


def test_stacking_accumulates_and_merges_in_order():
  value_type = tff.StructWithPythonType([tff.TensorType(np.float32, [2])], list)
  zero, accumulate, merge, report = stacking_computations(
      value_type, tff.TensorType(np.float32), capacity=5)
  values = [np.array([i, -i], np.float32) for i in range(5)]
  left, right = zero(), zero()
  for i in range(3):
    left = accumulate(left, ([values[i]], float(i)))
  for i in range(3, 5):
    right = accumulate(right, ([values[i]], float(i)))
  out = report(merge(left, right))
  assert out["num_uploads"] == 5
  np.testing.assert_array_equal(out["uploads"][0], np.stack(values))
  np.testing.assert_array_equal(out["upload_weights"], np.arange(5.0))


def test_capacity_is_validated():
  with pytest.raises(ValueError, match="capacity must be >= 1"):
    CaptureFactory(tff.aggregators.MeanFactory(), capacity=0)
