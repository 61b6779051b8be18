"""Attack a run's captured uploads and score the reconstructions.

The attack sees only the update store; scoring reads the ground-truth store.
Writes `attack.json` (per-sample MSE, PSNR, SSIM, feature MSE, recovered and
true label, and their means) and `reconstructions.png` (originals above reconstructions).
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Sequence

from tff_privacy import attacks, io
from tff_privacy.metrics import report
from tff_privacy.updates import GroundTruthStore, UpdateStore


def attack_round(updates: str, round_num: int, out: str, attack: str = "ig",
                 clients: Optional[Sequence[int]] = None,
                 attack_kwargs: Optional[dict[str, Any]] = None,
                 device: Optional[str] = None, seed: int = 0,
                 ground_truth: Optional[str] = None) -> dict[str, Any]:
  """Runs `attack` on the captured `clients` (default all) of `round_num`."""
  store = UpdateStore(updates)
  clients = list(clients) if clients is not None else store.clients(round_num)
  records = [store.read(round_num, c) for c in clients]
  inversion = attacks.build(attack, **(attack_kwargs or {}))
  start = time.perf_counter()
  reconstructions = inversion(records, device=device, seed=seed)
  seconds = time.perf_counter() - start
  value_range = tuple(records[0].metadata["value_range"])
  truth = GroundTruthStore(ground_truth or os.path.join(
      os.path.dirname(os.path.abspath(updates)), "ground_truth"))
  rows, pairs = report.score(reconstructions, records, truth, value_range)
  result = {"attack": attack,
            "params": {k: v for k, v in vars(inversion).items()
                       if not k.startswith("_")},
            "updates": os.path.abspath(updates), "round": round_num,
            "clients": clients, "device": device or "default",
            "seconds": seconds, "method": records[0].metadata["method"],
            "upload_kind": records[0].upload_kind,
            "mean": report.mean_scores(rows), "samples": rows,
            "lpips": "not computed: needs pretrained network weights"}
  io.write_json(os.path.join(out, "attack.json"), result)
  report.save_figure(pairs, os.path.join(out, "reconstructions.png"), value_range,
                     title=f"{attack} on {result['method']} round {round_num}")
  return result
