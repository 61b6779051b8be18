"""Federated methods, one module each; `get` builds one by name."""

from __future__ import annotations

from tff_privacy.algorithms import fedavg, fedsgd
from tff_privacy.algorithms.base import Algorithm, UPLOAD_KINDS
from tff_privacy.algorithms.fedavg import build_fedavg
from tff_privacy.algorithms.fedsgd import build_fedsgd

METHODS = {"fedavg": fedavg.algorithm, "fedsgd": fedsgd.algorithm}


def get(name: str, model_fn, **hparams) -> Algorithm:
  """Returns method `name` (one of `METHODS`) configured by `hparams`."""
  if name not in METHODS:
    raise ValueError(f"method={name!r} is unknown; choose one of {sorted(METHODS)}")
  return METHODS[name](model_fn, **hparams)
