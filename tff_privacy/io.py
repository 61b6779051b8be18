"""Atomic file writing: a reader never sees a half-written result."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import tempfile
from typing import Any, Iterator, Sequence

import numpy as np


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
  """Yields a temporary path beside `path`; renames it onto `path` on success."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-",
                             suffix=os.path.splitext(path)[1])
  os.close(fd)
  try:
    yield tmp
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_json(path: str, data: Any) -> None:
  with atomic_path(path) as tmp:
    with open(tmp, "w") as f:
      json.dump(data, f, indent=2, sort_keys=False)
      f.write("\n")


def write_text(path: str, text: str) -> None:
  with atomic_path(path) as tmp:
    with open(tmp, "w") as f:
      f.write(text)


def write_csv(path: str, rows: Sequence[dict[str, Any]],
              columns: Sequence[str]) -> None:
  """One row per dict, `columns` as the header; other keys are left out."""
  with atomic_path(path) as tmp:
    with open(tmp, "w", newline="") as f:
      writer = csv.DictWriter(f, list(columns), extrasaction="ignore")
      writer.writeheader()
      writer.writerows(rows)


def canonical(data: Any) -> Any:
  """`data` as it reads back from JSON (tuples become lists, keys strings),
  so that a value compares equal to its saved copy."""
  return json.loads(json.dumps(data))


def read_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


def write_npz(path: str, arrays: dict[str, np.ndarray]) -> str:
  """Writes `arrays` with `np.savez` (no pickled objects); returns its SHA-256."""
  for name, value in arrays.items():
    if np.asarray(value).dtype == object:
      raise ValueError(f"array {name!r} has dtype object, which npz cannot hold "
                       "without pickling")
  with atomic_path(path) as tmp:
    with open(tmp, "wb") as f:
      np.savez(f, **arrays)
  return sha256(path)


def sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()
