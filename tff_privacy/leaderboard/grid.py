"""The leaderboard's grid: one protocol, one set of attacks, and the entries
(a method, optionally a defence, and the strengths it is swept over).

A grid is a JSON object; every key but `entries` has a default (the
protocol and the attacks take more keys than these):

```json
{"protocol": {"dataset": "mnist5k_parity", "model": "cnn", "rounds": 20},
 "attacks": {"inversion": ["ig"], "iterations": 200, "victims": 4,
             "attribute": "parity", "shadow_samples": 200},
 "reference": "FedSGD",
 "utility_target": 0.9,
 "entries": [
   {"name": "FedSGD", "method": "fedsgd"},
   {"name": "DP Gaussian", "method": "fedsgd", "defense": "ldp_gaussian",
    "defense_kwargs": {"clip": 1.0},
    "sweep": {"noise_multiplier": [0.01, 0.1, 1.0]}, "default": 0.1}]}
```

`protocol` holds the `RunConfig` fields every entry shares (an entry may
override some under its own "protocol", e.g. a method that needs its own
model); `sweep` names one parameter of the entry's defence or, failing that,
of its method, and the strengths it takes; `default` is the strength the
entry's paper uses (the first strength when not given). `utility_target` is a fraction of the `reference`
entry's utility: each swept entry's utility-matched row is the strength
whose utility is closest to it. An entry may name its own inversion attacks
("attacks": ["tailored_hyperfl"]) where the common ones cannot read its
uploads.

`equal_epsilon` ({"epsilon": 8, "delta": 1e-5} unless given; null: none)
puts every swept entry whose run has a DP guarantee at one target: the
leaderboard calibrates the swept strength at which the run's own accounting
spends that epsilon at that delta (`tff_privacy.dp.calibration`), and the
grid gets one more row per entry at that strength (`equal_epsilon_rows`).

Every row is also attacked by the adaptive attacks of its defence (its
client-side defence, else its method where the method is a defence, e.g.
FedRE; `tff_privacy.attacks.adaptive_attacks`): the attacks that know it.
`iterations` "source" runs each attack for its own default, the iteration
count at which its source reports results (`--scale full` does).

Which attacks run is not one of a row's settings: adding one attacks the
stored uploads again without retraining.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional

from tff_privacy import algorithms, defenses, io
from tff_privacy import attacks as inversion_attacks
from tff_privacy.attacks import ATTACKS
from tff_privacy.attacks import attribute as attribute_inference
from tff_privacy.attacks.adaptive import defense_name

PROTOCOL_KEYS = ("dataset", "model", "model_kwargs", "clients", "clients_per_round",
                 "rounds", "batch_size", "partition", "alpha", "samples_per_client",
                 "seed", "data_kwargs", "data_dir", "evaluate_every", "checkpoint_every",
                 "split_sha256")
# what the clients of TFF ClientData fix for every row (`with_client_data`)
CLIENT_DATA_KEYS = ("partition", "clients", "split_sha256")
ATTACK_DEFAULTS = {"inversion": ["ig"], "iterations": 200, "victims": 4,
                   "attribute": "parity", "adversaries": list(attribute_inference.ADVERSARIES),
                   "shadow_samples": 200, "capture_round": 1}
EQUAL_EPSILON = {"epsilon": 8.0, "delta": 1e-5}
# `iterations` that runs each attack for its own default, the iteration
# count at which its source reports results (see each attack's docstring)
SOURCE_ITERATIONS = "source"
ENTRY_KEYS = ("name", "method", "method_kwargs", "defense", "defense_kwargs",
              "sweep", "default", "protocol", "attacks")


@dataclasses.dataclass(frozen=True)
class Row:
  """One training run of the leaderboard: an entry at one strength."""

  entry: str
  key: str  # folder name under OUT/rows, unique in the grid
  method: str
  method_kwargs: dict
  defense: Optional[str]
  defense_kwargs: dict
  protocol: dict
  inversion: tuple  # every inversion attack of the row, the adaptive ones last
  parameter: Optional[str] = None  # the swept parameter
  strength: Any = None
  is_default: bool = True
  # the target {"epsilon", "delta"} of a row calibrated to it, else None
  equal_epsilon: Optional[dict] = None
  protocol_name: Optional[str] = None  # of the grid's `protocols`, if it has them
  replicate: int = 0  # which of the grid's `seeds` the row trains with
  first_seed_key: Optional[str] = None  # the key of its first seed's row

  @property
  def base_key(self) -> str:
    """The key of the row's first seed: the rows of one (protocol, entry,
    strength) share it, and the report pools them."""
    return self.first_seed_key or self.key

  @property
  def label(self) -> str:
    if self.parameter is None:
      return self.entry
    at = (f" at epsilon {self.equal_epsilon['epsilon']:g}" if self.equal_epsilon
          else "")
    return f"{self.entry}{at} ({self.parameter}={_shown(self.strength)})"

  @property
  def upload_defense(self) -> Optional[str]:
    """The defence the row's uploads go through
    (`tff_privacy.attacks.adaptive.defense_name`)."""
    return defense_name(self.method, self.defense)

  @property
  def adaptive(self) -> tuple:
    """The row's attacks that know its defence."""
    known = (inversion_attacks.adaptive_attacks(self.upload_defense)
             if self.upload_defense else [])
    return tuple(a for a in self.inversion if a in known)

  def run_config(self, out: str, capture_round: int):
    """The row's `runner.RunConfig`, writing to `out`, capturing one round."""
    from tff_privacy import runner
    return runner.RunConfig(
        out=out, method=self.method, method_kwargs=self.method_kwargs,
        defense=self.defense, defense_kwargs=self.defense_kwargs,
        capture_rounds=(capture_round,), **self.protocol)

  def settings(self) -> dict:
    """What makes the row's results; a cached row with other settings is
    not reused."""
    return io.canonical({k: v for k, v in dataclasses.asdict(self).items()
                         if k not in ("entry", "key", "is_default", "inversion",
                                      "equal_epsilon", "protocol_name", "replicate",
                                      "first_seed_key")})


@dataclasses.dataclass(frozen=True)
class Grid:
  protocol: dict
  attacks: dict
  reference: str
  utility_target: float
  entries: tuple
  equal_epsilon: Optional[dict]  # the target {"epsilon", "delta"}, or None
  # per swept entry (`calibration_key`), the leaderboard's calibration to
  # `equal_epsilon` (`board.calibrate`); None before it
  calibration: Optional[dict] = None
  # named changes of `protocol`, every row trained under each; None: one
  protocols: Optional[tuple] = None
  seeds: int = 1  # every row trained with seeds seed, seed + 1, ...

  def variants(self) -> list[tuple[Optional[str], "Grid"]]:
    """(name, grid) per protocol of `protocols` (the grid itself, named
    None, without them): each its protocol changed."""
    if self.protocols is None:
      return [(None, self)]
    return [(p["name"], dataclasses.replace(
        self, protocol={**self.protocol, **{k: v for k, v in p.items() if k != "name"}},
        protocols=None)) for p in self.protocols]

  def rows(self) -> list[Row]:
    rows = []
    for name, variant in self.variants():
      rows += [_named(row, name) for row in
               [r for entry in variant.entries for r in _expand(entry, variant)]
               + equal_epsilon_rows(variant, name)]
    first_seed = _seed(self.protocol) if self.seeds > 1 else None
    return [_seeded(row, i, first_seed) for row in rows for i in range(self.seeds)]

  def to_json(self) -> dict:
    return io.canonical({k: v for k, v in dataclasses.asdict(self).items()
                         if k != "calibration"})


def parse(data: Any, where: str = "grid") -> Grid:
  """The grid of a JSON object (see the module docstring).

  Raises:
    ValueError: one line naming the key and what it accepts.
  """
  if not isinstance(data, dict):
    raise ValueError(f"{where}: a grid is a JSON object, got {type(data).__name__}")
  unknown = sorted(set(data) - {"protocol", "attacks", "reference",
                                "utility_target", "equal_epsilon", "protocols",
                                "seeds", "entries"})
  if unknown:
    raise ValueError(f"{where}: unknown keys {unknown}; a grid has protocol, "
                     "attacks, reference, utility_target, equal_epsilon, "
                     "protocols, seeds and entries")
  protocol = _protocol(data.get("protocol", {}), f"{where} protocol")
  attacks = _attacks(data.get("attacks", {}), f"{where} attacks")
  entries = data.get("entries")
  if not isinstance(entries, list) or not entries:
    raise ValueError(f"{where} entries: a non-empty list of entries")
  entries = tuple(_entry(e, f"{where} entries[{i}]") for i, e in enumerate(entries))
  names = [e["name"] for e in entries]
  if len(set(names)) != len(names):
    raise ValueError(f"{where} entries: names must differ, got {names}")
  reference = data.get("reference", names[0])
  if reference not in names:
    raise ValueError(f"{where} reference: {reference!r} is not an entry's name; "
                     f"choose one of {names}")
  target = data.get("utility_target", 0.9)
  if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1:
    raise ValueError(f"{where} utility_target: a fraction of the reference's "
                     f"utility in (0, 1], got {target!r}")
  seeds = data.get("seeds", 1)
  if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
    raise ValueError(f"{where} seeds: an integer >= 1, got {seeds!r}")
  grid = Grid(protocol, attacks, reference, float(target), entries,
              _equal_epsilon(data.get("equal_epsilon", EQUAL_EPSILON),
                             f"{where} equal_epsilon"),
              protocols=_protocols(data.get("protocols"), f"{where} protocols"),
              seeds=seeds)
  for row in grid.rows():
    try:
      row.run_config("unused", attacks["capture_round"])
    except ValueError as e:
      raise ValueError(f"{where} ({row.label}): {e}") from None
  keys = [r.key for r in grid.rows()]
  if len(set(keys)) != len(keys):
    raise ValueError(f"{where} entries: two rows share a folder name "
                     f"({sorted(k for k in keys if keys.count(k) > 1)[0]}); "
                     "rename an entry")
  return grid


def with_equal_epsilon(grid: Grid, epsilon) -> Grid:
  """`grid` with equal-epsilon rows at `epsilon` (False: none), at its
  target's delta where it has one, else `EQUAL_EPSILON`'s."""
  if epsilon is False:
    return dataclasses.replace(grid, equal_epsilon=None, calibration=None)
  delta = (grid.equal_epsilon or EQUAL_EPSILON)["delta"]
  return dataclasses.replace(grid, equal_epsilon=_equal_epsilon(
      {"epsilon": epsilon, "delta": delta}, "--equal-epsilon"), calibration=None)


def only(grid: Grid, names: list[str]) -> Grid:
  """`grid` with the entries `names` and its reference entry only.

  Raises:
    ValueError: a name that is not an entry's, in one line with the names.
  """
  known = [e["name"] for e in grid.entries]
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(f"--entries: {', '.join(map(repr, unknown))} is not an entry of "
                     f"the grid; choose from {', '.join(known)}")
  kept = {*names, grid.reference}
  return dataclasses.replace(grid, entries=tuple(e for e in grid.entries
                                                 if e["name"] in kept))


def with_client_data(grid: Grid, train_data, test_data):
  """`grid` on the clients of TFF ClientData `train_data` and `test_data`
  (`runner.with_client_data`, samples of the protocol's data set), and
  those clients as each row reads them ({`data_key`: FederatedData}: a row
  whose data_kwargs normalise the samples gets them normalised): the
  protocol records partition 'client_data', their number and SHA-256 (as
  the first row reads them), so a leaderboard folder holds one federation.

  Raises:
    ValueError: in one line, for an entry that sets its own clients, a
      grid attacking a sensitive attribute (ClientData carries none), or
      a row the clients do not fit (e.g. more clients per round).
  """
  from tff_privacy import runner
  for entry in grid.entries:
    fixed = sorted(set(entry["protocol"]) & {"dataset", *CLIENT_DATA_KEYS})
    if fixed:
      raise ValueError(f"entry {entry['name']!r} protocol: {', '.join(fixed)} "
                       "come from the ClientData for every entry; remove them")
  if grid.attacks["attribute"] is not None:
    raise ValueError(f"attacks attribute: {grid.attacks['attribute']!r} is not in "
                     "ClientData, which carries no sensitive attributes; set it to null")
  federations, first = {}, None
  for row in grid.rows():
    if data_key(row) not in federations:
      config, federations[data_key(row)] = runner.with_client_data(
          row.run_config("unused", grid.attacks["capture_round"]), train_data,
          test_data)
      first = first or config
  protocol = {**grid.protocol, **{k: getattr(first, k) for k in CLIENT_DATA_KEYS}}
  return parse(dataclasses.replace(grid, protocol=protocol).to_json(),
               "grid on the ClientData"), federations


def data_key(row: Row) -> str:
  """The data folder and options a row reads the samples of ClientData
  with: its federation's key in `with_client_data`'s."""
  protocol = row.protocol
  return json.dumps([protocol.get("data_dir"), protocol.get("data_kwargs") or {}],
                    sort_keys=True)


def load(path: str) -> Grid:
  """The grid in JSON file `path`."""
  try:
    with open(path) as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"config {path}: not JSON ({e})") from None
  return parse(data, f"config {path}")


def _object(value: Any, where: str, accepted, what: str) -> dict:
  """`value` as a dict, refused unless a JSON object with `accepted` keys."""
  if not isinstance(value, dict):
    raise ValueError(f"{where}: a JSON object of {what}")
  unknown = sorted(set(value) - set(accepted))
  if unknown:
    raise ValueError(f"{where}: unknown keys {unknown}; accepted: {', '.join(accepted)}")
  return dict(value)


def _protocol(protocol: Any, where: str) -> dict:
  return _object(protocol, where, PROTOCOL_KEYS, "run settings")


def _attacks(attacks: Any, where: str) -> dict:
  merged = {**ATTACK_DEFAULTS, **_object(attacks, where, ATTACK_DEFAULTS, "attack settings")}
  _check_inversion(merged["inversion"], f"{where} inversion")
  for key, least in (("iterations", 1), ("victims", 1), ("shadow_samples", 2),
                     ("capture_round", 1)):
    value = merged[key]
    if key == "iterations" and value == SOURCE_ITERATIONS:
      continue
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise ValueError(f"{where} {key}: an integer >= {least}"
                       + (f" or {SOURCE_ITERATIONS!r}" if key == "iterations" else "")
                       + f", got {value!r}")
  wrong = sorted(set(merged["adversaries"]) - set(attribute_inference.ADVERSARIES))
  if wrong or not merged["adversaries"]:
    raise ValueError(f"{where} adversaries: choose from "
                     f"{', '.join(attribute_inference.ADVERSARIES)}, got "
                     f"{merged['adversaries']!r}")
  if merged["attribute"] is not None and not isinstance(merged["attribute"], str):
    raise ValueError(f"{where} attribute: a sensitive attribute's name or null")
  return merged


def _protocols(protocols: Any, where: str) -> Optional[tuple]:
  """The named protocol changes, checked; None for none."""
  if protocols is None:
    return None
  if not isinstance(protocols, list) or not protocols:
    raise ValueError(f"{where}: a non-empty list of protocol changes, each with a "
                     "name, e.g. [{\"name\": \"CNN, batch 8\", \"model\": \"cnn\", "
                     "\"batch_size\": 8}], or null")
  checked = []
  for i, change in enumerate(protocols):
    change = _object(change, f"{where}[{i}]", ("name", *PROTOCOL_KEYS),
                     "a protocol's name and run settings")
    if not isinstance(change.get("name"), str) or not slug(change["name"]):
      raise ValueError(f"{where}[{i}] name: a non-empty name with a letter or digit")
    checked.append(change)
  names = [slug(c["name"]) for c in checked]
  if len(set(names)) != len(names):
    raise ValueError(f"{where}: names must differ in their letters and digits, "
                     f"got {[c['name'] for c in checked]}")
  return tuple(checked)


def _equal_epsilon(target: Any, where: str) -> Optional[dict]:
  """The target of the equal-epsilon rows, defaults filled in; None for none."""
  if target is None:
    return None
  target = {**EQUAL_EPSILON, **_object(target, where, EQUAL_EPSILON,
                                       "the target epsilon and delta, or null")}
  epsilon, delta = target["epsilon"], target["delta"]
  if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not (
      0 < epsilon < float("inf")):
    raise ValueError(f"{where} epsilon: a number > 0, got {epsilon!r}")
  if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
    raise ValueError(f"{where} delta: a number in (0, 1), got {delta!r}")
  return {"epsilon": float(epsilon), "delta": float(delta)}


def _check_inversion(names: Any, where: str) -> None:
  if not isinstance(names, list) or not names or any(n not in ATTACKS for n in names):
    raise ValueError(f"{where}: a list of attacks from {sorted(ATTACKS)}, got {names!r}")


def _entry(entry: Any, where: str) -> dict:
  entry = _object(entry, where, ENTRY_KEYS, "an entry's settings, with name and method")
  for key in ("name", "method"):
    if not isinstance(entry.get(key), str) or not entry[key]:
      raise ValueError(f"{where} {key}: a non-empty string")
  where = f"{where} ({entry['name']})"
  entry = {"method_kwargs": {}, "defense": None, "defense_kwargs": {},
           "sweep": None, "default": None, "protocol": {}, "attacks": None, **entry}
  try:
    algorithms.method(entry["method"])
    if entry["defense"] is not None:
      defenses.defense_class(entry["defense"])
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  _protocol(entry["protocol"], f"{where} protocol")
  if entry["attacks"] is not None:
    _check_inversion(entry["attacks"], f"{where} attacks")
  sweep = entry["sweep"]
  if sweep is not None:
    if (not isinstance(sweep, dict) or len(sweep) != 1
        or not isinstance(next(iter(sweep.values())), list)
        or not next(iter(sweep.values()))):
      raise ValueError(f"{where} sweep: one parameter and its list of "
                       "strengths, e.g. {\"noise_multiplier\": [0.01, 0.1]}")
    (name, values), = sweep.items()
    _swept_kwargs(entry, name, where)
    if entry["default"] is None:
      entry["default"] = values[0]
    elif entry["default"] not in values:
      raise ValueError(f"{where} default: {entry['default']!r} is not one of "
                       f"the strengths {values}")
  elif entry["default"] is not None:
    raise ValueError(f"{where} default: a strength of the entry's sweep, and "
                     "the entry has no sweep")
  for value in _strengths(entry):
    _resolve(entry, value, where)
  return entry


def _swept_kwargs(entry: dict, name: str, where: str) -> str:
  """'defense_kwargs' or 'method_kwargs': whose parameter `name` is."""
  if entry["defense"] is not None and name in defenses.defense_class(
      entry["defense"]).PARAMETERS.names:
    return "defense_kwargs"
  if name in algorithms.method(entry["method"]).parameters.names:
    return "method_kwargs"
  raise ValueError(f"{where} sweep: {name!r} is a parameter of neither the "
                   f"defence nor method {entry['method']!r}")


def _strengths(entry: dict) -> list:
  return [None] if entry["sweep"] is None else next(iter(entry["sweep"].values()))


def _resolve(entry: dict, strength: Any, where: str) -> tuple[dict, dict]:
  """The entry's method and defence kwargs at `strength`, checked."""
  kwargs = {"method_kwargs": dict(entry["method_kwargs"]),
            "defense_kwargs": dict(entry["defense_kwargs"])}
  if strength is not None:
    name = next(iter(entry["sweep"]))
    kwargs[_swept_kwargs(entry, name, where)][name] = strength
  try:
    algorithms.method(entry["method"]).resolve(kwargs["method_kwargs"])
    if entry["defense"] is not None:
      defenses.resolve(entry["defense"], kwargs["defense_kwargs"])
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  return kwargs["method_kwargs"], kwargs["defense_kwargs"]


def _expand(entry: dict, grid: Grid) -> list[Row]:
  return [_row(entry, grid, strength) for strength in _strengths(entry)]


def _row(entry: dict, grid: Grid, strength: Any) -> Row:
  """The entry's row at `strength` (None: the entry is not swept)."""
  parameter = None if entry["sweep"] is None else next(iter(entry["sweep"]))
  method_kwargs, defense_kwargs = _resolve(entry, strength, entry["name"])
  key = slug(entry["name"]) + ("" if strength is None else
                                f"__{slug(parameter)}-{slug(_shown(strength))}")
  return Row(
      entry=entry["name"], key=key, method=entry["method"],
      method_kwargs=method_kwargs, defense=entry["defense"],
      defense_kwargs=defense_kwargs,
      protocol={**grid.protocol, **entry["protocol"]},
      inversion=_with_adaptive(entry, grid), parameter=parameter,
      strength=strength, is_default=strength is None or strength == entry["default"])


def equal_epsilon_row(entry: dict, grid: Grid, strength: Any) -> Row:
  """The swept `entry`'s equal-epsilon row at `strength`: its run reports
  epsilon at the target delta; folder <entry>__eps-<target epsilon>.

  Raises:
    ValueError: in one line, a strength the entry's parameter refuses.
  """
  target, row = grid.equal_epsilon, _row(entry, grid, strength)
  return dataclasses.replace(
      row, key=f"{slug(entry['name'])}__eps-{slug(_shown(target['epsilon']))}",
      protocol={**row.protocol, "dp_delta": target["delta"]}, is_default=False,
      equal_epsilon=dict(target))


def equal_epsilon_rows(grid: Grid, protocol_name: Optional[str] = None) -> list[Row]:
  """The equal-epsilon rows of a grid's variant (`Grid.variants`): one per
  entry that `grid.calibration` gives a strength (none before the
  leaderboard calibrated it)."""
  if grid.equal_epsilon is None:
    return []
  found = grid.calibration or {}
  keys = {e["name"]: calibration_key(protocol_name, e) for e in grid.entries}
  return [equal_epsilon_row(entry, grid, found[keys[entry["name"]]]["strength"])
          for entry in grid.entries
          if found.get(keys[entry["name"]], {}).get("strength") is not None]


def calibration_key(protocol_name: Optional[str], entry: dict) -> str:
  """An entry's key in `Grid.calibration`: its name, after its protocol's
  where the grid has several."""
  return entry["name"] if protocol_name is None else f"{protocol_name}/{entry['name']}"


def _named(row: Row, protocol_name: Optional[str]) -> Row:
  """`row` under the grid's protocol `protocol_name` (None: the only one),
  its folder prefixed with the protocol's."""
  if protocol_name is None:
    return row
  return dataclasses.replace(row, key=f"{slug(protocol_name)}__{row.key}",
                             protocol_name=protocol_name)


def _seeded(row: Row, replicate: int, first_seed: Optional[int]) -> Row:
  """`row` trained with seed `first_seed` + `replicate` (None: the one
  seed of a grid with one); the first keeps the row's folder, so that a
  grid given more seeds reuses its rows."""
  if replicate == 0:
    return row
  return dataclasses.replace(
      row, key=f"{row.key}__seed-{replicate}", replicate=replicate,
      first_seed_key=row.key,
      protocol={**row.protocol, "seed": row.protocol.get("seed", first_seed) + replicate})


def _seed(protocol: dict) -> int:
  """The seed of a run with `protocol` (the runner's default unless set)."""
  from tff_privacy import runner
  return protocol.get("seed", runner.RunConfig.__dataclass_fields__["seed"].default)


def _with_adaptive(entry: dict, grid: Grid) -> tuple:
  """The entry's inversion attacks (its own, else the grid's), then the
  adaptive attacks of its defence that are not among them."""
  named = list(entry["attacks"] or grid.attacks["inversion"])
  defense = defense_name(entry["method"], entry["defense"])
  adaptive = inversion_attacks.adaptive_attacks(defense) if defense else []
  return tuple(named + [a for a in adaptive if a not in named])


def _shown(strength: Any) -> str:
  return f"{strength:g}" if isinstance(strength, (int, float)) else str(strength)


def slug(text: str) -> str:
  """`text` as a folder name: lower-case letters, digits, dots and dashes."""
  return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")
