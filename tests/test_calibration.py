"""Calibration to a target epsilon (`tff_privacy.dp.calibration`) and the
leaderboard's equal-epsilon rows made with it (`board.calibrate`)."""

import dataclasses

import dp_accounting
import pytest

from tff_privacy.dp import calibration
from tff_privacy.leaderboard import board, grid

# 8x8 digits, 10 classes: the MLP has 64 x 8 + 8 + 8 x 10 + 10 = 610 weights
GRID = {
    "protocol": {"dataset": "digits", "model": "mlp", "model_kwargs": {"hidden": [8]},
                 "clients": 10, "clients_per_round": 5, "rounds": 3, "batch_size": 2},
    "attacks": {"inversion": ["ig"], "iterations": 2, "victims": 2, "attribute": None},
    "entries": [
        {"name": "FedSGD", "method": "fedsgd"},
        {"name": "LDP Gaussian", "method": "fedsgd", "defense": "ldp_gaussian",
         "defense_kwargs": {"clip": 1.0}, "sweep": {"noise_multiplier": [1.0]}},
        {"name": "LDP-Fed", "method": "fedsgd", "defense": "ldp_fed",
         "sweep": {"alpha": [1.0]}},
        {"name": "DP-FedAvg", "method": "fedavg", "defense": "dp_fedavg",
         "defense_kwargs": {"clip": 1.0}, "sweep": {"noise_multiplier": [1.0]}},
        {"name": "Sparse", "method": "fedsgd", "defense": "sparsification",
         "sweep": {"p": [0.9]}}],
}
Rel = dp_accounting.NeighboringRelation


def _quiet(_):
  pass


def _rdp_epsilon(event, relation, rounds: int, delta: float) -> float:
  accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
  accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
  return accountant.get_epsilon(delta)


def _with_entries(*names, **changes):
  return grid.parse({**GRID, **changes, "entries": [
      e for e in GRID["entries"] if e["name"] in names]})


@pytest.mark.slow
def test_each_calibrated_strength_spends_the_target_by_dp_accounting_directly(tmp_path):
  # at delta 1e-6, not the runs' default 1e-5
  calibrated = board.calibrate(grid.parse({**GRID, "equal_epsilon": {
      "epsilon": 8, "delta": 1e-6}}), str(tmp_path), log=_quiet)
  found = calibrated.calibration
  # LDP Gaussian: a clipped upload moves by up to 2C, so each round is the
  # Gaussian mechanism of multiplier z / 2
  z = found["LDP Gaussian"]["strength"]
  assert _rdp_epsilon(dp_accounting.GaussianDpEvent(z / 2), Rel.ADD_OR_REMOVE_ONE,
                      3, 1e-6) == pytest.approx(8, rel=0.01)
  # DP-FedAvg: 5 of 10 clients drawn without replacement; replacing one
  # client moves the clipped sum by up to 2C
  z = found["DP-FedAvg"]["strength"]
  sampled = dp_accounting.SampledWithoutReplacementDpEvent(
      10, 5, dp_accounting.GaussianDpEvent(z / 2))
  assert _rdp_epsilon(sampled, Rel.REPLACE_ONE, 3, 1e-6) == pytest.approx(8, rel=0.01)
  assert found["DP-FedAvg"]["delta"] == 1e-6
  # LDP-Fed (epsilon grows with alpha): each of the 610 entries spends alpha
  # x its range in output units (2 x clip 0.05 x 10^3), summed over 3 rounds
  assert 3 * 610 * found["LDP-Fed"]["strength"] * 100 == pytest.approx(8, rel=0.01)
  assert found["LDP-Fed"]["delta"] == 0  # pure DP
  # sparsification gives no DP guarantee: no row
  assert found["Sparse"]["strength"] is None and "error" not in found["Sparse"]
  assert "FedSGD" not in found  # not swept

  rows = {r.key: r for r in calibrated.rows() if r.equal_epsilon}
  assert list(rows) == ["ldp-gaussian__eps-8", "ldp-fed__eps-8", "dp-fedavg__eps-8"]
  gaussian = rows["ldp-gaussian__eps-8"]
  assert gaussian.strength == found["LDP Gaussian"]["strength"]
  assert gaussian.defense_kwargs == {"clip": 1.0, "noise_multiplier": gaussian.strength}
  assert gaussian.protocol["dp_delta"] == 1e-6 and not gaussian.is_default
  assert gaussian.label == f"LDP Gaussian at epsilon 8 (noise_multiplier={gaussian.strength:g})"
  # the calibrated strength is one of the row's settings: a cached row
  # made at another strength is not reused
  assert gaussian.settings()["strength"] == gaussian.strength
  assert found["DP-FedAvg"]["relation"].startswith("central DP, user level")


def test_the_calibration_is_made_once_recorded_and_read_back(tmp_path, monkeypatch):
  small = _with_entries("FedSGD", "LDP Gaussian")
  out = str(tmp_path)
  first = board.calibrate(small, out, log=_quiet)
  assert [r.key for r in small.rows()] == ["fedsgd", "ldp-gaussian__noise-multiplier-1"]

  def no_accounting(*args, **kwargs):
    raise AssertionError("calibrated again")

  monkeypatch.setattr(board, "privacy_at", no_accounting)
  assert board.calibrate(small, out, log=_quiet) == first
  ran = []
  monkeypatch.setattr(board, "_timed_row", lambda row, *a, **k: (ran.append(row.key) or {}, 0.0))
  board.run(small, out, progress=False, log=_quiet)
  assert ran == [r.key for r in first.rows()] == [
      "fedsgd", "ldp-gaussian__noise-multiplier-1", "ldp-gaussian__eps-8"]
  # the report's grid carries the same rows
  assert board.read(out)[0].rows() == first.rows()
  # another target is calibrated anew
  other = dataclasses.replace(small, equal_epsilon={"epsilon": 4.0, "delta": 1e-5})
  assert board.calibrated(other, out).rows() == small.rows()
  with pytest.raises(AssertionError, match="calibrated again"):
    board.calibrate(other, out, log=_quiet)


@pytest.mark.parametrize("epsilon_at, start, message", [
    (lambda s: 5.0, 1.0, "entry 'A': no strength in [1e-10, 1e+10] reaches epsilon 8 "
     "(epsilon 5 at 1, 5 at 2)"),
    # the jump is at 1: the search ends within 0.1% of it
    (lambda s: 10.0 if s < 1 else 1.0, 0.5, "entry 'A': epsilon jumps over 8 near "
     "strength 0.99"),
    (lambda s: 1 / s if s > 0.2 else None, 1.0, "entry 'A': the search reached "
     "strength 0.125, where epsilon is None"),
    (lambda s: 1.0, "l2", "entry 'A': the target epsilon and the start strength "
     "must be numbers > 0, got 8.0 and 'l2'"),
])
def test_an_unreachable_target_is_refused_in_one_line(epsilon_at, start, message):
  with pytest.raises(ValueError) as error:
    calibration.strength_for_epsilon(epsilon_at, 8.0, start, "entry 'A'")
  assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_either_direction_reaches_the_target_within_the_tolerance():
  # epsilon = 3 / s^2 falls with s (noise), 5 s grows (a budget): by hand,
  # sqrt(3 / 8) and 8e-7 / 5
  assert calibration.strength_for_epsilon(lambda s: 3 / s**2, 8.0, 1.0, "a") == \
      pytest.approx((3 / 8) ** 0.5, rel=1e-3)
  assert calibration.strength_for_epsilon(lambda s: 5 * s, 8e-7, 1.0, "b") == \
      pytest.approx(1.6e-7, rel=1e-3)


@pytest.mark.slow
def test_an_entry_no_strength_brings_to_the_target_keeps_why(tmp_path):
  # the RDP accountant's epsilon of the Gaussian mechanism at delta 1e-5
  # drops from 0.0035 to 0 past a noise multiplier of about 2.6e5: no
  # multiplier spends 1e-3 within 1%
  found = board.calibrate(_with_entries("FedSGD", "LDP Gaussian", equal_epsilon={
      "epsilon": 1e-3}), str(tmp_path), log=_quiet).calibration["LDP Gaussian"]
  assert found["strength"] is None
  assert found["error"].startswith("entry 'LDP Gaussian': epsilon jumps over 0.001")
  assert "\n" not in found["error"] and found["relation"].startswith("local DP")


def test_each_mechanisms_relation_names_what_its_epsilon_protects():
  from tff_privacy.algorithms import fedre
  from tff_privacy.defenses import central, ldp_fed, updates
  from tff_privacy.dp import accounting, dp_sgd
  dp_fedavg = central.DPFedAvg(1.0, 1.0)
  expected = {dp_sgd.RELATION: "one record", fedre.SAMPLE_RELATION: "one record",
              dp_fedavg.dp_relation: "a client's data",
              dp_fedavg.round_event(10, 5).relation: "a client's data",
              updates.LOCAL_RELATION: "one upload",
              ldp_fed.LDPFed.dp_relation: "one upload",
              "a relation of its own": "a relation of its own"}
  assert {r: accounting.protected(r) for r in expected} == expected
