"""Federated methods, one module each; `get` builds one by name."""

from __future__ import annotations

from tff_privacy.algorithms import fedavg, fedem, fedsgd
from tff_privacy.algorithms.base import UPLOAD_KINDS, Algorithm, Method
from tff_privacy.algorithms.fedavg import build_fedavg
from tff_privacy.algorithms.fedem import Perturbation, build_fedem
from tff_privacy.algorithms.fedsgd import build_fedsgd

METHODS: dict[str, Method] = {m.name: m for m in (fedavg.METHOD, fedem.METHOD,
                                                   fedsgd.METHOD)}


def method(name: str) -> Method:
  """The method `name` (one of `METHODS`)."""
  if name not in METHODS:
    raise ValueError(f"method={name!r} is unknown; choose one of {sorted(METHODS)}")
  return METHODS[name]


def get(name: str, model_fn, *, batch_size: int = 32, seed: int = 0,
        defense=None, **kwargs) -> Algorithm:
  """Method `name` configured by its declared parameters `kwargs` (paper
  defaults for the rest), for clients with batches of `batch_size`."""
  return method(name).build(model_fn, batch_size=batch_size, seed=seed,
                            defense=defense, **kwargs)
