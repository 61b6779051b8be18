"""`ModelSpec`: everything needed to rebuild a model, and its TFF wrapper."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import pretrained, tasks
from tff_privacy.models import builders, lpm


def loss_fn() -> tf.keras.losses.Loss:
  """The training loss of every classifier here: cross-entropy on logits."""
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model builder name with its arguments; serialisable to JSON.

  The update store keeps this so that an attacker can rebuild the architecture
  the clients trained (a public fact of the protocol).
  """

  name: str
  input_shape: tuple[int, ...]
  num_classes: int
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  task: str = "classification"
  task_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))
    builders.check(self.name, self.num_classes)
    builders.check_kwargs(self.name, self.kwargs)
    builders.check_task(self.name, self.task_object.name)
    self.task_object.output_units(self.num_classes)  # raises if it cannot

  @property
  def task_object(self) -> tasks.Task:
    """The `tff_privacy.tasks.Task` the model is trained for."""
    return tasks.get(self.task, **self.task_kwargs)

  def keras(self, seed: int = 0) -> tf.keras.Model:
    return builders.build(self.name, self.input_shape,
                          self.task_object.output_units(self.num_classes),
                          seed=seed, **self.kwargs)

  def check_builds(self) -> None:
    """Raises `ValueError` naming `model_kwargs` if the builder fails on
    them (a wrong type or value; unknown names fail at construction)."""
    try:
      with tf.Graph().as_default():  # no eager Keras state before TFF traces
        self.keras()
    except pretrained.FingerprintMismatch:
      raise  # the file, not the arguments, is wrong
    except (TypeError, ValueError) as e:
      raise ValueError(f"model_kwargs {self.kwargs}: model {self.name!r} cannot "
                       f"be built from them ({' '.join(str(e).split())})") from None

  def pinned(self) -> "ModelSpec":
    """This spec with the fingerprint of the weights file its model reads
    (HyperFL-LPM's frozen backbone) in its kwargs, so that the model rebuilt
    from it later or elsewhere (a resumed run, an attack on its records)
    refuses other weights; the spec itself for other models."""
    if self.name not in lpm.LPM_MODELS:
      return self
    return dataclasses.replace(
        self, kwargs=lpm.pinned_kwargs(self.input_shape, self.kwargs))

  def initial_weights(self, seed: int) -> list[np.ndarray]:
    """Trainable weights of a freshly initialised model, fixed by `seed`."""
    return [v.numpy() for v in self.keras(seed).trainable_variables]

  def variable_names(self) -> list[str]:
    """Trainable variables as 'layer/weight', in the model's order."""
    return [v.name.split(":")[0] for v in self.keras().trainable_variables]

  @property
  def input_spec(self) -> collections.OrderedDict:
    label_shape = self.task_object.label_shape(self.input_shape)
    return collections.OrderedDict(
        x=tf.TensorSpec((None,) + self.input_shape, tf.float32),
        y=tf.TensorSpec((None,) + label_shape, tf.int32))

  def tff_model_fn(self):
    """A no-argument function returning a `tff.learning.models.VariableModel`."""
    task = self.task_object

    def model_fn():
      return tff.learning.models.from_keras_model(
          self.keras(), loss=task.keras_loss(), input_spec=self.input_spec,
          metrics=task.keras_metrics())
    return model_fn

  def to_json(self) -> dict[str, Any]:
    return {"name": self.name, "input_shape": list(self.input_shape),
            "num_classes": self.num_classes, "kwargs": dict(self.kwargs),
            "task": self.task, "task_kwargs": dict(self.task_kwargs)}

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> "ModelSpec":
    kwargs = {k: tuple(v) if isinstance(v, list) else v
              for k, v in data.get("kwargs", {}).items()}
    return cls(data["name"], tuple(data["input_shape"]), int(data["num_classes"]),
               kwargs, data.get("task", "classification"),
               data.get("task_kwargs", {}))
