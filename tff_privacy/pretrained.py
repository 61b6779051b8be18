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
import zipfile
from typing import Callable, Optional

import numpy as np

CACHE_VARIABLE = "TFF_PRIVACY_CACHE"
# the bundled data sets a default network may be trained on
BUNDLED_DATASETS = ("digits", "mnist5k", "lfw_subset")
# data sets that hold each other's images
_SAME_IMAGES = ({"mnist5k", "mnist"},)
_META = "__meta__"

Weights = dict[str, np.ndarray]


def check_dataset(parameter: str, dataset: str,
                  task_dataset: Optional[str]) -> None:
  """Raises `ValueError` naming `parameter` unless `dataset` is a bundled
  data set that shares no images with `task_dataset` (the data a network
  trained on it will be applied to)."""
  if dataset not in BUNDLED_DATASETS:
    raise ValueError(f"{parameter}={dataset!r}; choose one of "
                     f"{', '.join(BUNDLED_DATASETS)}")
  overlapping = dataset == task_dataset or any(
      {dataset, task_dataset} <= group for group in _SAME_IMAGES)
  if overlapping:
    others = [d for d in BUNDLED_DATASETS if d != dataset]
    raise ValueError(f"{parameter}={dataset!r} shares its images with the "
                     f"federated data set {task_dataset!r}; choose another "
                     f"({', '.join(others)}) or give a weights file")


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
    data = np.load(path, allow_pickle=False)
    if not isinstance(data, np.lib.npyio.NpzFile):
      raise ValueError("a single array, not named arrays")
    with data:
      return {k: data[k].astype(np.float32) for k in data.files if k != _META}
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
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


def cached(kind: str, key: dict,
           train: Callable[[], tuple[Weights, dict]]) -> Weights:
  """The weights of `kind` for `key`: `train()` -> (weights, meta) on first
  use, saved to `cache_path(kind, key)`, then read from there. Training runs
  in a thread of its own, which executes eagerly even when the caller is
  building a TensorFlow graph; its errors are raised here."""
  path = cache_path(kind, key)
  with _LOCK:
    if path not in _MEMO:
      if not os.path.isfile(path):
        result = {}

        def work():
          try:
            result["out"] = train()
          except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        if "error" in result:
          raise result["error"]
        weights, meta = result["out"]
        save(path, weights, {**meta, "key": key})
      try:
        _MEMO[path] = load(path, "cache file")
      except ValueError:
        raise ValueError(f"the cached {kind} file {path} is unreadable; delete "
                         "it to train it again") from None
    return _MEMO[path]


def he_normal(shapes: dict[str, tuple[int, ...]],
              rng: np.random.Generator) -> Weights:
  """He-normal kernels (fan-in: every axis but the last), zero biases."""
  out = {}
  for name, shape in shapes.items():
    if name.endswith("bias"):
      out[name] = np.zeros(shape, np.float32)
    else:
      std = np.sqrt(2.0 / np.prod(shape[:-1]))
      out[name] = (std * rng.standard_normal(shape)).astype(np.float32)
  return out


def check_shapes(weights: Weights, shapes: dict[str, tuple[int, ...]],
                 origin: str, what: str) -> None:
  """Raises `ValueError` naming `origin` unless `weights` has exactly the
  names and shapes of `shapes` (the architecture `what` describes)."""
  missing = sorted(set(shapes) - set(weights))
  extra = sorted(set(weights) - set(shapes))
  if missing or extra:
    raise ValueError(f"{origin}: not {what} (missing {missing[:3]}, unexpected "
                     f"{extra[:3]})")
  for name, shape in shapes.items():
    if tuple(weights[name].shape) != tuple(shape):
      raise ValueError(f"{origin}: {name} has shape {weights[name].shape}, "
                       f"{what} needs {tuple(shape)}")


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


class FingerprintMismatch(ValueError):
  """Weights other than those a run or record was made with."""


def check_fingerprint(weights: Weights, expected: Optional[str],
                      origin: str) -> None:
  """Raises `FingerprintMismatch` naming `origin` (the weights' file) unless
  `expected` is None or the `fingerprint` of `weights`."""
  actual = fingerprint(weights)
  if expected is not None and actual != expected:
    raise FingerprintMismatch(
        f"{origin}: the weights file's fingerprint {actual} differs from "
        f"{expected}, the one the run or record was made with")
