"""Attribute inference from client uploads (RECUP-FL Sec. 5.4, after Melis et
al. 2019).

The adversary max-pools each upload to a fixed-length vector and trains a
classifier that maps it to a sensitive attribute of the client's data. Its
training set comes from shadow data: samples whose attribute it knows, passed
through the broadcast model to produce the uploads a client holding them would
send (`shadow_features`); by default the training records RECUP-FL's defender
zoo trains on (`shadow_split`, `shadow_indices`), as in the paper (Sec. 5.4).
Four adversaries, as in the paper:

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
always guessing the most frequent attribute value. Where one class dominates
(85% of Adult's records are white) ASR stays near chance even when nothing
is learnt, so the balanced ASR (the mean recall over the classes, chance 1 /
classes) is reported beside it; the paper reports plain accuracy. A few
dozen victims leave either rate uncertain by several points (about 0.07
standard error at 40), so each comes with its 95% interval: Wilson's for
the plain rate, a percentile bootstrap over victims for the balanced one
(or, where every resample gives the same rate, e.g. when every victim is
inferred correctly, the mean of the classes' Wilson intervals).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import scipy.stats
import tensorflow as tf
from sklearn.ensemble import RandomForestClassifier
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC

from tff_privacy.attacks import functional
from tff_privacy.attacks.refusal import UploadRefused

ADVERSARIES = ("stru_nn", "unknown_nn", "svm", "rf")
# the uploads the adversaries' shadow simulation can reproduce
UPLOAD_KINDS = ("gradient", "model_delta")
# where the shadow records come from (`shadow_split`)
SHADOW_POOLS = ("train", "disjoint_test")
# the attack success rates' intervals: their level, and the bootstrap
# resamples of the balanced rate's
CONFIDENCE = 0.95
RESAMPLES = 2000


def pooled(upload: Sequence[np.ndarray], length: int = 1024) -> np.ndarray:
  """Max-pools the concatenated upload into `length` contiguous bins."""
  flat = np.concatenate([np.ravel(u) for u in upload])
  if length > flat.size:
    raise ValueError(f"length={length} exceeds the upload's {flat.size} entries")
  # np.array_split's bins: the first size % length one entry longer
  size, extra = divmod(flat.size, length)
  starts = np.arange(length) * size + np.minimum(np.arange(length), extra)
  return np.maximum.reduceat(flat, starts).astype(np.float32)


def shadow_features(spec, broadcast, x: np.ndarray, y: np.ndarray,
                    upload_kind: str, protocol: dict, samples_per_upload: int = 1,
                    length: int = 1024, defend=None) -> np.ndarray:
  """Pooled uploads of consecutive groups of `samples_per_upload` samples
  by the model of `spec` (a `tff_privacy.models.ModelSpec`, whose task's
  loss the clients train on) at weights `broadcast`. With `defend`, a
  function (upload tensors, group index, x, y) -> upload tensors, each
  upload goes through it before pooling (an adaptive adversary's copy of
  the clients' defence)."""
  weights = [tf.constant(w) for w in broadcast]
  model, task = spec.keras(), spec.task_object
  compute = tf.function(lambda xb, yb: functional.simulate_upload(
      model, weights, xb, tf.one_hot(yb, spec.num_classes), upload_kind,
      protocol, task=task))
  rows = []
  for start in range(0, len(y) - samples_per_upload + 1, samples_per_upload):
    end = start + samples_per_upload
    upload = compute(tf.constant(x[start:end]), tf.constant(y[start:end]))
    if defend is not None:
      upload = defend(upload, len(rows), x[start:end], y[start:end])
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


def check_shadow_pool(pool: str) -> None:
  """Raises a `ValueError` naming shadow_pool unless `pool` is one of
  `SHADOW_POOLS`."""
  if pool not in SHADOW_POOLS:
    raise ValueError(f"shadow_pool={pool!r}; choose one of "
                     f"{', '.join(repr(p) for p in SHADOW_POOLS)}")


def shadow_split(source, pool: str
                 ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
  """The records of data source `source` that shadow pool `pool` (one of
  `SHADOW_POOLS`) draws from: (x, y, each sensitive attribute's classes) of
  the training split for 'train', of the test split for 'disjoint_test'.

  'train' is the paper's setting (Sec. 5.4): the adversaries train on the
  defender zoo's training set, the strongest adversary, who knows it. The
  clients hold training records too, so a victim's own records may be among
  the shadow records. 'disjoint_test' (an ablation) keeps the adversaries
  and the zoo on disjoint records of the test split, which no client holds.

  Raises:
    ValueError: for an unknown pool.
  """
  check_shadow_pool(pool)
  if pool == "train":
    return source.x_train, source.y_train, source.attributes.train
  return source.x_test, source.y_test, source.attributes.test


SHADOW_SEED = 0


def training_sample(size: int, n: int) -> np.ndarray:
  """The shadow records of pool 'train': `n` of the training split's `size`
  records (all if fewer), drawn without replacement by numpy's
  `default_rng(SHADOW_SEED)` and sorted, the same for the defender zoo and
  the adversaries. A sample rather than the first n, since a split may be
  stored in some order (the bundled digits' first records are all even)."""
  return np.sort(np.random.default_rng(SHADOW_SEED).permutation(size)[:n])


def shadow_indices(attributes: np.ndarray, n: int, pool: str = "train") -> np.ndarray:
  """Indices, into `shadow_split`'s records of `pool`, of the adversary's
  `n` shadow records (`attributes`: the records' classes of the attribute).

  'train': `training_sample`, in their natural proportions: the records
  RECUP-FL's defender zoo trains on (`tff_privacy.defenses.recupfl.RecupFL`).
  'disjoint_test': balanced, the last ceil(n / classes) of each class
  present among the test records after the first n, so that none is among
  the zoo's first n test records (when it trains on as many); a class with
  fewer there gives what it has (the rare classes of Adult's race fall
  short).

  Raises:
    ValueError: for an unknown pool, or 'disjoint_test' with no test record
      after the first n.
  """
  check_shadow_pool(pool)
  if pool == "train":
    return training_sample(len(attributes), n)
  rest = np.asarray(attributes)[n:]
  if not len(rest):
    raise ValueError(f"shadow_samples={n}: the test split's {len(attributes)} "
                     f"records leave none after the zoo's first {n} for "
                     "shadow pool 'disjoint_test'; give fewer")
  present = np.unique(rest)
  per_class = -(-n // len(present))
  return n + np.sort(np.concatenate(
      [np.flatnonzero(rest == c)[-per_class:] for c in present]))


def predictions(train_features: np.ndarray, train_attributes: np.ndarray,
                victim_features: np.ndarray,
                adversaries: Sequence[str] = ADVERSARIES,
                seed: int = 0) -> dict[str, np.ndarray]:
  """Each adversary, trained on shadow uploads, predicting the victims'
  attribute."""
  import warnings

  from sklearn.exceptions import ConvergenceWarning
  out = {}
  for name in adversaries:
    adversary = build_adversary(name, seed)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", ConvergenceWarning)
      adversary.fit(train_features, train_attributes)
    out[name] = adversary.predict(victim_features)
  return out


def attack_success_rates(train_features: np.ndarray, train_attributes: np.ndarray,
                         victim_features: np.ndarray, victim_attributes: np.ndarray,
                         adversaries: Sequence[str] = ADVERSARIES,
                         seed: int = 0) -> dict[str, float]:
  """ASR of each adversary trained on shadow uploads, tested on victims'."""
  guessed = predictions(train_features, train_attributes, victim_features,
                        adversaries, seed)
  return {name: float(np.mean(p == victim_attributes)) for name, p in guessed.items()}


def balanced_rate(guessed: np.ndarray, truth: np.ndarray) -> float:
  """The mean over the victims' attribute classes of the share of each
  class inferred correctly (scikit-learn's balanced accuracy; chance is 1 /
  the classes present)."""
  return float(_balanced_rates(guessed, truth))


def _balanced_rates(guessed: np.ndarray, truth: np.ndarray,
                    axis: int = -1) -> np.ndarray:
  """`balanced_rate` of each slice along `axis` (scipy's bootstrap passes
  many resamples at once), over the classes present in that slice's truth,
  so that a resample missing a class averages the others."""
  guessed, truth = np.moveaxis(guessed, axis, -1), np.moveaxis(truth, axis, -1)
  recalls = []
  for c in np.unique(truth):
    members = truth == c
    count = members.sum(-1)
    hits = (members & (guessed == c)).sum(-1)
    recalls.append(np.where(count > 0, hits / np.maximum(count, 1), np.nan))
  return np.nanmean(np.stack(recalls), axis=0)


def rate_interval(guessed: np.ndarray, truth: np.ndarray,
                  confidence: float = CONFIDENCE) -> list[float]:
  """[low, high]: the Wilson score interval of the share of `guessed` equal
  to `truth` (scipy's `binomtest(...).proportion_ci`)."""
  hits = int(np.sum(guessed == truth))
  interval = scipy.stats.binomtest(hits, len(truth)).proportion_ci(
      confidence, method="wilson")
  return [float(interval.low), float(interval.high)]


def balanced_interval(guessed: np.ndarray, truth: np.ndarray, seed: int = 0,
                      resamples: int = RESAMPLES,
                      confidence: float = CONFIDENCE) -> list[float]:
  """[low, high]: the percentile bootstrap interval of `balanced_rate`,
  victims resampled with replacement `resamples` times, each keeping its
  (guess, truth) pair (scipy's `bootstrap`, paired), from `seed`. With one
  victim, whom no resample can vary, the balanced rate is the plain one and
  so is its (Wilson) interval. Where the bootstrap interval has zero width
  (every resample gives the same rate, as when every victim is inferred
  correctly, or every one wrongly), which would read as certainty, it is
  `recall_interval`'s instead, a conservative one."""
  if len(truth) < 2:
    return rate_interval(guessed, truth, confidence)
  interval = scipy.stats.bootstrap(
      (np.asarray(guessed), np.asarray(truth)), _balanced_rates, paired=True,
      n_resamples=resamples, confidence_level=confidence, method="percentile",
      random_state=np.random.default_rng(seed)).confidence_interval
  if interval.low == interval.high:
    return recall_interval(guessed, truth, confidence)
  return [float(interval.low), float(interval.high)]


def recall_interval(guessed: np.ndarray, truth: np.ndarray,
                    confidence: float = CONFIDENCE) -> list[float]:
  """[low, high]: the means over the victims' attribute classes of the
  bounds of each class's Wilson interval of its recall (`rate_interval` of
  its victims): the balanced rate were every class's recall at its own
  bound at once, a conservative interval, which never has zero width."""
  guessed, truth = np.asarray(guessed), np.asarray(truth)
  bounds = [rate_interval(guessed[truth == c], truth[truth == c], confidence)
            for c in np.unique(truth)]
  return [float(b) for b in np.mean(bounds, axis=0)]


def infer_round(records, victim_attributes: np.ndarray, shadow_x: np.ndarray,
                shadow_y: np.ndarray, shadow_attributes: np.ndarray,
                adversaries: Sequence[str] = ADVERSARIES, length: int = 1024,
                seed: int = 0, defend=None) -> dict:
  """Attribute inference on one round's captured uploads.

  The adversary (an honest-but-curious server) computes one shadow upload
  per group of shadow samples at the round's broadcast model under the
  records' protocol, groups as large as the victims' uploads (the median
  `num_examples`), labels each with its group's most frequent attribute
  class, trains every adversary on them and predicts each victim's
  attribute from its max-pooled upload. The shadow uploads are clean (the
  paper's adversary, who does not know the defence) unless `defend` is
  given: an adaptive adversary, who knows the defence and its parameters,
  passes each shadow upload through its own copy (`shadow_features`), so
  that it trains on uploads distributed as the victims' are.

  Args:
    records: `tff_privacy.updates.UpdateRecord`s of one round, one broadcast.
    victim_attributes: [clients] each record's client's attribute class
      (the most frequent one among its samples).
    shadow_x: the adversary's shadow samples' inputs.
    shadow_y: their labels.
    shadow_attributes: their attribute classes.
    adversaries: names from `ADVERSARIES`.
    length: max-pooled length of an upload.
    seed: seeds the adversaries and the bootstrap.
    defend: see `shadow_features`; None for clean shadow uploads.

  Returns:
    {'asr': {adversary: accuracy}, 'balanced_asr': {adversary: balanced
    accuracy}, 'asr_ci' and 'balanced_asr_ci': {adversary: [low, high]},
    their 95% intervals (`rate_interval`: Wilson; `balanced_interval`: a
    bootstrap over victims, `recall_interval` where that has zero width),
    'chance': most frequent class share,
    'balanced_chance': 1 / classes present, 'victims', 'shadow_uploads',
    'samples_per_upload', 'truth': each victim's attribute class and
    'guesses': {adversary: each victim's inferred class}, in record order,
    which let results of several runs be pooled}.

  Raises:
    UploadRefused: the records upload something other than a gradient or
      model delta, were sent different models, or their uploads are not
      shaped like the model's weights.
    ValueError: too few shadow samples for two shadow uploads.
  """
  first = records[0]
  if first.upload_kind not in UPLOAD_KINDS:
    raise UploadRefused(f"attribute inference simulates uploads of the model's "
                        f"weights (a gradient or model delta); method "
                        f"{first.metadata['method']!r} uploads {first.upload_kind}")
  shapes = [w.shape for w in first.broadcast]
  for r in records:
    if [u.shape for u in r.upload] != shapes:
      raise UploadRefused(f"attribute inference needs uploads shaped like the "
                          f"model's weights; client {r.client_index}'s are not "
                          f"(method {r.metadata['method']!r})")
    if any(not np.array_equal(a, b) for a, b in zip(r.broadcast, first.broadcast)):
      raise UploadRefused(f"attribute inference trains its adversaries at one "
                          f"broadcast model; round {r.round_num}'s clients were "
                          "sent different models")
  group = max(1, int(np.median([r.num_examples for r in records])))
  if len(shadow_y) < 2 * group:
    raise ValueError(f"{len(shadow_y)} shadow samples make fewer than 2 shadow "
                     f"uploads of {group} samples")
  features = shadow_features(first.model_spec, first.broadcast, shadow_x, shadow_y,
                             first.upload_kind, first.metadata["protocol"],
                             samples_per_upload=group, length=length,
                             defend=defend)
  labels = np.array([np.bincount(shadow_attributes[i:i + group]).argmax()
                     for i in range(0, len(features) * group, group)])
  victims = np.stack([pooled(r.upload, length) for r in records])
  guessed = predictions(features, labels, victims, adversaries, seed)
  return {"asr": {n: float(np.mean(p == victim_attributes)) for n, p in guessed.items()},
          "balanced_asr": {n: balanced_rate(p, victim_attributes)
                           for n, p in guessed.items()},
          "asr_ci": {n: rate_interval(p, victim_attributes)
                     for n, p in guessed.items()},
          "balanced_asr_ci": {n: balanced_interval(p, victim_attributes, seed)
                              for n, p in guessed.items()},
          "chance": chance_rate(victim_attributes),
          "balanced_chance": 1.0 / len(np.unique(victim_attributes)),
          "victims": len(records), "shadow_uploads": len(features),
          "samples_per_upload": group,
          "truth": [int(a) for a in victim_attributes],
          "guesses": {n: [int(a) for a in p] for n, p in guessed.items()}}
