import numpy as np
import pytest
from skimage import metrics as skm

from conftest import fake_lpips_weights
from tff_privacy import metrics
from tff_privacy.metrics import intervals, report


def test_scores_match_scikit_image_and_clip_to_range():
  rng = np.random.default_rng(0)
  a = rng.random((2, 28, 28, 1))
  b = a + rng.normal(0, 0.1, a.shape)
  scores = metrics.image_scores(a, b, (0.0, 1.0))
  bc = np.clip(b, 0, 1)
  assert scores[0]["mse"] == pytest.approx(np.mean((a[0] - bc[0]) ** 2))
  assert scores[1]["psnr"] == pytest.approx(
      skm.peak_signal_noise_ratio(a[1], bc[1], data_range=1.0))
  assert scores[0]["ssim"] == pytest.approx(
      skm.structural_similarity(a[0, ..., 0], bc[0, ..., 0], data_range=1.0))


def test_exact_reconstruction_scores_perfectly_and_psnr_is_capped():
  a = np.random.default_rng(1).random((1, 8, 8, 1))
  s = metrics.image_scores(a, a.copy(), (0.0, 1.0))[0]
  assert s == {"mse": 0.0, "psnr": metrics.PSNR_CAP_DB, "ssim": 1.0}


def test_matching_undoes_a_permutation():
  x = np.random.default_rng(2).random((5, 4, 4, 1))
  perm = np.array([3, 0, 4, 1, 2])
  shuffled = x[perm]
  matched = shuffled[metrics.match_by_mse(x, shuffled)]
  np.testing.assert_array_equal(matched, x)


def test_label_accuracy_counts_multisets():
  rows = [{"round": 1, "client": 0, "true_label": t, "recovered_label": r}
          for t, r in [(1, 2), (2, 1), (3, 3), (4, 5)]]
  assert report.label_count_accuracy(rows) == 0.75


def test_lpips_runs_only_from_a_weights_file(tmp_path):
  from tff_privacy.metrics import lpips
  with pytest.raises(FileNotFoundError, match="does not exist"):
    lpips.load_weights(str(tmp_path / "missing.npz"))
  arrays = fake_lpips_weights(tmp_path / "w.npz")
  weights = lpips.load_weights(str(tmp_path / "w.npz"))
  rng = np.random.default_rng(1)
  a, b = rng.random((2, 28, 28, 1)), rng.random((2, 28, 28, 1))
  d_same = lpips.lpips(a, a, weights)
  d_diff = lpips.lpips(a, b, weights)
  np.testing.assert_allclose(d_same, 0.0, atol=1e-6)
  assert np.all(d_diff > 1e-4)
  np.testing.assert_allclose(d_diff, lpips.lpips(b, a, weights), rtol=1e-5)
  del arrays["lin3"]
  np.savez(tmp_path / "bad.npz", **arrays)
  with pytest.raises(ValueError, match="lack 'lin3'"):
    lpips.load_weights(str(tmp_path / "bad.npz"))


def test_feature_mse_compares_penultimate_features():
  from tff_privacy import models
  spec = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": (16,)})
  model, weights = spec.keras(), spec.initial_weights(0)
  rng = np.random.default_rng(3)
  a, b = rng.random((1, 8, 8, 1)), rng.random((1, 8, 8, 1))
  assert metrics.feature_mse(model, weights, a, a) == 0.0
  hidden = np.maximum(a.reshape(1, -1) @ weights[0] + weights[1], 0)
  hidden_b = np.maximum(b.reshape(1, -1) @ weights[0] + weights[1], 0)
  assert metrics.feature_mse(model, weights, a, b) == pytest.approx(
      np.mean((hidden - hidden_b) ** 2), rel=1e-5)


@pytest.mark.parametrize("height,width", [(10, 30), (25, 25), (40, 8)])
def test_figure_keeps_the_images_aspect_ratio(height, width):
  import matplotlib.pyplot as plt
  from tff_privacy.metrics import report
  images = [np.random.default_rng(0).random((height, width, 1))] * 3
  fig = report.grid_figure({"original": images, "reconstructed": images}, (0, 1))
  fig.canvas.draw()
  for ax in fig.axes:
    box = ax.images[0].get_window_extent()
    assert box.width / box.height == pytest.approx(width / height, rel=0.03)
  plt.close(fig)


def test_region_scores_by_hand_and_scikit_image():
  rng = np.random.default_rng(3)
  a = rng.random((1, 12, 12, 1))
  b = a + rng.normal(0, 0.2, a.shape)
  mask = np.zeros((12, 12), bool)
  mask[1:5, 2:8] = True    # 24 pixels
  mask[8:11, 8:11] = True  # 9 pixels, a second part
  mask[0, 11] = True       # 1 pixel: in MSE, too thin for SSIM
  got = metrics.region_scores(a, b, mask, (0.0, 1.0))[0]
  bc = np.clip(b, 0, 1)
  mse = np.mean((a[0][mask] - bc[0][mask]) ** 2)
  assert got["mse"] == pytest.approx(mse)
  assert got["psnr"] == pytest.approx(10 * np.log10(1 / mse))
  ssim = [skm.structural_similarity(a[0, y0:y1, x0:x1, 0], bc[0, y0:y1, x0:x1, 0],
                                    win_size=3, data_range=1.0)
          for y0, y1, x0, x1 in ((1, 5, 2, 8), (8, 11, 8, 11))]
  assert got["ssim"] == pytest.approx((24 * ssim[0] + 9 * ssim[1]) / 33)


def test_region_without_a_part_ssim_can_score_is_refused():
  mask = np.zeros((8, 8), bool)
  mask[0, :] = True
  with pytest.raises(ValueError, match="at least 3x3"):
    metrics.region_scores(np.zeros((1, 8, 8, 1)), np.zeros((1, 8, 8, 1)), mask,
                          (0.0, 1.0))


def test_segmentation_rows_score_the_pixel_labels():
  rows = [{"label_pixel_accuracy": 0.5}, {"label_pixel_accuracy": 1.0}]
  assert report.label_accuracy(rows) == 0.75


def _uploads(rng, clients):
  """Each client's upload: a [3, 4] kernel and a [4] bias, float32."""
  return [[rng.normal(size=(3, 4)).astype(np.float32),
           rng.normal(size=4).astype(np.float32)] for _ in range(clients)]


def test_aggregate_fidelity_compares_the_weighted_means_in_float64():
  from tff_privacy.metrics.updates import aggregate_fidelity
  rng = np.random.default_rng(0)
  clean, weights = _uploads(rng, 3), [1.0, 2.0, 5.0]
  defended = [[t + rng.normal(0, 0.3, t.shape).astype(np.float32) for t in u]
              for u in clean]
  flat = lambda u: np.concatenate([u[0].ravel(), u[1]]).astype(np.float64)
  c = sum(w * flat(u) for w, u in zip(weights, clean)) / 8
  d = sum(w * flat(u) for w, u in zip(weights, defended)) / 8
  got = aggregate_fidelity(clean, defended, weights)
  assert got["update_cosine"] == pytest.approx(
      np.dot(c, d) / np.sqrt(np.dot(c, c) * np.dot(d, d)), rel=1e-12)
  assert got["update_relative_error"] == pytest.approx(
      np.sqrt(np.sum((d - c) ** 2) / np.sum(c ** 2)), rel=1e-12)
  assert aggregate_fidelity(clean, clean, weights) == {
      "update_cosine": pytest.approx(1.0, abs=1e-15), "update_relative_error": 0.0}


def test_aggregate_fidelity_refuses_what_it_cannot_compare():
  from tff_privacy.metrics.updates import UndefinedFidelity, aggregate_fidelity
  clean = _uploads(np.random.default_rng(1), 2)
  zero = [[np.zeros_like(t) for t in u] for u in clean]
  with pytest.raises(UndefinedFidelity, match="the clean aggregate update is zero"):
    aggregate_fidelity(zero, clean, [1, 1])
  with pytest.raises(UndefinedFidelity, match="the defended aggregate update is zero"):
    aggregate_fidelity(clean, zero, [1, 1])
  with pytest.raises(ValueError, match="2 clean uploads but 1 defended"):
    aggregate_fidelity(clean, clean[:1], [1, 1])
  with pytest.raises(ValueError, match="shaped differently"):
    aggregate_fidelity(clean, [u[:1] for u in clean], [1, 1])
  with pytest.raises(ValueError, match="weights: 1 given for 2 uploads"):
    aggregate_fidelity(clean, clean, [1])
  with pytest.raises(ValueError, match=r"weights must be >= 0, got \[1.0, -1.0\]"):
    aggregate_fidelity(clean, clean, [1, -1])


def test_clients_of_weight_zero_are_left_out_of_both_aggregates():
  """TFF zeroes a non-finite update and weighs it 0; the clean simulation
  of that client is still NaN or infinite."""
  from tff_privacy.metrics.updates import aggregate_fidelity
  rng = np.random.default_rng(2)
  clean, weights = _uploads(rng, 4), [2.0, 0.0, 3.0, 0.0]
  clean[1] = [np.full_like(t, np.nan) for t in clean[1]]
  clean[3][0][1, 2] = np.inf
  defended = [[t + rng.normal(0, 0.3, t.shape).astype(np.float32) for t in u]
              for u in clean]
  defended[1] = [np.zeros_like(t) for t in clean[1]]
  flat = lambda u: np.concatenate([u[0].ravel(), u[1]]).astype(np.float64)
  c = (2 * flat(clean[0]) + 3 * flat(clean[2])) / 5
  d = (2 * flat(defended[0]) + 3 * flat(defended[2])) / 5
  got = aggregate_fidelity(clean, defended, weights)
  assert got["update_cosine"] == pytest.approx(
      np.dot(c, d) / np.sqrt(np.dot(c, c) * np.dot(d, d)), rel=1e-12)
  assert got["update_relative_error"] == pytest.approx(
      np.sqrt(np.sum((d - c) ** 2) / np.sum(c ** 2)), rel=1e-12)


def test_fidelity_without_a_weighed_client_or_finite_aggregate_is_undefined():
  from tff_privacy.metrics.updates import UndefinedFidelity, aggregate_fidelity
  clean = _uploads(np.random.default_rng(3), 2)
  with pytest.raises(UndefinedFidelity, match=r"no client has a positive weight "
                     r"\(weights \[0.0, 0.0\]\)"):
    aggregate_fidelity(clean, clean, [0, 0])
  infinite = [[t.copy() for t in u] for u in clean]
  infinite[0][1][0] = np.inf
  with pytest.raises(UndefinedFidelity, match="the clean aggregate update is not finite"):
    aggregate_fidelity(infinite, clean, [1, 1])
  infinite[0][1][0] = np.nan
  with pytest.raises(UndefinedFidelity,
                     match="the defended aggregate update is not finite"):
    aggregate_fidelity(clean, infinite, [1, 1])


def _wilson(successes, trials, z=1.959963984540054):
  """The Wilson score interval written out (Wilson 1927)."""
  p = successes / trials
  centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
  half = z * np.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (
      1 + z * z / trials)
  return [centre - half, centre + half]


@pytest.mark.parametrize("successes,trials", [(7, 10), (0, 5), (412, 500)])
def test_a_proportions_interval_is_wilsons(successes, trials):
  np.testing.assert_allclose(intervals.proportion_interval(successes, trials),
                             _wilson(successes, trials), atol=1e-9)


def test_a_proportion_out_of_range_is_refused():
  with pytest.raises(ValueError, match="successes and trials"):
    intervals.proportion_interval(3, 2)


def _plain_worst_case(chosen_by, reported, resamples, seed):
  """The worst-case bootstrap written as a loop: draw victims, take the
  attack with the highest mean of `chosen_by`, keep its mean of `reported`."""
  rng = np.random.default_rng(seed)
  names = list(chosen_by)
  n = len(chosen_by[names[0]])
  values = []
  for _ in range(resamples):
    drawn = rng.integers(0, n, n)
    worst = max(names, key=lambda a: np.mean(np.asarray(chosen_by[a])[drawn]))
    values.append(np.mean(np.asarray(reported[worst])[drawn]))
  return np.percentile(values, [2.5, 97.5])


def test_the_worst_case_interval_chooses_the_attack_inside_each_resample():
  rng = np.random.default_rng(0)
  # two attacks of equal mean that win on different victims: the worst of
  # the two is higher than either, which an interval of one attack misses
  ssim = {"a": rng.uniform(0.2, 0.8, 16), "b": rng.uniform(0.2, 0.8, 16)}
  psnr = {"a": 30 * ssim["a"], "b": 10 + 20 * ssim["b"]}
  got = intervals.worst_case_interval(ssim, resamples=4000)
  np.testing.assert_allclose(got, _plain_worst_case(ssim, ssim, 20000, 1), atol=0.02)
  got = intervals.worst_case_interval(ssim, psnr, resamples=4000)
  np.testing.assert_allclose(got, _plain_worst_case(ssim, psnr, 20000, 1), atol=0.6)


def test_the_worst_case_interval_needs_two_victims_and_the_same_ones():
  assert intervals.worst_case_interval({"a": [0.5]}) is None
  with pytest.raises(ValueError, match="the same victims"):
    intervals.worst_case_interval({"a": [0.5, 0.6], "b": [0.5]})
  with pytest.raises(ValueError, match="the same attacks"):
    intervals.worst_case_interval({"a": [0.5, 0.6]}, {"b": [1.0, 2.0]})


def test_the_mean_interval_is_the_percentile_bootstrap_over_the_units():
  rng = np.random.default_rng(0)
  accuracies = rng.uniform(0.3, 0.9, 20)
  # the bootstrap written as a loop: draw units, keep the mean of the draw
  draws = np.random.default_rng(1).integers(0, 20, (20000, 20))
  plain = np.percentile(accuracies[draws].mean(axis=1), [2.5, 97.5])
  np.testing.assert_allclose(intervals.mean_interval(accuracies, resamples=4000),
                             plain, atol=0.01)


def test_the_mean_interval_needs_two_units():
  assert intervals.mean_interval([0.5]) is None
  assert intervals.mean_interval([]) is None


def test_the_seeded_interval_spans_seeds_that_disagree():
  # within each seed every unit agrees, so only the seeds vary: of two
  # seeds drawn with replacement, both are seed 0 a quarter of the time
  # (mean 0) and both seed 1 a quarter (mean 1), so the 2.5th and 97.5th
  # percentiles are 0 and 1
  per_seed = [[np.zeros(8)], [np.ones(8)]]
  assert intervals.seeded_interval(per_seed, intervals.weighted_mean) == [0.0, 1.0]


def test_the_seeded_interval_of_one_seed_is_the_units_bootstrap():
  import scipy.stats
  values = np.random.default_rng(4).normal(size=40)
  reference = scipy.stats.bootstrap((values,), np.mean, n_resamples=4000,
                                    method="percentile",
                                    random_state=np.random.default_rng(1))
  found = intervals.seeded_interval([[values]], intervals.weighted_mean,
                                   resamples=4000)
  assert found == pytest.approx([reference.confidence_interval.low,
                                 reference.confidence_interval.high], abs=0.03)


def test_the_seeded_interval_refuses_ragged_columns():
  with pytest.raises(ValueError, match="per_seed"):
    intervals.seeded_interval([[np.zeros(3), np.zeros(4)]], intervals.weighted_mean)
  assert intervals.seeded_interval([[np.zeros(1)]], intervals.weighted_mean) is None


def test_the_seeded_interval_draws_units_inside_the_seeds_drawn():
  # one seed of two units, 0 and 1: a resample draws both units with
  # replacement, so its mean is 0, 1/2 or 1 with chances 1/4, 1/2, 1/4,
  # and the bootstrap's weights hold exactly the two draws
  seen = []

  def statistic(weights, values):
    seen.append(weights)
    return intervals.weighted_mean(weights, values)

  assert intervals.seeded_interval([[np.array([0.0, 1.0])]], statistic,
                                   resamples=4000) == [0.0, 1.0]
  weights = seen[0]
  assert weights.shape == (4000, 2) and (weights.sum(axis=1) == 2).all()
  assert np.mean(weights[:, 0] == 1) == pytest.approx(0.5, abs=0.03)


def test_the_best_auc_interval_is_a_plain_bootstrap_of_the_best_attack():
  import sklearn.metrics
  rng = np.random.default_rng(1)
  scores = {"a": (rng.normal(0.3, 1, 40), rng.normal(0, 1, 30)),
            "b": (rng.normal(0, 1, 25), rng.normal(0, 1, 35))}
  got = intervals.best_auc_interval(scores, seed=5, resamples=200)
  # the same draws, in a plain loop
  draw, best = np.random.default_rng(5), []
  for _ in range(200):
    aucs = []
    for inside, outside in scores.values():
      a, b = draw.choice(inside, len(inside)), draw.choice(outside, len(outside))
      aucs.append(sklearn.metrics.roc_auc_score([1] * len(a) + [0] * len(b),
                                                np.r_[a, b]))
    best.append(max(aucs))
  assert got == pytest.approx([np.percentile(best, 2.5), np.percentile(best, 97.5)])
  separated = {"a": ([2.0, 3.0, 4.0], [0.0, 1.0])}
  assert intervals.best_auc_interval(separated, resamples=50) == [1.0, 1.0]
  with pytest.raises(ValueError, match="members and non-members"):
    intervals.best_auc_interval({"a": ([1.0], [])})
