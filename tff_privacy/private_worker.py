"""TFF's worker in a network of its own, reached through one socket.

TFF 0.87's ``worker_binary`` serves its executor API on every interface
(``[::]:PORT``) and has no flag to bind another address. Whoever reaches that
port can run any TensorFlow graph on it, file operations included, as the user
who started it. This program starts the worker in a new network namespace,
whose only interface is its own loopback, and forwards to it the connections
made to one listening socket opened before the namespace was entered:

- ``unix:PATH``: a Unix socket of mode 0600, which only its user can open
  (`runtime`'s local workers; ``tff-privacy worker --socket``);
- ``HOST:PORT``: a TCP socket (``tff-privacy worker --port``: ``127.0.0.1``,
  which every user of the machine can reach; ``[::]`` only when asked).

A user without root gets the namespace through a user namespace that maps
their own ids onto themselves, so files keep their owners. Where the kernel
allows neither, the program says so in one line on stderr and exits with code
`EXIT_NO_PRIVATE_NETWORK`; `--shared-network` (what `SHARED_NETWORK_VARIABLE`
set to 1 asks for) then keeps the machine's network, where the worker listens
on every interface.

Once the kernel shows the worker listening, it states on stderr, in one line
beginning with `REACH_PREFIX`, who can reach the worker: the listening
socket, as bound, and the addresses of ``worker_binary``'s own port, in the
private network or, with `--shared-network`, this machine's. It keeps the last lines that the worker writes
on stderr and repeats them when the worker exits with an error.

It exits as the worker exits: with the worker's code, or killed by the same
signal, so the caller can say why the worker ended. With `--parent-pipe` it
ends, and the worker with it, when the caller's end of that pipe closes,
which the kernel does when the caller's process ends in any way. On every
exit but SIGKILL it removes the Unix socket it bound (never a path it did
not bind: a failed bind removes nothing), and with `--remove-directory` the
socket's directory.

Standard library only, run by path in Python's isolated mode without site
packages (``python -I -S private_worker.py``): ``unshare(CLONE_NEWUSER)``
refuses a process that has started threads.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import errno
import fcntl
import ipaddress
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

SHARED_NETWORK_VARIABLE = "TFF_PRIVACY_WORKER_SHARED_NETWORK"
EXIT_NO_PRIVATE_NETWORK = 86
REACH_PREFIX = "TFF worker at "
_STDERR_LINES_KEPT = 10
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_PR_SET_PDEATHSIG = 1
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_CHUNK = 1 << 20
_CONNECT_TIMEOUT_S = 60.0

_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent(signum: int = signal.SIGTERM) -> None:
  """Has the kernel send `signum` to this process when the thread that
  started it ends (Linux)."""
  if sys.platform.startswith("linux"):
    _libc.prctl(_PR_SET_PDEATHSIG, signum)


def listen(address: str) -> socket.socket:
  """A listening socket at ``unix:PATH`` (mode 0600) or ``HOST:PORT``.

  Raises:
    ValueError: `address` is neither form.
    OSError: the address cannot be bound.
  """
  if address.startswith("unix:"):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)
    try:
      sock.bind(address[len("unix:"):])
    finally:
      os.umask(old_mask)
  else:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError("--listen takes unix:PATH or HOST:PORT with a port in "
                       f"1..65535, got {address!r}")
    family, kind, proto, _, where = socket.getaddrinfo(
        host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6 and host == "::":
      sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(where)
  sock.listen(16)
  return sock


def enter_private_network() -> None:
  """Moves this process into a new network namespace and brings its loopback
  up. Without the privilege for that, first into a user namespace that maps
  the user's own uid and gid.

  Raises:
    OSError: the kernel allows neither, or the C library has no `unshare`.
  """
  unshare = getattr(_libc, "unshare", None)
  if unshare is None:  # a C library without it: not Linux
    raise OSError(errno.ENOSYS, "this system's C library has no unshare")
  if unshare(_CLONE_NEWNET) != 0:
    uid, gid = os.getuid(), os.getgid()
    if unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
      code = ctypes.get_errno()
      raise OSError(code, f"unshare: {os.strerror(code)}")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
      with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    request = struct.pack("16sH", b"lo", 0)
    flags = struct.unpack("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
    fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pump(source: socket.socket, sink: socket.socket) -> None:
  """Copies `source` to `sink` until `source` ends, then ends `sink`'s
  sending side."""
  try:
    while chunk := source.recv(_CHUNK):
      sink.sendall(chunk)
  except OSError:
    pass
  finally:
    try:
      sink.shutdown(socket.SHUT_WR)
    except OSError:
      pass


def _connect_inward(port: int) -> socket.socket | None:
  """A connection to the worker, retried while it starts; None if it does
  not answer in time."""
  deadline = time.monotonic() + _CONNECT_TIMEOUT_S
  while time.monotonic() < deadline:
    try:
      return socket.create_connection(("127.0.0.1", port))
    except ConnectionRefusedError:
      time.sleep(0.02)
  return None


def _forward(client: socket.socket, port: int) -> None:
  """Carries one connection to the worker and back, then closes both ends."""
  with client:
    try:
      inner = _connect_inward(port)
    except OSError:
      return
    if inner is None:
      return
    with inner:
      back = threading.Thread(target=_pump, args=(inner, client), daemon=True)
      back.start()
      _pump(client, inner)
      back.join()


def _serve(outer: socket.socket, port: int) -> None:
  """Forwards every connection accepted on `outer` to the worker's port."""
  while True:
    try:
      client, _ = outer.accept()
    except OSError:  # e.g. out of file descriptors: try the next one
      time.sleep(0.1)
      continue
    threading.Thread(target=_forward, args=(client, port), daemon=True).start()


def _end_when_closed(pipe: int, stop) -> None:
  """Calls `stop` once the other end of `pipe` is closed."""
  while os.read(pipe, 1):
    pass
  stop()


def _bound_socket(listen_address: str) -> "tuple[str, tuple[int, int]] | None":
  """(path, (device, inode)) of the Unix socket this process just bound at
  `listen_address`; None for a TCP address."""
  if not listen_address.startswith("unix:"):
    return None
  path = listen_address[len("unix:"):]
  status = os.lstat(path)
  return path, (status.st_dev, status.st_ino)


def _remove(bound: "tuple[str, tuple[int, int]] | None", directory: bool) -> None:
  """Removes the Unix socket `bound` (`_bound_socket`) if the path still
  holds that very socket, and with `directory` its directory; nothing for
  a TCP socket."""
  if bound is None:
    return
  path, identity = bound
  if directory:
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return
  try:
    status = os.lstat(path)
  except FileNotFoundError:
    return
  if stat.S_ISSOCK(status.st_mode) and (status.st_dev, status.st_ino) == identity:
    os.unlink(path)


def describe_reach(outer: socket.socket, listeners: "list[str]",
                   shared_network: bool, port: int) -> str:
  """Who can reach a worker served on the listening socket `outer` whose own
  ``worker_binary`` listens on `port` at the addresses `listeners` (as the
  kernel lists them, `listening_addresses`), in one line that starts with
  `REACH_PREFIX`."""
  if outer.family == socket.AF_UNIX:
    served = f"unix:{outer.getsockname()}"
    outer_reach = "a Unix socket of mode 0600, which only you can open"
  else:
    host, outer_port = outer.getsockname()[:2]
    served = f"[{host}]:{outer_port}" if ":" in host else f"{host}:{outer_port}"
    outer_reach = _reach_of(host, "the port")
  where = ", ".join(listeners)
  if shared_network:
    inner = (f"warning: {SHARED_NETWORK_VARIABLE}=1, so worker_binary itself "
             f"listens on port {port} of this machine's network ({where}): "
             f"{_reach_of(_widest(listeners), 'that port')}")
  else:
    inner = (f"worker_binary listens on port {port} ({where}) in a network "
             "namespace of its own, out of reach of this machine's network")
  return (f"{REACH_PREFIX}{served}: plaintext, unauthenticated gRPC on "
          f"{outer_reach}; {inner}")


def _reach_of(address: str, what: str) -> str:
  """Who reaches `what` (a port) listening at IP `address`."""
  ip = ipaddress.ip_address(address.split("%")[0])
  if ip.is_unspecified:
    return (f"every network interface of this machine: anyone who reaches "
            f"{what} can run code as you")
  if ip.is_loopback:
    return ("loopback only: every user of this machine can reach it; other "
            "machines through an SSH tunnel")
  return f"{address}: anyone who reaches that address can run code as you"


def _widest(addresses: "list[str]") -> str:
  """An unspecified address (every interface) among `addresses` if there is
  one, else the first."""
  return next((a for a in addresses
               if ipaddress.ip_address(a.split("%")[0]).is_unspecified), addresses[0])


def listening_addresses(port: int) -> "list[str]":
  """The addresses at which a TCP socket of this network namespace listens
  on `port`, from the kernel's tables (/proc/self/net/tcp and tcp6)."""
  found = []
  for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
    try:
      with open(f"/proc/self/net/{table}") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    except OSError:
      continue
    for row in rows:
      address, hex_port = row[1].split(":")
      if row[3] == "0A" and int(hex_port, 16) == port:  # 0A: TCP_LISTEN
        words = bytes.fromhex(address)  # host-order 32-bit words
        packed = b"".join(words[i:i + 4][::-1] for i in range(0, len(words), 4))
        found.append(socket.inet_ntop(family, packed))
  return found


def _announce_when_listening(outer: socket.socket, port: int, shared_network: bool,
                             worker: subprocess.Popen) -> None:
  """Prints `describe_reach` once the kernel shows the worker listening on
  `port`; nothing if it ends first."""
  deadline = time.monotonic() + _CONNECT_TIMEOUT_S
  while worker.poll() is None and time.monotonic() < deadline:
    listeners = listening_addresses(port)
    if listeners:
      print(describe_reach(outer, listeners, shared_network, port),
            file=sys.stderr, flush=True)
      return
    time.sleep(0.05)


def signal_name(number: int) -> str:
  """The name of signal `number` (SIGTERM), or 'signal N' for one that has
  none (the real-time signals)."""
  try:
    return signal.Signals(number).name
  except ValueError:
    return f"signal {number}"


def _keep_last_lines(stream, kept: collections.deque) -> None:
  """Reads `stream` to its end, keeping its last lines in `kept`."""
  for line in stream:
    kept.append(line.decode(errors="replace").rstrip()[:500])


def _exit_like(returncode: int) -> None:
  """Ends this process as the worker ended."""
  if returncode < 0:
    if -returncode != signal.SIGKILL:  # whose handler cannot be changed
      signal.signal(-returncode, signal.SIG_DFL)
    os.kill(os.getpid(), -returncode)
  sys.exit(returncode)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="private_worker.py",
      description="TFF's worker_binary in a private network namespace, "
      "reached through one listening socket.")
  p.add_argument("--listen", required=True, help="unix:PATH or HOST:PORT")
  p.add_argument("--worker", required=True, help="path of worker_binary")
  p.add_argument("--max-concurrent-computation-calls", type=int, default=-1)
  p.add_argument("--parent-pipe", type=int,
                 help="a pipe's read end: end when its write end closes")
  p.add_argument("--remove-directory", action="store_true",
                 help="at exit, remove the Unix socket's directory")
  p.add_argument("--shared-network", action="store_true",
                 help="keep this machine's network: the worker then listens "
                 "on every interface")
  return p


def main(argv=None) -> None:
  args = _parser().parse_args(argv)
  try:
    outer = listen(args.listen)
    bound = _bound_socket(args.listen)
  except (ValueError, OSError) as e:
    sys.exit(f"cannot listen at {args.listen}: {e}")
  try:
    if not args.shared_network:
      enter_private_network()
  except OSError as e:
    _remove(bound, args.remove_directory)
    print(f"cannot give the TFF worker a private network ({e.strerror or e}: "
          "the kernel allows no network or user namespace here); set "
          f"{SHARED_NETWORK_VARIABLE}=1 to run it on this machine's network "
          "instead, where it listens on every interface and anyone who "
          "reaches its port can run code as you", file=sys.stderr, flush=True)
    sys.exit(EXIT_NO_PRIVATE_NETWORK)
  port = _free_port()
  returncode = _run_worker(args, outer, port)
  _remove(bound, args.remove_directory)
  _exit_like(returncode)


def _run_worker(args, outer: socket.socket, port: int) -> int:
  """Runs the worker on `port`, forwarding `outer`'s connections to it, until
  it ends; its return code. Repeats the last lines of its stderr when it
  ends unasked with an error."""
  host = os.getpid()

  def worker_setup():
    die_with_parent(signal.SIGKILL)
    if os.getppid() != host:
      os._exit(1)

  worker = subprocess.Popen(
      [args.worker, f"--port={port}", "--max_concurrent_computation_calls="
       f"{args.max_concurrent_computation_calls}"],
      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, preexec_fn=worker_setup)
  kept = collections.deque(maxlen=_STDERR_LINES_KEPT)
  asked = threading.Event()

  def stop(*_):
    asked.set()
    worker.terminate()

  stopping = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
  for signum in stopping:
    signal.signal(signum, stop)
  # The threads block these signals, so that the kernel delivers them to the
  # main thread: one that another thread took would set Python's flag but
  # leave the main thread waiting for the worker.
  signal.pthread_sigmask(signal.SIG_BLOCK, stopping)
  reader = threading.Thread(target=_keep_last_lines, args=(worker.stderr, kept),
                            daemon=True)
  reader.start()
  if args.parent_pipe is not None:
    threading.Thread(target=_end_when_closed, args=(args.parent_pipe, stop),
                     daemon=True).start()
  threading.Thread(target=_serve, args=(outer, port), daemon=True).start()
  threading.Thread(target=_announce_when_listening, daemon=True,
                   args=(outer, port, args.shared_network, worker)).start()
  signal.pthread_sigmask(signal.SIG_UNBLOCK, stopping)
  returncode = worker.wait()
  reader.join(timeout=1.0)
  if returncode != 0 and not asked.is_set() and kept:
    how = f"code {returncode}" if returncode > 0 else signal_name(-returncode)
    print(f"worker_binary (pid {worker.pid}) ended with {how}; the last lines "
          "it wrote on stderr:", *kept, sep="\n", file=sys.stderr, flush=True)
  return returncode


if __name__ == "__main__":
  main()
