"""Federated data sets: a `tff.simulation.datasets.ClientData` plus a test set."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy.data import partitioners
from tff_privacy.data import sources
from tff_privacy.data import splits

# the partition of a federation given as TFF ClientData (`from_client_data`)
CLIENT_DATA = "client_data"
_READ_BATCH = 4096  # samples read from a ClientData at a time


@dataclasses.dataclass(frozen=True)
class FederatedData:
  """Training samples split among clients, and a held-out test set.

  `client_data` serves each client's samples as a `tf.data.Dataset` of
  `OrderedDict(x=..., y=...)` elements; `client_arrays` gives the same samples as
  numpy arrays for code that batches them itself. Each client also has a
  test split drawn from the test set the way its training samples were
  (`client_test_arrays`, for personalised evaluation). The global model is
  tested on `test`: the source's whole test set, or where the clients'
  test splits are given (a split file, ClientData) those splits pooled, in
  client order.
  """

  source: sources.Source
  client_indices: tuple[np.ndarray, ...]
  client_test_indices: tuple[np.ndarray, ...]
  test_indices: Optional[np.ndarray] = None  # None: the whole test set

  @property
  def client_ids(self) -> list[str]:
    return [client_id(i) for i in range(len(self.client_indices))]

  @property
  def num_clients(self) -> int:
    return len(self.client_indices)

  def client_arrays(self, client: int) -> tuple[np.ndarray, np.ndarray]:
    idx = self.client_indices[client]
    return self.source.x_train[idx], self.source.y_train[idx]

  def client_test_arrays(self, client: int) -> tuple[np.ndarray, np.ndarray]:
    idx = self.client_test_indices[client]
    return self.source.x_test[idx], self.source.y_test[idx]

  @property
  def client_data(self) -> tff.simulation.datasets.ClientData:
    """The clients' samples as TFF `ClientData`. Its dataset function is
    plain TensorFlow (the client index is parsed from the id tensor), so
    TFF's `dataset_computation` and `create_tf_dataset_from_all_clients`
    can trace it."""
    flat = np.concatenate(self.client_indices).astype(np.int64)
    splits = np.cumsum([0] + [len(i) for i in self.client_indices]).astype(np.int64)

    def dataset_fn(cid: tf.Tensor) -> tf.data.Dataset:
      # constants made here, inside whatever graph TFF traces this in
      index = tf.strings.to_number(
          tf.strings.split(cid, "_")[-1], out_type=tf.int64)
      mine = tf.RaggedTensor.from_row_splits(flat, splits)[index]
      return tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
          x=tf.gather(self.source.x_train, mine),
          y=tf.gather(self.source.y_train, mine)))
    return tff.simulation.datasets.ClientData.from_clients_and_tf_fn(
        self.client_ids, dataset_fn)

  @property
  def test(self) -> tuple[np.ndarray, np.ndarray]:
    if self.test_indices is None:
      return self.source.x_test, self.source.y_test
    return (self.source.x_test[self.test_indices],
            self.source.y_test[self.test_indices])

  def sha256(self) -> str:
    """SHA-256 of every client's training and test samples, in client and
    sample order."""
    digest = hashlib.sha256()
    for c in range(self.num_clients):
      for array in (*self.client_arrays(c), *self.client_test_arrays(c)):
        digest.update(np.int64(len(array)).tobytes())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def client_id(index: int) -> str:
  return f"client_{index:04d}"


def load(dataset: str, num_clients: int, partition: str = "iid",
         alpha: float = 0.5, seed: int = 0, data_dir: str | None = None,
         samples_per_client: int | None = None,
         data_kwargs: dict | None = None) -> FederatedData:
  """Loads `dataset` and splits its training set among `num_clients` clients.

  Args:
    dataset: one of `tff_privacy.data.DATASETS`.
    num_clients: number of clients (<= number of training samples).
    partition: 'iid', 'dirichlet' (label skew with concentration `alpha`),
      'one_per_client', 'label_groups' (HyperFL's non-IID split),
      'groups' (each client one of the data set's sample groups, e.g. the
      documents' formats: FedRE's data categories) or 'file:SPLIT.json'
      (each client's train and test indices, `tff_privacy.data.splits`;
      `num_clients` must be its number of clients).
    alpha: Dirichlet concentration, > 0.
    seed: seeds the partition.
    data_dir: `tensorflow_datasets` data directory for the full data sets.
    samples_per_client: training samples per client ('label_groups' and
      'groups'; default: the training set divided among the clients).
    data_kwargs: the data set's options (`sources.DATA_PARAMETERS`).
  """
  if samples_per_client is not None and partition not in ("label_groups", "groups"):
    raise ValueError("samples_per_client applies to partitions 'label_groups' "
                     "and 'groups' "
                     f"only, got partition={partition!r}")
  source = sources.load_source(dataset, data_dir=data_dir, data_kwargs=data_kwargs)
  path = splits.path_of(partition)
  if path is not None:
    return from_split(source, path, num_clients)
  if partition == "groups":
    if source.groups is None:
      raise ValueError(f"partition='groups' needs a data set whose samples "
                       f"have groups (e.g. 'docs'); {dataset!r} has none")
    train_groups, test_groups = source.groups
    return FederatedData(
        source, tuple(partitioners.by_group(train_groups, num_clients, seed,
                                            samples_per_client)),
        tuple(partitioners.by_group(test_groups, num_clients, seed + 1,
                                    samples_per_client)))
  if source.task == "segmentation" and partition not in ("iid", "one_per_client"):
    raise ValueError(f"partition={partition!r} splits by class label; "
                     f"dataset {dataset!r} ({source.task}) takes 'iid', "
                     "'one_per_client' or 'groups'")
  parts = partitioners.partition(source.y_train, num_clients, partition, alpha,
                                 seed, samples_per_client)
  tests = partitioners.test_split(source.y_train, source.y_test, parts,
                                  partition, seed)
  return FederatedData(source, tuple(parts), tuple(tests))


def from_split(source: sources.Source, path: str,
               num_clients: int) -> FederatedData:
  """The federation of split file `path` (`tff_privacy.data.splits`) on
  `source`'s arrays, which its indices must lie in; `num_clients` must be
  its number of clients. The global test set is the clients' test splits
  pooled."""
  train, test = splits.read(path)
  if len(train) != num_clients:
    raise ValueError(f"split file {path} holds {len(train)} clients, not "
                     f"num_clients={num_clients}")
  splits.check_indices(path, train, test, len(source.y_train), len(source.y_test))
  splits.check_disjoint(f"split file {path}", range(len(train)),
                        [source.x_train[i] for i in train],
                        [source.x_test[i] for i in test])
  if not sum(len(i) for i in test):
    raise ValueError(f"split file {path}: no client has test samples, so no "
                     "model can be tested")
  return FederatedData(source, tuple(train), tuple(test), np.concatenate(test))


def from_client_data(source: sources.Source,
                     train: tff.simulation.datasets.ClientData,
                     test: tff.simulation.datasets.ClientData) -> FederatedData:
  """The federation of TFF ClientData: client k is `train.client_ids[k]`,
  holding its `train` samples and, if `test` has that client, its `test`
  samples; the global test set is every client's test samples pooled.

  `source` names the data set the samples are of: its task, classes and
  value range apply, and the ClientData's elements must be single samples
  shaped like its own, `OrderedDict(x=float32 [*input_shape], y=int32
  [*label_shape])`, which is what the model takes. Where `source` is
  normalised (`Source.normalization`), so are the samples, which are given
  in its value range.

  Raises:
    ValueError: in one line, for elements of another structure, shape or
      dtype, a test client that `train` lacks, a training client without
      samples, a label outside the data set's classes, or a client whose
      test samples include one of its training samples.
  """
  for name, client_data in (("train_data", train), ("test_data", test)):
    _check_element_spec(name, client_data, source)
  ids = list(train.client_ids)
  unknown = sorted(set(test.client_ids) - set(ids))
  if unknown:
    raise ValueError(f"test_data has clients that train_data lacks: "
                     f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
  train_arrays = [_client_arrays(train, c, source) for c in ids]
  empty = [c for c, (x, _) in zip(ids, train_arrays) if not len(x)]
  if empty:
    raise ValueError(f"train_data: client {empty[0]!r} has no samples")
  tested = set(test.client_ids)
  test_arrays = [_client_arrays(test, c, source) if c in tested
                 else _no_samples(source) for c in ids]
  for name, arrays in (("train_data", train_arrays), ("test_data", test_arrays)):
    for c, (_, y) in zip(ids, arrays):
      if len(y) and not 0 <= y.min() <= y.max() < source.num_classes:
        raise ValueError(f"{name}: client {c!r} has labels outside [0, "
                         f"{source.num_classes}), the classes of dataset "
                         f"{source.name!r}")
  splits.check_disjoint("ClientData", ids, [x for x, _ in train_arrays],
                        [x for x, _ in test_arrays])
  if not sum(len(y) for _, y in test_arrays):
    raise ValueError("test_data: no client has test samples, so no model can "
                     "be tested")
  norm = source.normalization.apply if source.normalization else np.asarray
  pooled = dataclasses.replace(
      source, x_train=norm(np.concatenate([x for x, _ in train_arrays])),
      y_train=np.concatenate([y for _, y in train_arrays]),
      x_test=norm(np.concatenate([x for x, _ in test_arrays])),
      y_test=np.concatenate([y for _, y in test_arrays]),
      groups=None, elements=None, attributes=None)
  return FederatedData(pooled, _ranges([len(y) for _, y in train_arrays]),
                       _ranges([len(y) for _, y in test_arrays]))


def _check_element_spec(name: str, client_data, source: sources.Source) -> None:
  """Refuses ClientData whose elements are not single samples of
  `source`'s shapes, x float32 and y integer."""
  spec = client_data.element_type_structure
  want = (f"OrderedDict(x=float32 {list(source.input_shape)}, "
          f"y=int32 {list(source.y_train.shape[1:])})")
  ok = (isinstance(spec, collections.abc.Mapping) and set(spec) == {"x", "y"}
        and all(isinstance(spec[k], tf.TensorSpec) for k in spec)
        and spec["x"].dtype == tf.float32 and spec["y"].dtype.is_integer
        and spec["x"].shape == source.input_shape
        and spec["y"].shape == source.y_train.shape[1:])
  if not ok:
    raise ValueError(f"{name}: elements must be single samples {want}, the "
                     f"inputs and labels of dataset {source.name!r} that the "
                     f"model takes; got {spec}")


def _client_arrays(client_data, client: str,
                   source: sources.Source) -> tuple[np.ndarray, np.ndarray]:
  """A client's samples as (x float32, y int32) arrays."""
  batches = list(client_data.create_tf_dataset_for_client(client)
                 .batch(_READ_BATCH).as_numpy_iterator())
  if not batches:
    return _no_samples(source)
  return (np.concatenate([b["x"] for b in batches]).astype(np.float32),
          np.concatenate([b["y"] for b in batches]).astype(np.int32))


def _no_samples(source: sources.Source) -> tuple[np.ndarray, np.ndarray]:
  return (np.zeros((0,) + source.input_shape, np.float32),
          np.zeros((0,) + source.y_train.shape[1:], np.int32))


def _ranges(sizes: list[int]) -> tuple[np.ndarray, ...]:
  """Consecutive index ranges of the given sizes."""
  ends = np.cumsum(sizes)
  return tuple(np.arange(end - size, end, dtype=np.int64)
               for size, end in zip(sizes, ends))
