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


def test_graph_flops_counts_inside_the_functions_a_graph_calls(monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
  import tensorflow as tf
  round_timing = load_script("benchmarks/round_timing.py")
  specs = (tf.TensorSpec([2, 3]), tf.TensorSpec([3, 4]))
  inner = tf.function(tf.matmul)
  # a [2, 3] x [3, 4] product: 2 x 4 outputs of 3 multiplications and 3 additions
  assert round_timing.graph_flops(tf.matmul, *specs) == 48
  assert round_timing.graph_flops(lambda a, b: inner(a, b), *specs) == 48


def test_round_flops_count_the_jvps_the_run_scores(monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
  bench = load_script("benchmarks/fedre_round_time.py")

  def flops(**fedre_kwargs):
    return bench.round_flops(bench.config("digits", "fedre", "unused",
                                          {"epsilon": 50.0, **fedre_kwargs}, {}))

  training, psi, least = flops()
  assert training > 0 and psi > least > 0
  # the compact row scores 2 own and 2 public samples at psi_pixels JVPs each
  assert flops(psi_pixels=4)[2] * 2 == least
  assert flops(budget_split="even", aggregation="mean") == (training, 0, 0)
