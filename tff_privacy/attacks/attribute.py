"""Attribute inference from client uploads (RECUP-FL Sec. 5.4, after Melis et
al. 2019).

The adversary max-pools each upload to a fixed-length vector and trains a
classifier that maps it to a sensitive attribute of the client's data. Its
training set comes from shadow data: samples whose attribute it knows, passed
through the broadcast model to produce the uploads a client holding them would
send (`shadow_features`). Four adversaries, as in the paper:

* 'stru_nn': a 3-layer fully connected network (the defender zoo's shape),
  hidden layers 512 and 256, SGD with learning rate 0.01 for 80 epochs;
* 'unknown_nn': 4 hidden layers of 1024, 1024, 512 and 128 units, same
  training;
* 'svm': an RBF support vector machine;
* 'rf': a random forest of 120 trees.

All are scikit-learn estimators. Inputs are standardised per feature first
(gradient entries are orders of magnitude below 1, which stalls SGD and an
RBF kernel with default scale); the paper does not say how it scales them.
Success is measured as the attack success rate (ASR, the share of victims
whose attribute is inferred correctly), printed beside the chance rate of
always guessing the most frequent attribute value.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf
from sklearn.ensemble import RandomForestClassifier
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC

from tff_privacy.attacks import functional

ADVERSARIES = ("stru_nn", "unknown_nn", "svm", "rf")


def pooled(upload: Sequence[np.ndarray], length: int = 1024) -> np.ndarray:
  """Max-pools the concatenated upload into `length` contiguous bins."""
  flat = np.concatenate([np.ravel(u) for u in upload])
  if length > flat.size:
    raise ValueError(f"length={length} exceeds the upload's {flat.size} entries")
  return np.array([b.max() for b in np.array_split(flat, length)], np.float32)


def shadow_features(spec, broadcast, x: np.ndarray, y: np.ndarray,
                    upload_kind: str, protocol: dict, samples_per_upload: int = 1,
                    length: int = 1024) -> np.ndarray:
  """Pooled uploads of consecutive groups of `samples_per_upload` samples
  by the model of `spec` (a `tff_privacy.models.ModelSpec`, whose task's
  loss the clients train on) at weights `broadcast`."""
  weights = [tf.constant(w) for w in broadcast]
  model, task = spec.keras(), spec.task_object
  compute = tf.function(lambda xb, yb: functional.simulate_upload(
      model, weights, xb, tf.one_hot(yb, spec.num_classes), upload_kind,
      protocol, task=task))
  rows = []
  for start in range(0, len(y) - samples_per_upload + 1, samples_per_upload):
    end = start + samples_per_upload
    upload = compute(tf.constant(x[start:end]), tf.constant(y[start:end]))
    rows.append(pooled([u.numpy() for u in upload], length))
  return np.stack(rows)


def build_adversary(name: str, seed: int = 0):
  """An unfitted scikit-learn adversary `name` (one of `ADVERSARIES`)."""
  if name == "stru_nn":
    clf = MLPClassifier((512, 256), solver="sgd", learning_rate_init=0.01,
                        max_iter=80, random_state=seed)
  elif name == "unknown_nn":
    clf = MLPClassifier((1024, 1024, 512, 128), solver="sgd",
                        learning_rate_init=0.01, max_iter=80, random_state=seed)
  elif name == "svm":
    clf = SVC(kernel="rbf", random_state=seed)
  elif name == "rf":
    return RandomForestClassifier(n_estimators=120, random_state=seed)
  else:
    raise ValueError(f"adversary={name!r} is unknown; choose one of {ADVERSARIES}")
  return make_pipeline(StandardScaler(), clf)


def chance_rate(attributes: np.ndarray) -> float:
  """Accuracy of always guessing the most frequent attribute value."""
  return float(np.bincount(attributes).max() / len(attributes))


def attack_success_rates(train_features: np.ndarray, train_attributes: np.ndarray,
                         victim_features: np.ndarray, victim_attributes: np.ndarray,
                         adversaries: Sequence[str] = ADVERSARIES,
                         seed: int = 0) -> dict[str, float]:
  """ASR of each adversary trained on shadow uploads, tested on victims'."""
  import warnings

  from sklearn.exceptions import ConvergenceWarning
  rates = {}
  for name in adversaries:
    adversary = build_adversary(name, seed)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", ConvergenceWarning)
      adversary.fit(train_features, train_attributes)
    rates[name] = float(np.mean(adversary.predict(victim_features)
                                == victim_attributes))
  return rates
