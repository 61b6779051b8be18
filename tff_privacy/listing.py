"""How a method or a defense appears on the built-in leaderboards.

Declared once, beside the component (a defense's `LISTING`, a `Method`'s
`listing`); `tff_privacy.leaderboard.defaults` generates the built-in grids
from the registries when a grid is asked for, so a defense registered by a
user's script or an installed package is on them too:

```python
from tff_privacy import defenses
from tff_privacy.listing import Listing

@defenses.register
class Quantization(defenses.UpdateDefense):
  name = "qsgd"
  LISTING = Listing("QSGD", parameter="bits", default=4, full_sweep=(2, 4, 8))
```
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

SCALES = ("compact", "cnn", "full")


@dataclasses.dataclass(frozen=True)
class Listing:
  """One entry of the built-in grids.

  Attributes:
    label: the entry's name in tables and verdicts.
    parameter: the swept parameter, of the defense (else of the method);
      None: the entry has no strength.
    default: the strength the compact and `cnn` grids run, its paper's.
    full_sweep: the strengths the full grid runs (default: `default` alone).
    method: a defense's, the method it runs under ('fedsgd' or 'fedavg');
      the method's own listing gives that method's parameters.
    kwargs: further parameters (of the defense, else the method) at every
      scale.
    full_kwargs: those that change at full scale.
    protocol: changes of the grid's protocol for this entry (HyperFL trains
      on batches of 10).
    attacks: its own inversion attacks, where the grid's cannot read its
      uploads.
    scales: the built-in grids it is on.
    seconds: its compact row's time on 2 cores, two rows at a time: the
      grid starts the slowest rows first, so that both processes finish
      near together.
  """

  label: str
  parameter: Optional[str] = None
  default: Any = None
  full_sweep: tuple = ()
  method: Optional[str] = None
  kwargs: dict = dataclasses.field(default_factory=dict)
  full_kwargs: dict = dataclasses.field(default_factory=dict)
  protocol: dict = dataclasses.field(default_factory=dict)
  attacks: tuple = ()
  scales: tuple = SCALES
  seconds: float = 0.0

  def __post_init__(self):
    if not isinstance(self.label, str) or not self.label:
      raise ValueError(f"label: a non-empty name, got {self.label!r}")
    if (self.parameter is None) != (self.default is None):
      raise ValueError(f"{self.label}: give parameter and default together "
                       f"(parameter={self.parameter!r}, default={self.default!r})")
    if self.full_sweep and self.parameter is None:
      raise ValueError(f"{self.label}: full_sweep needs the swept parameter")
    unknown = set(self.scales) - set(SCALES)
    if unknown:
      raise ValueError(f"{self.label}: scales {sorted(unknown)}; choose from {SCALES}")

  def strengths(self, scale: str) -> list:
    """The strengths of the grid `scale`."""
    if scale == "full" and self.full_sweep:
      return list(self.full_sweep)
    return [self.default]

  def parameters(self, scale: str) -> dict:
    """The fixed parameters at `scale`."""
    return {**self.kwargs, **(self.full_kwargs if scale == "full" else {})}
