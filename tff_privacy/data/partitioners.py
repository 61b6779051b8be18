"""Partitioners: split sample indices among clients."""

from __future__ import annotations

import numpy as np

PARTITIONS = ("iid", "dirichlet", "one_per_client", "label_groups", "groups")


def iid(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
  """Shuffles the samples and deals them into `num_clients` equal shares."""
  _check_clients(num_clients, len(labels))
  order = np.random.default_rng(seed).permutation(len(labels))
  return [np.sort(part) for part in np.array_split(order, num_clients)]


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float,
              seed: int, min_size: int = 1) -> list[np.ndarray]:
  """Label skew: each class is split among clients in Dir(alpha) proportions.

  Small alpha gives each client few classes; large alpha tends to IID. Draws are
  repeated (same seeded generator) until every client holds `min_size` samples.
  """
  if not alpha > 0:
    raise ValueError(f"alpha must be > 0 for the dirichlet partition, got {alpha}")
  _check_clients(num_clients, len(labels) // max(min_size, 1))
  rng = np.random.default_rng(seed)
  for _ in range(1000):
    shares = [[] for _ in range(num_clients)]
    for label in np.unique(labels):
      idx = rng.permutation(np.flatnonzero(labels == label))
      cuts = (np.cumsum(rng.dirichlet([alpha] * num_clients))[:-1]
              * len(idx)).astype(int)
      for client, part in enumerate(np.split(idx, cuts)):
        shares[client].extend(part)
    if min(len(s) for s in shares) >= min_size:
      return [np.sort(np.asarray(s, dtype=np.int64)) for s in shares]
  raise ValueError(
      f"dirichlet partition with alpha={alpha} left a client with fewer than "
      f"{min_size} samples in 1000 draws; raise alpha or lower num_clients")


def one_per_client(labels: np.ndarray, num_clients: int,
                   seed: int) -> list[np.ndarray]:
  """Gives each client exactly one distinct sample (gradient-leakage setting)."""
  _check_clients(num_clients, len(labels))
  chosen = np.random.default_rng(seed).choice(len(labels), num_clients,
                                              replace=False)
  return [np.array([i]) for i in chosen]


def label_group_sets(num_classes: int) -> list[list[int]]:
  """HyperFL's label groups (Guo et al., Sec. 5.1, the authors' loaders):
  for EMNIST's 62 classes digits, upper-case and lower-case letters; for
  other K >= 3 classes, K // 2 groups of three labels starting at every
  even label, wrapping around ([0,1,2], [2,3,4], ..., [8,9,0] for K = 10)."""
  if num_classes == 62:
    return [list(range(10)), list(range(10, 36)), list(range(36, 62))]
  if num_classes < 3:
    raise ValueError("partition='label_groups' needs a data set with >= 3 "
                     f"classes, got {num_classes}")
  return [[(2 * g + j) % num_classes for j in range(3)]
          for g in range(num_classes // 2)]


def _split_evenly(total: int, parts: int) -> list[int]:
  """`total` in `parts` equal shares, the remainder to the last (as the
  authors' loaders give it)."""
  share = total // parts
  return [share] * (parts - 1) + [total - share * (parts - 1)]


def label_groups(labels: np.ndarray, num_clients: int, samples_per_client: int,
                 seed: int, iid_fraction: float = 0.2) -> list[np.ndarray]:
  """HyperFL's non-IID split: client i holds `iid_fraction` of its samples
  spread evenly over all classes and the rest spread evenly over the labels
  of group i mod G (`label_group_sets`).

  Samples of each label are dealt in a seeded order from a running pointer
  that wraps around when the label is exhausted, as in the authors' loaders:
  clients share samples only when the data set holds fewer than they
  demand (e.g. 100 clients). Applied with the same sizes to the test set, it
  gives each client a test split drawn the same way as its training data.
  """
  if samples_per_client < 1:
    raise ValueError(f"samples_per_client must be >= 1, got {samples_per_client}")
  num_classes = int(labels.max()) + 1
  groups = label_group_sets(num_classes)
  rng = np.random.default_rng(seed)
  pools = [rng.permutation(np.flatnonzero(labels == k)) for k in range(num_classes)]
  empty = [k for k, pool in enumerate(pools) if not len(pool)]
  if empty:
    raise ValueError(f"partition='label_groups' needs samples of every class; "
                     f"classes {empty} have none")
  pointers = [0] * num_classes
  iid_total = int(round(iid_fraction * samples_per_client))
  iid_counts = _split_evenly(iid_total, num_classes)
  out = []
  for client in range(num_clients):
    group = groups[client % len(groups)]
    counts = dict(enumerate(iid_counts))
    for label, count in zip(group, _split_evenly(samples_per_client - iid_total,
                                                 len(group))):
      counts[label] += count
    taken = []
    for label, count in counts.items():
      pool = pools[label]
      taken.append(pool[(pointers[label] + np.arange(count)) % len(pool)])
      pointers[label] = (pointers[label] + count) % len(pool)
    out.append(np.sort(np.concatenate(taken)).astype(np.int64))
  return out


def by_group(groups: np.ndarray, num_clients: int, seed: int,
             samples_per_client: int | None = None) -> list[np.ndarray]:
  """Each client holds samples of one group (a data category, e.g. a
  document format): client c takes group c mod G (groups in order of first
  appearance), and each group's samples are dealt evenly among its clients,
  of which each keeps at most `samples_per_client`.

  Raises:
    ValueError: if a group would have more clients than samples.
  """
  names = list(dict.fromkeys(np.asarray(groups).tolist()))
  _check_clients(num_clients, len(groups))
  rng = np.random.default_rng(seed)
  out = [None] * num_clients
  for g, name in enumerate(names):
    mine = list(range(g, num_clients, len(names)))
    if not mine:
      continue
    idx = rng.permutation(np.flatnonzero(np.asarray(groups) == name))
    if len(idx) < len(mine):
      raise ValueError(f"group {name!r} has {len(idx)} samples for "
                       f"{len(mine)} clients")
    for client, part in zip(mine, np.array_split(idx, len(mine))):
      out[client] = np.sort(part[:samples_per_client]).astype(np.int64)
  return out


def test_split(train_labels: np.ndarray, test_labels: np.ndarray,
               train_parts: list[np.ndarray], kind: str,
               seed: int) -> list[np.ndarray]:
  """Each client's test split, drawn the way its training data was:
  'label_groups' by the same procedure, min(the test set divided among the
  clients, the client's training size) samples each; 'dirichlet' with each
  class's test samples dealt in proportion to the clients' shares of that
  class in training; the others IID."""
  num_clients = len(train_parts)
  if kind == "label_groups":
    size = min(len(test_labels) // num_clients, len(train_parts[0]))
    return label_groups(test_labels, num_clients, max(size, 1), seed + 1)
  if kind == "dirichlet":
    rng = np.random.default_rng(seed + 1)
    shares = [[] for _ in range(num_clients)]
    for label in np.unique(test_labels):
      idx = rng.permutation(np.flatnonzero(test_labels == label))
      held = np.array([np.sum(train_labels[p] == label) for p in train_parts],
                      dtype=float)
      cuts = (np.cumsum(held / max(held.sum(), 1))[:-1] * len(idx)).astype(int)
      for client, part in enumerate(np.split(idx, cuts)):
        shares[client].extend(part)
    return [np.sort(np.asarray(s, dtype=np.int64)) for s in shares]
  order = np.random.default_rng(seed + 1).permutation(len(test_labels))
  return [np.sort(part) for part in np.array_split(order, num_clients)]


def partition(labels: np.ndarray, num_clients: int, kind: str = "iid",
              alpha: float = 0.5, seed: int = 0,
              samples_per_client: int | None = None) -> list[np.ndarray]:
  """Dispatches to the partitioner `kind` (one of `PARTITIONS`);
  `samples_per_client` (label_groups only) defaults to the training set
  divided among the clients."""
  if kind == "iid":
    return iid(labels, num_clients, seed)
  if kind == "dirichlet":
    return dirichlet(labels, num_clients, alpha, seed)
  if kind == "one_per_client":
    return one_per_client(labels, num_clients, seed)
  if kind == "label_groups":
    _check_clients(num_clients, len(labels))
    return label_groups(labels, num_clients,
                        samples_per_client or len(labels) // num_clients, seed)
  if kind == "groups":
    raise ValueError("partition='groups' splits by sample groups, not labels: "
                     "use by_group")
  raise ValueError(f"partition={kind!r} is unknown; choose one of {PARTITIONS}")


def _check_clients(num_clients: int, num_samples: int) -> None:
  if num_clients < 1:
    raise ValueError(f"num_clients must be >= 1, got {num_clients}")
  if num_clients > num_samples:
    raise ValueError(f"num_clients={num_clients} exceeds the {num_samples} "
                     "training samples available")
