"""FedRE: regions, the client mechanism (eqs. 6-9), PDA-PAM (eqs. 10-11) and a
run. Expected values come from hand computations in numpy, the nested-tape
PSI reference and dp_accounting called directly."""

import collections
import dataclasses
import functools
import json

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import data, evaluate, models, psi, runner
from tff_privacy.aggregation import PublicRegions, build_pda_pam
from tff_privacy.algorithms import client_data, fedre, local_dp_sgd
from tff_privacy.defenses import ClientView
from tff_privacy.updates import UpdateStore

H, W, C = 5, 4, 2
SPEC = models.ModelSpec("mlp", (H, W, C), 3, {"hidden": (6,), "activation": "sigmoid"})
MASK = psi.box_mask([[1, 1, 3, 4]], H, W)


def _mechanism(cls=fedre.FedREMechanism, **kwargs):
  settings = dict(epsilon=20.0, delta=1e-5, rounds=5, clip=0.5, budget_split="psi",
                  noise_calibration="paper", psi_samples=3, psi_pixels=None)
  settings.update(kwargs)
  return cls(SPEC, **settings)


def _view(weights, seed=0, epochs=1):
  """A client of 4 samples in batches of 2, `epochs` passes over them."""
  rng = np.random.default_rng(seed)
  x = rng.random((4, H, W, C)).astype(np.float32)
  y = np.array([0, 1, 2, 1])
  dataset = tf.data.Dataset.from_tensor_slices({"x": x, "y": y}).batch(2).repeat(epochs)
  return ClientView([tf.constant(w) for w in weights], dataset,
                    {fedre.MASK_KEY: tf.constant(MASK, tf.float32)}), x, y


def test_regions_from_strings_and_json(tmp_path):
  default = fedre.client_regions(None, 2, 8, 8)
  np.testing.assert_array_equal(default[1], psi.box_mask([[3, 3, 5, 5]], 8, 8))
  two = fedre.client_regions("0,0,2,2;6,6,8,8", 3, 8, 8)
  assert two[2].sum() == 8 and two[0][0, 0] and two[0][7, 7]
  path = tmp_path / "regions.json"
  path.write_text(json.dumps({"default": [[0, 0, 1, 1]], "clients": {"1": [[2, 2, 4, 3]]}}))
  masks = fedre.client_regions(str(path), 2, 8, 8)
  assert masks[0].sum() == 1 and masks[1].sum() == 2 and masks[1][2, 3]


@pytest.mark.parametrize("text, message", [
    ("0,0,2", "expected 'x0,y0,x1,y1"), ("a,b", "needs a data set with element maps"),
    ("0,0,9,2", r"regions\[0\]"), ("missing.json", "no such file")])
def test_bad_regions_are_refused(text, message):
  with pytest.raises(ValueError, match=message):
    fedre.client_regions(text, 2, 8, 8)


def test_json_regions_need_known_clients_and_a_default(tmp_path):
  path = tmp_path / "r.json"
  path.write_text(json.dumps({"clients": {"5": [[0, 0, 1, 1]]}}))
  with pytest.raises(ValueError, match=r"clients \['5'\]"):
    fedre.client_regions(str(path), 2, 8, 8)
  path.write_text(json.dumps({"clients": {"0": [[0, 0, 1, 1]]}}))
  with pytest.raises(ValueError, match="regions=.*client 1 has no value"):
    fedre.client_regions(str(path), 2, 8, 8)
  path.write_text("{not json")
  with pytest.raises(ValueError, match="not readable JSON"):
    fedre.client_regions(str(path), 2, 8, 8)


@pytest.mark.slow
def test_tensor_epsilons_follow_eq_6_on_the_reference_scores():
  weights = SPEC.initial_weights(0)
  view, x, y = _view(weights)
  got = _mechanism(budget_unit="tensor").layer_epsilons(
      view, tf.constant([1, 2], tf.int64)).numpy()
  reference = psi.psi_scores_nested_tape(
      SPEC.keras(), [tf.constant(w) for w in weights], x[:3], y[:3],
      np.repeat(MASK[None], 3, 0)).numpy().mean(0)
  inverse = 1 / reference
  np.testing.assert_allclose(got, 20.0 * inverse / inverse.sum(), rtol=1e-4)


@pytest.mark.slow
def test_layer_epsilons_follow_eq_6_on_each_layers_kernel_and_bias_together():
  weights = SPEC.initial_weights(0)
  view, x, y = _view(weights)
  got = _mechanism().layer_epsilons(view, tf.constant([1, 2], tf.int64)).numpy()
  # per pixel, a layer's norm over its kernel's and bias's entries, from the
  # nested-tape reference; then eq. 5's mean over the region and eq. 6
  model, w = SPEC.keras(), [tf.constant(v) for v in weights]
  scores = []
  for i in range(3):
    squares = psi.pixel_norms_nested_tape(model, w, x[i], y[i]).numpy() ** 2
    layers = np.sqrt(np.stack([squares[0] + squares[1], squares[2] + squares[3]]))
    scores.append((layers * MASK).sum((1, 2)) / MASK.sum())
  inverse = 1 / np.mean(scores, 0)
  layer_epsilons = 20.0 * inverse / inverse.sum()
  np.testing.assert_allclose(got, np.repeat(layer_epsilons / 2, 2), rtol=1e-4)
  assert np.isclose(got.sum(), 20.0)


# (calibration, sensitivity, eta placement, local epochs); the client holds
# 4 samples and trains at learning rate 0.1
@pytest.mark.slow
@pytest.mark.parametrize("calibration, sensitivity, placement, epochs", [
    ("paper", "update", "client", 1), ("accountant", "update", "client", 1),
    ("paper", "sample", "server", 2), ("accountant", "sample", "server", 1)])
def test_upload_is_clipped_per_layer_plus_gaussian_noise_of_eq_8(
    calibration, sensitivity, placement, epochs):
  mechanism = _mechanism(budget_split="even", noise_calibration=calibration,
                         sensitivity=sensitivity, eta_placement=placement,
                         learning_rate=0.1, local_epochs=epochs)
  weights = SPEC.initial_weights(0)
  view, _, _ = _view(weights, epochs=epochs)
  rng = np.random.default_rng(5)
  update = [rng.normal(size=w.shape).astype(np.float32) * s
            for w, s in zip(weights, (0.1, 0.001, 0.2, 0.01))]
  # eq. 7 on the gradient (update / eta) is eq. 7 at eta C on the update
  eta = 0.1 if placement == "server" else 1.0
  clip = eta * 0.5
  clipped = [u * min(1.0, clip / np.linalg.norm(u)) for u in update]
  eps_l = np.full(4, 20.0 / 4)
  # noise std over clip: sigma (eq. 9) times 2 / |D_k| or 1
  per_clip = 2 / 4 if sensitivity == "sample" else 1.0
  if calibration == "paper":
    sigma = np.sqrt(2 * 5 * np.log(1 / (1e-5 / 4))) / eps_l
  else:
    z = dp_accounting.calibrate_dp_mechanism(
        dp_accounting.rdp.RdpAccountant,
        lambda z: dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), 5),
        20.0, 1e-5)
    # each layer's event: std over sensitivity, sigma (sample) or sigma / 2
    # (update); four of them compose to multiplier z
    sigma = z * np.linalg.norm(eps_l) / eps_l * (2 if sensitivity == "update" else 1)
  std = clip * sigma * per_clip
  upload = tf.function(lambda seed: mechanism.apply(update, seed, view))
  draws = [[t.numpy() for t in upload(tf.constant([s, 1], tf.int64))]
           for s in range(400)]
  for l in range(4):
    samples = np.stack([d[l] for d in draws])
    np.testing.assert_allclose((samples - clipped[l]).std(), std[l], rtol=0.08)
    assert np.abs(samples.mean(0) - clipped[l]).max() < 6 * std[l] / np.sqrt(400)
  again = upload(tf.constant([3, 1], tf.int64))
  np.testing.assert_array_equal(again[0].numpy(), draws[3][0])


@pytest.mark.parametrize("calibration, sensitivity", [
    ("paper", "sample"), ("accountant", "sample"), ("accountant", "update")])
def test_upload_records_the_epsilons_eq_9_assigns_to_its_noise(calibration,
                                                               sensitivity):
  """Client 1 of 3 fills its row of the round's per-tensor epsilons: its
  eq. 6 split under 'paper' (even: 20 / 4), and under 'accountant' eq. 9
  solved for epsilon_l at the accountant's sigma_l, sqrt(2 T ln(L / delta))
  / sigma_l with sigma_l = z ||eps|| / (m eps_l) = 2 z / m."""
  mechanism = _mechanism(budget_split="even", noise_calibration=calibration,
                         sensitivity=sensitivity, num_clients=3)
  view, _, _ = _view(SPEC.initial_weights(0))
  view.inputs[fedre.CLIENT_KEY] = tf.constant(1, tf.int32)
  update = [tf.zeros(w.shape) for w in SPEC.initial_weights(0)]
  upload, measured = mechanism.apply_measured(update, tf.constant([1, 2], tf.int64),
                                              view)
  assert len(upload) == 4 and mechanism.per_client_measurements == (fedre.SPENT_KEY,)
  if calibration == "paper":
    expected = np.full(4, 5.0)
  else:
    z = dp_accounting.calibrate_dp_mechanism(
        dp_accounting.rdp.RdpAccountant,
        lambda z: dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), 5),
        20.0, 1e-5)
    sigma = 2 * z / (1.0 if sensitivity == "sample" else 0.5)
    expected = np.full(4, np.sqrt(2 * 5 * np.log(4 / 1e-5)) / sigma)
  got = measured[fedre.SPENT_KEY].numpy()
  np.testing.assert_allclose(got[1], expected, rtol=1e-5)
  assert got.shape == (3, 4) and not got[[0, 2]].any()


def test_the_client_work_scores_the_samples_its_data_set_starts_with():
  """FedRE's client work collects its PSI samples in the pass that reads
  its inputs; the same work reading them from its data set instead
  (`view_samples` 0: `ClientView.head`'s own pass) uploads the same bits.
  Batches of 3 from 7 samples, 5 PSI samples: the head spans 2 batches."""
  class ReadsItsOwnSamples(fedre.FedREMechanism):
    view_samples = 0

  mechanism = _mechanism(psi_samples=5, num_clients=2)
  reading = _mechanism(psi_samples=5, num_clients=2, cls=ReadsItsOwnSamples)
  model_fn = SPEC.tff_model_fn()
  weights = tff.learning.models.ModelWeights(
      [np.asarray(w) for w in SPEC.initial_weights(0)], [])
  rng = np.random.default_rng(3)
  x = rng.random((2, 7, H, W, C)).astype(np.float32)
  y = rng.integers(0, 3, size=(2, 7)).astype(np.int32)

  def client(c):
    inputs = {"seed": np.array([c, 7], np.int64), fedre.MASK_KEY: MASK.astype(np.float32),
              fedre.PROFILE_KEY: np.int32(0), fedre.CLIENT_KEY: np.int32(c)}
    return client_data.with_inputs(tf.data.Dataset.from_tensor_slices(
        collections.OrderedDict(x=x[c], y=y[c])).batch(3), inputs)

  fewer = _mechanism(psi_samples=4, num_clients=2)
  uploads = []
  for m in (mechanism, reading, fewer):
    work = fedre._client_work(SPEC, m, None, model_fn, "sgd", 0.1)  # no steps
    uploads.append(work.next(work.initialize(), [weights] * 2,
                             [client(0), client(1)]).result)
  assert mechanism.view_samples == 5
  for got, want in zip(uploads[0], uploads[1]):
    for g, w in zip(got.update, want.update):
      np.testing.assert_array_equal(g, w)
  # the scores, and with them the noise, depend on the samples scored
  assert not np.array_equal(uploads[0][0].update[0], uploads[2][0].update[0])


def test_one_public_set_for_every_profile_scores_alike_without_reading_profiles(
    monkeypatch):
  """Two clients whose public sets are equal: FedRE's process then reads
  no client's profile and scores both uploads on the one set; a round of it
  gives the same state and metrics, to the bit, as the process that reads
  each profile and scores on that profile's copy of the set, and as the
  process that also runs a mean it then discards."""
  rng = np.random.default_rng(5)
  public = PublicRegions(rng.random((2, H, W, C)).astype(np.float32),
                         np.array([0, 2]), np.repeat(MASK[None], 2, 0))
  other = dataclasses.replace(public, y=np.array([1, 2]))
  assert fedre.one_public_set([public, dataclasses.replace(public)]) is public
  assert fedre.one_public_set([public, other]) is None
  x = rng.random((2, 4, H, W, C)).astype(np.float32)
  y = rng.integers(0, 3, size=(2, 4)).astype(np.int32)

  def client(c):
    inputs = {"seed": np.array([c, 3], np.int64), fedre.MASK_KEY: MASK.astype(np.float32),
              fedre.PROFILE_KEY: np.int32(c), fedre.CLIENT_KEY: np.int32(c)}
    return client_data.with_inputs(tf.data.Dataset.from_tensor_slices(
        collections.OrderedDict(x=x[c], y=y[c])).batch(2), inputs)

  def one_round(model_aggregator=None):
    process = fedre.build_fedre(SPEC, _mechanism(num_clients=2),
                                client_learning_rate=0.1,
                                public=[public, dataclasses.replace(public)],
                                model_aggregator=model_aggregator)
    return process.next(process.initialize(), [client(0), client(1)])

  def assert_same(got, want):
    for a, b in zip(tf.nest.flatten(got.state), tf.nest.flatten(want.state)):
      np.testing.assert_array_equal(a, b)
    assert str(got.metrics) == str(want.metrics)

  shared = one_round()
  # the plain mean beside PDA-PAM measures nothing and is skipped; TFF's
  # own mean, of the same layout, runs: the round is the same
  assert_same(shared, one_round(tff.aggregators.MeanFactory()))
  monkeypatch.setattr(fedre, "one_public_set", lambda sets: None)
  assert_same(shared, one_round())


def test_a_client_without_samples_takes_the_even_split_under_psi():
  """No samples, no PSI scores: each of the MLP's 4 tensors gets 20 / 4,
  and the upload stays finite."""
  mechanism = _mechanism()
  view, _, _ = _view(SPEC.initial_weights(0))
  empty = ClientView(view.weights, view.dataset.unbatch().take(0).batch(2),
                     view.inputs)
  seed = tf.constant([1, 2], tf.int64)
  np.testing.assert_allclose(mechanism.layer_epsilons(empty, seed), [5.0] * 4,
                             rtol=1e-6)
  update = [tf.zeros(w.shape) for w in SPEC.initial_weights(0)]
  assert all(np.isfinite(u).all() for u in mechanism.apply(update, seed, empty))
  # with samples, the scores split it unevenly
  assert not np.allclose(mechanism.layer_epsilons(view, seed), [5.0] * 4)


def test_a_client_without_samples_fills_no_row_of_the_tensor_epsilons():
  """A client whose data set is empty reads its inputs as the zeros the
  round's reduce starts from, client 0's index: client 0's row must not
  gain its epsilons, while client 0 itself fills its row with the even
  split 20 / 4."""
  mechanism = _mechanism(budget_split="even", num_clients=3)
  view, _, _ = _view(SPEC.initial_weights(0))
  empty = ClientView(view.weights, view.dataset.unbatch().take(0).batch(2),
                     {fedre.MASK_KEY: tf.zeros([H, W]),
                      fedre.CLIENT_KEY: tf.constant(0, tf.int32)})
  view.inputs[fedre.CLIENT_KEY] = tf.constant(0, tf.int32)
  update = [tf.zeros(w.shape) for w in SPEC.initial_weights(0)]
  seed = tf.constant([1, 2], tf.int64)
  _, measured = mechanism.apply_measured(update, seed, empty)
  np.testing.assert_array_equal(measured[fedre.SPENT_KEY].numpy(), np.zeros((3, 4)))
  _, measured = mechanism.apply_measured(update, seed, view)
  np.testing.assert_allclose(measured[fedre.SPENT_KEY].numpy(),
                             [[5.0] * 4, [0.0] * 4, [0.0] * 4], rtol=1e-6)


def _history(rounds_with, rounds_without, epsilons):
  """metrics.json entries: rounds recording each client's per-tensor
  `epsilons` and rounds trained before they were recorded."""
  entries = [{"round": r} for r in rounds_without]
  entries += [{"round": r, fedre.METRIC_KEY: epsilons} for r in rounds_with]
  return sorted(entries, key=lambda e: e["round"])


def test_paper_epsilon_is_unknown_when_rounds_did_not_record_their_epsilons():
  """T = 10 planned, even split of 500 over 4 tensors: 10 recorded rounds
  spend sum_l sqrt(10 * 125^2 / 10) = 500; 5 recorded of 10 trained would
  report 500 sqrt(5 / 10), too low, so a history with unrecorded rounds
  reports no number but which rounds lack them."""
  even = {"0": [125.0] * 4, "1": [125.0] * 4}
  assert fedre.paper_epsilon(_history(range(1, 11), (), even), 10) == {
      "paper_epsilon": pytest.approx(500.0, rel=1e-12)}
  assert fedre.paper_epsilon(_history(range(1, 6), (), even), 10) == {
      "paper_epsilon": pytest.approx(500.0 * np.sqrt(0.5), rel=1e-12)}
  assert fedre.paper_epsilon(_history(range(6, 11), range(1, 6), even), 10) == {
      "paper_epsilon": None, "paper_epsilon_unknown":
      "rounds 1-5 trained by a version that did not record per-tensor "
      "epsilons (fedre/tensor_epsilons)"}
  unknown = fedre.paper_epsilon(_history([1, 2, 4, 6], [3, 5, 7, 8], even), 10)
  assert unknown["paper_epsilon_unknown"].startswith("rounds 3, 5, 7-8 trained")
  unknown = fedre.paper_epsilon(_history([1], [2], even), 10)
  assert unknown["paper_epsilon_unknown"].startswith("round 2 trained")
  assert fedre.paper_epsilon([], 10) == {}


def _plain_pda_pam(updates, scores, rule, scale="linear"):
  """Eqs. 10-11 in numpy from the clients' scores [K, L], over the clients
  whose tensor and score are finite."""
  kept = np.isfinite(scores) & np.array(
      [[np.isfinite(d).all() for d in u] for u in updates])
  exponents = np.log(scores) if scale == "log" else scores
  odds = np.where(kept, np.exp(np.where(kept, exponents, 0)), 0.0)
  alpha = odds / odds.sum(0)
  inverse = np.where(kept, 1 / np.where(kept, alpha, 1), 0.0)
  weights = inverse / kept.sum(0) if rule == "paper" else inverse / inverse.sum(0)
  return [sum(weights[c, l] * np.where(kept[c, l], updates[c][l], 0)
              for c in range(len(updates))) for l in range(4)]


def _pda_pam_inputs(seed=2):
  rng = np.random.default_rng(seed)
  server = SPEC.initial_weights(1)
  updates = [[rng.normal(scale=0.3, size=w.shape).astype(np.float32) for w in server]
             for _ in range(3)]
  public = PublicRegions(rng.random((2, H, W, C)).astype(np.float32), np.array([1, 2]),
                         np.repeat(MASK[None], 2, 0))
  return server, updates, public


@functools.lru_cache(maxsize=None)
def _reference_scores(seed: int) -> np.ndarray:
  """[K, L]: the nested-tape reference scores of each client's model
  (server minus update) of `_pda_pam_inputs(seed)` on the public set; once
  per seed, as they take seconds and the rules and scales share them."""
  server, updates, public = _pda_pam_inputs(seed)
  model = SPEC.keras()
  return np.stack([psi.psi_scores_nested_tape(
      model, [tf.constant(w - d) for w, d in zip(server, u)], public.x, public.y,
      public.masks).numpy().mean(0) for u in updates]).astype(np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["paper", "normalized"])
@pytest.mark.parametrize("scale", ["linear", "log"])
def test_pda_pam_matches_eqs_10_and_11(rule, scale):
  server, updates, public = _pda_pam_inputs()
  aggregate = build_pda_pam(SPEC, public, rule=rule, score_scale=scale)
  got, measurements = aggregate(server, updates, [0, 0, 0])
  expected = _plain_pda_pam(updates, _reference_scores(2), rule, scale)
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, rtol=2e-4, atol=1e-7)
  assert np.all(np.asarray(measurements["paper_step_scale"]) >= 3 - 1e-4)
  assert not np.asarray(measurements["spread_capped"]).any()
  assert list(measurements["excluded_uploads"]) == [0] * 4


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["paper", "normalized"])
def test_pda_pam_leaves_out_a_diverged_client(rule):
  server, updates, public = _pda_pam_inputs(3)
  updates[1][2] = np.full_like(updates[1][2], np.nan)  # so are its scores
  got, measurements = build_pda_pam(SPEC, public, rule=rule)(server, updates, [0] * 3)
  expected = _plain_pda_pam(updates[:1] + updates[2:],
                            _reference_scores(3)[[0, 2]], rule)
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, rtol=2e-4, atol=1e-7)
  assert list(measurements["excluded_uploads"]) == [1] * 4


@pytest.mark.slow
def test_pda_pam_keeps_the_model_where_no_upload_is_finite():
  server, updates, public = _pda_pam_inputs()
  for u in updates:
    u[0] = np.full_like(u[0], np.inf)
  got, measurements = build_pda_pam(SPEC, public)(server, updates, [0] * 3)
  for g in got:
    assert np.all(np.asarray(g) == 0)
  assert list(measurements["excluded_uploads"]) == [3] * 4


def test_pda_pam_refuses_an_unknown_rule_and_a_bad_public_set():
  public = PublicRegions(np.zeros((1, H, W, C)), np.zeros(1), MASK[None])
  with pytest.raises(ValueError, match="rule='mean'"):
    build_pda_pam(SPEC, public, rule="mean")
  with pytest.raises(ValueError, match="score_scale='exp'"):
    build_pda_pam(SPEC, public, score_scale="exp")
  with pytest.raises(ValueError, match="select at least one pixel"):
    PublicRegions(np.zeros((1, H, W, C)), np.zeros(1), np.zeros((1, H, W), bool))


def _config(out, **method_kwargs):
  return runner.RunConfig(out=out, method="fedre", rounds=2, dataset="digits",
                          model="mlp", model_kwargs={"hidden": [16]}, clients=3,
                          partition="label_groups", samples_per_client=24,
                          # every round captured: one process to build
                          batch_size=8, seed=4, capture_rounds=(1, 2),
                          method_kwargs={"epsilon": 500.0, "psi_samples": 2,
                                         **method_kwargs})


@pytest.fixture(scope="module")
def fedre_run(tmp_path_factory):
  """FedRE under the whole-update sensitivity, noised as the model change,
  eq. 11 as written."""
  config = _config(str(tmp_path_factory.mktemp("fedre")), sensitivity="update",
                   eta_placement="client", pda_pam_rule="paper")
  return config, runner.run(config, progress=False)


def _eq9_paper_epsilon(planned_rounds, rounds, layer_epsilons, delta=1e-5):
  """Eq. 9's sigma_l for a budget planned over `planned_rounds` rounds,
  solved back for the epsilon_l that `rounds` rounds of that noise spend
  (eq. 9 at T = rounds), summed over the tensors (Theorem 1)."""
  layer_delta = delta / len(layer_epsilons)
  sigmas = [np.sqrt(2 * planned_rounds * np.log(1 / layer_delta)) / e
            for e in layer_epsilons]
  return sum(np.sqrt(2 * rounds * np.log(1 / layer_delta)) / s for s in sigmas)


@pytest.mark.slow
def test_run_reports_both_epsilons(fedre_run):
  config, history = fedre_run
  final = history[-1]
  assert final["paper_delta"] == 1e-5
  # after round 1 of 2 the paper's epsilon is what eq. 9 gives for one round
  # (the same for every split: the tensors' shares add up to 500)
  assert history[0]["paper_epsilon"] == pytest.approx(
      _eq9_paper_epsilon(2, 1, [50.0, 150.0, 100.0, 200.0]), rel=1e-6)
  num_layers = 4
  z = np.sqrt(2 * 2 * np.log(num_layers / 1e-5)) / (2 * 500.0)
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.GaussianDpEvent(z), 2)
  assert final["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-6)
  assert final["privacy_guarantee"].startswith("local DP of each upload")
  assert final["dp_relation"].startswith("local DP")
  assert np.isfinite(final["test_loss"])


def test_paper_epsilon_composes_the_recorded_splits_that_change(fedre_run):
  """Each client's eq. 6 split of the 500 changes from round 1 to round 2
  (the PSI scores follow the model), so eq. 9 over the two rounds spends
  more than 500: per client sum_l sqrt((e_l1^2 + e_l2^2) / 2), in numpy from
  the per-tensor epsilons the rounds recorded; the run reports the
  largest."""
  _, history = fedre_run
  spent = [np.array([m[fedre.METRIC_KEY][str(c)] for m in history])
           for c in range(3)]
  for rounds in spent:
    assert rounds.shape == (2, 4)
    np.testing.assert_allclose(rounds.sum(1), 500.0, rtol=1e-5)
    assert np.abs(rounds[0] - rounds[1]).max() > 1e-3
  per_client = [np.sqrt((r ** 2).sum(0) / 2).sum() for r in spent]
  assert history[-1]["paper_epsilon"] == pytest.approx(max(per_client), rel=1e-12)
  assert history[-1]["paper_epsilon"] > 500.0 + 1e-3


def test_run_records_pda_pam_measurements(fedre_run):
  _, history = fedre_run
  for m in history:
    assert m["server_update_rejected"] == 0
    high, low = (np.array(m[f"server_aggregation/score_{k}"]) for k in ("max", "min"))
    assert high.shape == (4,) and np.all(high >= low)
    assert m["server_aggregation/spread_capped"] == [0.0] * 4
    assert m["server_aggregation/excluded_uploads"] == [0.0] * 4


def test_run_captures_the_noised_uploads(fedre_run):
  config, _ = fedre_run
  store = UpdateStore(f"{config.out}/updates")
  records = store.records(2)
  assert len(records) == 3
  assert records[0].metadata["defense"]["name"] == "fedre"
  # the first kernel (64 x 16 entries) gets noise of norm about 0.27, so its
  # upload is longer than the clip 0.15 that bounds it before the noise
  for record in records:
    assert np.linalg.norm(record.upload[0]) > 0.2
    assert record.metadata["protocol"]["aggregation"] == "pda_pam"


@pytest.mark.slow
def test_even_split_reports_the_exact_epsilon_of_its_noise(tmp_path):
  # eq. 9 with the budget planned over 10 rounds, of which the run takes 2;
  # the default sensitivity: noise std 2 C sigma / |D_k| over a sensitivity
  # 2 C / |D_k|, so each layer's multiplier is sigma itself
  config = _config(str(tmp_path), budget_split="even", aggregation="mean",
                   budget_rounds=10)
  history = runner.run(runner.RunConfig(**{**vars(config), "capture_rounds": ()}),
                       progress=False)
  sigma = np.sqrt(2 * 10 * np.log(4 / 1e-5)) / (500.0 / 4)
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(sigma)] * 4), 2)
  assert history[-1]["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-6)
  assert history[-1]["privacy_guarantee"].startswith("heuristic")
  assert history[-1]["dp_relation"].startswith("sample-level local DP, heuristic")
  for entry in history:  # 2 of the 10 planned rounds spend part of the budget
    assert entry["paper_epsilon"] == pytest.approx(
        _eq9_paper_epsilon(10, entry["round"], [125.0] * 4), rel=1e-9)
    assert entry["paper_epsilon"] < 500.0


@pytest.mark.slow
def test_training_past_the_planned_rounds_needs_allow_over_budget(tmp_path):
  refused = _config(str(tmp_path / "refused"), budget_rounds=1)
  with pytest.raises(ValueError, match=r"budget_rounds=1 .* rounds=2; .*"
                     "allow_over_budget"):
    runner.run(refused, progress=False)
  assert not (tmp_path / "refused").exists()  # refused before writing
  config = _config(str(tmp_path / "over"), budget_rounds=1, budget_split="even",
                   aggregation="mean", allow_over_budget=True,
                   sensitivity="update")
  history = runner.run(runner.RunConfig(**{**vars(config), "capture_rounds": ()}),
                       progress=False)
  sigma = np.sqrt(2 * 1 * np.log(4 / 1e-5)) / (500.0 / 4)  # eq. 9, T = 1
  for entry in history:
    # round 2 spends past the budget: eq. 9 gives 500 sqrt(2) for it
    assert entry["paper_epsilon"] == pytest.approx(
        _eq9_paper_epsilon(1, entry["round"], [125.0] * 4), rel=1e-9)
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(sigma / 2)] * 4), entry["round"])
    assert entry["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-6)
  assert history[-1]["paper_epsilon"] > 500.0


def test_regions_without_pixels_are_refused(tmp_path):
  path = tmp_path / "r.json"
  path.write_text(json.dumps({"default": []}))
  with pytest.raises(ValueError, match="regions of client 0 selects no pixel"):
    fedre.client_regions(str(path), 2, 8, 8)


@pytest.mark.slow  # two minutes on 2 cores; the fast suite keeps the
# segmentation task's runs (test_tasks, test_runner's
# test_clients_without_test_data_are_left_out_of_personal_metrics) and
# FedRE's client and server parts
def test_fedre_trains_the_segmentation_task_on_documents(tmp_path):
  config = runner.RunConfig(
      out=str(tmp_path), method="fedre", dataset="docs", model="unet",
      model_kwargs={"widths": [2, 4]}, clients=8, rounds=1, batch_size=64, seed=2,
      capture_rounds=(1,), partition="groups",
      method_kwargs={"epsilon": 1000.0, "psi_samples": 1, "public_samples": 1,
                     "psi_pixels": 4, "regions": "numbers"})
  last = runner.run(config, progress=False)[-1]
  assert np.isfinite(last["test_f_score"])
  assert last["paper_epsilon"] == pytest.approx(1000.0, rel=1e-5)
  record = UpdateStore(f"{config.out}/updates").read(1, 0)
  assert record.model_spec.task == "segmentation"
  assert record.metadata["defense"]["rounds"] == 1
  result = evaluate.attack_round(
      f"{config.out}/updates", 1, str(tmp_path / "attack"), "ig", [3],
      {"iterations": 2, "max_examples": record.num_examples,
       "label_knowledge": "true"}, region="run")
  assert result["label_knowledge"].startswith("true: the client's labels")
  fed = data.load("docs", 8, "groups", seed=2)
  own = fedre.client_regions("numbers", 8, 64, 64, data=fed)[3]
  assert result["region"] == {"3": evaluate._boxes(own)}
  assert np.isfinite(result["mean"]["region_ssim"])
  with pytest.raises(ValueError, match="holds a 'fedavg' run, which has no"):
    fedavg = runner.RunConfig(out=str(tmp_path / "avg"), method="fedavg",
                              dataset="digits", model="mlp", clients=30, rounds=1,
                              capture_rounds=(1,))
    runner.run(fedavg, progress=False)
    evaluate.attack_round(f"{fedavg.out}/updates", 1, str(tmp_path / "a2"), "ig",
                          [0], {"iterations": 2}, region="run")


@pytest.fixture(scope="module")
def documents_by_format():
  from tff_privacy import data
  from tff_privacy.data import documents
  # 200 documents: 40 for testing, 10 of each format
  return (data.load("docs", 5, partition="groups", data_kwargs={"num": 200}),
          documents.generate(200, seed=0))


def test_regions_from_a_preference_cover_each_clients_elements(documents_by_format):
  from tff_privacy.data import documents
  fed, docs = documents_by_format
  masks = fedre.client_regions("numbers", 5, 64, 64, data=fed)
  for c, idx in enumerate(fed.client_indices):
    assert len({docs[i].format for i in idx}) == 1  # one data category each
    expected = np.any([documents.region_mask(docs[i], ("amount", "phone", "id_number"))
                       for i in idx], axis=0)
    np.testing.assert_array_equal(masks[c], expected)
  with pytest.raises(ValueError, match="element classes \\['logo'\\]: choose from"):
    fedre.client_regions("logo", 5, 64, 64, data=fed)


def test_public_sets_hold_the_clients_category_with_its_regions(documents_by_format,
                                                                tmp_path):
  from tff_privacy import algorithms
  from tff_privacy.data import documents
  fed, docs = documents_by_format
  path = tmp_path / "r.json"
  path.write_text(json.dumps({"default": "marks", "clients": {"1": "amount"}}))
  masks = fedre.client_regions(str(path), 5, 64, 64, data=fed)
  federation = algorithms.Federation(1, (1,) * 5, fed.test, data=fed)
  sets = fedre.public_regions(federation, str(path), masks, 3)
  test_docs = docs[160:]
  for c, public in enumerate(sets):
    fmt = docs[fed.client_indices[c][0]].format
    classes = ("amount",) if c == 1 else documents.PRIVACY_PREFERENCES["marks"]
    chosen = [d for d in test_docs if d.format == fmt
              and documents.region_mask(d, classes).any()][:3]
    np.testing.assert_array_equal(public.x, [d.image for d in chosen])
    np.testing.assert_array_equal(public.masks,
                                  [documents.region_mask(d, classes) for d in chosen])


def test_public_sets_of_pooled_test_splits_hold_their_own_samples(
    documents_by_format):
  # a split file tests on part of the test set in its own order: the
  # categories and regions must be those of the samples it holds
  from tff_privacy import algorithms
  from tff_privacy.data import documents
  fed, docs = documents_by_format
  fed = dataclasses.replace(fed, test_indices=np.arange(len(docs) - 160)[::-3])
  masks = fedre.client_regions("numbers", 5, 64, 64, data=fed)
  federation = algorithms.Federation(1, (1,) * 5, fed.test, data=fed)
  sets = fedre.public_regions(federation, "numbers", masks, 2)
  pooled = [docs[160 + i] for i in fed.test_indices]
  classes = documents.PRIVACY_PREFERENCES["numbers"]
  for c, public in enumerate(sets):
    fmt = docs[fed.client_indices[c][0]].format
    chosen = [d for d in pooled if d.format == fmt
              and documents.region_mask(d, classes).any()][:2]
    np.testing.assert_array_equal(public.x, [d.image for d in chosen])
    np.testing.assert_array_equal(public.masks,
                                  [documents.region_mask(d, classes) for d in chosen])


@pytest.mark.slow  # the fast suite trains local_only on the documents, and
# scores its personal models, in test_runner's
# test_clients_without_test_data_are_left_out_of_personal_metrics; the
# documents' groups partition trains in test_cli's
# test_segmentation_run_takes_the_unet_by_default_and_prints_its_scores
def test_local_only_trains_the_segmentation_task(tmp_path):
  config = runner.RunConfig(
      out=str(tmp_path), method="local_only", dataset="docs", model="unet",
      model_kwargs={"widths": [2, 4]}, clients=4, rounds=1, batch_size=32,
      partition="groups", samples_per_client=8)
  last = runner.run(config, progress=False)[-1]
  assert 0 <= last["personal_f_score_mean"] <= 1


def test_pixel_perturbation_noises_each_image_once_inside_its_region():
  mechanism = _mechanism(perturbation="pixels", pixel_noise=0.5, seed=7)
  rng = np.random.default_rng(3)
  x = rng.random((3, 32, 32, 3)).astype(np.float32)
  x[2] = x[0]
  region = np.zeros((32, 32), np.float32)
  region[8:24, 8:24] = 1
  transform = tf.function(lambda b: mechanism.transform_batch(
      b, {fedre.MASK_KEY: tf.constant(region)}))
  batch = {"x": tf.constant(x), "y": tf.constant([0, 1, 2])}
  first, again = transform(batch), transform(batch)
  noise = (first["x"].numpy() - x) / 0.5
  np.testing.assert_array_equal(first["x"], again["x"])  # fixed per image
  np.testing.assert_array_equal(first["y"], batch["y"])
  assert np.all(noise[:, region == 0] == 0)
  inside = noise[:, region == 1]
  np.testing.assert_allclose(inside[2], inside[0], atol=1e-6)  # same content
  assert not np.allclose(inside[1], inside[0])
  assert abs(inside.mean()) < 0.1 and abs(inside.std() - 1) < 0.1
  assert _mechanism(perturbation="gradient").transform_batch(batch, {}) is batch
  assert mechanism.params() == {"perturbation": "pixels", "pixel_noise": 0.5}
  assert mechanism.dp_event(10) is None
  with pytest.raises(ValueError, match="pixel_noise applies to perturbation='pixels'"):
    _mechanism(pixel_noise=0.5)


def test_pixel_perturbation_reports_no_share_of_unperturbed_uploads():
  """It acts on the training images, not the update, which its `apply`
  returns as it is: a share of 1 would read as 'left unprotected'."""
  from tff_privacy.algorithms.defended import measured_defense
  update = [tf.constant(w) for w in SPEC.initial_weights(0)]
  pixels = _mechanism(perturbation="pixels", pixel_noise=0.5)
  defended, measured, per_client = measured_defense(
      pixels, update, tf.constant([1, 2], tf.int64))
  for d, u in zip(defended, update):
    np.testing.assert_array_equal(d, u)
  assert "unperturbed_share" not in measured and not per_client


@pytest.mark.slow
def test_pixel_perturbation_uploads_the_plain_update_and_claims_no_epsilon(tmp_path):
  def uploads(out, method, **kwargs):
    config = runner.RunConfig(out=str(tmp_path / out), method=method, rounds=1,
                              dataset="digits", model="mlp",
                              model_kwargs={"hidden": [16]}, clients=2,
                              partition="label_groups", samples_per_client=24,
                              batch_size=8, seed=4, capture_rounds=(1,),
                              method_kwargs={"client_learning_rate": 0.1, **kwargs})
    history = runner.run(config, progress=False)
    return [r.upload for r in UpdateStore(f"{config.out}/updates").records(1)], history

  plain, _ = uploads("fedavg", "fedavg")
  clean, history = uploads("clean", "fedre", perturbation="pixels", pixel_noise=0.0,
                           aggregation="mean")
  noisy, _ = uploads("noisy", "fedre", perturbation="pixels", pixel_noise=0.3,
                     aggregation="mean")
  for p, c, n in zip(plain, clean, noisy):
    for a, b, d in zip(p, c, n):
      np.testing.assert_allclose(b, a, atol=1e-6)
    assert not np.allclose(n[0], p[0], atol=1e-4)
  assert "epsilon" not in history[-1] and "paper_epsilon" not in history[-1]
  assert "unperturbed_share" not in history[-1]


def _steps_mechanism(noise_multiplier, clip=0.5, **kwargs):
  return _mechanism(noise_on="steps", clip=clip,
                    steps=local_dp_sgd.DPSGD(clip, noise_multiplier), **kwargs)


@pytest.mark.slow
def test_step_noise_multipliers_keep_eq_9s_shape_and_compose_to_z():
  mechanism = _steps_mechanism(1.3)
  view, _, _ = _view(SPEC.initial_weights(0))
  seed = tf.constant([1, 2], tf.int64)
  eps = mechanism.layer_epsilons(view, seed).numpy().astype(np.float64)
  sigmas = mechanism.step_noise_multipliers(view, seed).numpy()
  assert len(set(np.round(eps, 3))) > 1  # the PSI split, not the even one
  np.testing.assert_allclose(sigmas * eps, (sigmas * eps)[0], rtol=1e-5)
  np.testing.assert_allclose(1 / np.sqrt((1 / sigmas.astype(np.float64) ** 2).sum()),
                             1.3, rtol=1e-5)


def _steps_round(mechanism, x, y, learning_rate, seed=(5, 6)):
  """The update of one client round of noise_on='steps' on one batch of all
  of the client's samples (a Poisson rate of 1)."""
  model_fn = SPEC.tff_model_fn()

  @tff.tensorflow.computation()
  def initial():
    return tff.learning.models.ModelWeights.from_model(model_fn())

  weights = tff.learning.models.ModelWeights(
      trainable=SPEC.initial_weights(0), non_trainable=[])
  update = fedre.steps_client_update(SPEC, mechanism, initial.type_signature.result,
                                     learning_rate)
  batch = tf.data.Dataset.from_tensors(collections.OrderedDict(
      x=x, y=y.astype(np.int32)))
  inputs = {fedre.SEED_KEY: np.array(seed, np.int64),
            fedre.MASK_KEY: MASK.astype(np.float32), fedre.PROFILE_KEY: np.int32(0),
            fedre.CLIENT_KEY: np.int32(0)}
  result, sums = update(weights, client_data.with_inputs(batch, inputs))
  assert sums[2] == len(y)
  return [np.asarray(u) for u in result.update]


def _clipped_mean_gradient(x, y, clip):
  """Each example's gradient (its own tape), each tensor clipped to `clip`
  alone, averaged over the batch."""
  model = SPEC.keras()
  model.set_weights(SPEC.initial_weights(0))
  loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  total = [np.zeros(w.shape) for w in SPEC.initial_weights(0)]
  for i in range(len(y)):
    with tf.GradientTape() as tape:
      value = loss(y[i:i + 1], model(x[i:i + 1]))
    for l, g in enumerate(tape.gradient(value, model.trainable_variables)):
      g = g.numpy()
      total[l] += g * min(1.0, clip / np.linalg.norm(g))
  return [t / len(y) for t in total]


@pytest.mark.slow
def test_a_steps_round_is_sgd_on_the_per_tensor_clipped_noisy_mean():
  _, x, y = _view(SPEC.initial_weights(0))
  clean = _clipped_mean_gradient(x, y, 0.05)
  assert min(np.linalg.norm(g) for g in clean) < 0.05 / 2  # some clipped, some not
  exact = _steps_round(_steps_mechanism(0.0, clip=0.05), x, y, 0.1)
  for u, g in zip(exact, clean):
    np.testing.assert_allclose(u, 0.1 * g, rtol=1e-4, atol=1e-7)
  # the even split: sigma_l = z ||eps|| / eps_l = 2 z for 4 tensors; the
  # noise on the mean is clip sigma_l / 4, times the learning rate
  noisy = _steps_round(_steps_mechanism(0.7, clip=0.05, budget_split="even"),
                       x, y, 0.1)
  noise = (noisy[0] - exact[0]) / 0.1
  np.testing.assert_allclose(noise.std(), 0.05 * 2 * 0.7 / 4, rtol=0.15)


@pytest.mark.slow
def test_steps_run_reports_the_accountants_epsilon_of_its_poisson_steps(tmp_path):
  # the even split spares the PSI scores: the epsilon holds for every split
  config = _config(str(tmp_path), noise_on="steps", epsilon=8.0,
                   aggregation="mean", budget_split="even")
  history = runner.run(config, progress=False)
  protocol = UpdateStore(f"{config.out}/updates").records(2)[0].metadata["protocol"]
  z, q = protocol["noise_multiplier"], protocol["dp_sample_rate"]
  assert q == 8 / 24 and protocol["dp_steps_per_round"] == 3

  def epsilon(multiplier, steps):
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(multiplier)), steps)
    return accountant.get_epsilon(1e-5)

  for entry in history:
    assert entry["epsilon"] == pytest.approx(epsilon(z, 3 * entry["round"]), rel=1e-6)
  assert history[-1]["epsilon"] <= 8.0 < epsilon(z - 0.01, 6)  # calibrated to 8
  assert history[-1]["privacy_guarantee"].startswith("proven: sample-level DP-SGD")
  assert history[-1]["dp_relation"].startswith("sample-level: add or remove one")
  assert "paper_epsilon" not in history[-1]
  assert np.isfinite(history[-1]["test_loss"])
  upload = UpdateStore(f"{config.out}/updates").records(2)[0].upload
  assert all(np.isfinite(u).all() for u in upload) and np.abs(upload[0]).max() > 0


@pytest.mark.parametrize("kwargs, message", [
    ({"client_optimizer": "adam"}, "client_optimizer='adam': noise_on='steps' runs DP-SGD"),
    ({"sensitivity": "update"}, "sensitivity='update' applies to noise_on='update'")])
def test_steps_refuse_what_only_the_update_noise_uses(tmp_path, kwargs, message):
  with pytest.raises(ValueError, match=message):
    runner.run(_config(str(tmp_path / "run"), noise_on="steps", **kwargs),
               progress=False)
  assert not (tmp_path / "run").exists()


def test_the_runs_public_defense_names_its_regions():
  built = fedre.METHOD.build(SPEC, batch_size=2, seed=0, regions="0,0,2,3",
                             aggregation="mean")
  assert built.defense["regions"] == "0,0,2,3"
  assert fedre.METHOD.build(SPEC, batch_size=2, seed=0,
                            aggregation="mean").defense["regions"] is None
