"""Attacks that judge defences: gradient inversion and attribute inference.

They read only what an honest-but-curious server holds: captured records from
`tff_privacy.updates` (broadcast model, upload, protocol facts).
"""

from tff_privacy.attacks.inversion import (DLG, IDLG, GradientInversion,
                                           InvertingGradients, Reconstruction,
                                           Target)
from tff_privacy.attacks.labels import recover_labels
from tff_privacy.attacks.refusal import UploadRefused
from tff_privacy.attacks.rog import ROG
from tff_privacy.attacks.shared_part import (ExtractorInversion,
                                             HyperFLInversion, TailoredHyperFL)

ATTACKS: dict[str, type[GradientInversion]] = {
    cls.name: cls for cls in (DLG, IDLG, InvertingGradients, ROG,
                              ExtractorInversion, HyperFLInversion,
                              TailoredHyperFL)}


def attack_class(name: str) -> type[GradientInversion]:
  """The class of attack `name` (one of `ATTACKS`)."""
  if name not in ATTACKS:
    raise ValueError(f"attack={name!r} is unknown; choose one of {sorted(ATTACKS)}")
  return ATTACKS[name]


def build(name: str, **kwargs) -> GradientInversion:
  """Attack `name` (one of `ATTACKS`) with its declared parameters."""
  return attack_class(name)(**kwargs)
