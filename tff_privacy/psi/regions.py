"""Privacy-sensitive regions: boxes and masks on an image.

A box is `[x_min, y_min, x_max, y_max]` in pixel coordinates, maxima
exclusive (the Pascal VOC convention with half-open ranges): column range
x_min..x_max-1, row range y_min..y_max-1. A region of a sample is the union of
its boxes, held as a boolean [height, width] mask; PSI (eqs. 4-5) averages
over the region's pixels.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


def check_box(box: Sequence[int], height: int, width: int,
              name: str = "box") -> tuple[int, int, int, int]:
  """`box` as four ints; `ValueError` naming `name` unless it is a non-empty
  box inside a height x width image."""
  try:
    x0, y0, x1, y1 = (int(v) for v in box)
  except (TypeError, ValueError):
    raise ValueError(f"{name}={box!r} must be four integers "
                     "[x_min, y_min, x_max, y_max]") from None
  if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
    raise ValueError(f"{name}={list(box)} must satisfy 0 <= x_min < x_max <= "
                     f"{width} and 0 <= y_min < y_max <= {height} (image "
                     f"{height}x{width}, maxima exclusive)")
  return x0, y0, x1, y1


def parse_boxes(text: str, name: str = "boxes") -> list[list[int]]:
  """Boxes from text 'x_min,y_min,x_max,y_max[;...]' (as the command line
  takes them); `ValueError` naming `name` if the text is not integers."""
  try:
    boxes = [[int(v) for v in box.split(",")] for box in text.split(";")]
  except ValueError:
    boxes = []
  if not boxes or any(len(box) != 4 for box in boxes):
    raise ValueError(f"{name}={text!r}: expected 'x0,y0,x1,y1[;...]' with "
                     "integers")
  return boxes


def box_mask(boxes: Iterable[Sequence[int]], height: int, width: int,
             name: str = "boxes") -> np.ndarray:
  """The [height, width] boolean mask of the union of `boxes`."""
  mask = np.zeros((height, width), bool)
  for i, box in enumerate(boxes):
    x0, y0, x1, y1 = check_box(box, height, width, f"{name}[{i}]")
    mask[y0:y1, x0:x1] = True
  return mask


def check_mask(mask: np.ndarray, height: int, width: int,
               name: str = "mask") -> np.ndarray:
  """`mask` as a boolean [height, width] array with at least one pixel."""
  mask = np.asarray(mask)
  if mask.shape != (height, width):
    raise ValueError(f"{name} has shape {mask.shape}; expected ({height}, {width})")
  mask = mask.astype(bool)
  if not mask.any():
    raise ValueError(f"{name} selects no pixel; a region needs at least one")
  return mask
