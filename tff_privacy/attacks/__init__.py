"""Attacks that judge defenses: gradient inversion and attribute inference.

They read only what an honest-but-curious server holds: captured records from
`tff_privacy.updates` (broadcast model, upload, protocol facts). Adaptive
attacks also read what a record's defense declares it discloses
(`tff_privacy.disclosure`), each the declaration it names (`READS`), and
answer every defense that makes it (`adaptive_attacks`).

An attack registers itself with `register` (or, from an installed package,
through the entry-point group 'tff_privacy.attacks'; see
`tff_privacy.registry`):

```python
from tff_privacy import attacks

@attacks.register
class MyInversion(attacks.InvertingGradients):
  name = "my_ig"
```
"""

from tff_privacy.attacks.adaptive import (defending_methods, defense_name,
                                          defense_of, defenses, disclosure)
from tff_privacy.attacks.inversion import (DLG, IDLG, GradientInversion,
                                           InvertingGradients, Reconstruction,
                                           Target)
from tff_privacy.attacks.labels import recover_labels
from tff_privacy.attacks.masked import MaskedInvertingGradients
from tff_privacy.attacks.noise_aware import NoiseAwareInvertingGradients
from tff_privacy.attacks.perturbation_aware import DenoisedInvertingGradients
from tff_privacy.attacks.refusal import UploadRefused
from tff_privacy.attacks.rog import ROG
from tff_privacy.attacks.shared_part import (ExtractorInversion,
                                             HyperFLInversion, TailoredHyperFL)
from tff_privacy.registry import ATTACKS

register = ATTACKS.register


def attack_class(name: str) -> type[GradientInversion]:
  """The class of attack `name` (one of `ATTACKS`)."""
  return ATTACKS.lookup(name)


def build(name: str, **kwargs) -> GradientInversion:
  """Attack `name` (one of `ATTACKS`) with its declared parameters."""
  return attack_class(name)(**kwargs)


def adaptive_attacks(defense: str) -> list[str]:
  """The attacks that know defense `defense` (one of `defenses()`): those
  whose declaration (`READS`) it makes; empty where it makes none."""
  declared = disclosure(defense).declared()
  return sorted(name for name, cls in ATTACKS.items()
                if getattr(cls, "READS", None) in declared)


def without_adaptive_attack() -> dict[str, str]:
  """The defenses of `defenses()` that no attack here knows, each with its
  stated reason (`Disclosure.no_adaptive_attack`; None where it states
  none): judged by attacks unaware of them only."""
  return {name: disclosure(name).no_adaptive_attack for name in defenses()
          if not adaptive_attacks(name)}
