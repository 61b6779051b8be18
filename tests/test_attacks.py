"""Attacks reconstruct undefended uploads of small models, from records only."""

import dataclasses
import types

import numpy as np
import pytest
import tensorflow as tf
from conftest import QUICK_MODEL_KWARGS, SLOW_MODELS, slow_where
from conftest import record_of as _record

from tff_privacy import attacks, metrics, models
from tff_privacy.attacks import functional, refusal

SPEC = models.ModelSpec("lenet", (8, 8, 1), 10)


@pytest.fixture(scope="module")
def digits():
  from tff_privacy import data
  src = data.load_source("digits")
  return src.x_train, src.y_train


@pytest.mark.parametrize("name", slow_where(sorted(models.MODELS), SLOW_MODELS))
def test_functional_forward_equals_keras(name):
  shape = {"hyperfl_cnn": (28, 28, 1), "hyperfl_cnn_cifar": (32, 32, 3)}.get(
      name, (8, 8, 1))
  model = models.build(name, shape, 10, seed=1, **QUICK_MODEL_KWARGS.get(name, {}))
  x = tf.random.uniform((3,) + shape, seed=1)
  out = functional.forward(model, [tf.constant(v) for v in model.trainable_variables], x)
  np.testing.assert_allclose(out, model(x), atol=1e-5)


@pytest.mark.parametrize("grouped", [True, False],
                         ids=["grouped_convolutions", "one_per_record"])
@pytest.mark.parametrize("name", slow_where(sorted(models.MODELS), SLOW_MODELS))
def test_record_batched_forward_equals_each_keras_model(name, grouped,
                                                        monkeypatch):
  """`forward(records=True)`: three records, each its own initialisation
  and inputs, in one pass give what each Keras model gives on its own,
  with grouped convolutions and with one convolution per record (where
  TensorFlow cannot differentiate grouped ones)."""
  monkeypatch.setattr(models.functional, "grouped_convolution_differentiable",
                      lambda: grouped)
  shape = {"hyperfl_cnn": (28, 28, 1), "hyperfl_cnn_cifar": (32, 32, 3),
           "unet": (16, 8, 3)}.get(name, (8, 8, 1))
  kwargs = QUICK_MODEL_KWARGS.get(name, {})
  keras_models = [models.build(name, shape, 10, seed=s, **kwargs) for s in (1, 2, 3)]
  x = tf.random.uniform((3, 2) + shape, seed=1)
  weights = [tf.stack(ws) for ws in zip(*(m.trainable_variables for m in keras_models))]
  out = functional.forward(keras_models[0], weights, x, records=True)
  for r, model in enumerate(keras_models):
    np.testing.assert_allclose(out[r], model(x[r]), atol=1e-5)


def test_record_batched_forward_through_adds_concatenations_and_dilations():
  """Layers no bundled model has, in records mode: a dilated and a strided
  convolution, Add of two grouped activations, a softmax convolution,
  Concatenate across rows (not channels) and a tap on a two-input layer."""
  L = tf.keras.layers

  def build(seed):
    init = tf.keras.initializers.GlorotUniform(seed)
    x = L.Input((8, 8, 2))
    a = L.Conv2D(3, 3, padding="same", dilation_rate=2, activation="relu",
                 kernel_initializer=init, name="a")(x)
    b = L.Conv2D(3, 3, padding="same", activation="tanh", kernel_initializer=init,
                 bias_initializer=tf.keras.initializers.RandomNormal(seed=seed),
                 name="b")(a)
    added = L.Add(name="add")([a, b])
    soft = L.Conv2D(3, 1, activation="softmax", kernel_initializer=init,
                    name="soft")(added)
    rows = L.Concatenate(axis=1, name="rows")([added, soft])
    down = L.Conv2D(4, 3, strides=2, kernel_initializer=init, name="down")(rows)
    out = L.Dense(5, kernel_initializer=init, name="fc")(L.Flatten()(down))
    return tf.keras.Model(x, out)

  keras_models = [build(s) for s in (1, 2, 3)]
  x = tf.random.uniform((3, 2, 8, 8, 2), seed=5)
  weights = [tf.stack(ws) for ws in zip(*(m.trainable_variables for m in keras_models))]
  out, tapped = functional.forward(keras_models[0], weights, x, tap="add",
                                   records=True)
  for r, model in enumerate(keras_models):
    np.testing.assert_allclose(out[r], model(x[r]), atol=1e-5)
    inputs = tf.keras.Model(model.input, [model.get_layer("a").output,
                                          model.get_layer("b").output])(x[r])
    for got, want in zip(tapped, inputs):
      np.testing.assert_allclose(got[r], want, atol=1e-6)
  with pytest.raises(ValueError, match="one static record axis"):
    functional.forward(keras_models[0], weights[:-1] + [weights[-1][0]], x,
                       records=True)


@pytest.mark.parametrize("task,upload_kind,protocol", [
    ("classification", "gradient", {"batch_size": 3}),
    ("classification", "model_delta", {"batch_size": 2, "local_epochs": 2,
                                       "client_learning_rate": 0.1,
                                       "client_momentum": 0.9}),
    ("segmentation", "model_delta", {"batch_size": 2, "client_learning_rate": 0.01,
                                     "client_optimizer": "adam"})])
def test_record_batched_uploads_equal_each_clients_upload(task, upload_kind, protocol):
  """`simulate_upload(records=True)` stacks what each client would upload
  from its own broadcast, as `simulate_upload` computes it one at a time."""
  name, shape = ("lenet", (8, 8, 1)) if task == "classification" else (
      "unet", (8, 8, 3))
  spec = models.ModelSpec(name, shape, 2 if task == "segmentation" else 10,
                          task=task)
  keras_models = [spec.keras(seed) for seed in (1, 2)]
  rng = np.random.default_rng(2)
  x = tf.constant(rng.random((2, 3) + shape), tf.float32)
  labels = rng.integers(0, spec.num_classes,
                        (2, 3) + spec.task_object.label_shape(shape))
  y = tf.one_hot(labels, spec.num_classes)
  weights = [[tf.constant(v) for v in m.trainable_variables] for m in keras_models]
  stacked = functional.simulate_upload(
      keras_models[0], [tf.stack(ws) for ws in zip(*weights)], x, y, upload_kind,
      protocol, 3, spec.task_object, records=True)
  for r in range(2):
    alone = functional.simulate_upload(keras_models[r], weights[r], x[r], y[r],
                                       upload_kind, protocol, 3, spec.task_object)
    # Adam moves an entry whose gradient is near 0 by up to its lr, where
    # float rounding shows at about 1e-3 lr
    for got, want in zip(stacked, alone):
      np.testing.assert_allclose(got[r], want, rtol=1e-4, atol=1e-5)


def test_single_sample_label_recovery_is_exact(digits):
  x, y = digits
  for i in range(10):
    rec = _record(x[i:i + 1], y[i:i + 1])
    got = attacks.recover_labels(SPEC.keras(), rec.broadcast, rec.upload, 1,
                                 "gradient", rec.metadata["protocol"])
    assert got.tolist() == [y[i]]


def test_batch_label_counts_are_recovered(digits):
  x, y = digits
  spec = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": (32,)})
  rec = _record(x[:6], y[:6], spec=spec)
  got = attacks.recover_labels(spec.keras(), rec.broadcast, rec.upload, 6,
                               "gradient", rec.metadata["protocol"])
  assert sorted(got.tolist()) == sorted(y[:6].tolist())


def test_momentum_delta_is_scaled_back_to_a_mean_gradient_by_hand():
  from tff_privacy.attacks.labels import mean_gradient
  # 3 steps (6 samples, batch 2), lr 0.1, momentum 0.5 on a constant g:
  # b = g, 1.5 g, 1.75 g; delta = 0.1 * 4.25 g
  protocol = {"batch_size": 2, "learning_rate": 0.1, "momentum": 0.5}
  got = mean_gradient([np.full(3, 0.425)], "model_delta", protocol, 6)
  np.testing.assert_allclose(got[0], np.ones(3), rtol=1e-6)


def test_label_counts_stay_non_negative_when_the_signal_overshoots():
  from tff_privacy.attacks.labels import whole_counts
  # the estimated counts sum to 7 for 4 labels; zeros must stay zeros
  got = whole_counts(np.array([0.0, 3.6, 0.0, 3.4]), 4)
  assert got.sum() == 4 and (got >= 0).all()
  np.testing.assert_array_equal(got, [0, 2, 0, 2])


def _invert_one(attack, digits, i, **record_kwargs):
  """Attacks the upload of sample i alone; returns (recovered labels, scores)."""
  x, y = digits
  out = attack([_record(x[i:i + 1], y[i:i + 1], **record_kwargs)])[0]
  return out.labels.tolist(), metrics.image_scores(x[i:i + 1], out.x, (0, 1))[0]


@pytest.mark.slow
def test_idlg_inverts_a_single_gradient(digits):
  labels, s = _invert_one(attacks.IDLG(iterations=200), digits, 3)
  assert labels == [digits[1][3]]
  assert s["ssim"] > 0.9 and s["mse"] < 1e-3


@pytest.mark.slow
def test_dlg_recovers_image_and_label_jointly(digits):
  # Needs the labels' second-order gradient, which TF's fused cross-entropy
  # op drops; the attack's loss is written out so that this works.
  labels, s = _invert_one(attacks.DLG(iterations=300), digits, 3)
  assert labels == [digits[1][3]]
  assert s["ssim"] > 0.9


@pytest.mark.slow
def test_inverting_gradients_inverts_a_single_gradient(digits):
  labels, s = _invert_one(attacks.InvertingGradients(iterations=400), digits, 5)
  assert labels == [digits[1][5]]
  assert s["ssim"] > 0.8


@pytest.mark.slow
def test_inverting_gradients_simulates_local_steps_for_model_deltas(digits):
  protocol = {"client_learning_rate": 0.1, "batch_size": 1, "local_epochs": 2}
  labels, s = _invert_one(attacks.InvertingGradients(iterations=400), digits, 7,
                          upload_kind="model_delta", protocol=protocol)
  assert labels == [digits[1][7]]
  assert s["ssim"] > 0.8


def test_best_iterate_is_kept_not_the_last(digits):
  x, y = digits
  rec = _record(x[1:2], y[1:2])
  # A huge step that ends far from the optimum: the reported objective must
  # still be the best one seen, which the starting point already bounds.
  attack = attacks.InvertingGradients(iterations=5, lr=50.0, lr_decay=False)
  target = attacks.Target.from_record(rec)
  y_soft = tf.one_hot(y[1:2], 10)
  x0 = tf.fill(target.input_shape, 0.5)
  start_loss = float(attacks.inversion.cosine_distance(
      target.simulate(target.broadcast, x0, y_soft), target.upload)
                     + attack.tv_weight * attacks.inversion.total_variation(x0))
  state = {**attack._start(target, np.random.default_rng(0)), "x": x0,
           "best_x": x0}
  state, _ = attack._advance(target, state, 0, attack.iterations)
  assert float(state["best_loss"]) <= start_loss + 1e-6


def test_a_chunk_takes_its_steps_then_evaluates_the_last_iterate_only():
  """`search_steps` against a hand count: a search at position 4 whose
  step moves it by one, from iteration 2, 3 steps. It evaluates 4, 5, 6 at
  iterations 2, 3, 4, then the last iterate 7 without moving on."""
  def step(t, state):
    x, evaluated, at = state
    evaluated += tf.one_hot(x, 10)
    at += tf.one_hot(t, 10)
    return (x + 1, evaluated, at), (x, evaluated, at)

  x, evaluated, at = tf.function(lambda: attacks.inversion.search_steps(
      step, tf.constant(2), tf.constant(3),
      (tf.constant(4), tf.zeros(10), tf.zeros(10))), autograph=False)()
  assert int(x) == 7
  np.testing.assert_array_equal(evaluated, np.isin(np.arange(10), [4, 5, 6, 7]))
  np.testing.assert_array_equal(at, np.isin(np.arange(10), [2, 3, 4, 5]))


def test_unknown_device_is_refused_not_silently_replaced(digits):
  x, y = digits
  rec = _record(x[:1], y[:1])
  with pytest.raises(ValueError, match="device='/GPU:7' is not available"):
    attacks.InvertingGradients(iterations=1)([rec], device="/GPU:7")
  out = attacks.InvertingGradients(iterations=1)([rec], device="/CPU:0")
  assert out[0].x.shape == (1, 8, 8, 1)


def test_attacks_validate_their_arguments():
  with pytest.raises(ValueError, match="iterations must be >= 1"):
    attacks.InvertingGradients(iterations=0)
  with pytest.raises(ValueError, match="tv_weight must be >= 0"):
    attacks.InvertingGradients(tv_weight=-1)
  with pytest.raises(ValueError, match="init='zeros'"):
    attacks.DLG(init="zeros")
  with pytest.raises(ValueError, match="attack='gan'"):
    attacks.build("gan")


def test_pooling_gives_fixed_length_maxima():
  from tff_privacy.attacks import attribute
  upload = [np.arange(10.0).reshape(2, 5), np.array([-1.0, 7.0])]
  np.testing.assert_array_equal(attribute.pooled(upload, 4), [2, 5, 8, 9])
  # bins of 3, 3, 2, 2, 2 entries, as np.array_split cuts 12 into 5
  np.testing.assert_array_equal(attribute.pooled(upload, 5), [2, 5, 7, 9, 7])
  with pytest.raises(ValueError, match="length=20 exceeds"):
    attribute.pooled(upload, 20)


@pytest.mark.slow
def test_attribute_adversaries_beat_chance_on_a_leaky_signal():
  from tff_privacy.attacks import attribute
  rng = np.random.default_rng(0)
  attrs = rng.integers(0, 2, 400)
  feats = rng.normal(size=(400, 16)).astype(np.float32)
  feats[:, 3] += 2.0 * attrs  # the attribute leaks into one coordinate
  rates = attribute.attack_success_rates(feats[:300], attrs[:300], feats[300:],
                                         attrs[300:])
  chance = attribute.chance_rate(attrs[300:])
  assert set(rates) == set(attribute.ADVERSARIES)
  assert all(rate > chance + 0.15 for rate in rates.values()), (rates, chance)
  with pytest.raises(ValueError, match="adversary='knn'"):
    attribute.build_adversary("knn")


@pytest.mark.slow
def test_records_of_different_models_in_one_call(digits):
  """The compiled function takes the broadcast weights as arguments: four
  records of four differently initialised models, attacked in one call,
  are reconstructed exactly as when each is attacked alone."""
  x, y = digits
  records = [_record(x[i:i + 1], y[i:i + 1], seed=i) for i in range(4)]
  together = attacks.InvertingGradients(iterations=300)(records)
  for i, record in enumerate(records):
    alone = attacks.InvertingGradients(iterations=300)([record])[0]
    np.testing.assert_allclose(together[i].x, alone.x, atol=1e-5)
    assert metrics.image_scores(x[i:i + 1], together[i].x, (0, 1))[0]["ssim"] > 0.8


@pytest.mark.slow
def test_grouped_search_equals_one_record_at_a_time(digits):
  """group_size batches the searches of records that share a compiled
  function: five records of different models and batch sizes give the same
  reconstructions to float rounding (the vectorised kernels may round
  otherwise and a sign step turns a rounding difference into a step, so
  only short searches are compared: signed steps over 10 iterations, plain
  Adam over 5) and the same order as one at a time."""
  x, y = digits
  records = [_record(x[i:i + 1], y[i:i + 1], seed=i) for i in range(3)]
  records.insert(1, _record(x[5:7], y[5:7], seed=5))  # another batch size
  records.append(_record(x[9:10], y[9:10], seed=9))
  records = [dataclasses.replace(r, client_index=i) for i, r in enumerate(records)]
  grouped = attacks.InvertingGradients(iterations=10, group_size=3, restarts=2)
  assert grouped.groups(grouped.targets(records)) == [[0, 2, 3], [4], [1]]
  # Adam's plain steps on the four records of one batch size, in one group
  # (the other batch size's record would be searched alone either way)
  one_size = records[:1] + records[2:]
  for signed, steps, atol, searched in ((True, 10, 1e-5, records),
                                        (False, 5, 1e-5, one_size)):
    if not signed:
      grouped = attacks.InvertingGradients(iterations=steps, group_size=4,
                                           signed=False)
    together = grouped(searched, seed=7)
    for record, got in zip(searched, together):
      # one record alone is a group of one: searched one at a time, by the
      # functions the lone groups above compiled
      want = grouped([record], seed=7)[0]
      assert got.client_index == record.client_index
      np.testing.assert_allclose(got.x, want.x, atol=atol, rtol=0)
      np.testing.assert_array_equal(got.labels, want.labels)
      assert got.objective == pytest.approx(want.objective, abs=1e-6)


def test_compiled_functions_are_shared_only_within_one_value_range(digits):
  x, y = digits
  a = attacks.Target.from_record(_record(x[:1], y[:1], seed=0))
  b = attacks.Target.from_record(_record(x[:1], y[:1], seed=1))
  assert a.cache_key() == b.cache_key()  # other weights: one trace
  record = _record(x[:1], y[:1])
  wider = dataclasses.replace(record, metadata={**record.metadata,
                                                "value_range": [-1.0, 1.0]})
  assert attacks.Target.from_record(wider).cache_key() != a.cache_key()


def test_uploads_beyond_max_examples_are_refused_unless_raised(digits):
  x, y = digits
  record = _record(x[:70], y[:70])
  with pytest.raises(attacks.UploadRefused, match="stands for 70 examples, more than "
                     "max_examples=64"):
    attacks.InvertingGradients(iterations=1)([record])
  attack = attacks.InvertingGradients(iterations=1, max_examples=70)
  assert attack.plan([record]) == ("ig: 1 record(s), 70 image(s) per record, "
                                   "1 iterations x 1 restart(s) each")
  assert attack([record])[0].x.shape == (70, 8, 8, 1)
  assert attack.estimate_seconds([record]) > 0


SEG_SPEC = models.ModelSpec("unet", (8, 8, 3), 2, {"widths": (16, 32)},
                            task="segmentation")


def _segmentation_sample(digits, i=0):
  """A digit as a 3-channel image, its bright pixels labelled 1."""
  x = np.repeat(digits[0][i:i + 1], 3, axis=-1)
  return x, (x[..., 0] > 0.5).astype(np.int32)


@pytest.mark.parametrize("positive_weight", [1.0, 7.0])
def test_segmentation_upload_is_the_keras_gradient_of_the_task_loss(digits,
                                                                    positive_weight):
  x, y = _segmentation_sample(digits)
  model = SEG_SPEC.keras(0)
  with tf.GradientTape() as tape:
    # Keras' own loss with per-pixel sample weights: the weighted mean CE
    weights = np.where(y == 1, positive_weight, 1.0)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
        y, model(x), sample_weight=weights)
  expected = tape.gradient(loss, model.trainable_variables)
  spec = models.ModelSpec(SEG_SPEC.name, SEG_SPEC.input_shape, 2, SEG_SPEC.kwargs,
                          "segmentation", {"positive_weight": positive_weight})
  with tf.GradientTape() as tape:
    task_loss = spec.task_object.keras_loss()(y, model(x))
  for g, e in zip(tape.gradient(task_loss, model.trainable_variables), expected):
    np.testing.assert_allclose(g, e, atol=1e-6)
  got = functional.simulate_upload(
      model, [tf.constant(v) for v in model.trainable_variables],
      tf.constant(x), tf.one_hot(y, 2), "gradient", {"batch_size": 1},
      task=spec.task_object)
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, atol=1e-6)


@pytest.mark.slow
def test_ig_inverts_a_segmentation_gradient_given_the_mask(digits):
  x, y = _segmentation_sample(digits, 1)
  record = _record(x, y, spec=SEG_SPEC)
  out = attacks.InvertingGradients(iterations=1500, label_knowledge="true")(
      [record], labels=[y])[0]
  np.testing.assert_array_equal(out.labels, y)
  assert metrics.image_scores(x, out.x, (0, 1))[0]["ssim"] > 0.95


# tracing L-BFGS through the U-Net's second-order gradients takes half a
# minute; the fast suite runs the search eagerly
@pytest.mark.parametrize("compiled", [
    False, pytest.param(True, marks=pytest.mark.slow)])
def test_dlg_optimises_one_label_per_pixel(digits, compiled):
  x, y = _segmentation_sample(digits)
  out = attacks.DLG(iterations=5, compiled=compiled)(
      [_record(x, y, spec=SEG_SPEC)])[0]
  assert out.labels.shape == (1, 8, 8)


def test_label_knowledge_decides_the_labels_held_fixed(digits):
  from tff_privacy.attacks.inversion import Target
  x, y = _segmentation_sample(digits)
  target = Target.from_record(_record(x, y, spec=SEG_SPEC), y)
  for attack in (attacks.InvertingGradients(), attacks.IDLG()):
    np.testing.assert_array_equal(attack.fixed_labels(target), np.zeros((1, 8, 8)))
  assert attacks.DLG().fixed_labels(target) is None
  np.testing.assert_array_equal(
      attacks.DLG(label_knowledge="true").fixed_labels(target), y)
  with pytest.raises(ValueError, match="needs the clients' labels"):
    attacks.InvertingGradients(label_knowledge="true").targets([target.record])
  with pytest.raises(ValueError, match=r"labels have shape \(1,\)"):
    Target.from_record(target.record, np.zeros(1))
  with pytest.raises(attacks.UploadRefused,
                     match="attack 'rog' inverts uploads of classification"):
    attacks.build("rog", prior=False).check_records([target.record])


def test_adam_deltas_refuse_analytic_label_recovery():
  from tff_privacy.attacks.labels import mean_gradient
  protocol = {"batch_size": 2, "learning_rate": 0.1, "client_optimizer": "adam"}
  with pytest.raises(attacks.UploadRefused, match="Adam client's model delta"):
    mean_gradient([np.ones(3)], "model_delta", protocol, 4)


CIFAR_MEAN = np.array([0.4914, 0.4822, 0.4465])
CIFAR_STD = np.array([0.2470, 0.2435, 0.2616])


def _normalised_record(seed=0):
  """A 3-channel record of a run normalised with the cifar10 preset."""
  rng = np.random.default_rng(seed)
  spec = models.ModelSpec("lenet", (8, 8, 3), 10)
  x = ((rng.random((2, 8, 8, 3)) - CIFAR_MEAN) / CIFAR_STD).astype(np.float32)
  record = _record(x, np.array([1, 4]), spec)
  return dataclasses.replace(record, metadata={
      **record.metadata, "normalize": {"mean": list(CIFAR_MEAN),
                                       "std": list(CIFAR_STD)}})


@pytest.mark.slow
@pytest.mark.parametrize("name,kwargs", [
    ("ig", {"iterations": 4, "init": "uniform"}),
    ("dlg", {"iterations": 4, "init": "uniform"}),
    ("rog", {"iterations": 4, "prior": False})])
def test_attacks_search_within_the_normalised_range_per_channel(name, kwargs):
  lo, hi = (0 - CIFAR_MEAN) / CIFAR_STD, (1 - CIFAR_MEAN) / CIFAR_STD
  target = attacks.Target.from_record(_normalised_record())
  np.testing.assert_allclose(target.bounds[0], lo, rtol=1e-6)
  np.testing.assert_allclose(target.bounds[1], hi, rtol=1e-6)
  attack = attacks.build(name, **kwargs)
  start = attack._start(target, np.random.default_rng(0))
  x0 = (start["results"].position[:2 * 8 * 8 * 3].numpy().reshape(2, 8, 8, 3)
        if name == "dlg" else start.get("x", start.get("z")).numpy())
  got = attack([_normalised_record()])[0].x
  for x in (x0, got):
    for c in range(3):  # each channel fills its own range, not another's
      assert lo[c] - 1e-6 <= x[..., c].min() and x[..., c].max() <= hi[c] + 1e-6
  assert x0[..., 0].min() < lo[2] or x0[..., 0].max() > hi[2]


def test_normalised_runs_compile_apart_from_plain_ones():
  record = _normalised_record()
  plain = dataclasses.replace(record, metadata={
      k: v for k, v in record.metadata.items() if k != "normalize"})
  assert (attacks.Target.from_record(plain).cache_key()
          != attacks.Target.from_record(record).cache_key())


@pytest.mark.parametrize("error, reason", [
    (KeyError(), ", whose metadata lacks a field it reads (captured by an "
     "older version?)"),
    (KeyError("noise_on"), ", whose metadata has no 'noise_on' (captured by an "
     "older version?)"),
    (ValueError("layer='conv9' is not a layer\nof the model"),
     ": layer='conv9' is not a layer")])
def test_a_store_a_declaration_cannot_read_is_refused_naming_it(error, reason):
  record = types.SimpleNamespace(round_num=3, client_index=2)
  with pytest.raises(attacks.UploadRefused) as refused:
    with refusal.refusing_unreadable("ig_masked", record, "upload_mask"):
      raise error
  assert str(refused.value) == ("attack 'ig_masked' refuses round 3 client 2: "
                                "its upload_mask cannot read its store" + reason)


@pytest.mark.slow
def test_a_search_keeps_what_it_found_at_a_quarter_a_half_and_the_end(digits):
  """Chunks end at every checkpoint; a search alone and in a group keep
  the same snapshots, the last being the reconstruction, and a longer
  search's quarter is a shorter one's end (the same seeded iterates)."""
  x, y = digits
  records = [dataclasses.replace(_record(x[i:i + 1], y[i:i + 1], seed=i),
                                 client_index=i) for i in range(2)]
  attack = attacks.InvertingGradients(iterations=300)
  assert attack.checkpoints() == [75, 150, 300]
  assert list(attack._chunks()) == [(0, 75), (75, 75), (150, 100), (250, 50)]
  alone = attacks.InvertingGradients(iterations=12)([records[0]], seed=3)[0]
  grouped = attacks.InvertingGradients(iterations=12, group_size=2)(records, seed=3)[0]
  for found in (alone, grouped):
    assert sorted(found.snapshots) == [3, 6, 12]
    np.testing.assert_allclose(found.snapshots[12], found.x)
  for k in (3, 6):
    np.testing.assert_allclose(alone.snapshots[k], grouped.snapshots[k], atol=1e-5)
  shorter = attacks.InvertingGradients(iterations=3, lr_decay=False)([records[0]], seed=3)[0]
  longer = attacks.InvertingGradients(iterations=12, lr_decay=False)([records[0]], seed=3)[0]
  np.testing.assert_allclose(longer.snapshots[3], shorter.x, atol=1e-6)
