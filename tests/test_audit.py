"""The one-run audit's bound against hand computations, and the per-upload
audit's soundness and power against the closed forms of the Gaussian and
Laplace mechanisms."""

import math

import dp_accounting
import numpy as np
import pytest
import scipy.optimize
import scipy.stats
import tensorflow as tf

from tff_privacy import defenses, models
from tff_privacy.algorithms import fedre, local_dp_sgd
from tff_privacy.audit import clients, one_run, one_shot, uploads
from tff_privacy.dp import accounting, queries

LEVELS = len(one_run.GUESS_FRACTIONS)  # the Bonferroni factor of audit_scores


def _logit(q):
  return math.log(q / (1 - q))


def _gaussian_epsilon(mu: float, delta: float) -> float:
  """Epsilon at delta of mu-GDP (Dong, Roth and Su): the root of
  Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) = delta."""
  phi = scipy.stats.norm.cdf
  return scipy.optimize.brentq(
      lambda e: phi(-e / mu + mu / 2) - math.exp(e) * phi(-e / mu - mu / 2) - delta,
      0, 100)


def test_the_p_value_by_hand():
  # q = 3/4 at epsilon log 3: two right of two, 9/16
  assert one_run.p_value(5, 2, 2, math.log(3), 0.0) == pytest.approx(0.5625)
  # one guess: q + 2 m delta P[Bin(1, q) = 0] = 0.75 + 2 * 10 * 0.01 * 0.25
  assert one_run.p_value(10, 1, 1, math.log(3), 0.01) == pytest.approx(0.8)
  # ten of ten at q = 1/2: delta's term is largest at i = 6, P[4 <= Bin < 10]
  # / 6 = (10 + 45 + 120 + 210 + 252 + 210) / 1024 / 6 = 847 / 6144
  assert one_run.p_value(10, 10, 10, 0.0, 0.01) == pytest.approx(
      1 / 1024 + 2 * 10 * 0.01 * 847 / 6144)


def test_every_guess_right_gives_the_closed_form_bound():
  # q^r = 1 - confidence at the bound, with delta 0
  assert one_run.epsilon_lower_bound(100, 100, 100, 0.0) == pytest.approx(
      _logit(0.05 ** (1 / 100)), rel=1e-5)
  assert one_run.epsilon_lower_bound(100, 100, 50, 0.0) == 0.0


@pytest.mark.parametrize("bad", [dict(m=5, r=6, v=1), dict(m=5, r=2, v=3)])
def test_impossible_counts_are_refused(bad):
  with pytest.raises(ValueError, match="0 <= v <= r <= m"):
    one_run.p_value(bad["m"], bad["r"], bad["v"], 1.0, 0.0)


def test_the_guesses_are_the_extreme_scores_and_the_bound_is_corrected():
  included = np.arange(100) % 2 == 0
  scores = np.where(included, 1.0, -1.0) + np.linspace(0, 0.1, 100)
  audit = one_run.audit_scores(scores, included, 0.0)
  # perfectly separated: the widest guess (k = 50) is all right
  assert (audit.guesses, audit.right) == (100, 100)
  assert audit.epsilon_lower_bound == pytest.approx(
      _logit((0.05 / LEVELS) ** (1 / 100)), rel=1e-5)
  assert audit.epsilon_interval == [audit.epsilon_lower_bound, None]


def test_the_closed_form_gaussian_epsilon_is_dp_accountings():
  for multiplier, delta in [(0.5, 1e-5), (3.0, 1e-5), (1.0, 0.01)]:
    expected = accounting.epsilon(dp_accounting.GaussianDpEvent(multiplier), delta, "pld")
    assert accounting.gaussian_epsilon_once(multiplier, delta) == pytest.approx(
        expected, rel=1e-6)


def test_each_defense_declares_the_farthest_pair_of_its_relation_as_canary():
  direction = np.random.default_rng(0).standard_normal(100)
  gaussian = defenses.LocalGaussian(2.0, 1.0).canary(direction)
  assert np.linalg.norm(gaussian) == pytest.approx(2.0)
  assert np.dot(gaussian, direction) == pytest.approx(2.0 * np.linalg.norm(direction))
  # L2-clipped Laplace: L1 sensitivity sqrt(d) C, reached by a sign vector
  laplace = defenses.LocalLaplace(2.0, 1.0).canary(direction)
  assert np.linalg.norm(laplace) == pytest.approx(2.0)
  assert np.abs(laplace).sum() == pytest.approx(10 * 2.0)
  corner = defenses.LocalLaplace(2.0, 1.0, norm="l1").canary(direction)
  assert np.count_nonzero(corner) == 1 and np.abs(corner).sum() == pytest.approx(2.0)
  ldp_fed = defenses.LDPFed(clip=0.05).canary(direction)
  np.testing.assert_allclose(ldp_fed, 0.05 * np.sign(direction))
  assert defenses.Sparsification(0.5).canary(direction) is None


def test_the_closed_form_laplace_epsilon_is_dp_accountings():
  for multiplier, delta in [(1.0, 1e-5), (0.5, 0.01)]:
    expected = accounting.epsilon(dp_accounting.LaplaceDpEvent(multiplier), delta, "pld")
    assert accounting.laplace_epsilon_once(multiplier, delta) == pytest.approx(
        expected, rel=1e-6)


class _HalfNoise(defenses.LocalGaussian):
  """Claims noise multiplier z, adds z / 2: the planted broken mechanism."""

  def apply(self, update, seed, client=None):
    claimed = self.noise_multiplier
    self.noise_multiplier = claimed / 2
    try:
      return super().apply(update, seed, client)
    finally:
      self.noise_multiplier = claimed


def test_a_correct_gaussian_mechanism_is_not_refuted():
  delta, z = 1e-5, 6.0
  audit = uploads.audit_defense(defenses.LocalGaussian(1.0, z), [(10,)], delta,
                                canaries=2000)
  assert 0 < audit["epsilon_lower_bound"] <= _gaussian_epsilon(2 / z, delta)


@pytest.mark.slow  # 20000 canaries twice
def test_a_correct_gaussian_mechanism_is_not_refuted_and_half_its_noise_is():
  # the one-run bound's power on a Gaussian mechanism is weakest at large
  # epsilon (at z 4, 20000 canaries: 1.97 for the planted 4.38 against the
  # claimed 1.99); at z 6 the planted mechanism's 2.9 is refuted
  delta, z = 1e-5, 6.0
  # sensitivity 2C against noise z C: mu = 2 / z
  claim = _gaussian_epsilon(2 / z, delta)
  correct = uploads.audit_defense(defenses.LocalGaussian(1.0, z), [(10,)], delta,
                                  canaries=20000)
  assert correct["epsilon_claimed"] == pytest.approx(claim, rel=1e-2)
  assert correct["epsilon_lower_bound"] <= claim
  planted = uploads.audit_defense(_HalfNoise(1.0, z), [(10,)], delta, canaries=20000)
  assert planted["epsilon_claimed"] == pytest.approx(claim, rel=1e-2)
  assert planted["epsilon_lower_bound"] > claim
  assert planted["epsilon_lower_bound"] <= _gaussian_epsilon(4 / z, delta)


def test_a_correct_laplace_mechanism_is_not_refuted():
  delta, z = 1e-5, 1.0
  # L1 clipping: sensitivity 2C against scale z C
  claim = 2 / z + 2 * math.log1p(-delta)
  audit = uploads.audit_defense(defenses.LocalLaplace(1.0, z, norm="l1"), [(10,)],
                                delta, canaries=5000)
  assert audit["epsilon_claimed"] == pytest.approx(claim)
  assert 0 < audit["epsilon_lower_bound"] <= claim


def test_without_noise_the_bound_is_the_most_the_canaries_can_show():
  audit = uploads.audit_defense(defenses.ClipOnly(1.0), [(4, 3), (3,)], 0.0,
                                canaries=1000)
  assert audit["epsilon_claimed"] is None
  # every guess right; 2k = 1000 would guess more canaries on one side than
  # were drawn there, so k = 300: 4.79, the most 1000 canaries show here
  assert (audit["guesses"], audit["right"]) == (600, 600)
  assert audit["epsilon_lower_bound"] == pytest.approx(
      _logit((0.05 / LEVELS) ** (1 / 600)), rel=1e-5)
  # every guess right at the widest k: the most these canaries can show
  assert audit["epsilon_reachable"] == audit["epsilon_lower_bound"]
  assert (audit["unit"], audit["applied_to"]) == ("one upload", "one upload")


def test_a_defense_without_a_per_upload_claim_is_refused():
  with pytest.raises(ValueError, match="'sparsification' makes no per-upload claim"):
    uploads.audit_defense(defenses.Sparsification(0.9), [(10,)], 1e-5)


@pytest.mark.slow  # 20000 canaries twice
def test_the_one_shot_estimate_finds_a_gaussian_mechanisms_epsilon():
  # 20000 canaries estimate the gap of the scores to about 4% (one standard
  # error): within 15% of the mechanism's epsilon, 3 standard errors
  delta, z = 1e-5, 6.0
  for defense, mu in [(defenses.LocalGaussian(1.0, z), 2 / z), (_HalfNoise(1.0, z), 4 / z)]:
    audit = uploads.audit_defense(defense, [(10,)], delta, canaries=20000)
    assert audit["epsilon_estimate"] == pytest.approx(_gaussian_epsilon(mu, delta), rel=0.15)
  # the planted mechanism's estimate is more than twice the claim
  assert audit["epsilon_estimate"] > 2 * audit["epsilon_claimed"]


@pytest.mark.slow  # 6 s: TFF's aggregation of 1000 clients
def test_one_round_of_dp_fedavg_is_audited_through_its_aggregator():
  # add or remove one client: the sum moves by the clip C against noise z C
  delta, z = 1e-5, 1.0
  audit = clients.audit_round(defenses.DPFedAvg(1.0, z), [(200, 100), (100,)],
                              delta, clients_per_round=16, canaries=1000)
  claim = _gaussian_epsilon(1 / z, delta)
  assert audit["epsilon_claimed"] == pytest.approx(claim, rel=1e-2)
  assert 0 < audit["epsilon_lower_bound"] <= claim
  # in 20100 dimensions the about 500 included canaries add a spread of
  # sqrt(500 / 20100) C to each score beside the noise's C (in 520
  # dimensions the estimate fell 25% short); 500 canaries a side estimate
  # epsilon to about 10% (one standard error): 5.11 here, within 25%
  assert audit["epsilon_estimate"] == pytest.approx(claim, rel=0.25)


FEDRE_SPEC = models.ModelSpec("mlp", (5, 4, 2), 3, {"hidden": (6,)})  # 4 tensors


def _fedre_client(sensitivity: str):
  """FedRE at epsilon 2 for one round (the accountant's multiplier z, the
  even split) and a client of 4 samples, fixed for the audit."""
  mechanism = fedre.FedREMechanism(
      FEDRE_SPEC, epsilon=2.0, delta=1e-5, rounds=1, clip=0.5, budget_split="even",
      noise_calibration="accountant", psi_samples=1, psi_pixels=None,
      sensitivity=sensitivity)
  x = np.random.default_rng(0).random((4, 5, 4, 2)).astype(np.float32)
  view = defenses.ClientView(
      [tf.constant(w) for w in FEDRE_SPEC.initial_weights(0)],
      tf.data.Dataset.from_tensor_slices({"x": x, "y": np.arange(4) % 3}).batch(2),
      {fedre.MASK_KEY: tf.ones([5, 4])})
  return mechanism, mechanism.for_client(view, tf.constant([1, 2], tf.int64)), view


def test_fedres_noise_for_one_client_is_eq_8s_and_its_rounds():
  shapes = [w.shape for w in FEDRE_SPEC.initial_weights(0)]
  clip, tensors, samples = 0.5, 4, 4
  for sensitivity, m, scale in [("update", 0.5, 1.0), ("sample", 1.0, 2 / samples)]:
    mechanism, fixed, view = _fedre_client(sensitivity)
    z = mechanism.round_multiplier
    # the even split: each sigma_l = z sqrt(L) / m (m 1/2 for 'update', 1
    # for 'sample'); eq. 8's std C sigma_l, times 2 / |D_k| for 'sample'
    sigma = z * math.sqrt(tensors) / m
    np.testing.assert_allclose(fixed.stddevs.numpy(), [clip * sigma * scale] * tensors,
                               rtol=1e-5)
    update = [tf.fill(s, 3.0) for s in shapes]
    seed = tf.constant([1, 2], tf.int64)
    _, noise_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    for ran, fixed_upload in zip(mechanism.apply(update, seed, view),
                                 fixed.apply(update, noise_seed)):
      np.testing.assert_allclose(ran.numpy(), fixed_upload.numpy(), rtol=1e-6)


def test_fedres_update_reading_holds_and_its_sample_reading_is_refuted():
  # 'update': the canary pair moves each of the 4 tensors by 2C = 1 (2 in
  # all) against std 2 z: mu = 1 / z, the claim. 'sample' claims the same of
  # noise 4 times smaller (std z / 2: sigma_l halves with m, and 2 / |D_k|
  # = 1/2) against one sample's white-box gradient, which moves the clipped
  # update as far: mu = 4 / z (epsilon 9.2 against the claimed 1.8, past
  # the 4.7 that 1000 canaries can show)
  shapes = [tuple(w.shape) for w in FEDRE_SPEC.initial_weights(0)]
  delta = 1e-5
  update_mechanism, update_fixed, _ = _fedre_client("update")
  z = update_mechanism.round_multiplier
  held = uploads.audit_defense(update_fixed, shapes, delta, canaries=1000)
  assert held["epsilon_claimed"] == pytest.approx(_gaussian_epsilon(1 / z, delta), rel=1e-2)
  assert held["unit"] == "one upload" and held["epsilon_lower_bound"] <= held["epsilon_claimed"]
  _, sample_fixed, _ = _fedre_client("sample")
  refuted = uploads.audit_defense(sample_fixed, shapes, delta, canaries=1000)
  assert refuted["epsilon_claimed"] == pytest.approx(held["epsilon_claimed"], rel=1e-6)
  assert refuted["unit"] == "one record"
  assert (refuted["epsilon_claimed"] < refuted["epsilon_lower_bound"]
          <= _gaussian_epsilon(4 / z, delta))


class _ClaimsMoreNoise(local_dp_sgd.StepsCanary):
  """DP-SGD that adds the noise of `dp` but claims the event of `claimed`."""

  def __init__(self, dp, claimed, delta):
    super().__init__(dp, delta)
    self.event = local_dp_sgd.StepsCanary(claimed, delta).event


def _dp_sgd(z, rate=1.0, steps=1):
  return local_dp_sgd.DPSGD(1.0, z, rate, steps, samplings=((rate, steps),))


def test_dp_sgd_steps_hold_their_claim_and_a_quarter_of_their_noise_is_refuted():
  # one full-batch step: the record's clipped gradient C against noise z C,
  # the Gaussian mechanism at mu = 1 / z for adding or removing it
  delta, z = 1e-5, 2.0
  shapes = [(6, 3), (3,)]
  held = uploads.audit_defense(local_dp_sgd.StepsCanary(_dp_sgd(z), delta),
                               shapes, delta, canaries=1000)
  assert held["epsilon_claimed"] == pytest.approx(_gaussian_epsilon(1 / z, delta), rel=1e-2)
  assert held["unit"] == "one record"
  assert 0 < held["epsilon_lower_bound"] <= held["epsilon_claimed"]
  # half the noise (mu 1, epsilon 4.4) gave a bound of 1.50 against the
  # claimed 1.99 from 1000 canaries: a quarter (mu 2, epsilon 10.0)
  planted = uploads.audit_defense(_ClaimsMoreNoise(_dp_sgd(z / 4), _dp_sgd(z), delta),
                                  shapes, delta, canaries=1000)
  assert (held["epsilon_claimed"] < planted["epsilon_lower_bound"]
          <= _gaussian_epsilon(4 / z, delta))


@pytest.mark.slow  # 12 s: 1000 canaries through 10 steps each
def test_dp_sgd_steps_per_tensor_and_sampled_hold_their_claim():
  delta, z = 1e-5, 1.0
  shapes = [(6, 3), (3,)]
  # per tensor: sigma_l = z sqrt(2) on each of 2 tensors, one step of z
  layerwise = local_dp_sgd.StepsCanary(_dp_sgd(z), delta, [z * 2 ** 0.5] * 2, shapes)
  canary = layerwise.canary(np.arange(1.0, 22.0))
  np.testing.assert_allclose([np.linalg.norm(canary[:18]), np.linalg.norm(canary[18:])],
                             [1.0, 1.0])
  audit = uploads.audit_defense(layerwise, shapes, delta, canaries=1000)
  assert audit["epsilon_claimed"] == pytest.approx(_gaussian_epsilon(1 / z, delta), rel=1e-2)
  assert 0 < audit["epsilon_lower_bound"] <= audit["epsilon_claimed"]
  # 10 steps at rate 0.1: the claim is dp_accounting's for the steps
  sampled = local_dp_sgd.StepsCanary(_dp_sgd(z, 0.1, 10), delta)
  audit = uploads.audit_defense(sampled, shapes, delta, canaries=1000)
  event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      0.1, dp_accounting.GaussianDpEvent(z)), 10)
  claim = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(delta)
  assert audit["epsilon_claimed"] == pytest.approx(claim, rel=1e-3)
  assert audit["epsilon_lower_bound"] <= claim


def test_canary_clients_enter_the_sum_clipped_and_only_the_inserted_ones():
  k, clip, rate = 40, 2.0, 0.5
  shapes = [(30, 20), (20,)]
  query = queries.CanaryClientsQuery(clip, 0.0, 5, canaries=k, rate=rate)
  directions = queries.canary_directions(shapes, k, 5)
  flat = np.concatenate([d.numpy().reshape(k, -1) for d in directions], axis=1)
  np.testing.assert_allclose(np.linalg.norm(flat, axis=1), 1.0, rtol=1e-5)
  inserted = queries.inserted_canaries(k, 5)
  state, joined = query.initial_global_state(), []
  for _ in range(30):
    result, state, _ = query.get_noised_result([tf.zeros(s) for s in shapes], state)
    total = np.concatenate([np.ravel(t) for t in result])
    # the sum is C times a 0/1 combination of the directions: solved for
    coefficients = np.linalg.lstsq(flat.T, total, rcond=None)[0]
    np.testing.assert_allclose(coefficients, clip * np.round(coefficients / clip),
                               atol=1e-4)
    joined.append(np.round(coefficients / clip).astype(bool))
  joined = np.array(joined)
  assert not joined[:, ~inserted].any()
  # each inserted canary takes part in a round with probability 1/2: over
  # 30 rounds and its 20-odd canaries, within 4 standard errors of 1/2
  share = joined[:, inserted].mean()
  assert abs(share - rate) < 4 * math.sqrt(rate * (1 - rate) / joined[:, inserted].size)


def _canary_training(z: float, rounds: int, k: int = 1000):
  """The model's descent over `rounds` rounds of a noised sum that holds
  only canary clients (every client's rate 1/4), from the query itself, in
  20050 dimensions, where the 1000 directions are nearly orthogonal."""
  defense = defenses.DPFedAvg(1.0, z, audit_canaries=k)
  query = queries.CanaryClientsQuery(1.0, z, 3, canaries=k, rate=0.25)
  shapes = [(400, 50), (50,)]
  state, descent = query.initial_global_state(), [np.zeros(s) for s in shapes]
  for _ in range(rounds):
    result, state, _ = query.get_noised_result([tf.zeros(s) for s in shapes], state)
    descent = [d + r.numpy() for d, r in zip(descent, result)]
  return defense, [np.zeros(s) for s in shapes], [-d for d in descent]


@pytest.mark.slow  # 40 s: 40 rounds of 1000 canaries in 20050 dimensions
def test_a_training_with_canary_clients_holds_its_claim_and_without_noise_shows_its_reach():
  delta, rounds = 1e-5, 20
  defense, initial, final = _canary_training(2.0, rounds)
  audit = clients.audit_training(defense, initial, final, num_clients=40,
                                 clients_per_round=10, rounds=rounds, delta=delta, seed=3)
  event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      0.25, dp_accounting.GaussianDpEvent(2.0)), rounds)
  claim = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(delta)
  assert audit["epsilon_claimed"] == pytest.approx(claim, rel=1e-3)
  assert audit["applied_to"] == "the whole training" and audit["unit"] == "a client's data"
  assert 0 <= audit["epsilon_lower_bound"] <= claim
  defense, initial, final = _canary_training(0.0, rounds)
  bare = clients.audit_training(defense, initial, final, num_clients=40,
                                clients_per_round=10, rounds=rounds, delta=delta, seed=3)
  assert bare["epsilon_claimed"] is None
  # an inserted canary joins about 5 of the 20 rounds (none: 0.75^20, 0.3%),
  # and scores near 5 / 120 (the descent's norm: sqrt(500 x 28.75)) against
  # a held-out one's spread of 1 / sqrt(20050)
  # (598 of 600 guesses right here: 4.17 of the 4.72 in reach)
  assert bare["right"] >= 0.99 * bare["guesses"]
  assert bare["epsilon_lower_bound"] >= 0.85 * bare["epsilon_reachable"]


def test_seeing_every_round_scores_each_canary_by_its_largest_cosine():
  k, rounds = 200, 3
  defense = defenses.DPFedAvg(1.0, 1.0, audit_canaries=k)
  inserted = queries.inserted_canaries(k, 4)
  # held-out canaries: 0.5 every round; inserted ones 1.0 in one round and
  # 0 in the others, whose mean (1/3) lies below the held-out ones' 0.5
  cosines = np.full((rounds, k), 0.5)
  cosines[:, inserted] = 0.0
  cosines[np.arange(k) % rounds, np.arange(k)] = np.where(inserted, 1.0, 0.5)
  model = [np.ones((5, 4), np.float32)]
  audit = clients.audit_training(defense, model, model, num_clients=10,
                                 clients_per_round=5, rounds=rounds, delta=1e-5,
                                 seed=4, every_round=cosines)
  every = audit["every_round"]
  assert every["right"] == every["guesses"] > 0
  assert every["epsilon_lower_bound"] == every["epsilon_reachable"]
  assert audit["epsilon_lower_bound"] < every["epsilon_lower_bound"]


def test_the_estimates_interval_is_scipys_bootstrap_mapped_to_epsilon():
  rng = np.random.default_rng(1)
  inside, outside = rng.normal(1.0, 1.0, 400), rng.normal(0.0, 1.0, 400)
  scores, included = np.r_[inside, outside], np.r_[np.ones(400, bool), np.zeros(400, bool)]

  def mu(a, b):
    pooled = math.sqrt((399 * a.var(ddof=1) + 399 * b.var(ddof=1)) / 798)
    return (a.mean() - b.mean()) / pooled

  scipy_ci = scipy.stats.bootstrap((inside, outside), mu, vectorized=False,
                                   method="percentile", n_resamples=4000,
                                   random_state=2).confidence_interval
  low, high = one_shot.estimate_interval(scores, included, 1e-5, resamples=4000)
  assert low == pytest.approx(_gaussian_epsilon(scipy_ci.low, 1e-5), rel=0.03)
  assert high == pytest.approx(_gaussian_epsilon(scipy_ci.high, 1e-5), rel=0.03)
  assert low < one_shot.epsilon_estimate(scores, included, 1e-5) < high
  assert low < _gaussian_epsilon(1.0, 1e-5) < high  # the mechanism's
