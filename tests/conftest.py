import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402


def worker_children(pid: int | None = None) -> list[psutil.Process]:
  """Live `worker_binary` processes whose parent is `pid` (default: this one)."""
  parent = psutil.Process(pid or os.getpid())
  return [p for p in parent.children(recursive=True)
          if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
          and "worker_binary" in " ".join(p.cmdline())]


def pytest_configure(config):
  """The test session's TFF runtime: a local worker, started on first use
  (importing tff_privacy starts nothing)."""
  from tff_privacy import runtime
  runtime.install()


@pytest.fixture(scope="session", autouse=True)
def _stop_tff_worker():
  yield
  from tff_privacy import runtime
  runtime.stop()
  assert not worker_children(), "the test session left a TFF worker running"


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
