"""LFW with attributes (its published files) and CelebA (tfds), on tiny
fixtures in their formats."""

import numpy as np
import pytest
from PIL import Image

from tff_privacy.data import lfw, sources

# the columns the loader reads, in the published file's order, among others
COLUMNS = ["Male", "Asian", "White", "Black", "Baby", "Child", "Youth",
           "Middle Aged", "Senior", "Black Hair", "Blond Hair", "Brown Hair",
           "Bald", "No Eyewear", "Eyeglasses", "Sunglasses", "Mustache",
           "Smiling"]


def _scores(male, race, age, glasses, hair, smiling):
  """A score row: the named class of each group scores 1, the others -1."""
  row = dict.fromkeys(COLUMNS, -1.0)
  for name in (race, age, glasses, hair):
    row[name] = 1.0
  row["Male"], row["Smiling"] = male, smiling
  return [row[c] for c in COLUMNS]


# person, image number, scores, pixel value inside the crop (None: no file)
IMAGES = [("Ann Smith", 1, _scores(-0.5, "Black", "Senior", "Sunglasses", "Bald", 2.0), 40),
          ("Ann Smith", 2, _scores(-1.5, "Black", "Youth", "No Eyewear", "Blond Hair", -1.0), 90),
          ("Bo Li", 1, _scores(1.2, "Asian", "Child", "Eyeglasses", "Black Hair", 0.5), 160),
          ("Bo Li", 3, _scores(0.3, "White", "Baby", "No Eyewear", "Brown Hair", -0.2), 210),
          ("Cy Young", 1, _scores(1.0, "White", "Baby", "No Eyewear", "Bald", 1.0), None)]


@pytest.fixture
def lfw_dir(tmp_path):
  lines = ["# \t", "#\tperson\timagenum\t" + "\t".join(COLUMNS)]
  for person, number, scores, value in IMAGES:
    lines.append("\t".join([person, str(number)] + [f"{s:g}" for s in scores]))
    if value is None:
      continue
    image = np.zeros((250, 250, 3), np.uint8)
    image[70:195, 78:172] = value  # the crop; 0 outside it
    folder = tmp_path / "lfw_funneled" / person.replace(" ", "_")
    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(folder / f"{person.replace(' ', '_')}_{number:04d}.jpg",
                                quality=100)
  (tmp_path / "lfw_attributes.txt").write_text("\n".join(lines) + "\n")
  return tmp_path


def test_lfw_reads_the_crop_the_task_and_the_attributes(lfw_dir):
  x, y, attributes = lfw.load(str(lfw_dir))
  assert x.shape == (4, 62, 47, 3) and x.dtype == np.float32
  for image, (*_, value) in zip(x, IMAGES):
    # nothing from outside the crop (0) reaches the image
    np.testing.assert_allclose(image, value / 255, atol=0.02)
  np.testing.assert_array_equal(y, [1, 0, 1, 0])
  classes = lfw.ATTRIBUTE_CLASSES
  want = {"gender": ["female", "female", "male", "male"],
          "race": ["black", "black", "asian", "white"],
          "age": ["senior", "youth", "child", "baby"],
          "glasses": ["sunglasses", "no eyewear", "eyeglasses", "no eyewear"],
          "hair": ["bald", "blond", "black", "brown"]}
  for name, values in want.items():
    assert [classes[name][i] for i in attributes[name]] == values


def test_lfw_source_splits_and_keeps_attributes_aligned(lfw_dir):
  source = sources.load_source("lfw", data_dir=str(lfw_dir))
  assert source.input_shape == (62, 47, 3) and source.num_classes == 2
  assert len(source.y_train) + len(source.y_test) == 4
  # each sample's gender follows it into its split: the pixel value tells
  # which image it is
  gender = {40: 0, 90: 0, 160: 1, 210: 1}
  for x, a in ((source.x_train, source.attributes.train),
               (source.x_test, source.attributes.test)):
    for image, g in zip(x, a["gender"]):
      assert gender[int(round(image.mean() * 255 / 10)) * 10] == g


def test_lfw_max_images_reads_the_first_annotated_images(lfw_dir):
  source = sources.load_source("lfw", str(lfw_dir), {"max_images": 2})
  x = np.concatenate([source.x_train, source.x_test])
  # the fixture's first two images found on disk have values 40 and 90
  assert sorted(int(round(image.mean() * 255 / 10)) * 10 for image in x) == [40, 90]


@pytest.mark.parametrize("edit,match", [
    (lambda d: (d / "lfw_attributes.txt").write_text("Ann\t1\t0.5\n"),
     "no header line"),
    (lambda d: (d / "lfw_attributes.txt").write_text(
        "#\tperson\timagenum\tMale\nAnn Smith\t1\t0.5\n"),
     r"lacks the score columns \['Asian'"),
    (lambda d: (d / "lfw_attributes.txt").write_text(
        "#\tperson\timagenum\t" + "\t".join(COLUMNS) + "\nAnn Smith\t1\t0.5\n"),
     "line 2: 3 fields, the header names 20"),
    (lambda d: (d / "lfw_funneled").rename(d / "elsewhere"), "none of the image folders"),
])
def test_lfw_errors_name_the_file_and_what_is_wrong(lfw_dir, edit, match):
  edit(lfw_dir)
  with pytest.raises(ValueError, match=match):
    lfw.load(str(lfw_dir))


def test_celeba_is_read_through_tfds_at_32_pixels():
  import tensorflow_datasets as tfds
  with tfds.testing.mock_data(num_examples=10):
    source = sources.load_source("celeba")
    want = {k: 0 for k in ("Male", "Young")}
    for split in ("train", "validation"):
      for example in tfds.as_numpy(tfds.load("celeb_a", split=split)):
        for k in want:
          want[k] += int(example["attributes"][k])
  assert source.input_shape == (32, 32, 3)
  assert len(source.y_train) + len(source.y_test) == 20
  assert 0 <= source.x_train.min() and source.x_train.max() <= 1
  attributes = source.attributes
  assert len(attributes.classes) == 39 and "Male" not in attributes.classes
  assert attributes.classes["Young"] == ("no", "yes")
  assert int(source.y_train.sum() + source.y_test.sum()) == want["Male"]
  assert int(attributes.train["Young"].sum() + attributes.test["Young"].sum()) == want["Young"]
