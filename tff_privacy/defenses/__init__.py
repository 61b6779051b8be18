"""Classic defences against gradient leakage: client-side update transforms
and server-side aggregators."""

from tff_privacy.defenses.central import DPFedAvg
from tff_privacy.defenses.updates import (ClipOnly, LocalGaussian, LocalLaplace,
                                          Sparsification, UpdateDefense,
                                          run_local_query)
from tff_privacy.defenses.updates import DEFENSES as CLIENT_DEFENSES

DEFENSES = {**CLIENT_DEFENSES, DPFedAvg.name: DPFedAvg}


def build(name: str, **kwargs):
  """Defence `name` (one of `DEFENSES`) with its parameters."""
  if name not in DEFENSES:
    raise ValueError(f"defense={name!r} is unknown; choose one of {sorted(DEFENSES)}")
  return DEFENSES[name](**kwargs)
