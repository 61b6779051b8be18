"""Partitioners: split sample indices among clients."""

from __future__ import annotations

import numpy as np

PARTITIONS = ("iid", "dirichlet", "one_per_client")


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


def partition(labels: np.ndarray, num_clients: int, kind: str = "iid",
              alpha: float = 0.5, seed: int = 0) -> list[np.ndarray]:
  """Dispatches to the partitioner `kind` (one of `PARTITIONS`)."""
  if kind == "iid":
    return iid(labels, num_clients, seed)
  if kind == "dirichlet":
    return dirichlet(labels, num_clients, alpha, seed)
  if kind == "one_per_client":
    return one_per_client(labels, num_clients, seed)
  raise ValueError(f"partition={kind!r} is unknown; choose one of {PARTITIONS}")


def _check_clients(num_clients: int, num_samples: int) -> None:
  if num_clients < 1:
    raise ValueError(f"num_clients must be >= 1, got {num_clients}")
  if num_clients > num_samples:
    raise ValueError(f"num_clients={num_clients} exceeds the {num_samples} "
                     "training samples available")
