"""benchmarks/recupfl_client_time.py: it times one LFW client's round as
RECUP-FL's Table 1 does (local training, then the perturbation), against a
zoo of the paper's shape, and reads memory as the system sees it."""

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tff_privacy.defenses import defender_zoo, recupfl
from tff_privacy.models import builders

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from conftest import load_script

SCRIPT = os.path.join(ROOT, "benchmarks", "recupfl_client_time.py")
EPSILON = 1e-3


@pytest.fixture(scope="module")
def bench():
  return load_script(SCRIPT)


def _keras_gradient(broadcast, x, y):
  """The mean softmax cross-entropy's gradient of the LFW CNN, by Keras."""
  model = builders.recupfl_lfw((62, 47, 3), 2)
  model.set_weights(broadcast)
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
        y, model(x), from_logits=True))
  return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def _flat(tensors) -> np.ndarray:
  return np.concatenate([np.ravel(t) for t in tensors])


def test_a_clients_local_training_is_its_lfw_faces_gradient(bench):
  spec = bench.lfw_spec()
  broadcast = spec.initial_weights(0)
  steps = bench.client_steps(spec, broadcast, "no zoo read", EPSILON)
  x, y, _, _ = bench.clients(2)[1]
  assert x.shape == (1, 62, 47, 3)  # one sample, shaped as LFW's faces
  got = steps["training"](x, y)
  for g, expected in zip(got, _keras_gradient(broadcast, x, y), strict=True):
    np.testing.assert_allclose(g.numpy(), expected, rtol=1e-4, atol=1e-7)


def test_the_random_zoo_has_the_papers_shape(bench):
  pooled = np.random.default_rng(0).normal(size=(6, 1024))
  pooled[:, 5] = 2.0  # a constant feature
  zoo = bench.random_zoo(pooled)
  widths = {(k1.shape[1], k2.shape[1]) for k1, _, k2, _, _, _ in zoo.models}
  assert len(zoo.models) == 20
  assert widths == {(h1, h2) for h1 in (128, 256, 512, 1024, 2048)
                    for h2 in (128, 256, 512, 1024)}
  for k1, b1, k2, b2, k3, b3 in zoo.models:
    assert k1.shape[0] == 1024 and k3.shape[1] == b3.shape[0] == 3  # race
    for kernel, bias in ((k1, b1), (k2, b2), (k3, b3)):
      bound = np.sqrt(6 / sum(kernel.shape))  # scikit-learn's MLP init
      assert np.abs(kernel).max() <= bound and np.abs(bias).max() <= bound
      assert np.abs(kernel).max() > 0.9 * bound
  np.testing.assert_allclose(zoo.mean, pooled.mean(0), rtol=1e-6)
  expected_scale = pooled.std(0)
  expected_scale[5] = 1.0
  np.testing.assert_allclose(zoo.scale, expected_scale, rtol=1e-6)


@pytest.mark.slow
def test_the_recupfl_round_is_the_gradient_perturbed_by_algorithm_1(bench, tmp_path):
  spec = bench.lfw_spec()
  broadcast = spec.initial_weights(0)
  pooled = np.random.default_rng(1).normal(size=(8, 1024)).astype(np.float32)
  # 6 of the paper's 20 defenders, the narrowest: Q = 5 of them still drawn
  # at each step, in half the time
  paper = bench.random_zoo(pooled)
  zoo = dataclasses.replace(paper, models=paper.models[:6])
  defender_zoo.save_zoo(zoo, str(tmp_path / "zoo"))
  steps = bench.client_steps(spec, broadcast, str(tmp_path / "zoo"), EPSILON)
  client = bench.clients(1)[0]
  clean = steps["training"](*client[:2])
  upload, zero_steps = steps["recupfl_round"](*client)
  alone, _ = steps["recupfl"](clean, *client[2:])
  expected = recupfl.perturb_upload(
      clean, [(client[2], defender_zoo.defenders(zoo), 1.0, client[3])],
      epsilon=EPSILON, pool_length=1024, iterations=10, sampled=5)
  np.testing.assert_allclose(_flat(upload), _flat(expected), rtol=0, atol=1e-9)
  np.testing.assert_allclose(_flat(alone), _flat(expected), rtol=0, atol=1e-9)
  moves = (_flat(upload).astype(np.float64) - _flat(clean)) / EPSILON
  moved = moves != 0
  assert bench.moved_entries(clean, upload) == moved.sum() > 0
  # meta-test steps move an entry by epsilon each, P = 10 of them
  np.testing.assert_allclose(moves[moved], np.round(moves[moved]), atol=1e-3)
  assert np.abs(moves).max() <= 10 + 1e-3
  assert float(zero_steps) == 0.0


def test_memory_added_counts_the_memory_a_call_touches_also_reused(bench):
  chunk = 64 * 1024  # below glibc's mmap threshold: heap memory
  held = [bytearray(chunk) for _ in range(2000)]
  pin = bytearray(chunk)  # keeps the freed chunks off the heap's top
  del held

  def reuse():
    return len([bytearray(chunk) for _ in range(2000)])

  _, reused = bench.memory_added(reuse, ())
  assert reused == pytest.approx(2000 * chunk / 2**20, rel=0.05)
  _, big = bench.memory_added(lambda n: np.ones(n, np.uint8), (300 * 2**20,))
  _, small = bench.memory_added(lambda n: np.ones(n, np.uint8), (100 * 2**20,))
  assert (big, small) == (pytest.approx(300, rel=0.05), pytest.approx(100, rel=0.05))
  del pin


@pytest.mark.parametrize("value", ["0", "-1e-3", "nan", "inf"])
def test_a_bad_budget_is_refused_in_one_line(bench, value, monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", [SCRIPT, f"--epsilon={value}"])
  with pytest.raises(SystemExit) as exit_:
    bench.main()
  assert exit_.value.code == 2
  assert capsys.readouterr().err.splitlines()[-1].endswith(
      f"error: --epsilon must be a finite number > 0, got {float(value)}")


@pytest.mark.slow  # 40 s; the fast suite checks its steps, zoo and memory
def test_a_tiny_run_prints_every_step_and_the_ratios():
  result = subprocess.run(
      [sys.executable, SCRIPT, "--clients", "1", "--repeats", "1"],
      capture_output=True, text=True, timeout=600,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
  assert result.returncode == 0, result.stderr
  assert "Traceback" not in result.stderr
  out = result.stdout
  for label in ("local training alone", "round with DP (Gaussian)",
                "round with RECUP-FL", "DP (Gaussian) alone",
                "RECUP-FL's perturbation alone"):
    assert f"\n{label}: " in out
  for key in ("ratio_recupfl_round_over_dp_gaussian_round=",
              "ratio_recupfl_over_dp_gaussian=", "zero_gradient_steps=0.000",
              "recupfl_round_ms_per_client=", "recupfl_ms_per_client="):
    assert key in out
