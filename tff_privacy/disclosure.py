"""What a defense tells an attacker who knows it.

The threat model is an honest-but-curious server that holds each captured
upload, the model it broadcast and the run's public configuration (the
record's metadata: method, protocol, the defense's name and parameters),
never the clients' data, noise draws or perturbations. A defense declares
what of its working that attacker can compute from those, as a
`Disclosure`; adaptive attacks read the declarations they need (an
attack's `READS`) and name no defense, so a new defense is answered by
every attack whose declaration it makes (`tff_privacy.attacks.adaptive_attacks`).

Each declaration is a function of a captured `tff_privacy.updates.UpdateRecord`:

* `transmitted_mask`: 1 at the upload's coordinates the defense transmits,
  0 where it zeroed them (sparsification, pruning): an attacker matches
  only the transmitted ones (`ig_masked`).
* `noise_levels`: the std of the noise on each tensor of the upload
  (`ig_noise_aware` weighs each tensor by its signal-to-noise ratio).
* `input_perturbation`: (bound, norm) of a perturbation of the training
  inputs, 'linf' per entry or 'l2' per sample (`ig_denoised` denoises within it).
* `sensitive_region`: the client's privacy-sensitive pixels as [1, H, W, 1]
  0/1 (`ig_noise_aware`'s `region_tv_weight`).
* `hypernetwork`: the sizes {'embedding_dim', 'hidden_dim'} of the
  hypernetwork whose weights the upload holds
  (`tff_privacy.models.hypernetwork.Hypernetwork.for_model`), generating the
  client's feature extractor from its private embedding
  (`tailored_hyperfl`).

A declaration raises `tff_privacy.attacks.UploadRefused` for an upload it
cannot speak for (e.g. FedRE's noise on the pixels, not the upload), with
the reason. A defense that declares none of them states why in
`no_adaptive_attack`: the leaderboard then judges it by unaware attacks
only, and says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

# the declarations an attack may read (its `READS`), in the order above
DECLARATIONS = ("transmitted_mask", "noise_levels", "input_perturbation",
                "sensitive_region", "hypernetwork")

Declaration = Optional[Callable[[Any], Any]]  # UpdateRecord -> what it tells


@dataclasses.dataclass(frozen=True)
class Disclosure:
  """A defense's declarations (see the module docstring); None: not
  declared."""

  transmitted_mask: Declaration = None
  noise_levels: Declaration = None
  input_perturbation: Declaration = None
  sensitive_region: Declaration = None
  hypernetwork: Declaration = None
  # why no adaptive attack is known, for a defense that declares nothing
  no_adaptive_attack: Optional[str] = None

  def __post_init__(self):
    if self.no_adaptive_attack is not None and self.declared():
      raise ValueError("a Disclosure that declares "
                       f"{', '.join(self.declared())} has adaptive attacks; "
                       "give no_adaptive_attack only where it declares none")

  def declared(self) -> tuple[str, ...]:
    """The names of the declarations made, in `DECLARATIONS`' order."""
    return tuple(n for n in DECLARATIONS if getattr(self, n) is not None)

  def read(self, name: str, record) -> Any:
    """What declaration `name` tells of `record`.

    Raises:
      ValueError: `name` is not one of `DECLARATIONS`, or not declared.
    """
    if name not in DECLARATIONS:
      raise ValueError(f"declaration={name!r}; choose one of {DECLARATIONS}")
    declaration = getattr(self, name)
    if declaration is None:
      raise ValueError(f"this defense declares no {name}")
    return declaration(record)


NOTHING = Disclosure()  # a defense that has not said what it discloses
