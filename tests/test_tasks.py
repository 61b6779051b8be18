"""Tasks: segmentation metrics against scikit-learn on the same pixels, and
the evaluator and runner on the synthetic documents."""

import numpy as np
import pytest
import tensorflow as tf
from sklearn import metrics as skm

from tff_privacy import models, runner, tasks
from tff_privacy.attacks import functional
from tff_privacy.attacks.inversion import Target
from tff_privacy.updates import GroundTruthStore, UpdateStore


def _pixels(seed):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(3, 5, 4, 2)).astype(np.float32)
  labels = (rng.random((3, 5, 4)) > 0.6).astype(np.int32)
  return logits, labels


@pytest.mark.parametrize("seed", range(3))
def test_segmentation_scores_match_scikit_learn(seed):
  logits, labels = _pixels(seed)
  task = tasks.get("segmentation")
  sums = [float(v) for v in task.sums(tf.constant(logits), tf.constant(labels))]
  scores = task.scores(sums, len(labels))
  true, pred = labels.ravel(), logits.argmax(-1).ravel()
  assert scores["iou"] == pytest.approx(skm.jaccard_score(true, pred))
  assert scores["precision"] == pytest.approx(skm.precision_score(true, pred))
  assert scores["recall"] == pytest.approx(skm.recall_score(true, pred))
  assert scores["f_score"] == pytest.approx(skm.f1_score(true, pred))
  expected_loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
      labels, logits)
  assert scores["loss"] == pytest.approx(float(expected_loss), rel=1e-5)


def test_segmentation_scores_are_zero_where_undefined():
  task = tasks.get("segmentation")
  logits = np.zeros((1, 2, 2, 2), np.float32)
  logits[..., 0] = 1.0  # predicts no tampered pixel
  labels = np.zeros((1, 2, 2), np.int32)
  sums = [float(v) for v in task.sums(tf.constant(logits), tf.constant(labels))]
  scores = task.scores(sums, 1)
  assert scores["iou"] == scores["precision"] == scores["recall"] == scores["f_score"] == 0


def test_evaluator_batches_add_up_to_the_whole_set():
  spec = models.ModelSpec("unet", (8, 8, 3), 2, {"widths": (2, 3)}, "segmentation")
  rng = np.random.default_rng(0)
  x = rng.random((70, 8, 8, 3)).astype(np.float32)  # more than one batch
  y = (rng.random((70, 8, 8)) > 0.5).astype(np.int32)
  weights = spec.initial_weights(1)
  scores = runner.Evaluator(spec).scores(weights, x, y)
  model = spec.keras()
  model.set_weights(weights)
  pred = model(x).numpy().argmax(-1).ravel()
  assert scores["f_score"] == pytest.approx(skm.f1_score(y.ravel(), pred))
  assert scores["iou"] == pytest.approx(skm.jaccard_score(y.ravel(), pred))


def test_positive_weight_weighs_tampered_pixels_in_the_cross_entropy():
  logits, labels = _pixels(4)
  p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  ce = -np.log(np.take_along_axis(p, labels[..., None], -1)[..., 0])
  expected = np.mean(ce * np.where(labels == 1, 5.0, 1.0))
  task = tasks.get("segmentation", positive_weight=5.0)
  assert float(task.loss(logits, labels)) == pytest.approx(expected, rel=1e-5)
  assert float(task.keras_loss()(labels, logits)) == pytest.approx(expected, rel=1e-5)
  assert float(tasks.get("segmentation").loss(logits, labels)) == pytest.approx(
      ce.mean(), rel=1e-5)
  with pytest.raises(ValueError, match="positive_weight must be > 0"):
    tasks.get("segmentation", positive_weight=0.0)
  with pytest.raises(ValueError, match="task 'classification' takes no arguments"):
    tasks.get("classification", positive_weight=2.0)


def test_positive_weight_is_refused_for_classification_runs(tmp_path):
  with pytest.raises(ValueError, match="positive_weight applies to segmentation"):
    runner.Run(runner.RunConfig(out=str(tmp_path), dataset="digits", model="mlp",
                                positive_weight=3.0))


@pytest.mark.slow
def test_a_weighted_run_on_the_documents_scores_and_records_as_its_task(tmp_path):
  """A FedAvg run on the documents trained with a positive weight reports
  the segmentation metrics, its test loss the evaluator's (weighted) loss
  of the final model; its captured delta equals the attacker's simulation
  (`Target.simulate`, which reads the weight from the record's model), and
  not the unweighted one."""
  config = runner.RunConfig(out=str(tmp_path), method="fedavg", dataset="docs",
                            data_kwargs={"num": 100}, model="unet",
                            model_kwargs={"widths": [4, 8]},
                            clients=5, clients_per_round=1, rounds=1,
                            batch_size=8, seed=2, capture_rounds=(1,),
                            positive_weight=6.0,
                            method_kwargs={"client_learning_rate": 0.05})
  last = runner.run(config, progress=False)[-1]
  for key in ("test_iou", "test_precision", "test_recall", "test_f_score",
              "test_loss", "personal_f_score_mean", "personal_iou_mean"):
    assert np.isfinite(last[key])
  run = runner.Run(config)
  final = runner.load_model_weights(config.out, run.spec)
  assert runner.Evaluator(run.spec).scores(final, *run.fed.test)["loss"] == \
      pytest.approx(last["test_loss"])
  client = UpdateStore(f"{config.out}/updates").clients(1)[0]
  record = UpdateStore(f"{config.out}/updates").read(1, client)
  x, y = GroundTruthStore(f"{config.out}/ground_truth").read(1, client)
  assert record.model_spec.task_object.positive_weight == 6.0
  target = Target.from_record(record)
  broadcast = [tf.constant(w) for w in record.broadcast]
  simulated = target.simulate(broadcast, tf.constant(x), tf.one_hot(y, 2))
  for got, want in zip(record.upload, simulated):
    np.testing.assert_allclose(got, want.numpy(), atol=2e-5)
  plain = models.ModelSpec(record.model_spec.name, record.model_spec.input_shape, 2,
                           record.model_spec.kwargs, "segmentation")
  unweighted = functional.simulate_upload(
      plain.keras(), broadcast, tf.constant(x), tf.one_hot(y, 2), "model_delta",
      record.metadata["protocol"])
  assert not np.allclose(record.upload[0], unweighted[0].numpy(), atol=2e-5)


def test_binary_mse_is_keras_mse_on_the_sigmoid_and_scores_at_one_half():
  rng = np.random.default_rng(4)
  logits = rng.normal(size=(9, 1)).astype(np.float32)
  labels = rng.integers(0, 2, 9).astype(np.int32)
  task = tasks.get("binary_mse")
  probability = 1 / (1 + np.exp(-logits[:, 0]))
  expected = float(tf.keras.losses.MeanSquaredError()(labels.astype(np.float32),
                                                      probability))
  assert float(task.loss(logits, labels)) == pytest.approx(expected, rel=1e-6)
  assert float(task.keras_loss()(labels, logits)) == pytest.approx(expected, rel=1e-6)
  assert float(task.soft_loss(logits, tf.one_hot(labels, 2))) == pytest.approx(
      expected, rel=1e-6)
  scores = task.scores([float(v) for v in task.sums(logits, labels)], 9)
  assert scores["accuracy"] == pytest.approx(np.mean((probability > 0.5) == labels))
  metric = task.keras_metrics()[0]
  metric.update_state(labels, logits)
  assert float(metric.result()) == pytest.approx(scores["accuracy"])
  assert task.output_units(2) == 1 and not task.labels_recoverable


def test_binary_mse_upload_is_the_keras_gradient_of_mse_on_a_sigmoid_output():
  spec = models.ModelSpec("mlp", (6,), 2, {"hidden": (5,)}, "binary_mse")
  model = spec.keras(1)
  assert model.output_shape == (None, 1)
  rng = np.random.default_rng(1)
  x = rng.random((4, 6)).astype(np.float32)
  y = np.array([0, 1, 1, 0], np.int32)
  with tf.GradientTape() as tape:
    loss = tf.keras.losses.MeanSquaredError()(y[:, None].astype(np.float32),
                                              tf.sigmoid(model(x)))
  expected = tape.gradient(loss, model.trainable_variables)
  got = functional.simulate_upload(
      model, [tf.constant(v) for v in model.trainable_variables], tf.constant(x),
      tf.one_hot(y, 2), "gradient", {"batch_size": 4}, task=spec.task_object)
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, atol=1e-7)
