"""ROG: the low-resolution search, its prior, and their checks."""

import os

import numpy as np
import pytest
import tensorflow as tf
from conftest import record_of as _record

from tff_privacy import attacks, metrics, models, pretrained
from tff_privacy.attacks import rog


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv(pretrained.CACHE_VARIABLE, str(tmp_path / "cache"))
  monkeypatch.setattr(pretrained, "_MEMO", {})


def test_search_space_is_the_input_over_the_scale_factor_rounded_up():
  assert rog.low_resolution((28, 28, 1), 4) == (7, 7)
  assert rog.low_resolution((8, 10, 3), 3) == (3, 4)
  z = tf.fill((2, 3, 4, 3), 0.25)  # bicubic interpolation keeps a constant
  np.testing.assert_allclose(rog.upsample(z, (8, 10, 3)),
                             np.full((2, 8, 10, 3), 0.25), atol=1e-6)


def test_prior_is_a_residual_network_by_hand():
  prior = rog.ImagePrior(channels=1, width=2, depth=2)
  w = {k: np.zeros(s, np.float32) for k, s in prior.shapes.items()}
  x = np.random.default_rng(0).random((1, 4, 4, 1)).astype(np.float32)
  np.testing.assert_array_equal(prior(w, x), x)  # zero correction: identity
  w["conv1/kernel"][1, 1, 0, 0] = 1.0  # channel 0 = relu(x) = x
  w["conv2/kernel"][1, 1, 0, 0] = 2.0  # correction = 2 x
  w["conv2/bias"][0] = -0.5
  np.testing.assert_allclose(prior(w, x), 3 * x - 0.5, rtol=1e-6)


@pytest.mark.slow
def test_trained_prior_undoes_the_degradation_better_than_nothing():
  from PIL import Image
  from tff_privacy import data
  prior = rog.ImagePrior(1, width=16, depth=3)
  weights, _ = rog.train_prior(prior, (8, 8, 1), "lfw_subset", scale_factor=2,
                               epochs=40)
  # held-out faces degraded by PIL's bicubic resampling, not the module's,
  # and noised as a search's result is
  faces = pretrained.resized(data.load_source("lfw_subset").x_test, (8, 8, 1))

  def bicubic(image, size):
    return np.asarray(Image.fromarray(image[..., 0], mode="F").resize(
        (size, size), Image.BICUBIC))[..., None]

  noise = np.random.default_rng(5).normal(0, 0.05, faces.shape)
  degraded = np.stack([bicubic(bicubic(f, 4), 8) for f in faces]) + noise
  restored = prior(weights, degraded).numpy()

  def psnr(images):
    return np.mean([s["psnr"] for s in metrics.image_scores(faces, images, (0, 1))])

  assert psnr(restored) > psnr(degraded) + 1.0


def test_learning_rate_is_cosine_annealed_to_a_tenth_by_hand():
  assert float(rog.cosine_learning_rate(0, 100, 0.05)) == pytest.approx(0.05)
  assert float(rog.cosine_learning_rate(50, 100, 0.05)) == pytest.approx(0.0275)
  assert float(rog.cosine_learning_rate(100, 100, 0.05)) == pytest.approx(0.005)
  # the authors' defaults: 100 iterations at 0.05, a quarter of the resolution
  defaults = attacks.attack_class("rog").PARAMETERS.defaults()
  assert (defaults["iterations"], defaults["lr"], defaults["scale_factor"]) == (
      100, 0.05, 4)


def test_search_recovers_an_image_of_its_own_resolution():
  # A target the search space holds exactly: the bicubic upsampling of a
  # 4x4 image, its gradient through a one-hidden-layer network.
  spec = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": (32,)})
  z_true = np.random.default_rng(1).random((1, 4, 4, 1)).astype(np.float32)
  x_true = np.clip(rog.upsample(z_true, (8, 8, 1)).numpy(), 0, 1)
  record = _record(x_true, np.array([3]), spec=spec)
  attack = attacks.build("rog", scale_factor=2, iterations=400, lr=0.05,
                         prior=False)
  out = attack([record])[0]
  assert out.labels.tolist() == [3]
  score = metrics.image_scores(x_true, out.x, (0, 1))[0]
  assert score["psnr"] > 30, score


def test_prior_is_applied_to_the_search_result(tmp_path):
  spec = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": (16,)})
  x = np.random.default_rng(2).random((1, 8, 8, 1)).astype(np.float32)
  record = _record(x, np.array([1]), spec=spec)
  prior = rog.ImagePrior(1)
  weights = {k: np.zeros(s, np.float32) for k, s in prior.shapes.items()}
  weights[f"conv{prior.depth}/bias"][:] = 0.25  # adds 0.25 everywhere
  path = str(tmp_path / "prior.npz")
  pretrained.save(path, weights, {})
  kwargs = dict(scale_factor=2, iterations=20)
  plain = attacks.build("rog", prior=False, **kwargs)([record])[0]
  shifted = attacks.build("rog", prior_weights=path, **kwargs)([record])[0]
  inside = (plain.x > 1e-3) & (plain.x < 0.74)  # unclipped either way
  assert inside.mean() > 0.3
  np.testing.assert_allclose(shifted.x[inside], plain.x[inside] + 0.25, atol=1e-5)
  assert shifted.objective == plain.objective


def test_default_prior_on_the_attacked_data_and_bad_files_are_refused(tmp_path):
  spec = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": (16,)})
  record = _record(np.zeros((1, 8, 8, 1), np.float32), np.array([1]), spec=spec)
  assert record.metadata["dataset"] == "digits"
  with pytest.raises(ValueError, match="prior_dataset='digits' shares its images"):
    attacks.build("rog", iterations=1)([record])
  wrong = str(tmp_path / "wrong.npz")
  pretrained.save(wrong, {"conv1/kernel": np.zeros((3, 3, 1, 1), np.float32)}, {})
  with pytest.raises(ValueError, match="prior_weights=.*not a ROG prior"):
    attacks.build("rog", iterations=1, prior_weights=wrong)([record])
  with pytest.raises(ValueError, match="prior_weights=.*is not a file"):
    attacks.build("rog", iterations=1,
                  prior_weights=os.path.join(tmp_path, "missing.npz"))([record])


def test_prior_sees_a_normalised_run_in_pixel_units(tmp_path):
  import dataclasses
  spec = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": (16,)})
  x = np.random.default_rng(2).random((1, 8, 8, 1)).astype(np.float32)
  record = _record((x - 0.5) / 0.5, np.array([1]), spec=spec)
  record = dataclasses.replace(record, metadata={
      **record.metadata, "normalize": {"mean": [0.5], "std": [0.5]}})
  prior = rog.ImagePrior(1)
  weights = {k: np.zeros(s, np.float32) for k, s in prior.shapes.items()}
  weights[f"conv{prior.depth}/bias"][:] = 0.25  # adds 0.25 to every pixel
  path = str(tmp_path / "prior.npz")
  pretrained.save(path, weights, {})
  kwargs = dict(scale_factor=2, iterations=20)
  plain = attacks.build("rog", prior=False, **kwargs)([record])[0]
  shifted = attacks.build("rog", prior_weights=path, **kwargs)([record])[0]
  # the normalised range is [-1, 1]; 0.25 in pixels is 0.5 there
  inside = (plain.x > -1 + 1e-3) & (plain.x < 0.49)
  assert inside.mean() > 0.3
  np.testing.assert_allclose(shifted.x[inside], plain.x[inside] + 0.5, atol=1e-5)
