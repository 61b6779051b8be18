"""The noise-aware inversion: each tensor weighted by the inverse of its
noise level, from the run's public parameters or the upload itself."""

import dataclasses
import os
import types

import numpy as np
import pytest
import tensorflow as tf
from conftest import (attack_cli, attack_store, forbid_ground_truth_in_search,
                      record_of)
from skimage.metrics import structural_similarity

from tff_privacy import attacks, models
from tff_privacy.algorithms import fedre
from tff_privacy.attacks import noise_aware
from tff_privacy.attacks.inversion import total_variation
from tff_privacy.defenses import ClientView
from tff_privacy.updates import UpdateRecord

# every tensor's noise over its clipped signal's root mean square, C / sqrt(n):
# little on the first convolution and the classifier (labels stay
# recoverable), a hundredfold more on the layers between
LAYER_NOISE = (0.01, 0.01, 10, 10, 10, 10, 0.01, 0.01)


@pytest.fixture(scope="module")
def digits():
  from tff_privacy import data
  src = data.load_source("digits")
  return src.x_train, src.y_train


def _fedre_metadata(record, clip, **defense):
  """`record`'s metadata as a FedRE run with the PSI split publishes it."""
  return {**record.metadata, "method": "fedre", "upload_kind": record.upload_kind,
          "defense": {"name": "fedre", "epsilon": 50.0, "clip": clip,
                      "budget_split": "psi", "eta_placement": "client",
                      "learning_rate": 0.005, "perturbation": "gradient",
                      "noise_on": "update", "regions": None, **defense}}


def _layer_noised(digits, i):
  """(record of sample i's LeNet gradient plus Gaussian noise of the
  `LAYER_NOISE` levels, under FedRE's PSI split, those levels)."""
  x, y = digits
  record = record_of(x[i:i + 1], y[i:i + 1])
  clip = max(float(np.linalg.norm(u)) for u in record.upload)  # binds nowhere
  rng = np.random.default_rng(i)
  levels = [f * clip / np.sqrt(u.size) for u, f in zip(record.upload, LAYER_NOISE)]
  upload = [u + rng.normal(0, s, u.shape).astype(np.float32)
            for u, s in zip(record.upload, levels)]
  return dataclasses.replace(record, upload=upload,
                             metadata=_fedre_metadata(record, clip)), levels


def _declared_levels(record):
  """The noise levels the record's defense declares."""
  return attacks.disclosure(attacks.defense_of(record)).read("noise_levels", record)


def _ssim(truth, reconstruction):
  return structural_similarity(truth[0, ..., 0], reconstruction[0, ..., 0],
                               win_size=7, data_range=1.0)


@pytest.mark.slow
def test_weighting_recovers_what_layer_wise_noise_hides_from_ig(digits):
  # Measured (300 iterations, samples 0-1): IG 0.02-0.13, ig_noise_aware
  # 0.993-0.995.
  record, _ = _layer_noised(digits, 0)
  truth = digits[0][:1]
  assert _ssim(truth, attacks.build("ig", iterations=300)([record])[0].x) < 0.5
  assert _ssim(truth, attacks.build("ig_noise_aware", iterations=300)(
      [record])[0].x) > 0.9


def test_the_psi_splits_levels_are_estimated_from_the_upload(digits):
  record, levels = _layer_noised(digits, 1)
  clip = record.metadata["defense"]["clip"]
  estimated = _declared_levels(record)
  for u, got, want in zip(record.upload, estimated, levels):
    if want > clip / np.sqrt(u.size):  # above what the clipped signal can be
      assert got == pytest.approx(want, rel=0.2 if u.size >= 100 else 0.5)
    else:  # hidden in the signal: no more than the upload's rms
      assert got <= np.sqrt(np.mean(u ** 2))
  attack = attacks.build("ig_noise_aware")
  weights = attack.upload_mask(attack.targets([record])[0])
  for w, got in zip(weights, estimated):
    np.testing.assert_allclose(w.numpy(), min(estimated) / got, rtol=1e-6)


SPEC = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": [32]})


def _even_split_upload(epsilon, epochs=1, clip=0.5, samples=4, seed=0):
  """A FedRE client's upload under the even split (eq. 9, 'sample'
  sensitivity), its data passed `epochs` times as a run passes it: the
  record and the tensors' noise std by hand."""
  mechanism = fedre.FedREMechanism(
      SPEC, epsilon=epsilon, delta=1e-5, rounds=5, clip=clip,
      budget_split="even", noise_calibration="paper", psi_samples=2,
      psi_pixels=None, local_epochs=epochs)
  weights = SPEC.initial_weights(0)
  rng = np.random.default_rng(seed)
  x = rng.random((samples, 8, 8, 1)).astype(np.float32)
  view = ClientView([tf.constant(w) for w in weights],
                    tf.data.Dataset.from_tensor_slices(
                        {"x": x, "y": np.arange(samples) % 10}).batch(2)
                    .repeat(epochs),
                    {fedre.MASK_KEY: tf.ones([8, 8])})
  update = [rng.normal(size=w.shape).astype(np.float32) for w in weights]
  upload = mechanism.apply(update, tf.constant([seed, 1], tf.int64), view)
  # four tensors, two layers: epsilon / 4 each; delta / 4 each
  sigma = np.sqrt(2 * 5 * np.log(4 / 1e-5)) / (epsilon / 4)
  std = 2 * clip * sigma / samples
  meta = {"method": "fedre", "upload_kind": "model_delta",
          "model": SPEC.to_json(), "dataset": "digits", "value_range": [0.0, 1.0],
          "raw_max": 16.0, "protocol": {"batch_size": 2},
          "defense": {"name": "fedre", **mechanism.params(), "regions": None}}
  record = UpdateRecord(1, 0, "client_0000", [u.numpy() for u in upload],
                        float(samples), samples, weights, meta)
  return record, [std] * len(weights)


@pytest.mark.parametrize("epsilon, epochs, within", [
    (20.0, 1, 0.05), (20.0, 2, 0.05), (2000.0, 1, 0.15)])
def test_the_even_splits_levels_are_public_and_the_estimate_finds_them(
    epsilon, epochs, within):
  # at epsilon 20 the noise dominates every tensor; at 2000 the clipped
  # signal (norm 0.5) is of the noise's size on the first kernel (2,048
  # entries, noise std 0.006 against the signal's rms 0.011), and the
  # smaller tensors' noise hides under their signal
  record, stds = _even_split_upload(epsilon, epochs)
  np.testing.assert_allclose(_declared_levels(record), stds, rtol=1e-5)
  estimated = noise_aware.estimated_levels(record.upload, 0.5)
  assert estimated[0] == pytest.approx(stds[0], rel=within)
  if epsilon == 20.0:  # 32 to 320 entries: a chi-square's spread
    np.testing.assert_allclose(estimated[1:], stds[1:], rtol=0.5)


@pytest.mark.slow
def test_one_noise_level_leaves_the_search_plain_igs(digits):
  x, y = digits
  record = record_of(x[:1], y[:1])
  rng = np.random.default_rng(0)
  record = dataclasses.replace(
      record, upload=[u + rng.normal(0, 0.1, u.shape).astype(np.float32)
                      for u in record.upload],
      metadata={**record.metadata, "defense": {"name": "ldp_gaussian",
                                               "clip": 1.0, "noise_multiplier": 0.1}})
  plain = attacks.build("ig", iterations=5)([record])[0]
  aware = attacks.build("ig_noise_aware", iterations=5)([record])[0]
  np.testing.assert_allclose(aware.x, plain.x, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_grouped_search_equals_one_record_at_a_time(digits):
  # each record its own weights; plain Adam steps over 5 iterations (see
  # test_attacks' grouped test for why short and unsigned)
  records = [dataclasses.replace(_layer_noised(digits, i)[0], client_index=i)
             for i in range(3)]
  grouped = attacks.build("ig_noise_aware", iterations=5, group_size=3,
                          signed=False)
  together = grouped(records, seed=7)
  for record, got in zip(records, together):
    want = grouped([record], seed=7)[0]
    np.testing.assert_allclose(got.x, want.x, atol=1e-5, rtol=0)
    assert got.objective == pytest.approx(want.objective, abs=1e-6)


def test_region_tv_counts_only_the_pairs_inside_the_region():
  rng = np.random.default_rng(0)
  x = rng.random((2, 5, 6, 1)).astype(np.float32)
  inside = np.zeros((5, 6))
  inside[1:4, 2:5] = 1  # the box 2,1,5,4
  # by hand: differences between two pixels of the box, over every pair
  dx = sum(abs(x[n, r, c + 1, 0] - x[n, r, c, 0]) for n in range(2)
           for r in range(1, 4) for c in range(2, 4)) / (2 * 5 * 5)
  dy = sum(abs(x[n, r + 1, c, 0] - x[n, r, c, 0]) for n in range(2)
           for r in range(1, 3) for c in range(2, 5)) / (2 * 4 * 6)
  got = total_variation(tf.constant(x), weights=tf.constant(
      inside[None, :, :, None], tf.float32))
  assert float(got) == pytest.approx(dx + dy, rel=1e-5)


def test_the_region_prior_reads_the_runs_boxes(digits):
  record, _ = _layer_noised(digits, 0)
  boxed = dataclasses.replace(record, metadata=_fedre_metadata(
      record, 1.0, regions="2,1,5,4"))
  attack = attacks.build("ig_noise_aware", region_tv_weight=0.01)
  weight, pixels = attack.region_prior(attack.targets([boxed])[0])
  want = np.zeros((1, 8, 8, 1), np.float32)
  want[0, 1:4, 2:5, 0] = 1
  np.testing.assert_array_equal(pixels.numpy(), want)
  assert float(weight) == pytest.approx(0.01)
  # the default region: the central box of a quarter of each side
  _, pixels = attack.region_prior(attack.targets([record])[0])
  want = np.zeros((1, 8, 8, 1), np.float32)
  want[0, 3:5, 3:5, 0] = 1
  np.testing.assert_array_equal(pixels.numpy(), want)
  plain = attacks.build("ig_noise_aware")
  assert plain.region_prior(plain.targets([record])[0]) == []


@pytest.mark.parametrize("defense, message", [
    ({"name": "sparsification", "p": 0.9}, "was uploaded under sparsification"),
    ({"name": "fedre", "perturbation": "pixels", "pixel_noise": 0.1},
     "noise on the pixels"),
    ({"name": "fedre", "perturbation": "gradient", "noise_on": "steps"},
     "noise on the steps")])
def test_uploads_without_noise_it_answers_are_refused(digits, defense, message):
  x, y = digits
  record = record_of(x[:1], y[:1])
  record = dataclasses.replace(record, metadata={**record.metadata,
                                                 "defense": defense})
  with pytest.raises(attacks.UploadRefused, match=message) as refused:
    attacks.build("ig_noise_aware", iterations=1)([record])
  assert "\n" not in str(refused.value)


@pytest.mark.parametrize("split, dropped", [
    ("psi", "noise_on"),  # read when the records are checked
    ("even", "noise_calibration")])  # read by noise_levels, for the mask
def test_a_store_without_a_field_it_reads_is_refused(digits, split, dropped):
  # a FedRE store captured by an older version, before the field existed
  record = (_layer_noised(digits, 0)[0] if split == "psi"
            else _even_split_upload(20.0)[0])
  defense = {k: v for k, v in record.metadata["defense"].items() if k != dropped}
  old = dataclasses.replace(record, metadata={**record.metadata,
                                              "defense": defense})
  with pytest.raises(attacks.UploadRefused,
                     match=f"has no '{dropped}'") as refused:
    attacks.build("ig_noise_aware", iterations=1)([old])
  assert "ig_noise_aware" in str(refused.value)
  assert "\n" not in str(refused.value)


def test_region_prior_refuses_regions_it_cannot_rebuild(digits):
  record, _ = _layer_noised(digits, 0)
  named = dataclasses.replace(record, metadata=_fedre_metadata(
      record, 1.0, regions="numbers"))
  with pytest.raises(attacks.UploadRefused, match="regions='numbers'"):
    attacks.build("ig_noise_aware", region_tv_weight=0.01, iterations=1)([named])


@pytest.mark.slow
def test_the_search_never_reads_the_ground_truth(digits, tmp_path, monkeypatch,
                                                 capsys):
  record, _ = _layer_noised(digits, 1)
  x, y = digits[0][1:2], digits[1][1:2]
  updates = attack_store(tmp_path, record, x, y)
  reads = forbid_ground_truth_in_search(monkeypatch, noise_aware.NoiseAwareInvertingGradients)
  out = str(tmp_path / "out")
  code, err = attack_cli(capsys, updates, out, "--attack", "ig_noise_aware",
                         "--iterations", "300")
  assert code == 0, err
  with np.load(os.path.join(out, "reconstructions.npz")) as f:
    reconstructed = f["reconstructed"]
  assert reads  # the scoring, after the search
  assert _ssim(x, reconstructed) > 0.9


@pytest.mark.parametrize("name, kwargs", [
    ("ldp_gaussian", {"clip": 1.0, "noise_multiplier": 0.3}),
    ("ldp_laplace", {"clip": 1.0, "noise_multiplier": 0.3}),
    ("ldp_fed", {"alpha": 1.0, "clip": 0.05, "precision": 3, "fraction": 1.0})])
def test_the_local_defenses_level_is_the_std_their_noise_has(name, kwargs):
  # the defence's own draws on a zero update, whose clipping leaves it zero
  from tff_privacy import defenses
  defense = defenses.build(name, **kwargs)
  zero = [tf.zeros([100, 100])]
  noise = np.concatenate([defense.apply(zero, tf.constant([s, 0], tf.int64))[0]
                          .numpy().ravel() for s in range(4)])
  record = types.SimpleNamespace(
      upload=[np.zeros(3), np.zeros(5)],
      metadata={"defense": {"name": name, **kwargs}})
  levels = _declared_levels(record)
  assert levels[0] == levels[1] == pytest.approx(noise.std(), rel=0.03)


def test_the_cli_refuses_an_upload_without_noise_in_one_line(digits, tmp_path,
                                                             capsys):
  x, y = digits[0][:1], digits[1][:1]
  updates = attack_store(tmp_path, record_of(x, y), x, y)
  code, err = attack_cli(capsys, updates, str(tmp_path / "out"), "--attack",
                         "ig_noise_aware", "--iterations", "1")
  assert code != 0
  assert len(err.strip().splitlines()) == 1
  assert "ig_noise_aware" in err and "no defense" in err and "'ig'" in err
