"""The Adult Income source against pandas reading the same UCI files, a
hand-checked fixture in the UCI format, and a run on it."""

import numpy as np
import pandas as pd
import pytest

from tff_privacy import runner
from tff_privacy.data import adult, sources

FIXTURE = """\
39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, 40, United-States, <=50K
50, ?, 83311, Masters, 14, Married-civ-spouse, ?, Husband, Black, Female, 0, 0, 80, ?, >50K
"""


def test_a_uci_fixture_is_encoded_by_hand(tmp_path):
  path = tmp_path / "adult.test"
  path.write_text("|1x3 Cross validator\n" + FIXTURE.replace("K\n", "K.\n"))
  records = adult.read_records(str(path))
  x, y, attributes = adult.encode(records)
  names = adult.feature_names(records)
  assert x.shape == (2, len(names)) and list(y) == [0, 1]
  row = dict(zip(names, x[1]))
  assert row["age"] == pytest.approx(50 / 50) and row["hours-per-week"] == 1.0
  assert row["capital-gain"] == 0 and x[0, names.index("capital-gain")] == 1.0
  assert not x[:, names.index("capital-loss")].any()  # all 0: divided by 1
  assert row["education=Masters"] == 1 and row["education=Bachelors"] == 0
  assert not any(v for n, v in row.items() if n.startswith(("workclass=", "occupation=",
                                                            "native-country=")))
  assert attributes["race"].tolist() == [0, 3] and attributes["sex"].tolist() == [1, 0]


def test_a_sensitive_attribute_outside_its_classes_is_named(tmp_path):
  path = tmp_path / "adult.data"
  path.write_text(FIXTURE.replace("Black", "Martian"))
  with pytest.raises(ValueError, match=r"adult: race values \['Martian'\] are not among"):
    adult.encode(adult.read_records(str(path)))


def test_the_loaded_arrays_are_read_only_and_a_load_splits_copies():
  first, second = sources.load_source("adult"), sources.load_source("adult")
  first.x_train[0, 0] = 7.0  # the split is the caller's own copy (inputs are in [0, 1])
  assert second.x_train[0, 0] <= 1.0
  with pytest.raises(ValueError, match="read-only"):
    sources._adult_arrays()[0][0, 0] = 0


def test_adult_matches_pandas_on_the_uci_files():
  source = sources.load_source("adult")
  frames = [pd.read_csv(p, names=list(adult.COLUMNS), skipinitialspace=True,
                        skiprows=1 if p.endswith(".test") else 0)
            for p in adult.data_files()]
  frame = pd.concat(frames, ignore_index=True)
  x = np.concatenate([source.x_train, source.x_test])
  assert len(frame) == len(x) == 48842 and x.shape[1] == 103  # the paper's inputs
  income = frame["income"].str.rstrip(".")
  assert (source.y_train.sum() + source.y_test.sum()) == (income == ">50K").sum()
  assert abs(source.y_train.mean() - source.y_test.mean()) < 1e-3  # stratified
  assert len(source.y_test) == round(0.2 * (income == ">50K").sum()) + round(
      0.2 * (income != ">50K").sum())
  for name, classes in adult.ATTRIBUTE_CLASSES.items():
    counts = np.bincount(np.concatenate([source.attributes.train[name],
                                         source.attributes.test[name]]),
                         minlength=len(classes))
    assert counts.tolist() == [int((frame[name] == c).sum()) for c in classes]
  dummies = pd.get_dummies(frame[list(adult.CATEGORICAL)].replace("?", np.nan))
  assert dummies.shape[1] + len(adult.NUMERIC) == 103
  assert x[:, len(adult.NUMERIC):].sum() == dummies.to_numpy().sum()
  for column in adult.NUMERIC:
    assert x[:, adult.NUMERIC.index(column)].sum() == pytest.approx(
        (frame[column] / frame[column].max()).sum(), rel=1e-5)


@pytest.mark.slow
def test_a_fedsgd_run_on_adult_trains_the_papers_model(tmp_path):
  config = runner.RunConfig(out=str(tmp_path), method="fedsgd", dataset="adult",
                            model="mlp", model_kwargs={"hidden": [50]}, clients=20,
                            rounds=3, batch_size=64,
                            method_kwargs={"server_learning_rate": 1.0})
  history = runner.run(config, progress=False)
  assert history[-1]["test_loss"] < history[0]["test_loss"] < 0.25
  assert 0.5 < history[-1]["test_accuracy"] <= 1
