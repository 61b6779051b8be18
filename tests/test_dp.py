import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import dp
from tff_privacy.dp import accounting, dp_sgd

CLIPS = [1.0, 0.5, 2.0]
SIGMAS = [0.5, 2.0, 1.0]
SHAPES = [(40, 50), (1000,), (30, 20)]


def _run(query, records, global_state=None):
  """Sums `records` through `query`; returns (noised sum, state, event)."""
  state = global_state if global_state is not None else query.initial_global_state()
  params = query.derive_sample_params(state)
  sample = query.initial_sample_state(records[0])
  for r in records:
    sample = query.accumulate_record(params, sample, r)
  return query.get_noised_result(sample, state)


def _zeros():
  return [tf.zeros(s) for s in SHAPES]


def test_layerwise_clipping_bounds_every_layer():
  query = dp.LayerwiseGaussianQuery(CLIPS, [0.0] * 3)
  rng = np.random.default_rng(0)
  params = query.derive_sample_params(query.initial_global_state())
  for scale in (0.01, 1.0, 100.0):
    record = [tf.constant(rng.normal(0, scale, s), tf.float32) for s in SHAPES]
    clipped = query.preprocess_record(params, record)
    for c, original, v in zip(CLIPS, record, clipped):
      norm = float(tf.norm(v))
      assert norm <= c * (1 + 1e-6)
      if float(tf.norm(original)) <= c:  # small layers pass unchanged
        np.testing.assert_allclose(v, original, rtol=1e-6)


def test_layerwise_noise_std_is_clip_times_multiplier():
  query = dp.LayerwiseGaussianQuery(CLIPS, SIGMAS, seed=7)
  noised, _, event = _run(query, [_zeros()])
  for v, c, s in zip(noised, CLIPS, SIGMAS):
    # >= 600 samples per layer: the sample std has relative error ~1/sqrt(2n)
    # <= 3%, so 10% is a > 3 sigma tolerance
    assert float(tf.math.reduce_std(v)) == pytest.approx(c * s, rel=0.1)
    assert abs(float(tf.reduce_mean(v))) < 4 * c * s / np.sqrt(v.shape.num_elements())
  assert isinstance(event, dp_accounting.ComposedDpEvent)
  assert [float(e.noise_multiplier) for e in event.events] == pytest.approx(SIGMAS)


def test_laplace_noise_std_is_sqrt2_times_scale():
  query = dp.LaplaceSumQuery(norm_clip=1.0, scale=0.3, seed=1)
  noised, _, event = _run(query, [[tf.zeros((200, 100))]])
  assert float(tf.math.reduce_std(noised[0])) == pytest.approx(np.sqrt(2) * 0.3, rel=0.05)
  assert float(event.noise_multiplier) == pytest.approx(0.3)


@pytest.mark.parametrize("norm,measure", [("l1", lambda v: np.abs(v).sum()),
                                          ("l2", lambda v: np.sqrt((v ** 2).sum()))])
def test_laplace_query_clips_in_its_norm(norm, measure):
  query = dp.LaplaceSumQuery(norm_clip=2.0, scale=0.0, norm=norm)
  record = [tf.fill((10,), 3.0), tf.fill((4, 4), -1.0)]
  clipped = query.preprocess_record(query.derive_sample_params(
      query.initial_global_state()), record)
  total = measure(np.concatenate([np.ravel(v) for v in clipped]))
  assert total == pytest.approx(2.0, rel=1e-5)


def test_noise_is_reproducible_fresh_and_seedable():
  query = dp.LayerwiseGaussianQuery(CLIPS, SIGMAS, seed=3)
  a, state_after, _ = _run(query, [_zeros()])
  b, _, _ = _run(query, [_zeros()])
  c, _, _ = _run(query, [_zeros()], state_after)  # the next round's noise
  for x, y, z in zip(a, b, c):
    np.testing.assert_array_equal(x, y)
    assert not np.allclose(x, z)
  client = dp.with_seed(query, query.initial_global_state(), 12345)
  d, _, _ = _run(query, [_zeros()], client)
  assert not np.allclose(a[0], d[0])
  layers = [v.numpy().ravel()[:100] for v in d]
  assert not np.allclose(layers[0] / CLIPS[0] / SIGMAS[0],
                         layers[2][:100] / CLIPS[2] / SIGMAS[2])


@pytest.mark.parametrize("build,match", [
    (lambda: dp.LayerwiseGaussianQuery([1.0, 0.0], [1.0, 1.0]), "l2_norm_clips must be > 0"),
    (lambda: dp.LayerwiseGaussianQuery([1.0], [-1.0]), "noise_multipliers must be >= 0"),
    (lambda: dp.LayerwiseGaussianQuery([1.0], [1.0, 2.0]), "1 entries but"),
    (lambda: dp.LaplaceSumQuery(0.0, 1.0), "norm_clip must be > 0"),
    (lambda: dp.LaplaceSumQuery(1.0, -1.0), "scale must be >= 0"),
    (lambda: dp.LaplaceSumQuery(1.0, 1.0, norm="linf"), "norm='linf'"),
])
def test_invalid_parameters_name_themselves(build, match):
  with pytest.raises(ValueError, match=match):
    build()


def test_accountant_agrees_with_dp_accounting():
  direct = dp_accounting.rdp.RdpAccountant()
  direct.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.1)), 20))
  assert accounting.gaussian_epsilon(1.1, 20, 1e-5, 0.1) == pytest.approx(
      direct.get_epsilon(1e-5))
  pld = dp_accounting.pld.PLDAccountant()
  pld.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.LaplaceDpEvent(2.0), 5))
  assert accounting.laplace_epsilon(2.0, 5, 1e-5) == pytest.approx(pld.get_epsilon(1e-5))
  # one Laplace step with b = 2C is a (0.5, 0)-DP mechanism
  assert accounting.laplace_epsilon(2.0, 1, 1e-9) == pytest.approx(0.5, abs=0.01)
  assert accounting.laplace_pure_epsilon(2.0, 5) == 2.5
  assert accounting.simple_composition([0.5, 1.0], [1e-5, 0.0]) == (1.5, 1e-5)


def test_layerwise_event_is_accounted_per_round():
  query = dp.LayerwiseGaussianQuery(CLIPS, SIGMAS)
  _, _, event = _run(query, [_zeros()])
  eps = accounting.epsilon(dp_accounting.SelfComposedDpEvent(event, 10), 1e-5)
  # composing layers is at least as costly as the least noisy layer alone
  assert eps >= accounting.gaussian_epsilon(min(SIGMAS), 10, 1e-5)


@pytest.mark.parametrize("delta", [0.0, 1.0, -0.1])
def test_accounting_rejects_bad_delta(delta):
  with pytest.raises(ValueError, match="delta must lie in"):
    accounting.gaussian_epsilon(1.0, 1, delta)


def test_tff_differentially_private_factory_accepts_the_layerwise_query():
  query = dp.LayerwiseGaussianQuery([1.0, 1.0], [0.0, 0.0])
  factory = tff.aggregators.DifferentiallyPrivateFactory(query)
  value_type = tff.StructWithPythonType(
      [tff.TensorType(np.float32, [3]), tff.TensorType(np.float32, [2])], list)
  process = factory.create(value_type)
  values = [[np.full(3, 10.0, np.float32), np.array([0.3, 0.4], np.float32)],
            [np.zeros(3, np.float32), np.zeros(2, np.float32)]]
  out = process.next(process.initialize(), values)
  # the first layer is clipped to norm 1 before the sum, the second is within
  # its bound and passes unchanged; no noise
  np.testing.assert_allclose(np.linalg.norm(out.result[0]), 1.0, rtol=1e-5)
  np.testing.assert_allclose(out.result[1], [0.3, 0.4], rtol=1e-6)


def test_rounds_epsilon_picks_the_accountant_per_event():
  gauss = dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.1))
  rdp = dp_accounting.rdp.RdpAccountant()
  rdp.compose(dp_accounting.SelfComposedDpEvent(gauss, 7))
  assert accounting.rounds_epsilon(gauss, 7, 1e-5) == (
      pytest.approx(rdp.get_epsilon(1e-5)), 1e-5)
  laplace = dp_accounting.LaplaceDpEvent(2.0)
  assert accounting.rounds_epsilon(laplace, 5, 1e-5) == (
      pytest.approx(accounting.laplace_epsilon(2.0, 5, 1e-5)), 1e-5)
  # far beyond the PLD's reach: the pure bound, delta 0
  assert accounting.rounds_epsilon(dp_accounting.LaplaceDpEvent(1e-4), 3, 1e-5) == (
      pytest.approx(3e4), 0.0)


def test_layerwise_query_builds_inside_tf_function_and_tff():
  def noised_sum():
    records = [tf.fill([3], 10.0), tf.constant([0.3, 0.4])]
    query = dp.LayerwiseGaussianQuery([1.0, 1.0], [0.5, 0.5], seed=4)
    return _run(query, [records])[0]

  eager = noised_sum()
  graph = tf.function(noised_sum)()

  @tff.tensorflow.computation
  def in_tff():
    return noised_sum()

  for a, b, c in zip(eager, graph, in_tff()):
    np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(a, c, rtol=1e-6)
  # the seeds are the stateless fold-in of the query's seed and layer index
  direct = tf.random.stateless_normal(
      [2], seed=tf.random.experimental.stateless_split(
          tf.random.experimental.stateless_fold_in(tf.constant([4, 0], tf.int64), 1),
          num=2)[0], stddev=0.5)
  np.testing.assert_allclose(eager[1], [0.3, 0.4] + direct.numpy(), rtol=1e-5)


# FedRE's layer-wise budget (eqs. 6 and 9), checked by hand computations and
# by dp_accounting called directly.

def test_layerwise_budget_is_eq_6_by_hand():
  from tff_privacy.dp import layerwise_budget as lb
  got = lb.layerwise_budget([1.0, 2.0, 4.0], 7.0).numpy()
  # 1/S = 1, 1/2, 1/4; sum 7/4; eps_l = 7 * (1/S_l) / (7/4)
  np.testing.assert_allclose(got, [4.0, 2.0, 1.0], rtol=1e-6)
  np.testing.assert_allclose(lb.layerwise_budget([0.0, 0.0], 3.0).numpy(), [1.5, 1.5])



def test_a_zero_score_takes_the_smallest_share_not_the_whole_budget():
  from tff_privacy.dp import layerwise_budget as lb
  # the zero counts as the largest other score, 4: 1/S = 1/4, 1, 1/2, 1/4,
  # sum 2; eps_l = 7 (1/S_l) / 2
  got = lb.layerwise_budget([0.0, 1.0, 2.0, 4.0], 7.0).numpy()
  np.testing.assert_allclose(got, [0.875, 3.5, 1.75, 0.875], rtol=1e-6)
  # a dead tensor beside live ones no longer starves them of budget: eq. 9's
  # sigma of the live tensors stays that of the split without the zero
  live = lb.layerwise_budget([1.0, 2.0, 4.0], 7.0 - 0.875).numpy()
  np.testing.assert_allclose(got[1:], live, rtol=1e-6)


def test_paper_noise_multipliers_are_eq_9_by_hand():
  from tff_privacy.dp import layerwise_budget as lb
  got = lb.paper_noise_multipliers([2.0, 8.0], 1e-3, 50).numpy()
  expected = np.sqrt(2 * 50 * np.log(1000)) / np.array([2.0, 8.0])
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  assert lb.split_delta(1e-5, 4) == 2.5e-6
  # and solved back for epsilon_l: the share those sigmas spend
  np.testing.assert_allclose(lb.paper_layer_epsilons(expected, 1e-3, 50).numpy(),
                             [2.0, 8.0], rtol=1e-6)


@pytest.mark.parametrize("splits, planned, expected", [
    # the same split every round: epsilon sqrt(t / T)
    ([[5.0, 5.0, 5.0, 5.0]], 2, 20.0 / np.sqrt(2)),
    ([[5.0, 5.0, 5.0, 5.0]] * 2, 2, 20.0),
    # a PSI split that changes: per tensor, by hand, 2 sqrt((3.988^2 +
    # 4.408^2) / 2) + 2 sqrt((6.012^2 + 5.592^2) / 2) = 8.40650 + 11.61160
    ([[3.988, 3.988, 6.012, 6.012], [4.408, 4.408, 5.592, 5.592]], 2, 20.01810),
    # 0.9 / 0.1 then 0.1 / 0.9: 2 sqrt((0.81 + 0.01) / 2) = 1.28062, not 1
    ([[0.9, 0.1], [0.1, 0.9]], 2, 1.28062),
    # a round the client sat out spends nothing
    ([[0.9, 0.1], [0.0, 0.0]], 2, 1.0 / np.sqrt(2))])
def test_paper_epsilon_composes_eq_9_over_rounds_per_tensor(splits, planned,
                                                            expected):
  from tff_privacy.dp import layerwise_budget as lb
  assert lb.paper_epsilon_spent(splits, planned) == pytest.approx(expected, abs=2e-5)


def test_paper_epsilon_is_eq_9_of_the_noise_each_tensor_received():
  """Eq. 9's bound for rounds of noise sigma_{l,r}: epsilon_l^2 = 2 ln(1 /
  delta_l) sum_r 1 / sigma_{l,r}^2 (T equal rounds: eq. 9 itself), summed
  over tensors; each round's sigma is eq. 9's for its split over T = 3."""
  from tff_privacy.dp import layerwise_budget as lb
  splits = np.array([[1.0, 3.0, 6.0], [5.0, 4.0, 1.0]])
  layer_delta = 1e-5 / 3
  sigmas = np.sqrt(2 * 3 * np.log(1 / layer_delta)) / splits
  per_tensor = np.sqrt(2 * np.log(1 / layer_delta) * (1 / sigmas**2).sum(0))
  assert lb.paper_epsilon_spent(splits, 3) == pytest.approx(per_tensor.sum(), rel=1e-12)
  with pytest.raises(ValueError, match=r"layer_epsilons must be \[rounds, tensors\]"):
    lb.paper_epsilon_spent([1.0, 2.0], 3)
  with pytest.raises(ValueError, match="planned_rounds must be >= 1"):
    lb.paper_epsilon_spent(splits, 0)


def test_calibrated_multipliers_spend_exactly_the_budget():
  import dp_accounting
  from tff_privacy.dp import layerwise_budget as lb
  eps = lb.layerwise_budget([0.3, 1.0, 0.05, 2.0], 10.0).numpy()
  z = lb.round_multiplier(10.0, 1e-5, 20)
  sigmas = lb.calibrated_noise_multipliers(eps, z).numpy()
  acc = dp_accounting.rdp.RdpAccountant()
  acc.compose(dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(s / 2) for s in sigmas]), 20)
  assert abs(acc.get_epsilon(1e-5) - 10.0) < 0.01
  assert abs(accounting.rounds_epsilon(lb.layerwise_event(sigmas), 20, 1e-5)[0] - 10.0) < 0.01
  # per-sample sensitivity: the noise is scaled to it, multipliers sigma_l
  sample = lb.calibrated_noise_multipliers(eps, z, "sample").numpy()
  np.testing.assert_allclose(sample, sigmas / 2, rtol=1e-6)
  acc = dp_accounting.rdp.RdpAccountant()
  acc.compose(dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(s) for s in sample]), 20)
  assert abs(acc.get_epsilon(1e-5) - 10.0) < 0.01
  assert abs(accounting.rounds_epsilon(lb.layerwise_event(sample, "sample"),
                                       20, 1e-5)[0] - 10.0) < 0.01


@pytest.mark.parametrize("sensitivity, per_sigma", [("update", 0.5), ("sample", 1.0)])
def test_eq_9_never_spends_more_than_its_data_independent_bound(sensitivity, per_sigma):
  from tff_privacy.dp import layerwise_budget as lb
  rng = np.random.default_rng(0)
  bound = lb.paper_round_multiplier_bound(10.0, 1e-5, 20, 4, sensitivity)
  # by hand: m sqrt(2 T ln(L / delta)) / epsilon
  assert bound == pytest.approx(per_sigma * np.sqrt(40 * np.log(4e5)) / 10.0)
  from tff_privacy.dp import accounting
  worst = accounting.gaussian_epsilon(bound, 20, 1e-5)
  one_layer_takes_all = [1e9, 1e9, 1e9, 1.0]

  def spent(scores):
    eps = lb.layerwise_budget(scores, 10.0).numpy()
    sigmas = lb.paper_noise_multipliers(eps, lb.split_delta(1e-5, 4), 20).numpy()
    return accounting.rounds_epsilon(lb.layerwise_event(sigmas, sensitivity), 20, 1e-5)[0]

  for scores in [rng.random(4) for _ in range(5)] + [one_layer_takes_all]:
    assert spent(scores) <= worst + 1e-6
  # the bound is reached when one layer takes the whole budget
  assert spent(one_layer_takes_all) == pytest.approx(worst, rel=1e-3)


@pytest.mark.parametrize("args, message", [
    ((0.0, 1e-5, 10), "epsilon must be"), ((1.0, 1.0, 10), "delta must lie"),
    ((1.0, 1e-5, 0), "rounds must be")])
def test_budget_arguments_are_checked(args, message):
  from tff_privacy.dp import layerwise_budget as lb
  with pytest.raises(ValueError, match=message):
    lb.round_multiplier(*args)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_layerwise_budget_of_non_finite_scores_is_nan_not_another_split(bad):
  from tff_privacy.dp import layerwise_budget as lb
  assert np.isnan(lb.layerwise_budget([bad, 1.0, 2.0], 3.0).numpy()).all()


def test_layerwise_private_gradient_clips_each_tensor_of_each_example():
  rng = np.random.default_rng(3)
  grads = [rng.normal(scale=s, size=(5,) + shape).astype(np.float32)
           for s, shape in zip((1.0, 0.05, 3.0), [(4, 3), (3,), (2, 2)])]
  clip = 0.5
  got = dp_sgd.layerwise_private_gradient(
      [tf.constant(g) for g in grads], clip, tf.zeros([3]),
      tf.constant([1, 2], tf.int64), tf.constant(4.0))
  for g, t in zip(grads, got):
    norms = np.sqrt((g.reshape(5, -1) ** 2).sum(1))
    scale = np.minimum(1.0, clip / norms)
    expected = (scale[:, None] * g.reshape(5, -1)).sum(0).reshape(g.shape[1:]) / 4
    np.testing.assert_allclose(t.numpy(), expected, rtol=1e-5, atol=1e-7)


def test_layerwise_private_gradient_noise_std_is_clip_times_each_multiplier():
  zeros = [tf.zeros((1,) + s) for s in SHAPES]
  sigmas = tf.constant(SIGMAS)
  step = tf.function(lambda seed: dp_sgd.layerwise_private_gradient(
      zeros, 0.7, sigmas, seed, tf.constant(2.0)))
  draws = [step(tf.constant([s, 9], tf.int64)) for s in range(3)]
  for l, sigma in enumerate(SIGMAS):
    samples = np.concatenate([d[l].numpy().ravel() for d in draws])
    np.testing.assert_allclose(samples.std(), 0.7 * sigma / 2.0, rtol=0.05)
    assert abs(samples.mean()) < 5 * 0.7 * sigma / 2.0 / np.sqrt(samples.size)
  np.testing.assert_array_equal(step(tf.constant([1, 9], tf.int64))[0].numpy(),
                                draws[1][0].numpy())
  assert not np.array_equal(draws[0][0].numpy(), draws[1][0].numpy())
