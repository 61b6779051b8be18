"""What a client's computation receives as its data in a round: its batches
and, for a method with per-client inputs (`Algorithm.client_inputs`: the
round's noise seed, FedRE's region, RECUP-FL's attributes), those inputs
beside the batches.

TFF's learning templates take a client's data as a structure of sequences
only, so the inputs travel as a data set of one element:

```text
OrderedDict(batches=<the client's batches of x, y>,
            inputs=<one element: OrderedDict(seed=int64[2], ...)>)
```

built by `with_inputs` on the driver and taken apart by `split` in the
client's computation. Joining the inputs to every batch instead costs a
`Dataset.map` over the batches and a read of the first batch, and each
instantiates the data set's whole pipeline (the worker's file reads
included): on the compact FedRE benchmark's clients (16 clients of 20
one-sample batches) that was about 50 ms of a round of about 250 ms
(ad-hoc probe on a TFF worker).
"""

from __future__ import annotations

import collections
from typing import Mapping, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

BATCHES, INPUTS = "batches", "inputs"
SEED_KEY = "seed"
SEED_TYPE = tff.TensorType(np.int64, [2])


def client_seed(run_seed: int, round_num: int, client: int) -> np.ndarray:
  """The stateless-RNG seed of one client in one round."""
  state = np.random.SeedSequence([run_seed, round_num, client]).generate_state(2)
  return state.astype(np.int64)


def data_type(element, input_types: Mapping[str, tff.TensorType]) -> tff.StructType:
  """The type of a client's data: batches of `element` (a TFF type or its
  structure) and one element of `input_types`, by name."""
  return tff.StructWithPythonType(
      [(BATCHES, tff.SequenceType(element)),
       (INPUTS, tff.SequenceType(collections.OrderedDict(input_types)))],
      collections.OrderedDict)


def seeded_type(element, inputs: Optional[Mapping[str, tff.TensorType]] = None
                ) -> tff.StructType:
  """`data_type` of a client whose inputs are its noise seed, then
  `inputs` (e.g. a defence's `client_input_types`)."""
  return data_type(element, collections.OrderedDict(
      [(SEED_KEY, SEED_TYPE), *(inputs or {}).items()]))


def with_inputs(batches: tf.data.Dataset,
                inputs: Mapping[str, np.ndarray]) -> collections.OrderedDict:
  """A client's data of `data_type`: `batches` and its `inputs`."""
  one = collections.OrderedDict((k, np.asarray(v)) for k, v in inputs.items())
  return collections.OrderedDict(
      [(BATCHES, batches), (INPUTS, tf.data.Dataset.from_tensors(one))])


def split(data) -> tuple[tf.data.Dataset, collections.OrderedDict]:
  """(batches, inputs by name) of a client's data of `data_type`, inside
  its computation."""
  return data[BATCHES], collections.OrderedDict(data[INPUTS].get_single_element())
