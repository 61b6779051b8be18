import collections

import numpy as np
import pytest
import tensorflow_federated as tff
from tensorflow_federated.proto.v0 import executor_pb2
from tensorflow_federated.python.core.impl.executors import value_serialization

from tff_privacy import runtime, worker_values

F32 = np.float32


def written(value, type_spec) -> executor_pb2.Value:
  proto = executor_pb2.Value()
  worker_values.serialize_into(proto, value, tff.to_type(type_spec))
  return proto


def by_tff(value, type_spec) -> executor_pb2.Value:
  return value_serialization.serialize_value(value, tff.to_type(type_spec))[0]


STATE_TYPE = collections.OrderedDict(
    shared=[tff.TensorType(F32, (3, 4)), tff.TensorType(F32, (4,))],
    step=tff.TensorType(np.int32),
    names=tff.TensorType(np.str_, (2,)),
    flags=tff.TensorType(np.bool_, (2,)),
    empty=tff.StructType([]))
STATE = collections.OrderedDict(
    shared=[np.arange(12, dtype=F32).reshape(3, 4), np.ones(4, F32)],
    step=np.int32(7), names=np.array(["a", "b"]),
    flags=np.array([True, False]), empty=[])

CASES = {
    "server state": (STATE, tff.FederatedType(STATE_TYPE, tff.SERVER)),
    "clients' structs": (
        [collections.OrderedDict(w=np.full((2, 2), i, F32), n=F32(i))
         for i in range(3)],
        tff.FederatedType(collections.OrderedDict(
            w=tff.TensorType(F32, (2, 2)), n=tff.TensorType(F32)), tff.CLIENTS)),
    "unknown dimension": (np.zeros((5, 3), F32), tff.TensorType(F32, (None, 3))),
    # left to TFF: a Python list, and arrays of a narrower dtype, of the
    # other byte order, and masked
    "int16 given": (np.ones((2, 2), np.int16), tff.TensorType(np.int32, (2, 2))),
    "list given": ([[1.0, 2.0]], tff.TensorType(F32, (1, 2))),
    "big-endian given": (np.arange(6, dtype=">f4").reshape(2, 3),
                         tff.TensorType(F32, (2, 3))),
    "masked array given": (np.ma.masked_array(np.arange(4, dtype=F32),
                                              [0, 1, 0, 1]),
                           tff.TensorType(F32, (4,))),
    "unnamed struct of tensors": (
        (np.ones(3, np.int64), np.zeros((1, 1), F32)),
        tff.StructType([tff.TensorType(np.int64, (3,)),
                        tff.TensorType(F32, (1, 1))])),
}


@pytest.mark.parametrize("name", CASES)
def test_the_message_written_in_place_is_tffs_own(name):
  value, type_spec = CASES[name]
  assert written(value, type_spec) == by_tff(value, type_spec)


@pytest.mark.parametrize("bad", [np.zeros((2, 3), F32), np.zeros((3, 2))])
def test_a_value_that_does_not_match_its_type_fails_as_in_tff(bad):
  with pytest.raises(TypeError) as ours:
    written(bad, tff.TensorType(F32, (3, 2)))
  with pytest.raises(TypeError) as theirs:
    by_tff(bad, tff.TensorType(F32, (3, 2)))
  assert str(ours.value) == str(theirs.value)
  with pytest.raises(TypeError):
    written([bad], tff.StructType([tff.TensorType(F32, (2, 3))] * 2))


def test_computations_on_the_worker_get_the_values_sent(monkeypatch):
  sent = []

  def spy(proto, value, type_spec):
    sent.append(type_spec)
    serialize_into(proto, value, type_spec)

  serialize_into = worker_values.serialize_into
  monkeypatch.setattr(worker_values, "serialize_into", spy)
  runtime.start()
  shapes = [(64, 128), (128,), (128, 1000)]
  types = [tff.TensorType(F32, s) for s in shapes]
  rng = np.random.default_rng(0)
  given = [rng.normal(size=s).astype(F32) for s in shapes]

  @tff.tensorflow.computation(types)
  def doubled(weights):
    return [2 * w for w in weights]

  @tff.federated_computation(tff.FederatedType(types, tff.SERVER))
  def doubled_on_server(weights):
    return tff.federated_map(doubled, weights)

  for out in (doubled(given), doubled_on_server(given)):
    for w, o in zip(given, out):
      np.testing.assert_array_equal(o, 2 * w)
  assert sum(t.is_equivalent_to(tff.to_type(types)) for t in sent) == 2
