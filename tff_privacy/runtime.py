"""One TFF C++ worker per Python process, started here and never left behind.

TFF 0.87 starts its ``worker_binary`` lazily and stops it from a ``__del__`` that
runs after ``subprocess`` is torn down at interpreter exit, so the worker outlives
the program (and keeps a pipe on our stdout open), and its worker serves on
every network interface of the machine, to anyone who reaches the port. This
module starts the worker itself, through `private_worker`: in a network
namespace of its own, reached through a Unix socket that only this user can
open, with the kernel's parent-death signal set, so that the worker ends with
its parent even when the parent is killed with SIGKILL; an ``atexit`` hook
stops it on a normal exit.

The other way round, TFF's remote executor retries a dead worker forever. A
watcher thread notices when the worker exits unasked (the kernel's
out-of-memory killer is the usual cause), says so on stderr and interrupts
the main thread, so the program fails instead of hanging.

Importing this module changes nothing. A program opts in:

```python
from tff_privacy import runtime
runtime.install()   # TFF's default context: this worker, started on first use
...                 # run computations, e.g. tff_privacy.runner.run(config)
runtime.stop()      # optional: also registered to run at exit
```

`start()` does the same and starts the worker at once. A program that runs
TFF under its own execution context simply does not call either.

Several workers: `start(workers=N)` starts N local workers, or
`start(addresses=[...])` connects to workers already running elsewhere
(`tff-privacy worker --port P`), and runs every computation through TFF's
mergeable-computation context, which splits each round's clients between
the workers and merges their partial aggregates. That form allows one
logical aggregation per computation: `check_mergeable` names a computation
that has more. A worker that ends (local) or stops answering (remote) stops
the program with a message naming its process or address.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Sequence

import asyncio

import grpc
import tensorflow_federated as tff
from tensorflow_federated.python.common_libs import async_utils
from tensorflow_federated.python.common_libs import structure
from tensorflow_federated.python.core.backends.native import compiler
from tensorflow_federated.python.core.backends.native import mergeable_comp_compiler
from tensorflow_federated.python.core.environments.tensorflow_frontend import tensorflow_computation
from tensorflow_federated.python.core.impl.context_stack import context_base
from tensorflow_federated.python.core.impl.context_stack import context_stack_impl
from tensorflow_federated.python.core.impl.execution_contexts import async_execution_context
from tensorflow_federated.python.core.impl.execution_contexts import compiler_pipeline
from tensorflow_federated.python.core.impl.execution_contexts import mergeable_comp_execution_context
from tensorflow_federated.python.core.impl.execution_contexts import sync_execution_context
from tensorflow_federated.python.core.impl.executor_stacks import python_executor_stacks
from tensorflow_federated.python.core.impl.executors import remote_executor_grpc_stub
from tensorflow_federated.python.core.impl.types import computation_types
from tensorflow_federated.python.core.impl.types import placements
from tensorflow_federated.python.core.impl.types import type_analysis
from tensorflow_federated.python.core.impl.types import type_conversions

from tff_privacy import private_worker, worker_values

_GRPC_OPTIONS = [
    ("grpc.max_message_length", 2 * 10**9),
    ("grpc.max_receive_message_length", 2 * 10**9),
    ("grpc.max_send_message_length", 2 * 10**9),
]
_STARTUP_TIMEOUT_S = 60.0
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]")
SHARED_NETWORK_VARIABLE = private_worker.SHARED_NETWORK_VARIABLE

_workers: "list[LocalWorker | RemoteWorker]" = []
_call_limit = -1  # of new local workers, see `limit_concurrent_calls`
_contexts = weakref.WeakSet()  # the execution contexts this runtime made


class WorkerError(RuntimeError):
  """A worker did not start, or does not answer."""


def describe_exit(returncode: int, pid: "int | None" = None) -> str:
  """Why the local worker (process `pid`, if given) ended, for an error
  message."""
  worker = "the local TFF worker" + (f" (pid {pid})" if pid else "")
  if returncode >= 0:
    return f"{worker} exited with code {returncode}"
  name = private_worker.signal_name(-returncode)
  hint = (" (most often the kernel's out-of-memory killer: the round needed "
          "more memory than the machine has)" if -returncode == signal.SIGKILL
          else "")
  return f"{worker} was killed by {name}{hint}"


# The watchers interrupt the main thread with this signal, whose handler
# raises KeyboardInterrupt there. Not SIGINT: a shell starts background jobs
# with SIGINT ignored, and Python then installs no handler for it, so a dead
# worker would leave the run waiting on it for ever.
_FAILURE_SIGNAL = signal.SIGUSR1
_failure_handler_installed = False


def _raise_keyboard_interrupt(signum, frame):
  raise KeyboardInterrupt


def _install_failure_handler() -> None:
  """Installs the handler of `_FAILURE_SIGNAL`; only the main thread can."""
  global _failure_handler_installed
  if threading.current_thread() is threading.main_thread():
    signal.signal(_FAILURE_SIGNAL, _raise_keyboard_interrupt)
    _failure_handler_installed = True


def _stop_main_thread(failure: str) -> None:
  print(f"tff_privacy: {failure}; stopping", file=sys.stderr, flush=True)
  signal.pthread_kill(threading.main_thread().ident, _FAILURE_SIGNAL
                      if _failure_handler_installed else signal.SIGINT)


def end_with_parent(parent_pid: int) -> None:
  """Has the kernel end this process with SIGTERM when its parent
  `parent_pid` ends (Linux), and ends it now if that has already happened:
  for the processes of a pool, which would otherwise go on running their
  tasks, each with its worker, after the program that started them died."""
  private_worker.die_with_parent(signal.SIGTERM)
  if os.getppid() != parent_pid:
    os.kill(os.getpid(), signal.SIGTERM)


def worker_binary_path() -> str:
  return os.path.join(os.path.dirname(tff.__file__), "data", "worker_binary")


def private_worker_command(listen: str, max_concurrent_computation_calls: int = -1
                           ) -> list[str]:
  """The command that serves TFF's worker at `listen` (``unix:PATH`` or
  ``HOST:PORT``) from a private network (see `private_worker`). Python's
  isolated mode without site packages (-I -S) runs the file alone: its
  standard-library imports start no thread, which the namespace needs."""
  return [sys.executable, "-I", "-S", private_worker.__file__, "--listen", listen,
          "--worker", worker_binary_path(),
          f"--max-concurrent-computation-calls={max_concurrent_computation_calls}"]


def worker_environment() -> dict[str, str]:
  """This process's environment with glibc's malloc limited to 2 arenas
  unless MALLOC_ARENA_MAX is set: the worker's many threads otherwise each
  keep an arena of freed blocks, which HyperFL's 60 MB uploads fragment
  (its peak resident memory fell by about a tenth)."""
  return {"MALLOC_ARENA_MAX": "2", **os.environ}


class LocalWorker:
  """A ``worker_binary`` started by `private_worker` in a network namespace of
  its own, reached through a Unix socket in a directory only this user can
  enter: nothing listens on this machine's network. The environment
  variable `SHARED_NETWORK_VARIABLE` set to 1 keeps the machine's network
  instead (the worker then listens on every interface), for kernels that
  allow no namespace. The worker ends when this process does, in whatever
  thread it was started: its host reads a pipe whose other end only this
  process holds."""

  def __init__(self, max_concurrent_computation_calls: int = -1):
    self.max_concurrent_computation_calls = max_concurrent_computation_calls
    self._directory = _socket_directory()
    self.address = f"unix:{os.path.join(self._directory, 'worker.sock')}"
    self._stderr = open(os.path.join(self._directory, "stderr"), "w+")
    self._released = False
    read_end, self._pipe = os.pipe()
    args = private_worker_command(self.address, max_concurrent_computation_calls)
    args += [f"--parent-pipe={read_end}", "--remove-directory"]
    self.shared_network = os.environ.get(SHARED_NETWORK_VARIABLE) == "1"
    if self.shared_network:
      args.append("--shared-network")
    try:
      # No preexec_fn: Python then spawns without fork handlers, which gRPC
      # would run (and complain about) in this multi-threaded process.
      self.process = subprocess.Popen(
          args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
          stderr=self._stderr, pass_fds=(read_end,), env=worker_environment())
    except BaseException:
      self._release()
      raise
    finally:
      os.close(read_end)
    self.pid = self.process.pid
    self._closing = False
    self._connected = threading.Event()
    self._ended = threading.Event()
    self.returncode: int | None = None
    self.failure: str | None = None  # set when the worker ends unasked
    threading.Thread(target=self._watch, daemon=True,
                     name="tff-worker-watcher").start()

  def connect(self) -> None:
    """Waits until the worker serves; separate from starting it so that
    several workers are started before any gRPC thread runs.

    Raises:
      WorkerError: the worker ended, or did not serve in time.
    """
    channel = grpc.insecure_channel(self.address, _GRPC_OPTIONS)
    self.stub = remote_executor_grpc_stub.RemoteExecutorGrpcStub(channel)
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    while not self.stub.is_ready:
      if self._ended.is_set():
        raise WorkerError(self._startup_failure())
      if time.monotonic() > deadline:
        raise WorkerError(f"the local TFF worker (pid {self.pid}) did not "
                          f"become ready in {_STARTUP_TIMEOUT_S:g} s")
      time.sleep(0.05)
    self._connected.set()
    if self._ended.wait(0) and not self._closing:
      raise WorkerError(self._startup_failure())
    if self.shared_network:
      self._warn_of_reach()

  def _warn_of_reach(self) -> None:
    """Relays the host's line on who can reach the worker, which it prints
    once the kernel shows the worker listening (a moment after it serves)."""
    deadline = time.monotonic() + 10
    while not (said := self._said(reach=True)) and time.monotonic() < deadline:
      time.sleep(0.05)
    print("tff_privacy: " + (said or f"warning: the local TFF worker (pid "
                             f"{self.pid}) runs on this machine's network "
                             f"({SHARED_NETWORK_VARIABLE}=1) and did not say where "
                             "it listens: take it that anyone who reaches this "
                             "machine can run code as you"),
          file=sys.stderr, flush=True)

  def _said(self, reach: bool = False) -> str:
    """What the worker's host wrote on stderr, on one line: its line on the
    worker's reach (`reach`), or every other line."""
    try:  # by our descriptor: the host removes the file with its directory
      fd = self._stderr.fileno()
      lines = os.pread(fd, os.fstat(fd).st_size, 0).decode(
          errors="replace").splitlines()
    except (OSError, ValueError):  # ValueError: closed by `close`
      return ""
    lines = [line for line in lines
             if line.startswith(private_worker.REACH_PREFIX) == reach]
    return " ".join(" ".join(lines).split())

  def _startup_failure(self) -> str:
    said = self._said()
    if self.returncode == private_worker.EXIT_NO_PRIVATE_NETWORK:
      return said
    return describe_exit(self.returncode, self.pid) + " while starting" + (
        f": {said}" if said else "")

  @property
  def alive(self) -> bool:
    return not self._ended.is_set()

  def _watch(self) -> None:
    self.returncode = self.process.wait()
    self._ended.set()
    if self._closing:
      return
    said = self._said()
    self.failure = describe_exit(self.returncode, self.pid) + (
        f": {said}" if said else "")
    if self._connected.is_set():  # before that, `connect` reports it
      _stop_main_thread(self.failure)

  def close(self) -> None:
    self._closing = True
    if not self._ended.is_set():
      self.process.terminate()
      try:
        self.process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
    self._release()

  def _release(self) -> None:
    if self._released:
      return
    self._released = True
    os.close(self._pipe)
    self._stderr.close()
    shutil.rmtree(self._directory, ignore_errors=True)


_MAX_SOCKET_PATH = 100  # sun_path holds 107 bytes


def _socket_directory() -> str:
  """A new directory, mode 0700, for a worker's socket: under the temporary
  directory, or /tmp where that path would be too long for a socket."""
  directory = tempfile.mkdtemp(prefix="tff-privacy-worker-")
  if len(os.path.join(directory, "worker.sock")) <= _MAX_SOCKET_PATH:
    return directory
  os.rmdir(directory)
  return tempfile.mkdtemp(prefix="tff-privacy-worker-", dir="/tmp")


class RemoteWorker:
  """A TFF worker already running at `address` (host:port), e.g. started
  there by `tff-privacy worker`. A watcher stops the program when the
  connection fails (TFF's remote executor would retry it forever)."""

  def __init__(self, address: str):
    self.address = address
    self.failure: str | None = None
    self._closing = False
    self._channel = grpc.insecure_channel(address, _GRPC_OPTIONS)
    self.stub = remote_executor_grpc_stub.RemoteExecutorGrpcStub(self._channel)
    try:
      grpc.channel_ready_future(self._channel).result(timeout=_STARTUP_TIMEOUT_S)
    except grpc.FutureTimeoutError:
      self._channel.close()
      raise WorkerError(f"no TFF worker answered at {address} within "
                         f"{_STARTUP_TIMEOUT_S:.0f} s; start one there with "
                         "'tff-privacy worker --socket PATH' or '--port PORT'"
                         ) from None
    self._channel.subscribe(self._watch)

  @property
  def alive(self) -> bool:
    return self.failure is None

  def _watch(self, state: grpc.ChannelConnectivity) -> None:
    if self._closing or self.failure or state not in (
        grpc.ChannelConnectivity.TRANSIENT_FAILURE,
        grpc.ChannelConnectivity.SHUTDOWN):
      return
    self.failure = f"the TFF worker at {self.address} stopped answering"
    _stop_main_thread(self.failure)

  def close(self) -> None:
    self._closing = True
    self._channel.close()


def check_addresses(addresses: Sequence[str], allow_remote: bool = False) -> None:
  """Refuses an address that is neither host:port nor unix:PATH, and a host
  other than loopback unless `allow_remote`: TFF's worker speaks plaintext
  gRPC with no authentication."""
  for address in addresses:
    if address.startswith("unix:") and len(address) > len("unix:"):
      continue  # a socket on this machine
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(f"worker_addresses: {address!r} is neither host:port "
                       "nor unix:PATH")
    if host not in _LOOPBACK and not allow_remote:
      raise ValueError(
          f"worker_addresses: {address!r} is not on this machine; TFF workers "
          "speak plaintext, unauthenticated gRPC, so reach remote ones through "
          "an SSH tunnel or a private network and pass --allow-remote-workers")


def _executor_factory(worker):
  def stack_fn(cardinalities):
    cardinalities.setdefault(placements.CLIENTS, 0)
    # TFF's default batches 20 disposals, so a worker would keep the values
    # of the last few rounds (with HyperFL's, every client's upload) alive
    executor = worker_values.InPlaceRemoteExecutor(worker.stub,
                                                   dispose_batch_size=1)
    executor.set_cardinalities(cardinalities)
    return executor
  return python_executor_stacks.ResourceManagingExecutorFactory(
      executor_stack_fn=stack_fn)


class OrderedMergeableContext(context_base.SyncContext):
  """TFF's mergeable-computation context over one asynchronous context per
  worker, in a fixed order: worker i runs the i-th share of the clients up
  to the merge, the partial aggregates merge in worker order, and the
  clients' results come back in client order. TFF 0.87's own
  `MergeableCompExecutionContext` takes both in order of completion, which
  permutes clients' private states between rounds (HyperFL's personal
  accuracy fell from 0.66 to 0.13 on 2 workers) and makes the rounding of
  the sums depend on timing. The splitting and rejoining of values are
  TFF's own (private helpers of the pinned version)."""

  def __init__(self, contexts):
    self._contexts = list(contexts)
    self._runner = async_utils.AsyncThreadRunner()
    self._compiler = compiler_pipeline.CompilerPipeline(
        mergeable_comp_compiler.compile_to_mergeable_comp_form)

  def invoke(self, comp, arg=None):
    form = self._compiler.compile(comp)
    shares = ([None] if arg is None else
              mergeable_comp_execution_context._split_value_into_subrounds(  # pylint: disable=protected-access
                  arg, form.up_to_merge.type_signature.parameter,
                  len(self._contexts)))
    result = self._runner.run_coro_and_return_result(self._run(form, shares))
    result = type_conversions.type_to_py_container(
        result, form.after_merge.type_signature.result)
    return tensorflow_computation.transform_result(result)

  async def _run(self, form, shares):
    contexts = self._contexts[:len(shares)]
    partials = await asyncio.gather(*(
        c.invoke(form.up_to_merge, share) for c, share in zip(contexts, shares)))
    merged = partials[0]
    for partial in partials[1:]:
      merged = await contexts[0].invoke(
          form.merge, structure.Struct.unnamed(merged, partial))
    result_type = form.after_merge.type_signature.result
    if type_analysis.contains_only(result_type, _same_for_every_share):
      # one answer serves all shares, so it depends on none of their client
      # values: leave those out instead of sending them again
      contexts = contexts[:1]
      shares = [None if shares[0] is None else _without_client_values(
          shares[0], form.up_to_merge.type_signature.parameter)]
    results = await asyncio.gather(*(
        c.invoke(form.after_merge, merged if share is None
                 else structure.Struct.unnamed(share, merged))
        for c, share in zip(contexts, shares)))
    return mergeable_comp_execution_context._repackage_partitioned_values(  # pylint: disable=protected-access
        list(results), result_type)


def _without_client_values(value, type_spec):
  """`value` with every CLIENTS-placed, not all-equal part emptied."""
  if isinstance(type_spec, computation_types.StructType):
    return structure.Struct([
        (name, _without_client_values(v, t)) for (_, v), (name, t) in zip(
            structure.iter_elements(structure.from_container(value)),
            structure.iter_elements(type_spec))])
  if (isinstance(type_spec, computation_types.FederatedType)
      and type_spec.placement is placements.CLIENTS and not type_spec.all_equal):
    return []
  return value


def _same_for_every_share(type_spec) -> bool:
  return (not isinstance(type_spec, computation_types.FederatedType)
          or type_spec.all_equal)


def _context(workers):
  """One worker: TFF's synchronous context. Several: the mergeable context
  over one asynchronous context per worker."""
  transforms = dict(transform_args=tensorflow_computation.transform_args,
                    transform_result=tensorflow_computation.transform_result)
  if len(workers) == 1:
    context = sync_execution_context.SyncExecutionContext(
        executor_fn=_executor_factory(workers[0]),
        compiler_fn=compiler.desugar_and_transform_to_native, **transforms)
  else:
    context = OrderedMergeableContext(
        async_execution_context.AsyncExecutionContext(
            executor_fn=_executor_factory(w), **transforms) for w in workers)
  _contexts.add(context)
  return context


def start(max_concurrent_computation_calls: "int | None" = None, workers: int = 1,
          addresses: Sequence[str] = (), allow_remote: bool = False):
  """Starts (once) `workers` local workers, or connects to the workers at
  `addresses`, and makes them TFF's default execution context. Local
  workers run at most `max_concurrent_computation_calls` calls of one
  computation at once (-1: no limit; None: `limit_concurrent_calls`'s).

  Idempotent: while workers run, later calls return the first. The local
  workers are stopped at exit. Called in the main thread, it installs a
  SIGUSR1 handler: a worker that dies interrupts the main thread with it
  (KeyboardInterrupt), whatever the SIGINT disposition.

  Raises:
    ValueError: workers < 1, or an address that `check_addresses` refuses.
    WorkerError: a worker did not start or does not answer.
  """
  global _workers
  if _workers and all(w.alive for w in _workers):
    if isinstance(context_stack_impl.context_stack.current, _StartOnFirstUse):
      # TFF's default context is per thread: this thread's is still lazy
      context_stack_impl.context_stack.set_default_context(_context(_workers))
    return _workers[0]
  if not isinstance(workers, int) or workers < 1:
    raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
  check_addresses(addresses, allow_remote)
  _register_exit_hook()
  _install_failure_handler()
  started = []
  try:
    if addresses:
      for address in addresses:
        started.append(RemoteWorker(address))
    else:
      if max_concurrent_computation_calls is None:
        max_concurrent_computation_calls = _call_limit
      for _ in range(workers):
        started.append(LocalWorker(max_concurrent_computation_calls))
      for w in started:
        w.connect()
  except BaseException:
    with contextlib.suppress(Exception):  # the reason to stop comes first
      _close_all(started)
    raise
  context_stack_impl.context_stack.set_default_context(_context(started))
  _workers = started
  return started[0]


def _close_all(workers) -> None:
  """Closes every one of `workers`, even when closing one fails; raises the
  first such failure after."""
  failures = []
  for w in workers:
    try:
      w.close()
    except Exception as e:  # pylint: disable=broad-except
      failures.append(e)
  if failures:
    raise failures[0]


def worker_count() -> int:
  """How many workers the current context splits computations over (0: none
  started yet)."""
  return len(_workers)


def serves_remotely() -> bool:
  """Whether computations run on workers at addresses (possibly on other
  machines) rather than on local workers."""
  return any(isinstance(w, RemoteWorker) for w in _workers)


def runs_on_this_machine() -> bool:
  """Whether TFF's current context is this runtime's on local workers (or
  starts one at its first computation), so that computations may read this
  machine's files; False under a context a program set itself."""
  current = context_stack_impl.context_stack.current
  if not (isinstance(current, _StartOnFirstUse) or current in _contexts):
    return False
  return all(isinstance(w, LocalWorker) for w in _workers)  # the ones it uses


def check_mergeable(computation, what: str) -> None:
  """With several workers, refuses `computation` (named by `what`) unless
  TFF can split it into per-worker parts and one merge.

  Raises:
    ValueError: it has more than one logical aggregation.
  """
  if len(_workers) < 2:
    return
  try:
    mergeable_comp_compiler.compile_to_mergeable_comp_form(computation)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"{what} cannot run on {len(_workers)} workers: TFF's mergeable form "
        "splits a round between workers only when its computation has one "
        f"logical aggregation (TFF: {str(e).split(' Examples')[0].strip()}); "
        "use --workers 1"
    ) from None


def failure() -> str | None:
  """Why a current worker ended unasked, if one did."""
  return next((w.failure for w in _workers if w.failure), None)


def stop() -> None:
  """Stops the workers started by `start`, if any; the next computation
  starts a new one."""
  global _workers
  if _workers:
    closing, _workers = _workers, []
    _install_lazy_context()
    _close_all(closing)


def renew() -> None:
  """Replaces the local workers by as many fresh ones with the same settings;
  workers at addresses, or none, are left as they are.

  A worker keeps memory from every computation it has run (about 0.5 GB more
  after each FedRE run of the documents' U-Net), so scripts that run many
  runs in one process renew it between runs.
  """
  if not _workers or not all(isinstance(w, LocalWorker) for w in _workers):
    return
  count = len(_workers)
  limit = _workers[0].max_concurrent_computation_calls
  stop()
  start(limit, count)


def limit_concurrent_calls(limit: int) -> None:
  """Has the local workers run at most `limit` calls of one computation at
  once (-1: no limit), from now on. TFF runs a computation mapped over a
  round's clients for all of them at once; a method whose computation needs
  much memory per client (FedRE's PSI scores) runs them one by one with 1.
  Local workers running with another limit are replaced by as many fresh
  ones; workers at addresses keep the limit they serve with (`tff-privacy
  worker --max-concurrent-computation-calls`)."""
  global _call_limit
  _call_limit = limit
  if (_workers and all(isinstance(w, LocalWorker) for w in _workers)
      and _workers[0].max_concurrent_computation_calls != limit):
    count = len(_workers)
    stop()
    start(limit, count)


class _StartOnFirstUse(context_base.SyncContext):
  """Default context until the first computation runs: starts the worker then,
  in the calling thread, and hands over to the real context."""

  def invoke(self, comp, arg):
    start()
    return context_stack_impl.context_stack.current.invoke(comp, arg)


def install() -> None:
  """Makes a local worker, started on the first computation, TFF's default
  execution context, and stops it at exit. Starts no process by itself;
  installs `start`'s SIGUSR1 handler."""
  if not _workers:
    _install_lazy_context()
  _register_exit_hook()
  _install_failure_handler()


def install_over_tffs_own() -> None:
  """`install`s the runtime where TFF's own import-time context would run
  computations, and leaves any other context (this runtime's, or one a
  program set itself) alone. TFF's own starts its C++ worker listening on
  every network interface, and at interpreter exit fails to stop it (its
  service manager's `__del__` meets a torn-down `subprocess`), leaving the
  worker running: `runner.run` calls this, so a program that trains without
  starting the runtime first still trains on a private worker."""
  if _is_tffs_own_local_context(context_stack_impl.context_stack.current):
    _install_lazy_context()  # over it even while this runtime's workers run
    install()


def _is_tffs_own_local_context(context) -> bool:
  """Whether `context` is TFF 0.87's local C++ execution context, whose
  executor stack function `local_cpp_executor_factory` defines."""
  factory = getattr(context, "_executor_factory", None)
  stack_fn = getattr(factory, "_executor_stack_fn", None)
  return getattr(stack_fn, "__qualname__", "").startswith(
      "local_cpp_executor_factory.")


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
