"""Declared parameters: one declaration per method, defence and attack.

A component lists its keyword parameters once, as `Param`s (name, type,
default from its paper, valid range or choices, help text, command-line flag).
Everything else is derived from that list: the `tff-privacy` flags and their
help, the checks of `--method-kwargs`, of config files and of Python calls,
and the one-line error that names a wrong value and what is accepted.

```python
from tff_privacy.params import Param, Params

PARAMETERS = Params(
    Param("clip", float, help="clipping bound C", minimum=0,
          exclusive_minimum=True),
    Param("noise_multiplier", float, 1.0, "noise std over C", minimum=0))
resolved = PARAMETERS.resolve("defense 'ldp_gaussian'", {"clip": 1})
assert resolved == {"clip": 1.0, "noise_multiplier": 1.0}
```
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any, Callable, Iterator, Optional


class _Required:
  def __repr__(self) -> str:
    return "REQUIRED"


REQUIRED: Any = _Required()  # default of a parameter the caller must give

_KIND_NAMES = {int: "an integer", float: "a finite number", str: "a string",
               bool: "true or false", object: "a JSON value"}
_KINDS = tuple(_KIND_NAMES)


def _number(x: float) -> str:
  return f"{x:.6g}" if isinstance(x, float) else str(x)


@dataclasses.dataclass(frozen=True)
class Param:
  """One keyword parameter.

  Attributes:
    name: the keyword argument.
    kind: int, float, str or bool; values are converted to it (an int is a
      valid float, a bool is not a number). `object`: a value of a shape
      the kinds cannot express, checked by `parse`.
    default: the paper's default, `REQUIRED`, or None for "chosen by the
      component" (then None is an accepted value).
    help: one line for `--help`.
    choices: the accepted values, if they are few, or a live collection
      of them (a `tff_privacy.registry.Registry`), read when a value is
      checked: its default is checked then, not at import.
    minimum, maximum: the valid range (None: unbounded);
      `exclusive_minimum` / `exclusive_maximum` make a bound open.
    flag: the command-line flag without its dashes (default: the name with
      '-' for '_'); None with `cli=False`.
    cli: whether the parameter gets a flag.
    parse: for kind `object`, converts a value or raises `ValueError`
      naming the parameter and what it accepts.
  """

  name: str
  kind: type
  default: Any = REQUIRED
  help: str = ""
  choices: tuple = ()
  minimum: Optional[float] = None
  maximum: Optional[float] = None
  exclusive_minimum: bool = False
  exclusive_maximum: bool = False
  flag: Optional[str] = None
  cli: bool = True
  parse: Optional[Callable[[Any], Any]] = None

  def __post_init__(self):
    if self.kind not in _KINDS:
      raise TypeError(f"Param {self.name}: kind must be one of {_KINDS}")
    if (self.kind is object) != (self.parse is not None) or (
        self.kind is object and self.cli):
      raise TypeError(f"Param {self.name}: kind object goes with parse and "
                      "cli=False")
    if self.cli and self.flag is None:
      object.__setattr__(self, "flag", self.name.replace("_", "-"))
    live = not isinstance(self.choices, (tuple, list, set, frozenset))
    if self.default is not REQUIRED and self.default is not None and not live:
      self.check(self.default)

  @property
  def required(self) -> bool:
    return self.default is REQUIRED

  def accepted(self) -> str:
    """What the parameter accepts, e.g. 'in [0, 1)' or '> 0'."""
    if self.choices:
      return "one of " + ", ".join(repr(c) for c in self.choices)
    lo, hi = self.minimum, self.maximum
    if lo is not None and hi is not None:
      return (f"in {'(' if self.exclusive_minimum else '['}{_number(lo)}, "
              f"{_number(hi)}{')' if self.exclusive_maximum else ']'}")
    if lo is not None:
      return f"{'>' if self.exclusive_minimum else '>='} {_number(lo)}"
    if hi is not None:
      return f"{'<' if self.exclusive_maximum else '<='} {_number(hi)}"
    return _KIND_NAMES[self.kind]

  def check(self, value: Any) -> Any:
    """`value` converted to the parameter's kind; `ValueError` naming the
    parameter and what it accepts if it is not valid."""
    if value is None and self.default is None:
      return None
    if self.parse is not None:
      return self.parse(value)
    value = self._convert(value)
    if self.choices and value not in self.choices:
      raise ValueError(f"{self.name}={value!r}; choose one of "
                       f"{', '.join(repr(c) for c in self.choices)}")
    lo, hi = self.minimum, self.maximum
    below = lo is not None and (value <= lo if self.exclusive_minimum else value < lo)
    above = hi is not None and (value >= hi if self.exclusive_maximum else value > hi)
    if below or above:
      verb = "lie" if lo is not None and hi is not None else "be"
      raise ValueError(f"{self.name} must {verb} {self.accepted()}, got {value!r}")
    return value

  def _convert(self, value: Any) -> Any:
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    finite = (isinstance(value, numbers.Real) and not isinstance(value, bool)
              and (integral or math.isfinite(value)))
    if self.kind is int and (integral or (finite and float(value).is_integer())):
      return int(value)
    if self.kind is float and finite:
      try:
        return float(value)
      except OverflowError:
        pass
    if self.kind in (str, bool) and isinstance(value, self.kind):
      return value
    what = _KIND_NAMES[self.kind]
    suffix = f" {self.accepted()}" if self.kind in (int, float) and (
        self.minimum is not None or self.maximum is not None) else ""
    raise ValueError(f"{self.name} must be {what}{suffix}, got {value!r}")

  def default_text(self) -> str:
    """'required', 'optional' (None), or the default as a user types it."""
    if self.required:
      return "required"
    if self.default is None:
      return "optional"
    if isinstance(self.default, float):
      return _number(self.default)
    return str(self.default)

  def describe(self) -> str:
    """Help text with the accepted values and the default."""
    default = self.default_text()
    if default not in ("required", "optional"):
      default = "default " + default
    return f"{self.help} ({self.accepted()}; {default})"


class Params:
  """The declared parameters of one component, in order."""

  def __init__(self, *params: Param):
    names = [p.name for p in params]
    if len(set(names)) != len(names):
      raise ValueError(f"duplicate parameter names in {names}")
    self._params = {p.name: p for p in params}

  def __iter__(self) -> Iterator[Param]:
    return iter(self._params.values())

  def __getitem__(self, name: str) -> Param:
    return self._params[name]

  def __contains__(self, name: str) -> bool:
    return name in self._params

  @property
  def names(self) -> list[str]:
    return list(self._params)

  def defaults(self) -> dict[str, Any]:
    return {p.name: p.default for p in self if not p.required}

  def check(self, **values: Any) -> dict[str, Any]:
    """The given values, each checked and converted (for constructors)."""
    self._refuse_unknown("this component", values)
    return {k: self._params[k].check(v) for k, v in values.items()}

  def resolve(self, owner: str, values: dict[str, Any]) -> dict[str, Any]:
    """Every parameter's value: the given `values` checked, the defaults for
    the rest. `owner` (e.g. "method 'fedem'") starts the error messages."""
    self._refuse_unknown(owner, values)
    missing = [p.name for p in self if p.required and p.name not in values]
    if missing:
      raise ValueError(f"{owner} needs " + "; ".join(
          f"{n}" + (f" (--{self[n].flag})" if self[n].cli else "")
          + f": {self[n].help}, {self[n].accepted()}" for n in missing))
    resolved = self.defaults()
    for name, value in values.items():
      try:
        resolved[name] = self._params[name].check(value)
      except ValueError as e:
        raise ValueError(f"{owner}: {e}") from None
    return resolved

  def _refuse_unknown(self, owner: str, values: dict[str, Any]) -> None:
    unknown = sorted(set(values) - set(self._params))
    if unknown:
      raise ValueError(f"{owner} takes no {', '.join(unknown)}; its parameters: "
                       f"{', '.join(self.names) or 'none'}")


def per_client(value: Any, num_clients: int, name: str,
               parse: Callable[[Any, str], Any]) -> list:
  """One setting per client from a parameter `name`'s `value`: the same for
  every client, or, for a path ending in '.json', a file
  `{"default": v, "clients": {"3": v, ...}}` (clients by index, 'default'
  for the rest). `parse(v, label)` reads one value, `label` naming it in
  errors ("regions[3]").

  Raises:
    ValueError: naming `name` for an unreadable file, unknown client
      indices or a client left without a value.
  """
  if not (isinstance(value, str) and value.endswith(".json")):
    return [parse(value, name)] * num_clients
  spec = _read_per_client_json(value, name)
  own = spec.get("clients", {})
  unknown = [c for c in own if not str(c).isdigit() or int(c) >= num_clients]
  if unknown:
    raise ValueError(f"{name}={value!r}: clients {unknown} are not client "
                     f"indices 0..{num_clients - 1}")
  out = []
  for c in range(num_clients):
    setting = own.get(str(c), spec.get("default"))
    if setting is None:
      raise ValueError(f"{name}={value!r}: client {c} has no value and there "
                       "is no 'default'")
    out.append(parse(setting, f"{name}[{c}]"))
  return out


def _read_per_client_json(path: str, name: str) -> dict:
  if not os.path.isfile(path):
    raise ValueError(f"{name}={path!r}: no such file")
  try:
    with open(path) as f:
      spec = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{name}={path!r} is not readable JSON: {e}") from None
  if not isinstance(spec, dict) or set(spec) - {"default", "clients"}:
    raise ValueError(f"{name}={path!r}: expected an object with keys "
                     "'default' and 'clients'")
  return spec
