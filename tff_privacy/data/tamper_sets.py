"""Loaders for the published on-disk formats of FedRE's data sets.

* DocTamper (Qu et al., CVPR 2023), as its authors distribute it: one LMDB
  environment per split (a folder holding data.mdb), opened read-only; key
  'num-samples' holds the count, and sample i (from 0) is 'image-%09d' (JPEG
  bytes) with 'label-%09d' (the mask, an image read as grayscale, tampered
  pixels non-zero: 1 or 255).
* T-SROIE (Wang et al. 2022), in the layout its DocTamper-era scripts read:
  receipts as <root>/<split>/<name>.jpg and a COCO-style
  <root>/sroie_<split>_1011.json whose annotations with category_id 2 are
  tampered text quadrilaterals ('segmentation': 8 numbers, x y pairs); the
  masks are those polygons filled. Another annotation file can be named.

Neither set ships FedRE's privacy-sensitive regions (the paper annotated
them by hand): `load_regions` reads a user-supplied JSON of boxes per
sample and element class, and `require_regions` refuses a run without one.
"""

from __future__ import annotations

import io as _io
import json
import os
from typing import Optional, Sequence

import numpy as np
from PIL import Image, ImageDraw

TAMPERED_CATEGORY = 2


def _resized(image: Image.Image, mask: Image.Image, size: Optional[int]):
  """(image in [0, 1], boolean mask), resized to `size` x `size` if given."""
  if size is not None:
    image = image.resize((size, size), Image.BILINEAR)
    mask = mask.resize((size, size), Image.NEAREST)
  return (np.asarray(image.convert("RGB"), np.float32) / 255.0,
          np.asarray(mask) != 0)


def load_doctamper(path: str, *, max_samples: Optional[int] = None,
                   size: Optional[int] = None, sizes: Optional[list] = None
                   ) -> tuple[np.ndarray, np.ndarray]:
  """Images [N, H, W, 3] in [0, 1] and tamper masks [N, H, W] (bool) of the
  DocTamper LMDB split at `path`, the first `max_samples` of them, resized
  to `size` x `size` if given (bilinear for images, nearest for masks).
  `sizes`, if given, receives each image's stored (width, height).

  Raises:
    ValueError: naming `path` if it is not a DocTamper LMDB folder or a
      sample is missing or unreadable.
  """
  import lmdb
  if not os.path.isfile(os.path.join(path, "data.mdb")):
    raise ValueError(f"path={path!r} is not an LMDB folder (no data.mdb); give a "
                     "DocTamper split such as DocTamperV1-TestingSet")
  env = lmdb.open(path, readonly=True, lock=False, readahead=False,
                  meminit=False, max_readers=64)
  try:
    with env.begin(write=False) as txn:
      count = txn.get(b"num-samples")
      if count is None:
        raise ValueError(f"path={path!r}: no 'num-samples' key; not a DocTamper LMDB")
      count = int(count)
      if max_samples is not None:
        count = min(count, max_samples)
      images, masks = [], []
      for i in range(count):
        image, mask = txn.get(b"image-%09d" % i), txn.get(b"label-%09d" % i)
        if image is None or mask is None:
          raise ValueError(f"path={path!r}: sample {i} lacks image-{i:09d} or "
                           f"label-{i:09d}")
        try:
          image = Image.open(_io.BytesIO(image))
          if sizes is not None:
            sizes.append(image.size)
          x, m = _resized(image, Image.open(_io.BytesIO(mask)).convert("L"), size)
        except OSError as e:
          raise ValueError(f"path={path!r}: sample {i} is not a readable image "
                           f"({e})") from None
        images.append(x)
        masks.append(m)
  finally:
    env.close()
  return _stacked(images, masks, path)


def _stacked(images, masks, path):
  shapes = {x.shape for x in images}
  if len(shapes) > 1:
    raise ValueError(f"{path!r}: images differ in size {sorted(shapes)}; pass size=")
  if not images:
    raise ValueError(f"{path!r} holds no samples")
  return np.stack(images), np.stack(masks)


def load_tsroie(root: str, split: str = "test", *, annotations: Optional[str] = None,
                size: Optional[int] = None, max_samples: Optional[int] = None,
                sizes: Optional[list] = None) -> tuple[np.ndarray, np.ndarray, list[str]]:
  """Images, tamper masks (filled category-2 polygons) and file names of the
  T-SROIE `split` under `root`; see the module docstring for the layout.
  `sizes`, if given, receives each image's stored (width, height).

  Raises:
    ValueError: naming the missing folder or annotation file, or a
      malformed annotation.
  """
  folder = os.path.join(root, split)
  annotations = annotations or os.path.join(root, f"sroie_{split}_1011.json")
  if not os.path.isdir(folder):
    raise ValueError(f"T-SROIE: no folder {folder!r} (expected <root>/{split}/*.jpg)")
  if not os.path.isfile(annotations):
    raise ValueError(f"T-SROIE: no annotation file {annotations!r}; pass annotations=")
  try:
    with open(annotations) as f:
      coco = json.load(f)
    files = {im["id"]: im["file_name"] for im in coco["images"]}
    polygons: dict = {}
    for ann in coco["annotations"]:
      if ann["category_id"] == TAMPERED_CATEGORY:
        points = np.asarray(ann["segmentation"], float).reshape(-1, 2)
        polygons.setdefault(ann["image_id"], []).append(points)
  except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
    raise ValueError(f"T-SROIE: {annotations!r} is not COCO-style JSON with "
                     f"images and annotations ({e})") from None
  images, masks, names = [], [], []
  for image_id, name in sorted(files.items())[:max_samples]:
    file = os.path.join(folder, name)
    if not os.path.isfile(file):
      raise ValueError(f"T-SROIE: {annotations!r} names {name!r}, which is not in {folder!r}")
    image = Image.open(file).convert("RGB")
    if sizes is not None:
      sizes.append(image.size)
    mask = Image.new("L", image.size, 0)
    for points in polygons.get(image_id, []):
      ImageDraw.Draw(mask).polygon([tuple(p) for p in points], fill=255)
    x, m = _resized(image, mask, size)
    images.append(x)
    masks.append(m)
    names.append(name)
  x, m = _stacked(images, masks, folder)
  return x, m, names


def load_regions(path: str, sample_keys: list[str]) -> list[dict]:
  """Privacy-sensitive boxes per sample from the JSON file `path`:
  {"<sample key>": {"<element class>": [[x0, y0, x1, y1], ...]}}, one entry
  per key of `sample_keys` (`sample_key`), boxes in the stored image's
  pixels, maxima exclusive."""
  if not os.path.isfile(path):
    raise ValueError(f"regions file {path!r} does not exist")
  try:
    with open(path) as f:
      regions = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"regions file {path!r} is not JSON ({e})") from None
  if not isinstance(regions, dict):
    raise ValueError(f"regions file {path!r} must hold a JSON object keyed by sample")
  missing = [k for k in sample_keys if k not in regions]
  if missing:
    raise ValueError(f"regions file {path!r} has no boxes for {len(missing)} "
                     f"samples, e.g. {missing[:3]}")
  for key in sample_keys:
    _check_boxes(regions[key], f"regions file {path!r}, sample {key!r}")
  return [regions[k] for k in sample_keys]


def _check_boxes(boxes, where: str) -> None:
  """`boxes` maps element classes to lists of [x_min, y_min, x_max, y_max]
  with 0 <= x_min < x_max and 0 <= y_min < y_max."""
  ok = isinstance(boxes, dict) and all(
      isinstance(v, list) and all(
          isinstance(b, list) and len(b) == 4
          and all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in b)
          and 0 <= b[0] < b[2] and 0 <= b[1] < b[3] for b in v)
      for v in boxes.values())
  if not ok:
    raise ValueError(f"{where}: give {{\"<element class>\": [[x_min, y_min, "
                     "x_max, y_max], ...]}} with 0 <= x_min < x_max and 0 <= "
                     "y_min < y_max")


def sample_key(split: str, index: int, name: Optional[str] = None) -> str:
  """A sample's key in a regions file: '<split>/<index>' for DocTamper (e.g.
  'DocTamperV1-TestingSet/0'), '<split>/<file name>' for T-SROIE (e.g.
  'test/X51005200931.jpg')."""
  return f"{split}/{index if name is None else name}"


def element_maps(regions: list[dict], sizes: list[tuple[int, int]],
                 shape: tuple[int, int], classes: Sequence[str]) -> np.ndarray:
  """uint8 [N, H, W] maps, bit k set where a box of `classes[k]` lies: the
  boxes of `regions` (one dict per sample, as `load_regions` returns), drawn
  from each sample's stored (width, height) in `sizes` onto the `shape`
  (height, width) the images were resized to, widened to whole pixels."""
  if len(classes) > 8:
    raise ValueError(f"regions name {len(classes)} element classes; at most 8 fit")
  height, width = shape
  maps = np.zeros((len(regions), height, width), np.uint8)
  for i, (boxes, (w, h)) in enumerate(zip(regions, sizes)):
    for cls, cls_boxes in boxes.items():
      for x0, y0, x1, y1 in cls_boxes:
        rows = slice(int(np.floor(y0 * height / h)), int(np.ceil(y1 * height / h)))
        cols = slice(int(np.floor(x0 * width / w)), int(np.ceil(x1 * width / w)))
        maps[i, rows, cols] |= np.uint8(1 << classes.index(cls))
  return maps


def require_regions(dataset: str, path: Optional[str]) -> str:
  """`path`, or a one-line refusal: the real sets carry no PSI regions."""
  if path is None:
    raise ValueError(f"dataset {dataset!r} ships no privacy-sensitive regions; "
                     "give a JSON file of boxes per sample and element class "
                     "(see tff_privacy.data.tamper_sets.load_regions)")
  return path
