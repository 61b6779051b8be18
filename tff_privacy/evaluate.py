"""Attack a run's captured uploads and score the reconstructions.

The attack sees only the update store; scoring reads the ground-truth store.
Writes `attack.json` (per-sample MSE, PSNR, SSIM, feature MSE, recovered and
true label, and their means), `reconstructions.png` (originals above
reconstructions) and `reconstructions.npz` (the matched 'original' and
'reconstructed' images, in `attack.json`'s sample order). Images are scored
and saved in the data's pixel units (`value_range`), a normalised run's
normalisation (`normalize`) undone.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

from tff_privacy import attacks, io, provenance, psi
from tff_privacy.attacks import attribute as attribute_inference
from tff_privacy.algorithms.fedre import run_regions
from tff_privacy.data import sources
from tff_privacy.defenses.updates import ClientView
from tff_privacy.metrics import lpips, report
from tff_privacy.metrics.image import region_boxes, ssim_parts
from tff_privacy.updates import GroundTruthStore, UpdateStore


FILES = ("attack.json", "reconstructions.png", "reconstructions.npz")


def attack_round(updates: str, round_num: int, out: str, attack: str = "ig",
                 clients: Optional[Sequence[int]] = None,
                 attack_kwargs: Optional[dict[str, Any]] = None,
                 device: Optional[str] = None, seed: int = 0,
                 ground_truth: Optional[str] = None,
                 lpips_weights: Optional[str] = None,
                 progress: bool = False,
                 region: Any = None,
                 shard: Optional[tuple[int, int]] = None) -> dict[str, Any]:
  """Runs `attack` on the captured `clients` (default all) of `round_num`.

  With `shard` (i, n), only every n-th of those clients from the i-th on
  (0-based) is attacked, so that n machines can split a campaign;
  `merge_attacks` joins the n results into the unsharded one (each record's
  search is seeded by (seed, round, client), not by its place in the list).

  With `region`, FedRE's privacy-sensitive region as boxes [x_min, y_min,
  x_max, y_max] (maxima exclusive; one box or a list), a [H, W] mask, or
  'run' (each client's own region in the FedRE run the store belongs to),
  the reconstructions are also scored inside it (`region_mse`,
  `region_psnr`, `region_ssim`; `tff_privacy.metrics.image.region_scores`).

  An attack run with `label_knowledge='true'` is handed the clients' labels
  from the ground truth (an upper bound on leakage); attack.json states the
  attacker's label knowledge either way.

  LPIPS is added only when `lpips_weights` names a weights file (see
  `tff_privacy.metrics.lpips`); otherwise the report says it was not computed.
  With `progress`, prints the plan (records, images per record) and a rough
  time estimate before the attack, then shows a progress bar. The result's
  'files' lists what was written under `out` (`FILES`).
  """
  if os.path.exists(out) and not os.path.isdir(out):
    raise ValueError(f"out={out!r} is a file; give a folder")
  store = UpdateStore(updates)
  clients = list(clients) if clients is not None else store.clients(round_num)
  campaign = list(clients)
  if len(set(campaign)) != len(campaign):
    raise ValueError(f"clients={campaign}: each client at most once")
  if shard is not None:
    clients = shard_of(campaign, *shard)
  records = [store.read(round_num, c) for c in clients]
  inversion = attacks.build(attack, **(attack_kwargs or {}))
  inversion.check_records(records)
  attacks.inversion.check_device(device)
  # everything the scoring reads is checked before a long attack
  ground_truth = os.path.abspath(ground_truth or os.path.join(
      os.path.dirname(os.path.abspath(updates)), "ground_truth"))
  truth = GroundTruthStore(ground_truth)
  labels = [truth.read(round_num, c)[1] for c in clients]
  weights = lpips.load_weights(lpips_weights) if lpips_weights else None
  shape = records[0].model_spec.input_shape[:2]
  if isinstance(region, str) and region == "run":
    own = run_regions(os.path.dirname(os.path.abspath(updates)))
    regions = [region_mask(own[c], *shape) for c in clients]
  else:
    regions = [None if region is None else region_mask(region, *shape)] * len(clients)
  if progress:
    print(inversion.plan(records), flush=True)
    estimate = inversion.estimate_seconds(records, device)
    print(f"{attack}: estimated time about {_duration(estimate)}", flush=True)
  start = time.perf_counter()
  reconstructions = inversion(records, device=device, seed=seed,
                              progress=progress, labels=labels)
  seconds = time.perf_counter() - start
  value_range = tuple(records[0].metadata["value_range"])
  rows, pairs = report.score(reconstructions, records, truth, value_range, regions)
  means = report.mean_scores(rows)
  lpips_note = ("not computed: needs pretrained AlexNet and LPIPS weights; "
                "pass a weights file to compute it")
  if weights is not None:
    distances = lpips.lpips(np.stack([p[0] for p in pairs]),
                            np.stack([p[1] for p in pairs]), weights, value_range)
    for row, d in zip(rows, distances):
      row["lpips"] = float(d)
    means["lpips"] = float(np.mean(distances))
    lpips_note = f"computed with weights from {os.path.abspath(lpips_weights)}"
  result = {"attack": attack,
            "params": {k: v for k, v in vars(inversion).items()
                       if not k.startswith("_")},
            "updates": os.path.abspath(updates), "ground_truth": ground_truth,
            "round": round_num,
            "clients": clients, "device": device or "default", "seed": seed,
            "value_range": list(value_range),
            # undone before scoring: the scores are in value_range's units
            "normalize": records[0].metadata.get("normalize"),
            "region": ({str(c): _boxes(r) for c, r in zip(clients, regions)}
                       if regions[0] is not None else None),
            "region_setting": _region_setting(region, regions),
            "label_knowledge": _label_knowledge(inversion, records[0]),
            "seconds": seconds, "method": records[0].metadata["method"],
            "upload_kind": records[0].upload_kind,
            "mean": means, "samples": rows, "lpips": lpips_note,
            "files": list(FILES), provenance.KEY: [provenance.code_version()]}
  if shard is not None:
    result["shard"] = {"index": shard[0], "count": shard[1], "campaign": campaign}
  _write_attack(out, result, pairs)
  return result


def _write_attack(out: str, result: dict[str, Any], pairs) -> None:
  """The npz and the figure, then attack.json: a folder with attack.json
  holds a complete result."""
  io.write_npz(os.path.join(out, "reconstructions.npz"),
               {"original": np.stack([p[0] for p in pairs]),
                "reconstructed": np.stack([p[1] for p in pairs])})
  report.save_figure(pairs, os.path.join(out, "reconstructions.png"),
                     result["value_range"],
                     title=f"{result['attack']} on {result['method']} round "
                           f"{result['round']}")
  io.write_json(os.path.join(out, "attack.json"), result)


def _region_setting(region: Any, regions: list) -> Any:
  """What the region argument was, for comparing shards: None, 'run' or
  the boxes every client was scored in."""
  if region is None or (isinstance(region, str) and region == "run"):
    return region
  return _boxes(regions[0])


def shard_of(clients: Sequence[int], index: int, count: int) -> list[int]:
  """Shard `index` of `count` (0-based): every count-th client from the
  index-th on.

  Raises:
    ValueError: index not in [0, count), or more shards than clients (some
      shard would be empty).
  """
  if count < 1 or not 0 <= index < count:
    raise ValueError(f"shard={index}/{count}: takes i/N with 0 <= i < N")
  if not clients:
    raise ValueError(f"shard={index}/{count}: the round has no records to attack")
  if count > len(clients):
    raise ValueError(f"shard={index}/{count}: the round has {len(clients)} "
                     f"records to attack; use at most {len(clients)} shards")
  return list(clients)[index::count]


# what every shard of one campaign must share
_CAMPAIGN_KEYS = ("attack", "params", "updates", "ground_truth", "round", "device",
                  "seed", "region_setting", "method", "upload_kind",
                  "label_knowledge", "lpips")


def merge_attacks(folders: Sequence[str], out: str) -> dict[str, Any]:
  """Joins the shards of one attack campaign (`attack_round(shard=...)`)
  into the result the unsharded attack writes: attack.json with the samples
  in the campaign's client order and their means, reconstructions.npz and
  the figure. `seconds` is the sum of the shards'.

  Raises:
    ValueError: a folder has no attack.json or is not a shard; the shards
      differ in any setting (attack, its parameters, updates, round, seed,
      clients, ...); a shard is missing or given twice.
  """
  shards = []
  for folder in folders:
    path = os.path.join(folder, "attack.json")
    if not os.path.isfile(path):
      raise ValueError(f"{folder!r} has no attack.json")
    result = io.read_json(path)
    if "shard" not in result:
      raise ValueError(f"{path} is not a shard (attacked without --shard)")
    shards.append((folder, result))
  first = shards[0][1]
  for folder, result in shards[1:]:
    for key in _CAMPAIGN_KEYS:
      if result.get(key) != first.get(key):
        raise ValueError(f"{folder!r} is a shard of another campaign: its "
                         f"{key!r} differs from {shards[0][0]!r}'s")
    if (result["shard"]["count"], result["shard"]["campaign"]) != (
        first["shard"]["count"], first["shard"]["campaign"]):
      raise ValueError(f"{folder!r} splits another campaign (shard count or "
                       f"clients differ from {shards[0][0]!r}'s)")
  count = first["shard"]["count"]
  indices = sorted(r["shard"]["index"] for _, r in shards)
  if indices != list(range(count)):
    raise ValueError(f"merging needs shards 0..{count - 1} once each; got "
                     f"{', '.join(str(i) for i in indices)}")
  campaign = first["shard"]["campaign"]
  order = {c: i for i, c in enumerate(campaign)}
  rows, regions = [], {}
  for folder, result in shards:
    with np.load(os.path.join(folder, "reconstructions.npz")) as f:
      if not len(result["samples"]) == len(f["original"]) == len(f["reconstructed"]):
        raise ValueError(f"{folder!r}: reconstructions.npz does not hold one "
                         "pair per sample of attack.json")
      for row, a, b in zip(result["samples"], f["original"], f["reconstructed"]):
        rows.append((order[row["client"]], row["sample"], row, a, b))
    regions.update(result["region"] or {})
  rows.sort(key=lambda t: t[:2])
  samples = [t[2] for t in rows]
  means = report.mean_scores(samples)
  if samples and "lpips" in samples[0]:
    means["lpips"] = float(np.mean([r["lpips"] for r in samples]))
  merged = {key: first[key] for key in first if key not in ("shard",)}
  merged.update(clients=campaign, mean=means, samples=samples,
                seconds=sum(r["seconds"] for _, r in shards),
                **{provenance.KEY: provenance.merged(
                    *(provenance.versions_of(r) for _, r in shards),
                    [provenance.code_version()])},
                region=({str(c): regions[str(c)] for c in campaign}
                        if first["region"] is not None else None))
  _write_attack(out, merged, [(t[3], t[4]) for t in rows])
  return merged


def infer_attributes_round(updates: str, round_num: int, attribute: str,
                           out: Optional[str] = None,
                           adversaries: Sequence[str] = attribute_inference.ADVERSARIES,
                           shadow_samples: int = 1000, shadow_pool: str = "train",
                           pool_length: int = 1024, seed: int = 0,
                           ground_truth: Optional[str] = None,
                           data_dir: Optional[str] = None,
                           source: Any = None,
                           adaptive: bool = False) -> dict[str, Any]:
  """Infers `attribute` of every client captured in `round_num` from its
  upload (`tff_privacy.attacks.attribute.infer_round`) with each of
  `adversaries`, trained on uploads of `shadow_samples` records of
  `shadow_pool` (`tff_privacy.attacks.attribute.shadow_indices`): 'train',
  a seeded sample of the training split, which RECUP-FL's defender zoo
  trains on too (the paper's adversary, Sec. 5.4; clients hold training
  records, so a victim's may be among them), or 'disjoint_test', records
  from the end of the test split balanced over the attribute's classes,
  disjoint from the zoo's (an ablation). The victims' true
  attribute (their samples' most frequent class) is read from the ground
  truth store. The data set is the run's (`source`, else loaded by the name
  in the store, with `data_dir` or the run's own, and the run's
  `data_kwargs`). With `out`, writes
  OUT/attribute_round_RRRR_<attribute>.json (…_adaptive.json if `adaptive`).

  `adaptive`: the adversaries train on shadow uploads passed through the
  run's client defence with its parameters (`adaptive_defense`), not on
  clean ones.

  Returns `infer_round`'s result plus 'attribute', 'classes', 'round',
  'adaptive' and 'shadow_pool'.

  Raises:
    ValueError: an unknown attribute, adversary or shadow pool, a round not
      captured.
  """
  unknown = sorted(set(adversaries) - set(attribute_inference.ADVERSARIES))
  if unknown or not adversaries:
    raise ValueError(f"adversaries {unknown or '(none)'} are not among "
                     f"{attribute_inference.ADVERSARIES}")
  if not isinstance(shadow_samples, int) or shadow_samples < 2:
    raise ValueError(f"shadow_samples must be an integer >= 2, got {shadow_samples!r}")
  attribute_inference.check_shadow_pool(shadow_pool)
  store = UpdateStore(updates)
  if round_num not in store.rounds():
    raise ValueError(f"round {round_num} was not captured in {updates}; "
                     f"captured rounds: {store.rounds()}")
  records = store.records(round_num)
  run_dir = os.path.dirname(os.path.abspath(updates))
  if source is None:
    config_path = os.path.join(run_dir, "config.json")
    config = io.read_json(config_path) if os.path.isfile(config_path) else {}
    source = sources.load_source(records[0].metadata["dataset"],
                                 data_dir or config.get("data_dir"),
                                 config.get("data_kwargs"))
  if source.attributes is None or attribute not in source.attributes.classes:
    known = sorted(source.attributes.classes) if source.attributes else []
    raise ValueError(f"attribute={attribute!r}: data set {source.name!r} has "
                     f"sensitive attributes {known or 'none'}")
  truth = GroundTruthStore(ground_truth or os.path.join(run_dir, "ground_truth"))
  victims = np.array([np.bincount(truth.read_attributes(
      round_num, r.client_index)[attribute]).argmax() for r in records])
  x, y, attributes = attribute_inference.shadow_split(source, shadow_pool)
  classes = attributes[attribute]
  shadow = attribute_inference.shadow_indices(classes, shadow_samples, shadow_pool)
  result = attribute_inference.infer_round(
      records, victims, x[shadow], y[shadow], classes[shadow],
      adversaries, pool_length, seed,
      adaptive_defense(records[0], seed, updates,
                       {a: attributes[a][shadow] for a in source.attributes.classes})
      if adaptive else None)
  result.update(attribute=attribute, round=round_num, adaptive=adaptive,
                shadow_pool=shadow_pool,
                classes=list(source.attributes.classes[attribute]),
                **{provenance.KEY: [provenance.code_version()]})
  if out is not None:
    io.write_json(os.path.join(out, attributes_file(round_num, attribute, adaptive)),
                  result)
  return result


def attributes_file(round_num: int, attribute: str, adaptive: bool = False) -> str:
  """The name of `infer_attributes_round`'s result file in its `out`."""
  return (f"attribute_round_{round_num:04d}_{attribute}"
          f"{'_adaptive' if adaptive else ''}.json")


def adaptive_defense(record, seed: int = 0, updates: Optional[str] = None,
                     shadow_attributes: Optional[dict] = None):
  """The client defence of `record`'s run, rebuilt from its metadata with
  the same parameters, as `attacks.attribute.shadow_features`' `defend`:
  each shadow upload gets its own noise seed (from `seed` and its index),
  and a defence that reads the client's data (Soteria) sees the shadow
  batch. A defence built from the run's data and files
  (`adaptive_from_run`: RECUP-FL, with its round's zoo) is rebuilt by its
  `adaptive_copy` from the run's update store `updates` (in the run's
  folder) and the shadow samples' attribute classes `shadow_attributes`
  ({attribute: [samples]}, in the data set's order of attributes).

  Raises:
    ValueError: the run has no client defence, or one the adversary cannot
      rebuild (DP-FedAvg adds its noise on the server, after the uploads).
  """
  from tff_privacy import defenses
  meta = record.metadata.get("defense")
  if not meta:
    raise ValueError("adaptive adversaries re-apply the clients' defence to "
                     f"their shadow uploads; method {record.metadata['method']!r} "
                     "ran without one")
  name = meta["name"]
  refused = (f"adaptive adversaries are not available against {name!r}: it "
             "cannot be re-applied to a shadow upload from its parameters alone")
  cls = (defenses.defense_class(name) if name in defenses.DEFENSES
         and defenses.is_client_side(name) else None)
  if cls is not None and cls.adaptive_from_run:
    if updates is None or shadow_attributes is None:
      raise ValueError(f"adaptive adversaries rebuild {name!r} from the run's "
                       "update store and the shadow samples' attributes")
    return cls.adaptive_copy(record, updates, shadow_attributes, seed)
  if cls is None or getattr(cls, "needs_data", False):
    raise ValueError(refused)
  params = {k: v for k, v in meta.items() if k in cls.PARAMETERS}
  defense = defenses.build(name, record.model_spec, **params)
  if defense.client_input_types:
    raise ValueError(refused)
  weights = [tf.constant(w) for w in record.broadcast]

  def defend(upload, index, x, y):
    view = None
    if defense.needs_client_view:
      view = ClientView(weights, tf.data.Dataset.from_tensor_slices(
          {"x": x, "y": y}).batch(len(y)))
    # four entries: never a client's (run seed, round, client) seed
    state = np.random.SeedSequence([seed, record.round_num, index, 1]).generate_state(2)
    return defense.apply(list(upload), tf.constant(state.astype(np.int64)), view)
  return defend


def region_mask(region: Any, height: int, width: int) -> np.ndarray:
  """`region` (a box, a list of boxes or a [height, width] mask) as a mask
  with a part SSIM can score; a one-line `ValueError` otherwise."""
  if isinstance(region, np.ndarray) and region.ndim == 2:
    mask = psi.check_mask(region, height, width, name="region")
  else:
    boxes = [region] if np.ndim(region) == 1 else list(region)
    mask = psi.box_mask(boxes, height, width, name="region")
  mask = np.asarray(mask, bool)
  try:
    ssim_parts(mask)
  except ValueError as e:
    raise ValueError(f"region: {e}") from None
  return mask


def _boxes(mask: np.ndarray) -> list[list[int]]:
  """The bounding boxes [x_min, y_min, x_max, y_max] of a mask's parts."""
  return [[b[1].start, b[0].start, b[1].stop, b[0].stop]
          for b in region_boxes(mask)]


def _label_knowledge(inversion, record) -> str:
  """What attack.json says the attacker knew of the labels."""
  knowledge = getattr(inversion, "label_knowledge", "auto")
  if knowledge == "true":
    return "true: the client's labels were given (an upper bound on leakage)"
  if knowledge == "background":
    return "background: every label taken as class 0"
  if getattr(inversion, "OPTIMISES_LABELS", False):
    return "optimised jointly with the inputs"
  if record.model_spec.task_object.labels_recoverable:
    return "recovered analytically from the upload"
  return "none: every pixel taken as class 0 (an untampered document)"


def _duration(seconds: float) -> str:
  if seconds < 90:
    return f"{seconds:.0f} s"
  if seconds < 5400:
    return f"{seconds / 60:.0f} min"
  return f"{seconds / 3600:.1f} h"
