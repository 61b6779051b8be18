import os

import numpy as np
import pytest
import tensorflow as tf

from tff_privacy import algorithms, models, runner
from tff_privacy.algorithms.client_data import client_seed
from tff_privacy.algorithms.fedem import project
from tff_privacy.models import functional
from tff_privacy.updates import GroundTruthStore, UpdateStore

SMALL = dict(dataset="digits", model="cnn", model_kwargs={"filters": 4, "dense": 16},
             clients=3, batch_size=4, seed=5)
FEDEM = dict(perturb_steps=3, perturb_lr=0.02, model_lr=0.05, rho_min=0.01,
             rho_max=0.1)


def _loss(model, weights, x, y):
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      y, functional.forward(model, weights, x)))


def fedem_reference(spec, broadcast, x, y, seed, perturb_steps, perturb_lr,
                    model_lr, rho_min, rho_max):
  """Algorithm 1, lines 6-11, written out eagerly on functional weights."""
  model = spec.keras()
  theta = [tf.constant(w) for w in broadcast]
  x = tf.constant(x)
  delta = project(tf.random.stateless_uniform(x.shape, seed, -rho_max, rho_max),
                  rho_min, rho_max)
  t = lambda d: tf.clip_by_value(x + d, 0.0, 1.0)
  theta_u = list(theta)
  for _ in range(perturb_steps):
    with tf.GradientTape() as tape:
      tape.watch(delta)
      loss = _loss(model, theta_u, t(delta), y)
    delta = project(delta - perturb_lr * tf.sign(tape.gradient(loss, delta)),
                    rho_min, rho_max)
    with tf.GradientTape() as tape:
      tape.watch(theta_u)
      loss = _loss(model, theta_u, t(delta), y)
    theta_u = [w - model_lr * g for w, g in zip(theta_u, tape.gradient(loss, theta_u))]
  with tf.GradientTape() as tape:
    tape.watch(theta)
    loss = _loss(model, theta, t(delta), y)
  return tape.gradient(loss, theta), t(delta)


@pytest.fixture(scope="module")
def fedem_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("fedem"))
  config = runner.RunConfig(out=out, method="fedem", rounds=2, capture_rounds=(2,),
                            method_kwargs=FEDEM, **SMALL)
  return config, runner.run(config, progress=False)


@pytest.mark.slow
def test_captured_upload_is_algorithm_1(fedem_run):
  config, history = fedem_run
  assert history[-1]["train_loss"] > 0  # train metrics on the perturbed batch
  store = UpdateStore(os.path.join(config.out, "updates"))
  truth = GroundTruthStore(os.path.join(config.out, "ground_truth"))
  for client in store.clients(2):
    record = store.read(2, client)
    assert record.metadata["method"] == "fedem"
    assert record.metadata["protocol"]["perturb_steps"] == 3
    x, y = truth.read(2, client)
    want, perturbed = fedem_reference(
        record.model_spec, record.broadcast, x, y,
        client_seed(config.seed, 2, client), **FEDEM)
    for got, w in zip(record.upload, want):
      np.testing.assert_allclose(got, w.numpy(), atol=1e-5)
    # the perturbation is real and within its bounds (t clips to [0, 1])
    change = np.abs(perturbed.numpy() - x)
    assert change.max() <= 0.1 + 1e-6
    interior = (x >= 0.1) & (x <= 0.9)
    assert change[interior].min() >= 0.01 - 1e-6


def test_a_batch_upload_is_attacked_with_all_its_images(fedem_run, tmp_path):
  # FedEM weighs every client 1; the record says how many images stand behind
  # the upload, and the attack reconstructs that many
  from tff_privacy import evaluate
  config, _ = fedem_run
  record = UpdateStore(os.path.join(config.out, "updates")).read(2, 0)
  assert record.weight == 1.0 and record.num_examples == config.batch_size == 4
  result = evaluate.attack_round(os.path.join(config.out, "updates"), 2,
                                 str(tmp_path), "ig", [0], {"iterations": 2})
  assert len(result["samples"]) == 4


@pytest.mark.slow
def test_with_a_vanishing_radius_fedem_uploads_fedsgd_gradients(tmp_path):
  # an MLP: with the CNN's zero biases, background pixels sit exactly at the
  # ReLU's kink, where even a 1e-7 perturbation flips the bias gradient
  small = {**SMALL, "model": "mlp", "model_kwargs": {"hidden": [16]}}
  config = runner.RunConfig(out=str(tmp_path / "em"), method="fedem", rounds=1,
                            capture_rounds=(1,),
                            method_kwargs={"perturb_steps": 0, "rho_max": 1e-7},
                            **small)
  runner.run(config, progress=False)
  base = runner.RunConfig(out=str(tmp_path / "sgd"), method="fedsgd", rounds=1,
                          capture_rounds=(1,), **small)
  runner.run(base, progress=False)
  em = UpdateStore(os.path.join(config.out, "updates"))
  sgd = UpdateStore(os.path.join(base.out, "updates"))
  for client in em.clients(1):
    for a, b in zip(em.read(1, client).upload, sgd.read(1, client).upload):
      np.testing.assert_allclose(a, b, atol=1e-5)


def test_projection_keeps_each_entry_or_sample_within_its_bounds():
  rng = np.random.default_rng(0)
  delta = tf.constant(rng.normal(0, 1, (5, 6, 6, 1)), tf.float32) * tf.constant(
      [1.0, 0.01, 0.001, 0.1, 2.0])[:, None, None, None]
  out = project(delta, 0.05, 0.2, "linf").numpy()
  assert np.all(np.abs(out) <= 0.2 + 1e-7) and np.all(np.abs(out) >= 0.05 - 1e-7)
  np.testing.assert_array_equal(np.sign(out), np.where(delta < 0, -1, 1))
  inside = (np.abs(delta) >= 0.05) & (np.abs(delta) <= 0.2)
  np.testing.assert_array_equal(out[inside], delta.numpy()[inside])
  out = project(delta, 0.05, 0.2, "l2").numpy()
  size = np.linalg.norm(out.reshape(5, -1), axis=1)
  np.testing.assert_array_less(size, 0.2 + 1e-6)
  np.testing.assert_array_less(0.05 - 1e-6, size)
  # inside the annulus: unchanged
  sample = delta[3:4] / tf.norm(delta[3]) * 0.1
  np.testing.assert_allclose(project(sample, 0.05, 0.2, "l2"), sample, rtol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(perturb_steps=-1), "perturb_steps must be >= 0"),
    (dict(perturb_steps=1.5), "perturb_steps must be an integer >= 0"),
    (dict(perturb_lr=0.0), "perturb_lr must be > 0"),
    (dict(rho_max=0.1, rho_min=0.2), r"rho_min must lie in \[0, rho_max=0.1\]"),
    (dict(norm="l1"), "norm='l1'"),
    (dict(server_learning_rate=-1.0), "server_learning_rate must be > 0"),
    (dict(unknown=1), "method 'fedem' takes no unknown"),
])
def test_bad_parameters_name_themselves(kwargs, match):
  spec = models.ModelSpec("mlp", (4, 4, 1), 3)
  with pytest.raises(ValueError, match=match):
    algorithms.get("fedem", spec, **kwargs)
