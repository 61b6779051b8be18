import numpy as np
import pytest
import tensorflow as tf

from tff_privacy import data, defenses, leaderboard
from tff_privacy.models import ModelSpec, functional

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
  # local DP: two clipped uploads differ by up to 2 * clip, so the noise
  # std z * clip is z / 2 times that sensitivity
  assert float(d.dp_event(1640).noise_multiplier) == 1.0


def test_local_laplace_noise_has_std_sqrt2_times_scale():
  d = defenses.LocalLaplace(clip=1.0, noise_multiplier=0.25)
  zero = [tf.zeros((100, 100))]
  noise = d.apply(zero, 5)[0].numpy()
  assert noise.std() == pytest.approx(np.sqrt(2) * 0.25, rel=0.05)
  # L2 clipping bounds the L1 distance of two clipped uploads by
  # 2 sqrt(d) times the clip
  assert d.dp_event(10000).noise_multiplier == pytest.approx(0.25 / (2 * 100))
  assert defenses.LocalLaplace(1.0, 0.25, "l1").dp_event(10000).noise_multiplier == 0.125


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
    defenses.ClipOnly(1.0), defenses.Sparsification(0.5), defenses.LDPFed()])
def test_defenses_trace_into_graphs_with_the_same_result(defense):
  # Client work runs them inside TFF computations, i.e. in graph mode.
  u = _update()
  seed = tf.constant([7, 0], tf.int64)
  graph = tf.function(lambda update, s: defense.apply(update, s))(u, seed)
  for a, b in zip(graph, defense.apply(u, seed)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _gradient(spec, x, y):
  model = spec.keras(seed=1)
  weights = [tf.constant(v) for v in model.trainable_variables]
  with tf.GradientTape() as tape:
    tape.watch(weights)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        y, functional.forward(model, weights, x)))
  return model, weights, tape.gradient(loss, weights)


@pytest.fixture(scope="module")
def lenet_client():
  spec = ModelSpec("lenet", (12, 12, 1), 4)
  rng = np.random.default_rng(0)
  x = tf.constant(rng.uniform(0, 1, (3, 12, 12, 1)), tf.float32)
  y = tf.constant([0, 3, 1], tf.int32)
  model, weights, grads = _gradient(spec, x, y)
  view = defenses.ClientView(
      weights, tf.data.Dataset.from_tensor_slices({"x": x, "y": y}).batch(2))
  return spec, model, x, grads, view


@pytest.mark.parametrize("p", [0.0, 0.5, 0.9])
def test_soteria_changes_only_the_defended_layer(lenet_client, p):
  spec, model, _, grads, view = lenet_client
  soteria = defenses.build("soteria", spec, p=p)
  out = soteria.apply(grads, None, view)
  k = functional.kernel_index(model, "fc")
  for i, (a, b) in enumerate(zip(out, grads)):
    if i != k:
      np.testing.assert_array_equal(a, b)
  width = grads[k].shape[0]  # 3 * 3 * 12 features feed the dense layer
  zero_rows = np.flatnonzero(~out[k].numpy().any(axis=1))
  assert len(zero_rows) == width - int(np.ceil((1 - p) * width))
  kept = np.setdiff1d(np.arange(width), zero_rows)
  np.testing.assert_array_equal(out[k].numpy()[kept], grads[k].numpy()[kept])


@pytest.mark.slow
def test_soteria_prunes_the_features_with_the_largest_iota(lenet_client):
  spec, model, x, grads, view = lenet_client
  soteria = defenses.Soteria(spec, p=0.5)
  scores = soteria.feature_scores(view.weights, x).numpy()
  # brute force: one input gradient per sample and feature
  s = np.zeros(scores.shape)
  for b in range(x.shape[0]):
    xb = x[b:b + 1]
    for i in range(s.size):
      with tf.GradientTape() as tape:
        tape.watch(xb)
        _, r = functional.forward(model, view.weights, xb, tap="fc")
        r_i = r[0, i]
      s[i] += np.linalg.norm(tape.gradient(r_i, xb)) / (float(r_i) + 0.1)
  np.testing.assert_allclose(scores, s, rtol=1e-4)
  mask = soteria.mask(view).numpy()
  # pruned: smallest s, i.e. largest iota = r / ||d r / d x||
  assert s[mask == 0].max() <= s[mask == 1].min()


def test_soteria_defends_the_first_dense_layer_that_reads_a_representation():
  mlp = ModelSpec("mlp", (28, 28, 1), 2, {"hidden": [64, 32]})
  layers = mlp.keras().layers
  assert [type(l).__name__ for l in layers] == ["Flatten", "Dense", "Dense", "Dense"]
  # the first dense layer reads the flattened image; the second, the first's
  # 64 units
  assert defenses.Soteria(mlp).layer == layers[2].name
  assert defenses.Soteria(mlp, layer=layers[3].name).layer == layers[3].name
  cnn = ModelSpec("cnn", (28, 28, 1), 2)
  layers = cnn.keras().layers
  assert [type(l).__name__ for l in layers] == [
      "Conv2D", "MaxPooling2D", "Conv2D", "MaxPooling2D", "Flatten", "Dense", "Dense"]
  assert defenses.Soteria(cnn).layer == layers[5].name


def test_soteria_refuses_a_layer_that_reads_the_input():
  mlp = ModelSpec("mlp", (28, 28, 1), 2, {"hidden": [64]})
  with pytest.raises(ValueError, match="layer='fc1' reads mlp's input, not a learned "
                     r"representation .* choose one of \['fc2'\]"):
    defenses.Soteria(mlp, layer="fc1")
  with pytest.raises(ValueError, match=r"layer: mlp has no dense layer that reads a "
                     r"learned representation \(dense layers: \['fc1'\]\)"):
    defenses.Soteria(ModelSpec("mlp", (28, 28, 1), 2, {"hidden": []}))


def test_a_representation_is_what_learned_weights_computed():
  L = tf.keras.layers
  with tf.Graph().as_default():
    x = tf.keras.Input((6, 6, 1))
    raw = L.Dense(3, name="raw")(L.Flatten()(x))
    features = L.Dense(3, name="features")(L.GlobalAveragePooling2D()(L.Conv2D(2, 3)(x)))
    head = L.Dense(2, name="head")(L.Concatenate()([raw, features]))
    model = tf.keras.Model(x, head)
    assert functional.representation_dense_layers(model) == ["features", "head"]


def test_soteria_strengths_give_different_uploads_on_the_leaderboards_mlp():
  protocol = leaderboard.defaults.grid("compact")["protocol"]
  source = data.load_source(protocol["dataset"])
  spec = ModelSpec(protocol["model"], source.input_shape, source.num_classes,
                   protocol["model_kwargs"])
  x, y = tf.constant(source.x_train[:1]), tf.constant(source.y_train[:1], tf.int32)
  model, weights, grads = _gradient(spec, x, y)
  view = defenses.ClientView(
      weights, tf.data.Dataset.from_tensor_slices({"x": x, "y": y}).batch(1))
  uploads = {p: [u.numpy() for u in defenses.Soteria(spec, p=p).apply(grads, None, view)]
             for p in (0.8, 0.95)}
  assert not all(np.array_equal(a, b) for a, b in zip(uploads[0.8], uploads[0.95]))
  k = functional.kernel_index(model, "fc2")  # reads the 64 hidden units
  for p, pruned in ((0.8, 64 - 13), (0.95, 64 - 4)):  # 64 - ceil((1 - p) 64)
    assert np.count_nonzero(~uploads[p][k].any(axis=1)) >= pruned  # ReLU zeros too


def test_ldp_fed_outputs_the_ordinal_cldp_distribution():
  d = defenses.LDPFed(alpha=0.5, clip=0.01, precision=3)
  values = [tf.fill([20000], 0.0234)]  # 23.4 grid units, in range
  out = d.apply(values, tf.constant([1, 2], tf.int64))[0].numpy()
  units = np.round(out * 1000).astype(int)
  np.testing.assert_allclose(out * 1000, units, atol=1e-3)  # on the grid
  assert units.min() >= -10 and units.max() <= 10  # clipped to [-c, c]
  grid = np.arange(-10, 11)
  want = np.exp(-0.5 * np.abs(10 - grid) / 2)  # 0.0234 clips to 10 units
  want /= want.sum()
  got = np.bincount(units + 10, minlength=21) / units.size
  # 20,000 draws: standard error of each frequency <= 0.0035
  np.testing.assert_allclose(got, want, atol=0.015)


def test_ldp_fed_shares_exactly_the_requested_fraction():
  d = defenses.LDPFed(alpha=50.0, clip=0.05, precision=3, fraction=0.25)
  u = [tf.fill([30, 40], 0.03), tf.fill([40], -0.03)]
  out = d.apply(u, tf.constant([3, 4], tf.int64))
  flat = np.concatenate([v.numpy().ravel() for v in out])
  # alpha = 50: shared entries come out at +-0.03, never at 0
  assert np.count_nonzero(flat) == int(np.ceil(0.25 * 1240))
  np.testing.assert_allclose(np.abs(flat[flat != 0]), 0.03, atol=1e-6)
  assert d.pure_epsilon(1240) == pytest.approx(310 * 50.0 * 2 * 50)


@pytest.mark.parametrize("kwargs,match", [
    (dict(alpha=0.0), "alpha must be > 0"),
    (dict(clip=-1.0), "clip must be > 0"),
    (dict(precision=1.5), "precision must be an integer"),
    (dict(fraction=0.0), r"fraction must lie in \(0, 1\]"),
    (dict(clip=0.0001, precision=3), "clip \\* 10\\*\\*precision must be >= 1"),
])
def test_ldp_fed_bad_parameters_name_themselves(kwargs, match):
  with pytest.raises(ValueError, match=match):
    defenses.build("ldp_fed", **kwargs)


def test_soteria_bad_parameters_name_themselves():
  spec = ModelSpec("cnn", (8, 8, 1), 3)
  with pytest.raises(ValueError, match=r"p must lie in \[0, 1\)"):
    defenses.build("soteria", spec, p=1.0)
  with pytest.raises(ValueError, match="layer='conv1' is not a dense layer"):
    defenses.build("soteria", spec, layer="conv1")
  with pytest.raises(ValueError, match="needs the model's ModelSpec"):
    defenses.build("soteria")


def test_a_compressing_defense_gives_its_uploads_size_in_its_own_encoding():
  # 2 of 10 entries nonzero: 2 x (int32 index + float32 value), not 10 x 4
  sparse = [np.array([[0, 1.5, 0], [0, 0, 0]], np.float32),
            np.array([0, -2.0, 0, 0], np.float32)]
  assert defenses.encoded_bytes("sparsification", {"p": 0.8}, sparse) == 16
  # every entry nonzero: dense (3 x 4 bytes) is smaller than 3 x 8
  assert defenses.encoded_bytes("sparsification", {"p": 0.1},
                                [np.ones(3, np.float32)]) == 12
  # LDP-Fed at clip 0.05, precision 3: |U| = 2 x 50 + 1 = 101 codes, 7 bits
  # each; 100 entries: ceil(700 / 8) = 88 bytes
  upload = [np.zeros((10, 9), np.float32), np.zeros(10, np.float32)]
  assert defenses.encoded_bytes("ldp_fed", {}, upload) == 88
  # 5 shared: 5 x (4 index bytes) + ceil(35 / 8) = 25; 20 shared: 80 +
  # ceil(140 / 8) = 98 > 88, so every entry's code
  assert defenses.encoded_bytes("ldp_fed", {"fraction": 0.05}, upload) == 25
  assert defenses.encoded_bytes("ldp_fed", {"fraction": 0.2}, upload) == 88
  # clip 1, precision 2: |U| = 201, 8 bits each
  assert defenses.encoded_bytes("ldp_fed", {"clip": 1.0, "precision": 2}, upload) == 100
  noise = {"clip": 1.0, "noise_multiplier": 0.1}
  for name, kwargs in ((None, {}), ("ldp_gaussian", noise), ("dp_fedavg", noise)):
    assert defenses.encoded_bytes(name, kwargs, upload) is None


class _Negated(defenses.UpdateDefense):
  """Uploads -update: a defence whose effect a test can undo exactly."""
  name = "negated"

  def apply(self, update, seed, client=None):
    return [-u for u in update]


@pytest.mark.parametrize("local", ["model_delta", "gradient"])
def test_a_defended_client_uploads_tffs_own_update_defended(local):
  import collections

  import tensorflow_federated as tff
  from tensorflow_federated.python.learning.algorithms import fed_sgd

  from tff_privacy.algorithms import client_data, defended
  from tff_privacy.aggregation.wide_sum import wide_sum_then_finalize

  spec = ModelSpec("mlp", (8, 8, 1), 3, {"hidden": (5,)})
  model_fn = spec.tff_model_fn()
  optimizer = tff.learning.optimizers.build_sgdm(0.3, momentum=0.9)
  if local == "model_delta":
    plain = tff.learning.templates.build_model_delta_client_work(
        model_fn, optimizer, tff.learning.ClientWeighting.NUM_EXAMPLES,
        wide_sum_then_finalize)
    update = defended.model_delta_update(model_fn, optimizer)
  else:
    plain = fed_sgd._build_fed_sgd_client_work(model_fn, wide_sum_then_finalize)
    update = defended.fed_sgd_update(model_fn)
  work = defended.with_update_defense(update, _Negated(), wide_sum_then_finalize)
  rng = np.random.default_rng(0)
  x = rng.uniform(size=(2, 7, 8, 8, 1)).astype(np.float32)
  y = rng.integers(0, 3, size=(2, 7)).astype(np.int32)
  weights = tff.learning.models.ModelWeights.from_model(spec.keras())
  weights = tff.learning.models.ModelWeights(
      [v.numpy() for v in weights.trainable], [v.numpy() for v in weights.non_trainable])

  def batches(c, seeded):
    data = tf.data.Dataset.from_tensor_slices(
        collections.OrderedDict(x=x[c], y=y[c])).batch(3)
    return client_data.with_inputs(data, {"seed": np.array([c, 1])}) if seeded else data

  want = plain.next(plain.initialize(), [weights] * 2, [batches(c, False) for c in (0, 1)])
  got = work.next(work.initialize(), [weights] * 2, [batches(c, True) for c in (0, 1)])
  for g, w in zip(got.result, want.result):
    assert float(g.update_weight) == float(w.update_weight) == 7.0
    for gu, wu in zip(g.update, w.update):
      np.testing.assert_array_equal(gu, -wu)
  assert got.measurements["train"] == want.measurements["train"]
  assert float(got.measurements["defense"]["unperturbed_share"]) == 0.0


@pytest.mark.parametrize("method", ["fedavg", "fedsgd"])
def test_undefended_rounds_equal_tffs_own_with_its_default_loop(method):
  # the library's processes step through the batches by the dataset's
  # iterator (defended.CLIENT_LOOP); TFF's defaults use Dataset.reduce
  import collections

  import tensorflow_federated as tff

  from tff_privacy.aggregation.wide_sum import wide_mean_factory, wide_sum_then_finalize
  from tff_privacy.algorithms import fedavg, fedsgd

  spec = ModelSpec("mlp", (8, 8, 1), 3, {"hidden": (5,)})
  model_fn = spec.tff_model_fn()
  sgdm = tff.learning.optimizers.build_sgdm
  if method == "fedavg":
    ours = fedavg.build_fedavg(model_fn, client_learning_rate=0.3, client_momentum=0.9)
    tffs = tff.learning.algorithms.build_weighted_fed_avg(
        model_fn, client_optimizer_fn=sgdm(0.3, momentum=0.9),
        server_optimizer_fn=sgdm(1.0), model_aggregator=wide_mean_factory(),
        metrics_aggregator=wide_sum_then_finalize)
  else:
    ours = fedsgd.build_fedsgd(model_fn, server_learning_rate=0.3)
    tffs = tff.learning.algorithms.build_fed_sgd(
        model_fn, server_optimizer_fn=sgdm(0.3), model_aggregator=wide_mean_factory(),
        metrics_aggregator=wide_sum_then_finalize)
  rng = np.random.default_rng(0)
  x = rng.uniform(size=(2, 7, 8, 8, 1)).astype(np.float32)
  y = rng.integers(0, 3, size=(2, 7)).astype(np.int32)
  clients = [tf.data.Dataset.from_tensor_slices(
      collections.OrderedDict(x=x[c], y=y[c])).batch(3) for c in (0, 1)]
  got, want = (p.next(p.initialize(), clients) for p in (ours, tffs))
  for g, w in zip(ours.get_model_weights(got.state).trainable,
                  tffs.get_model_weights(want.state).trainable):
    np.testing.assert_array_equal(g, w)
  assert got.metrics["client_work"] == want.metrics["client_work"]


def test_a_client_view_counts_its_samples_or_takes_the_callers_count():
  """Batches of 2, 3 and 1 samples: 6; a count the caller passed is taken
  as it is."""
  x = np.zeros((6, 2), np.float32)
  batches = tf.data.Dataset.from_tensor_slices({"x": x, "y": np.arange(6)})
  dataset = batches.take(2).batch(2).concatenate(batches.skip(2).batch(3))
  assert int(defenses.ClientView([], dataset).sample_count()) == 6
  given = tf.constant(4, tf.int32)
  assert defenses.ClientView([], dataset, {}, given).sample_count() is given


def test_a_client_view_reads_its_first_samples_or_takes_the_callers():
  """Batches of 2, 3 and 1 samples: the first 4 samples, all 6 of them
  where 10 are asked for; samples the caller read are cut to the number
  asked, without reading a data set (here: none)."""
  x = np.arange(12, dtype=np.float32).reshape(6, 2)
  batches = tf.data.Dataset.from_tensor_slices({"x": x, "y": np.arange(6)})
  dataset = batches.take(2).batch(2).concatenate(batches.skip(2).batch(3))
  view = defenses.ClientView([], dataset)
  np.testing.assert_array_equal(view.head(4)["x"], x[:4])
  np.testing.assert_array_equal(view.head(10)["y"], np.arange(6))
  assert view.head(3)["x"].shape == (3, 2)
  empty = defenses.ClientView([], dataset.take(0))
  assert empty.head(3)["x"].shape == (0, 2)
  given = defenses.ClientView([], None, head_samples={"x": tf.constant(x[3:])},
                              head_size=3)
  np.testing.assert_array_equal(given.head(2)["x"], x[3:5])
  # more than the caller read: a pass over the data set
  short = defenses.ClientView([], dataset, head_samples={"x": tf.constant(x[3:])},
                              head_size=3)
  np.testing.assert_array_equal(short.head(4)["x"], x[:4])


class _Viewing(defenses.UpdateDefense):
  """Uploads the update as it is and measures what its view shows: the
  sample count, the sum of its first `view_samples` samples' x, and its
  seed input."""
  name = "viewing"
  needs_client_view = True

  def __init__(self, head_size):
    self.view_samples = head_size

  def apply(self, update, seed, client=None):
    return list(update)

  def apply_measured(self, update, seed, client=None):
    head = (tf.reduce_sum(client.head(self.view_samples)["x"])
            if self.view_samples else tf.constant(-1.0))
    return list(update), {"count": client.sample_count(), "head_sum": head,
                          "seed_sum": tf.reduce_sum(client.inputs["seed"])}


@pytest.mark.parametrize("head_size", [0, 4, 10])
def test_a_defended_clients_view_counts_its_samples_and_reads_its_first(head_size):
  """Batches of 2, 3 and 1 samples beside the seed [4, 5]: the view counts
  6 samples, reads the first 4 (all 6 where 10 are asked) and holds the
  seed."""
  import collections

  import tensorflow_federated as tff

  from tff_privacy.aggregation.wide_sum import wide_sum_then_finalize
  from tff_privacy.algorithms import client_data, defended

  spec = ModelSpec("mlp", (2,), 3, {"hidden": (4,)})
  update = defended.model_delta_update(spec.tff_model_fn(),
                                       tff.learning.optimizers.build_sgdm(0.1))
  work = defended.with_update_defense(update, _Viewing(head_size),
                                      wide_sum_then_finalize)
  x = np.arange(12, dtype=np.float32).reshape(6, 2)
  samples = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
      x=x, y=np.arange(6, dtype=np.int32) % 3))
  batches = samples.take(2).batch(2).concatenate(samples.skip(2).batch(3))
  weights = tff.learning.models.ModelWeights(list(spec.initial_weights(0)), [])
  out = work.next(work.initialize(), [weights],
                  [client_data.with_inputs(batches, {"seed": np.array([4, 5])})])
  seen = out.measurements["defense"]["viewing"]
  assert seen["count"] == 6 and seen["seed_sum"] == 9
  assert seen["head_sum"] == (x[:min(head_size, 6)].sum() if head_size else -1)


def test_a_model_without_an_examples_metric_leaves_the_count_to_the_view():
  """TFF's Keras models report 'num_examples' as a Sum's [total]; a model
  without it gives no count, and the view then reads its batches."""
  from tff_privacy.algorithms import defended

  count = defended._trained_examples({"num_examples": [tf.constant(6, tf.int64)]})
  assert count.dtype == tf.int32 and int(count) == 6
  assert defended._trained_examples({"loss": [tf.constant(1.0)]}) is None
  batches = tf.data.Dataset.from_tensor_slices({"x": np.zeros((5, 2)), "y": np.arange(5)})
  assert int(defenses.ClientView([], batches.batch(2), {}, None).sample_count()) == 5
