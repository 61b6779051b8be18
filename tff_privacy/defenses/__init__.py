"""Defences against gradient leakage: client-side update transforms (the
classic ones and RECUP-FL's) and server-side aggregators."""

from typing import Optional

from tff_privacy.defenses.central import DPFedAvg
from tff_privacy.defenses.ldp_fed import LDPFed
from tff_privacy.defenses.recupfl import RecupFL
from tff_privacy.defenses.soteria import Soteria
from tff_privacy.defenses.updates import (ClientView, ClipOnly, LocalGaussian,
                                          LocalLaplace, Sparsification,
                                          UpdateDefense, run_local_query)
from tff_privacy.defenses.updates import DEFENSES as _UPDATE_DEFENSES

CLIENT_DEFENSES = {**_UPDATE_DEFENSES, LDPFed.name: LDPFed, Soteria.name: Soteria,
                   RecupFL.name: RecupFL}
DEFENSES = {**CLIENT_DEFENSES, DPFedAvg.name: DPFedAvg}


def defense_class(name: str):
  """The class of defence `name` (one of `DEFENSES`)."""
  if name not in DEFENSES:
    raise ValueError(f"defense={name!r} is unknown; choose one of {sorted(DEFENSES)}")
  return DEFENSES[name]


def resolve(name: str, kwargs: dict) -> dict:
  """The parameters of defence `name` from `kwargs`, checked against its
  declaration (`PARAMETERS`), defaults filled in."""
  return defense_class(name).PARAMETERS.resolve(f"defense {name!r}", kwargs)


def encoded_bytes(name: Optional[str], kwargs: dict, upload) -> Optional[int]:
  """The bytes of a client's `upload` in the own encoding of client-side
  defence `name` with parameters `kwargs` (`UpdateDefense.encoded_bytes`);
  None without a defence, for a server-side one, or one that sends dense."""
  if name not in CLIENT_DEFENSES:
    return None
  return CLIENT_DEFENSES[name].encoded_bytes(resolve(name, kwargs), upload)


def build(name: str, model_spec=None, data=None, out=None, **kwargs):
  """Defence `name` (one of `DEFENSES`) with its parameters; defences that
  need the architecture (Soteria) get `model_spec` as `model`, those that
  need the run's data (RECUP-FL) its `FederatedData` as `data` and its
  output folder as `out`."""
  cls = defense_class(name)
  kwargs = resolve(name, kwargs)
  if getattr(cls, "needs_model_spec", False):
    if model_spec is None:
      raise ValueError(f"defense={name!r} needs the model's ModelSpec")
    kwargs["model"] = model_spec
  if getattr(cls, "needs_data", False):
    if data is None or out is None:
      raise ValueError(f"defense={name!r} needs the run's data and output "
                       "folder; use it through a run")
    kwargs.update(data=data, out=out)
  return cls(**kwargs)
