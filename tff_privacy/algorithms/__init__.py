"""Federated methods, one module each; `get` builds one by name."""

from __future__ import annotations

from tff_privacy.algorithms import fedavg, fedem, fedsgd, hyperfl
from tff_privacy.algorithms.base import (UPLOAD_KINDS, Algorithm, Method,
                                         PrivateState)
from tff_privacy.algorithms.fedavg import build_fedavg
from tff_privacy.algorithms.fedem import Perturbation, build_fedem
from tff_privacy.algorithms.fedsgd import build_fedsgd
from tff_privacy.algorithms.hyperfl import build_hyperfl
from tff_privacy.algorithms.personalized import PersonalizedProcess

METHODS: dict[str, Method] = {m.name: m for m in (
    fedavg.METHOD, fedem.METHOD, fedsgd.METHOD, hyperfl.METHOD)}


def method(name: str) -> Method:
  """The method `name` (one of `METHODS`)."""
  if name not in METHODS:
    raise ValueError(f"method={name!r} is unknown; choose one of {sorted(METHODS)}")
  return METHODS[name]


def get(name: str, spec, *, batch_size: int = 32, seed: int = 0,
        defense=None, **kwargs) -> Algorithm:
  """Method `name` configured by its declared parameters `kwargs` (paper
  defaults for the rest), for clients training the model of `spec` (a
  `tff_privacy.models.ModelSpec`) with batches of `batch_size`."""
  return method(name).build(spec, batch_size=batch_size, seed=seed,
                            defense=defense, **kwargs)
