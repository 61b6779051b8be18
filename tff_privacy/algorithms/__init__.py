"""Federated methods, one module each; `get` builds one by name."""

from __future__ import annotations

import inspect

from tff_privacy.algorithms import fedavg, fedem, fedsgd
from tff_privacy.algorithms.base import Algorithm, UPLOAD_KINDS
from tff_privacy.algorithms.fedavg import build_fedavg
from tff_privacy.algorithms.fedem import Perturbation, build_fedem
from tff_privacy.algorithms.fedsgd import build_fedsgd

METHODS = {"fedavg": fedavg.algorithm, "fedem": fedem.algorithm,
           "fedsgd": fedsgd.algorithm}


def get(name: str, model_fn, **hparams) -> Algorithm:
  """Returns method `name` (one of `METHODS`) configured by `hparams`."""
  if name not in METHODS:
    raise ValueError(f"method={name!r} is unknown; choose one of {sorted(METHODS)}")
  parameters = inspect.signature(METHODS[name]).parameters
  accepted = set(parameters) - {"model_fn"}
  unknown = sorted(set(hparams) - accepted)
  # a method taking **kwargs names its own unknown parameters
  open_ended = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
  if unknown and not open_ended:
    raise ValueError(f"method {name!r} takes no {', '.join(unknown)}; its "
                     f"parameters: {', '.join(sorted(accepted))}")
  return METHODS[name](model_fn, **hparams)
