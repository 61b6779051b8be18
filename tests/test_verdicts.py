"""The report's verdicts on hand-made rows: disjoint intervals ordered,
overlapping ones tied, no order without intervals on both sides or with a
lower bound, and the sentences' numbers the rows' own, formatted by hand."""

from tff_privacy import attacks
from tff_privacy.leaderboard import board, grid, report
from tff_privacy.leaderboard.verdicts import ATTACK_NAMES, verdicts

MASKED = "masked Inverting Gradients (ig_masked)"


def _row(label: str, **changes) -> dict:
  """A table row (`report.table_rows`'s fields that verdicts read) of
  FedSGD-like numbers, with `changes`."""
  return {"key": label, "label": label, "entry": label, "default": True,
          "matched": False, "utility": 0.9, "utility_ci": [0.88, 0.92],
          "utility_kind": "test accuracy", "attack": "ig", "ssim": 0.9,
          "ssim_ci": [0.85, 0.95], "attack_converged": True, "ssim_ig": 0.9,
          "unaware_attack": "ig", "unaware_ssim": 0.9, "unaware_ssim_ci": [0.85, 0.95],
          "adaptive": [], "balanced_asr_max": None, "balanced_asr_max_ci": None,
          "balanced_chance": None, **changes}


def _sparse(**changes) -> dict:
  """A sparsified row whose adaptive attack ig_masked is the worst."""
  return _row("Sparse (p=0.9)", **{
      "entry": "Sparse", "adaptive": ["ig_masked"], "attack": "ig_masked",
      "ssim_ig_masked": 0.71234, "ssim_ig": 0.31, "ssim": 0.71234,
      "ssim_ci": [0.60449, 0.80051],
      "unaware_ssim": 0.31, "unaware_ssim_ci": [0.2012, 0.3987],
      "utility": 0.61237, "utility_ci": [0.55551, 0.66649],
      "balanced_asr_max": 0.8149, "balanced_asr_max_ci": [0.7012, 0.9049],
      "balanced_chance": 0.5, **changes})


def test_disjoint_intervals_are_ordered_with_the_rows_numbers():
  found = verdicts([_row("FedSGD"), _sparse()], "FedSGD")
  assert found == [
      # the differences by hand: 0.71234 - 0.31, 0.9 - 0.71234, 0.9 - 0.61237
      f"Sparse (p=0.9): {MASKED} recovers what the unaware attacks do not, by 0.402 "
      "(SSIM 0.712 [0.604, 0.801] against 0.310 [0.201, 0.399] unaware).",
      "Sparse (p=0.9): leaks less than FedSGD, by 0.188 (SSIM 0.712 [0.604, 0.801] "
      "against 0.900 [0.850, 0.950] for FedSGD).",
      "Sparse (p=0.9): costs utility, by 0.2876 (test accuracy 0.6124 [0.5555, 0.6665] "
      "against 0.9000 [0.8800, 0.9200] for FedSGD).",
      "Sparse (p=0.9): attribute inference beats chance (balanced ASR 0.81 "
      "[0.70, 0.90] against chance 0.50)."]


def test_overlapping_intervals_are_tied():
  # each interval touches or crosses the other side's
  found = verdicts([_row("FedSGD"), _sparse(
      ssim_ci=[0.6, 0.86], unaware_ssim_ci=[0.2, 0.6], utility_ci=[0.55, 0.88],
      balanced_asr_max_ci=[0.49, 0.9])], "FedSGD")
  assert found == [
      f"Sparse (p=0.9): {MASKED} does no better than the unaware attacks within "
      "the intervals (SSIM 0.712 [0.600, 0.860] against 0.310 [0.200, 0.600] unaware).",
      "Sparse (p=0.9): leaks as much as FedSGD within the intervals (SSIM 0.712 "
      "[0.600, 0.860] against 0.900 [0.850, 0.950] for FedSGD).",
      "Sparse (p=0.9): keeps FedSGD's utility within the intervals (test accuracy "
      "0.6124 [0.5500, 0.8800] against 0.9000 [0.8800, 0.9200] for FedSGD).",
      "Sparse (p=0.9): attribute inference does no better than chance within the "
      "interval (balanced ASR 0.81 [0.49, 0.90] against chance 0.50)."]


def test_a_row_above_the_reference_beyond_the_intervals_is_said_to_be():
  found = verdicts([_row("FedSGD"), _sparse(
      ssim=0.99, ssim_ci=[0.96, 0.999], utility=0.95, utility_ci=[0.93, 0.97])],
      "FedSGD")
  assert "Sparse (p=0.9): leaks more than FedSGD, by 0.090 (SSIM 0.990 [0.960, 0.999] " \
         "against 0.900 [0.850, 0.950] for FedSGD)." in found
  assert "Sparse (p=0.9): has higher utility than FedSGD, by 0.0500 (test accuracy 0.9500 " \
         "[0.9300, 0.9700] against 0.9000 [0.8800, 0.9200] for FedSGD)." in found


def test_without_intervals_on_both_sides_no_order_is_claimed():
  found = verdicts([_row("FedSGD", ssim_ci=None), _sparse(
      unaware_ssim_ci=None, utility_ci=None, balanced_asr_max_ci=None)], "FedSGD")
  assert found == [
      "Sparse (p=0.9): SSIM 0.712 [0.604, 0.801] against 0.310 unaware: without "
      "intervals on both sides, no order is claimed.",
      "Sparse (p=0.9): SSIM 0.712 [0.604, 0.801] against 0.900 for FedSGD: "
      "without intervals on both sides, no order is claimed.",
      "Sparse (p=0.9): test accuracy 0.6124 against 0.9000 [0.8800, 0.9200] for "
      "FedSGD: without intervals on both sides, no order is claimed.",
      "Sparse (p=0.9): balanced ASR 0.81 against chance 0.50: without an "
      "interval, no comparison with chance is claimed."]


def test_a_lower_bound_is_compared_with_nothing():
  found = verdicts([_row("FedSGD"), _sparse(attack_converged=False)], "FedSGD")
  assert found[0] == (
      f"Sparse (p=0.9): its leakage, SSIM 0.712 [0.604, 0.801] by {MASKED}, is a "
      "lower bound (the attack was still improving when it stopped): no leakage "
      "comparison is claimed.")
  assert not any("leaks" in v or "unaware" in v for v in found)
  # the reference's lower bound: nothing is compared with it either
  found = verdicts([_row("FedSGD", attack_converged=False), _sparse()], "FedSGD")
  assert "Sparse (p=0.9): FedSGD's leakage is a lower bound: no leakage " \
         "comparison with it is claimed." in found
  assert not any("leaks" in v for v in found)


def test_an_unaware_worst_attack_means_the_adaptive_one_did_no_better():
  row = _sparse(attack="ig", ssim=0.31, ssim_ci=[0.2012, 0.3987], ssim_ig_masked=0.25)
  assert verdicts([row], "FedSGD")[1] == (
      f"Sparse (p=0.9): {MASKED} does no better than the unaware attacks (SSIM "
      "0.250 against 0.310 [0.201, 0.399] unaware).")
  refused = _sparse(attack="ig", ssim_ig_masked=None)
  assert verdicts([refused], "FedSGD")[1] == (
      "Sparse (p=0.9): no attack that knows its defence scored its uploads: its "
      "leakage is the unaware attacks' only, a lower bound.")


def test_another_kind_of_utility_is_not_ordered_against_the_reference():
  found = verdicts([_row("FedSGD"), _row(
      "FedEM", utility=0.5, utility_ci=[0.4, 0.6], utility_kind="personalised accuracy")],
      "FedSGD")
  assert ("FedEM: its utility (personalised accuracy) is another measurement than "
          "FedSGD's (test accuracy): no order is claimed.") in found
  assert not any("costs" in v for v in found)


def test_only_the_shown_rows_are_judged_and_the_reference_not_against_itself():
  rows = [_row("FedSGD", balanced_asr_max=0.5, balanced_asr_max_ci=[0.4, 0.6],
               balanced_chance=0.5),
          _sparse(default=False),
          {**_sparse(default=False, matched=True), "key": "m", "label": "Sparse (p=0.5)"}]
  found = verdicts(rows, "FedSGD")
  assert found[0] == ("FedSGD: attribute inference does no better than chance "
                      "within the interval (balanced ASR 0.50 [0.40, 0.60] against "
                      "chance 0.50).")
  assert [v.split(":")[0] for v in found[1:]] == ["Sparse (p=0.5)"] * 4
  assert verdicts([_sparse()], "FedSGD")[0] == (
      "FedSGD (the reference) has no finished row at its default strength: no "
      "row is compared with it.")
  assert verdicts([_row("FedSGD", ssim=None, ssim_ci=None)], "FedSGD") == [
      "FedSGD: no inversion attack scored its uploads: no leakage verdict."]


def test_every_attack_has_a_sentence_name():
  assert set(ATTACK_NAMES) == set(attacks.ATTACKS)


def _result(row: grid.Row, ssim: dict[str, list[float]], utility: float) -> dict:
  """A finished row's result whose attacks scored victims 1, 2 and 3 with
  `ssim`."""
  return {"key": row.key, "label": row.label, "entry": row.entry,
          "is_default": row.is_default,
          "settings": {"parameter": row.parameter, "strength": row.strength},
          "utility": utility, "utility_kind": board.GLOBAL_UTILITY, "loss": 0.1,
          "samples_tested": 1000, "attribute": None, "privacy": None,
          "seconds_per_round": 1.0, "upload_bytes": 4,
          "inversion": {a: {"ssim": sum(s) / 3, "psnr": 10.0, "label_accuracy": 1.0,
                            "victims": {"clients": [1, 2, 3], "ssim": s,
                                        "psnr": [10.0] * 3}}
                        for a, s in ssim.items()}}


def test_the_report_lists_the_verdicts_after_the_table():
  tiny = grid.parse({
      "protocol": {"dataset": "mnist5k_parity", "model": "mlp"},
      "attacks": {"inversion": ["ig"], "victims": 3, "attribute": "parity",
                  "adversaries": ["svm"]},
      "reference": "FedSGD",
      "entries": [{"name": "FedSGD", "method": "fedsgd"},
                  {"name": "Clip", "method": "fedsgd", "defense": "dp_clip",
                   "defense_kwargs": {"clip": 1.0}}]})
  fedsgd, clip = tiny.rows()
  rows = report.table_rows(tiny, [_result(fedsgd, {"ig": [0.9, 0.92, 0.94]}, 0.9),
                                  _result(clip, {"ig": [0.1, 0.12, 0.14]}, 0.5)])
  text = report.markdown(tiny, rows)
  listed = text.split("## Verdicts\n")[1].split("\n## ")[0]
  assert text.index("## Every row") < text.index("## Verdicts") < text.index(
      "## Defences without a known adaptive attack")
  assert "95% intervals" in listed and "one seed per row" in listed
  assert [line[2:] for line in listed.splitlines() if line.startswith("- ")] == \
      verdicts(rows, "FedSGD")
  # SSIM 0.12 [0.10, 0.14] at most against 0.92 [0.90, 0.94] at least
  assert "- Clip: leaks less than FedSGD, by " in listed
