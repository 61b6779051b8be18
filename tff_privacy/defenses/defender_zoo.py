"""RECUP-FL's defender zoo (Sec. 4, 5.3): models that predict a sensitive
attribute from a max-pooled upload, the substitutes of the attacker's
classifier that `tff_privacy.defenses.recupfl` perturbs uploads against.

The paper: 20 three-layer fully connected networks "with varying numbers of
neurons for each layer (i.e., 128 to 2,048)", trained on the same shadow
data as the attacker, whose Stru-NN is "included in the defender model
zoo". Here the 20 are every pair of hidden widths (h1, h2), h1 in 128 ...
2048 and h2 in 128 ... 1024 by powers of 2 (`ZOO_WIDTHS`), which includes
Stru-NN's (512, 256), each trained as Stru-NN is
(`tff_privacy.attacks.attribute`: scikit-learn's MLP, SGD at learning rate
0.01 for 80 epochs, inputs standardised per feature), from its own seed.

A zoo is saved as a folder of `tf.io.serialize_tensor` files (data, never
pickle) with a `zoo.json` that names them, so that a TensorFlow graph can
read it with `tf.io.read_file` and `tf.io.parse_tensor`: TFF's C++ workers
run such ops, so the zoo's tens of megabytes stay out of the serialized
computation, which only holds the folder's path. `zoo.json` also records
the fingerprint of the weights (`weights_fingerprint`), which every read
checks: a folder holding other weights of the same shapes (a stale copy) is
refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf
import tqdm
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

ZOO_WIDTHS = tuple((h1, h2) for h1 in (128, 256, 512, 1024, 2048)
                   for h2 in (128, 256, 512, 1024))
ARRAYS = ("kernel_1", "bias_1", "kernel_2", "bias_2", "kernel_3", "bias_3")
INDEX = "zoo.json"


@dataclasses.dataclass(frozen=True)
class DefenderZoo:
  """Defenders of one attribute: standardisation `mean`, `scale` of the
  pooled features and, per model, its 6 weight arrays (`ARRAYS`; a binary
  attribute's model has one output, the logit of class 1)."""

  attribute: str
  classes: tuple[str, ...]
  mean: np.ndarray
  scale: np.ndarray
  models: tuple[tuple[np.ndarray, ...], ...]

  @property
  def pool_length(self) -> int:
    return len(self.mean)

  def size_bytes(self) -> int:
    return sum(a.nbytes for m in self.models for a in m) + 2 * self.mean.nbytes


def defender_logits(mean, scale, arrays, pooled: tf.Tensor) -> tf.Tensor:
  """Logits over the attribute's classes of one defender on pooled uploads
  [N, L] (a binary model's one logit z becomes [0, z]: the same softmax)."""
  k1, b1, k2, b2, k3, b3 = arrays
  h = (pooled - mean) / scale
  h = tf.nn.relu(tf.matmul(h, k1) + b1)
  h = tf.nn.relu(tf.matmul(h, k2) + b2)
  out = tf.matmul(h, k3) + b3
  if out.shape[-1] == 1:
    out = tf.concat([tf.zeros_like(out), out], -1)
  return out


def defenders(zoo: DefenderZoo):
  """The zoo as functions pooled [N, L] -> logits, for `recupfl`."""
  return [lambda z, m=m: defender_logits(zoo.mean, zoo.scale, m, z)
          for m in zoo.models]


def fit_defenders(features: np.ndarray, attributes: np.ndarray, *,
                  widths=ZOO_WIDTHS, epochs: int = 80, learning_rate: float = 0.01,
                  seed: int = 0, progress: Optional[str] = None) -> list:
  """One scikit-learn pipeline (standardisation, MLP with hidden widths
  (h1, h2)) per entry of `widths`, fitted to pooled shadow uploads
  `features` [N, L] labelled with attribute class indices `attributes`;
  with `progress`, a tqdm bar of that name (on a terminal)."""
  if len(set(np.asarray(attributes).tolist())) < 2:
    raise ValueError("the shadow data hold one attribute class only; a "
                     "defender needs at least two")
  pipelines = []
  bar = tqdm.tqdm(widths, desc=progress, unit="model", leave=False,
                  disable=None if progress else True)
  for k, hidden in enumerate(bar):
    pipeline = make_pipeline(StandardScaler(), MLPClassifier(
        tuple(hidden), solver="sgd", learning_rate_init=learning_rate,
        max_iter=epochs, random_state=seed + k))
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", ConvergenceWarning)
      pipelines.append(pipeline.fit(features, attributes))
  return pipelines


def zoo_from_pipelines(pipelines, attribute: str, classes: Sequence[str]) -> DefenderZoo:
  """The zoo of fitted `fit_defenders` pipelines, every class of `classes`
  seen in training.

  Raises:
    ValueError: when a class never occurred in the shadow data.
  """
  scaler = pipelines[0][0]
  models = []
  for pipeline in pipelines:
    clf = pipeline[-1]
    if clf.classes_.tolist() != list(range(len(classes))):
      raise ValueError(f"attribute {attribute!r}: the shadow data hold classes "
                       f"{clf.classes_.tolist()} of {len(classes)}; every class "
                       "must occur")
    models.append(tuple(a.astype(np.float32) for pair in zip(clf.coefs_, clf.intercepts_)
                        for a in pair))
  return DefenderZoo(attribute, tuple(classes), scaler.mean_.astype(np.float32),
                     scaler.scale_.astype(np.float32), tuple(models))


def _named_arrays(zoo: DefenderZoo) -> dict:
  """The zoo's arrays by file name, in the order of its files."""
  files = {"mean": zoo.mean, "scale": zoo.scale}
  files.update({f"model{k:02d}_{name}": a for k, m in enumerate(zoo.models)
                for name, a in zip(ARRAYS, m)})
  return files


def weights_fingerprint(zoo: DefenderZoo) -> tf.Tensor:
  """A 64-bit fingerprint (int64) of the zoo's weights: farmhash
  (`tf.fingerprint`) of each array's float32 bytes, then of those
  fingerprints together. TensorFlow ops, so a graph computes it from the
  arrays it reads."""
  parts = [tf.fingerprint(tf.reshape(tf.cast(a, tf.float32), [1, -1]))
           for a in _named_arrays(zoo).values()]
  return tf.bitcast(tf.fingerprint(tf.concat(parts, 1))[0], tf.int64)


def save_zoo(zoo: DefenderZoo, folder: str, trained_round: Optional[int] = None
             ) -> None:
  """Writes `zoo` to `folder` (replaced whole: written beside it, then
  renamed), its `weights_fingerprint` in zoo.json, and there as 'round'
  the training round at whose broadcast model it was trained, if given."""
  parent = os.path.dirname(os.path.abspath(folder))
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(dir=parent, prefix=".zoo-")
  try:
    files = _named_arrays(zoo)
    for name, array in files.items():
      tf.io.write_file(os.path.join(staging, f"{name}.tensor"),
                       tf.io.serialize_tensor(tf.constant(array, tf.float32)))
    with open(os.path.join(staging, INDEX), "w") as f:
      json.dump({"attribute": zoo.attribute, "classes": list(zoo.classes),
                 "models": len(zoo.models),
                 "fingerprint": int(weights_fingerprint(zoo)),
                 "shapes": {n: list(a.shape) for n, a in files.items()},
                 **({} if trained_round is None else {"round": int(trained_round)})},
                f, indent=1)
    if os.path.isdir(folder):
      shutil.rmtree(folder)
    os.replace(staging, folder)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise


def read_index(folder: str) -> dict:
  """The `zoo.json` of a saved zoo.

  Raises:
    ValueError: naming the folder when it holds no readable zoo.
  """
  path = os.path.join(folder, INDEX)
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"zoo={folder!r} holds no readable {INDEX} ({e})") from None


def zoo_index(attribute: str, classes: Sequence[str], widths, pool_length: int) -> dict:
  """What `save_zoo` writes to zoo.json for a zoo of `widths` on pooled
  uploads of `pool_length` (a binary attribute's models have one output)."""
  outputs = 1 if len(classes) == 2 else len(classes)
  shapes = {"mean": [pool_length], "scale": [pool_length]}
  for k, (h1, h2) in enumerate(widths):
    for name, shape in zip(ARRAYS, ([pool_length, h1], [h1], [h1, h2], [h2],
                                    [h2, outputs], [outputs])):
      shapes[f"model{k:02d}_{name}"] = shape
  return {"attribute": attribute, "classes": list(classes), "models": len(widths),
          "shapes": shapes}


def load_zoo(folder: str, in_graph: bool = False, index: Optional[dict] = None,
             fingerprint=None) -> DefenderZoo:
  """A saved zoo, refused unless its weights have `fingerprint` (default:
  the one its zoo.json recorded when it was built).

  With `in_graph`, its arrays are read by TensorFlow ops (`tf.io.read_file`,
  `tf.io.parse_tensor`) in the current graph, so a `tf.function` or TFF
  computation holds the path, not the weights, and reads and checks the
  files each time it runs; `fingerprint` may then be a tensor (an input of
  the computation). `index` (`zoo_index`) lets a graph be built before the
  files exist.

  Raises:
    ValueError: naming the folder, for other weights (eagerly).
    tf.errors.InvalidArgumentError: the same, when a graph runs.
  """
  index = index or read_index(folder)
  if fingerprint is None:
    fingerprint = index.get("fingerprint")

  def array(name):
    return tf.ensure_shape(tf.io.parse_tensor(tf.io.read_file(
        os.path.join(folder, f"{name}.tensor")), tf.float32), index["shapes"][name])

  zoo = DefenderZoo(index["attribute"], tuple(index["classes"]), array("mean"),
                    array("scale"),
                    tuple(tuple(array(f"model{k:02d}_{n}") for n in ARRAYS)
                          for k in range(index["models"])))
  if fingerprint is not None:
    zoo = _checked(zoo, folder, fingerprint)
  return zoo if in_graph else _map_arrays(zoo, lambda a: a.numpy())


def _map_arrays(zoo: DefenderZoo, fn) -> DefenderZoo:
  """`zoo` with `fn` applied to each of its arrays."""
  return dataclasses.replace(
      zoo, mean=fn(zoo.mean), scale=fn(zoo.scale),
      models=tuple(tuple(fn(a) for a in m) for m in zoo.models))


def _checked(zoo: DefenderZoo, folder: str, fingerprint) -> DefenderZoo:
  """`zoo` (tensors) whose arrays are used only once their weights are found
  to have `fingerprint`."""
  message = (f"zoo={folder!r} holds other weights than the zoo built for this "
             "round (their fingerprint differs from the one recorded when it "
             "was built): a stale copy")
  if tf.executing_eagerly():
    if int(weights_fingerprint(zoo)) != int(fingerprint):
      raise ValueError(message)
    return zoo
  check = tf.debugging.assert_equal(
      weights_fingerprint(zoo), tf.cast(fingerprint, tf.int64), message=message)
  with tf.control_dependencies([check]):
    return _map_arrays(zoo, tf.identity)
