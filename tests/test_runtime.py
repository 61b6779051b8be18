import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
import tensorflow_federated as tff

from conftest import listening_sockets, network_interfaces, worker_children
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
  assert [p.parent().pid for p in worker_children()] == [first.process.pid]
  runtime.stop()
  assert first.process.poll() is not None and not worker_children()
  assert _mean([1.0, 3.0]) == 2.0  # a fresh worker
  assert len(worker_children()) == 1


def test_only_this_runtimes_local_workers_run_on_this_machine():
  runtime.stop()
  runtime.install()
  assert runtime.runs_on_this_machine()  # starts a local worker on first use
  runtime.start()
  assert runtime.runs_on_this_machine()
  own = tff.framework.get_context_stack().current
  tff.framework.get_context_stack().set_default_context(object.__new__(type(own)))
  try:  # a context the program set itself may run anywhere
    assert not runtime.runs_on_this_machine()
  finally:
    tff.framework.get_context_stack().set_default_context(own)
  runtime.stop()


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


def test_limiting_concurrent_calls_renews_only_workers_with_another_limit():
  runtime.stop()
  runtime.start(workers=2)
  old = {p.pid for p in worker_children()}
  try:
    runtime.limit_concurrent_calls(1)
    new = worker_children()
    assert len(new) == 2 and not {p.pid for p in new} & old
    assert all("--max_concurrent_computation_calls=1" in p.cmdline() for p in new)
    runtime.limit_concurrent_calls(1)
    assert {p.pid for p in worker_children()} == {p.pid for p in new}
    runtime.stop()
    assert _mean([1.0, 2.0, 6.0]) == 3.0  # started on first use, limited
    assert ["--max_concurrent_computation_calls=1" in p.cmdline()
            for p in worker_children()] == [True]
  finally:
    runtime.limit_concurrent_calls(-1)
  assert ["--max_concurrent_computation_calls=-1" in p.cmdline()
          for p in worker_children()] == [True]
  runtime.stop()


@pytest.mark.slow
def test_worker_dies_with_a_sigkilled_parent():
  script = textwrap.dedent("""
      import sys, time
      from tff_privacy import runtime
      print(runtime.start().address, flush=True)
      time.sleep(600)
  """)
  parent = subprocess.Popen([sys.executable, "-c", script],
                            stdout=subprocess.PIPE, text=True)
  directory = os.path.dirname(parent.stdout.readline().strip()[len("unix:"):])
  [worker] = worker_children(parent.pid)
  processes = [worker.parent(), worker]  # private_worker's host and the binary
  assert os.path.isdir(directory)
  parent.send_signal(signal.SIGKILL)
  parent.wait()
  gone, alive = psutil.wait_procs(processes, timeout=15)
  assert not alive
  assert not os.path.exists(directory)  # the socket's, removed by the host


def test_a_worker_started_in_a_thread_outlives_the_thread():
  """The worker ends with this process, not with the thread that started
  it (the kernel's parent-death signal follows threads); this thread, whose
  TFF context is its own, uses the same worker."""
  runtime.stop()
  results = []

  def start_and_compute():
    runtime.start()
    results.append(_mean([1.0, 3.0]))

  starter = threading.Thread(target=start_and_compute)
  starter.start()
  starter.join()
  [worker] = worker_children()
  time.sleep(1.0)
  assert results == [2.0] and worker.is_running() and runtime.failure() is None
  assert _mean([1.0, 2.0, 6.0]) == 3.0
  assert worker_children() == [worker]
  runtime.stop()


@pytest.mark.slow
def test_a_worker_that_cannot_start_is_reported_in_one_line(monkeypatch):
  """A host that exits at start (here as where the kernel refuses network
  namespaces) is a WorkerError carrying its words, not an interrupt."""
  said = "cannot give the TFF worker a private network (stand-in)"
  script = textwrap.dedent(f"""
      import sys
      from tff_privacy import private_worker, runtime
      runtime.private_worker_command = lambda *args: [
          sys.executable, "-c", "import sys; print({said!r}, file=sys.stderr); "
          f"sys.exit({{private_worker.EXIT_NO_PRIVATE_NETWORK}})"]
      try:
        runtime.start()
      except runtime.WorkerError as e:
        print("WorkerError:", e)
  """)
  result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=120)
  assert result.stdout == f"WorkerError: {said}\n", result.stderr[-2000:]
  assert result.returncode == 0


def _stand_in_worker(tmp_path, monkeypatch, script: str) -> str:
  """Has local workers run `script` (sh) in place of worker_binary."""
  path = tmp_path / "stand_in_worker"
  path.write_text(f"#!/bin/sh\n{script}\n")
  path.chmod(0o700)
  monkeypatch.setattr(runtime, "worker_binary_path", lambda: str(path))
  return str(path)


def test_workers_that_do_not_serve_in_time_are_all_stopped(tmp_path, monkeypatch):
  """A start that times out says so, and stops every worker it started."""
  runtime.stop()
  pids = tmp_path / "pids"
  _stand_in_worker(tmp_path, monkeypatch, f"echo $$ >> {pids}; exec sleep 600")
  monkeypatch.setattr(runtime, "_STARTUP_TIMEOUT_S", 2.0)
  with pytest.raises(runtime.WorkerError, match=r"^the local TFF worker \(pid \d+\) "
                     r"did not become ready in 2 s$"):
    runtime.start(workers=2)
  started = [int(pid) for pid in pids.read_text().split()]
  assert len(started) == 2
  time.sleep(1.0)  # their hosts' parent-death signal and reaping
  assert not [pid for pid in started if psutil.pid_exists(pid)
              and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
  assert runtime.worker_count() == 0


def test_a_worker_that_fails_to_start_shows_its_last_words(tmp_path, monkeypatch):
  said = "worker_binary: error while loading shared libraries: libnope.so.1"
  runtime.stop()
  _stand_in_worker(tmp_path, monkeypatch, f"echo '{said}' >&2; exit 127")
  with pytest.raises(runtime.WorkerError) as raised:
    runtime.start()
  message = str(raised.value)
  assert re.match(r"the local TFF worker \(pid \d+\) exited with code 127 while "
                  r"starting: worker_binary \(pid \d+\) ended with code 127; the last "
                  r"lines it wrote on stderr: ", message), message
  assert message.endswith(said) and "\n" not in message


def test_a_workers_end_is_described_by_pid_and_signal():
  assert runtime.describe_exit(-9, 4242).startswith(
      "the local TFF worker (pid 4242) was killed by SIGKILL (most often the "
      "kernel's out-of-memory killer")
  assert runtime.describe_exit(-15) == "the local TFF worker was killed by SIGTERM"
  assert runtime.describe_exit(1, 7) == "the local TFF worker (pid 7) exited with code 1"


def _is_loopback(address: str) -> bool:
  return address == "::1" or address.startswith("127.")


@pytest.mark.parametrize("count", [1, 2])
def test_no_worker_listens_where_another_machine_can_reach_it(count):
  """The kernel's view of every TCP socket that the run's processes listen
  on: each is on loopback, or in a network namespace whose only interface
  is loopback (TFF's worker_binary listens on every interface)."""
  runtime.stop()
  runtime.start(workers=count)
  assert _mean([1.0, 2.0, 6.0]) == 3.0
  here = os.readlink("/proc/self/ns/net")
  workers = [p.pid for p in worker_children()]
  sockets, interfaces = {}, {}
  for process in [psutil.Process()] + psutil.Process().children(recursive=True):
    try:
      sockets[process.pid] = listening_sockets(process.pid)
      interfaces[process.pid] = network_interfaces(process.pid)
    except (FileNotFoundError, ProcessLookupError):
      pass  # a short-lived helper process that has ended
  runtime.stop()
  assert len(workers) == count and all(sockets[pid] for pid in workers)
  for pid, found in sockets.items():
    for address, port, namespace in found:
      assert _is_loopback(address) or (
          namespace != here and interfaces[pid] == ["lo"]), (pid, address, port)


def _wildcard_listeners() -> list[tuple[int, str, int]]:
  """(pid, address, port) of every socket that this process or one of its
  descendants listens on at a wildcard address of this machine's network."""
  here = os.readlink("/proc/self/ns/net")
  found = []
  for process in [psutil.Process()] + psutil.Process().children(recursive=True):
    try:
      found += [(process.pid, a, port) for a, port, ns in listening_sockets(process.pid)
                if a in ("0.0.0.0", "::") and ns == here]
    except (FileNotFoundError, ProcessLookupError):
      pass
  return found


@pytest.mark.slow
def test_a_run_without_the_runtime_started_trains_on_a_private_worker(tmp_path):
  """A program that calls `runner.run` on TFF's own import-time context,
  whose worker would listen on every interface, trains on this runtime's."""
  from tff_privacy import runner
  runtime.stop()
  tff.backends.native.set_sync_local_cpp_execution_context()
  try:
    runner.run(runner.RunConfig(out=str(tmp_path), method="fedavg", dataset="digits",
                                model="mlp", model_kwargs={"hidden": [8]},
                                clients=2, rounds=1), progress=False)
    parents = [p.parent().pid for p in worker_children()]
    listening = _wildcard_listeners()
  finally:
    runtime.stop()
    runtime.install()
  # TFF's own context runs worker_binary as a child of this process
  assert parents and os.getpid() not in parents
  assert not listening, listening


def test_the_shared_network_escape_listens_on_every_interface(monkeypatch, capsys):
  """`SHARED_NETWORK_VARIABLE`=1 does what its warning says: the worker
  listens on a wildcard address of this machine's network, at the port the
  warning names."""
  runtime.stop()
  monkeypatch.setenv(runtime.SHARED_NETWORK_VARIABLE, "1")
  runtime.start()
  [worker] = worker_children()
  found = listening_sockets(worker.pid)
  runtime.stop()
  here = os.readlink("/proc/self/ns/net")
  assert found and all(a in ("0.0.0.0", "::") and ns == here for a, _, ns in found)
  warned = re.findall(r"^tff_privacy: TFF worker at unix:\S+: .*warning: "
                      f"{runtime.SHARED_NETWORK_VARIABLE}=1, so worker_binary itself "
                      r"listens on port (\d+) of this machine's network \(::\): every "
                      "network interface of this machine",
                      capsys.readouterr().err, re.M)
  assert [int(p) for p in warned] == sorted({port for _, port, _ in found})


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

      import psutil
      worker = runtime.start()
      [binary] = psutil.Process(worker.pid).children()
      threading.Timer(3.0, os.kill, (binary.pid, signal.SIGKILL)).start()
      try:
        while True:
          mean([1.0, 2.0])
      except KeyboardInterrupt:
        print("interrupted:", runtime.failure(), flush=True)
  """)
  result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=120)
  assert re.search(r"interrupted: the local TFF worker \(pid \d+\) was killed by "
                   "SIGKILL", result.stdout), result.stdout
  assert "out-of-memory" in result.stderr


@pytest.mark.slow
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


@pytest.mark.slow
def test_renewing_workers_prints_nothing():
  """Starting a worker while gRPC's threads run (`renew`) must not fork
  this process: gRPC's fork handlers print warnings a user did not ask for."""
  script = textwrap.dedent("""
      import numpy as np
      import tensorflow_federated as tff
      from tff_privacy import runtime

      @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
      def mean(x):
        return tff.federated_mean(x)

      runtime.start(workers=2)
      for _ in range(3):
        assert mean([1.0, 2.0]) == 1.5
        runtime.renew()
      runtime.stop()
  """)
  result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]


def test_the_worker_limits_mallocs_arenas_unless_the_user_chose(monkeypatch):
  # read from the running worker_binary's own environment (the OS's view)
  for given, expected in ((None, "2"), ("4", "4")):
    runtime.stop()
    if given is None:
      monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    else:
      monkeypatch.setenv("MALLOC_ARENA_MAX", given)
    runtime.start()
    [worker] = worker_children()
    assert worker.environ().get("MALLOC_ARENA_MAX") == expected
  runtime.stop()
