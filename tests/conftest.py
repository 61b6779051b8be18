import importlib.util
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402


def worker_children(pid: int | None = None) -> list[psutil.Process]:
  """Live `worker_binary` processes descending from `pid` (default: this
  one)."""
  parent = psutil.Process(pid or os.getpid())
  return [p for p in parent.children(recursive=True)
          if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
          and os.path.basename(p.cmdline()[0]) == "worker_binary"]


def listening_sockets(pid: int) -> list[tuple[str, int, str]]:
  """(address, port, network namespace) of every TCP socket that process
  `pid` listens on, as the kernel shows them in /proc: the socket inodes of
  its open files, looked up in the TCP tables of its own network namespace
  and of this process's (a socket stays in the namespace it was made in)."""
  inodes = set()
  for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
      target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except FileNotFoundError:
      continue
    if target.startswith("socket:["):
      inodes.add(target[len("socket:["):-1])
  found = set()
  for viewer in {pid, os.getpid()}:
    namespace = os.readlink(f"/proc/{viewer}/ns/net")
    for table in ("tcp", "tcp6"):
      with open(f"/proc/{viewer}/net/{table}") as f:
        for line in f.readlines()[1:]:
          fields = line.split()
          local, state, inode = fields[1], fields[3], fields[9]
          if state == "0A" and inode in inodes:  # 0A: TCP_LISTEN
            address, port = local.split(":")
            found.add((_address_from_proc(address), int(port, 16), namespace))
  return sorted(found)


def _address_from_proc(hex_address: str) -> str:
  """/proc/net/tcp's hex address (host-order 32-bit words) as text."""
  import ipaddress
  import socket
  words = bytes.fromhex(hex_address)
  packed = b"".join(words[i:i + 4][::-1] for i in range(0, len(words), 4))
  family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
  return str(ipaddress.ip_address(socket.inet_ntop(family, packed)))


def network_interfaces(pid: int) -> list[str]:
  """The interfaces of process `pid`'s network namespace (/proc/PID/net/dev)."""
  with open(f"/proc/{pid}/net/dev") as f:
    return [line.split(":")[0].strip() for line in f.readlines()[2:]]


def pytest_configure(config):
  """The test session's TFF runtime: a local worker, started on first use
  (importing tff_privacy starts nothing)."""
  from tff_privacy import runtime
  runtime.install()


def slow_where(values, slow) -> list:
  """`values` for `pytest.mark.parametrize`, those in `slow` marked slow:
  the fast suite keeps the others."""
  return [pytest.param(v, marks=pytest.mark.slow) if v in slow else v
          for v in values]


# models whose tests take 10 s or more each (a pretrained backbone)
SLOW_MODELS = {"lpm_resnet"}

# builder arguments that keep a model quick to build in tests
QUICK_MODEL_KWARGS = {"lpm_resnet": {"widths": (4, 8),
                                     "pretrain_dataset": "lfw_subset",
                                     "pretrain_epochs": 1}}


@pytest.fixture(scope="session", autouse=True)
def _backbone_cache(tmp_path_factory):
  """Default pre-trained networks go to the session's own cache."""
  from tff_privacy import pretrained
  old = os.environ.get(pretrained.CACHE_VARIABLE)
  os.environ[pretrained.CACHE_VARIABLE] = str(tmp_path_factory.mktemp("cache"))
  yield
  if old is None:
    del os.environ[pretrained.CACHE_VARIABLE]
  else:
    os.environ[pretrained.CACHE_VARIABLE] = old


@pytest.fixture(scope="session", autouse=True)
def _stop_tff_worker():
  yield
  from tff_privacy import runtime
  runtime.stop()
  assert not worker_children(), "the test session left a TFF worker running"


def record_of(x, y, spec=None, upload_kind="gradient", protocol=None, seed=0):
  """A record built the way a client would: the upload of (x, y) under
  `spec` (default: LeNet on 8x8 digits)."""
  import tensorflow as tf
  from tff_privacy import models
  from tff_privacy.attacks import functional
  from tff_privacy.updates import UpdateRecord
  spec = spec or models.ModelSpec("lenet", (8, 8, 1), 10)
  model = spec.keras(seed)
  broadcast = [v.numpy() for v in model.trainable_variables]
  protocol = protocol or {"batch_size": len(y)}
  upload = functional.simulate_upload(
      model, [tf.constant(w) for w in broadcast], tf.constant(x),
      tf.one_hot(y, spec.num_classes), upload_kind, protocol)
  meta = {"method": "test", "upload_kind": upload_kind, "model": spec.to_json(),
          "dataset": "digits", "value_range": [0.0, 1.0], "raw_max": 16.0,
          "protocol": protocol}
  # TFF weighs a FedAvg client by the examples of every local epoch
  epochs = protocol.get("local_epochs", 1) if upload_kind == "model_delta" else 1
  return UpdateRecord(1, 0, "client_0000", [u.numpy() for u in upload],
                      float(len(y) * epochs), len(y), broadcast, meta)


def fake_lpips_weights(path):
  """Writes an LPIPS weights file of the right shapes with random values."""
  from tff_privacy.metrics import lpips
  rng = np.random.default_rng(0)
  arrays, in_ch = {}, 3
  for i, (ch, k, _, _) in enumerate(lpips._LAYERS, start=1):
    arrays[f"conv{i}_kernel"] = rng.normal(0, 0.05, (k, k, in_ch, ch)).astype(np.float32)
    arrays[f"conv{i}_bias"] = np.zeros(ch, np.float32)
    arrays[f"lin{i}"] = rng.random(ch).astype(np.float32)
    in_ch = ch
  np.savez(path, **arrays)
  return arrays


def write_doctamper_split(path, count: int, side: int, seed: int):
  """A DocTamper LMDB split at `path` as its authors distribute it: `count`
  side x side JPEG images, each with a tampered square in a PNG mask."""
  import io
  import lmdb
  from PIL import Image

  def encoded(array, fmt):
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt)
    return buffer.getvalue()

  rng = np.random.default_rng(seed)
  env = lmdb.open(str(path), map_size=1 << 24)
  with env.begin(write=True) as txn:
    txn.put(b"num-samples", str(count).encode())
    for i in range(count):
      mask = np.zeros((side, side), np.uint8)
      mask[4:12, 8:16] = 255
      txn.put(b"image-%09d" % i,
              encoded(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), "JPEG"))
      txn.put(b"label-%09d" % i, encoded(mask, "PNG"))
  env.close()


def load_script(path: str):
  """The experiment or benchmark script at `path` (absolute, or relative to
  the project's root) imported as a module (its name: the file's), without
  running its main."""
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses of the script look it up
  spec.loader.exec_module(module)
  return module


def attack_store(tmp_path, record, x, y, dataset: str = "digits") -> str:
  """An update store of `record` (round 1, client 0) with its ground truth
  `x`, `y` beside it, as a run writes them; returns the update store's path."""
  from tff_privacy.updates import GroundTruthStore, UpdateStore
  UpdateStore(str(tmp_path / "updates")).write_round(
      1, record.broadcast, [(0, "client_0000", record.upload, 1.0, len(y))],
      record.metadata)
  GroundTruthStore(str(tmp_path / "ground_truth")).write_round(
      1, [(0, x, y)], {"dataset": dataset})
  return str(tmp_path / "updates")


def attack_cli(capsys, updates: str, out: str, *flags) -> tuple[int, str]:
  """`tff-privacy attack` on round 1 of `updates`, in this process: (exit
  code, stderr)."""
  from tff_privacy import cli
  code = cli.main(["attack", "--updates", updates, "--round", "1", "--quiet",
                   "--out", out, *flags])
  return code, capsys.readouterr().err


def forbid_ground_truth_in_search(monkeypatch, attack_class) -> list:
  """Makes every read of the ground-truth store raise while a search of
  `attack_class` runs; returns the list of the reads made outside it (the
  scoring's)."""
  from tff_privacy.updates import GroundTruthStore
  searching, reads = [False], []
  read, search = GroundTruthStore._arrays, attack_class.__call__

  def guarded(self, *args):
    if searching[0]:
      raise AssertionError("the attack read the ground truth")
    reads.append(args)
    return read(self, *args)

  def watched(self, *args, **kwargs):
    searching[0] = True
    try:
      return search(self, *args, **kwargs)
    finally:
      searching[0] = False

  monkeypatch.setattr(GroundTruthStore, "_arrays", guarded)
  monkeypatch.setattr(attack_class, "__call__", watched)
  return reads
