import numpy as np
import pytest
import tensorflow as tf
from conftest import QUICK_MODEL_KWARGS, SLOW_MODELS, slow_where

from tff_privacy import models


@pytest.mark.parametrize("name", slow_where(sorted(models.MODELS), SLOW_MODELS))
def test_builders_produce_logits(name):
  model = models.build(name, (28, 28, 1), 10, seed=3,
                       **QUICK_MODEL_KWARGS.get(name, {}))
  per_pixel = name in models.builders.SEGMENTATION_MODELS
  expected = (2, 28, 28, 10) if per_pixel else (2, 10)
  assert model(tf.zeros((2, 28, 28, 1))).shape == expected


def test_model_spec_keeps_its_task_and_refuses_a_mismatch():
  spec = models.ModelSpec("unet", (8, 8, 3), 2, task="segmentation")
  assert models.ModelSpec.from_json(spec.to_json()) == spec
  assert spec.input_spec["y"].shape.as_list() == [None, 8, 8]
  old_record = {k: v for k, v in models.ModelSpec("cnn", (8, 8, 1), 10).to_json().items()
                if k != "task"}
  assert models.ModelSpec.from_json(old_record).task == "classification"
  with pytest.raises(ValueError, match="does not fit the segmentation task"):
    models.ModelSpec("cnn", (8, 8, 3), 2, task="segmentation")
  with pytest.raises(ValueError, match="task='depth' is unknown"):
    models.ModelSpec("cnn", (8, 8, 3), 2, task="depth")


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


def test_hyperfl_cnn_starts_from_pytorchs_layer_defaults():
  """As the HyperFL authors' PyTorch model: every kernel and bias of a layer
  with fan-in f is U(-1/sqrt(f), 1/sqrt(f)), f by hand (kernel area times
  input channels; fc1 sees 32 x 5 x 5); Keras' Glorot stays reachable."""
  model = models.build("hyperfl_cnn", (28, 28, 1), 10, seed=4)
  fan_ins = {"conv1": 5 * 5 * 1, "conv2": 5 * 5 * 16, "fc1": 32 * 5 * 5, "fc2": 128}
  layers = {l.name: l for l in model.layers}
  for name, fan_in in fan_ins.items():
    bound = 1 / np.sqrt(fan_in)
    kernel, bias = (v.numpy() for v in (layers[name].kernel, layers[name].bias))
    assert np.abs(kernel).max() <= bound and np.abs(bias).max() <= bound
    assert kernel.std() == pytest.approx(bound / np.sqrt(3), rel=0.1)
    assert np.abs(bias).max() > bound / 4  # drawn, not zeros
  again = models.build("hyperfl_cnn", (28, 28, 1), 10, seed=4)
  np.testing.assert_array_equal(again.layers[-1].bias.numpy(), layers["fc2"].bias.numpy())
  glorot = models.build("hyperfl_cnn", (28, 28, 1), 10, seed=4, weight_init="default")
  fc2 = {l.name: l for l in glorot.layers}["fc2"]
  assert np.all(fc2.bias.numpy() == 0)
  assert fc2.kernel.numpy().std() == pytest.approx(
      np.sqrt(2 / (128 + 10)), rel=0.1)  # Glorot-uniform: sqrt(6 / (in + out)) / sqrt(3)


def test_bad_model_arguments_raise():
  with pytest.raises(ValueError, match="model='resnet'"):
    models.build("resnet", (28, 28, 1), 10)
  with pytest.raises(ValueError, match="weight_init='normal'"):
    models.build("lenet", (28, 28, 1), 10, weight_init="normal")
  with pytest.raises(ValueError, match="num_outputs must be >= 1"):
    models.build("mlp", (8, 8, 1), 0)
  with pytest.raises(ValueError, match="num_classes must be >= 2"):
    models.ModelSpec("mlp", (8, 8, 1), 1)
  with pytest.raises(ValueError, match="binary_mse task needs 2 classes"):
    models.ModelSpec("mlp", (8, 8, 1), 3, task="binary_mse")


def test_model_spec_round_trips_through_json():
  spec = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": (32,)})
  again = models.ModelSpec.from_json(spec.to_json())
  assert again == spec
  assert spec.variable_names() == ["fc1/kernel", "fc1/bias", "fc2/kernel", "fc2/bias"]


def test_unet_forward_on_weight_tensors_equals_keras():
  from tff_privacy.models import builders, functional
  model = builders.unet((16, 8, 3), 2, seed=2)
  x = tf.random.uniform((2, 16, 8, 3), seed=4)
  weights = [tf.constant(v) for v in model.trainable_variables]
  out = functional.forward(model, weights, x)
  assert out.shape == (2, 16, 8, 2)
  np.testing.assert_allclose(out, model(x), atol=1e-5)
  # the tapped input of the first decoder convolution is the concatenation
  _, tapped = functional.forward(model, weights, x, tap="dec1_1")
  expected = tf.keras.Model(model.input, model.get_layer("skip1").output)(x)
  np.testing.assert_allclose(tapped, expected, atol=1e-6)


def test_unet_refuses_sizes_its_pooling_cannot_halve():
  from tff_privacy.models import builders
  with pytest.raises(ValueError, match="divisible by 4"):
    builders.unet((10, 8, 1), 2)


@pytest.mark.parametrize("name,shape,flat", [
    ("recupfl_lfw", (62, 47, 3), 8 * 6 * 128),  # 62x47 pooled 3 times, rounding up
    ("recupfl_celeba", (32, 32, 3), 4 * 4 * 64),
    ("recupfl_audiomnist", (224, 224, 1), 4 * 4 * 64)])  # 224 / 2^6 = 3.5
def test_recupfl_cnns_have_the_papers_layers_and_run_on_weight_tensors(name, shape, flat):
  from tff_privacy.models import functional
  model = models.build(name, shape, 2, seed=1)
  convs = [l for l in model.layers if isinstance(l, tf.keras.layers.Conv2D)]
  dense = [l for l in model.layers if isinstance(l, tf.keras.layers.Dense)]
  assert [c.filters for c in convs] == {"recupfl_lfw": [32, 64, 128]}.get(name, [16, 32, 64])
  assert dense[0].kernel.shape == (flat, {"recupfl_lfw": 256, "recupfl_celeba": 128,
                                          "recupfl_audiomnist": 32}[name])
  x = tf.random.uniform((2,) + shape, seed=2)
  out = functional.forward(model, [tf.constant(v) for v in model.trainable_variables], x)
  np.testing.assert_allclose(out, model(x), atol=1e-5)
