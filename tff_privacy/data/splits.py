"""Split files: a federation given as each client's train and test indices.

A split file is a JSON object

```json
{"clients": [{"train": [3, 17, 20], "test": [5, 8]},
             {"train": [0, 4], "test": [1]}]}
```

whose client k holds the samples `train` of the data set's training arrays
and `test` of its test arrays (indices into `Source.x_train` and
`Source.x_test`). Every client needs training samples; a client without
test samples is left out of the personalised metrics (the runner counts
it in `clients_without_test_data`). A partition names one as
'file:SPLIT.json'.
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional, Sequence

import numpy as np

from tff_privacy import io

PREFIX = "file:"  # a partition 'file:SPLIT.json' reads SPLIT.json
EXAMPLE = '{"clients": [{"train": [3, 17], "test": [5]}, ...]}'


def path_of(partition: str) -> Optional[str]:
  """The split file that `partition` names ('file:S.json' -> 'S.json'), or
  None for a partition that is not a split file."""
  if not partition.startswith(PREFIX):
    return None
  path = partition[len(PREFIX):]
  if not path:
    raise ValueError(f"partition={partition!r}: name the split file, e.g. "
                     f"'{PREFIX}split.json'")
  return path


def read(path: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Each client's train indices and test indices, from split file `path`.

  Raises:
    ValueError: in one line naming the file (and the client) if the file
      cannot be read, is not a split file, or a client has no training
      samples, a negative or non-integer index, or an index twice in a list.
  """
  try:
    with open(path, "rb") as f:
      content = json.loads(f.read())
  except OSError as e:
    raise ValueError(f"split file {path}: cannot be read ({e.strerror})") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"split file {path}: not valid JSON ({e})") from None
  clients = content.get("clients") if isinstance(content, dict) else None
  if not isinstance(clients, list) or not clients:
    raise ValueError(f"split file {path}: must hold a JSON object with a "
                     f"non-empty list of clients, like {EXAMPLE}")
  train, test = [], []
  for k, client in enumerate(clients):
    if not isinstance(client, dict) or set(client) != {"train", "test"}:
      raise ValueError(f"split file {path}: client {k} must be an object with "
                       f"the lists 'train' and 'test' only, like {EXAMPLE}")
    train.append(_indices(path, k, "train", client["train"]))
    test.append(_indices(path, k, "test", client["test"]))
    if not len(train[-1]):
      raise ValueError(f"split file {path}: client {k} has no training samples")
  return train, test


def _indices(path: str, client: int, split: str, values) -> np.ndarray:
  """A client's index list as int64, checked."""
  if not isinstance(values, list) or not all(
      isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
    raise ValueError(f"split file {path}: client {client}'s {split} must be a "
                     "list of indices >= 0")
  out = np.asarray(values, dtype=np.int64)
  if len(np.unique(out)) != len(out):
    raise ValueError(f"split file {path}: client {client}'s {split} lists an "
                     "index more than once")
  return out


def describe(path: str) -> tuple[int, str]:
  """(number of clients, SHA-256 of the file) of split file `path`, read
  and checked (`read`)."""
  return len(read(path)[0]), io.sha256(path)


def check_indices(path: str, train: Sequence[np.ndarray],
                  test: Sequence[np.ndarray], train_size: int,
                  test_size: int) -> None:
  """Refuses an index outside the data set's train or test arrays,
  naming the client."""
  for split, parts, size in (("train", train, train_size),
                             ("test", test, test_size)):
    for k, idx in enumerate(parts):
      if len(idx) and idx.max() >= size:
        raise ValueError(f"split file {path}: client {k}'s {split} index "
                         f"{int(idx.max())} is out of range: the data set has "
                         f"{size} {split} samples (indices 0 to {size - 1})")


def check_disjoint(where: str, names: Sequence, train_x: Sequence[np.ndarray],
                   test_x: Sequence[np.ndarray]) -> None:
  """Refuses a client whose test samples include one of its training
  samples (equal arrays), naming the client (`names`, in client order)."""
  for name, mine, tested in zip(names, train_x, test_x):
    seen = {_digest(x) for x in mine}
    if any(_digest(x) in seen for x in tested):
      raise ValueError(f"{where}: client {name!r}'s test samples include one of its "
                       "training samples; a client's train and test must not "
                       "overlap")


def _digest(x: np.ndarray) -> bytes:
  return hashlib.sha256(np.ascontiguousarray(x).tobytes()).digest()


def write(path: str, train: Sequence[np.ndarray],
          test: Sequence[np.ndarray]) -> None:
  """Writes a split file of each client's `train` and `test` indices."""
  if len(train) != len(test):
    raise ValueError(f"{len(train)} clients' train indices but {len(test)} "
                     "clients' test indices")
  io.write_json(path, {"clients": [
      {"train": [int(i) for i in a], "test": [int(i) for i in b]}
      for a, b in zip(train, test)]})
