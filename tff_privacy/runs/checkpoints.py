"""Resuming a run: its checkpoints, the rounds done, and the
configuration it was started with."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

import tensorflow_federated as tff

from tff_privacy import io, provenance
from tff_privacy.models.lpm import LPM_MODELS

if TYPE_CHECKING:  # annotations only: the config imports this module
  from tff_privacy.runs.config import RunConfig


_UNSET = object()  # a key that one config lacks


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
  """'key: OLD there, NEW now' for every key whose value differs between
  `old` and `new`, in key order; JSON objects on both sides compared key by
  key ('method_kwargs.local_epochs: ...')."""
  out = []
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key, _UNSET), new.get(key, _UNSET)
    if a == b:
      continue
    if isinstance(a, dict) and isinstance(b, dict):
      out.extend(differences(a, b, f"{prefix}{key}."))
    else:
      out.append(f"{prefix}{key}: {_shown(a)} there, {_shown(b)} now")
  return out


def _shown(value: Any) -> str:
  return "unset" if value is _UNSET else json.dumps(value)


def checkpoint_manager(out: str) -> tff.program.FileProgramStateManager:
  """The state manager of run folder `out` (it makes its folder)."""
  return tff.program.FileProgramStateManager(
      os.path.join(out, "checkpoints"), keep_total=2, keep_first=False)


def load_latest(manager, structure, config) -> tuple:
  """(the last checkpointed state, its round), or (None, 0).

  Raises:
    ValueError: naming the folder, for a checkpoint of a state of another
      form (one that another version of the method wrote)."""
  try:
    return asyncio.run(manager.load_latest(structure))
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"{os.path.join(config.out, 'checkpoints')}: its last checkpoint holds "
        f"another form of {config.method}'s state than this version's, so the "
        f"run cannot go on from it; remove that folder to train from round 1 "
        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def rounds_done(out: str) -> int:
  """The last round checkpointed in run folder `out`; 0 for none."""
  if not os.path.isdir(os.path.join(out, "checkpoints")):
    return 0
  return max(asyncio.run(checkpoint_manager(out).get_versions()) or [0])


def recorded_config(config: RunConfig) -> dict[str, Any]:
  """What config.json holds: `config.to_json()` and, under
  `provenance.KEY`, the code versions that trained the run's checkpointed
  rounds, this process's added when it has rounds left to train."""
  path = os.path.join(config.out, "config.json")
  done = rounds_done(config.out)
  saved = io.read_json(path) if done and os.path.exists(path) else {}
  earlier = provenance.versions_of(saved) if done else []
  now = [provenance.code_version()] if config.rounds > done else []
  return {**config.to_json(), provenance.KEY: provenance.merged(earlier, now)}


def pinned_as_saved(config: RunConfig) -> RunConfig:
  """`config` with the backbone fingerprint that the run in its folder
  recorded (config.json's model_kwargs), unless it gives its own: a resumed
  run refuses another backbone file."""
  path = os.path.join(config.out, "config.json")
  if "backbone_fingerprint" in config.model_kwargs or not os.path.isfile(path):
    return config
  saved = io.read_json(path).get("model_kwargs", {}).get("backbone_fingerprint")
  if config.model not in LPM_MODELS or saved is None:
    return config
  return dataclasses.replace(
      config, model_kwargs={**config.model_kwargs, "backbone_fingerprint": saved})
