"""Federated data sets: a `tff.simulation.datasets.ClientData` plus a test set."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy.data import partitioners
from tff_privacy.data import sources


@dataclasses.dataclass(frozen=True)
class FederatedData:
  """Training samples split among clients, and a held-out test set.

  `client_data` serves each client's samples as a `tf.data.Dataset` of
  `OrderedDict(x=..., y=...)` elements; `client_arrays` gives the same samples as
  numpy arrays for code that batches them itself. Each client also has a
  test split drawn from the test set the way its training samples were
  (`client_test_arrays`, for personalised evaluation).
  """

  source: sources.Source
  client_indices: tuple[np.ndarray, ...]
  client_test_indices: tuple[np.ndarray, ...]

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
    return self.source.x_test, self.source.y_test


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
      'one_per_client', 'label_groups' (HyperFL's non-IID split) or
      'groups' (each client one of the data set's sample groups, e.g. the
      documents' formats: FedRE's data categories).
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
