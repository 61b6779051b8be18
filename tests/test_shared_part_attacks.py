"""Attacks on uploads of a model's shared part: HyperFL's hypernetwork (eq. 8
and the tailored eqs. 9-10) and a feature extractor (PPSGD, CENTAUR)."""

import numpy as np
import pytest
import tensorflow as tf

from tff_privacy import attacks, evaluate, models, runner
from tff_privacy.attacks.inversion import Target, cosine_distance
from tff_privacy.attacks.shared_part import ExtractorView, _cross_entropy
from tff_privacy.models.functional import forward
from tff_privacy.models.hypernetwork import Hypernetwork
from tff_privacy.updates import UpdateRecord

SPEC = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": (16,)})
DIMS = {"embedding_dim": 4, "hidden_dim": 8}


def _record(broadcast, upload, kind="hypernetwork_weights", n=2):
  metadata = {"model": SPEC.to_json(), "upload_kind": kind,
              "protocol": dict(DIMS), "value_range": [0.0, 1.0],
              "method": "hyperfl"}
  return UpdateRecord(1, 0, "client_0000", [np.asarray(u) for u in upload],
                      float(n), n, [np.asarray(b) for b in broadcast], metadata)


def _hyper():
  return Hypernetwork.for_model(SPEC.keras(), **DIMS)


def _one_step(hyper, varphi, v, g, lr):
  """The hypernetwork after one SGD step on the loss <theta(v), g>, i.e.
  with g the gradient of the generated tensors (autodiff, full tensors)."""
  varphi = [tf.constant(w) for w in varphi]
  with tf.GradientTape() as tape:
    tape.watch(varphi)
    theta = hyper.generate(varphi, tf.constant(v))
    loss = tf.add_n([tf.reduce_sum(t * gi) for t, gi in zip(theta, g)])
  grads = tape.gradient(loss, varphi)
  return [w - lr * d for w, d in zip(varphi, grads)], theta


@pytest.mark.parametrize("alive", [True, False])
def test_tailored_attack_identifies_extractor_and_update_of_one_step(alive):
  hyper = _hyper()
  varphi = hyper.initial_weights(0)
  varphi[1] = np.full_like(varphi[1], 5.0 if alive else -5.0)  # ReLU on / off
  rng = np.random.default_rng(1)
  v = rng.standard_normal(4).astype(np.float32)
  g = [tf.constant(rng.standard_normal(s), tf.float32) for s in hyper.target_shapes]
  upload, theta = _one_step(hyper, varphi, v, g, lr=0.01)
  view = ExtractorView.of_hypernetwork(Target.from_record(_record(varphi, upload)),
                                       hyper)
  for got, want in zip(view.weights, theta):
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)
  for got, want in zip(view.update, g):  # the head biases moved by lr g
    np.testing.assert_allclose(got, 0.01 * want.numpy(), rtol=1e-3, atol=1e-6)
  if not alive:  # nothing active: the extractor is the head biases
    np.testing.assert_allclose(view.weights[0], varphi[3].reshape(64, 16),
                               atol=1e-6)
    np.testing.assert_allclose(view.weights[1], varphi[5], atol=1e-6)


def test_eq8_objective_equals_the_full_hypernetwork_cosine():
  hyper = _hyper()
  rng = np.random.default_rng(2)
  varphi = hyper.initial_weights(0)
  varphi[1] = np.abs(varphi[1]) + 0.1  # some units active
  upload = [w + 0.01 * rng.standard_normal(w.shape).astype(np.float32)
            for w in varphi]
  target = Target.from_record(_record(varphi, upload))
  inversion = attacks.build("ig_hyperfl")
  x = tf.constant(rng.random((2, 8, 8, 1)), tf.float32)
  unknowns = inversion._unknowns(target, rng)
  got = inversion._objective_fn(target)(x, unknowns, inversion._constants(target))

  labels, classifier, v = unknowns[0], unknowns[1:-1], unknowns[-1]
  weights = [tf.constant(w) for w in varphi]
  with tf.GradientTape() as tape:
    tape.watch(weights)
    extractor = hyper.generate(weights, v)
    loss = _cross_entropy(forward(target.model, extractor + list(classifier), x),
                          labels)
  change = [tf.constant(a - b) for a, b in zip(varphi, upload)]
  want = cosine_distance(tape.gradient(loss, weights), change)
  assert float(got) == pytest.approx(float(want), rel=1e-4)


def test_attacks_refuse_uploads_they_do_not_model():
  record = _record([np.zeros((64, 16))], [np.zeros((64, 16))], "body_weights")
  with pytest.raises(attacks.UploadRefused, match="'tailored_hyperfl' handles "
                     "hypernetwork_weights uploads; method 'hyperfl' uploads "
                     "'body_weights': use 'ig_body'"):
    attacks.build("tailored_hyperfl").check_records([record])
  with pytest.raises(attacks.UploadRefused, match="'ig' handles gradient, model_delta "
                     "uploads; .* use 'ig_hyperfl' or 'tailored_hyperfl'"):
    attacks.build("ig").check_records([_record([], [])])


@pytest.mark.slow
def test_ig_body_inverts_an_undefended_extractor_update(tmp_path):
  """A positive control: without noise or clipping, the extractor's update
  of two images gives them away although the classifier is unknown."""
  out = str(tmp_path / "run")
  runner.run(runner.RunConfig(
      out=out, method="ppsgd", dataset="digits", model="mlp",
      model_kwargs={"hidden": (64,)}, clients=2, rounds=1, batch_size=2,
      partition="label_groups", samples_per_client=2, seed=0,
      capture_rounds=(1,), method_kwargs={
          "noise_multiplier": 0.0, "l2_norm_clip": 1e3, "local_epochs": 1}),
      progress=False)
  result = evaluate.attack_round(f"{out}/updates", 1, str(tmp_path / "ig_body"),
                                 "ig_body", attack_kwargs={"iterations": 600})
  assert result["upload_kind"] == "body_weights"
  assert np.isnan(result["mean"]["feature_mse"])  # the client's model is private
  # random images in [0, 1] score about 0 SSIM against digits
  assert result["mean"]["ssim"] > 0.5
