"""Federated methods, one module each; `get` builds one by name.

A method is a `Method` (its parameters, its factory and, where its uploads
carry their own defense, what that defense discloses), registered with
`register` (or, from an installed package, through the entry-point group
'tff_privacy.methods'; see `tff_privacy.registry`)."""

from __future__ import annotations

from typing import Optional

from tff_privacy.algorithms import (centaur, dp_sgd_fedavg, fedavg, fedem,
                                    fedre, fedsgd, hyperfl, hyperfl_lpm,
                                    local_only, pfedhn, ppsgd)
from tff_privacy.algorithms.base import (UPLOAD_KINDS, Algorithm, Federation,
                                         Method, PrivateState)
from tff_privacy.algorithms.fedavg import build_fedavg
from tff_privacy.algorithms.fedem import Perturbation, build_fedem
from tff_privacy.algorithms.fedre import FedREMechanism, build_fedre
from tff_privacy.algorithms.fedsgd import build_fedsgd
from tff_privacy.algorithms.centaur import build_centaur
from tff_privacy.algorithms.dp_sgd_fedavg import build_dp_sgd_fedavg
from tff_privacy.algorithms.hyperfl import build_hyperfl
from tff_privacy.algorithms.hyperfl_lpm import build_hyperfl_lpm
from tff_privacy.algorithms.local_only import build_local_only
from tff_privacy.algorithms.pfedhn import build_pfedhn
from tff_privacy.algorithms.personalized import (PersonalizedProcess,
                                                 build_personalized_process)
from tff_privacy.algorithms.ppsgd import build_ppsgd
from tff_privacy.registry import METHODS

register = METHODS.register


def method(name: str) -> Method:
  """The method `name` (one of `METHODS`)."""
  return METHODS.lookup(name)


def get(name: str, spec, *, batch_size: int = 32, seed: int = 0,
        defense=None, federation: Optional[Federation] = None,
        **kwargs) -> Algorithm:
  """Method `name` configured by its declared parameters `kwargs` (paper
  defaults for the rest), for clients training the model of `spec` (a
  `tff_privacy.models.ModelSpec`) with batches of `batch_size` in the run
  described by `federation` (see `Federation`)."""
  return method(name).build(spec, batch_size=batch_size, seed=seed,
                            defense=defense, federation=federation, **kwargs)
