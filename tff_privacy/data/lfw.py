"""LFW with attribute annotations, read from its published files.

Layout under the data folder (as published: the LFW image archive unpacked,
and the attribute file of Kumar et al., "Attribute and Simile Classifiers
for Face Verification", ICCV 2009)::

```text
lfw_attributes.txt                        tab-separated: comment lines
                                          starting with '#', the last of
                                          them the header '#, person,
                                          imagenum, <73 attribute names>';
                                          then per image its person, its
                                          number and 73 classifier scores
lfw_funneled/<Person>/<Person>_<NNNN>.jpg 250 x 250 RGB images (or lfw/,
                                          lfw-deepfunneled/); <Person> is
                                          the name with '_' for spaces
```

Images are cropped to rows 70-194 and columns 78-171 and halved to 62 x 47
(scikit-learn's `fetch_lfw_people(resize=0.5)` crop, the size RECUP-FL
uses), RGB in [0, 1]. Annotated images without a file are left out.

The task is smiling (RECUP-FL Sec. 5.2: 'Smiling' score > 0). Sensitive
attributes, each the class whose score is highest (RECUP-FL Sec. 6.3):
race (asian, white, black), gender (female, male: 'Male' score > 0), age
(baby, child, youth, middle-aged, senior), glasses (no eyewear,
eyeglasses, sunglasses) and hair (black, blond, brown, bald).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

ATTRIBUTES_FILE = "lfw_attributes.txt"
IMAGE_FOLDERS = ("lfw_funneled", "lfw", "lfw-deepfunneled")
CROP = (slice(70, 195), slice(78, 172))
SHAPE = (62, 47)
TASK_SCORE = "Smiling"
# attribute: (class names, the score columns whose largest picks the class)
ATTRIBUTE_SCORES = {
    "race": (("asian", "white", "black"), ("Asian", "White", "Black")),
    "age": (("baby", "child", "youth", "middle-aged", "senior"),
            ("Baby", "Child", "Youth", "Middle Aged", "Senior")),
    "glasses": (("no eyewear", "eyeglasses", "sunglasses"),
                ("No Eyewear", "Eyeglasses", "Sunglasses")),
    "hair": (("black", "blond", "brown", "bald"),
             ("Black Hair", "Blond Hair", "Brown Hair", "Bald")),
}
ATTRIBUTE_CLASSES = {"race": ATTRIBUTE_SCORES["race"][0], "gender": ("female", "male"),
                     **{a: v[0] for a, v in ATTRIBUTE_SCORES.items() if a != "race"}}


def read_attributes(path: str) -> tuple[list[tuple[str, int]], dict[str, np.ndarray]]:
  """(person, image number) per annotated image and each score column."""
  header, rows = None, []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      fields = line.rstrip("\n").split("\t")
      if line.startswith("#"):
        names = [v.strip().lstrip("#").strip() for v in fields]
        names = [v for v in names if v]
        if names[:2] == ["person", "imagenum"]:
          header = names[2:]
        continue
      if not line.strip():
        continue
      if header is None:
        raise ValueError(f"{path}: no header line '#\\tperson\\timagenum\\t...' "
                         f"before line {number}")
      if len(fields) != len(header) + 2:
        raise ValueError(f"{path}, line {number}: {len(fields)} fields, the "
                         f"header names {len(header) + 2}")
      try:
        rows.append((fields[0], int(fields[1]), [float(v) for v in fields[2:]]))
      except ValueError:
        raise ValueError(f"{path}, line {number}: expected a person, an image "
                         "number and numeric scores") from None
  if header is None or not rows:
    raise ValueError(f"{path}: no annotated images")
  needed = {TASK_SCORE, "Male"} | {c for _, cols in ATTRIBUTE_SCORES.values() for c in cols}
  missing = sorted(needed - set(header))
  if missing:
    raise ValueError(f"{path}: the header lacks the score columns {missing}")
  scores = np.array([r[2] for r in rows], np.float32)
  return ([(r[0], r[1]) for r in rows],
          {name: scores[:, i] for i, name in enumerate(header)})


def image_folder(data_dir: str) -> str:
  for name in IMAGE_FOLDERS:
    if os.path.isdir(os.path.join(data_dir, name)):
      return os.path.join(data_dir, name)
  raise ValueError(f"data_dir={data_dir!r} holds none of the image folders "
                   f"{', '.join(IMAGE_FOLDERS)}")


def image_path(folder: str, person: str, number: int) -> str:
  name = person.replace(" ", "_")
  return os.path.join(folder, name, f"{name}_{number:04d}.jpg")


def load_image(path: str) -> np.ndarray:
  """The cropped 62 x 47 RGB image in [0, 1]."""
  from skimage import io as skio
  from skimage.transform import resize
  image = skio.imread(path)
  if image.ndim != 3 or image.shape[0] < CROP[0].stop or image.shape[1] < CROP[1].stop:
    raise ValueError(f"{path}: expected a 250 x 250 RGB image, got shape {image.shape}")
  crop = image[CROP[0], CROP[1], :3].astype(np.float32) / 255.0
  return resize(crop, SHAPE, anti_aliasing=True).astype(np.float32)


def load(data_dir: str, max_images: Optional[int] = None):
  """(images [N, 62, 47, 3], smiling labels [N], attributes {name: [N]})."""
  keys, scores = read_attributes(os.path.join(data_dir, ATTRIBUTES_FILE))
  folder = image_folder(data_dir)
  found = [i for i, (person, number) in enumerate(keys)
           if os.path.isfile(image_path(folder, person, number))]
  if max_images is not None:
    found = found[:max_images]
  if not found:
    raise ValueError(f"data_dir={data_dir!r}: no image of {ATTRIBUTES_FILE} "
                     f"is in {folder}")
  x = np.stack([load_image(image_path(folder, *keys[i])) for i in found])
  y = (scores[TASK_SCORE][found] > 0).astype(np.int32)
  attributes = {"gender": (scores["Male"][found] > 0).astype(np.int32)}
  for name, (_, columns) in ATTRIBUTE_SCORES.items():
    attributes[name] = np.argmax(np.stack(
        [scores[c][found] for c in columns], axis=1), axis=1).astype(np.int32)
  return x, y, attributes
