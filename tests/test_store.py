import builtins
import json
import os
import re

import numpy as np
import pytest

from tff_privacy import models
from tff_privacy.updates import GroundTruthStore, UpdateStore, UpdateStoreError

SPEC = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": (16,)})
META = {"method": "fedsgd", "upload_kind": "gradient", "model": SPEC.to_json(),
        "dataset": "digits", "value_range": [0.0, 1.0], "raw_max": 16.0,
        "protocol": {"batch_size": 4}}


@pytest.fixture
def store(tmp_path):
  rng = np.random.default_rng(0)
  broadcast = SPEC.initial_weights(0)
  # the aggregation weight (1, as FedEM weighs) differs from the examples
  uploads = [(i, f"client_{i:04d}",
              [rng.normal(size=w.shape).astype(np.float32) for w in broadcast],
              1.0, 4) for i in (3, 7)]
  s = UpdateStore(str(tmp_path / "updates"))
  s.write_round(1, broadcast, uploads, META)
  return s, broadcast, uploads


def test_round_trip_preserves_tensors_and_metadata(store):
  s, broadcast, uploads = store
  assert s.rounds() == [1] and s.clients(1) == [3, 7]
  rec = s.read(1, 7)
  assert rec.client_id == "client_0007"
  assert rec.weight == 1.0 and rec.num_examples == 4
  assert rec.upload_kind == "gradient" and rec.model_spec == SPEC
  assert rec.metadata["protocol"]["batch_size"] == 4
  for got, want in zip(rec.upload, uploads[1][2]):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(rec.broadcast, broadcast):
    np.testing.assert_array_equal(got, want)
  names = [t["name"] for t in s.manifest()["run"]["tensors"]]
  assert names == SPEC.variable_names()


def test_tampered_record_names_the_file(store):
  s, *_ = store
  path = os.path.join(s.root, "round_0001", "client_0007.npz")
  raw = bytearray(open(path, "rb").read())
  raw[-40] ^= 0xFF
  open(path, "wb").write(bytes(raw))
  with pytest.raises(UpdateStoreError, match="client_0007.npz: SHA-256"):
    s.read(1, 7)
  s.read(1, 3)  # the other record is untouched


def test_truncated_record_names_the_file(store):
  s, *_ = store
  path = os.path.join(s.root, "round_0001", "client_0003.npz")
  raw = open(path, "rb").read()
  open(path, "wb").write(raw[: len(raw) // 2])
  with pytest.raises(UpdateStoreError, match="client_0003.npz"):
    s.read(1, 3)


def test_mismatched_shape_names_the_file(store, tmp_path):
  s, broadcast, _ = store
  path = os.path.join(s.root, "round_0001", "client_0003.npz")
  bad = {f"t{i:03d}": np.zeros(w.shape, np.float32) for i, w in enumerate(broadcast)}
  bad["t000"] = np.zeros((3, 3), np.float32)
  np.savez(path, **bad)
  manifest = s.manifest()
  entry = manifest["rounds"]["1"]["clients"]["3"]
  from tff_privacy import io
  entry["sha256"] = io.sha256(path)  # a consistent but wrong record
  entry["arrays"]["t000"]["shape"] = [3, 3]
  json.dump(manifest, open(os.path.join(s.root, "manifest.json"), "w"))
  with pytest.raises(UpdateStoreError, match="client_0003.npz: tensor t000"):
    s.read(1, 3)


def test_a_record_swapped_after_it_is_opened_is_never_loaded_unchecked(
    store, tmp_path, monkeypatch):
  # another valid record of the same tensors replaces client 7's file right
  # after its first open: a second open (to load what was hashed) reads it
  s, _, uploads = store
  path = os.path.join(s.root, "round_0001", "client_0007.npz")
  other = str(tmp_path / "other.npz")
  np.savez(other, **{f"t{i:03d}": np.zeros_like(u)
                     for i, u in enumerate(uploads[1][2])})
  real_open, swapped = builtins.open, []

  def open_then_swap(file, *args, **kwargs):
    f = real_open(file, *args, **kwargs)
    if (isinstance(file, (str, os.PathLike)) and not swapped
        and os.path.realpath(file) == os.path.realpath(path)):
      swapped.append(file)
      os.replace(other, path)  # the open file keeps the first one's bytes
    return f

  monkeypatch.setattr(builtins, "open", open_then_swap)
  rec = s.read(1, 7)
  assert swapped
  for got, want in zip(rec.upload, uploads[1][2]):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(UpdateStoreError, match="client_0007.npz: SHA-256"):
    s.read(1, 7)  # the swapped file itself is caught by its checksum


def test_a_rounds_defense_facts_reach_its_records_only(tmp_path):
  s = UpdateStore(str(tmp_path / "updates"))
  broadcast = SPEC.initial_weights(0)
  upload = [(0, "client_0000", broadcast, 1.0, 4)]
  facts = {"zoo_fingerprints": {"race": -7}}
  s.write_round(1, broadcast, upload, META, defense_round=facts)
  s.write_round(2, broadcast, upload, META)
  manifest = json.load(open(os.path.join(s.root, "manifest.json")))
  assert manifest["rounds"]["1"]["defense_round"] == facts
  assert s.read(1, 0).metadata["defense_round"] == facts
  assert "defense_round" not in s.read(2, 0).metadata


def test_missing_round_and_client_are_reported(store):
  s, *_ = store
  with pytest.raises(UpdateStoreError, match="no round 2"):
    s.read(2, 3)
  with pytest.raises(UpdateStoreError, match="no client 5"):
    s.read(1, 5)


def test_records_refuse_pickles(store):
  s, *_ = store
  path = os.path.join(s.root, "round_0001", "client_0003.npz")
  np.savez(path, **{f"t{i:03d}": np.array([object()]) for i in range(4)})
  with pytest.raises(UpdateStoreError, match="client_0003.npz"):
    s.read(1, 3)


def test_metadata_with_tuples_writes_a_second_round(tmp_path):
  # JSON turns tuples into lists: the run's own metadata must still match
  meta = dict(META, protocol={"batch_size": 4, "value_range": (0.0, 1.0)})
  s = UpdateStore(str(tmp_path / "updates"))
  broadcast = SPEC.initial_weights(0)
  upload = [(0, "client_0000", broadcast, 1.0, 4)]
  s.write_round(1, broadcast, upload, meta)
  s.write_round(2, broadcast, upload, meta)
  assert s.rounds() == [1, 2]
  assert s.read(2, 0).metadata["protocol"]["value_range"] == [0.0, 1.0]


def test_other_run_cannot_write_into_store(store):
  s, broadcast, uploads = store
  with pytest.raises(UpdateStoreError, match="different run"):
    s.write_round(2, broadcast, uploads, dict(META, method="fedavg"))


def test_ground_truth_store_round_trip(tmp_path):
  g = GroundTruthStore(str(tmp_path / "gt"))
  x = np.random.default_rng(0).random((4, 8, 8, 1), dtype=np.float32)
  y = np.array([1, 2, 3, 4], np.int32)
  g.write_round(1, [(7, x, y)], {"dataset": "digits"})
  gx, gy = g.read(1, 7)
  np.testing.assert_array_equal(gx, x)
  np.testing.assert_array_equal(gy, y)
  with pytest.raises(UpdateStoreError, match="no ground truth"):
    g.read(1, 8)


def _point_entry_at(s, relpath):
  """Makes the manifest's entry of client 3 in round 1 name `relpath`, with
  the checksum of the file it names (a consistent manifest)."""
  from tff_privacy import io
  manifest = s.manifest()
  entry = manifest["rounds"]["1"]["clients"]["3"]
  entry["file"] = relpath
  entry["sha256"] = io.sha256(os.path.join(s.root, relpath))
  json.dump(manifest, open(os.path.join(s.root, "manifest.json"), "w"))


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_manifest_paths_outside_the_store_are_refused(store, tmp_path, where):
  s, *_ = store
  outside = tmp_path / "elsewhere"
  outside.mkdir()
  # a valid record of this run, but not the store's own file
  target = outside / "x.npz"
  target.write_bytes(open(os.path.join(s.root, "round_0001", "client_0007.npz"),
                          "rb").read())
  if where == "parent":
    relpath = "../elsewhere/x.npz"
  elif where == "absolute":
    relpath = str(target)
  else:
    relpath = "round_0001/client_0003.npz"
    os.remove(os.path.join(s.root, relpath))
    os.symlink(target, os.path.join(s.root, relpath))
  _point_entry_at(s, relpath)
  with pytest.raises(UpdateStoreError,
                     match=f"{re.escape(relpath)}.*outside the store"):
    s.read(1, 3)
  s.read(1, 7)


def test_a_store_reached_through_a_symlink_reads_its_own_files(store, tmp_path):
  s, _, uploads = store
  os.symlink(s.root, tmp_path / "link")
  rec = UpdateStore(str(tmp_path / "link")).read(1, 7)
  np.testing.assert_array_equal(rec.upload[0], uploads[1][2][0])
