"""benchmarks/fedre_round_time.py: its estimate of the PSI a round scores
times the run's own scoring, and reports none for a run that scores none."""

import os

from conftest import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_psi_estimate_times_what_the_run_scores_and_nothing_else(monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # round_timing
  bench = load_script("benchmarks/fedre_round_time.py")

  def run(**fedre_kwargs):
    return bench.config("digits", "fedre", "unused", {"epsilon": 50.0, **fedre_kwargs}, {})

  assert bench.psi_seconds(run(budget_split="even", aggregation="mean"), repeats=1) is None
  for scored in ({}, {"budget_split": "even"}, {"aggregation": "mean"}):
    assert bench.psi_seconds(run(**scored), repeats=1) > 0
