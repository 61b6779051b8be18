"""Attacks that judge defences: gradient inversion and attribute inference.

They read only what an honest-but-curious server holds: captured records from
`tff_privacy.updates` (broadcast model, upload, protocol facts). Adaptive
attacks (`adaptive`) also read the run's public defence configuration; each
declares the defences it answers (`adaptive_attacks`).
"""

from tff_privacy.attacks.adaptive import (DEFENDED_METHODS,
                                          MaskedInvertingGradients, defence_of)
from tff_privacy.attacks.inversion import (DLG, IDLG, GradientInversion,
                                           InvertingGradients, Reconstruction,
                                           Target)
from tff_privacy.attacks.labels import recover_labels
from tff_privacy.attacks.noise_aware import NoiseAwareInvertingGradients
from tff_privacy.attacks.perturbation_aware import DenoisedInvertingGradients
from tff_privacy.attacks.refusal import UploadRefused
from tff_privacy.attacks.rog import ROG
from tff_privacy.attacks.shared_part import (ExtractorInversion,
                                             HyperFLInversion, TailoredHyperFL)

ATTACKS: dict[str, type[GradientInversion]] = {
    cls.name: cls for cls in (DLG, IDLG, InvertingGradients, ROG,
                              ExtractorInversion, HyperFLInversion,
                              TailoredHyperFL, MaskedInvertingGradients,
                              NoiseAwareInvertingGradients,
                              DenoisedInvertingGradients)}


def attack_class(name: str) -> type[GradientInversion]:
  """The class of attack `name` (one of `ATTACKS`)."""
  if name not in ATTACKS:
    raise ValueError(f"attack={name!r} is unknown; choose one of {sorted(ATTACKS)}")
  return ATTACKS[name]


def build(name: str, **kwargs) -> GradientInversion:
  """Attack `name` (one of `ATTACKS`) with its declared parameters."""
  return attack_class(name)(**kwargs)


def defences() -> list[str]:
  """Every defence an adaptive attack may answer: the client-side defences
  of `tff_privacy.defenses.DEFENSES` and the methods that are defences
  (`DEFENDED_METHODS`)."""
  from tff_privacy import defenses  # deferred: RECUP-FL imports this package
  return sorted({*defenses.DEFENSES, *DEFENDED_METHODS})


def adaptive_attacks(defense: str) -> list[str]:
  """The attacks that know defence `defense` (one of `defences()`), by their
  declared `DEFENDS`; empty where it has no known adaptive attack."""
  if defense not in defences():
    raise ValueError(f"defense={defense!r} is unknown; choose one of {defences()}")
  return sorted(name for name, cls in ATTACKS.items() if defense in cls.DEFENDS)


def without_adaptive_attack() -> list[str]:
  """The defences of `defences()` that no attack here knows: judged by
  attacks unaware of them only."""
  return [name for name in defences() if not adaptive_attacks(name)]
