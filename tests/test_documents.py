"""The synthetic tampered documents: seeded, masks that cover exactly the
changed pixels, boxes inside the image, arguments checked."""

import numpy as np
import pytest

from tff_privacy.data import documents, sources


def test_same_seed_same_documents_other_seed_others():
  a = documents.generate(6, seed=3)
  b = documents.generate(6, seed=3)
  c = documents.generate(6, seed=4)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x.image, y.image)
    np.testing.assert_array_equal(x.mask, y.mask)
    assert x.boxes == y.boxes and x.tamper == y.tamper
  assert any(not np.array_equal(x.image, z.image) for x, z in zip(a, c))


@pytest.mark.parametrize("kind", documents.TAMPERS)
@pytest.mark.parametrize("seed", range(4))
def test_tampering_changes_pixels_inside_the_mask_only(kind, seed):
  # the first document is drawn before any tampering draws, so the pristine
  # run holds the same document untouched
  pristine = documents.generate(1, seed=seed, tamper_fraction=0.0, jpeg_quality=None)[0]
  tampered = documents.generate(1, seed=seed, tamper_fraction=1.0, tampers=[kind],
                                jpeg_quality=None)[0]
  assert pristine.tamper is None and not pristine.mask.any()
  assert tampered.tamper == kind and tampered.mask.any()
  changed = np.any(tampered.image != pristine.image, axis=-1)
  assert not (changed & ~tampered.mask).any()
  assert changed[tampered.mask].mean() > 0.05


def test_formats_cycle_and_boxes_lie_inside_the_image():
  docs = documents.generate(8, size=48, seed=0)
  assert [d.format for d in docs] == list(documents.FORMATS) * 2
  for d in docs:
    assert d.image.shape == (48, 48, 3) and d.image.dtype == np.float32
    assert 0 <= d.image.min() and d.image.max() <= 1
    assert set(d.boxes) == set(documents.ELEMENT_CLASSES)
    for boxes in d.boxes.values():
      for x0, y0, x1, y1 in boxes:
        assert 0 <= x0 < x1 <= 48 and 0 <= y0 < y1 <= 48
  assert docs[0].boxes["barcode"] and docs[1].boxes["stamp"] and docs[2].boxes["qr"]


def test_region_mask_is_the_union_of_the_chosen_classes():
  doc = documents.generate(1, seed=2)[0]
  mask = documents.region_mask(doc, documents.PRIVACY_PREFERENCES["numbers"])
  expected = np.zeros_like(mask)
  for cls in ("amount", "phone", "id_number"):
    for x0, y0, x1, y1 in doc.boxes[cls]:
      expected[y0:y1, x0:x1] = True
  np.testing.assert_array_equal(mask, expected)
  assert mask.any()
  with pytest.raises(ValueError, match=r"classes \['logo'\] are unknown"):
    documents.region_mask(doc, ["logo"])


@pytest.mark.parametrize("kwargs, message", [
    ({"num": 0}, "num must be >= 1"), ({"size": 16}, "size must be >= 32"),
    ({"formats": ["poster"]}, "formats=\\['poster'\\]"),
    ({"tampers": []}, "tampers=\\[\\]"),
    ({"tamper_fraction": 1.5}, "tamper_fraction must lie in"),
    ({"jpeg_quality": 0}, "jpeg_quality must lie in")])
def test_bad_arguments_name_the_parameter(kwargs, message):
  with pytest.raises(ValueError, match=message):
    documents.generate(**{"num": 2, **kwargs})
  with pytest.raises(ValueError, match=message):  # before drawing any
    documents.iterate(**{"num": 2, **kwargs})


def test_elements_drawn_outside_a_small_page_have_no_box():
  for seed in range(3):
    for doc in documents.generate(8, size=documents.MIN_SIZE, seed=seed):
      assert all(len(box) == 4 for boxes in doc.boxes.values() for box in boxes)


def test_the_docs_source_holds_the_generated_documents_in_file_backed_arrays():
  # drawn one at a time into arrays whose pages live in a file, the source
  # must hold what `generate` returns in a list
  source = sources.load_docs(num=11, size=32, test_fraction=0.2)
  docs = documents.generate(11, size=32, seed=0)
  for array in (source.x_train, source.y_train, source.elements.train):
    assert isinstance(array, np.memmap)
  np.testing.assert_array_equal(np.concatenate([source.x_train, source.x_test]),
                                np.stack([d.image for d in docs]))
  np.testing.assert_array_equal(np.concatenate([source.y_train, source.y_test]),
                                np.stack([d.mask for d in docs]).astype(np.int32))
  assert len(source.y_train) == 9
  assert list(np.concatenate(source.groups)) == [d.format for d in docs]
  for cls in documents.ELEMENT_CLASSES:
    np.testing.assert_array_equal(
        np.concatenate([source.elements.masks([cls], "train"),
                        source.elements.masks([cls], "test")]),
        np.stack([documents.region_mask(d, [cls]) for d in docs]))
    np.testing.assert_array_equal(  # some images only
        source.elements.masks([cls], "train", np.array([3, 0])),
        np.stack([documents.region_mask(docs[i], [cls]) for i in (3, 0)]))
