"""tff_privacy/private_worker.py, the worker's host, with a stand-in worker:
it removes only the socket it bound, refuses ports outside 1..65535, and
fails in one line where the C library has no `unshare`."""

import os
import socket
import stat
import subprocess
import sys
import textwrap
import time

import portpicker
import pytest

from tff_privacy import private_worker


def _host(listen: str, worker: str, *flags: str) -> list[str]:
  return [sys.executable, "-I", "-S", private_worker.__file__, "--listen", listen,
          "--worker", worker, *flags]


@pytest.fixture
def sleeper(tmp_path) -> str:
  """A stand-in worker that serves nothing and runs until stopped."""
  path = tmp_path / "sleeper"
  path.write_text("#!/bin/sh\nexec sleep 600\n")
  path.chmod(0o700)
  return str(path)


def _wait_for_socket(path: str, timeout_s: float = 30.0) -> os.stat_result:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    try:
      status = os.lstat(path)
      if stat.S_ISSOCK(status.st_mode):
        return status
    except FileNotFoundError:
      pass
    time.sleep(0.05)
  raise AssertionError(f"no socket at {path}")


def test_a_failed_bind_leaves_the_path_alone(tmp_path, sleeper):
  """A second host on a live socket's path, and a host on a regular file's
  path, fail without removing what is there; the first host removes its own
  socket when it ends."""
  path = str(tmp_path / "w.sock")
  first = subprocess.Popen(_host(f"unix:{path}", sleeper, "--shared-network"),
                           stderr=subprocess.PIPE, text=True)
  try:
    bound = _wait_for_socket(path)
    second = subprocess.run(_host(f"unix:{path}", sleeper, "--shared-network"),
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and "Address already in use" in second.stderr
    after = os.lstat(path)
    assert (after.st_dev, after.st_ino) == (bound.st_dev, bound.st_ino)
    with socket.socket(socket.AF_UNIX) as s:
      s.connect(path)  # still the first host's
  finally:
    first.terminate()
    first.wait(timeout=30)
  assert not os.path.exists(path)

  precious = tmp_path / "precious.txt"
  precious.write_text("keep me")
  third = subprocess.run(_host(f"unix:{precious}", sleeper, "--shared-network"),
                         capture_output=True, text=True, timeout=60)
  assert third.returncode == 1 and precious.read_text() == "keep me"


@pytest.mark.parametrize("address", ["127.0.0.1:70000", "127.0.0.1:0", "[::]:65536"])
def test_ports_outside_the_tcp_range_are_refused(address):
  with pytest.raises(ValueError, match=r"--listen takes .* port in 1\.\.65535, got"):
    private_worker.listen(address)


def test_a_c_library_without_unshare_is_one_line(tmp_path):
  """As on a system that is not Linux: the documented exit code, the escape
  variable named, and the socket it bound removed."""
  path = tmp_path / "w.sock"
  script = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {os.path.dirname(private_worker.__file__)!r})
      import private_worker
      private_worker._libc = object()  # a C library with no unshare
      private_worker.main(["--listen", "unix:{path}", "--worker", "/bin/true"])
  """)
  result = subprocess.run([sys.executable, "-I", "-S", "-c", script],
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == private_worker.EXIT_NO_PRIVATE_NETWORK, result.stderr
  assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
  assert "no unshare" in result.stderr
  assert f"set {private_worker.SHARED_NETWORK_VARIABLE}=1" in result.stderr
  assert os.listdir(tmp_path) == []


def test_the_workers_last_words_are_repeated_when_it_fails(tmp_path):
  said = "worker_binary: error while loading shared libraries: libnope.so.1"
  worker = tmp_path / "broken"
  worker.write_text(f"#!/bin/sh\necho early >&2\necho '{said}' >&2\nexit 127\n")
  worker.chmod(0o700)
  result = subprocess.run(_host(f"unix:{tmp_path / 'w.sock'}", str(worker),
                                "--shared-network"),
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 127
  lines = result.stderr.splitlines()  # no reach: it never listened
  assert lines[0].endswith("ended with code 127; the last lines it wrote on stderr:")
  assert lines[1:] == ["early", said]


def test_signals_without_a_name_are_named_by_number():
  assert private_worker.signal_name(15) == "SIGTERM"
  assert private_worker.signal_name(40) == "signal 40"  # a real-time signal


@pytest.mark.parametrize("host,reach", [
    ("127.0.0.1", "loopback only"), ("[::1]", "loopback only"),
    ("0", "every network interface of this machine"),
    ("[::]", "every network interface of this machine")])
def test_the_reach_of_a_tcp_socket_is_read_from_its_bound_address(host, reach):
  """By the address the kernel bound (0 is 0.0.0.0), not the text given."""
  with private_worker.listen(f"{host}:{portpicker.pick_unused_port()}") as outer:
    said = private_worker.describe_reach(outer, ["::"], False, 1234)
  assert said.startswith(private_worker.REACH_PREFIX)
  assert f"plaintext, unauthenticated gRPC on {reach}" in said
  assert said.endswith("worker_binary listens on port 1234 (::) in a network "
                       "namespace of its own, out of reach of this machine's network")


def test_listening_addresses_are_the_kernels():
  with socket.socket(socket.AF_INET) as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    assert private_worker.listening_addresses(port) == ["127.0.0.1"]
  assert private_worker.listening_addresses(port) == []
