"""HyperFL-LPM: the frozen backbone, its weights files, the adapters, and
the method on the runner."""

import dataclasses
import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf
from conftest import QUICK_MODEL_KWARGS

from tff_privacy import algorithms, cli, models, pretrained, runner
from tff_privacy.models import backbone as backbone_lib
from tff_privacy.models import lpm
from tff_privacy.models.functional import forward
from tff_privacy.models.hypernetwork import Hypernetwork
from tff_privacy.updates import UpdateStore

# a tiny backbone pre-trained for one epoch on 160 face crops
TINY = QUICK_MODEL_KWARGS["lpm_resnet"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv(pretrained.CACHE_VARIABLE, str(tmp_path / "cache"))
  monkeypatch.setattr(pretrained, "_MEMO", {})


def _random_weights(backbone, seed=0):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(0, 0.3, s).astype(np.float32)
          for k, s in backbone.shapes.items()}


def test_backbone_stages_match_keras_layers():
  backbone = backbone_lib.Backbone(channels=2, widths=(3, 5))
  w = _random_weights(backbone)
  x = np.random.default_rng(1).random((2, 9, 9, 2)).astype(np.float32)

  def conv(name, stride=1, kernel=3):
    layer = tf.keras.layers.Conv2D(w[f"{name}/bias"].shape[0], kernel, stride,
                                   padding="same")
    layer.build((None, None, None, w[f"{name}/kernel"].shape[2]))
    layer.set_weights([w[f"{name}/kernel"], w[f"{name}/bias"]])
    return layer

  relu = tf.nn.relu
  h = relu(conv("stem")(x))
  h1 = relu(conv("block1/conv2")(relu(conv("block1/conv1")(h))) + h)
  h2 = relu(conv("block2/conv2")(relu(conv("block2/conv1", 2)(h1)))
            + conv("block2/shortcut", 2, 1)(h1))
  assert "block1/shortcut/kernel" not in w  # same width, stride 1: identity
  np.testing.assert_allclose(backbone.stage(w, 1, x), h1, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(backbone.stage(w, 2, h1), h2, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(backbone.features(w, x), np.mean(h2, axis=(1, 2)),
                             rtol=1e-5, atol=1e-5)


def test_folded_batch_norm_is_keras_batch_norm_in_inference():
  backbone = backbone_lib.Backbone(channels=1, widths=(3,))
  w = _random_weights(backbone)
  norm = backbone_lib._BatchNorm(backbone)
  rng = np.random.default_rng(2)
  stats = [rng.normal(size=3), rng.normal(size=3), rng.normal(size=3),
           rng.random(3) + 0.5]  # gamma, beta, moving mean, moving variance
  for v, s in zip((norm.gamma, norm.beta, norm.mean, norm.var), stats):
    v["stem"].assign(s.astype(np.float32))
  keras_bn = tf.keras.layers.BatchNormalization(epsilon=1e-5)
  keras_bn.build((None, 6, 6, 3))
  keras_bn.set_weights(stats)
  x = rng.random((2, 6, 6, 1)).astype(np.float32)
  plain = tf.nn.conv2d(x, w["stem/kernel"], 1, "SAME") + w["stem/bias"]
  folded = norm.fold(w)
  np.testing.assert_allclose(
      tf.nn.conv2d(x, folded["stem/kernel"], 1, "SAME") + folded["stem/bias"],
      keras_bn(plain, training=False), rtol=1e-4, atol=1e-5)


def test_adapter_by_hand():
  rng = np.random.default_rng(3)
  c, r = 4, 2
  h = rng.normal(size=(2, 3, 3, c)).astype(np.float32)
  down, d = rng.normal(size=(c, r)), rng.normal(size=r)
  up, u = rng.normal(size=(r, c)), rng.normal(size=c)
  g, b = rng.normal(size=c), rng.normal(size=c)
  z = np.maximum(h @ down + d, 0) @ up + u
  ln = (z - z.mean(-1, keepdims=True)) / np.sqrt(z.var(-1, keepdims=True) + 1e-5)
  expected = h + (1 + g) * ln + b
  weights = [tf.constant(a, tf.float32) for a in
             (down.reshape(1, 1, c, r), d, up.reshape(1, 1, r, c), u, g, b)]
  np.testing.assert_allclose(lpm.adapter_forward(weights, h), expected,
                             rtol=1e-4, atol=1e-4)


def test_lpm_model_trains_adapters_and_classifier_only(tmp_path):
  # any frozen backbone does: a random one's file, not a pre-training
  path = str(tmp_path / "backbone.npz")
  pretrained.save(path, _random_weights(backbone_lib.Backbone(1, (4, 8))), {})
  kwargs = {"widths": (4, 8), "backbone_weights": path}
  spec = models.ModelSpec("lpm_resnet", (8, 8, 1), 10, kwargs)
  model = spec.keras(seed=1)
  assert spec.variable_names() == [
      f"adapter{j}/{t.replace('/', '_')}" for j in (1, 2)
      for t in lpm.ADAPTER_TENSORS] + ["fc/kernel", "fc/bias"]
  fixed = models.ModelSpec("lpm_resnet", (8, 8, 1), 10, {**kwargs, "adapters": False})
  assert fixed.variable_names() == ["fc/kernel", "fc/bias"]
  rng = np.random.default_rng(4)
  weights = [tf.constant(rng.normal(0, 0.2, v.shape), tf.float32)
             for v in model.trainable_variables]
  for v, w in zip(model.trainable_variables, weights):
    v.assign(w)
  x = rng.random((3, 8, 8, 1)).astype(np.float32)
  np.testing.assert_allclose(forward(model, weights, x), model(x), rtol=1e-5,
                             atol=1e-5)
  # the extractor HyperFL-LPM's hypernetwork generates is the adapters
  hyper = Hypernetwork.for_model(model)
  assert all(n.startswith("adapter") for n in hyper.target_names)


@pytest.mark.slow
def test_default_backbone_is_pretrained_once_and_cached(tmp_path, monkeypatch):
  backbone = backbone_lib.Backbone(1, (4, 8))
  with tf.Graph().as_default():  # pre-training still runs eagerly
    first = backbone_lib.default_weights(backbone, (8, 8, 1), "lfw_subset", 1)
  folder = tmp_path / "cache" / "backbones"
  [name] = os.listdir(folder)  # and no temp file beside it
  meta = pretrained.metadata(str(folder / name))
  assert meta["dataset"] == "lfw_subset" and 0 <= meta["test_accuracy"] <= 1
  # deterministic: an attacker rebuilding the default backbone gets this one
  fresh, _ = backbone_lib.pretrain(backbone, (8, 8, 1), "lfw_subset", 1)
  assert pretrained.fingerprint(fresh) == pretrained.fingerprint(first)
  monkeypatch.setattr(pretrained, "_MEMO", {})
  monkeypatch.setattr(backbone_lib, "pretrain", lambda *a, **k: pytest.fail(
      "pre-trained again"))
  again = backbone_lib.default_weights(backbone, (8, 8, 1), "lfw_subset", 1)
  assert pretrained.fingerprint(again) == pretrained.fingerprint(first)


@pytest.mark.slow
def test_pretrain_command_writes_a_file_the_model_loads(tmp_path, capsys):
  out = str(tmp_path / "b.npz")
  assert backbone_lib.main(["--dataset", "lfw_subset", "--input-shape", "8,8,1",
                            "--widths", "4,8", "--epochs", "1", "--out", out]) == 0
  assert '"test_accuracy"' in capsys.readouterr().out
  spec = models.ModelSpec("lpm_resnet", (8, 8, 1), 10,
                          {"widths": (4, 8), "backbone_weights": out})
  frozen = spec.keras().get_layer("stage1")._frozen
  saved = backbone_lib.load(out, backbone_lib.Backbone(1, (4, 8)))
  for name, value in frozen.items():
    np.testing.assert_array_equal(value, saved[name])


def test_bad_weights_files_are_named(tmp_path):
  backbone = backbone_lib.Backbone(1, (4, 8))
  with pytest.raises(ValueError, match="backbone_weights=.*is not a file"):
    backbone_lib.load(str(tmp_path / "missing.npz"), backbone)
  text = tmp_path / "text.npz"
  text.write_text("not weights")
  with pytest.raises(ValueError, match="not an .npz weights file"):
    backbone_lib.load(str(text), backbone)
  single = tmp_path / "single.npy"
  np.save(single, np.zeros(3))
  with pytest.raises(ValueError, match="not an .npz weights file"):
    backbone_lib.load(str(single), backbone)
  wrong = str(tmp_path / "wrong.npz")
  pretrained.save(wrong, _random_weights(backbone_lib.Backbone(1, (4, 6))), {})
  with pytest.raises(ValueError, match="block2/conv1/kernel has shape"):
    backbone_lib.load(wrong, backbone)
  truncated = tmp_path / "truncated.npz"
  truncated.write_bytes(open(wrong, "rb").read()[:200])
  with pytest.raises(ValueError, match="not an .npz weights file"):
    backbone_lib.load(str(truncated), backbone)
  assert sorted(os.listdir(tmp_path)) == [  # no temp file left
      "single.npy", "text.npz", "truncated.npz", "wrong.npz"]


def test_a_spec_refuses_a_backbone_file_replaced_after_it_was_recorded(tmp_path):
  backbone = backbone_lib.Backbone(1, (4, 8))
  path = str(tmp_path / "backbone.npz")
  first = _random_weights(backbone, 1)
  pretrained.save(path, first, {})
  spec = models.ModelSpec("lpm_resnet", (8, 8, 1), 10,
                          {"widths": (4, 8), "backbone_weights": path}).pinned()
  assert spec.kwargs["backbone_fingerprint"] == pretrained.fingerprint(first)
  recorded = spec.to_json()  # as the update store and config.json keep it
  models.ModelSpec.from_json(recorded).keras()
  pretrained.save(path, _random_weights(backbone, 2), {})  # same shapes
  with pytest.raises(ValueError, match=f"backbone_weights='{re.escape(path)}': "
                     "the weights file's fingerprint [0-9a-f]+ differs from "
                     f"{pretrained.fingerprint(first)}, the one the run or "
                     "record was made with"):
    models.ModelSpec.from_json(recorded).keras()


def test_training_errors_reach_the_caller_and_nothing_is_cached(tmp_path):
  def train():
    raise ArithmeticError("diverged")

  with pytest.raises(ArithmeticError, match="diverged"):
    pretrained.cached("things", {"a": 1}, train)
  assert not (tmp_path / "cache" / "things").exists()


def test_default_backbone_must_not_share_images_with_the_task(tmp_path):
  base = dict(out=str(tmp_path / "run"), method="hyperfl_lpm", model="lpm_resnet")
  with pytest.raises(ValueError, match="pretrain_dataset='mnist5k' shares its "
                     "images with the federated data set 'mnist'"):
    runner.RunConfig(dataset="mnist", model_kwargs={"pretrain_dataset": "mnist5k"},
                     **base)
  with pytest.raises(ValueError, match="pretrain_dataset='digits' shares"):
    runner.RunConfig(dataset="digits", model_kwargs={"backbone_weights": None},
                     **base)
  runner.RunConfig(dataset="digits", model_kwargs={"pretrain_dataset": "mnist5k"},
                   **base)


def test_hyperfl_lpm_refuses_other_models_and_pretraining_on_the_task(tmp_path):
  spec = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": (16,)})
  with pytest.raises(ValueError, match="hyperfl_lpm' needs --model lpm_resnet"):
    algorithms.get("hyperfl_lpm", spec)
  fixed = models.ModelSpec("lpm_resnet", (8, 8, 1), 10, {**TINY, "adapters": False})
  with pytest.raises(ValueError, match="with adapters"):
    algorithms.get("hyperfl_lpm", fixed)
  code = cli.main(["train", "--method", "hyperfl_lpm", "--model", "lpm_resnet",
                   "--dataset", "digits", "--out", str(tmp_path / "run")])
  assert code == cli.EXIT_USAGE
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_hyperfl_lpm_run_uploads_the_adapter_hypernetwork_and_records_its_backbone(
    tmp_path, monkeypatch):
  spec = models.ModelSpec("lpm_resnet", (8, 8, 1), 10, TINY)
  config = runner.RunConfig(
      out=str(tmp_path), method="hyperfl_lpm", dataset="digits",
      model="lpm_resnet", model_kwargs=TINY, clients=3, rounds=1, batch_size=16,
      partition="label_groups", samples_per_client=32, seed=0,
      method_kwargs={"hidden_dim": 8, "embedding_dim": 4,
                     "hypernetwork_epochs": 1}, capture_rounds=(1,))
  history = runner.run(config, progress=False)
  assert 0 <= history[0]["personal_accuracy_mean"] <= 1
  hyper = Hypernetwork.for_model(spec.keras(), embedding_dim=4, hidden_dim=8)
  records = UpdateStore(str(tmp_path / "updates")).records(1)
  assert len(records) == 3
  for record in records:
    assert record.upload_kind == "hypernetwork_weights"
    assert [u.shape for u in record.upload] == hyper.shapes
  # the default backbone's fingerprint is recorded with the run and its uploads
  [cached] = os.listdir(tmp_path / "cache" / "backbones")
  cached = str(tmp_path / "cache" / "backbones" / cached)
  used = pretrained.fingerprint(backbone_lib.load(cached,
                                                  backbone_lib.Backbone(1, (4, 8))))
  saved = json.load(open(tmp_path / "config.json"))["model_kwargs"]
  assert saved["backbone_fingerprint"] == used
  assert records[0].model_spec.kwargs["backbone_fingerprint"] == used
  # the cache rebuilt with another backbone: resuming and attacking refuse it
  pretrained.save(cached, _random_weights(backbone_lib.Backbone(1, (4, 8))), {})
  monkeypatch.setattr(pretrained, "_MEMO", {})
  message = (f"{re.escape(cached)}: the weights file's fingerprint [0-9a-f]+ "
             f"differs from {used}")
  with pytest.raises(ValueError, match=message):
    runner.run(dataclasses.replace(config, rounds=2), progress=False)
  with pytest.raises(ValueError, match=message):
    records[0].model_spec.keras()
