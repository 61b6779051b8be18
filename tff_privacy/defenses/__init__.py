"""Classic defences against gradient leakage: client-side update transforms
and server-side aggregators."""

from tff_privacy.defenses.central import DPFedAvg
from tff_privacy.defenses.ldp_fed import LDPFed
from tff_privacy.defenses.soteria import Soteria
from tff_privacy.defenses.updates import (ClientView, ClipOnly, LocalGaussian,
                                          LocalLaplace, Sparsification,
                                          UpdateDefense, run_local_query)
from tff_privacy.defenses.updates import DEFENSES as _UPDATE_DEFENSES

CLIENT_DEFENSES = {**_UPDATE_DEFENSES, LDPFed.name: LDPFed, Soteria.name: Soteria}
DEFENSES = {**CLIENT_DEFENSES, DPFedAvg.name: DPFedAvg}


def build(name: str, model_spec=None, **kwargs):
  """Defence `name` (one of `DEFENSES`) with its parameters; defences that
  need the architecture (Soteria) get `model_spec` as `model`."""
  if name not in DEFENSES:
    raise ValueError(f"defense={name!r} is unknown; choose one of {sorted(DEFENSES)}")
  cls = DEFENSES[name]
  if getattr(cls, "needs_model_spec", False):
    if model_spec is None:
      raise ValueError(f"defense={name!r} needs the model's ModelSpec")
    kwargs["model"] = model_spec
  return cls(**kwargs)
