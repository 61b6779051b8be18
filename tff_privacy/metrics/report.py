"""Scoring attack outputs against the clients' true samples, and the figure.

This is the only place that reads the ground-truth store.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from tff_privacy import io
from tff_privacy.data import normalization
from tff_privacy.metrics.image import (feature_mse, image_scores, match_by_mse,
                                       region_scores, summarize)
from tff_privacy.updates import GroundTruthStore


WHOLE_MODEL_UPLOADS = ("gradient", "model_delta")
REGION_KEYS = ("region_mse", "region_psnr", "region_ssim")


def score(reconstructions: Sequence[Any], records: Sequence[Any],
          truth: GroundTruthStore, value_range,
          regions: Optional[Sequence[Optional[np.ndarray]]] = None
          ) -> tuple[list[dict[str, Any]], list[tuple[np.ndarray, np.ndarray]]]:
  """Per-sample scores (after MSE matching within each client's batch) and
  the aligned (true, reconstructed) image pairs for the figure.

  With `regions`, one [H, W] mask (FedRE's privacy-sensitive region) or
  None per reconstruction, each row also scores its region (`region_mse`,
  `region_psnr`, `region_ssim`; see
  `tff_privacy.metrics.image.region_scores`).

  Labels: a classifier's row holds the recovered and the true label; a
  segmentation model's row holds `label_pixel_accuracy`, the share of
  pixels whose label the attack used (or found) is the true one.

  Images are scored in `value_range`, the data's pixel units: where the
  run normalised its inputs (the records' 'normalize' metadata), the true
  samples and the reconstructions are mapped back first
  (`tff_privacy.data.normalization.to_pixels`), and the pairs returned are
  in pixel units too.

  `records` are the attacked `UpdateRecord`s, in the same order; their
  broadcast model gives the features of the feature MSE. Where the
  broadcast is not the client's whole model (HyperFL's hypernetwork, a
  shared feature extractor) the feature MSE is not computed (NaN): the
  client's own model is private.
  """
  rows, pairs = [], []
  regions = regions or [None] * len(records)
  for rec, record, region in zip(reconstructions, records, regions):
    inputs, y_true = truth.read(rec.round_num, rec.client_index)
    x_true = normalization.to_pixels(inputs, record.metadata)
    lo, hi = value_range
    perm = match_by_mse(x_true, np.clip(
        normalization.to_pixels(rec.x, record.metadata), lo, hi))
    x_in, labels = rec.x[perm], np.asarray(rec.labels)[perm]
    x_rec = normalization.to_pixels(x_in, record.metadata)
    in_lo, in_hi = normalization.input_bounds(record.metadata)
    model = record.model_spec.keras()
    whole_model = record.upload_kind in WHOLE_MODEL_UPLOADS
    inside = (region_scores(x_true, x_rec, region, value_range)
              if region is not None else None)
    by_iterations = _ssim_by_iterations(rec, record, x_true, value_range)
    for i, s in enumerate(image_scores(x_true, x_rec, value_range)):
      if inside is not None:
        s.update({f"region_{k}": v for k, v in inside[i].items()})
      if by_iterations:
        s["ssim_by_iterations"] = {k: v[i] for k, v in by_iterations.items()}
      s["feature_mse"] = (feature_mse(model, record.broadcast, inputs[i:i + 1],
                                      np.clip(x_in[i:i + 1], in_lo, in_hi))
                          if whole_model else float("nan"))
      rows.append({"round": rec.round_num, "client": rec.client_index,
                   "sample": i, **s, **_label_scores(labels[i], y_true[i]),
                   "attack_objective": rec.objective})
      pairs.append((x_true[i], x_rec[i]))
  return rows, pairs


def _ssim_by_iterations(rec, record, x_true: np.ndarray, value_range
                        ) -> dict[str, list[float]]:
  """{iterations: each true sample's SSIM} of the reconstruction's
  snapshots, each matched to the true samples by MSE on its own."""
  lo, hi = value_range
  found = {}
  for iterations, x in sorted(rec.snapshots.items()):
    x = np.clip(normalization.to_pixels(x, record.metadata), lo, hi)
    x = x[match_by_mse(x_true, x)]
    found[str(iterations)] = [s["ssim"] for s in image_scores(x_true, x, value_range)]
  return found


def _label_scores(recovered: np.ndarray, true: np.ndarray) -> dict[str, Any]:
  if np.ndim(true) == 0:
    return {"recovered_label": int(recovered), "true_label": int(true)}
  return {"label_pixel_accuracy": float(np.mean(recovered == true))}


def label_accuracy(rows: Sequence[dict[str, Any]]) -> float:
  """Class labels: `label_count_accuracy`; per-pixel labels: the mean
  `label_pixel_accuracy`."""
  if rows and "label_pixel_accuracy" in rows[0]:
    return float(np.mean([r["label_pixel_accuracy"] for r in rows]))
  return label_count_accuracy(rows)


def label_count_accuracy(rows: Sequence[dict[str, Any]]) -> float:
  """Share of true labels recovered, as multisets per client (order-free)."""
  hits = total = 0
  for client in {(r["round"], r["client"]) for r in rows}:
    mine = [r for r in rows if (r["round"], r["client"]) == client]
    true = sorted(r["true_label"] for r in mine)
    got = sorted(r["recovered_label"] for r in mine)
    remaining = list(got)
    for label in true:
      if label in remaining:
        remaining.remove(label)
        hits += 1
    total += len(true)
  return hits / total if total else float("nan")


def mean_scores(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
  keys = ("mse", "psnr", "ssim", "feature_mse") + tuple(
      k for k in REGION_KEYS if rows and k in rows[0])
  means = summarize([{k: r[k] for k in keys} for r in rows])
  means["label_accuracy"] = label_accuracy(rows)
  return means


def save_figure(pairs: Sequence[tuple[np.ndarray, np.ndarray]], path: str,
                value_range, max_columns: int = 16, title: str = "") -> None:
  """Originals (top row) above reconstructions (bottom row), as a PNG."""
  pairs = list(pairs)
  save_grid({"original": [a for a, _ in pairs],
             "reconstructed": [b for _, b in pairs]},
            path, value_range, max_columns, title)


def save_grid(rows: dict[str, Sequence[np.ndarray]], path: str, value_range,
              max_columns: int = 16, title: str = "") -> None:
  """One labelled row of images per entry of `rows`, as a PNG."""
  import matplotlib.pyplot as plt
  fig = grid_figure(rows, value_range, max_columns, title)
  with io.atomic_path(path) as tmp:
    fig.savefig(tmp, format="png", dpi=100)
  plt.close(fig)


def grid_figure(rows: dict[str, Sequence[np.ndarray]], value_range,
                max_columns: int = 16, title: str = ""):
  """The figure of `save_grid`: images keep their aspect ratio, and the
  figure's shape follows it."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  columns = min(max_columns, max(len(images) for images in rows.values()))
  lo, hi = value_range
  first = next(iter(images[0] for images in rows.values() if len(images)))
  aspect = first.shape[0] / first.shape[1]  # height over width
  fig, axes = plt.subplots(len(rows), columns,
                           figsize=(1.2 * columns + 0.9,
                                    (1.2 * aspect + 0.2) * len(rows) + 0.4),
                           squeeze=False)
  for i, (label, images) in enumerate(rows.items()):
    for j in range(columns):
      ax = axes[i][j]
      ax.set_xticks([])
      ax.set_yticks([])
      if j < len(images):
        img = np.clip(images[j], lo, hi)
        ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray",
                  vmin=lo, vmax=hi, aspect="equal")
      else:
        ax.axis("off")
    axes[i][0].set_ylabel(label)
  if title:
    fig.suptitle(title)
  # tight_layout ignores the title: keep half an inch above the images for it
  fig.tight_layout(rect=(0, 0, 1, 1 - (0.5 if title else 0) / fig.get_figheight()))
  return fig
