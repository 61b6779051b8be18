"""Training on several TFF workers (`runtime.start(workers=N)`, `train
--workers`): the same numbers as one worker, the clients' results in
client order, methods TFF cannot split refused by name, a dead worker named,
and the run resumed."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import portpicker
import psutil
import pytest
import tensorflow_federated as tff

from conftest import listening_sockets, worker_children
from tff_privacy import runner, runtime
from tff_privacy.algorithms import hyperfl
from tff_privacy.updates import UpdateStore

# 24 samples a client: 3 local steps, and as many to simulate for the
# captured round's update error
FEDAVG = dict(method="fedavg", dataset="digits", model="mlp",
              model_kwargs={"hidden": [16]}, clients=5, rounds=2, batch_size=8,
              partition="label_groups", samples_per_client=24, seed=3,
              capture_rounds=(1,))
# private client states that go in and come back every round
HYPERFL = dict(method="hyperfl", dataset="digits", model="mlp",
               model_kwargs={"hidden": [16]}, clients=4, rounds=2, batch_size=10,
               partition="label_groups", samples_per_client=24, seed=0,
               method_kwargs={"embedding_dim": 8, "hidden_dim": 16})


@pytest.fixture
def workers():
  """Starts `n` local workers; the test session's lazy single worker after."""
  def start(n):
    runtime.stop()
    runtime.start(workers=n)
    assert runtime.worker_count() == n and len(worker_children()) == n
  yield start
  runtime.stop()


def _equal(history, other):
  """Equal keys and equal numbers, wall time aside: each worker sums its
  share of the clients first, and the sums accumulated in float64
  (`aggregation.wide_sum`) round to the same float32 total."""
  assert [sorted(m) for m in history] == [sorted(m) for m in other]
  for m, o in zip(history, other):
    assert {k: v for k, v in m.items() if k != "seconds"} == {
        k: v for k, v in o.items() if k != "seconds"}


@pytest.fixture(scope="module")
def fedavg_on_one_worker(tmp_path_factory):
  """(folder, metrics) of FEDAVG trained on one local worker: what the tests
  that train it on other workers compare with."""
  out = tmp_path_factory.mktemp("one_worker")
  runtime.stop()
  runtime.start(workers=1)
  try:
    return out, runner.run(runner.RunConfig(out=str(out), **FEDAVG),
                           progress=False)
  finally:
    runtime.stop()


@pytest.mark.slow
def test_two_workers_give_the_numbers_of_one(workers, tmp_path,
                                             fedavg_on_one_worker):
  one, history = fedavg_on_one_worker
  workers(2)
  _equal(history, runner.run(runner.RunConfig(out=str(tmp_path), **FEDAVG),
                             progress=False))
  # round 1: each upload computed whole on one worker
  alone, split = (UpdateStore(str(out / "updates")).records(1)
                  for out in (one, tmp_path))
  assert [r.client_index for r in split] == [r.client_index for r in alone]
  for a, b in zip(alone, split):
    for x, y in zip(a.upload, b.upload):
      np.testing.assert_array_equal(x, y)
  with np.load(one / "model_weights.npz") as a, \
       np.load(tmp_path / "model_weights.npz") as b:
    for key in a.files:
      np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.slow
def test_two_workers_give_the_private_states_of_one(workers, tmp_path, monkeypatch):
  """Two workers give one worker's metrics and private states, here with
  each round in calls of 3 clients and 1 (`PersonalizedProcess.run_round`)
  against one worker's single call."""
  histories = {}
  for n in (1, 2):
    workers(n)
    monkeypatch.setattr(hyperfl, "clients_per_call_for",
                        lambda parameters: 4 if n == 1 else 3)
    histories[n] = runner.run(runner.RunConfig(out=str(tmp_path / str(n)), **HYPERFL),
                              progress=False)
  _equal(histories[1], histories[2])
  # the private states came back to their own clients
  with np.load(tmp_path / "1" / "personal_models.npz") as a, \
       np.load(tmp_path / "2" / "personal_models.npz") as b:
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
      np.testing.assert_array_equal(a[key], b[key])


def test_a_computation_with_dependent_aggregations_is_refused_by_name(workers):
  @tff.tensorflow.computation(np.float32, np.float32)
  def centred(x, mean):
    return x - mean

  @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
  def variance_like(x):
    mean = tff.federated_broadcast(tff.federated_mean(x))
    return tff.federated_mean(tff.federated_map(centred, (x, mean)))

  runtime.check_mergeable(variance_like, "this")  # one worker: nothing to split
  workers(2)
  with pytest.raises(ValueError, match=r"^this cannot run on 2 workers: TFF's "
                     r"mergeable form .* one logical aggregation \(TFF: Detected "
                     r"one aggregate dependent on another\.?\); use --workers 1$"):
    runtime.check_mergeable(variance_like, "this")


@pytest.mark.parametrize("address,match", [
    ("localhost", "'localhost' is neither host:port nor unix:PATH"),
    ("localhost:0", "'localhost:0' is neither host:port nor unix:PATH"),
    ("unix:", "'unix:' is neither host:port nor unix:PATH"),
    ("10.1.2.3:8000", "'10.1.2.3:8000' is not on this machine; .* pass "
     "--allow-remote-workers")])
def test_worker_addresses_are_loopback_unless_allowed(address, match):
  with pytest.raises(ValueError, match=match):
    runtime.check_addresses([address])
  if "not on this machine" in match:
    runtime.check_addresses([address], allow_remote=True)


@pytest.mark.slow
def test_workers_started_elsewhere_train_like_local_ones(tmp_path,
                                                        fedavg_on_one_worker):
  """Two `tff-privacy worker` processes, on a Unix socket and on a loopback
  port, reached by their addresses."""
  port, socket_path = portpicker.pick_unused_port(), str(tmp_path / "w.sock")
  servers = [subprocess.Popen([sys.executable, "-m", "tff_privacy.cli", "worker",
                               *where], stderr=subprocess.PIPE, text=True)
             for where in (["--socket", socket_path], ["--port", str(port)])]
  try:
    assert "which only you can open" in servers[0].stderr.readline()
    assert "loopback only" in servers[1].stderr.readline()
    runtime.stop()
    runtime.start(addresses=[f"unix:{socket_path}", f"localhost:{port}"])
    remote = runner.run(runner.RunConfig(out=str(tmp_path / "remote"), **FEDAVG),
                        progress=False)
    here = os.readlink("/proc/self/ns/net")
    # the kernel's view: the port on loopback only, the socket private
    assert listening_sockets(servers[0].pid) == []
    assert listening_sockets(servers[1].pid) == [("127.0.0.1", port, here)]
    assert os.stat(socket_path).st_mode & 0o777 == 0o600
  finally:
    runtime.stop()
    for s in servers:
      s.terminate()
      s.wait(timeout=30)
  assert not os.path.exists(socket_path)  # removed by the worker's host
  _equal(fedavg_on_one_worker[1], remote)


@pytest.mark.parametrize("flags", [
    ["--socket", "/nonexistent/w.sock"],
    ["--socket", "w.sock", "--listen-on-every-interface"]])
def test_a_wrong_worker_socket_is_one_line(flags, capsys, tmp_path, monkeypatch):
  from tff_privacy import cli
  monkeypatch.chdir(tmp_path)
  assert cli.main(["worker", *flags]) == 2
  err = capsys.readouterr().err
  assert err.startswith("tff-privacy worker: error: --") and err.count("\n") == 1


def test_a_port_outside_the_tcp_range_is_refused_by_name(capsys):
  from tff_privacy import cli
  with pytest.raises(SystemExit) as exited:
    cli.main(["worker", "--port", "70000"])
  assert exited.value.code == 2
  assert capsys.readouterr().err.splitlines()[-1] == (
      "tff-privacy worker: error: argument --port: takes a TCP port in 1..65535, "
      "got '70000'")


def _listeners_once_serving(pid: int) -> dict[int, list]:
  """{pid: listening sockets} of `pid` and its worker_binary, once the
  binary listens."""
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline:
    binaries = worker_children(pid)
    if binaries and listening_sockets(binaries[0].pid):
      return {p: listening_sockets(p) for p in (pid, binaries[0].pid)}
    time.sleep(0.1)
  raise AssertionError("the worker did not listen in time")


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("where", ["socket", "port"])
def test_a_workers_reach_message_says_what_the_kernel_shows(tmp_path, monkeypatch,
                                                           where, shared):
  """The line `tff-privacy worker` prints against /proc's view: the socket
  or loopback port it serves on, and worker_binary's own port, inside a
  namespace of its own or, with the shared-network escape, on every
  interface of this machine."""
  if shared:
    monkeypatch.setenv(runtime.SHARED_NETWORK_VARIABLE, "1")
  port = portpicker.pick_unused_port()
  flags = (["--socket", str(tmp_path / "w.sock")] if where == "socket"
           else ["--port", str(port)])
  server = subprocess.Popen([sys.executable, "-m", "tff_privacy.cli", "worker", *flags],
                            stderr=subprocess.PIPE, text=True)
  try:
    said = server.stderr.readline()
    listeners = _listeners_once_serving(server.pid)
  finally:
    server.terminate()
    server.wait(timeout=30)
  here = os.readlink("/proc/self/ns/net")
  inner = int(re.search(r"worker_binary (?:itself )?listens on port (\d+)", said)[1])
  [binary] = [pid for pid in listeners if pid != server.pid]
  if shared:
    assert f"port {inner} of this machine's network (::): every network " \
        "interface of this machine" in said
    assert listeners[binary] == [("::", inner, here)]
  else:
    assert f"port {inner} (::) in a network namespace of its own" in said
    [(address, found, namespace)] = listeners[binary]
    assert (address, found) == ("::", inner) and namespace != here
  if where == "socket":
    assert "a Unix socket of mode 0600, which only you can open" in said
    assert listeners[server.pid] == []
  else:
    assert "127.0.0.1" in said and "loopback only" in said
    assert listeners[server.pid] == [("127.0.0.1", port, here)]


@pytest.mark.slow
def test_a_worker_serves_every_interface_only_when_asked():
  port = portpicker.pick_unused_port()
  server = subprocess.Popen([sys.executable, "-m", "tff_privacy.cli", "worker",
                             "--port", str(port), "--listen-on-every-interface"],
                            stderr=subprocess.PIPE, text=True)
  try:
    assert "every network interface of this machine: anyone who reaches" in \
        server.stderr.readline()
    deadline = time.monotonic() + 60
    while not listening_sockets(server.pid) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert listening_sockets(server.pid) == [
        ("::", port, os.readlink("/proc/self/ns/net"))]
  finally:
    server.terminate()
    server.wait(timeout=30)


def _train(out, *flags):
  return [sys.executable, "-m", "tff_privacy.cli", "train", "--out", str(out),
          "--method", "fedavg", "--dataset", "digits", "--model", "mlp",
          "--model-kwargs", '{"hidden": [16]}', "--clients", "6",
          "--batch-size", "8", "--seed", "3", "--quiet", *flags]


@pytest.mark.slow  # a worker killed while TFF's C++ executor waits on it can
# block for minutes (see runtime's watcher); the fast suite checks the
# message in test_runtime and the resume in test_runner
@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_a_killed_worker_is_named_and_the_rerun_resumes(tmp_path, sigint):
  """One of two workers is SIGKILLed after round 2's checkpoint: the run
  stops with a message naming the worker's process and leaves no worker
  behind, also when SIGINT is ignored (a background job of a shell script);
  the same command then resumes from the last finished round."""
  script = textwrap.dedent(f"""
      import os, signal, sys, threading, time
      from tff_privacy import cli, runtime
      def kill_after_round_two():
        while not os.path.exists({str(tmp_path / "run" / "checkpoints" / "program_state_2")!r}):
          time.sleep(0.05)
        import psutil
        first, second = runtime._workers
        print("pids", first.pid, second.pid, flush=True)
        [binary] = psutil.Process(second.pid).children()
        os.kill(binary.pid, signal.SIGKILL)
        print("killed worker", second.pid, flush=True)
      threading.Thread(target=kill_after_round_two, daemon=True).start()
      sys.exit(cli.main(sys.argv[1:]))
  """)
  command = _train(tmp_path / "run", "--rounds", "8", "--workers", "2")
  ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if (
      sigint == "ignored") else None
  killed = subprocess.run([sys.executable, "-c", script, *command[3:]],
                          capture_output=True, text=True, timeout=600,
                          preexec_fn=ignore)
  assert "killed worker" in killed.stdout, killed.stderr[-2000:]
  pid = killed.stdout.split("killed worker ")[1].split()[0]
  assert killed.returncode == 1, killed.stderr[-2000:]
  assert (f"error: the local TFF worker (pid {pid}) was killed by SIGKILL"
          in killed.stderr)
  for pid in killed.stdout.split("pids ")[1].split()[:2]:
    assert not psutil.pid_exists(int(pid)) or psutil.Process(
        int(pid)).status() == psutil.STATUS_ZOMBIE
  before = json.load(open(tmp_path / "run" / "metrics.json"))
  assert 2 <= len(before) < 8
  resumed = subprocess.run(command, capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  after = json.load(open(tmp_path / "run" / "metrics.json"))
  assert [m["round"] for m in after] == list(range(1, 9))
  assert after[:len(before)] == before  # nothing lost or redone


def test_wide_sums_are_the_correctly_rounded_float32_totals():
  """`WideSumFactory`, `federated_wide_mean`, `wide_mean_factory` and
  `wide_sum_then_finalize` against math.fsum (the exact sum) rounded once to float32, on values whose float32 sum depends on the
  order of the additions; integer parts are summed as they are."""
  import collections
  import math
  from tff_privacy.aggregation import wide_sum
  values = np.array([[1.0, 3e-8], [5e-8, 1.0], [5e-8, -1.0], [5e-8, 1e-8]],
                    np.float32)
  in_order = np.float32(0)
  for v in values[:, 0]:
    in_order = np.float32(in_order + v)
  exact = np.float32([math.fsum(float(v) for v in column) for column in values.T])
  assert in_order != exact[0]  # float32 in client order loses the small parts
  value_type = collections.OrderedDict(a=tff.TensorType(np.float32, [2]),
                                       n=tff.TensorType(np.int32),
                                       d=tff.TensorType(np.float64))
  process = wide_sum.WideSumFactory().create(value_type)
  clients = [collections.OrderedDict(a=v, n=np.int32(i), d=np.float64(0.1))
             for i, v in enumerate(values)]
  total = process.next(process.initialize(), clients).result
  np.testing.assert_array_equal(total["a"], exact)
  assert total["n"] == 6 and total["n"].dtype == np.int32
  assert total["d"] == 0.1 + 0.1 + 0.1 + 0.1 and total["d"].dtype == np.float64

  @tff.federated_computation(tff.FederatedType(tff.TensorType(np.float32, [2]),
                                               tff.CLIENTS))
  def mean_of(client_values):
    return wide_sum.federated_wide_mean(client_values)

  np.testing.assert_array_equal(mean_of(list(values)), np.float32(
      [math.fsum(float(v) for v in column) / 4 for column in values.T]))
  weights = np.float32([1, 2, 3, 4])
  mean = wide_sum.wide_mean_factory().create(tff.TensorType(np.float32, [2]),
                                             tff.TensorType(np.float32))
  got = mean.next(mean.initialize(), list(values), list(weights)).result
  weighted = [[math.fsum(float(np.float32(v * w)) for v, w in zip(column, weights))]
              for column in values.T]
  np.testing.assert_array_equal(
      got, np.float32(weighted).ravel() / np.float32(math.fsum(weights)))
  aggregate = wide_sum.wide_sum_then_finalize(collections.OrderedDict(
      total=lambda t: t, halved=lambda t: t / 2))
  metric_type = tff.TensorType(np.float32, [2])

  @tff.federated_computation(tff.FederatedType(collections.OrderedDict(
      total=metric_type, halved=metric_type), tff.CLIENTS))
  def finalized(client_metrics):
    return aggregate(client_metrics)

  metrics = finalized([collections.OrderedDict(total=v, halved=v) for v in values])
  np.testing.assert_array_equal(metrics["total"], exact)
  np.testing.assert_array_equal(metrics["halved"], exact / 2)


def test_wide_mean_folded_in_parts_is_tff_mean_to_the_bit(monkeypatch):
  """`wide_mean_factory` and `federated_wide_sum` with every value cut into
  parts of 4 entries (a matrix cut between its rows, a scalar and a vector
  packed together): the exact sums (math.fsum) of the float32 products,
  rounded once, then divided as `tff.aggregators.MeanFactory` divides."""
  import collections
  import math
  from tff_privacy.aggregation import wide_sum
  monkeypatch.setattr(wide_sum, "PART_ELEMENTS", 4)
  rng = np.random.default_rng(0)
  value_type = collections.OrderedDict(
      m=tff.TensorType(np.float32, [5, 3]), s=tff.TensorType(np.float32),
      v=tff.TensorType(np.float32, [2]))
  clients = [collections.OrderedDict(
      m=(rng.normal(size=(5, 3)) * 10.0 ** rng.integers(-8, 3, (5, 3))).astype(np.float32),
      s=np.float32(rng.normal()), v=rng.normal(size=2).astype(np.float32))
      for _ in range(6)]
  weights = np.float32([1, 2, 3, 150, 0.5, 7])

  def exact(name, w):
    stacked = np.stack([c[name] * np.float32(x) for c, x in zip(clients, w)])
    return np.float32(np.vectorize(lambda *t: math.fsum(t))(*stacked))

  mean = wide_sum.wide_mean_factory().create(tff.to_type(value_type),
                                             tff.TensorType(np.float32))
  got = mean.next(mean.initialize(), clients, list(weights)).result
  for name in value_type:
    np.testing.assert_array_equal(
        got[name], exact(name, weights) / np.float32(math.fsum(weights)))

  @tff.federated_computation(tff.FederatedType(tff.to_type(value_type), tff.CLIENTS))
  def total(values):
    return wide_sum.federated_wide_sum(values)

  summed = total(clients)
  for name in value_type:
    np.testing.assert_array_equal(summed[name], exact(name, np.ones(6)))


def _worker_peak_mb(computation, *args) -> int:
  """The peak resident MiB of a fresh local worker (and its children) over
  one call of `computation`, above its size before the call."""
  import threading
  runtime.stop()
  worker = psutil.Process(runtime.start().process.pid)

  def rss():
    return sum(p.memory_info().rss for p in [worker, *worker.children(recursive=True)])
  before, peak, done = rss(), [0], threading.Event()

  def sample():
    while not done.is_set():
      peak[0] = max(peak[0], rss())
      time.sleep(0.02)
  sampler = threading.Thread(target=sample)
  sampler.start()
  computation(*args)
  done.set()
  sampler.join()
  runtime.stop()
  return (peak[0] - before) // 2**20


@pytest.mark.slow
def test_wide_mean_holds_no_copy_of_every_client_value(monkeypatch):
  """Averaging 20 clients' values of 8 MiB with `wide_mean_factory`, folded
  in parts of 256 KiB, takes the worker less than one more copy of all of
  them (160 MiB) beyond receiving them (a computation that only reads
  them): TFF's runtime keeps every accumulator of one `federated_aggregate`
  and every client's weighted value until the aggregation ends, which a
  float64 fold of every client's weighted value in one aggregation (480
  MiB here) would exceed."""
  from tff_privacy.aggregation import wide_sum
  monkeypatch.setattr(wide_sum, "PART_ELEMENTS", 2**16, raising=False)
  size, n = 2**21, 20
  value_type = tff.TensorType(np.float32, [size])
  values = [np.full(size, i, np.float32) for i in range(n)]
  weights = [np.float32(i + 1) for i in range(n)]
  mean = wide_sum.wide_mean_factory().create(value_type, tff.TensorType(np.float32))

  @tff.tensorflow.computation(value_type)
  def first(value):
    return value[0]

  @tff.federated_computation(tff.FederatedType(value_type, tff.CLIENTS),
                             tff.FederatedType(np.float32, tff.CLIENTS))
  def read_only(value, weight):
    del weight
    return tff.federated_sum(tff.federated_map(first, value))

  received = _worker_peak_mb(read_only, values, weights)
  averaged = _worker_peak_mb(
      lambda v, w: mean.next(mean.initialize(), v, w), values, weights)
  assert averaged - received < n * size * 4 // 2**20, (received, averaged)
