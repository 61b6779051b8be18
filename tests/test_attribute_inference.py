"""Attribute inference on captured uploads: the ground truth's attributes,
the adversary's shadow data and the attack success rates in metrics.json."""

import dataclasses
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from sklearn.ensemble import RandomForestClassifier

from tff_privacy import attacks, evaluate, runner
from tff_privacy.attacks import attribute
from tff_privacy.updates import GroundTruthStore, UpdateStore


def _training_sample(size, n):
  """The documented draw: numpy's default_rng(0) permutation, first n, sorted."""
  return sorted(np.random.default_rng(0).permutation(size)[:n])


def test_shadow_indices_are_a_training_sample_or_balanced_after_the_first():
  classes = np.array([2, 0, 1, 0, 1, 2, 0, 1, 0])
  np.testing.assert_array_equal(attribute.shadow_indices(classes, 4),
                                _training_sample(9, 4))
  np.testing.assert_array_equal(attribute.shadow_indices(classes, 12), np.arange(9))
  # a split stored sorted by class still gives both classes
  ordered = np.repeat([0, 1], 500)
  assert set(ordered[attribute.shadow_indices(ordered, 20)]) == {0, 1}
  # after the zoo's first 4: ceil(4 / 3) = 2 per class, the last ones of
  # each (0: 6, 8; 1: 4, 7); the rare class 2 has only 5 there, not 0
  np.testing.assert_array_equal(
      attribute.shadow_indices(classes, 4, "disjoint_test"), [4, 5, 6, 7, 8])
  # class 0 only among the first 3: 2 per class of classes 1 and 2
  np.testing.assert_array_equal(
      attribute.shadow_indices(np.array([0, 0, 0, 1, 2, 1, 2, 1]), 3,
                               "disjoint_test"), [4, 5, 6, 7])
  with pytest.raises(ValueError, match="shadow_samples=9: the test split's 9 "
                     "records leave none after the zoo's first 9"):
    attribute.shadow_indices(classes, 9, "disjoint_test")
  with pytest.raises(ValueError, match="shadow_pool='test'; choose one of "
                     "'train', 'disjoint_test'"):
    attribute.shadow_indices(classes, 4, "test")


def test_balanced_rate_is_the_mean_recall_over_classes():
  # class 0: 2 of 3 right; class 1: 1 of 1
  assert attribute.balanced_rate(np.array([0, 0, 1, 1]),
                                 np.array([0, 0, 0, 1])) == pytest.approx(5 / 6)


def test_balanced_rate_is_scikit_learns_balanced_accuracy():
  from sklearn.metrics import balanced_accuracy_score
  rng = np.random.default_rng(0)
  truth = rng.integers(0, 3, 50)
  guessed = rng.integers(0, 4, 50)  # class 3: guessed, never true
  with pytest.warns(UserWarning):
    want = balanced_accuracy_score(truth, guessed)
  assert attribute.balanced_rate(guessed, truth) == pytest.approx(want, abs=1e-12)


def _wilson(hits, total, z=1.959963984540054):
  """Wilson's score interval by its formula (z: the standard normal's 97.5%
  quantile)."""
  p = hits / total
  center = (p + z ** 2 / (2 * total)) / (1 + z ** 2 / total)
  half = z / (1 + z ** 2 / total) * np.sqrt(p * (1 - p) / total
                                            + z ** 2 / (4 * total ** 2))
  return [center - half, center + half]


@pytest.mark.parametrize("hits,total", [(7, 10), (29, 40), (0, 40), (40, 40), (1, 1)])
def test_the_plain_rates_interval_is_wilsons(hits, total):
  truth = np.zeros(total, np.int64)
  guessed = np.r_[np.zeros(hits), np.ones(total - hits)].astype(np.int64)
  assert attribute.rate_interval(guessed, truth) == pytest.approx(
      _wilson(hits, total), abs=1e-12)


def _sklearn_bootstrap(guessed, truth, resamples=2000, seed=99):
  """Percentile interval of balanced accuracy over victims resampled in
  pairs, by numpy and scikit-learn."""
  import warnings

  from sklearn.metrics import balanced_accuracy_score
  rng = np.random.default_rng(seed)
  rates = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # a resample missing a class
    for _ in range(resamples):
      i = rng.integers(0, len(truth), len(truth))
      rates.append(balanced_accuracy_score(truth[i], guessed[i]))
  return np.percentile(rates, [2.5, 97.5])


def _guesses(truth, right, seed=0):
  """`truth` guessed correctly with probability `right`, else the next class."""
  hit = np.random.default_rng(seed).random(len(truth)) < right
  return np.where(hit, truth, (truth + 1) % (truth.max() + 1))


def test_the_balanced_rates_bootstrap_interval():
  truth = np.repeat([0, 1, 2], [24, 10, 6])  # 40 victims
  guessed = _guesses(truth, 0.6)
  low, high = attribute.balanced_interval(guessed, truth, seed=3)
  assert low <= attribute.balanced_rate(guessed, truth) <= high
  np.testing.assert_allclose([low, high], _sklearn_bootstrap(guessed, truth), atol=0.03)
  assert attribute.balanced_interval(guessed, truth, seed=3) == [low, high]
  # ten times the victims, the same rate: a narrower interval
  wide = attribute.balanced_interval(np.tile(guessed, 10), np.tile(truth, 10), seed=3)
  assert wide[1] - wide[0] < 0.5 * (high - low)


@pytest.mark.parametrize("right", [True, False])
def test_a_bootstrap_interval_of_zero_width_becomes_the_classes_wilson_mean(right):
  """Every victim inferred correctly (or every one wrongly): each resample's
  balanced rate is 1 (or 0), and the interval the mean over the classes of
  each class's Wilson bounds of its recall."""
  counts = [24, 10, 6]
  truth = np.repeat([0, 1, 2], counts)
  guessed = truth if right else (truth + 1) % 3
  bounds = np.array([_wilson(n if right else 0, n) for n in counts])
  assert attribute.balanced_interval(guessed, truth, seed=3) == pytest.approx(
      bounds.mean(0), abs=1e-12)


def test_a_resample_missing_a_class_averages_the_others():
  truth = np.r_[np.zeros(39), 1].astype(np.int64)  # 36% of resamples lack class 1
  guessed = _guesses(truth, 0.7, seed=1)
  interval = attribute.balanced_interval(guessed, truth, seed=0)
  np.testing.assert_allclose(interval, _sklearn_bootstrap(guessed, truth), atol=0.05)


def _config(out, **kwargs):
  return runner.RunConfig(**{
      "out": str(out), "method": "fedsgd", "dataset": "adult", "model": "mlp",
      "model_kwargs": {"hidden": [12]}, "clients": 40,
      "partition": "one_per_client", "rounds": 1, "batch_size": 1, "seed": 3,
      "capture_rounds": (1,), "infer_attributes": ("race", "sex"),
      "attribute_adversaries": ("rf",), "attribute_shadow_samples": 60, **kwargs})


@pytest.fixture(scope="module")
def adult_run(tmp_path_factory):
  config = _config(tmp_path_factory.mktemp("run"))
  runner.run(config, progress=False)
  return config


def _plain_pooled(arrays, length=1024):
  flat = np.concatenate([a.ravel() for a in arrays])
  return np.array([b.max() for b in np.array_split(flat, length)])


@pytest.mark.slow
def test_ground_truth_holds_each_clients_attributes(adult_run):
  fed = runner.Run(adult_run).fed
  truth = GroundTruthStore(os.path.join(adult_run.out, "ground_truth"))
  for client in range(40):
    sample = fed.client_indices[client]
    got = truth.read_attributes(1, client)
    assert sorted(got) == ["race", "sex"]
    for name in ("race", "sex"):
      np.testing.assert_array_equal(got[name], fed.source.attributes.train[name][sample])


def test_metrics_hold_the_rates_of_adversaries_fitted_on_plain_gradients(adult_run):
  entry = json.load(open(os.path.join(adult_run.out, "metrics.json")))[0]
  fed = runner.Run(adult_run).fed  # before any eager Keras model
  source = fed.source
  store = UpdateStore(os.path.join(adult_run.out, "updates"))
  records = store.records(1)
  spec = records[0].model_spec
  model = spec.keras()
  model.set_weights(records[0].broadcast)
  victims = np.stack([_plain_pooled(r.upload) for r in records])
  for name in ("race", "sex"):
    truth = np.array([source.attributes.train[name][fed.client_indices[r.client_index][0]]
                      for r in records])
    # the training sample of 60, as RECUP-FL's zoo's
    rows = _training_sample(len(source.y_train), 60)
    shadow = source.attributes.train[name][rows]
    features = []
    for i in rows:
      with tf.GradientTape() as tape:
        p = tf.sigmoid(model(source.x_train[i:i + 1])[:, 0])
        loss = tf.reduce_mean(tf.square(p - source.y_train[i]))
      grads = tape.gradient(loss, model.trainable_variables)
      features.append(_plain_pooled([g.numpy() for g in grads]))
    forest = RandomForestClassifier(n_estimators=120, random_state=3)
    guessed = forest.fit(np.stack(features), shadow).predict(victims)
    assert entry[f"asr/{name}/rf"] == pytest.approx(np.mean(guessed == truth), abs=1 / 40)
    assert entry[f"asr/{name}/chance"] == pytest.approx(np.bincount(truth).max() / 40)
    hits = int(np.sum(guessed == truth))
    assert entry[f"asr_ci/{name}/rf"] == pytest.approx(_wilson(hits, 40), abs=1e-12)
    low, high = entry[f"balanced_asr_ci/{name}/rf"]
    assert low <= entry[f"balanced_asr/{name}/rf"] <= high
    assert entry[f"balanced_asr/{name}/chance"] == pytest.approx(
        1 / len(np.unique(truth)))


@pytest.mark.slow
def test_the_command_writes_the_same_rates(adult_run, tmp_path):
  from tff_privacy import cli
  assert cli.main(["infer-attributes", "--updates",
                   os.path.join(adult_run.out, "updates"), "--round", "1",
                   "--attribute", "sex", "--adversaries", "rf",
                   "--shadow-samples", "60", "--seed", "3",
                   "--out", str(tmp_path)]) == 0
  result = json.load(open(tmp_path / "attribute_round_0001_sex.json"))
  entry = json.load(open(os.path.join(adult_run.out, "metrics.json")))[0]
  assert result["asr"]["rf"] == entry["asr/sex/rf"]
  assert result["asr_ci"]["rf"] == entry["asr_ci/sex/rf"]
  assert result["balanced_asr_ci"]["rf"] == entry["balanced_asr_ci/sex/rf"]
  assert result["victims"] == 40 and result["classes"] == ["Female", "Male"]
  assert result["shadow_pool"] == "train"
  # each victim's guess and truth, kept for pooling runs, give its rates
  from sklearn.metrics import balanced_accuracy_score
  truth, guesses = result["truth"], result["guesses"]["rf"]
  assert len(truth) == len(guesses) == 40
  assert result["asr"]["rf"] == pytest.approx(np.mean(np.equal(truth, guesses)))
  assert result["balanced_asr"]["rf"] == pytest.approx(
      balanced_accuracy_score(truth, guesses))
  assert cli.main(["infer-attributes", "--updates",
                   os.path.join(adult_run.out, "updates"), "--round", "1",
                   "--attribute", "sex", "--adversaries", "rf",
                   "--shadow-samples", "60", "--shadow-pool", "disjoint_test",
                   "--out", str(tmp_path)]) == 0
  result = json.load(open(tmp_path / "attribute_round_0001_sex.json"))
  assert result["shadow_pool"] == "disjoint_test"


class _Seen(Exception):
  """Stops a computation once its shadow records have been seen."""


def _shadow_records(monkeypatch, call) -> tuple[np.ndarray, np.ndarray]:
  """The (x, y) whose shadow uploads `call` makes first."""
  seen = []

  def shadow_features(spec, broadcast, x, y, *args, **kwargs):
    seen.append((np.array(x), np.array(y)))
    raise _Seen

  with monkeypatch.context() as m:
    m.setattr(attribute, "shadow_features", shadow_features)
    with pytest.raises(_Seen):
      call()
  return seen[0]


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["train", "disjoint_test"])
def test_the_zoo_and_the_adversaries_share_records_unless_disjoint(
    adult_run, tmp_path, monkeypatch, pool):
  config = dataclasses.replace(
      adult_run, out=str(tmp_path), infer_attributes=(), capture_rounds=(),
      defense="recupfl", defense_kwargs={"protect": "race", "zoo_size": 2,
                                         "sampled_models": 2, "shadow_samples": 60,
                                         "shadow_pool": pool})
  run = runner.Run(config)
  source = run.fed.source
  zoo = _shadow_records(monkeypatch, lambda: run.client_defense.prepare_round(
      1, run.spec.initial_weights(3), "gradient", run.algorithm.protocol))
  adversaries = _shadow_records(monkeypatch, lambda: evaluate.infer_attributes_round(
      os.path.join(adult_run.out, "updates"), 1, "race", adversaries=("rf",),
      shadow_samples=60, shadow_pool=pool))
  if pool == "train":  # both the same sample of 60 training records
    rows = _training_sample(len(source.y_train), 60)
    for got in (zoo, adversaries):
      np.testing.assert_array_equal(got[0], source.x_train[rows])
      np.testing.assert_array_equal(got[1], source.y_train[rows])
    return
  np.testing.assert_array_equal(zoo[0], source.x_test[:60])
  # the adversaries': the last 12 test records of each of race's 5 classes
  race = source.attributes.test["race"]
  last = np.sort(np.concatenate([np.flatnonzero(race == c)[-12:] for c in range(5)]))
  assert len(last) == 60 and last.min() >= 60  # none of the zoo's
  np.testing.assert_array_equal(adversaries[0], source.x_test[last])
  np.testing.assert_array_equal(adversaries[1], source.y_test[last])


def _sparsified(arrays, p):
  """Keeps the ceil((1 - p) d) entries of largest magnitude, zeroes the rest."""
  flat = np.concatenate([a.ravel() for a in arrays])
  keep = int(np.ceil((1 - p) * flat.size))
  out = np.zeros_like(flat)
  top = np.argsort(-np.abs(flat), kind="stable")[:keep]
  out[top] = flat[top]
  return out


@pytest.mark.slow
def test_adaptive_adversaries_train_on_shadow_uploads_through_the_defense(tmp_path):
  config = _config(tmp_path, defense="sparsification", defense_kwargs={"p": 0.97},
                   infer_attributes=("sex",), adaptive_adversaries=True)
  runner.run(config, progress=False)
  entry = json.load(open(os.path.join(config.out, "metrics.json")))[0]
  fed = runner.Run(config).fed
  source = fed.source
  records = UpdateStore(os.path.join(config.out, "updates")).records(1)
  model = records[0].model_spec.keras()
  model.set_weights(records[0].broadcast)
  victims = np.stack([_plain_pooled(r.upload) for r in records])
  truth = np.array([source.attributes.train["sex"][fed.client_indices[r.client_index][0]]
                    for r in records])
  rows = _training_sample(len(source.y_train), 60)
  shadow = source.attributes.train["sex"][rows]
  features = {"clean": [], "adaptive": []}
  for i in rows:
    with tf.GradientTape() as tape:
      p = tf.sigmoid(model(source.x_train[i:i + 1])[:, 0])
      loss = tf.reduce_mean(tf.square(p - source.y_train[i]))
    grads = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    features["clean"].append(_plain_pooled(grads))
    features["adaptive"].append(_plain_pooled([_sparsified(grads, 0.97)]))
  for kind, prefix in (("clean", ""), ("adaptive", "adaptive_")):
    forest = RandomForestClassifier(n_estimators=120, random_state=3)
    guessed = forest.fit(np.stack(features[kind]), shadow).predict(victims)
    assert entry[f"{prefix}asr/sex/rf"] == pytest.approx(np.mean(guessed == truth),
                                                         abs=1 / 40)
  # the adaptive adversary's shadow uploads themselves, whatever the rates
  got = attribute.shadow_features(
      records[0].model_spec, records[0].broadcast, source.x_train[rows],
      source.y_train[rows], records[0].upload_kind, records[0].metadata["protocol"],
      defend=evaluate.adaptive_defense(records[0]))
  np.testing.assert_allclose(got, np.stack(features["adaptive"]), rtol=1e-5, atol=1e-7)
  assert not np.allclose(got, np.stack(features["clean"]))


def test_adaptive_gaussian_shadow_uploads_are_clipped_and_noised_per_upload(adult_run):
  record = UpdateStore(os.path.join(adult_run.out, "updates")).records(1)[0]
  record = dataclasses.replace(record, metadata={
      **record.metadata, "defense": {"name": "ldp_gaussian", "clip": 1e-3,
                                     "noise_multiplier": 0.0}})
  upload = [tf.constant(u) for u in record.upload]
  norm = np.sqrt(sum(np.sum(u ** 2) for u in record.upload))
  clipped = evaluate.adaptive_defense(record)(upload, 0, None, None)
  for got, u in zip(clipped, record.upload):
    np.testing.assert_allclose(got, u * 1e-3 / norm, rtol=1e-5)
  record.metadata["defense"]["noise_multiplier"] = 1.0
  defend = evaluate.adaptive_defense(record, seed=5)
  first, second = (np.concatenate([np.ravel(t) for t in defend(upload, i, None, None)])
                   for i in (0, 1))
  assert not np.allclose(first, second)  # a seed per shadow upload
  assert np.std(first) == pytest.approx(1e-3, rel=0.2)  # N(0, (z C)^2) dominates


@pytest.mark.parametrize("name", ["fedre", "dp_fedavg"])
def test_adaptive_defense_refuses_defenses_it_cannot_rebuild(adult_run, name):
  record = UpdateStore(os.path.join(adult_run.out, "updates")).records(1)[0]
  record = dataclasses.replace(record, metadata={**record.metadata,
                                                 "defense": {"name": name}})
  with pytest.raises(ValueError, match=f"not available against '{name}'"):
    evaluate.adaptive_defense(record)


@pytest.mark.parametrize("kwargs,match", [
    ({}, r"give a client defence \(--defense\)"),
    ({"defense": "dp_fedavg", "defense_kwargs": {"clip": 1.0, "noise_multiplier": 1.0}},
     "defense=.dp_fedavg. cannot be re-applied"),
    ({"defense": "sparsification", "defense_kwargs": {"p": 0.5},
      "infer_attributes": (), "capture_rounds": ()},
     "adaptive_adversaries is a kind of infer_attributes")])
def test_adaptive_adversaries_need_a_defense_they_can_rebuild(tmp_path, kwargs, match):
  with pytest.raises(ValueError, match=match):
    _config(tmp_path, adaptive_adversaries=True, **kwargs)


def test_adaptive_adversaries_rebuild_recupfl_from_the_run(tmp_path):
  config = _config(tmp_path, adaptive_adversaries=True, defense="recupfl",
                   defense_kwargs={"protect": "race"})
  assert config.adaptive_adversaries and config.defense == "recupfl"


@pytest.mark.parametrize("kwargs,match", [
    ({"attribute": "age"}, "attribute='age': data set 'adult' has sensitive "
     r"attributes \['race', 'sex'\]"),
    ({"round_num": 2}, r"round 2 was not captured .* captured rounds: \[1\]"),
    ({"adversaries": ("knn",)}, r"adversaries \['knn'\] are not among"),
    ({"shadow_samples": 1}, "shadow_samples must be an integer >= 2")])
def test_bad_inference_arguments_name_the_parameter(adult_run, kwargs, match):
  args = {"updates": os.path.join(adult_run.out, "updates"), "round_num": 1,
          "attribute": "race", **kwargs}
  with pytest.raises(ValueError, match=match):
    evaluate.infer_attributes_round(**args)


@pytest.mark.parametrize("kwargs,match", [
    ({"capture_rounds": ()}, "infer_attributes attacks captured uploads"),
    ({"attribute_adversaries": ("knn",)}, r"attribute_adversaries \['knn'\]")])
def test_bad_run_settings_are_refused(tmp_path, kwargs, match):
  with pytest.raises(ValueError, match=match):
    _config(tmp_path, **kwargs)


def test_a_data_set_without_the_attribute_is_refused(tmp_path):
  config = runner.RunConfig(out=str(tmp_path), dataset="digits", model="mlp",
                            clients=2, rounds=1, capture_rounds=(1,),
                            infer_attributes=("race",))
  with pytest.raises(ValueError, match="infer_attributes \\['race'\\]: data set "
                     "'digits' has sensitive attributes none"):
    runner.Run(config)


def test_uploads_that_are_not_the_models_weights_are_refused():
  from conftest import record_of
  x = np.random.default_rng(0).random((2, 8, 8, 1), dtype=np.float32)
  record = record_of(x, np.array([1, 2]))
  record = dataclasses.replace(record, metadata={
      **record.metadata, "method": "hyperfl", "upload_kind": "hypernetwork_weights"})
  with pytest.raises(attacks.UploadRefused,
                     match="'hyperfl' uploads hypernetwork_weights"):
    attribute.infer_round([record], np.array([0]), x, np.array([1, 2]),
                          np.array([0, 1]))


@pytest.mark.slow
def test_a_run_of_a_method_without_weight_uploads_is_refused_before_training(tmp_path):
  out = tmp_path / "run"
  config = runner.RunConfig(out=str(out), method="hyperfl", dataset="mnist5k_parity",
                            model="mlp", model_kwargs={"hidden": [4]}, clients=2,
                            rounds=1, capture_rounds=(1,), infer_attributes=("parity",))
  with pytest.raises(ValueError, match="infer_attributes: method 'hyperfl' uploads "
                     "hypernetwork_weights"):
    runner.run(config, progress=False)
  assert not out.exists()
