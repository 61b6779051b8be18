"""Values sent to TFF's worker without a copy per level of nesting.

TFF 0.87's `value_serialization.serialize_value` builds each level of a
nested value (a federated value of structs of tensors, say) with protobuf
constructors, and each constructor copies the messages it is given. A
tensor three levels deep is copied five times or more before gRPC sends it,
which for HyperFL's 57 MiB server state cost about 0.6 s of a 5.9 s round
and several copies of the state in the driver's memory. `serialize_into`
writes the same `executor_pb2.Value` into a message in place, each tensor's
bytes copied twice (by `tobytes` and into the message);
`InPlaceRemoteExecutor` sends its values that way.

Numeric tensors of rank one or more given as plain numpy arrays of the
type's own dtype, in the machine's byte order, are written here.
Everything else (scalars, strings, Python lists, other arrays, sequences,
computations, values that do not match their type) is left to TFF's
serializer, whose checks and errors therefore still apply; its result is
merged in at that point of the message.
"""

from __future__ import annotations

import numpy as np
from tensorflow_federated.proto.v0 import executor_pb2
from tensorflow_federated.python.common_libs import structure
from tensorflow_federated.python.core.impl.executors import remote_executor
from tensorflow_federated.python.core.impl.executors import value_serialization
from tensorflow_federated.python.core.impl.types import array_shape
from tensorflow_federated.python.core.impl.types import computation_types
from tensorflow_federated.python.core.impl.types import dtype_utils
from tensorflow_federated.python.core.impl.types import type_serialization


def serialize_into(proto: executor_pb2.Value, value,
                   type_spec: computation_types.Type) -> None:
  """Writes `value` of TFF type `type_spec` into the empty `proto`: the
  message `value_serialization.serialize_value(value, type_spec)` returns.

  Raises:
    TypeError, ValueError: TFF's own, where TFF's serializer raises them;
      `proto` is then partly written and must be dropped.
  """
  if isinstance(type_spec, computation_types.StructType):
    _struct_into(proto, value, type_spec)
  elif isinstance(type_spec, computation_types.FederatedType):
    _federated_into(proto, value, type_spec)
  elif _plain_array(value, type_spec):
    proto.array.dtype = dtype_utils.to_proto(type_spec.dtype.type)
    proto.array.shape.CopyFrom(array_shape.to_proto(value.shape))
    proto.array.content = value.tobytes()
  else:
    _by_tff(proto, value, type_spec)


def _plain_array(value, type_spec) -> bool:
  # `==` on dtypes also compares byte order; subclasses such as masked
  # arrays write other bytes than TFF sends
  return (isinstance(type_spec, computation_types.TensorType)
          and type(value) is np.ndarray and value.ndim > 0
          and value.dtype == type_spec.dtype
          and value.dtype.type is not np.str_
          and array_shape.is_compatible_with(value.shape, type_spec.shape))


def _struct_into(proto, value, type_spec) -> None:
  try:
    elements = structure.from_container(value)
  except TypeError:
    elements = None
  if elements is None or len(elements) != len(type_spec):
    _by_tff(proto, value, type_spec)
    return
  proto.struct.SetInParent()  # an empty struct is still a struct
  for (name, element_type), (_, element) in zip(
      structure.iter_elements(type_spec), structure.iter_elements(elements)):
    out = proto.struct.element.add()
    if name:
      out.name = name
    serialize_into(out.value, element, element_type)


def _federated_into(proto, value, type_spec) -> None:
  members = [value] if type_spec.all_equal else value
  if not isinstance(members, list):
    _by_tff(proto, value, type_spec)
    return
  for member in members:
    serialize_into(proto.federated.value.add(), member, type_spec.member)
  proto.federated.type.CopyFrom(
      type_serialization.serialize_type(type_spec).federated)


def _by_tff(proto, value, type_spec) -> None:
  serialized, _ = value_serialization.serialize_value(value, type_spec)
  proto.MergeFrom(serialized)


class InPlaceRemoteExecutor(remote_executor.RemoteExecutor):
  """TFF's `RemoteExecutor`, sending values written by `serialize_into`
  (computations, and values without a type, the way TFF does). It sends
  each value in one request, as TFF's does unless built with
  `stream_structs`, which the runtime does not use, and leaves out TFF's
  tracing spans."""

  async def create_value(self, value, type_spec=None):
    if type_spec is None or not isinstance(
        type_spec, (computation_types.StructType, computation_types.FederatedType,
                    computation_types.TensorType)):
      return await super().create_value(value, type_spec)
    self._check_has_executor_id()
    request = executor_pb2.CreateValueRequest(executor=self._executor_id)
    serialize_into(request.value, value, type_spec)
    response = self._stub.create_value(request)
    return remote_executor.RemoteValue(response.value_ref, type_spec, self)
