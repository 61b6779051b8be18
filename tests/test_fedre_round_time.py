"""benchmarks/fedre_round_time.py: its estimate of the PSI a round scores
times the run's own scoring, and reports none for a run that scores none;
its operation counts (and `round_timing.graph_flops`'s) count what the run
computes; benchmarks/psi_tangent_support.py's shares and multiply-adds
are the hand-counted ones."""

import os

import pytest

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


def test_graph_flops_counts_inside_called_functions_what_the_outputs_need(monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
  import tensorflow as tf
  round_timing = load_script("benchmarks/round_timing.py")
  specs = (tf.TensorSpec([2, 3]), tf.TensorSpec([3, 4]))
  inner = tf.function(tf.matmul)
  # a [2, 3] x [3, 4] product: 8 outputs, each of 3 products and their sum,
  # which TensorFlow counts as 2 x 3 operations
  assert round_timing.graph_flops(tf.matmul, *specs) == 48
  assert round_timing.graph_flops(lambda a, b: inner(a, b), *specs) == 48

  def unused_product(a, b):
    tf.matmul(a, b)
    return a + 1.0  # 6 additions

  assert round_timing.graph_flops(unused_product, *specs) == 6

  def two_products(a, b):  # the second does not depend on a
    return tf.matmul(a, b) + tf.matmul(tf.ones([2, 3]), b)

  assert round_timing.graph_flops(two_products, *specs) == 48 + 48 + 8
  assert round_timing.graph_flops(two_products, *specs, depending_on=0) == 48 + 8
  # an input after a structure of inputs: its place among the flat inputs
  def three_products(pair, b):  # two depend on b, and both sums
    return (tf.matmul(pair[0], b) + tf.matmul(pair[1], tf.ones([3, 4]))
            + tf.matmul(tf.ones([2, 3]), b))

  assert round_timing.graph_flops(three_products, [specs[0]] * 2, specs[1],
                                  depending_on=1) == 48 + 48 + 8 + 8


def test_what_depends_on_the_tangent_is_what_a_vectorised_map_repeats(monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
  import tensorflow as tf
  from tff_privacy import psi, runner
  bench = load_script("benchmarks/fedre_round_time.py")
  round_timing = load_script("benchmarks/round_timing.py")
  spec = runner.Run(bench.config("digits", "fedre", "unused", {"epsilon": 50.0}, {})).spec
  model = spec.keras()
  specs = ([tf.TensorSpec(v.shape) for v in model.trainable_variables],
           tf.TensorSpec(spec.input_shape), tf.TensorSpec([], tf.int32))

  def jvp(w, x1, y1, triple):
    return psi.pixel_jvp_squares(model, w, x1, y1, triple, spec.task_object.loss)

  def jvps(k):  # k JVPs as psi_scores runs them: TensorFlow's own vectorised map
    return round_timing.graph_flops(
        lambda w, x1, y1, triples: tf.vectorized_map(lambda t: jvp(w, x1, y1, t),
                                                     triples),
        *specs, tf.TensorSpec([k, 3], tf.int32))

  per_jvp = round_timing.graph_flops(jvp, *specs, tf.TensorSpec([3], tf.int32),
                                     depending_on=3)
  assert jvps(4) - jvps(2) == 2 * per_jvp > 0


def test_round_flops_count_the_jvps_the_run_scores(monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
  bench = load_script("benchmarks/fedre_round_time.py")

  def flops(**fedre_kwargs):
    return bench.round_flops(bench.config("digits", "fedre", "unused",
                                          {"epsilon": 50.0, **fedre_kwargs}, {}))

  training, psi, dense = flops()
  assert training > 0 and psi > 0 and dense > 0
  # the compact row scores 2 of the client's samples and PDA-PAM 2 public
  # ones, each at psi_pixels (8) JVPs
  assert flops(aggregation="mean")[2] * 2 == dense
  assert flops(psi_samples=1)[2] * 4 == dense * 3
  assert flops(psi_pixels=4)[2] * 2 == dense
  assert flops(budget_split="even", aggregation="mean") == (training, 0, 0)


def test_tangent_supports_and_multiply_adds_by_hand(monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
  import tensorflow as tf
  bench = load_script("benchmarks/psi_tangent_support.py")
  layers = tf.keras.layers
  # 5 x 5 outputs of a 3 x 3 kernel, 1 channel in and out; 3 x 3 x 4
  # outputs of a 3 x 3 kernel over 2 channels; 2 x 5 positions of 4 x 3
  assert bench.multiply_adds(layers.Conv2D(1, 3, padding="same"), (5, 5, 1)) == 25 * 9
  assert bench.multiply_adds(layers.Conv2D(4, 3, strides=2), (7, 7, 2)) == 36 * 9 * 2
  assert bench.multiply_adds(layers.Dense(3), (2, 5, 4)) == 10 * 12
  model = tf.keras.Sequential([
      layers.InputLayer((5, 5, 1)),
      layers.Conv2D(1, 3, padding="same", kernel_initializer="ones", name="spread"),
      layers.Conv2D(1, 1, kernel_initializer="ones", name="pointwise")])
  weights = [tf.convert_to_tensor(w) for w in model.trainable_variables]
  loss = lambda outputs, labels: 0.5 * tf.reduce_sum(tf.square(outputs))
  x1 = tf.random.stateless_uniform((5, 5, 1), (0, 1), 0.1, 1.0)

  def shares(layer):
    spatial, bias = bench.with_spatial_bias(model, weights, layer, (5, 5, 1))
    f, s = bench.nonzero_shares(model, spatial, loss, layer.name, bias, x1,
                                tf.constant(0), tf.constant([2, 2, 0]))
    return float(f), float(s)

  # The one-hot tangent reaches the 3 x 3 square around the centre after the
  # first layer. The loss gradient at the output is the output, and the
  # pointwise layer passes it back as it is: its tangent fills that square
  # at both layers' outputs.
  spread, pointwise = model.layers
  assert shares(spread) == pytest.approx((1 / 25, 9 / 25))  # float32 means
  assert shares(pointwise) == pytest.approx((9 / 25, 9 / 25))
  assert not bench.depends_on_weights(model, weights, "spread", x1[None])
  assert bench.depends_on_weights(model, weights, "pointwise", x1[None])
