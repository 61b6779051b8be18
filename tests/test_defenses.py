import numpy as np
import pytest
import tensorflow as tf

from tff_privacy import defenses

SHAPES = [(30, 40), (40,), (40, 10)]


def _update(scale=1.0, seed=0):
  rng = np.random.default_rng(seed)
  return [tf.constant(rng.normal(0, scale, s), tf.float32) for s in SHAPES]


def _norm(update):
  return float(tf.linalg.global_norm(update))


def test_clip_only_bounds_the_update_norm_and_adds_no_noise():
  d = defenses.ClipOnly(clip=1.5)
  big, small = _update(10.0), _update(0.001)
  assert _norm(d.apply(big, 0)) == pytest.approx(1.5, rel=1e-5)
  for a, b in zip(d.apply(small, 0), small):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_local_gaussian_noise_has_std_z_times_clip():
  d = defenses.LocalGaussian(clip=0.5, noise_multiplier=2.0)
  zero = [tf.zeros(s) for s in SHAPES]
  noise = np.concatenate([v.numpy().ravel() for v in d.apply(zero, 11)])
  # 1,640 samples: relative error of the sample std ~ 1.7%; tolerance 8%
  assert noise.std() == pytest.approx(1.0, rel=0.08)
  assert float(d.dp_event(1640).noise_multiplier) == 2.0


def test_local_laplace_noise_has_std_sqrt2_times_scale():
  d = defenses.LocalLaplace(clip=1.0, noise_multiplier=0.25)
  zero = [tf.zeros((100, 100))]
  noise = d.apply(zero, 5)[0].numpy()
  assert noise.std() == pytest.approx(np.sqrt(2) * 0.25, rel=0.05)
  # L2 clipping bounds the L1 sensitivity by sqrt(d) times the clip
  assert d.dp_event(10000).noise_multiplier == pytest.approx(0.25 / 100)
  assert defenses.LocalLaplace(1.0, 0.25, "l1").dp_event(10000).noise_multiplier == 0.25


def test_noise_depends_only_on_the_seed():
  d = defenses.LocalGaussian(clip=1.0, noise_multiplier=1.0)
  u = _update()
  a, b, c = d.apply(u, 3), d.apply(u, 3), d.apply(u, 4)
  np.testing.assert_array_equal(a[0], b[0])
  assert not np.allclose(a[0], c[0])


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.99])
def test_sparsification_keeps_exactly_the_requested_fraction(p):
  u = _update()
  out = defenses.Sparsification(p).apply(u)
  flat_in = np.concatenate([v.numpy().ravel() for v in u])
  flat_out = np.concatenate([v.numpy().ravel() for v in out])
  kept = np.flatnonzero(flat_out)
  assert len(kept) == int(np.ceil((1 - p) * flat_in.size))
  np.testing.assert_array_equal(flat_out[kept], flat_in[kept])
  # the kept entries are the largest in magnitude
  assert np.abs(flat_in[kept]).min() >= np.abs(np.delete(flat_in, kept)).max(initial=0)


@pytest.mark.parametrize("name,kwargs,match", [
    ("ldp_gaussian", dict(clip=0.0, noise_multiplier=1.0), "clip must be > 0"),
    ("ldp_gaussian", dict(clip=1.0, noise_multiplier=-1.0), "noise_multiplier must be >= 0"),
    ("ldp_laplace", dict(clip=1.0, noise_multiplier=1.0, norm="max"), "norm='max'"),
    ("sparsification", dict(p=1.0), r"p must lie in \[0, 1\)"),
    ("sparsification", dict(p=-0.1), r"p must lie in \[0, 1\)"),
    ("soteria_v2", dict(), "defense='soteria_v2'"),
])
def test_bad_parameters_name_themselves(name, kwargs, match):
  with pytest.raises(ValueError, match=match):
    defenses.build(name, **kwargs)


@pytest.mark.parametrize("defense", [
    defenses.LocalGaussian(1.0, 1.0), defenses.LocalLaplace(1.0, 1.0),
    defenses.ClipOnly(1.0), defenses.Sparsification(0.5)])
def test_defenses_trace_into_graphs_with_the_same_result(defense):
  # Client work runs them inside TFF computations, i.e. in graph mode.
  u = _update()
  seed = tf.constant([7, 0], tf.int64)
  graph = tf.function(lambda update, s: defense.apply(update, s))(u, seed)
  for a, b in zip(graph, defense.apply(u, seed)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
