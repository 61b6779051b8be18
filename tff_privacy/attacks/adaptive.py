"""What an adaptive attack knows of a captured upload's defense.

Beside the upload and the broadcast model, an adaptive attack reads the
run's public configuration from the record's metadata, never the clients'
data, noise draws or perturbations, and only through what the defense
declares it discloses (`tff_privacy.disclosure.Disclosure`). The attack
names the declaration it reads (`READS`), not the defenses: any registered
defense that makes that declaration is answered by it
(`tff_privacy.attacks.adaptive_attacks`), one of this package or a
user's.

A defense here is a registered client- or server-side defense
(`tff_privacy.registry.DEFENSES`) or a method whose uploads carry their
own defense (FedRE, FedEM, HyperFL: a `Method` with a `disclosure`,
`defending_methods`). Both are looked up in their registries by name, so
this layer imports neither `tff_privacy.defenses` nor
`tff_privacy.algorithms`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from tff_privacy import disclosure as disclosures
from tff_privacy.attacks.refusal import UploadRefused, refusing_unreadable
from tff_privacy.registry import DEFENSES, METHODS
from tff_privacy.updates import UpdateRecord


def defending_methods() -> list[str]:
  """The methods that are defenses themselves (they declare a
  `disclosure`): their uploads are judged like a defense's."""
  return [name for name, method in METHODS.items()
          if getattr(method, "disclosure", None) is not None]


def defenses() -> list[str]:
  """Every defense an adaptive attack may answer: the registered defenses
  and the defending methods."""
  return sorted({*DEFENSES, *defending_methods()})


def defense_name(method: Optional[str], defense: Optional[str]) -> Optional[str]:
  """The defense uploads of `method` under client-side defense `defense`
  go through: `defense`, else the method where it is a defense itself
  (`defending_methods`), else None."""
  if defense is not None:
    return defense
  return method if method in defending_methods() else None


def defense_of(record: UpdateRecord) -> Optional[str]:
  """The defense `record`'s upload went through, from the run's public
  metadata (`defense_name` of its method and client-side defense)."""
  return defense_name(record.metadata.get("method"),
                      (record.metadata.get("defense") or {}).get("name"))


def disclosure(defense: str) -> disclosures.Disclosure:
  """What defense `defense` (one of `defenses()`) declares it discloses.

  Raises:
    ValueError: an unknown defense.
  """
  if defense in DEFENSES:
    return getattr(DEFENSES[defense], "DISCLOSURE", disclosures.NOTHING)
  if defense in defending_methods():
    return METHODS[defense].disclosure
  raise ValueError(f"defense={defense!r} is unknown; choose one of {defenses()}")


def read(attack: str, records: Sequence[UpdateRecord],
         declarations: Sequence[str]) -> list[dict[str, Any]]:
  """What each record's defense discloses under `declarations`, one
  {declaration: value} per record, read for attack `attack`.

  Raises:
    UploadRefused: a record uploaded without a defense, or under one that
      does not make a declaration, or whose declaration cannot speak for it
      (a store without the fields it reads, a configuration it does not
      cover); the same records are refused on every try.
  """
  if not declarations:  # an attack unaware of defenses reads none
    return [{} for _ in records]
  out = []
  for record in records:
    defense = defense_of(record)
    known = _known(defense)
    values = {}
    for name in declarations:
      if known is None or name not in known.declared():
        makers = ", ".join(declaring(name)) or "none here"
        raise UploadRefused(
            f"attack {attack!r} reads the {name} a defense declares ({makers}); "
            f"round {record.round_num} client {record.client_index} was "
            f"uploaded under {defense or 'no defense'}, which "
            f"{'is not registered here' if known is None else 'declares none'}: "
            "use 'ig'")
      with refusing_unreadable(attack, record, name):
        values[name] = known.read(name, record)
    out.append(values)
  return out


def _known(defense: Optional[str]) -> Optional[disclosures.Disclosure]:
  """What `defense` discloses; nothing without a defense; None for one
  that is not registered in this process (a plugin not installed here)."""
  if defense is None:
    return disclosures.NOTHING
  return disclosure(defense) if defense in defenses() else None


def declaring(name: str) -> list[str]:
  """The defenses that make declaration `name`."""
  return [d for d in defenses() if name in disclosure(d).declared()]
