"""Synthetic documents with tampering, for FedRE's tamper-segmentation task,
generated offline and seeded.

A document has one of four fixed formats (`FORMATS`: receipt, invoice, ID
card, contract page), each with its own layout of elements of seven classes
(`ELEMENT_CLASSES`): plain text lines, amounts, phone numbers, ID numbers,
stamps (a coloured ring with text), barcodes and QR-like marks (a random
module grid with three finder squares). Text is rendered with Pillow's
bundled scalable font; the paper is a light tone with the texture of
scikit-image's scanned `page` image.

Tampering (`TAMPERS`), applied to a `tamper_fraction` of the documents:
* copy_move: the pixels of one element are copied over another element of
  the same document;
* splicing: the pixels of an element of another document are pasted over
  an element;
* retyping: a number (amount, phone or ID) is painted over with the paper
  tone and retyped with other digits, a font one size off, a 1-pixel offset
  and a slightly different ink colour.
The tampered region's pixels form the ground-truth mask. Every document may
then be re-saved as JPEG (`jpeg_quality`), which tampered and pristine
documents share, so compression alone does not give tampering away.

Each document also lists the boxes of its elements by class
([x_min, y_min, x_max, y_max], maxima exclusive): the privacy-sensitive
regions a client chooses by class (`PRIVACY_PREFERENCES` holds Fig. 1's two
examples).
"""

from __future__ import annotations

import dataclasses
import io as _io
from typing import Iterator, Optional, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

FORMATS = ("receipt", "invoice", "id_card", "contract")
ELEMENT_CLASSES = ("text", "amount", "phone", "id_number", "stamp", "barcode", "qr")
NUMBER_CLASSES = ("amount", "phone", "id_number")
TAMPERS = ("copy_move", "splicing", "retyping")
# Fig. 1: one client guards numbers, another iconographic marks
PRIVACY_PREFERENCES = {"numbers": ("amount", "phone", "id_number"),
                       "marks": ("stamp", "barcode", "qr")}
MIN_SIZE = 32
_WORDS = ("TOTAL", "ITEM", "DATE", "NAME", "PAID", "CASH", "TAX", "QTY", "SHOP",
          "ACCOUNT", "TERMS", "PARTY", "SIGNED", "ADDRESS", "INVOICE", "CARD")


@dataclasses.dataclass(frozen=True)
class Document:
  """One generated document.

  Attributes:
    image: [size, size, 3] float32 in [0, 1].
    mask: [size, size] bool, the tampered pixels.
    boxes: element class -> list of boxes [x_min, y_min, x_max, y_max].
    format: one of `FORMATS`.
    tamper: one of `TAMPERS`, or None for a pristine document.
  """

  image: np.ndarray
  mask: np.ndarray
  boxes: dict
  format: str
  tamper: Optional[str]


class _Canvas:
  """A document being drawn: the image and its elements' boxes."""

  def __init__(self, rng: np.random.Generator, size: int, paper: np.ndarray):
    self.rng, self.size = rng, size
    tone = rng.uniform(0.88, 0.97)
    texture = _texture(rng, paper, size)
    pixels = np.clip(tone + 0.06 * (texture - texture.mean()), 0, 1)
    tint = 1 - rng.uniform(0, 0.04, 3)
    self.image = Image.fromarray(
        (255 * pixels[..., None] * tint).astype(np.uint8), "RGB")
    self.draw = ImageDraw.Draw(self.image)
    self.paper = tuple(int(255 * tone * t) for t in tint)
    self.ink = tuple(int(v) for v in rng.integers(0, 60, 3))
    self.font_size = max(6, size // 9)
    self.elements: list[tuple[str, list[int], str]] = []

  def unit(self, fraction: float) -> int:
    return max(1, int(round(fraction * self.size)))

  def text(self, cls: str, x: int, y: int, value: str, size_delta: int = 0,
           ink=None) -> None:
    font = ImageFont.load_default(size=self.font_size + size_delta)
    box = self.draw.textbbox((x, y), value, font=font)
    box = _clipped(box, self.size)
    if box is None:
      return
    self.draw.text((x, y), value, font=font, fill=ink or self.ink)
    self.add(cls, box, value)

  def add(self, cls: str, box: Optional[list[int]], value: str = "") -> None:
    """Records an element; one drawn wholly outside the image has no box."""
    if box is not None:
      self.elements.append((cls, box, value))

  def stamp(self, cx: int, cy: int, radius: int) -> None:
    colour = (int(self.rng.integers(150, 220)), int(self.rng.integers(0, 60)),
              int(self.rng.integers(0, 80)))
    box = _clipped((cx - radius, cy - radius, cx + radius + 1, cy + radius + 1), self.size)
    width = max(1, radius // 5)
    self.draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius),
                      outline=colour, width=width)
    inner = max(1, radius - 2 * width)
    self.draw.ellipse((cx - inner, cy - inner, cx + inner, cy + inner),
                      outline=colour, width=1)
    self.add("stamp", box)

  def barcode(self, x: int, y: int, width: int, height: int) -> None:
    bars = self.rng.integers(0, 2, max(4, width))
    for i, bar in enumerate(bars[:width]):
      if bar:
        self.draw.line((x + i, y, x + i, y + height - 1), fill=self.ink)
    self.add("barcode", _clipped((x, y, x + width, y + height), self.size))

  def qr(self, x: int, y: int, modules: int, cell: int) -> None:
    grid = self.rng.integers(0, 2, (modules, modules))
    for corner in ((0, 0), (0, modules - 3), (modules - 3, 0)):
      grid[corner[0]:corner[0] + 3, corner[1]:corner[1] + 3] = [[1, 1, 1], [1, 0, 1], [1, 1, 1]]
    for i, j in zip(*np.nonzero(grid)):
      self.draw.rectangle((x + j * cell, y + i * cell, x + (j + 1) * cell - 1,
                           y + (i + 1) * cell - 1), fill=self.ink)
    self.add("qr", _clipped((x, y, x + modules * cell, y + modules * cell),
                            self.size))


def _clipped(box, size: int) -> Optional[list[int]]:
  x0, y0, x1, y1 = (int(v) for v in box)
  x0, y0, x1, y1 = max(0, x0), max(0, y0), min(size, x1), min(size, y1)
  return [x0, y0, x1, y1] if x0 < x1 and y0 < y1 else None


def _texture(rng, paper: np.ndarray, size: int) -> np.ndarray:
  """A random size x size crop of the scanned page, tiled if needed."""
  reps = (-(-size // paper.shape[0]), -(-size // paper.shape[1]))
  tiled = np.tile(paper, reps)
  y = rng.integers(0, tiled.shape[0] - size + 1)
  x = rng.integers(0, tiled.shape[1] - size + 1)
  return tiled[y:y + size, x:x + size]


def _digits(rng, n: int) -> str:
  return "".join(str(d) for d in rng.integers(0, 10, n))


def _amount(rng) -> str:
  return f"{rng.integers(1, 999)}.{rng.integers(0, 100):02d}"


def _phone(rng) -> str:
  return f"{_digits(rng, 3)}-{_digits(rng, 4)}"


def _word(rng) -> str:
  return str(rng.choice(_WORDS))


def _layout(canvas: _Canvas, fmt: str) -> None:
  """Draws the elements of format `fmt`."""
  rng, u, line = canvas.rng, canvas.unit, canvas.font_size + 2
  if fmt == "receipt":
    canvas.text("text", u(0.3), u(0.03), _word(rng))
    y = u(0.03) + line
    for _ in range(3):
      canvas.text("text", u(0.12), y, _word(rng)[:4])
      canvas.text("amount", u(0.55), y, _amount(rng))
      y += line
    canvas.text("phone", u(0.12), y, _phone(rng))
    canvas.barcode(u(0.15), y + line, u(0.7), u(0.12))
  elif fmt == "invoice":
    canvas.text("text", u(0.05), u(0.03), "INVOICE")
    canvas.text("id_number", u(0.05), u(0.03) + line, "#" + _digits(rng, 6))
    y = u(0.03) + 2 * line
    for _ in range(2):
      canvas.text("text", u(0.05), y, _word(rng)[:5])
      canvas.text("amount", u(0.5), y, _amount(rng))
      y += line
    canvas.text("phone", u(0.05), y, _phone(rng))
    canvas.stamp(u(0.75), u(0.78), u(0.15))
  elif fmt == "id_card":
    canvas.draw.rectangle((u(0.05), u(0.1), u(0.35), u(0.5)),
                          fill=tuple(int(c) for c in rng.integers(120, 200, 3)))
    canvas.text("text", u(0.42), u(0.1), _word(rng)[:6])
    canvas.text("id_number", u(0.42), u(0.1) + canvas.font_size + 2, _digits(rng, 8))
    canvas.text("phone", u(0.05), u(0.58), _phone(rng))
    canvas.qr(u(0.62), u(0.6), 7, max(1, u(0.045)))
  elif fmt == "contract":
    y = u(0.03)
    for _ in range(3):
      canvas.text("text", u(0.05), y, " ".join(_word(rng)[:4] for _ in range(2)))
      y += line
    canvas.text("id_number", u(0.05), y, "No " + _digits(rng, 5))
    canvas.text("amount", u(0.05), y + line, _amount(rng))
    canvas.stamp(u(0.72), u(0.75), u(0.16))
  else:
    raise ValueError(f"format={fmt!r}; choose one of {FORMATS}")


def _draw(rng, fmt: str, size: int, paper: np.ndarray) -> _Canvas:
  canvas = _Canvas(rng, size, paper)
  _layout(canvas, fmt)
  return canvas


def _paste(canvas: _Canvas, patch: Image.Image, target: list[int]) -> np.ndarray:
  """Pastes `patch`, resized to `target`'s box; returns the mask."""
  x0, y0, x1, y1 = target
  canvas.image.paste(patch.resize((x1 - x0, y1 - y0)), (x0, y0))
  mask = np.zeros((canvas.size, canvas.size), bool)
  mask[y0:y1, x0:x1] = True
  return mask


def _tamper(rng, canvas: _Canvas, kind: str, donor: _Canvas) -> Optional[np.ndarray]:
  """Applies `kind` to the canvas; the mask, or None if the layout offers
  no target for it."""
  elements = [e for e in canvas.elements if e[0] in ("text",) + NUMBER_CLASSES]
  if kind == "retyping":
    numbers = [e for e in canvas.elements if e[0] in NUMBER_CLASSES]
    if not numbers:
      return None
    cls, box, value = numbers[rng.integers(len(numbers))]
    canvas.draw.rectangle((box[0], box[1], box[2] - 1, box[3] - 1), fill=canvas.paper)
    new = "".join(str(rng.integers(0, 10)) if c.isdigit() else c for c in value)
    ink = tuple(int(np.clip(c + rng.integers(-25, 26), 0, 255)) for c in canvas.ink)
    font = ImageFont.load_default(size=canvas.font_size + int(rng.choice([-1, 1])))
    x, y = box[0] + int(rng.integers(-1, 2)), box[1] + int(rng.integers(-1, 2))
    drawn = canvas.draw.textbbox((x, y), new, font=font)
    canvas.draw.text((x, y), new, font=font, fill=ink)
    region = _clipped((min(box[0], drawn[0]), min(box[1], drawn[1]),
                       max(box[2], drawn[2]), max(box[3], drawn[3])), canvas.size)
    mask = np.zeros((canvas.size, canvas.size), bool)
    mask[region[1]:region[3], region[0]:region[2]] = True
    return mask
  if len(elements) < (2 if kind == "copy_move" else 1):
    return None
  target = elements[rng.integers(len(elements))][1]
  if kind == "copy_move":
    sources = [e for e in elements if e[1] != target]
    source = sources[rng.integers(len(sources))][1]
    patch = canvas.image.crop(tuple(source))
  else:
    donors = [e for e in donor.elements if e[0] in ("text",) + NUMBER_CLASSES]
    if not donors:
      return None
    patch = donor.image.crop(tuple(donors[rng.integers(len(donors))][1]))
  return _paste(canvas, patch, target)


def _jpeg(image: Image.Image, quality: int) -> Image.Image:
  buffer = _io.BytesIO()
  image.save(buffer, format="JPEG", quality=quality)
  buffer.seek(0)
  return Image.open(buffer).convert("RGB")


def generate(num: int, *, size: int = 64, seed: int = 0,
             formats: Sequence[str] = FORMATS, tamper_fraction: float = 0.5,
             tampers: Sequence[str] = TAMPERS,
             jpeg_quality: Optional[int] = 90) -> list[Document]:
  """`num` documents, formats in turn, tampered with probability
  `tamper_fraction` by a kind drawn from `tampers`: `iterate`'s documents
  in a list.

  Args:
    num: how many documents.
    size: side of the square images, >= `MIN_SIZE` pixels.
    seed: the same seed gives the same documents.
    formats: the layouts to cycle through, from `FORMATS`.
    tamper_fraction: share of documents tampered, in [0, 1].
    tampers: the kinds of tampering, from `TAMPERS`.
    jpeg_quality: JPEG quality every document is re-saved at (1-95), or None.

  Raises:
    ValueError: naming the first argument outside its range.
  """
  return list(iterate(num, size=size, seed=seed, formats=formats,
                      tamper_fraction=tamper_fraction, tampers=tampers,
                      jpeg_quality=jpeg_quality))


def iterate(num: int, *, size: int = 64, seed: int = 0,
            formats: Sequence[str] = FORMATS, tamper_fraction: float = 0.5,
            tampers: Sequence[str] = TAMPERS,
            jpeg_quality: Optional[int] = 90) -> Iterator[Document]:
  """`generate`'s documents one at a time, drawn as they are asked for, so
  that a caller storing them elsewhere holds one in memory. The arguments
  are checked before the first document is drawn; see `generate`."""
  _check_arguments(num, size, formats, tamper_fraction, tampers, jpeg_quality)
  return _drawn(num, size, seed, formats, tamper_fraction, tampers, jpeg_quality)


def _check_arguments(num, size, formats, tamper_fraction, tampers, jpeg_quality) -> None:
  if num < 1:
    raise ValueError(f"num must be >= 1, got {num}")
  if size < MIN_SIZE:
    raise ValueError(f"size must be >= {MIN_SIZE}, got {size}")
  for name, given, known in (("formats", formats, FORMATS), ("tampers", tampers, TAMPERS)):
    unknown = [g for g in given if g not in known]
    if unknown or not given:
      raise ValueError(f"{name}={list(given)}; choose from {known}")
  if not 0 <= tamper_fraction <= 1:
    raise ValueError(f"tamper_fraction must lie in [0, 1], got {tamper_fraction}")
  if jpeg_quality is not None and not 1 <= jpeg_quality <= 95:
    raise ValueError(f"jpeg_quality must lie in [1, 95] or be None, got {jpeg_quality}")


def _drawn(num, size, seed, formats, tamper_fraction, tampers,
           jpeg_quality) -> Iterator[Document]:
  from skimage import data as skdata
  paper = skdata.page().astype(np.float32) / 255.0
  rng = np.random.default_rng(seed)
  for i in range(num):
    fmt = formats[i % len(formats)]
    canvas = _draw(rng, fmt, size, paper)
    mask, kind = np.zeros((size, size), bool), None
    if rng.random() < tamper_fraction:
      kind = str(rng.choice(list(tampers)))
      donor = _draw(rng, str(rng.choice(list(formats))), size, paper)
      mask = _tamper(rng, canvas, kind, donor)
      if mask is None:
        mask, kind = np.zeros((size, size), bool), None
    image = _jpeg(canvas.image, jpeg_quality) if jpeg_quality else canvas.image
    boxes = {cls: [list(b) for c, b, _ in canvas.elements if c == cls]
             for cls in ELEMENT_CLASSES}
    yield Document(np.asarray(image, np.float32) / 255.0, mask, boxes, fmt, kind)


def region_mask(document: Document, classes: Sequence[str]) -> np.ndarray:
  """The [size, size] mask of the document's elements of `classes` (a
  client's privacy preference); all False when it has none of them."""
  unknown = [c for c in classes if c not in ELEMENT_CLASSES]
  if unknown:
    raise ValueError(f"classes {unknown} are unknown; choose from {ELEMENT_CLASSES}")
  size = document.mask.shape[0]
  mask = np.zeros((size, size), bool)
  for cls in classes:
    for x0, y0, x1, y1 in document.boxes[cls]:
      mask[y0:y1, x0:x1] = True
  return mask
