"""Per-channel mean/std normalisation of images, a data set option.

`normalize` in a data set's `data_kwargs` is a preset name (`PRESETS`) or
`[means, stds]`, one number per channel. The model then sees
(x - mean) / std of the [0, 1] images; the run records the constants in
the update store's metadata (`to_json`) so that attacks search in the
normalised space's valid range (`input_bounds`) and score their
reconstructions in pixel space (`to_pixels`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional

import numpy as np

# the published training-set statistics of [0, 1] pixels
PRESETS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}
ACCEPTED = (f"a preset ({', '.join(PRESETS)}) or [means, stds] with one "
            "number per channel, stds > 0")


@dataclasses.dataclass(frozen=True)
class Normalization:
  """x -> (x - mean) / std per channel (the last axis)."""

  mean: tuple[float, ...]
  std: tuple[float, ...]

  def apply(self, x: np.ndarray) -> np.ndarray:
    """(x - mean) / std, float32."""
    return ((np.asarray(x, np.float32) - np.float32(self.mean))
            / np.float32(self.std)).astype(np.float32)

  def undo(self, x: np.ndarray) -> np.ndarray:
    """x * std + mean: normalised inputs back in pixel units."""
    return np.asarray(x) * np.float32(self.std) + np.float32(self.mean)

  def to_json(self) -> dict[str, list[float]]:
    return {"mean": list(self.mean), "std": list(self.std)}


def parse(value: Any) -> Any:
  """Checks a `normalize` option: a preset name, or [means, stds] of equal
  length with finite numbers and stds > 0 (returned as lists of floats).

  Raises:
    ValueError: in one line, naming `normalize` and what it accepts.
  """
  if isinstance(value, str):
    if value not in PRESETS:
      raise ValueError(f"normalize={value!r} is no preset; give {ACCEPTED}")
    return value
  pair = (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(v, (list, tuple)) and v for v in value))
  numbers_ok = pair and all(
      isinstance(n, numbers.Real) and not isinstance(n, bool)
      and math.isfinite(n) for v in value for n in v)
  if not numbers_ok or len(value[0]) != len(value[1]):
    raise ValueError(f"normalize must be {ACCEPTED}, got {value!r}")
  if min(value[1]) <= 0:
    raise ValueError(f"normalize: every std must be > 0, got {list(value[1])}")
  return [[float(n) for n in v] for v in value]


def resolve(value: Any, channels: int) -> Optional[Normalization]:
  """The `Normalization` of a checked `normalize` option (None: none) for
  images of `channels` channels.

  Raises:
    ValueError: naming `normalize` when its channels are not `channels`.
  """
  if value is None:
    return None
  mean, std = PRESETS[value] if isinstance(value, str) else value
  if len(mean) != channels:
    raise ValueError(f"normalize={value!r} has {len(mean)} channel(s); the "
                     f"images have {channels}")
  return Normalization(tuple(mean), tuple(std))


def of_metadata(metadata: dict[str, Any]) -> Optional[Normalization]:
  """The normalisation recorded in a store's run metadata, if any."""
  recorded = metadata.get("normalize")
  if recorded is None:
    return None
  return Normalization(tuple(recorded["mean"]), tuple(recorded["std"]))


def input_bounds(metadata: dict[str, Any]) -> tuple[Any, Any]:
  """The range of the model's inputs: the recorded `value_range` as two
  floats, or, for a normalised run, its image under the normalisation, one
  bound per channel (float32 arrays that broadcast over NHWC images)."""
  lo, hi = metadata["value_range"]
  norm = of_metadata(metadata)
  if norm is None:
    return float(lo), float(hi)
  return norm.apply(np.float32(lo)), norm.apply(np.float32(hi))


def to_pixels(x: np.ndarray, metadata: dict[str, Any]) -> np.ndarray:
  """Inputs of the model as images in the recorded value range: the
  normalisation undone where the run normalised."""
  norm = of_metadata(metadata)
  return np.asarray(x) if norm is None else norm.undo(x)

