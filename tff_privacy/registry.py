"""Registries of named components: methods, defenses and attacks.

One registry per kind. A component registers itself with its kind's
decorator, in this package or in a user's own script:

```python
from tff_privacy import defenses

@defenses.register
class Quantization(defenses.UpdateDefense):
  name = "qsgd"
  ...
```

and an installed package registers through the entry-point group of the
kind (Python packaging's plugin convention), e.g. in its pyproject.toml:

```toml
[project.entry-points."tff_privacy.defenses"]
qsgd = "my_package.qsgd:Quantization"
```

A registry imports its kind's built-in module and loads the entry points of
its group the first time it is read, not when it is created: a lower layer
(an attack) can look up a higher one's declarations (a defense's
`tff_privacy.disclosure.Disclosure`) without importing it, and command-line
choices are read when arguments are parsed, not when modules are imported.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Mapping
from importlib import metadata
from typing import Any, Iterator, Optional


class Registry(Mapping):
  """Components of one kind by name, a read-only mapping once loaded.

  Args:
    kind: what a component is, as the command line spells it ('defense').
    builtin: the module whose import registers the package's own.
    group: the entry-point group of other packages' components.
  """

  def __init__(self, kind: str, builtin: str, group: str):
    self.kind, self.builtin, self.group = kind, builtin, group
    self._components: dict[str, Any] = {}
    self._loaded = False

  def register(self, component: Any = None, *, name: Optional[str] = None):
    """Registers `component` under `name` (default: its `name` attribute)
    and returns it, as a decorator of a class or a call on an instance.

    Raises:
      ValueError: no name, or the name is another component's.
    """
    if component is None:
      return lambda c: self.register(c, name=name)
    own = getattr(component, "name", None)
    if name is not None and own is not None and own != name:
      raise ValueError(f"{self.kind} {_where(component)} is named {own!r}, "
                       f"not {name!r}: runs record its own name")
    name = name or own
    if not isinstance(name, str) or not name:
      raise ValueError(f"a {self.kind} needs a non-empty string `name` to be "
                       f"registered; got {name!r} for {component!r}")
    known = self._components.get(name)
    if known is not None and not _same(known, component):
      raise ValueError(f"{self.kind} {name!r} is registered already "
                       f"({_where(known)}); choose another name")
    self._components[name] = component
    return component

  def unregister(self, name: str) -> None:
    """Forgets component `name`, for one defined for a while (a test, a
    notebook cell run again with changes)."""
    self._components.pop(name, None)

  def lookup(self, name: str) -> Any:
    """The component `name`.

    Raises:
      ValueError: no such component (one line naming the choices).
    """
    if name not in self:
      raise ValueError(f"{self.kind}={name!r} is unknown; choose one of {sorted(self)}")
    return self[name]

  def __getitem__(self, name: str) -> Any:
    self._load()
    return self._components[name]

  def __iter__(self) -> Iterator[str]:
    self._load()
    return iter(sorted(self._components))

  def __len__(self) -> int:
    self._load()
    return len(self._components)

  def __repr__(self) -> str:
    return f"Registry({self.kind!r}, {sorted(self)})"

  def _load(self) -> None:
    if self._loaded:
      return
    self._loaded = True  # first: the imports below register into it
    try:
      importlib.import_module(self.builtin)
    except BaseException:
      self._loaded = False  # read again, the import tried again
      raise
    for entry in metadata.entry_points(group=self.group):
      try:
        loaded = entry.load()
        if not inspect.ismodule(loaded):  # a module registers its own
          self.register(loaded, name=entry.name)
      except Exception as e:  # noqa: BLE001 -- one broken plugin, not all
        warnings.warn(f"entry point {entry.name!r} of {self.group!r} "
                      f"({entry.value}) is left out: {e}")


def _same(a: Any, b: Any) -> bool:
  """One component, also when its module ran again (`importlib.reload`, a
  notebook cell run again): the same class name in the same module."""
  return a is b or (getattr(a, "__qualname__", None) == getattr(b, "__qualname__", 0)
                    and _where(a) == _where(b))


def _where(component: Any) -> str:
  return f"{getattr(component, '__module__', '?')}." + getattr(
      component, "__qualname__", type(component).__qualname__)


METHODS = Registry("method", "tff_privacy.algorithms", "tff_privacy.methods")
DEFENSES = Registry("defense", "tff_privacy.defenses", "tff_privacy.defenses")
ATTACKS = Registry("attack", "tff_privacy.attacks", "tff_privacy.attacks")
