"""DocTamper and T-SROIE loaders on tiny fixtures written in their formats."""

import io
import json

import lmdb
import numpy as np
import pytest
from PIL import Image

from conftest import write_doctamper_split
from tff_privacy.data import tamper_sets


def _encoded(array: np.ndarray, fmt: str) -> bytes:
  buffer = io.BytesIO()
  Image.fromarray(array).save(buffer, format=fmt, **({"quality": 100} if fmt == "JPEG" else {}))
  return buffer.getvalue()


@pytest.fixture
def doctamper(tmp_path):
  """Two samples the way the authors' LMDB holds them: JPEG images, masks
  stored as 0/255 (sample 0) and 0/1 (sample 1)."""
  rng = np.random.default_rng(0)
  images = [rng.integers(0, 256, (8, 12, 3), dtype=np.uint8) for _ in range(2)]
  masks = [np.zeros((8, 12), np.uint8) for _ in range(2)]
  masks[0][2:4, 3:7] = 255
  masks[1][5:8, 0:2] = 1
  jpegs = [_encoded(x, "JPEG") for x in images]
  env = lmdb.open(str(tmp_path / "split"), map_size=1 << 22)
  with env.begin(write=True) as txn:
    txn.put(b"num-samples", b"2")
    for i, (jpeg, m) in enumerate(zip(jpegs, masks)):
      txn.put(b"image-%09d" % i, jpeg)
      txn.put(b"label-%09d" % i, _encoded(m, "PNG"))
  env.close()
  # what PIL itself decodes from the stored JPEG bytes
  decoded = [np.asarray(Image.open(io.BytesIO(j)).convert("RGB")) / 255.0 for j in jpegs]
  return str(tmp_path / "split"), decoded, masks


def test_doctamper_images_and_masks(doctamper):
  path, images, masks = doctamper
  x, m = tamper_sets.load_doctamper(path)
  assert x.shape == (2, 8, 12, 3) and m.shape == (2, 8, 12) and m.dtype == bool
  np.testing.assert_array_equal(m, np.stack(masks) != 0)
  np.testing.assert_allclose(x, np.stack(images), atol=1e-6)
  x1, m1 = tamper_sets.load_doctamper(path, max_samples=1, size=4)
  assert x1.shape == (1, 4, 4, 3) and m1.shape == (1, 4, 4)


def test_doctamper_refuses_what_is_not_its_format(tmp_path, doctamper):
  with pytest.raises(ValueError, match="no data.mdb"):
    tamper_sets.load_doctamper(str(tmp_path))
  env = lmdb.open(str(tmp_path / "bad"), map_size=1 << 20)
  with env.begin(write=True) as txn:
    txn.put(b"num-samples", b"3")
    txn.put(b"image-000000000", b"not an image")
    txn.put(b"label-000000000", b"x")
  env.close()
  with pytest.raises(ValueError, match="sample 0 is not a readable image"):
    tamper_sets.load_doctamper(str(tmp_path / "bad"))
  env = lmdb.open(str(tmp_path / "empty"), map_size=1 << 20)
  env.close()
  with pytest.raises(ValueError, match="no 'num-samples' key"):
    tamper_sets.load_doctamper(str(tmp_path / "empty"))


@pytest.fixture
def tsroie(tmp_path):
  (tmp_path / "test").mkdir()
  for name in ("X001.jpg", "X002.jpg"):
    Image.fromarray(np.full((6, 10, 3), 200, np.uint8)).save(tmp_path / "test" / name)
  coco = {"images": [{"id": 1, "file_name": "X001.jpg"}, {"id": 2, "file_name": "X002.jpg"}],
          "annotations": [
              {"image_id": 1, "category_id": 2, "segmentation": [2, 1, 5, 1, 5, 3, 2, 3]},
              {"image_id": 1, "category_id": 1, "segmentation": [0, 0, 9, 0, 9, 5, 0, 5]},
              {"image_id": 2, "category_id": 1, "segmentation": [0, 0, 1, 0, 1, 1, 0, 1]}]}
  (tmp_path / "sroie_test_1011.json").write_text(json.dumps(coco))
  return tmp_path


def test_tsroie_masks_are_the_filled_tampered_polygons(tsroie):
  x, m, names = tamper_sets.load_tsroie(str(tsroie))
  assert names == ["X001.jpg", "X002.jpg"] and x.shape == (2, 6, 10, 3)
  expected = np.zeros((2, 6, 10), bool)
  expected[0, 1:4, 2:6] = True  # the quadrilateral, its border pixels included
  np.testing.assert_array_equal(m, expected)


def test_tsroie_refusals_name_the_missing_piece(tsroie, tmp_path):
  with pytest.raises(ValueError, match="no folder"):
    tamper_sets.load_tsroie(str(tsroie), split="train")
  with pytest.raises(ValueError, match="no annotation file"):
    tamper_sets.load_tsroie(str(tsroie), annotations=str(tmp_path / "none.json"))
  (tsroie / "bad.json").write_text(json.dumps({"images": []}))
  with pytest.raises(ValueError, match="not COCO-style"):
    tamper_sets.load_tsroie(str(tsroie), annotations=str(tsroie / "bad.json"))


def test_regions_come_from_a_user_file_or_the_run_is_refused(tmp_path):
  with pytest.raises(ValueError, match="ships no privacy-sensitive regions"):
    tamper_sets.require_regions("doctamper", None)
  path = tmp_path / "regions.json"
  path.write_text(json.dumps({"0": {"amount": [[1, 1, 3, 3]]}}))
  assert tamper_sets.load_regions(str(path), ["0"]) == [{"amount": [[1, 1, 3, 3]]}]
  with pytest.raises(ValueError, match="no boxes for 1 samples"):
    tamper_sets.load_regions(str(path), ["0", "1"])


def test_doctamper_element_maps_scale_the_files_boxes(tmp_path):
  from tff_privacy.data import sources
  for split, count in (("DocTamperV1-TrainingSet", 3), ("DocTamperV1-TestingSet", 2)):
    write_doctamper_split(tmp_path / split, count, 32, count)
  boxes = {f"DocTamperV1-TrainingSet/{i}": {"amount": [[0, 0, 8, 4]],
                                            "stamp": [[16, 16, 32, 32]]}
           for i in range(3)}
  boxes.update({f"DocTamperV1-TestingSet/{i}": {"amount": [[2, 2, 5, 5]]}
                for i in range(2)})
  path = tmp_path / "regions.json"
  path.write_text(json.dumps(boxes))
  src = sources.load_source("doctamper", str(tmp_path),
                            {"size": 16, "regions": str(path)})
  assert src.task == "segmentation" and src.x_train.shape == (3, 16, 16, 3)
  assert src.y_test.shape == (2, 16, 16) and src.y_train[0, 2:6, 4:8].all()
  assert src.elements.classes == ("amount", "stamp")
  # boxes halve from 32 to 16 pixels; 2..5 widens to whole pixels 1..3
  amount = np.zeros((16, 16), bool)
  amount[0:2, 0:4] = True
  np.testing.assert_array_equal(src.elements.masks(["amount"])[0], amount)
  np.testing.assert_array_equal(src.elements.masks(["stamp"])[1][8:, 8:], True)
  expected = np.zeros((16, 16), bool)
  expected[1:3, 1:3] = True
  np.testing.assert_array_equal(src.elements.masks(["amount"], "test")[1], expected)


def test_doctamper_regions_must_cover_every_sample(tmp_path):
  from tff_privacy.data import sources
  for split in ("DocTamperV1-TrainingSet", "DocTamperV1-TestingSet"):
    write_doctamper_split(tmp_path / split, 1, 16, 0)
  path = tmp_path / "regions.json"
  path.write_text(json.dumps({"DocTamperV1-TrainingSet/0": {"amount": [[0, 0, 4, 4]]}}))
  with pytest.raises(ValueError, match="no boxes for 1 samples"):
    sources.load_source("doctamper", str(tmp_path), {"size": 16, "regions": str(path)})
  path.write_text(json.dumps({f"{s}/0": {"amount": [[0, 0, 4]]} for s in (
      "DocTamperV1-TrainingSet", "DocTamperV1-TestingSet")}))
  with pytest.raises(ValueError, match="sample 'DocTamperV1-TrainingSet/0': give"):
    sources.load_source("doctamper", str(tmp_path), {"size": 16, "regions": str(path)})
  for bad in ([[0, 0, 4, 4]], {"amount": [[-4, 0, 4, 4]]}, {"amount": [[4, 0, 4, 4]]}):
    path.write_text(json.dumps({f"{s}/0": bad for s in (
        "DocTamperV1-TrainingSet", "DocTamperV1-TestingSet")}))
    with pytest.raises(ValueError, match="with 0 <= x_min < x_max"):
      sources.load_source("doctamper", str(tmp_path), {"size": 16, "regions": str(path)})


def test_tsroie_source_keys_regions_by_split_and_file_name(tsroie):
  import shutil
  from tff_privacy.data import sources
  shutil.copytree(tsroie / "test", tsroie / "train")
  shutil.copy(tsroie / "sroie_test_1011.json", tsroie / "sroie_train_1011.json")
  # a 10 x 6 receipt resized to 20 x 20: x doubles, y scales by 20/6
  regions = {f"{s}/{n}": {"phone": [[1, 0, 3, 3]]} for s in ("train", "test")
             for n in ("X001.jpg", "X002.jpg")}
  (tsroie / "regions.json").write_text(json.dumps(regions))
  src = sources.load_source("tsroie", str(tsroie), {
      "size": 20, "regions": str(tsroie / "regions.json")})
  assert src.x_train.shape == (2, 20, 20, 3) and src.y_train[0].any()
  expected = np.zeros((20, 20), bool)
  expected[0:10, 2:6] = True
  np.testing.assert_array_equal(src.elements.masks(["phone"], "test")[1], expected)
