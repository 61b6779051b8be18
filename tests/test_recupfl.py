"""RECUP-FL's perturbation (Algorithm 1, Appendix E) against a plain numpy
implementation with linear softmax defenders, whose input gradients are
written out by hand."""

import os
import re

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import io, models, runner
from tff_privacy.algorithms.client_data import client_seed
from tff_privacy.attacks import attribute
from tff_privacy.defenses import ClientView, defender_zoo, recupfl
from tff_privacy.updates import GroundTruthStore, UpdateStore

SIZE, LENGTH, CLASSES, ZOO = 203, 16, 3, 6


def _zoo(seed=0):
  rng = np.random.default_rng(seed)
  return [(rng.normal(size=(LENGTH, CLASSES)).astype(np.float32),
           rng.normal(size=CLASSES).astype(np.float32)) for _ in range(ZOO)]


def _defenders(zoo):
  return [lambda z, w=w, b=b: tf.matmul(z, w) + b for w, b in zoo]


def _np_gradient(zoo_model, x, label):
  """d CE(softmax(pool(x) W + b), label) / dx, through each bin's maximum."""
  w, b = zoo_model
  bins = np.array_split(np.arange(SIZE), LENGTH)
  z = np.array([x[i].max() for i in bins], np.float64)
  logits = z @ w + b
  p = np.exp(logits - logits.max())
  p /= p.sum()
  dz = (p - np.eye(CLASSES)[label]) @ w.T
  dx = np.zeros(SIZE)
  for j, i in enumerate(bins):
    dx[i[np.argmax(x[i])]] = dz[j]
  return dx


def _np_perturbation(x, label, zoo, choices, eps, iterations, sampled, variant):
  g = lambda k, v: _np_gradient(zoo[k], v, label)
  step = eps / sampled
  if variant == "one_step":
    return eps * np.sign(g(choices[0, 0], x))
  if variant == "average":
    return sum(eps * np.sign(g(choices[0, q], x)) for q in range(sampled)) / sampled
  if variant in ("iterative", "momentum"):
    v, u = x.copy(), np.zeros_like(x)
    for q in range(sampled):
      d = g(choices[0, q], v)
      if variant == "momentum":
        u = 0.9 * u + d / np.abs(d).sum()
        d = u
      v = v + step * np.sign(d)
    return v - x
  current = x.copy()
  for p in range(iterations):
    v = current.copy()
    for q in range(sampled - 1):
      v = v + step * np.sign(g(choices[p, q], v))
    current = current + eps * np.sign(g(choices[p, sampled - 1], v))
  return current - x


def _sparse(seed):
  """An upload like a one-record gradient: most entries exactly 0, so most
  pooling bins hold tied maxima."""
  rng = np.random.default_rng(seed)
  return (rng.normal(size=SIZE) * (rng.random(SIZE) < 0.05)).astype(np.float32)


def _first_maxima(x):
  """The index of the first maximum of each pooling bin."""
  return np.array([b[np.argmax(x[b])] for b in
                   np.array_split(np.arange(SIZE), LENGTH)])


def _pooled(flat):
  """The upload's entries at its bins' `first_maxima`, [1, LENGTH]: what the
  defenders read."""
  flat = tf.constant(flat)
  return tf.gather(flat, recupfl.first_maxima(
      flat, recupfl.pool_segments(SIZE, LENGTH)))[None]


def test_first_maxima_gather_the_adversaries_max_pooling():
  rng = np.random.default_rng(1)
  upload = [rng.normal(size=(7, 9)), rng.normal(size=140)]
  flat = np.concatenate([u.ravel() for u in upload]).astype(np.float32)
  np.testing.assert_allclose(_pooled(flat).numpy()[0],
                             attribute.pooled(upload, LENGTH))


def test_first_maxima_on_ties_gather_the_adversaries_max_pooling():
  flat = _sparse(11)
  flat[[3, 4, 40]] = 2.5  # ties of a non-zero maximum
  flat[[60, 61]] = -0.0, np.nan
  flat[200] = -np.inf
  upload = [flat[:63].reshape(7, 9), flat[63:]]
  np.testing.assert_array_equal(_pooled(flat).numpy()[0],
                                attribute.pooled(upload, LENGTH))


REDUCE_MAX = tf.reduce_max


def _reduce_max_from_lowest(values, axis, keepdims):
  """`tf.reduce_max` as a GPU kernel may compute it: from -FLT_MAX, so
  that an all -inf bin's maximum is -FLT_MAX, which no entry equals."""
  lowest = tf.constant(np.finfo(np.float32).min)
  maxima = REDUCE_MAX(values, axis=axis, keepdims=keepdims)
  return tf.where(tf.math.is_nan(maxima), maxima, tf.maximum(maxima, lowest))


@pytest.mark.parametrize("reduce_max", [REDUCE_MAX, _reduce_max_from_lowest])
def test_first_maxima_by_hand(monkeypatch, reduce_max):
  """NaNs first, then the first maximum; an all -inf bin gives its first
  entry, on the CPU's maximum and on one that starts from -FLT_MAX."""
  monkeypatch.setattr(tf, "reduce_max", reduce_max)
  inf, nan = np.inf, np.nan
  flat = tf.constant([1.0, nan, 3.0, nan,  # two NaNs: the first, 1
                      -inf, -inf, -inf,  # all -inf: the first, 4
                      0.5, 2.0, -1.0, 2.0,  # tied maxima: the first, 8
                      -inf, -3.0, -3.0], tf.float32)  # the first -3, 12
  segments = np.repeat(np.arange(4), [4, 3, 4, 3])
  np.testing.assert_array_equal(recupfl.first_maxima(flat, segments), [1, 4, 8, 12])


def test_first_maxima_refuses_bins_out_of_order():
  with pytest.raises(ValueError, match="segments must number contiguous bins"):
    recupfl.first_maxima(tf.zeros([4]), np.array([0, 1, 0, 1]))


@pytest.mark.parametrize("variant", recupfl.VARIANTS)
def test_steps_on_each_bins_largest_entries_are_steps_on_the_whole_upload(
    monkeypatch, variant):
  """The steps read only each bin's `_candidates` (here 6 or fewer of its
  13 entries): the same perturbation as steps that read every entry."""
  x = np.round(2 * _sparse(13))  # many ties, at 0 and elsewhere
  kwargs = dict(epsilon=0.3, pool_length=LENGTH, seed=tf.constant([5, 6], tf.int64),
                sampled=3, iterations=2, variant=variant)
  defenders = _defenders(_zoo())
  reduced = recupfl.attribute_perturbation(x, 1, defenders, **kwargs).numpy()
  monkeypatch.setattr(recupfl, "_candidates", lambda flat, segments, steps: tf.constant(
      recupfl._bin_table(segments, pad=len(segments))[1]))
  every = recupfl.attribute_perturbation(x, 1, defenders, **kwargs).numpy()
  assert np.count_nonzero(every) > LENGTH // 2
  np.testing.assert_array_equal(reduced, every)


def test_a_step_moves_only_the_first_maximum_of_each_pooling_bin():
  x = _sparse(12)
  segments = recupfl.pool_segments(SIZE, LENGTH)
  tied = [np.sum(x[segments == j] == x[segments == j].max()) for j in range(LENGTH)]
  assert sum(t > 1 for t in tied) >= LENGTH // 2  # the case at stake
  delta = recupfl.attribute_perturbation(
      x, 1, _defenders(_zoo()), epsilon=1e-3, pool_length=LENGTH,
      seed=tf.constant([3, 4], tf.int64), sampled=3, variant="one_step").numpy()
  moved = delta != 0
  assert np.bincount(segments, weights=moved, minlength=LENGTH).max() == 1
  assert set(np.flatnonzero(moved)) <= set(_first_maxima(x))


@pytest.mark.parametrize("variant", recupfl.VARIANTS)
@pytest.mark.parametrize("attack_loss", recupfl.ATTACK_LOSSES)
@pytest.mark.parametrize("sparse", [False, True])
def test_perturbation_matches_a_plain_implementation(variant, attack_loss, sparse):
  """Both losses take the cross-entropy gradient's signs (the plain
  implementation's), on dense uploads and on uploads full of ties."""
  zoo = _zoo()
  x = (_sparse(2) if sparse else
       np.random.default_rng(2).normal(size=SIZE).astype(np.float32))
  seed = tf.constant([3, 4], tf.int64)
  rounds = 4 if variant == "recupfl" else 1
  choices = recupfl.model_choices(seed, rounds, ZOO, 3).numpy()
  got = recupfl.attribute_perturbation(
      x, 1, _defenders(zoo), epsilon=0.01, pool_length=LENGTH, seed=seed,
      iterations=4, sampled=3, variant=variant, attack_loss=attack_loss).numpy()
  expected = _np_perturbation(x.astype(np.float64), 1, zoo, choices, 0.01, 4, 3,
                              variant)
  np.testing.assert_allclose(got, expected, atol=1e-6)


def test_recupfl_moves_entries_by_multiples_of_epsilon_and_fools_the_zoo():
  zoo = _zoo(5)
  x = np.random.default_rng(3).normal(size=SIZE).astype(np.float32)
  delta = recupfl.attribute_perturbation(
      x, 0, _defenders(zoo), epsilon=0.05, pool_length=LENGTH,
      seed=tf.constant([1, 2], tf.int64), iterations=10, sampled=5).numpy()
  steps = delta / 0.05
  np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
  assert np.abs(steps).max() <= 10 + 1e-3 and np.abs(steps).sum() > 0

  def mean_loss(v):
    z = _pooled(v)
    return np.mean([float(tf.keras.losses.sparse_categorical_crossentropy(
        [0], d(z), from_logits=True)[0]) for d in _defenders(zoo)])
  assert mean_loss(x + delta) > mean_loss(x)


def test_several_attributes_add_their_weighted_perturbations():
  rng = np.random.default_rng(4)
  upload = [tf.constant(rng.normal(size=(7, 9)), tf.float32),
            tf.constant(rng.normal(size=140), tf.float32)]
  flat = np.concatenate([u.numpy().ravel() for u in upload]).astype(np.float64)
  zoos = [_zoo(6), _zoo(7)]
  seeds = [tf.constant([1, k], tf.int64) for k in (1, 2)]
  got = recupfl.perturb_upload(
      upload, [(2, _defenders(zoos[0]), 0.25, seeds[0]),
               (0, _defenders(zoos[1]), 0.75, seeds[1])],
      epsilon=0.02, pool_length=LENGTH, iterations=3, sampled=2)
  expected = flat + sum(
      gamma * _np_perturbation(flat, label, zoo,
                               recupfl.model_choices(seed, 3, ZOO, 2).numpy(),
                               0.02, 3, 2, "recupfl")
      for label, zoo, gamma, seed in zip((2, 0), zoos, (0.25, 0.75), seeds))
  assert [g.shape for g in got] == [u.shape for u in upload]
  np.testing.assert_allclose(tf.concat([tf.reshape(g, [-1]) for g in got], 0),
                             expected, atol=1e-6)


def test_model_choices_are_distinct_per_iteration_and_seeded():
  choices = recupfl.model_choices(tf.constant([5, 6], tf.int64), 50, 20, 5).numpy()
  assert all(len(set(row)) == 5 for row in choices) and choices.max() < 20
  again = recupfl.model_choices(tf.constant([5, 6], tf.int64), 50, 20, 5).numpy()
  np.testing.assert_array_equal(choices, again)
  assert len({tuple(r) for r in choices}) > 40


def _binary_defender(seed, scale):
  """A zoo-shaped binary defender (`defender_zoo.defender_logits`) whose
  standardisation divides by `scale`: its arrays and the function."""
  rng = np.random.default_rng(seed)
  arrays = [rng.normal(size=s).astype(np.float32) for s in
            ((LENGTH, 8), (8,), (8, 4), (4,), (4, 1), (1,))]
  mean, scales = np.zeros(LENGTH, np.float32), np.full(LENGTH, scale, np.float32)
  return (arrays, mean, scales), lambda z: defender_zoo.defender_logits(
      mean, scales, arrays, z)


def _np_binary_logit(defender, x):
  """The binary defender's logit z at upload x and dz/dx (float64, through
  each bin's first maximum)."""
  (arrays, mean, scale), _ = defender
  k1, b1, k2, b2, k3, b3 = [a.astype(np.float64) for a in arrays]
  first = _first_maxima(x)
  h0 = (x[first].astype(np.float64) - mean) / scale
  a1 = h0 @ k1 + b1
  a2 = np.maximum(a1, 0) @ k2 + b2
  z = np.maximum(a2, 0) @ k3[:, 0] + b3[0]
  dh1 = (k3[:, 0] * (a2 > 0)) @ k2.T
  dx = np.zeros(SIZE)
  dx[first] = ((dh1 * (a1 > 0)) @ k1.T) / scale
  return z, dx


@pytest.mark.parametrize("label", [0, 1])
def test_the_logit_margin_steps_as_the_cross_entropy_where_it_does_not_saturate(
    label):
  defender = _binary_defender(21, 1.0)
  x = _sparse(22)
  z, dz = _np_binary_logit(defender, x)
  sigmoid = 1 / (1 + np.exp(-z))
  expected = np.sign((sigmoid - label) * dz)  # d CE([0, z], label) / dx
  assert np.count_nonzero(expected) >= LENGTH
  for attack_loss in recupfl.ATTACK_LOSSES:
    delta, zero_share = recupfl.measured_perturbation(
        x, label, [defender[1]], epsilon=0.01, pool_length=LENGTH,
        seed=tf.constant([1, 1], tf.int64), sampled=1, variant="one_step",
        attack_loss=attack_loss)
    np.testing.assert_array_equal(np.sign(delta.numpy()), expected)
    assert float(zero_share) == 0.0


@pytest.mark.parametrize("variant", ["one_step", "recupfl"])
def test_a_saturated_defender_stops_the_cross_entropy_not_the_logit_margin(variant):
  """Standardised by tiny scales (mostly-zero features), a defender's logit
  is in the thousands: its softmax is exactly 1 at the predicted class in
  float32, the cross-entropy's gradient exactly 0."""
  defender = _binary_defender(23, 1e-3)
  x = _sparse(24)
  z, dz = _np_binary_logit(defender, x)
  label = int(z > 0)
  assert abs(z) > 1000
  logits = defender[1](tf.constant(x[_first_maxima(x)])[None])
  assert float(tf.nn.softmax(logits)[0, label]) == 1.0
  kwargs = dict(epsilon=0.1, pool_length=LENGTH, seed=tf.constant([1, 1], tf.int64),
                iterations=3, sampled=2, variant=variant)
  defenders = [defender[1]] * 2
  delta, zero_share = recupfl.measured_perturbation(
      x, label, defenders, attack_loss="cross_entropy", **kwargs)
  assert not np.any(delta.numpy()) and float(zero_share) == 1.0
  delta, zero_share = recupfl.measured_perturbation(
      x, label, defenders, attack_loss="logit_margin", **kwargs)
  assert float(zero_share) == 0.0
  if variant == "one_step":  # d (logsumexp_{c != a} z_c - z_a) / dx: -+dz/dx
    np.testing.assert_array_equal(np.sign(delta.numpy()),
                                  np.sign((1 - 2 * label) * dz))
  assert np.count_nonzero(delta.numpy()) >= LENGTH // 2


def test_a_saturated_three_class_cross_entropy_strays_without_vanishing():
  """Three classes, the true one leading the next by 40: in float32 p_a is
  1, the next one's p_c about e^-40. The cross-entropy's gradient keeps
  sum_{c != a} p_c J_c but loses -J_a (J_c = W[:, c] for a linear
  defender): non-zero, so no zero-gradient step, and signed unlike the
  logit margin's."""
  rng = np.random.default_rng(25)
  x = rng.normal(size=SIZE).astype(np.float32)
  z = x[_first_maxima(x)].astype(np.float64)
  w = rng.normal(size=(LENGTH, CLASSES))
  logits = z @ w
  label = int(np.argmax(logits))
  lead = logits[label] - np.max(np.delete(logits, label))
  w = (w * 40 / lead).astype(np.float32)  # the lead is now 40
  defender = lambda v: tf.matmul(v, w)
  logits = (z @ w).astype(np.float32)
  p = np.exp(logits - logits.max())
  p /= p.sum()
  assert p[label] == 1.0 and 0 < np.delete(p, label).max()
  cross_entropy = np.delete(p, label) @ np.delete(w, label, 1).T
  others = np.exp(np.delete(logits, label) - np.delete(logits, label).max())
  margin = (others / others.sum()) @ np.delete(w, label, 1).T - w[:, label]
  signs = {}
  for attack_loss in recupfl.ATTACK_LOSSES:
    delta, zero_share = recupfl.measured_perturbation(
        x, label, [defender], epsilon=0.01, pool_length=LENGTH,
        seed=tf.constant([1, 1], tf.int64), sampled=1, variant="one_step",
        attack_loss=attack_loss)
    assert float(zero_share) == 0.0
    signs[attack_loss] = np.sign(delta.numpy()[_first_maxima(x)])
  np.testing.assert_array_equal(signs["cross_entropy"], np.sign(cross_entropy))
  np.testing.assert_array_equal(signs["logit_margin"], np.sign(margin))
  assert np.any(signs["cross_entropy"] != signs["logit_margin"])


@pytest.mark.parametrize("kwargs,match", [
    ({"variant": "pgd"}, "variant='pgd'"), ({"epsilon": 0.0}, "epsilon must be > 0"),
    ({"attack_loss": "mse"}, "attack_loss='mse'; choose one of"),
    ({"iterations": 0}, "iterations P must be >= 1"),
    ({"sampled": 1}, "sampled models Q must be >= 2"),
    ({"sampled": 7}, r"sampled models Q must be in \[1, 6\]"),
    ({"pool_length": 500}, r"pool length must be in \[1, 203\]")])
def test_bad_arguments_are_refused(kwargs, match):
  args = dict(epsilon=0.01, pool_length=LENGTH, seed=tf.constant([0, 0], tf.int64))
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    recupfl.attribute_perturbation(np.zeros(SIZE, np.float32), 0,
                                   _defenders(_zoo()), **args)


def test_perturbation_compiles_in_a_graph_with_the_label_and_seed_as_inputs():
  zoo = _zoo(8)
  x = np.random.default_rng(9).normal(size=SIZE).astype(np.float32)
  kwargs = dict(epsilon=0.03, pool_length=LENGTH, iterations=3, sampled=3)
  graph = tf.function(lambda v, a, s: recupfl.attribute_perturbation(
      v, a, _defenders(zoo), seed=s, **kwargs))
  seed = tf.constant([2, 2], tf.int64)
  np.testing.assert_allclose(
      graph(x, tf.constant(2), seed),
      recupfl.attribute_perturbation(x, 2, _defenders(zoo), seed=seed, **kwargs),
      atol=1e-6)


def _shadow(classes, seed=0, n=120):
  rng = np.random.default_rng(seed)
  attributes = np.arange(n) % classes
  features = rng.normal(size=(n, LENGTH)) + attributes[:, None] * 0.8
  return features.astype(np.float32), attributes


@pytest.mark.parametrize("classes", [2, 3])
def test_zoo_defenders_are_the_fitted_scikit_learn_models(classes):
  features, attributes = _shadow(classes)
  pipelines = defender_zoo.fit_defenders(features, attributes,
                                         widths=((8, 4), (16, 8)), epochs=20)
  zoo = defender_zoo.zoo_from_pipelines(pipelines, "a", [f"c{k}" for k in range(classes)])
  for pipeline, defender in zip(pipelines, defender_zoo.defenders(zoo)):
    probabilities = tf.nn.softmax(defender(tf.constant(features))).numpy()
    np.testing.assert_allclose(probabilities, pipeline.predict_proba(features),
                               atol=1e-5)


def _saved_zoo(folder, widths, seed=1):
  features, attributes = _shadow(3, seed)
  zoo = defender_zoo.zoo_from_pipelines(defender_zoo.fit_defenders(
      features, attributes, widths=widths, epochs=5), "race", ["x", "y", "z"])
  defender_zoo.save_zoo(zoo, folder)
  return zoo


def _perturb_from_files(folder, **kwargs):
  return tf.function(lambda v: recupfl.attribute_perturbation(
      v, 1, defender_zoo.defenders(defender_zoo.load_zoo(folder, in_graph=True)),
      **kwargs))


@pytest.mark.slow
def test_saved_zoo_is_read_by_the_graph_and_stays_out_of_it(tmp_path):
  large = _saved_zoo(str(tmp_path / "large"), ((256, 128), (128, 64), (64, 32)))
  small = _saved_zoo(str(tmp_path / "small"), ((4, 2), (4, 2), (4, 2)))
  again = defender_zoo.load_zoo(str(tmp_path / "large"))
  for m, n in zip(large.models, again.models):
    for a, b in zip(m, n):
      np.testing.assert_array_equal(a, b)
  x = np.random.default_rng(2).normal(size=SIZE).astype(np.float32)
  kwargs = dict(epsilon=0.01, pool_length=LENGTH, iterations=2, sampled=2,
                seed=tf.constant([1, 1], tf.int64))
  from_files = _perturb_from_files(str(tmp_path / "large"), **kwargs)
  expected = recupfl.attribute_perturbation(x, 1, defender_zoo.defenders(large), **kwargs)
  np.testing.assert_allclose(from_files(x), expected, atol=1e-6)

  def graph_bytes(fn):
    return len(fn.get_concrete_function(tf.TensorSpec([SIZE], tf.float32))
               .graph.as_graph_def().SerializeToString())
  # the weights stay in the files: a zoo 150 times larger, the same graph
  assert large.size_bytes() > 150 * small.size_bytes()
  assert graph_bytes(from_files) < 1.05 * graph_bytes(
      _perturb_from_files(str(tmp_path / "small"), **kwargs))
  embedded = tf.function(lambda v: recupfl.attribute_perturbation(
      v, 1, defender_zoo.defenders(large), **kwargs))
  assert graph_bytes(embedded) > large.size_bytes() > 2 * graph_bytes(from_files)
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".zoo-")]


def test_a_stale_zoo_of_the_same_shapes_is_refused_when_read(tmp_path):
  folder = str(tmp_path / "zoo")
  widths = ((4, 2), (4, 2), (4, 2))
  built = _saved_zoo(folder, widths, seed=1)
  recorded = defender_zoo.read_index(folder)["fingerprint"]
  stale = str(tmp_path / "stale")
  _saved_zoo(stale, widths, seed=2)
  assert defender_zoo.read_index(stale)["shapes"] == defender_zoo.read_index(
      folder)["shapes"]

  # as the client work reads it on a TFF worker: the expected fingerprint
  # is an input, the files are read each time the computation runs
  @tff.tensorflow.computation(tff.TensorType(np.int64))
  def read_mean(expected):
    return defender_zoo.load_zoo(folder, in_graph=True,
                                 fingerprint=expected).mean

  np.testing.assert_array_equal(read_mean(recorded), built.mean)
  for name in os.listdir(stale):  # another zoo's files, as on a worker's disk
    if name.endswith(".tensor"):
      os.replace(os.path.join(stale, name), os.path.join(folder, name))
  refused = "other weights than the zoo built for this round"
  with pytest.raises(Exception, match=f"zoo=.*{refused}"):
    read_mean(recorded)
  with pytest.raises(ValueError, match=f"zoo='{re.escape(folder)}'.*{refused}"):
    defender_zoo.load_zoo(folder)  # checked against its zoo.json


def test_zoo_errors_name_what_is_wrong(tmp_path):
  with pytest.raises(ValueError, match="zoo=.*nowhere.*holds no readable zoo.json"):
    defender_zoo.load_zoo(str(tmp_path / "nowhere"))
  features, _ = _shadow(3)
  with pytest.raises(ValueError, match="one attribute class only"):
    defender_zoo.fit_defenders(features, np.zeros(len(features), int))
  pipelines = defender_zoo.fit_defenders(features, np.arange(len(features)) % 2,
                                         widths=((4, 2),), epochs=2)
  with pytest.raises(ValueError, match="classes \\[0, 1\\] of 3; every class must occur"):
    defender_zoo.zoo_from_pipelines(pipelines, "race", ["a", "b", "c"])


def test_shadow_features_pool_the_tasks_gradient():
  spec = models.ModelSpec("mlp", (12,), 2, {"hidden": (6,)}, "binary_mse")
  rng = np.random.default_rng(3)
  x = rng.random((4, 12)).astype(np.float32)
  y = np.array([1, 0, 0, 1], np.int32)
  broadcast = spec.initial_weights(2)
  got = attribute.shadow_features(spec, broadcast, x, y, "gradient",
                                  {"batch_size": 1}, length=20)
  model = spec.keras()
  model.set_weights(broadcast)
  for i in range(4):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(tf.sigmoid(model(x[i:i + 1])[:, 0]) - y[i]))
    grads = tape.gradient(loss, model.trainable_variables)
    np.testing.assert_allclose(got[i], attribute.pooled([g.numpy() for g in grads], 20),
                               atol=1e-7)


def test_client_protections_from_text_and_a_json_file(tmp_path):
  attributes = ("race", "sex")
  assert recupfl.client_protections("race", 2, attributes) == [{"race": 1.0}] * 2
  assert recupfl.client_protections("race=0.25, sex=0.75", 1, attributes) == [
      {"race": 0.25, "sex": 0.75}]
  path = tmp_path / "protect.json"
  path.write_text('{"default": "race", "clients": {"1": "sex=0.5", "3": "sex=0.5"}}')
  assert recupfl.client_protections(str(path), 4, attributes) == [
      {"race": 1.0}, {"sex": 0.5}, {"race": 1.0}, {"sex": 0.5}]


@pytest.mark.parametrize("text,match", [
    ("age", "attribute 'age' is not one of the data set's: race, sex"),
    ("race=1.5", r"gamma of 'race' must be a number in \[0, 1\], got '1.5'"),
    ("race=high", "got 'high'"), ("race,race=0.5", "'race' given twice"),
    ("", r"expected 'attribute\[=gamma\]"), ("none.json", "no such file")])
def test_bad_protections_name_the_parameter(text, match):
  with pytest.raises(ValueError, match=f"protect.*{match}"):
    recupfl.client_protections(text, 2, ("race", "sex"))


def _adult_config(out, **defense_kwargs):
  return runner.RunConfig(
      out=str(out), method="fedsgd", dataset="adult", model="mlp",
      model_kwargs={"hidden": [8]}, clients=4, rounds=2, batch_size=64, seed=3,
      capture_rounds=(1, 2),  # every round captured: one process to build
      defense="recupfl", defense_kwargs={
          "protect": "race", "zoo_size": 3, "sampled_models": 2, "iterations": 3,
          "shadow_samples": 60, "zoo_epochs": 2, "pool_length": 64,
          "perturbation_budget": 0.01, **defense_kwargs})


@pytest.mark.slow
def test_captured_upload_is_the_gradient_perturbed_against_the_zoo_files(tmp_path):
  path = tmp_path / "protect.json"  # client 1 protects nothing: sent as it is
  path.write_text('{"default": "race", "clients": {"1": "race=0"}}')
  # the zoo trains on the test split's first 60 records, which hold every
  # race (the training split's first 60 lack one)
  config = _adult_config(tmp_path / "run", protect=str(path),
                         shadow_pool="disjoint_test")
  history = runner.run(config, progress=False)
  defense = runner.Run(config).client_defense
  store = UpdateStore(os.path.join(config.out, "updates"))
  truth = GroundTruthStore(os.path.join(config.out, "ground_truth"))
  unperturbed = []
  for client in store.clients(2):
    record = store.read(2, client)
    assert record.metadata["defense"]["name"] == "recupfl"
    x, y = truth.read(2, client)
    model = record.model_spec.keras()
    model.set_weights(record.broadcast)
    with tf.GradientTape() as tape:
      loss = record.model_spec.task_object.loss(model(x), y)
    clean = tape.gradient(loss, model.trainable_variables)
    view = ClientView([tf.constant(w) for w in record.broadcast], None,
                      defense.client_inputs(client, 2))
    want = defense.apply(clean, client_seed(config.seed, 2, client), view)
    moved = 0
    for got, w, c in zip(record.upload, want, clean):
      np.testing.assert_allclose(got, w.numpy(), atol=2e-6)
      moved += int(np.sum(np.abs(got - c.numpy()) > 1e-4))
    # entries move by multiples of epsilon (0.01), far above rounding
    unperturbed.append(moved == 0)
  assert unperturbed == [False, True, False, False]
  assert history[1]["unperturbed_share"] == pytest.approx(np.mean(unperturbed))
  saved = io.read_json(os.path.join(config.out, "metrics.json"))
  assert [0 <= m["recupfl/zero_gradient_steps"] <= 1 for m in saved] == [True] * 2
  assert os.listdir(os.path.join(config.out, "recupfl_zoo")) == ["race"]  # sex: no one


@pytest.mark.slow
def test_clients_protect_what_their_json_says_with_their_own_class(tmp_path):
  path = tmp_path / "protect.json"
  path.write_text('{"default": "race", "clients": {"1": "sex=0.5", "3": "sex=0.5"}}')
  # the sample of 200 training records holds every race (of 60, two lack)
  run = runner.Run(_adult_config(tmp_path / "run", protect=str(path),
                                 shadow_samples=200))
  defense, fed = run.client_defense, run.fed
  # the round's zoos first: the clients' inputs name the weights they read
  defense.prepare_round(1, run.spec.initial_weights(3), run.algorithm.upload_kind,
                        run.algorithm.protocol)
  for client in range(4):
    inputs = defense.client_inputs(client, 1)
    gammas = (inputs["recupfl_gamma_race"], inputs["recupfl_gamma_sex"])
    assert gammas == ((0.0, 0.5) if client in (1, 3) else (1.0, 0.0))
    sexes = fed.source.attributes.train["sex"][fed.client_indices[client]]
    assert inputs["recupfl_class_sex"] == np.bincount(sexes).argmax()


@pytest.mark.parametrize("kwargs,match", [
    ({"protect": "age"}, "attribute 'age' is not one of the data set's: race, sex"),
    ({"sampled_models": 4}, r"sampled_models \(4\) exceeds zoo_size \(3\)"),
    ({"zoo_size": 21}, "zoo_size"), ({"fgsm": "pgd"}, "fgsm")])
def test_bad_recupfl_settings_are_refused(tmp_path, kwargs, match):
  with pytest.raises(ValueError, match=match):
    runner.Run(_adult_config(tmp_path, **kwargs))


def test_recupfl_needs_a_data_set_with_attributes(tmp_path):
  config = runner.RunConfig(out=str(tmp_path), method="fedsgd", dataset="digits",
                            model="mlp", clients=2, defense="recupfl",
                            defense_kwargs={"protect": "race"})
  with pytest.raises(ValueError, match="needs a data set with sensitive attributes"):
    runner.Run(config)


def test_a_run_on_workers_at_addresses_is_refused_before_it_writes(
    tmp_path, monkeypatch):
  """Workers elsewhere do not see the zoo files the clients read; a Python
  run is refused as the CLI is, whatever started the workers."""
  from tff_privacy import runtime
  monkeypatch.setattr(runtime, "serves_remotely", lambda: True)
  with pytest.raises(ValueError, match="^--defense recupfl and "
                     "--worker-addresses: its clients read files"):
    runner.run(_adult_config(tmp_path / "run"), progress=False)
  assert not os.path.exists(tmp_path / "run")
