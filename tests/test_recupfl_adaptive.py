"""The adaptive attribute adversary's copy of RECUP-FL: shadow uploads
perturbed against the round's zoo as the victims' were."""

import json
import os
import types

import numpy as np
import pytest
import tensorflow as tf

from tff_privacy import evaluate, runner
from tff_privacy.defenses import ClientView, defender_zoo, recupfl
from tff_privacy.updates import UpdateStore

LENGTH, EPSILON, ITERATIONS = 16, 0.05, 3


def _upload(seed):
  rng = np.random.default_rng(seed)
  return [tf.constant(rng.normal(size=(7, 9)), tf.float32),
          tf.constant(rng.normal(size=140), tf.float32)]


def _pooled(upload):
  """The first maximum of each bin (the adversaries' max-pooling), by hand."""
  flat = np.concatenate([np.ravel(u) for u in upload])
  return np.array([[b.max() for b in np.array_split(flat, LENGTH)]], np.float32)


def _save_zoo(folder, attribute="race", classes=("a", "b"),
              widths=((8, 4), (6, 3), (4, 2)), column=0, trained_round=1):
  """A zoo of `attribute` fitted on pooled uploads whose entry `column`
  lies above its median (class 1) or not, saved to `folder`."""
  features = np.stack([_pooled(_upload(s))[0] for s in range(40)])
  labels = (features[:, column] > np.median(features[:, column])).astype(int)
  pipelines = defender_zoo.fit_defenders(features, labels, widths=widths, epochs=30)
  zoo = defender_zoo.zoo_from_pipelines(pipelines, attribute, classes)
  defender_zoo.save_zoo(zoo, folder, trained_round=trained_round)
  return zoo


def _run_folder(tmp_path, trained_round=1, column=0):
  """(the update store's path in the run folder `tmp_path`, the zoo of
  'race' saved beside it)."""
  zoo = _save_zoo(str(tmp_path / "recupfl_zoo" / "race"),
                  trained_round=trained_round, column=column)
  return str(tmp_path / "updates"), zoo


def _fingerprints(updates, attributes=("race",)):
  """What a capture records of the zoos beside `updates`: the fingerprints
  their zoo.json files hold."""
  run_dir = os.path.dirname(updates)
  return {"zoo_fingerprints": {
      a: json.load(open(os.path.join(run_dir, "recupfl_zoo", a, "zoo.json")))[
          "fingerprint"] for a in attributes}}


def _record(round_num=2, defense_round=None, **settings):
  defense = {"name": "recupfl", "protect": "race", "perturbation_budget": EPSILON,
             "pool_length": LENGTH, "iterations": ITERATIONS, "sampled_models": 2,
             "fgsm": "recupfl", "attack_loss": "logit_margin", "zoo_refresh": 2,
             **settings}
  metadata = {"defense": defense}
  if defense_round is not None:
    metadata["defense_round"] = defense_round
  return types.SimpleNamespace(round_num=round_num, metadata=metadata)


def _margin(zoo, upload, label):
  """Mean over the zoo of the true class's logit minus the other's."""
  logits = [d(tf.constant(_pooled(upload))).numpy()[0]
            for d in defender_zoo.defenders(zoo)]
  return np.mean([z[label] - z[1 - label] for z in logits])


def test_shadow_uploads_are_perturbed_against_their_own_class(tmp_path):
  updates, zoo = _run_folder(tmp_path)
  # groups of three shadow samples: classes [1, 1, 0] then [1, 0, 0]
  shadow = {"race": np.array([1, 1, 0, 1, 0, 0]), "sex": np.zeros(6, int)}
  defend = evaluate.adaptive_defense(
      _record(defense_round=_fingerprints(updates)), 0, updates, shadow)
  y = np.zeros(3, np.int32)
  for index, label in ((0, 1), (1, 0)):
    clean = _upload(10)
    got = [g.numpy() for g in defend(clean, index, None, y)]
    steps = np.concatenate([(g - c.numpy()).ravel() for g, c in zip(got, clean)])
    steps /= EPSILON
    assert np.count_nonzero(steps) > 0
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
    assert np.abs(steps).max() <= ITERATIONS + 1e-3
    # the group's most frequent class is the one the zoo is pushed off
    assert _margin(zoo, got, label) < _margin(zoo, clean, label)


@pytest.mark.slow
def test_shadow_uploads_draw_their_own_model_choices(tmp_path):
  updates, _ = _run_folder(tmp_path)
  record = _record(defense_round=_fingerprints(updates))
  shadow = {"race": np.ones(40, int)}
  upload = _upload(3)
  firsts = []
  for seed in (0, 1):
    defend = evaluate.adaptive_defense(record, seed, updates, shadow)
    again = evaluate.adaptive_defense(record, seed, updates, shadow)
    outputs = [np.concatenate([u.numpy().ravel() for u in d(upload, i, None, [0])])
               for d in (defend, again) for i in range(20)]
    np.testing.assert_array_equal(outputs[:20], outputs[20:])  # seeded
    assert len({o.tobytes() for o in outputs[:20]}) > 1  # per shadow upload
    firsts.append(np.stack(outputs[:20]))
  assert not np.array_equal(*firsts)  # and per seed


@pytest.mark.slow
@pytest.mark.parametrize("protect", ["race,sex", "sex=0.5,race"])
def test_a_shadow_upload_is_perturbed_as_a_client_of_its_classes_would_be(
    tmp_path, protect):
  # one client, of race class 1 and sex class 0, as is shadow sample 0
  attributes = types.SimpleNamespace(
      classes={"race": ("a", "b"), "sex": ("f", "m")},
      train={"race": np.array([1, 0]), "sex": np.array([0, 1])})
  data = types.SimpleNamespace(
      source=types.SimpleNamespace(name="toy", attributes=attributes),
      client_indices=[np.array([0])])
  client = recupfl.RecupFL(None, data, str(tmp_path), protect=protect,
                           perturbation_budget=EPSILON, iterations=ITERATIONS,
                           sampled_models=2, zoo_size=3, pool_length=LENGTH)
  widths = [tuple(w) for w in client.params()["zoo_widths"]]
  for column, a in enumerate(attributes.classes):
    _save_zoo(client.zoo_folder(a), a, attributes.classes[a], widths, column)
  updates = str(tmp_path / "updates")
  record = types.SimpleNamespace(round_num=1, metadata={
      "defense": {"name": client.name, **client.params()},
      "defense_round": _fingerprints(updates, tuple(attributes.classes))})
  defend = evaluate.adaptive_defense(record, 7, updates, attributes.train)
  upload = _upload(5)
  got = defend(upload, 0, None, np.zeros(1, np.int32))
  # the copy seeds shadow upload 0 of round 1 from (seed, round, index, 2)
  seed = np.random.SeedSequence([7, 1, 0, 2]).generate_state(2).astype(np.int64)
  want = client.apply(upload, tf.constant(seed),
                      ClientView(None, None, client.client_inputs(0, 1)))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g.numpy(), w.numpy())
  assert any(np.any(g.numpy() != u.numpy()) for g, u in zip(got, upload))


def test_a_zoo_retrained_when_it_was_missing_is_the_one_its_round_used(tmp_path):
  # due at rounds 1 and 3, but retrained at round 2 (prepare_round, for a
  # missing zoo) and used there
  updates, _ = _run_folder(tmp_path, trained_round=2)
  record = _record(round_num=2, zoo_refresh=2,
                   defense_round=_fingerprints(updates))
  defend = evaluate.adaptive_defense(record, 0, updates,
                                     {"race": np.ones(4, int)})
  clean = _upload(1)
  got = defend(clean, 0, None, np.zeros(1, np.int32))
  assert any(np.any(g.numpy() != c.numpy()) for g, c in zip(got, clean))


@pytest.mark.parametrize("record,trained_round,match", [
    (_record(round_num=2, zoo_refresh=1), 1,
     "need the zoo of 'race' trained at round 2; .* holds the one of round 1"),
    (_record(round_num=2, zoo_refresh=2), 3,
     "need the zoo of 'race' trained at round 1; .* holds the one of round 3"),
    (_record(round_num=2, zoo_refresh=2), None,
     r"records no training round \(written by an older version\)"),
    (_record(protect="protect.json"), 1, "sets them per client"),
    (_record(round_num=2, zoo_refresh=2), 1,
     r"round 2 of updates=.* records no fingerprint of the zoo of 'race' "
     r"\(captured by an older version\): zoo=.* cannot be checked")])
def test_a_copy_it_cannot_build_is_refused(tmp_path, record, trained_round, match):
  updates, _ = _run_folder(tmp_path, trained_round)
  with pytest.raises(ValueError, match=match):
    evaluate.adaptive_defense(record, 0, updates, {"race": np.ones(4, int)})


def test_another_runs_zoo_of_the_same_round_is_refused_by_name(tmp_path):
  # run a's round 2 was captured against a's zoo; run b's folder holds its
  # own zoo of the same round (other weights) beside a copy of a's updates
  ours, _ = _run_folder(tmp_path / "a")
  theirs, _ = _run_folder(tmp_path / "b", column=1)
  record = _record(defense_round=_fingerprints(ours))
  shadow = {"race": np.ones(4, int)}
  evaluate.adaptive_defense(record, 0, ours, shadow)  # its own zoo: used
  with pytest.raises(ValueError) as refused:
    evaluate.adaptive_defense(record, 0, theirs, shadow)
  message = str(refused.value)
  assert "\n" not in message and "another run's zoo" in message
  assert f"zoo={str(tmp_path / 'b' / 'recupfl_zoo' / 'race')!r}" in message
  assert f"updates={theirs!r}" in message


@pytest.mark.slow
def test_a_run_infers_with_adaptive_adversaries_after_each_round(tmp_path):
  config = runner.RunConfig(
      out=str(tmp_path / "run"), method="fedsgd", dataset="adult", model="mlp",
      model_kwargs={"hidden": [16]}, partition="one_per_client", clients=12,
      rounds=2, batch_size=1, seed=3, capture_rounds=(1, 2),
      infer_attributes=("race",), attribute_adversaries=("rf",),
      attribute_shadow_samples=40, adaptive_adversaries=True, defense="recupfl",
      defense_kwargs={"protect": "race", "zoo_size": 3, "sampled_models": 2,
                      "iterations": 2, "shadow_samples": 400, "zoo_epochs": 2,
                      "pool_length": 64, "perturbation_budget": 0.01})
  runner.run(config, progress=False)
  for entry in json.load(open(os.path.join(config.out, "metrics.json"))):
    for prefix in ("", "adaptive_"):
      assert 0 <= entry[f"{prefix}asr/race/rf"] <= 1
  # afterwards the folder holds round 2's zoo only: round 1 is refused
  with pytest.raises(ValueError, match="trained at round 1; .* round 2"):
    evaluate.infer_attributes_round(os.path.join(config.out, "updates"), 1, "race",
                                    adversaries=("rf",), shadow_samples=40,
                                    adaptive=True)
  record = UpdateStore(os.path.join(config.out, "updates")).records(2)[0]
  index = defender_zoo.read_index(os.path.join(config.out, "recupfl_zoo", "race"))
  assert index["round"] == record.round_num == 2
  # each captured round records the fingerprint of the zoo it used
  assert record.metadata["defense_round"] == {
      "zoo_fingerprints": {"race": index["fingerprint"]}}
