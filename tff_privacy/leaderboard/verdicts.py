"""The leaderboard report's verdicts: sentences written from each row's
numbers and their 95% intervals.

Each row shown at its default strength (and its utility-matched one in a
swept grid) gets one sentence per claim: whether the attacks that know its
defence recover more than the unaware ones, whether it leaks less than the
reference entry, whether it costs the reference's utility, and whether
attribute inference beats chance. One row is said to be above or below
another only where their intervals do not overlap; overlapping intervals
are a tie, and a number without an interval, or a leakage that is a lower
bound (its attack still improving when it stopped), is compared with
nothing.
"""

from __future__ import annotations

from typing import Optional, Sequence

from tff_privacy.leaderboard.report import _finite, _number, _with_interval

# Each attack of `tff_privacy.attacks.ATTACKS`, as a sentence names it.
ATTACK_NAMES = {
    "dlg": "DLG", "idlg": "iDLG", "ig": "Inverting Gradients", "rog": "ROG",
    "ig_body": "Inverting Gradients on the extractor",
    "ig_hyperfl": "Inverting Gradients on the hypernetwork",
    "tailored_hyperfl": "the tailored HyperFL attack",
    "ig_masked": "masked Inverting Gradients",
    "ig_noise_aware": "noise-aware Inverting Gradients",
    "ig_denoised": "denoised Inverting Gradients"}
SSIM_DIGITS, UTILITY_DIGITS, ASR_DIGITS = 3, 4, 2


def verdicts(rows: Sequence[dict], reference: str) -> list[str]:
  """The sentences the numbers of `rows` (`report.table_rows`) support for
  each row at its default or utility-matched strength, compared with the
  default row of entry `reference` (none where it has no finished row)."""
  ref = next((r for r in rows if r["entry"] == reference and r["default"]), None)
  found = [] if ref else [f"{reference} (the reference) has no finished row at its "
                          "default strength: no row is compared with it."]
  for r in rows:
    if r["default"] or r["matched"]:
      other = None if ref is None or ref["key"] == r["key"] else ref
      found += _leakage_claims(r, other)
      found += [_utility_claim(r, other)] if other else []
      found += _attribute_claim(r)
  return found


def _leakage_claims(r: dict, ref: Optional[dict]) -> list[str]:
  """`r`'s sentences on leakage: its adaptive attacks against its unaware
  ones, and its leakage against `ref`'s (none for None); one sentence
  instead where it has no leakage or a lower bound."""
  if r["ssim"] is None:
    return [f"{r['label']}: no inversion attack scored its uploads: no leakage verdict."]
  if r["attack_converged"] is False:
    return [f"{r['label']}: its leakage, SSIM {_ssim(r, 'ssim')} by "
            f"{_attack(r['attack'])}, is a lower bound (the attack was still "
            "improving when it stopped): no leakage comparison is claimed."]
  claims = [_adaptive_claim(r)] if r["adaptive"] else []
  if ref is not None and ref["attack_converged"] is False:
    claims.append(f"{r['label']}: {ref['label']}'s leakage is a lower bound: no "
                  "leakage comparison with it is claimed.")
  elif ref is not None:
    claims.append(_compared(
        r["label"], "SSIM", SSIM_DIGITS, _pair(r, "ssim"), _pair(ref, "ssim"),
        f" for {ref['label']}", (f"leaks more than {ref['label']}",
         f"leaks as much as {ref['label']} within the intervals",
         f"leaks less than {ref['label']}")))
  return claims


def _utility_claim(r: dict, ref: dict) -> str:
  """Whether `r` costs `ref`'s utility beyond both intervals; no order
  between two kinds of utility."""
  if r["utility_kind"] != ref["utility_kind"]:
    return (f"{r['label']}: its utility ({r['utility_kind']}) is another "
            f"measurement than {ref['label']}'s ({ref['utility_kind']}): no order "
            "is claimed.")
  return _compared(
      r["label"], r["utility_kind"], UTILITY_DIGITS, _pair(r, "utility"),
      _pair(ref, "utility"), f" for {ref['label']}",
      (f"has higher utility than {ref['label']}",
       f"keeps {ref['label']}'s utility within the intervals", "costs utility"))


def _adaptive_claim(r: dict) -> str:
  """Whether `r`'s attacks that know its defence recover more than its
  unaware attacks: beyond both intervals, within them, or (the worst
  attack being unaware) not at all."""
  scored = {a: r.get(f"ssim_{a}") for a in r["adaptive"] if _finite(r.get(f"ssim_{a}"))}
  if not scored:
    return (f"{r['label']}: no attack that knows its defence scored its uploads: "
            "its leakage is the unaware attacks' only, a lower bound.")
  if r["attack"] not in scored:
    best = max(scored, key=scored.get)
    return (f"{r['label']}: {_attack(best)} does no better than the unaware attacks "
            f"(SSIM {_number(scored[best], SSIM_DIGITS)} against "
            f"{_ssim(r, 'unaware_ssim')} unaware).")
  tie = (f"{_attack(r['attack'])} does no better than the unaware attacks within "
         "the intervals")
  return _compared(
      r["label"], "SSIM", SSIM_DIGITS, _pair(r, "ssim"), _pair(r, "unaware_ssim"),
      " unaware", (f"{_attack(r['attack'])} recovers what the unaware attacks do not",
                   tie, tie))


def _attribute_claim(r: dict) -> list[str]:
  """Whether the best adversary's balanced ASR beats chance beyond its
  interval; none where attribute inference did not run."""
  value, interval = r["balanced_asr_max"], r["balanced_asr_max_ci"]
  if value is None:
    return []
  numbers = (f"balanced ASR {_with_interval(value, interval, ASR_DIGITS)} against "
             f"chance {r['balanced_chance']:.2f}")
  if interval is None:
    return [f"{r['label']}: {numbers}: without an interval, no comparison with "
            "chance is claimed."]
  if interval[0] > r["balanced_chance"]:
    return [f"{r['label']}: attribute inference beats chance ({numbers})."]
  return [f"{r['label']}: attribute inference does no better than chance within "
          f"the interval ({numbers})."]


def _compared(label: str, quantity: str, digits: int, mine: tuple, theirs: tuple,
              whose: str, words: tuple[str, str, str]) -> str:
  """`label`'s sentence comparing `mine` with `theirs`, each (value, its
  interval or None): words[0] where mine's interval lies wholly above
  theirs, words[1] where the two overlap, words[2] wholly below, an order
  with the difference of the values; no order where either lacks a value
  or an interval."""
  (a, a_ci), (b, b_ci) = mine, theirs
  numbers = (f"{quantity} {_with_interval(a, a_ci, digits)} against "
             f"{_with_interval(b, b_ci, digits)}{whose}")
  if not (_finite(a) and _finite(b)) or a_ci is None or b_ci is None:
    return f"{label}: {numbers}: without intervals on both sides, no order is claimed."
  if a_ci[0] <= b_ci[1] and a_ci[1] >= b_ci[0]:
    return f"{label}: {words[1]} ({numbers})."
  # an order: by how much, since intervals as narrow as 1.000 [1.000, 1.000]
  # order differences too small to matter
  word = words[0] if a_ci[0] > b_ci[1] else words[2]
  return f"{label}: {word}, by {_number(abs(a - b), digits)} ({numbers})."


def _pair(r: dict, field: str) -> tuple:
  """(`field` of row `r`, its interval `field`_ci)."""
  return r[field], r[f"{field}_ci"]


def _ssim(r: dict, field: str) -> str:
  return _with_interval(*_pair(r, field), SSIM_DIGITS)


def _attack(name: str) -> str:
  """Attack `name` as a sentence names it, with its registry name."""
  return f"{ATTACK_NAMES.get(name, name)} ({name})"
