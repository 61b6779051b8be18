"""Defenses against gradient leakage: client-side update transforms (the
classic ones and RECUP-FL's) and server-side aggregators.

A defense is one declaration: a class with a `name`, its `PARAMETERS`
(which give its command-line flags and config checks), what its public
configuration discloses to an attacker who knows it (`DISCLOSURE`, read by
the adaptive attacks; `tff_privacy.disclosure`) and, for the leaderboard,
how it is shown and swept. It registers itself with `register`, in this
package or in a user's own script (or, from an installed package, through
the entry-point group 'tff_privacy.defenses'; see `tff_privacy.registry`):

```python
from tff_privacy import defenses

@defenses.register
class Quantization(defenses.UpdateDefense):
  name = "qsgd"
  ...
```
"""

from typing import Optional

from tff_privacy.defenses.central import DPFedAvg
from tff_privacy.defenses.ldp_fed import LDPFed
from tff_privacy.defenses.recupfl import RecupFL
from tff_privacy.defenses.soteria import Soteria
from tff_privacy.defenses.updates import (ClientView, ClipOnly, LocalGaussian,
                                          LocalLaplace, Sparsification,
                                          UpdateDefense, run_local_query)
from tff_privacy.disclosure import Disclosure
from tff_privacy.registry import DEFENSES

register = DEFENSES.register


def defense_class(name: str):
  """The class of defense `name` (one of `DEFENSES`)."""
  return DEFENSES.lookup(name)


def is_client_side(name: str) -> bool:
  """Whether defense `name` is registered and transforms each client's
  upload (an `UpdateDefense`), rather than the server's aggregate."""
  cls = DEFENSES.get(name)
  return isinstance(cls, type) and issubclass(cls, UpdateDefense)


def resolve(name: str, kwargs: dict) -> dict:
  """The parameters of defense `name` from `kwargs`, checked against its
  declaration (`PARAMETERS`), defaults filled in."""
  return defense_class(name).PARAMETERS.resolve(f"defense {name!r}", kwargs)


def encoded_bytes(name: Optional[str], kwargs: dict, upload) -> Optional[int]:
  """The bytes of a client's `upload` in the own encoding of client-side
  defense `name` with parameters `kwargs` (`UpdateDefense.encoded_bytes`);
  None without a defense, for a server-side one, or one that sends dense."""
  if name is None or not is_client_side(name):
    return None
  return defense_class(name).encoded_bytes(resolve(name, kwargs), upload)


def build(name: str, model_spec=None, data=None, out=None, **kwargs):
  """Defense `name` (one of `DEFENSES`) with its parameters; defenses that
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
