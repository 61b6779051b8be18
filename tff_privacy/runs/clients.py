"""Each client's samples: which clients a round samples, the order and
batches of their local samples, and the files a round's clients read
their data from (`ClientFiles`)."""

from __future__ import annotations

import collections
import fcntl
import functools
import os
import shutil
import stat
import sys
import tempfile
import weakref
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tff_privacy import algorithms
from tff_privacy.protocol import local_batch_sizes
from tff_privacy.runs.config import RunConfig


def sample_clients(config: RunConfig, round_num: int) -> np.ndarray:
  """The clients of `round_num`: sorted, without replacement, from (seed, round)."""
  if config.sampled_per_round == config.clients:
    return np.arange(config.clients)
  rng = np.random.default_rng([config.seed, round_num, 0])
  return np.sort(rng.choice(config.clients, config.sampled_per_round,
                            replace=False))


def local_order(num_samples: int, algorithm: algorithms.Algorithm,
                config: RunConfig, round_num: int, client: int) -> np.ndarray:
  """Indices of a client's samples in the order it uses them this round:
  one batch (FedSGD) or a fresh permutation per local epoch."""
  rng = np.random.default_rng([config.seed, round_num, client + 1])
  if algorithm.local_data == "one_batch":
    return rng.permutation(num_samples)[: config.batch_size]
  return np.concatenate([rng.permutation(num_samples)
                         for _ in range(algorithm.local_epochs)])


def local_batches(num_samples: int, algorithm: algorithms.Algorithm,
                  config: RunConfig) -> list[int]:
  """The batch sizes of a client's round (`protocol.local_batch_sizes`)."""
  return local_batch_sizes(num_samples, config.batch_size, algorithm.local_epochs,
                           one_batch=algorithm.local_data == "one_batch")


def client_dataset(x: np.ndarray, y: np.ndarray,
                   batch_sizes: Sequence[int]) -> tf.data.Dataset:
  """(x, y) in order, cut into consecutive batches of `batch_sizes`."""
  # Dataset.batch cuts each run of equal batches ending in a smaller one (a
  # local epoch)
  return _concatenated_runs(batch_sizes, lambda start, count, size: (
      tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
          x=x[start:start + count], y=y[start:start + count])).batch(size)))


def _concatenated_runs(batch_sizes: Sequence[int], run_of: Callable) -> tf.data.Dataset:
  """The datasets `run_of(start, count, size)` of each run of equal batches
  (`_batch_runs`: `count` samples from `start` cut into batches of `size`),
  concatenated (`unoptimized`)."""
  ds, start = None, 0
  for size, count in _batch_runs(batch_sizes):
    run = run_of(start, count, size)
    ds = run if ds is None else ds.concatenate(run)
    start += count
  return unoptimized(ds)


def unoptimized(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """`dataset` without tf.data's default static optimizations, which every
  data set derived from it inherits (the client computations' maps, takes
  and passes). They rewrite the pipeline each time it is iterated: about 5
  of the 9 ms a pass over one of the compact leaderboard's clients (20
  samples) took on a TFF worker. Turning them off leaves the elements, and
  their order, unchanged."""
  options = tf.data.Options()
  options.experimental_optimization.apply_default_optimizations = False
  return dataset.with_options(options)


class ClientFiles:
  """Each client's training samples in files that the TFF workers read, so
  that a round's datasets carry a folder and a sample order, not the
  samples: the driver and the worker then hold only the batches in flight,
  whatever the number of samples (`file_client_dataset`). A client's
  folder, one file per sample (its x then its y, raw bytes), is written at
  its first round, in a private temporary folder removed by `close`, when
  this object is collected or at exit.

  The folder holds `LOCK`, locked (``flock``) for as long as this object
  lives: the kernel releases the lock when the process ends in any way, so
  the next `ClientFiles` removes the folders whose lock it can take, even
  those of processes in other PID namespaces sharing the temporary folder
  (containers, Bazel's sandboxes), whose PIDs say nothing here. Only for
  workers on this machine."""

  PREFIX = "tff-privacy-clients-"
  LOCK = ".lock"

  def __init__(self, x: np.ndarray, y: np.ndarray,
               client_indices: Sequence[np.ndarray]):
    self.x, self.y, self.client_indices = x, y, client_indices
    parent = tempfile.gettempdir()
    _remove_orphaned_client_files(parent)
    self._folder, lock = _locked_folder(parent, self.PREFIX, self.LOCK)
    self._finalizer = weakref.finalize(self, _remove_locked_folder, self._folder, lock)
    self._written: set[int] = set()

  def folder(self, client: int) -> str:
    """The folder of `client`'s samples x[indices], y[indices] (its
    `client_indices`): file k holds the k-th; written if new."""
    folder = os.path.join(self._folder, f"client_{client}")
    if client not in self._written:
      # whole or not at all; a half-written one goes with the run's folder
      tmp = tempfile.mkdtemp(dir=self._folder, prefix=".tmp-")
      for k, i in enumerate(self.client_indices[client]):
        with open(os.path.join(tmp, str(k)), "wb") as f:
          f.write(np.ascontiguousarray(self.x[i]).tobytes())
          f.write(np.ascontiguousarray(self.y[i]).tobytes())
      os.replace(tmp, folder)
      self._written.add(client)
    return folder

  def close(self) -> None:
    self._finalizer()


def _locked_folder(parent: str, prefix: str, lock_name: str) -> tuple[str, int]:
  """A new private folder `prefix`* in `parent` holding the file `lock_name`,
  locked by the returned descriptor. Made under another name and renamed
  once locked, so no cleaner ever sees one of its folders unlocked while
  its process lives.

  Raises:
    OSError: the folder cannot be made or locked (a file system without
      flock); nothing is left behind.
  """
  making = tempfile.mkdtemp(dir=parent, prefix=f".{prefix}new-")
  lock = None
  try:
    lock = os.open(os.path.join(making, lock_name), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    folder = os.path.join(parent, prefix + os.path.basename(making)[len(f".{prefix}new-"):])
    os.rename(making, folder)
  except OSError:
    if lock is not None:
      os.close(lock)
    shutil.rmtree(making, ignore_errors=True)
    raise
  return folder, lock


def _remove_locked_folder(folder: str, lock: int) -> None:
  shutil.rmtree(folder, ignore_errors=True)
  os.close(lock)


def _remove_orphaned_client_files(parent: str) -> None:
  """Removes this user's `ClientFiles` folders in `parent` whose lock no
  process holds, and those of earlier versions (named by their process id,
  without a lock) whose process no longer runs. Any other folder without a
  lock file is left alone."""
  for name in os.listdir(parent):
    if not name.startswith(ClientFiles.PREFIX):
      continue
    path = os.path.join(parent, name)
    try:
      status = os.lstat(path)
      if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid():
        continue
      lock = os.open(os.path.join(path, ClientFiles.LOCK), os.O_RDONLY)
    except FileNotFoundError:
      if _ended_unlocked(name[len(ClientFiles.PREFIX):]):
        shutil.rmtree(path, ignore_errors=True)
      continue
    except OSError:
      continue
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # its process still runs
      os.close(lock)
      continue
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock)


def _ended_unlocked(suffix: str) -> bool:
  """Whether an unlocked folder named `suffix` after the prefix is an earlier
  version's ('PID-random') whose process no longer runs."""
  pid, dash, _ = suffix.partition("-")
  return bool(dash) and pid.isdigit() and not _process_runs(int(pid))


def _process_runs(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def file_client_dataset(folder: str, specs: tuple[tf.TensorSpec, ...],
                        order: np.ndarray, batch_sizes: Sequence[int]
                        ) -> tf.data.Dataset:
  """`client_dataset` of the samples x[order], y[order], read one at a time
  from `folder` (`ClientFiles.folder`; x and y with `specs`) when the
  dataset is iterated."""
  batches = _file_batches(*specs)
  order = np.asarray(order, np.int64)
  return _concatenated_runs(batch_sizes, lambda start, count, size: batches(
      folder, order[start:start + count], size))


@functools.lru_cache(maxsize=None)
def _file_batches(x_spec, y_spec) -> Callable:
  """A tf.function (folder, order, batch size) -> batches of the samples
  `order` read from the folder's files; traced once for these specs."""
  shapes = [s.shape[1:] for s in (x_spec, y_spec)]
  sizes = [s.dtype.size * shape.num_elements() for s, shape in zip((x_spec, y_spec), shapes)]

  def decoded(raw, start, spec, shape, size):
    return tf.reshape(tf.io.decode_raw(tf.strings.substr(raw, start, size), spec.dtype,
                                       little_endian=sys.byteorder == "little"), shape)

  def sample(folder, k):
    raw = tf.io.read_file(tf.strings.join([folder, tf.strings.as_string(k)], "/"))
    checked = tf.debugging.assert_equal(  # a file of other specs fails, not garbles
        tf.strings.length(raw), sum(sizes), message="a client sample file of other specs")
    with tf.control_dependencies([checked]):
      raw = tf.identity(raw)
    return collections.OrderedDict(
        x=decoded(raw, 0, x_spec, shapes[0], sizes[0]),
        y=decoded(raw, sizes[0], y_spec, shapes[1], sizes[1]))

  @tf.function(input_signature=(tf.TensorSpec([], tf.string), tf.TensorSpec([None], tf.int64),
                                tf.TensorSpec([], tf.int64)))
  def batches(folder, order, size):
    return tf.data.Dataset.from_tensor_slices(order).map(
        lambda k: sample(folder, k), num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True).batch(size)

  return batches


def spec_of(samples: np.ndarray) -> tf.TensorSpec:
  """The spec of `samples`, their number left open."""
  return tf.TensorSpec((None, *samples.shape[1:]), tf.as_dtype(samples.dtype))


def _batch_runs(batch_sizes: Sequence[int]) -> list[tuple[int, int]]:
  """(batch size, samples) of each run of equal batches that Dataset.batch
  cuts alike: a run ends after a smaller batch, e.g. [4, 4, 2, 4, 4, 2] ->
  [(4, 10), (4, 10)]."""
  runs: list[list] = []  # [size, samples, ended]
  for b in batch_sizes:
    if runs and not runs[-1][2] and b <= runs[-1][0]:
      runs[-1][1] += b
      runs[-1][2] = b < runs[-1][0]
    else:
      runs.append([b, b, False])
  return [(size, count) for size, count, _ in runs]
