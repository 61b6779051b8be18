import numpy as np
import pytest
import tensorflow as tf
from conftest import QUICK_MODEL_KWARGS

from tff_privacy import models


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_builders_produce_logits(name):
  model = models.build(name, (28, 28, 1), 10, seed=3,
                       **QUICK_MODEL_KWARGS.get(name, {}))
  assert model(tf.zeros((2, 28, 28, 1))).shape == (2, 10)


def test_seed_fixes_initial_weights():
  spec = models.ModelSpec("cnn", (8, 8, 1), 10)
  a, b, c = spec.initial_weights(1), spec.initial_weights(1), spec.initial_weights(2)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_lenet_reproduces_dlg_setting():
  model = models.build("lenet", (28, 28, 1), 10)
  acts = [l.activation.__name__ for l in model.layers if hasattr(l, "strides")]
  assert acts == ["sigmoid"] * 3
  weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
  assert weights.min() >= -0.5 and weights.max() <= 0.5
  assert weights.std() == pytest.approx(1 / np.sqrt(12), rel=0.05)  # U(-.5,.5)
  glorot = models.build("lenet", (28, 28, 1), 10, weight_init="default")
  assert np.all(glorot.layers[0].bias.numpy() == 0)


def test_bad_model_arguments_raise():
  with pytest.raises(ValueError, match="model='resnet'"):
    models.build("resnet", (28, 28, 1), 10)
  with pytest.raises(ValueError, match="weight_init='normal'"):
    models.build("lenet", (28, 28, 1), 10, weight_init="normal")
  with pytest.raises(ValueError, match="num_classes must be >= 2"):
    models.build("mlp", (8, 8, 1), 1)


def test_model_spec_round_trips_through_json():
  spec = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": (32,)})
  again = models.ModelSpec.from_json(spec.to_json())
  assert again == spec
  assert spec.variable_names() == ["fc1/kernel", "fc1/bias", "fc2/kernel", "fc2/bias"]
