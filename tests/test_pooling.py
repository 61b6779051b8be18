"""A row trained with several seeds: its numbers pooled over the seeds'
units, its intervals holding the seed-to-seed spread."""

import numpy as np
import pytest
from sklearn.metrics import balanced_accuracy_score

from tff_privacy.leaderboard import board, pooling


def _seed(ssim_ig, ssim_masked, accuracy, tested, truth, guesses):
  def cell(ssims):
    return {"ssim": float(np.mean(ssims)), "psnr": float(np.mean(ssims)) * 10,
            "mse": 0.1, "label_accuracy": 1.0, "seconds": 2.0,
            "value_range": [0.0, 1.0], "folder": "rows/x/ig",
            "ssim_by_iterations": {"1": 0.1, "2": float(np.mean(ssims))},
            "victims": {"clients": list(range(len(ssims))), "ssim": list(ssims),
                        "psnr": [10 * s for s in ssims]}}
  return {"key": "x", "label": "X", "entry": "X", "is_default": True,
          "settings": {}, "utility": accuracy, "samples_tested": tested,
          "utility_kind": board.GLOBAL_UTILITY, "loss": 0.5,
          "seconds_per_round": 1.0, "privacy": None, "upload_bytes": 4,
          "inversion": {"ig": cell(ssim_ig), "ig_masked": cell(ssim_masked)},
          "attribute": {"asr": {"rf": 0.0}, "balanced_asr": {"rf": 0.0},
                        "truth": truth, "guesses": {"rf": guesses}, "victims": len(truth),
                        "chance": 0.5, "balanced_chance": 0.5}}


SEEDS = [_seed([0.2, 0.4], [0.9, 0.7], 0.75, 4, [0, 1, 1], [0, 1, 0]),
         _seed([0.6, 0.6, 0.3], [0.1, 0.2, 0.3], 0.5, 6, [1, 0, 0, 1], [1, 0, 0, 0])]


def test_numbers_are_pooled_over_every_seeds_units():
  got = pooling.pooled(SEEDS)
  # 3 of 4 right and 3 of 6 right: 6 of 10
  assert got["utility"] == pytest.approx(0.6) and got["samples_tested"] == 10
  # each attack's mean over the five victims of both seeds
  assert got["inversion"]["ig"]["ssim"] == pytest.approx(np.mean([0.2, 0.4, 0.6, 0.6, 0.3]))
  assert got["inversion"]["ig_masked"]["ssim"] == pytest.approx(
      np.mean([0.9, 0.7, 0.1, 0.2, 0.3]))
  assert got["inversion"]["ig"]["seconds"] == 4.0
  truth, guesses = [0, 1, 1, 1, 0, 0, 1], [0, 1, 0, 1, 0, 0, 0]
  assert got["attribute"]["victims"] == 7
  assert got["attribute"]["asr"]["rf"] == pytest.approx(5 / 7)
  assert got["attribute"]["balanced_asr"]["rf"] == pytest.approx(
      balanced_accuracy_score(truth, guesses))
  assert got["attribute"]["chance"] == pytest.approx(4 / 7)
  assert got["seeds"] == SEEDS


def test_one_seed_is_the_result_itself():
  assert pooling.pooled(SEEDS[:1]) is SEEDS[0]


def test_pooled_intervals_hold_their_numbers_and_the_worst_attacks_choice():
  got = pooling.pooled(SEEDS)
  leak = pooling.leakage_intervals(got, ["ig", "ig_masked"])
  assert leak["victims"] == 5
  low, high = leak["ssim_ci"]
  # resamples where the masked attack is worst reach its 0.9 victims; those
  # of the second seed alone lie near 0.5 (ig): the interval spans both
  assert low <= 0.5 and high >= 0.6
  assert pooling.utility_interval(got)[0] <= 0.6 <= pooling.utility_interval(got)[1]
  assert got["attribute"]["balanced_asr_ci"]["rf"][0] <= got["attribute"][
      "balanced_asr"]["rf"] <= got["attribute"]["balanced_asr_ci"]["rf"][1]


def test_seeds_without_per_unit_values_are_averaged_without_intervals():
  old = [dict(s, samples_tested=None) for s in SEEDS]
  for s in old:
    s["attribute"] = dict(s["attribute"], truth=None, asr={"rf": 0.5})
  got = pooling.pooled(old)
  assert got["utility"] == pytest.approx(0.625)
  assert pooling.utility_interval(got) is None
  assert got["attribute"]["asr"]["rf"] == 0.5 and got["attribute"]["asr_ci"] is None


def test_a_failed_attack_of_one_seed_fails_the_pooled_row():
  broken = [SEEDS[0], dict(SEEDS[1], inversion={**SEEDS[1]["inversion"],
                                                "ig": {"error": "out of memory"}})]
  assert pooling.pooled(broken)["inversion"]["ig"] == {"error": "out of memory"}


def test_seeds_whose_attacks_scored_other_victims_have_no_pooled_interval():
  ragged = [SEEDS[0], dict(SEEDS[1], inversion={**SEEDS[1]["inversion"]})]
  masked = dict(ragged[1]["inversion"]["ig_masked"])
  masked["victims"] = {"clients": [0, 1], "ssim": [0.1, 0.2], "psnr": [1.0, 2.0]}
  ragged[1]["inversion"]["ig_masked"] = masked
  got = pooling.leakage_intervals(pooling.pooled(ragged), ["ig", "ig_masked"])
  assert got == {"victims": None, "ssim_ci": None, "psnr_ci": None}


def test_the_pooled_balanced_rate_is_scikit_learns_with_the_draws_as_weights():
  truth = np.array([0, 0, 1, 1, 1, 2])
  guessed = np.array([0, 1, 1, 1, 0, 2])
  weights = np.array([[1, 0, 2, 1, 0, 2], [0, 3, 1, 0, 2, 0], [1, 1, 1, 1, 1, 1]],
                     np.float64)
  got = pooling._balanced(weights, guessed, truth)
  # scikit-learn's balanced accuracy over the classes drawn, each unit as
  # often as drawn
  for row, value in zip(weights, got):
    drawn = row > 0
    assert value == pytest.approx(balanced_accuracy_score(
        truth[drawn], guessed[drawn], sample_weight=row[drawn]))
