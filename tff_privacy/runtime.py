"""One TFF C++ worker per Python process, started here and never left behind.

TFF 0.87 starts its ``worker_binary`` lazily and stops it from a ``__del__`` that
runs after ``subprocess`` is torn down at interpreter exit, so the worker outlives
the program (and keeps a pipe on our stdout open). This module starts the worker
itself, from the main thread, with the kernel's parent-death signal set, so that
the worker ends with its parent even when the parent is killed with SIGKILL; an
``atexit`` hook stops it on a normal exit.

The other way round, TFF's remote executor retries a dead worker forever. A
watcher thread notices when the worker exits unasked (the kernel's
out-of-memory killer is the usual cause), says so on stderr and interrupts
the main thread, so the program fails instead of hanging.

Importing this module changes nothing. A program opts in:

  from tff_privacy import runtime
  runtime.install()   # TFF's default context: this worker, started on first use
  ...                 # run computations, e.g. tff_privacy.runner.run(config)
  runtime.stop()      # optional: also registered to run at exit

`start()` does the same and starts the worker at once. A program that runs
TFF under its own execution context simply does not call either.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import portpicker
import tensorflow_federated as tff
from tensorflow_federated.python.core.backends.native import compiler
from tensorflow_federated.python.core.environments.tensorflow_frontend import tensorflow_computation
from tensorflow_federated.python.core.impl.context_stack import context_base
from tensorflow_federated.python.core.impl.context_stack import context_stack_impl
from tensorflow_federated.python.core.impl.execution_contexts import sync_execution_context
from tensorflow_federated.python.core.impl.executor_stacks import python_executor_stacks
from tensorflow_federated.python.core.impl.executors import remote_executor
from tensorflow_federated.python.core.impl.executors import remote_executor_grpc_stub
from tensorflow_federated.python.core.impl.types import placements

_PR_SET_PDEATHSIG = 1
_GRPC_OPTIONS = [
    ("grpc.max_message_length", 2 * 10**9),
    ("grpc.max_receive_message_length", 2 * 10**9),
    ("grpc.max_send_message_length", 2 * 10**9),
]
_STARTUP_TIMEOUT_S = 60.0

_worker: "LocalWorker | None" = None


def _die_with_parent() -> None:
  libc = ctypes.CDLL("libc.so.6", use_errno=True)
  libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def describe_exit(returncode: int) -> str:
  """Why the worker ended, for an error message."""
  if returncode >= 0:
    return f"the TFF worker_binary exited with code {returncode}"
  name = signal.Signals(-returncode).name
  hint = (" (most often the kernel's out-of-memory killer: the round needed "
          "more memory than the machine has)" if -returncode == signal.SIGKILL
          else "")
  return f"the TFF worker_binary was killed by {name}{hint}"


def worker_binary_path() -> str:
  return os.path.join(os.path.dirname(tff.__file__), "data", "worker_binary")


class LocalWorker:
  """A ``worker_binary`` child process serving TFF's executor API on loopback."""

  def __init__(self, max_concurrent_computation_calls: int = -1):
    self.port = portpicker.pick_unused_port()
    args = [
        worker_binary_path(),
        f"--port={self.port}",
        f"--max_concurrent_computation_calls={max_concurrent_computation_calls}",
    ]
    self.process = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    self._closing = False
    self.failure: str | None = None  # set when the worker ends unasked
    threading.Thread(target=self._watch, daemon=True,
                     name="tff-worker-watcher").start()
    channel = grpc.insecure_channel(f"localhost:{self.port}", _GRPC_OPTIONS)
    self.stub = remote_executor_grpc_stub.RemoteExecutorGrpcStub(channel)
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while not self.stub.is_ready:
      if self.process.poll() is not None:
        raise RuntimeError(
            f"TFF worker_binary exited with code {self.process.returncode}")
      if time.monotonic() > deadline:
        self.close()
        raise RuntimeError("TFF worker_binary did not become ready in time")
      time.sleep(0.05)

  def _watch(self) -> None:
    returncode = self.process.wait()
    if self._closing:
      return
    self.failure = describe_exit(returncode)
    print(f"tff_privacy: {self.failure}; stopping", file=sys.stderr, flush=True)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

  def close(self) -> None:
    self._closing = True
    if self.process.poll() is None:
      self.process.terminate()
      try:
        self.process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()


def start(max_concurrent_computation_calls: int = -1) -> LocalWorker:
  """Starts (once) a local worker and makes it TFF's default execution context.

  Idempotent: later calls return the running worker. The worker is stopped
  at exit.
  """
  global _worker
  if _worker is not None and _worker.process.poll() is None:
    return _worker
  _register_exit_hook()
  worker = LocalWorker(max_concurrent_computation_calls)

  def stack_fn(cardinalities):
    cardinalities.setdefault(placements.CLIENTS, 0)
    executor = remote_executor.RemoteExecutor(worker.stub)
    executor.set_cardinalities(cardinalities)
    return executor

  factory = python_executor_stacks.ResourceManagingExecutorFactory(
      executor_stack_fn=stack_fn)
  context = sync_execution_context.SyncExecutionContext(
      executor_fn=factory,
      compiler_fn=compiler.desugar_and_transform_to_native,
      transform_args=tensorflow_computation.transform_args,
      transform_result=tensorflow_computation.transform_result,
  )
  context_stack_impl.context_stack.set_default_context(context)
  _worker = worker
  return worker


def failure() -> str | None:
  """Why the current worker ended unasked, if it did."""
  return _worker.failure if _worker is not None else None


def stop() -> None:
  """Stops the worker started by `start`, if any; the next computation starts
  a new one."""
  global _worker
  if _worker is not None:
    _worker.close()
    _worker = None
    _install_lazy_context()


class _StartOnFirstUse(context_base.SyncContext):
  """Default context until the first computation runs: starts the worker then,
  in the calling thread, and hands over to the real context."""

  def invoke(self, comp, arg):
    start()
    return context_stack_impl.context_stack.current.invoke(comp, arg)


def install() -> None:
  """Makes a local worker, started on the first computation, TFF's default
  execution context, and stops it at exit. Starts no process by itself."""
  if _worker is None:
    _install_lazy_context()
  _register_exit_hook()


def _install_lazy_context() -> None:
  # Replacing TFF's own default context early, while `subprocess` is alive,
  # lets its service manager be collected cleanly instead of failing at exit.
  context_stack_impl.context_stack.set_default_context(_StartOnFirstUse())


_exit_hook_registered = False


def _register_exit_hook() -> None:
  global _exit_hook_registered
  if not _exit_hook_registered:
    atexit.register(stop)
    _exit_hook_registered = True
