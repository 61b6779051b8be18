"""Adaptive attacks: inversions that know the defence, from the upload and
the run's public configuration only."""

import dataclasses
import json
import os
import types

import numpy as np
import pytest
import tensorflow as tf
from conftest import (attack_cli, attack_store, forbid_ground_truth_in_search,
                      record_of)
from skimage.metrics import structural_similarity

from tff_privacy import attacks, models
from tff_privacy.defenses import ClientView, Soteria, Sparsification

SPEC = models.ModelSpec("lenet", (8, 8, 1), 10)


@pytest.fixture(scope="module")
def digits():
  from tff_privacy import data
  src = data.load_source("digits")
  return src.x_train, src.y_train


def _sparsified(digits, i, p):
  """The record of sample i's gradient sparsified at p, as a run with that
  defence stores it."""
  x, y = digits
  record = record_of(x[i:i + 1], y[i:i + 1])
  upload = Sparsification(p).apply([tf.constant(u) for u in record.upload])
  return dataclasses.replace(
      record, upload=[u.numpy() for u in upload],
      metadata={**record.metadata, "defense": {"name": "sparsification", "p": p}})


def _ssim(truth, reconstruction):
  return structural_similarity(truth[0, ..., 0], reconstruction[0, ..., 0],
                               win_size=7, data_range=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("i", [0, 1])
def test_masked_ig_recovers_what_sparsification_hides_from_ig(digits, i):
  # Measured at p 0.9 (400 iterations, samples 0-3): IG 0.31-0.46, ig_masked
  # 0.97-0.99; the bounds leave a margin of about 0.1 on either side.
  record = _sparsified(digits, i, 0.9)
  plain = attacks.build("ig", iterations=400)([record])[0]
  masked = attacks.build("ig_masked", iterations=400)([record])[0]
  truth = digits[0][i:i + 1]
  assert _ssim(truth, plain.x) < 0.6
  assert _ssim(truth, masked.x) > 0.85


def _soterian(digits, i, p=0.8):
  """(record of sample i's gradient under Soteria at p, the defence, the
  client's view it pruned from)."""
  x, y = digits
  record = record_of(x[i:i + 1], y[i:i + 1])
  soteria = Soteria(SPEC, p=p)
  view = ClientView([tf.constant(w) for w in record.broadcast],
                    tf.data.Dataset.from_tensor_slices(
                        {"x": x[i:i + 1], "y": y[i:i + 1]}).batch(1))
  upload = soteria.apply([tf.constant(u) for u in record.upload], client=view)
  record = dataclasses.replace(
      record, upload=[u.numpy() for u in upload],
      metadata={**record.metadata, "defense": {"name": "soteria", **soteria.params()}})
  return record, soteria, view


@pytest.mark.slow
def test_soteria_mask_drops_the_pruned_rows_and_keeps_every_other_layer(digits):
  x, y = digits
  record, soteria, view = _soterian(digits, 2)
  kernel = [v.name for v in SPEC.keras().trainable_variables].index(
      f"{soteria.layer}/kernel:0")
  attack = attacks.build("ig_masked")
  mask = attack.upload_mask(attack.targets([record])[0])
  # the defence's own choice of rows (from the client's data), less the rows
  # the client's gradient already had at zero (nothing told them apart)
  kept = soteria.mask(view).numpy() * np.any(record_of(
      x[2:3], y[2:3]).upload[kernel] != 0, axis=1)
  assert kept.sum() < len(kept)
  np.testing.assert_array_equal(mask[kernel].numpy(),
                                np.broadcast_to(kept[:, None], mask[kernel].shape))
  for j, m in enumerate(mask):
    if j != kernel:
      assert np.all(m.numpy() == 1)


@pytest.mark.parametrize("layer, message", [
    (None, "has no 'layer'"),  # a store captured without the field
    ("conv9", "cannot read its store: layer='conv9' is not a layer")])
def test_a_soteria_store_it_cannot_read_is_refused(digits, layer, message):
  record, _, _ = _soterian(digits, 1)
  defense = {k: v for k, v in record.metadata["defense"].items() if k != "layer"}
  if layer is not None:
    defense["layer"] = layer
  old = dataclasses.replace(record, metadata={**record.metadata,
                                              "defense": defense})
  with pytest.raises(attacks.UploadRefused, match=message) as refused:
    attacks.build("ig_masked", iterations=1)([old])
  assert "ig_masked" in str(refused.value)
  assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_masked_ig_recovers_what_soteria_hides_from_ig(digits):
  # Measured at p 0.8 (400 iterations, samples 0-3): IG 0.08-0.34, ig_masked
  # 1.000.
  record, _, _ = _soterian(digits, 0)
  truth = digits[0][:1]
  assert _ssim(truth, attacks.build("ig", iterations=400)([record])[0].x) < 0.6
  assert _ssim(truth, attacks.build("ig_masked", iterations=400)(
      [record])[0].x) > 0.9


def test_the_search_never_reads_the_ground_truth(digits, tmp_path, monkeypatch,
                                                 capsys):
  x, y = digits[0][3:4], digits[1][3:4]
  updates = attack_store(tmp_path, _sparsified(digits, 3, 0.9), x, y)
  reads = forbid_ground_truth_in_search(monkeypatch, attacks.MaskedInvertingGradients)
  out = str(tmp_path / "out")
  code, err = attack_cli(capsys, updates, out, "--attack", "ig_masked",
                      "--iterations", "400")
  assert code == 0, err
  with open(os.path.join(out, "attack.json")) as f:
    assert json.load(f)["attack"] == "ig_masked"
  with np.load(os.path.join(out, "reconstructions.npz")) as f:
    reconstructed = f["reconstructed"]
  assert reads  # the scoring, after the search
  assert _ssim(x, reconstructed) > 0.85


def test_the_cli_refuses_a_run_without_a_defense_the_attack_knows(
    digits, tmp_path, capsys):
  x, y = digits[0][:1], digits[1][:1]
  updates = attack_store(tmp_path, record_of(x, y), x, y)
  code, err = attack_cli(capsys, updates, str(tmp_path / "out"), "--attack",
                      "ig_masked", "--iterations", "1")
  assert code != 0
  assert len(err.strip().splitlines()) == 1
  assert "ig_masked" in err and "no defense" in err and "'ig'" in err


def test_each_defense_is_answered_by_its_adaptive_attacks_or_listed_without():
  assert attacks.adaptive_attacks("sparsification") == ["ig_masked"]
  assert attacks.adaptive_attacks("soteria") == ["ig_masked"]
  assert attacks.adaptive_attacks("ldp_gaussian") == ["ig_noise_aware"]
  assert attacks.adaptive_attacks("fedre") == ["ig_noise_aware"]
  assert attacks.adaptive_attacks("hyperfl") == ["tailored_hyperfl"]
  assert attacks.adaptive_attacks("fedem") == ["ig_denoised"]
  with pytest.raises(ValueError, match="defense='nope' is unknown"):
    attacks.adaptive_attacks("nope")


def test_a_defense_not_registered_here_leaves_plain_ig_and_refuses_adaptive_ones(
    digits):
  # a store captured under a plugin that this process does not have
  record = record_of(digits[0][:1], digits[1][:1])
  record = dataclasses.replace(record, metadata={
      **record.metadata, "defense": {"name": "plugin_not_installed"}})
  assert len(attacks.build("ig", iterations=1)([record])) == 1
  with pytest.raises(attacks.UploadRefused, match=(
      r"reads the transmitted_mask a defense declares \(soteria, sparsification\)"
      r".*plugin_not_installed, which is not registered here")):
    attacks.build("ig_masked", iterations=1)([record])


def test_every_registered_defense_has_an_adaptive_attack_or_says_why_not():
  # over the registries, so that a new defense cannot leave it unsaid
  unanswered = attacks.without_adaptive_attack()
  for name in attacks.defenses():
    assert bool(attacks.adaptive_attacks(name)) != (name in unanswered)
    assert (name in unanswered) == bool(attacks.disclosure(name).no_adaptive_attack)
  assert sorted(unanswered) == ["dp_clip", "dp_fedavg", "recupfl"]


@pytest.mark.slow
def test_grouped_masked_search_equals_one_record_at_a_time(digits):
  # each record its own mask: plain Adam steps over 5 iterations (see
  # test_attacks' grouped test for why short and unsigned)
  records = [dataclasses.replace(_sparsified(digits, i, 0.9), client_index=i)
             for i in range(3)]
  grouped = attacks.build("ig_masked", iterations=5, group_size=3, signed=False)
  together = grouped(records, seed=7)
  for record, got in zip(records, together):
    want = grouped([record], seed=7)[0]
    np.testing.assert_allclose(got.x, want.x, atol=1e-5, rtol=0)
    assert got.objective == pytest.approx(want.objective, abs=1e-6)


@pytest.mark.parametrize("metadata,expected", [
    ({"method": "fedsgd", "defense": {"name": "soteria", "p": 0.8}}, "soteria"),
    ({"method": "fedem", "defense": None}, "fedem"),
    ({"method": "fedre", "defense": {"name": "fedre", "epsilon": 50.0}}, "fedre"),
    ({"method": "fedavg", "defense": None}, None),
    ({"method": "fedavg"}, None)])
def test_a_records_defense_is_its_defenses_else_a_defending_methods(metadata,
                                                                     expected):
  record = types.SimpleNamespace(metadata=metadata)
  assert attacks.defense_of(record) == expected
