"""Networks pre-trained here on bundled data, and their weights files.

Some parts need weights trained before a run: HyperFL-LPM's frozen backbone
(`tff_privacy.models.backbone`) and ROG's image prior
(`tff_privacy.attacks.rog`). Neither can be downloaded here, so each comes
from a weights file the user gives or, by default, is trained on first use
on a bundled data set and cached (`TFF_PRIVACY_CACHE`, default
`~/.cache/tff_privacy`). A weights file is an .npz of named float arrays
plus a JSON `__meta__` entry saying how it was made.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from typing import Callable

import numpy as np

CACHE_VARIABLE = "TFF_PRIVACY_CACHE"
_META = "__meta__"

Weights = dict[str, np.ndarray]


def save(path: str, weights: Weights, meta: dict) -> None:
  """Writes `weights` and `meta` to `path` (.npz) through a temp file."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, suffix=".npz")
  try:
    with os.fdopen(fd, "wb") as f:
      np.savez(f, **{_META: json.dumps(meta)}, **weights)
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


def load(path: str, parameter: str) -> Weights:
  """The arrays of weights file `path`; `ValueError` naming `parameter`
  (the option that gave the file) when it is missing or unreadable."""
  if not os.path.isfile(path):
    raise ValueError(f"{parameter}={path!r} is not a file")
  try:
    with np.load(path, allow_pickle=False) as data:
      return {k: data[k].astype(np.float32) for k in data.files if k != _META}
  except (OSError, ValueError) as e:
    raise ValueError(f"{parameter}={path!r} is not an .npz weights file "
                     f"({e})") from None


def metadata(path: str) -> dict:
  """The `meta` a weights file was saved with."""
  with np.load(path, allow_pickle=False) as data:
    return json.loads(str(data[_META])) if _META in data.files else {}


def cache_path(kind: str, key: dict) -> str:
  """Where the default weights of `kind` configured by `key` are cached."""
  folder = os.environ.get(CACHE_VARIABLE) or os.path.join(
      os.path.expanduser("~"), ".cache", "tff_privacy")
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
  return os.path.join(folder, kind, f"{digest[:16]}.npz")


_LOCK = threading.Lock()
_MEMO: dict[str, Weights] = {}


def cached(kind: str, key: dict, train: Callable[[], tuple[Weights, dict]],
           parameter: str) -> Weights:
  """The weights of `kind` for `key`: `train()` -> (weights, meta) on first
  use, saved to `cache_path(kind, key)`, then read from there. Training runs
  in a thread of its own, which executes eagerly even when the caller is
  building a TensorFlow graph."""
  path = cache_path(kind, key)
  with _LOCK:
    if path not in _MEMO:
      if not os.path.isfile(path):
        result = {}
        worker = threading.Thread(target=lambda: result.update(out=train()))
        worker.start()
        worker.join()
        if "out" not in result:
          raise RuntimeError(f"training the default {kind} ({key}) failed")
        weights, meta = result["out"]
        save(path, weights, {**meta, "key": key})
      _MEMO[path] = load(path, parameter)
    return _MEMO[path]


def resized(images: np.ndarray, input_shape) -> np.ndarray:
  """NHWC `images` resized (bilinear) to `input_shape` (height, width,
  channels), a grey channel repeated or colours averaged to match."""
  import tensorflow as tf
  height, width, channels = input_shape
  x = tf.image.resize(images, (height, width)).numpy()
  if x.shape[-1] != channels:
    x = (np.repeat(x[..., :1], channels, -1) if x.shape[-1] == 1
         else np.mean(x, -1, keepdims=True).repeat(channels, -1))
  return x.astype(np.float32)


def fingerprint(weights: Weights) -> str:
  """A short hash of the weights, to tell trained networks apart."""
  digest = hashlib.sha256()
  for name in sorted(weights):
    digest.update(name.encode())
    digest.update(np.ascontiguousarray(weights[name], np.float32).tobytes())
  return digest.hexdigest()[:16]
