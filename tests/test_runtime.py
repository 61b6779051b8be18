import os
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import psutil
import pytest
import tensorflow_federated as tff

from conftest import worker_children
from tff_privacy import runtime


@tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
def _mean(x):
  return tff.federated_mean(x)


def test_worker_starts_on_first_use_and_restarts_after_stop():
  runtime.stop()
  assert not worker_children()
  assert _mean([1.0, 2.0, 6.0]) == 3.0
  first = runtime.start()
  assert runtime.start() is first
  assert [p.pid for p in worker_children()] == [first.process.pid]
  runtime.stop()
  assert first.process.poll() is not None and not worker_children()
  assert _mean([1.0, 3.0]) == 2.0  # a fresh worker
  assert len(worker_children()) == 1


def test_renew_replaces_local_workers_by_as_many_fresh_ones():
  runtime.stop()
  runtime.renew()  # nothing started: nothing to renew
  assert not worker_children()
  runtime.start(max_concurrent_computation_calls=3, workers=2)
  old = [p.pid for p in worker_children()]
  assert len(old) == 2
  runtime.renew()
  new = worker_children()
  assert len(new) == 2 and not {p.pid for p in new} & set(old)
  assert all("--max_concurrent_computation_calls=3" in p.cmdline() for p in new)
  assert runtime.worker_count() == 2
  assert _mean([1.0, 2.0, 6.0]) == 3.0
  runtime.stop()


def test_worker_dies_with_a_sigkilled_parent():
  script = textwrap.dedent("""
      import sys, time
      from tff_privacy import runtime
      print(runtime.start().process.pid, flush=True)
      time.sleep(600)
  """)
  parent = subprocess.Popen([sys.executable, "-c", script],
                            stdout=subprocess.PIPE, text=True)
  worker = psutil.Process(int(parent.stdout.readline()))
  assert worker.is_running()
  parent.send_signal(signal.SIGKILL)
  parent.wait()
  worker.wait(timeout=15)
  assert not worker.is_running()


def test_a_workers_end_is_described_by_port_and_signal():
  assert runtime.describe_exit(-9, 4242).startswith(
      "the TFF worker_binary on port 4242 was killed by SIGKILL (most often the "
      "kernel's out-of-memory killer")
  assert runtime.describe_exit(-15) == "the TFF worker_binary was killed by SIGTERM"
  assert runtime.describe_exit(3, 7) == "the TFF worker_binary on port 7 exited with code 3"


@pytest.mark.slow  # it can block for minutes when the kill lands inside a
# call to TFF's C++ executor (the watcher's SIGINT waits for it); the
# fast suite keeps test_worker_dies_with_a_sigkilled_parent
def test_a_killed_worker_stops_the_program_instead_of_hanging():
  # TFF's remote executor retries a dead worker forever; the watcher must
  # interrupt the main thread and say why.
  script = textwrap.dedent("""
      import os, signal, threading, time
      import numpy as np
      import tensorflow_federated as tff
      from tff_privacy import runtime

      @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
      def mean(x):
        return tff.federated_mean(x)

      worker = runtime.start()
      threading.Timer(3.0, os.kill, (worker.process.pid, signal.SIGKILL)).start()
      try:
        while True:
          mean([1.0, 2.0])
      except KeyboardInterrupt:
        print("interrupted:", runtime.failure(), flush=True)
  """)
  result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=120)
  assert re.search(r"interrupted: the TFF worker_binary on port \d+ was killed by "
                   "SIGKILL", result.stdout), result.stdout
  assert "out-of-memory" in result.stderr


def test_importing_the_package_changes_no_global_state():
  script = textwrap.dedent("""
      import importlib, os, pkgutil
      import tensorflow_federated as tff
      from tensorflow_federated.python.core.impl.context_stack import context_stack_impl
      env, context = dict(os.environ), context_stack_impl.context_stack.current
      import tff_privacy
      for module in pkgutil.walk_packages(tff_privacy.__path__, "tff_privacy."):
        importlib.import_module(module.name)
      assert dict(os.environ) == env, set(os.environ.items()) ^ set(env.items())
      assert context_stack_impl.context_stack.current is context
      print("unchanged")
  """)
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=300, env=env)
  assert "unchanged" in result.stdout, result.stderr[-2000:]
