import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import psutil  # noqa: E402
import pytest  # noqa: E402


def worker_children(pid: int | None = None) -> list[psutil.Process]:
  """Live `worker_binary` processes whose parent is `pid` (default: this one)."""
  parent = psutil.Process(pid or os.getpid())
  return [p for p in parent.children(recursive=True)
          if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
          and "worker_binary" in " ".join(p.cmdline())]


@pytest.fixture(scope="session", autouse=True)
def _stop_tff_worker():
  yield
  from tff_privacy import runtime
  runtime.stop()
  assert not worker_children(), "the test session left a TFF worker running"
