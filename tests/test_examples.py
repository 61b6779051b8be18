"""The examples run as a user runs them, with no file of the package edited."""

import importlib.util
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN_DEFENSE = os.path.join(ROOT, "examples", "own_defense.py")


@pytest.fixture(scope="module")
def own_defense():
  spec = importlib.util.spec_from_file_location("own_defense_example", OWN_DEFENSE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  yield module
  from tff_privacy import defenses
  defenses.DEFENSES.unregister("qsgd")


@pytest.mark.parametrize("bits, entries", [(2, 20000), (4, 2000), (8, 2000)])
def test_qsgd_is_unbiased_and_its_declared_noise_is_its_rounding_error(
    own_defense, bits, entries):
  # few bits on many entries leave most below one level; many bits spread
  # the rounding evenly: the declaration holds in both regimes
  rng = np.random.default_rng(0)
  update = [tf.constant(rng.standard_normal(entries), tf.float32),
            tf.constant(rng.standard_normal((30, 40)) * 0.01, tf.float32)]
  qsgd = own_defense.QSGD(bits=bits)
  uploads = [qsgd.apply(update, tf.constant([s, 7], tf.int64)) for s in range(100)]
  levels = 2 ** bits - 1
  for k, u in enumerate(update):
    drawn = np.stack([up[k].numpy() for up in uploads])
    # by hand: `levels` steps of the norm; each entry within one step of u
    # and u on average
    step = np.linalg.norm(u.numpy()) / levels
    assert np.all(np.abs(drawn - u.numpy()) <= step * (1 + 1e-5))
    np.testing.assert_allclose(drawn.mean(0), u.numpy(), atol=5 * step / np.sqrt(100))
    assert own_defense.level_step(np.abs(drawn[0])) == pytest.approx(step, rel=1e-4)
    record = types.SimpleNamespace(upload=[drawn[0]], metadata={})
    declared = own_defense.rounding_noise(record)[0]
    assert declared == pytest.approx(np.std(drawn - u.numpy()), rel=0.1)


@pytest.mark.slow
def test_a_users_own_defense_trains_is_attacked_and_is_on_the_leaderboard(tmp_path):
  out = tmp_path / "board"
  done = subprocess.run([sys.executable, OWN_DEFENSE, "--out", str(out), "--small"],
                        capture_output=True, text=True, cwd=tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "attacks that know qsgd: ig_noise_aware" in done.stdout
  with open(out / "leaderboard.json") as f:
    rows = {r["entry"]: r for r in json.load(f)["rows"]}
  assert set(rows) == {"FedSGD", "QSGD"}
  qsgd = rows["QSGD"]
  assert qsgd["upload_defense"] == "qsgd" and qsgd["adaptive"] == ["ig_noise_aware"]
  assert qsgd["ssim_ig_noise_aware"] is not None and qsgd["utility"] > 0.5
  assert (out / "report.md").exists()
