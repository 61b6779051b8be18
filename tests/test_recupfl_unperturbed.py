"""benchmarks/recupfl_unperturbed.py: on Adult uploads it counts the
unperturbed ones and the entries moved per pooling window, with the
library's first-maximum pooling and a tie-splitting reference of the old
pooling."""

import contextlib
import csv
import io
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from tff_privacy import data
from tff_privacy.defenses import recupfl
from tff_privacy.models import builders

from conftest import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "recupfl_unperturbed.py")
BUDGETS = (1e-3, 0.1)
VICTIMS = 4
TINY = ["--victims", str(VICTIMS), "--zoo-size", "3", "--zoo-epochs", "1",
        "--shadow-samples", "100", "--budgets", ",".join(map(str, BUDGETS)),
        "--iterations", "2", "--sampled-models", "2"]
CONFIGURATIONS = ("paper_tie_splitting", "paper_first_max", "default")


@pytest.fixture(scope="module")
def bench():
  module = load_script(SCRIPT)
  yield module
  del sys.modules[module.__name__]


@pytest.fixture(scope="module")
def run(bench, tmp_path_factory):
  """The benchmark's result, printed text and --out folder at a tiny
  setting."""
  out = tmp_path_factory.mktemp("out")
  original = recupfl._attack_gradient
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    measured = bench.main(TINY + ["--out", str(out)])
  assert recupfl._attack_gradient is original  # the reference was patched out
  return measured, printed.getvalue(), out


def _windows(vector: np.ndarray) -> list[np.ndarray]:
  """The upload's entry indices per pooling window of 1024."""
  return np.array_split(np.arange(len(vector)), 1024)


def _moved_per_window(clean, upload) -> np.ndarray:
  moved = upload != clean
  return np.array([moved[w].sum() for w in _windows(clean)])


def _row(measured, configuration, budget):
  return next(r for r in measured["rows"] if r["configuration"] == configuration
              and r["budget"] == budget)


@pytest.mark.slow
def test_victims_upload_their_records_adult_gradient(run):
  measured, _, _ = run
  victims = measured["setting"]
  source = data.load_source("adult")
  expected_records = np.random.default_rng(0).choice(len(source.y_train), VICTIMS,
                                                     replace=False)
  np.testing.assert_array_equal(victims.records, expected_records)
  np.testing.assert_array_equal(victims.labels,
                                source.attributes.train["race"][expected_records])
  model = builders.mlp((103,), 1, seed=0, hidden=(50,))  # the experiments' Adult MLP
  for record, clean in zip(expected_records, victims.clean):
    x = source.x_train[record:record + 1]
    with tf.GradientTape() as tape:
      probability = tf.sigmoid(model(x)[:, 0])
      loss = tf.reduce_mean(tf.square(probability - source.y_train[record]))
    gradient = tape.gradient(loss, model.trainable_variables)
    np.testing.assert_allclose(
        clean, np.concatenate([g.numpy().ravel() for g in gradient]),
        rtol=1e-5, atol=1e-9)


def test_default_leaves_no_upload_unperturbed(run):
  measured, _, _ = run
  clean = measured["setting"].clean
  for budget in BUDGETS:
    uploads, _ = measured["uploads"][("default", budget, "recupfl")]
    assert all(np.any(u != c) for u, c in zip(uploads, clean))
    assert _row(measured, "default", budget)["unperturbed_share"] == 0.0
  for configuration in CONFIGURATIONS:
    for budget in BUDGETS:
      uploads, _ = measured["uploads"][(configuration, budget, "recupfl")]
      unperturbed = np.mean([np.array_equal(u, c) for u, c in zip(uploads, clean)])
      assert _row(measured, configuration, budget)["unperturbed_share"] == unperturbed


@pytest.mark.parametrize("configuration", ["paper_first_max", "default"])
def test_one_step_moves_at_most_each_windows_first_maximum(run, configuration):
  measured, _, _ = run
  clean = measured["setting"].clean
  for budget in BUDGETS:
    uploads, _ = measured["uploads"][(configuration, budget, "one_step")]
    counts = []
    for c, u in zip(clean, uploads):
      for window in _windows(c):
        moved = window[u[window] != c[window]]
        assert set(moved) <= {window[np.argmax(c[window])]}
        counts.append(len(moved))
    row = _row(measured, configuration, budget)
    assert row["one_step_moved_per_window_max"] == max(counts) == 1
    assert row["one_step_moved_per_window_mean"] == pytest.approx(np.mean(counts))


def test_tie_splitting_moves_tied_maxima_several_per_window(run):
  measured, _, _ = run
  clean = measured["setting"].clean
  assert np.mean(clean == 0) > 0.5  # one record's gradient: mostly exact zeros
  for budget in BUDGETS:
    uploads, _ = measured["uploads"][("paper_tie_splitting", budget, "one_step")]
    counts = []
    for c, u in zip(clean, uploads):
      for window in _windows(c):
        moved = window[u[window] != c[window]]
        assert np.all(c[moved] == c[window].max())
        counts.append(len(moved))
    row = _row(measured, "paper_tie_splitting", budget)
    assert row["one_step_moved_per_window_max"] == max(counts) > 1
    assert row["one_step_moved_per_window_mean"] == pytest.approx(np.mean(counts))


def test_algorithm_1_rows_count_the_moved_entries_and_zero_gradients(run):
  measured, _, _ = run
  clean = measured["setting"].clean
  for configuration in CONFIGURATIONS:
    for budget in BUDGETS:
      uploads, zero_shares = measured["uploads"][(configuration, budget, "recupfl")]
      counts = np.concatenate([_moved_per_window(c, u) for c, u in zip(clean, uploads)])
      row = _row(measured, configuration, budget)
      assert row["recupfl_moved_per_window_max"] == counts.max()
      assert row["recupfl_moved_per_window_mean"] == pytest.approx(counts.mean())
      assert row["zero_gradient_steps"] == pytest.approx(np.mean(zero_shares))
      # P 2, Q 2: a share of 4 steps
      np.testing.assert_allclose(zero_shares * 4, np.round(zero_shares * 4))


def test_the_table_and_files_hold_every_row(run, bench):
  measured, printed, out = run
  lines = printed.splitlines()
  for configuration in bench.CONFIGURATIONS:
    assert sum(line.startswith(configuration.label) for line in lines) == len(BUDGETS)
  assert lines[-1].startswith("wall_s=")
  assert sorted(os.listdir(out)) == ["recupfl_unperturbed.csv",
                                     "recupfl_unperturbed.json"]
  with open(out / "recupfl_unperturbed.csv") as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == len(CONFIGURATIONS) * len(BUDGETS)
  for row, expected in zip(rows, measured["rows"]):
    assert row["configuration"] == expected["configuration"]
    for key, value in expected.items():
      if key != "configuration":
        assert float(row[key]) == pytest.approx(value)
  with open(out / "recupfl_unperturbed.json") as f:
    saved = json.load(f)
  assert saved["rows"] == measured["rows"]
  assert saved["settings"]["victims"] == VICTIMS and saved["wall_s"] > 0


def test_the_reference_splits_a_bins_gradient_over_its_tied_maxima(bench):
  w = np.array([0.5, -1.0], np.float32)
  defenders = [lambda pooled: tf.concat(
      [tf.zeros([1, 1]), tf.matmul(pooled, tf.constant(w[:, None]))], -1)]
  x = tf.constant([0, 0, 0, 2, 2, 1], tf.float32)
  indices, got = bench.tie_splitting_gradient(
      defenders, tf.constant(0), tf.reshape(x, [2, 3]), tf.constant(1), "cross_entropy")
  np.testing.assert_array_equal(indices, [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]])
  # d CE([0, s], 1) / ds = sigmoid(s) - 1 at s = w . (0, 2), shared by ties
  d = 1 / (1 + np.exp(-2 * w[1])) - 1
  expected = [d * w[0] / 3] * 3 + [d * w[1] / 2] * 2 + [0]
  np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)
  kwargs = dict(epsilon=0.01, pool_length=2, seed=tf.constant([0, 0], tf.int64),
                sampled=1, variant="one_step", attack_loss="cross_entropy")
  with bench.tie_splitting_pooling():
    tied = recupfl.attribute_perturbation(x, 1, defenders, **kwargs)
  first = recupfl.attribute_perturbation(x, 1, defenders, **kwargs)
  np.testing.assert_allclose(tied.numpy(), [-0.01] * 3 + [0.01] * 2 + [0])
  np.testing.assert_allclose(first.numpy(), [-0.01, 0, 0, 0.01, 0, 0])


@pytest.mark.parametrize("flags, message", [
    (["--budgets", "1e-3,0"], "argument --budgets: takes comma-separated finite "
     "numbers > 0, got '1e-3,0'"),
    (["--budgets", "inf"], "argument --budgets: takes comma-separated finite "
     "numbers > 0, got 'inf'"),
    (["--victims", "0"], "argument --victims: takes an integer >= 1, got '0'"),
    (["--zoo-size", "21"], "--zoo-size must be in [2, 20], got 21"),
    (["--zoo-size", "2", "--sampled-models", "3"],
     "--sampled-models must be in [2, --zoo-size 2], got 3")])
def test_a_bad_flag_is_refused_in_one_line(bench, capsys, flags, message):
  with pytest.raises(SystemExit) as exit_:
    bench.main(flags)
  assert exit_.value.code == 2
  assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {message}")


def test_too_few_shadow_records_for_every_race_are_refused_in_one_line(bench, capsys):
  with pytest.raises(SystemExit) as exit_:
    bench.main(["--victims", "1", "--shadow-samples", "50"])
  assert exit_.value.code == 2
  assert capsys.readouterr().err.splitlines()[-1].endswith(
      "error: --shadow-samples 50: the shadow records hold no race "
      "Asian-Pac-Islander, Amer-Indian-Eskimo, Other, which every defender must "
      "know; give more")


def test_more_victims_than_records_are_refused_in_one_line(bench, capsys):
  records = len(data.load_source("adult").y_train)
  with pytest.raises(SystemExit) as exit_:
    bench.main(["--victims", str(records + 1)])
  assert exit_.value.code == 2
  assert capsys.readouterr().err.splitlines()[-1].endswith(
      f"error: --victims must be at most the {records} training records, "
      f"got {records + 1}")
