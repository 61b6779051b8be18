"""The update store: what clients uploaded, one checksummed record per
(round, client), readable without running any code.

Layout under the store's root::

```text
manifest.json               format, run metadata, one entry per file
round_0001/broadcast.npz    the global model the server broadcast that round
round_0001/client_0007.npz  client 7's upload, tensors t000, t001, ... in the
                            model's trainable-variable order
round_0001/sent_0007.npz    instead of broadcast.npz, for methods whose
                            server sends each client its own model (pFedHN):
                            what client 7 received
```

Each client's manifest entry also holds its aggregation weight and the number
of examples behind its upload (the distinct samples the client computed on
this round), two different facts: FedEM weighs every client 1, FedAvg by the
examples of every local epoch.

The run metadata holds the public facts of the protocol an attacker may use:
method, upload kind, model builder and arguments, data set and its value range
(and, for normalised data, the per-channel mean and std under 'normalize'),
learning rates, local epochs or steps, batch size. Records are `np.savez`
files read with `allow_pickle=False`; every read reads a file once and
checks the SHA-256 of the bytes it loads, the tensor names, shapes and
dtypes against the manifest and names the file that is wrong, and reads no
file outside the store (a manifest path with '..', an absolute one, or a
symbolic link out of the store is refused).

The clients' true samples (for scoring attacks only), and their sensitive
attributes where the data set has them, live in a separate
`GroundTruthStore` with the same checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import zipfile
from io import BytesIO
from typing import Any

import numpy as np

from tff_privacy import io
from tff_privacy.models import ModelSpec

FORMAT = "tff_privacy.updates/2"
GROUND_TRUTH_FORMAT = "tff_privacy.ground_truth/1"
_ATTRIBUTE_PREFIX = "attribute_"


class UpdateStoreError(ValueError):
  """A record is missing, tampered with, truncated or does not match."""


@dataclasses.dataclass(frozen=True)
class UpdateRecord:
  """One client's upload in one round, with what the server knew about it."""

  round_num: int
  client_index: int
  client_id: str
  upload: list[np.ndarray]
  weight: float            # the server's aggregation weight
  num_examples: int        # distinct samples behind the upload
  broadcast: list[np.ndarray]
  metadata: dict[str, Any]

  @property
  def upload_kind(self) -> str:
    return self.metadata["upload_kind"]

  @property
  def model_spec(self) -> ModelSpec:
    return ModelSpec.from_json(self.metadata["model"])


def _tensor_specs(arrays, names=None) -> list[dict[str, Any]]:
  specs = [{"shape": list(a.shape), "dtype": str(a.dtype)} for a in arrays]
  for spec, name in zip(specs, names or []):
    spec["name"] = name
  return specs


def _round_dir(round_num: int) -> str:
  return f"round_{round_num:04d}"


class _ChecksummedDir:
  """A folder of npz files listed, with checksums, in `manifest.json`."""

  def __init__(self, root: str, fmt: str):
    self.root = root
    self.format = fmt
    self.manifest_path = os.path.join(root, "manifest.json")

  def manifest(self) -> dict[str, Any]:
    if not os.path.exists(self.manifest_path):
      raise UpdateStoreError(f"{self.manifest_path}: no manifest (not a store?)")
    try:
      manifest = io.read_json(self.manifest_path)
    except ValueError as e:
      raise UpdateStoreError(f"{self.manifest_path}: unreadable manifest: {e}")
    if manifest.get("format") != self.format:
      raise UpdateStoreError(f"{self.manifest_path}: format "
                             f"{manifest.get('format')!r}, expected {self.format!r}")
    return manifest

  def manifest_or_new(self, run: dict[str, Any]) -> dict[str, Any]:
    if os.path.exists(self.manifest_path):
      return self.manifest()
    return {"format": self.format, "run": run, "rounds": {}}

  def put(self, relpath: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    path = os.path.join(self.root, relpath)
    digest = io.write_npz(path, arrays)
    return {"file": relpath, "sha256": digest,
            "arrays": {k: {"shape": list(np.shape(v)), "dtype": str(np.asarray(v).dtype)}
                       for k, v in arrays.items()}}

  def _path(self, entry: dict[str, Any]) -> str:
    """The file `entry` names, refused unless it resolves (symbolic links
    followed) to a file inside the store: its checksum, kept in the same
    manifest, cannot vouch for a file elsewhere."""
    relpath = entry.get("file")
    root = os.path.realpath(self.root)
    inside = isinstance(relpath, str) and not os.path.isabs(relpath)
    if inside:
      resolved = os.path.realpath(os.path.join(root, relpath))
      inside = os.path.commonpath([root, resolved]) == root
    if not inside:
      raise UpdateStoreError(f"{self.manifest_path}: entry {relpath!r} lies "
                             "outside the store; a store reads its own files only")
    return resolved

  def get(self, entry: dict[str, Any]) -> dict[str, np.ndarray]:
    resolved = self._path(entry)
    path = os.path.join(self.root, entry["file"])
    if not os.path.isfile(resolved):
      raise UpdateStoreError(f"{path}: file listed in the manifest is missing")
    with open(resolved, "rb") as f:
      raw = f.read()  # read once: the bytes checked are the bytes loaded
    if hashlib.sha256(raw).hexdigest() != entry["sha256"]:
      raise UpdateStoreError(f"{path}: SHA-256 does not match the manifest "
                             "(file changed or truncated)")
    try:
      with np.load(BytesIO(raw), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    except (ValueError, OSError, zipfile.BadZipFile) as e:
      raise UpdateStoreError(f"{path}: not a readable npz file: {e}")
    expected = entry["arrays"]
    if sorted(arrays) != sorted(expected):
      raise UpdateStoreError(f"{path}: holds arrays {sorted(arrays)}, manifest "
                             f"lists {sorted(expected)}")
    for name, spec in expected.items():
      a = arrays[name]
      if list(a.shape) != spec["shape"] or str(a.dtype) != spec["dtype"]:
        raise UpdateStoreError(
            f"{path}: array {name} is {a.dtype}{list(a.shape)}, manifest says "
            f"{spec['dtype']}{spec['shape']}")
    return arrays


def _tensors(arrays: dict[str, np.ndarray], path: str, specs) -> list[np.ndarray]:
  tensors = [arrays[f"t{i:03d}"] for i in range(len(specs))]
  for i, (t, spec) in enumerate(zip(tensors, specs)):
    if list(t.shape) != spec["shape"] or str(t.dtype) != spec["dtype"]:
      raise UpdateStoreError(f"{path}: tensor t{i:03d} is {t.dtype}{list(t.shape)}"
                             f" but the model needs {spec['dtype']}{spec['shape']}")
  return tensors


def _as_arrays(tensors) -> dict[str, np.ndarray]:
  return {f"t{i:03d}": np.asarray(t) for i, t in enumerate(tensors)}


class UpdateStore:
  """Reads and writes captured client uploads (see the module docstring)."""

  def __init__(self, root: str):
    self._dir = _ChecksummedDir(root, FORMAT)
    self.root = root

  def write_round(self, round_num: int, broadcast: list[np.ndarray] | None,
                  uploads: list[tuple[int, str, list[np.ndarray], float, int]],
                  run_metadata: dict[str, Any],
                  sent: dict[int, list[np.ndarray]] | None = None,
                  defense_round: dict[str, Any] | None = None) -> None:
    """Writes round `round_num`: the broadcast model and, for each uploading
    client, `(client_index, client_id, tensors, weight, num_examples)`; or,
    with `broadcast` None, what each client was sent (`sent`, by client
    index). `defense_round`: the public facts of this round's client
    defence (RECUP-FL's zoo fingerprints), which every record of the round
    carries as metadata['defense_round'].

    Every round of a store belongs to one run: its metadata, compared after a
    JSON round-trip (tuples and lists alike), must match the manifest's."""
    if (broadcast is None) == (sent is None):
      raise ValueError("give either broadcast or sent")
    names = ModelSpec.from_json(run_metadata["model"]).variable_names()
    model = broadcast if broadcast is not None else next(iter(sent.values()))
    run = io.canonical(dict(run_metadata, tensors=_tensor_specs(model, names)))
    manifest = self._dir.manifest_or_new(run)
    if manifest["run"] != run:
      raise UpdateStoreError(f"{self._dir.manifest_path}: belongs to a different "
                             "run (metadata differs); use a new directory")
    rdir = _round_dir(round_num)
    entry = {"clients": {}}
    if defense_round:
      entry["defense_round"] = defense_round
    if broadcast is not None:
      entry["broadcast"] = self._dir.put(f"{rdir}/broadcast.npz",
                                         _as_arrays(broadcast))
    for index, cid, tensors, weight, num_examples in uploads:
      own = [] if sent is None else [sent[index]]
      for arrays in [tensors] + own:
        if _tensor_specs(arrays, names) != run["tensors"]:
          raise UpdateStoreError(f"upload of client {index} in round {round_num} "
                                 "does not match the model's tensors")
      client = self._dir.put(f"{rdir}/client_{index:04d}.npz", _as_arrays(tensors))
      if own:
        client["sent"] = self._dir.put(f"{rdir}/sent_{index:04d}.npz",
                                       _as_arrays(own[0]))
      entry["clients"][str(index)] = dict(client, client_id=cid,
                                          weight=float(weight),
                                          num_examples=int(num_examples))
    manifest["rounds"][str(round_num)] = entry
    io.write_json(self._dir.manifest_path, manifest)

  def manifest(self) -> dict[str, Any]:
    return self._dir.manifest()

  def rounds(self) -> list[int]:
    return sorted(int(r) for r in self.manifest()["rounds"])

  def clients(self, round_num: int) -> list[int]:
    return sorted(int(c) for c in self._round(self.manifest(), round_num)["clients"])

  def _round(self, manifest, round_num: int) -> dict[str, Any]:
    try:
      return manifest["rounds"][str(round_num)]
    except KeyError:
      raise UpdateStoreError(
          f"{self._dir.manifest_path}: no round {round_num}; captured rounds: "
          f"{sorted(int(r) for r in manifest['rounds'])}") from None

  def read(self, round_num: int, client_index: int) -> UpdateRecord:
    """Loads and validates the record of `client_index` in `round_num`."""
    manifest = self.manifest()
    entry = self._round(manifest, round_num)
    client = entry["clients"].get(str(client_index))
    if client is None:
      raise UpdateStoreError(
          f"{self._dir.manifest_path}: round {round_num} has no client "
          f"{client_index}; captured: {sorted(int(c) for c in entry['clients'])}")
    specs = manifest["run"]["tensors"]
    sent = client.get("sent", entry.get("broadcast"))
    broadcast = _tensors(self._dir.get(sent), sent["file"], specs)
    upload = _tensors(self._dir.get(client), client["file"], specs)
    metadata = dict(manifest["run"], round=round_num, client_index=client_index,
                    client_id=client["client_id"])
    if "defense_round" in entry:
      metadata["defense_round"] = entry["defense_round"]
    return UpdateRecord(round_num, client_index, client["client_id"], upload,
                        client["weight"], client["num_examples"], broadcast,
                        metadata)

  def records(self, round_num: int) -> list[UpdateRecord]:
    return [self.read(round_num, c) for c in self.clients(round_num)]


class GroundTruthStore:
  """The samples each captured client really used; read only for scoring."""

  def __init__(self, root: str):
    self._dir = _ChecksummedDir(root, GROUND_TRUTH_FORMAT)
    self.root = root

  def write_round(self, round_num: int, samples: list[tuple],
                  run_metadata: dict[str, Any]) -> None:
    """Writes `(client_index, x, y)` or `(client_index, x, y, attributes)`
    for each client, samples in the order the client used them;
    `attributes` maps a sensitive attribute's name to its class index per
    sample (`read_attributes`)."""
    manifest = self._dir.manifest_or_new(io.canonical(run_metadata))
    rdir = _round_dir(round_num)
    entries = {}
    for index, x, y, *extra in samples:
      arrays = {"x": x, "y": y}
      for name, values in (extra[0] if extra else {}).items():
        arrays[_ATTRIBUTE_PREFIX + name] = np.asarray(values, np.int32)
      entries[str(index)] = self._dir.put(f"{rdir}/client_{index:04d}.npz", arrays)
    manifest["rounds"][str(round_num)] = entries
    io.write_json(self._dir.manifest_path, manifest)

  def _arrays(self, round_num: int, client_index: int) -> dict[str, np.ndarray]:
    manifest = self._dir.manifest()
    try:
      entry = manifest["rounds"][str(round_num)][str(client_index)]
    except KeyError:
      raise UpdateStoreError(f"{self._dir.manifest_path}: no ground truth for "
                             f"round {round_num}, client {client_index}") from None
    return self._dir.get(entry)

  def read(self, round_num: int, client_index: int) -> tuple[np.ndarray, np.ndarray]:
    arrays = self._arrays(round_num, client_index)
    return arrays["x"], arrays["y"]

  def read_attributes(self, round_num: int, client_index: int) -> dict[str, np.ndarray]:
    """The sensitive attributes' class indices of the client's samples
    (empty when the data set has none)."""
    arrays = self._arrays(round_num, client_index)
    return {k[len(_ATTRIBUTE_PREFIX):]: v for k, v in arrays.items()
            if k.startswith(_ATTRIBUTE_PREFIX)}
