"""Runs the leaderboard's rows: train, capture one round, attack it.

Each row lives in OUT/rows/<key>/: `settings.json` (what the folder was
made with), `train/` (the run, which resumes), one folder per inversion
attack, `attributes/`, and `row.json`, written last: a row with row.json
is finished and is not run again while its settings are unchanged, unless
one of its attacks failed or the grid now attacks it with one it lacks
(that attack then runs on the stored uploads). A row whose settings
changed starts again in an emptied folder, as does a row on ClientData
whose run trained on other clients than its data options read now. An
attack that refuses a method's uploads
(`tff_privacy.attacks.UploadRefused`: it would refuse them on every try)
is recorded with its one-line reason instead of a number. Any other
failure of an attack (out of memory, say) is printed to stderr and kept in
row.json as failed, and the next run runs the row again: training resumes
where it ended and only the attacks without a result run. row.json records
the code versions that made its run and attacks (`provenance.KEY`); a
finished row is reused whichever code made it, and the report names the
rows made by code other than the current.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.util
import os
import shutil
import sys
import tempfile
import time
from concurrent import futures
from typing import Any, Callable, Optional, Sequence

import numpy as np

from tff_privacy import attacks as inversion_attacks
from tff_privacy import data, defenses, evaluate, io, provenance, runner
from tff_privacy.attacks import UploadRefused
from tff_privacy.dp import calibration
from tff_privacy.leaderboard import grid as grids
from tff_privacy.leaderboard.grid import Grid, Row
from tff_privacy.updates import UpdateStore

ROW_FILE = "row.json"
AUDIT_FILE = "audit.json"  # tff_privacy.audit.report's, in a row's run
SETTINGS_FILE = "settings.json"
CALIBRATION_FILE = "equal_epsilon.json"
GLOBAL_UTILITY = "test accuracy"


def run(grid: Grid, out: str, progress: bool = True,
        log: Callable[[str], None] = print, jobs: int = 1,
        train_data=None, test_data=None,
        entries: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
  """Every row of `grid` under `out` (of `entries` and the reference entry
  only, when given: OUT/grid.json still records the whole grid), finished
  rows reused; returns the rows' results in grid order, the equal-epsilon
  rows, which `grid` lacks until calibrated, among them: `read(out)` gives
  the grid they belong to.

  With `jobs` > 1 the unfinished rows run in that many processes (spawned,
  each with its own TFF worker) and show no progress bars; their times per
  round are then measured while they share the machine. Given TFF
  ClientData `train_data` and `test_data`, every row trains on their
  clients, read with its own data options (`grid.with_client_data`;
  grid.json records their SHA-256). The grid's equal-epsilon rows are
  calibrated first (`calibrate`) and run after the others.

  Raises:
    ValueError: `out` holds a leaderboard of another protocol (other
      clients too) or attacks, jobs < 1, a name of `entries` that is not
      an entry's, or a grid of partition 'client_data' without its
      ClientData.
  """
  if not isinstance(jobs, int) or jobs < 1:
    raise ValueError(f"jobs must be an integer >= 1, got {jobs!r}")
  kept = ({e["name"] for e in grids.only(grid, list(entries)).entries}
          if entries is not None else {e["name"] for e in grid.entries})
  federations = None
  if train_data is not None or test_data is not None:
    grid, federations = grids.with_client_data(grid, train_data, test_data)
  elif grid.protocol.get("partition") == data.CLIENT_DATA:
    raise ValueError(f"grid protocol partition {data.CLIENT_DATA!r}: give the "
                     "clients' ClientData as train_data and test_data")
  _claim(grid, out)
  grid = calibrate(grid, out, federations, log)
  rows = [row for row in grid.rows() if row.entry in kept]
  results, pending = {}, []
  digests = {key: f.sha256() for key, f in (federations or {}).items()}
  for i, row in enumerate(rows, start=1):
    stale = _other_clients(row, out, digests)
    if stale:
      log(f"[{i}/{len(rows)}] {row.label}: {stale}; running it again")
      shutil.rmtree(os.path.join(out, "rows", row.key))
    results[row.key] = _cached(row, out)
    if results[row.key] and not failures(results[row.key]) and not set(
        row.inversion) - set(results[row.key]["inversion"]):
      made = provenance.note(provenance.versions_of(results[row.key]),
                             provenance.code_version())
      log(f"[{i}/{len(rows)}] {row.label}: cached" + (f" ({made})" if made else ""))
    else:
      pending.append((i, row))
  if jobs == 1 or len(pending) < 2:
    for i, row in pending:
      log(f"[{i}/{len(rows)}] {row.label}: running")
      results[row.key], seconds = _timed_row(row, grid, out, progress, 1, federations)
      log(f"[{i}/{len(rows)}] {row.label}: done in {seconds:.0f} s")
  else:
    log(f"running {len(pending)} rows in {min(jobs, len(pending))} processes")
    for (i, row), (result, seconds) in _in_processes(pending, grid, out, jobs,
                                                     federations):
      results[row.key] = result
      log(f"[{i}/{len(rows)}] {row.label}: done in {seconds:.0f} s")
  return [results[row.key] for row in rows]


def _timed_row(row: Row, grid: Grid, out: str, progress: bool = False, jobs: int = 1,
               federations: Optional[dict] = None):
  from tff_privacy import runtime
  start = time.perf_counter()
  result = (run_row(row, grid, out, progress, jobs, federations),
            time.perf_counter() - start)
  runtime.renew()  # a worker's memory grows with every run it serves
  return result


def _in_processes(pending, grid: Grid, out: str, jobs: int,
                  federations: Optional[dict]):
  """Yields ((index, row), (result, seconds)) as rows finish in `jobs`
  spawned processes; the first failure cancels the rows not started."""
  context = multiprocessing.get_context("spawn")  # TensorFlow is not fork-safe
  with futures.ProcessPoolExecutor(min(jobs, len(pending)), mp_context=context,
                                   initializer=_start_process) as pool:
    submitted = {pool.submit(_timed_row, row, grid, out, False, jobs,
                             _own_clients(row, federations)): (i, row)
                 for i, row in pending}
    try:
      for done in futures.as_completed(submitted):
        yield submitted[done], done.result()
    except BaseException:
      pool.shutdown(wait=True, cancel_futures=True)
      raise


def _own_clients(row: Row, federations: Optional[dict]) -> Optional[dict]:
  """The entry of `federations` that `row` reads: all its process needs."""
  if federations is None:
    return None
  key = grids.data_key(row)
  return {key: federations[key]}


def _start_process() -> None:
  from tff_privacy import runtime
  runtime.end_with_parent(multiprocessing.parent_process().pid)
  runtime.start()
  # a pool's process ends without atexit hooks; its finalizers do run
  multiprocessing.util.Finalize(None, runtime.stop, exitpriority=10)


def read(out: str) -> tuple[Grid, list[dict[str, Any]]]:
  """The grid of the leaderboard in `out` and its rows that have a
  row.json (with the attacks that failed, if any)."""
  path = os.path.join(out, "grid.json")
  if not os.path.exists(path):
    raise ValueError(f"{out}: no leaderboard here (grid.json is missing); run "
                     "'tff-privacy leaderboard --out DIR' first")
  grid = calibrated(grids.load(path), out)
  results = [r for r in (_cached(row, out) for row in grid.rows()) if r]
  return grid, results


def with_recorded_target(grid: Grid, out: str) -> Grid:
  """`grid` with the equal-epsilon target that OUT/grid.json records (set
  there by an earlier run), or as it is where it records none (no file, or
  one from before the target was kept)."""
  path = os.path.join(out, "grid.json")
  if not os.path.exists(path) or "equal_epsilon" not in io.read_json(path):
    return grid
  return dataclasses.replace(grid, equal_epsilon=grids.load(path).equal_epsilon)


def calibrate(grid: Grid, out: str, federations: Optional[dict] = None,
              log: Callable[[str], None] = print) -> Grid:
  """`grid` calibrated to its `equal_epsilon` target (`Grid.calibration`,
  recorded in OUT/equal_epsilon.json), per swept entry: {'strength': the
  strength at which its run's own accounting spends the target epsilon at
  the target delta (`calibration.strength_for_epsilon`), 'epsilon',
  'delta' and 'relation': what that run reports}; {'strength': None,
  'error': why no strength does, 'relation'}; or {'strength': None} for a
  run without a DP guarantee at the entry's default strength. The runs
  are configured, not trained, on their clients among `federations` (a
  'client_data' grid's). A record whose entry and target are unchanged is
  reused."""
  if grid.equal_epsilon is None:
    return grid
  found = _recorded(grid, out)
  for name, variant, entry in _swept(grid):
    key = grids.calibration_key(name, entry)
    if key not in found:
      found[key] = _calibration(variant, entry, federations, log, key)
  io.write_json(os.path.join(out, CALIBRATION_FILE), found)
  return dataclasses.replace(grid, calibration=found)


def calibrated(grid: Grid, out: str) -> Grid:
  """`grid` with the calibration recorded in `out` by `calibrate` (its
  entries that are unchanged)."""
  if grid.equal_epsilon is None:
    return grid
  return dataclasses.replace(grid, calibration=_recorded(grid, out))


def _swept(grid: Grid) -> list[tuple[Optional[str], Grid, dict]]:
  """(protocol name, the grid under it, entry) of every swept entry under
  each of the grid's protocols (`Grid.variants`)."""
  return [(name, variant, entry) for name, variant in grid.variants()
          for entry in variant.entries if entry["sweep"] is not None]


def _recorded(grid: Grid, out: str) -> dict[str, dict]:
  """The records of OUT/equal_epsilon.json made for `grid`'s swept entries
  as they are now."""
  path = os.path.join(out, CALIBRATION_FILE)
  recorded = io.read_json(path) if os.path.exists(path) else {}
  keys = {grids.calibration_key(name, e): _calibrated_for(variant, e)
          for name, variant, e in _swept(grid)}
  return {key: recorded[key] for key, made_for in keys.items()
          if recorded.get(key, {}).get("for") == made_for}


def _calibrated_for(grid: Grid, entry: dict) -> dict:
  """What an entry's calibration depends on: its equal-epsilon row's
  settings at the default strength and the target epsilon."""
  return io.canonical({
      "settings": grids.equal_epsilon_row(entry, grid, entry["default"]).settings(),
      "epsilon": grid.equal_epsilon["epsilon"]})


def _calibration(grid: Grid, entry: dict, federations: Optional[dict],
                 log: Callable[[str], None], name: str) -> dict[str, Any]:
  """`calibrate`'s record of one swept entry, called `name` in the log."""
  start, spent = time.perf_counter(), {}

  def epsilon_at(strength: float) -> Optional[float]:
    if strength not in spent:
      spent[strength] = privacy_at(grids.equal_epsilon_row(entry, grid, strength),
                                   grid.attacks["capture_round"], federations)
    return spent[strength].get("epsilon")

  record = {"for": _calibrated_for(grid, entry), "strength": None}
  if epsilon_at(entry["default"]) is None:
    return record
  target = grid.equal_epsilon["epsilon"]
  try:
    strength = calibration.strength_for_epsilon(epsilon_at, target, entry["default"],
                                                f"entry {name!r}")
  except ValueError as e:
    log(f"{e}; no row at epsilon {target:g}")
    return {**record, "error": str(e), "relation": spent[entry["default"]]["dp_relation"]}
  at = spent[strength]
  log(f"{name}: {next(iter(entry['sweep']))}={strength:.4g} spends epsilon "
      f"{at['epsilon']:.4g} (calibrated in {time.perf_counter() - start:.1f} s)")
  return {**record, "strength": strength, "epsilon": at["epsilon"],
          "delta": at["delta"], "relation": at["dp_relation"]}


def privacy_at(row: Row, capture_round: int, federations: Optional[dict] = None
               ) -> dict[str, Any]:
  """What `row`'s run reports of its privacy after its last round
  (`runner.Run.privacy_spent`), from its configuration, without training;
  on its clients among `federations` (None: its partition's)."""
  with tempfile.TemporaryDirectory() as folder:
    config, federation = _on_clients(row, row.run_config(folder, capture_round),
                                     federations)
    return runner.Run(config, federation).privacy_spent(config.rounds)


def _claim(grid: Grid, out: str) -> None:
  """Writes OUT/grid.json, or checks that the one there has the same
  protocol and attacks (entries may be added or removed)."""
  if os.path.exists(out) and not os.path.isdir(out):
    raise ValueError(f"out={out!r} is a file; give a folder")
  path = os.path.join(out, "grid.json")
  new = grid.to_json()
  if os.path.exists(path):
    old = io.read_json(path)
    changed = [k for k in ("protocol", "attacks") if old.get(k) != new[k]]
    if changed:
      raise ValueError(f"{out} holds a leaderboard with other "
                       f"{' and '.join(changed)}; choose another --out or delete it")
  io.write_json(path, new)


def failures(result: dict[str, Any]) -> dict[str, str]:
  """The row's attacks that failed, and why; a refusal is a result, not a
  failure."""
  return {name: cell["error"] for name, cell in _cells(result).items()
          if "error" in cell and not cell.get("refused")}


def refusals(result: dict[str, Any]) -> dict[str, str]:
  """The row's attacks that refused its uploads, and why."""
  return {name: cell["error"] for name, cell in _cells(result).items()
          if cell.get("refused")}


def _cells(result: dict[str, Any]) -> dict[str, dict]:
  return {**result["inversion"], "attribute": result["attribute"] or {}}


def _cached(row: Row, out: str) -> Optional[dict[str, Any]]:
  path = os.path.join(out, "rows", row.key, ROW_FILE)
  if not os.path.exists(path):
    return None
  result = io.read_json(path)
  if result.get("settings") != row.settings():
    return None
  # the entry's name and default mark are presentation, not settings
  result.update(entry=row.entry, label=row.label, is_default=row.is_default)
  return _with_audit(result, os.path.dirname(path))


def _with_audit(result: dict[str, Any], folder: str) -> dict[str, Any]:
  """`result` with the audit of its row's run (train/audit.json in the
  row's `folder`; None before `audit`), the same whether the row ran now
  or was cached."""
  path = os.path.join(folder, "train", AUDIT_FILE)
  return {**result, "audit": io.read_json(path) if os.path.exists(path) else None}


def audit(out: str, canaries: int, mia_samples: int, seed: int = 0,
          log: Callable[[str], None] = print) -> None:
  """Audits every finished row of the leaderboard in `out` that has no
  audit yet, or one in an earlier format (`tff_privacy.audit.report.FORMAT`:
  audits that did not apply then may now), by
  `tff_privacy.audit.report.audit_run` on its run, which writes its
  train/audit.json, for the report's audit columns.

  Raises:
    ValueError: no leaderboard in `out`.
  """
  from tff_privacy.audit import report as audits
  _, results = read(out)
  for i, r in enumerate(results, start=1):
    run = os.path.join(out, "rows", r["key"], "train")
    if (r.get("audit") or {}).get("format") == audits.FORMAT:
      log(f"[{i}/{len(results)}] {r['label']}: audited before")
      continue
    start = time.perf_counter()
    try:
      audits.audit_run(run, canaries, mia_samples, seed)
    except ValueError as e:  # this row's: the others are still audited
      print(f"{r['label']}: not audited: {e}", file=sys.stderr, flush=True)
      continue
    log(f"[{i}/{len(results)}] {r['label']}: audited in "
        f"{time.perf_counter() - start:.0f} s")


def run_row(row: Row, grid: Grid, out: str, progress: bool = True,
            jobs: int = 1, federations: Optional[dict] = None
            ) -> dict[str, Any]:
  """Trains `row` (on its clients among `federations`, a 'client_data'
  grid's, `grid.with_client_data`), attacks its captured round, writes and
  returns row.json; `jobs` is how many rows train at once (recorded beside
  the timings)."""
  folder = os.path.join(out, "rows", row.key)
  _claim_row(row, folder)
  attacks = grid.attacks
  capture = attacks["capture_round"]
  config, federation = _on_clients(
      row, row.run_config(os.path.join(folder, "train"), capture), federations)
  history = runner.run(config, progress=progress, federation=federation)
  updates = os.path.join(config.out, "updates")
  victims = UpdateStore(updates).clients(capture)[:attacks["victims"]]
  inversion = {name: _inversion(updates, capture, victims, name, attacks,
                                os.path.join(folder, name), config.seed, progress)
               for name in row.inversion}
  attribute = (None if attacks["attribute"] is None else
               _attribute(updates, capture, attacks, os.path.join(folder, "attributes"),
                          config.seed))
  result = {"entry": row.entry, "label": row.label, "key": row.key,
            "is_default": row.is_default, "settings": row.settings(),
            **utility(history), "privacy": privacy(history[-1]),
            "seconds_per_round": seconds_per_round(history, capture),
            **upload_sizes(updates, capture, row.defense, row.defense_kwargs),
            "concurrent_rows": jobs, "inversion": inversion, "attribute": attribute}
  # the code of its run and attacks, which may be reused from before
  result[provenance.KEY] = provenance.merged(
      *provenance.recorded(folder).values(), [provenance.code_version()])
  io.write_json(os.path.join(folder, ROW_FILE), result)
  for name, why in failures(result).items():
    print(f"{row.label}, {name}: failed, run again by the next run: {why}",
          file=sys.stderr, flush=True)
  return _with_audit(result, folder)


def _on_clients(row: Row, config: runner.RunConfig, federations: Optional[dict]
                ) -> tuple[runner.RunConfig, Optional[data.FederatedData]]:
  """`config` and the clients `row` reads from `federations` (None: those
  of the config's partition); the config then names their SHA-256, which
  the row's data options may change (normalised samples)."""
  if federations is None:
    return config, None
  federation = federations[grids.data_key(row)]
  return dataclasses.replace(config, split_sha256=federation.sha256()), federation


def _other_clients(row: Row, out: str, digests: dict[str, str]) -> Optional[str]:
  """Why the run in `row`'s folder must not be reused: its config.json
  names other clients than the SHA-256 of the row's ClientData clients
  (`digests`, by `grids.data_key`: rows from before each row read them
  with its own data options, e.g. normalised); None where it names the
  same, there is no run, or no ClientData."""
  path = os.path.join(out, "rows", row.key, "train", "config.json")
  if not digests or not os.path.exists(path):
    return None
  trained = io.read_json(path).get("split_sha256")
  now = digests[grids.data_key(row)]
  if trained == now:
    return None
  return (f"its run trained on other clients (split_sha256 {str(trained)[:12]}; "
          f"its data options read {now[:12]})")


def _claim_row(row: Row, folder: str) -> None:
  """Empties a row's folder made with other settings (its run and attacks
  would be refused or stale), then records the row's settings there."""
  path = os.path.join(folder, SETTINGS_FILE)
  if os.path.isdir(folder) and (not os.path.exists(path)
                                or io.read_json(path) != row.settings()):
    shutil.rmtree(folder)
  os.makedirs(folder, exist_ok=True)
  io.write_json(path, row.settings())


def utility(history: list[dict]) -> dict[str, Any]:
  """The last round's utility: the global model's test accuracy and loss,
  with how many test samples it scored, or, for a method without one, the
  clients' own models' mean, with each tested client's accuracy
  (`utility_by_client`; None for a run made before they were kept): what
  the utility's interval is computed over.

  Raises:
    ValueError: a method without a global model whose last round has no
      personalised accuracy: its clients have no test samples, so that
      none of their models was tested, or its task measures no accuracy.
  """
  last = history[-1]
  if "test_accuracy" in last:
    return {"utility": last["test_accuracy"], "loss": last["test_loss"],
            "utility_kind": GLOBAL_UTILITY, "samples_tested": last.get("samples_tested")}
  if "personal_accuracy_mean" not in last:
    raise ValueError(
        f"round {last['round']} has no personalised accuracy "
        "(personal_accuracy_mean): a method without a global model is "
        "tested on its clients' own test samples, by a classification "
        f"task's accuracy ({last.get('clients_without_test_data')} of its "
        "clients have no test samples); give the clients test samples")
  return {"utility": last["personal_accuracy_mean"],
          "loss": last.get("personal_loss_mean"),
          "utility_kind": "personalised accuracy",
          "utility_by_client": last.get("personal_accuracy_by_client")}


def privacy(last: dict) -> Optional[dict[str, Any]]:
  """(epsilon, delta) spent by the whole run and its neighbouring relation,
  or None for a method without a formal guarantee."""
  if "epsilon" not in last:
    return None
  return {"epsilon": last["epsilon"], "delta": last.get("delta"),
          "relation": last.get("dp_relation")}


def seconds_per_round(history: list[dict], capture: int) -> float:
  """Mean wall time of a round, leaving out the first (tracing) and the
  captured one (it also writes the uploads), unless nothing else is left."""
  plain = [m["seconds"] for m in history if m["round"] not in (1, capture)]
  return float(np.mean(plain or [m["seconds"] for m in history]))


def upload_sizes(updates: str, round_num: int, defense: Optional[str],
                 defense_kwargs: dict) -> dict[str, int]:
  """Bytes one client uploads, from round `round_num`'s first captured
  upload (read once): 'upload_bytes', its tensors as stored (dense
  float32), and 'upload_bytes_encoded', in the own encoding of its
  client-side `defense` (`tff_privacy.defenses.encoded_bytes`: sparse
  indices and values, quantised codes; dense float32 without one)."""
  upload = _first_upload(updates, round_num)
  dense = int(sum(u.nbytes for u in upload))
  encoded = defenses.encoded_bytes(defense, defense_kwargs, upload)
  return {"upload_bytes": dense,
          "upload_bytes_encoded": dense if encoded is None else int(encoded)}


def _first_upload(updates: str, round_num: int) -> list[np.ndarray]:
  """The captured upload of round `round_num`'s first client."""
  store = UpdateStore(updates)
  record = store.read(round_num, store.clients(round_num)[0])
  return [np.asarray(u) for u in record.upload]


def _inversion(updates: str, round_num: int, victims: list[int], name: str,
               attacks: dict, out: str, seed: int, progress: bool) -> dict[str, Any]:
  path = os.path.join(out, "attack.json")
  if not os.path.exists(path):
    try:
      evaluate.attack_round(updates, round_num, out, name, clients=victims,
                            attack_kwargs=attack_settings(
                                name, attacks, _examples(updates, round_num, victims)),
                            seed=seed, progress=progress)
    except Exception as e:  # noqa: BLE001 -- recorded, see `_failed`
      return _failed(e)
  result = io.read_json(path)
  return {"ssim": result["mean"]["ssim"], "psnr": result["mean"]["psnr"],
          "mse": result["mean"]["mse"], "victims": per_victim(result["samples"]),
          "ssim_by_iterations": ssim_by_iterations(result["samples"]),
          "label_accuracy": result["mean"]["label_accuracy"],
          "seconds": result["seconds"], "value_range": result["value_range"],
          # relative to the leaderboard's folder (OUT/rows/KEY/ATTACK)
          "folder": os.path.relpath(out, os.path.dirname(os.path.dirname(
              os.path.dirname(out))))}


def attack_settings(name: str, attacks: dict, examples: list[int]) -> dict[str, Any]:
  """Attack `name`'s parameters in a row whose victims' uploads stand for
  `examples` samples each: the grid's iterations (none for 'source': the
  attack's own default, its source's count), and, for an attack that
  batches its searches (`group_size`), every victim in one group where
  each upload stands for one sample. A group searches each victim as
  alone (to float rounding); on 2 cores it took 0.6x the time of one at a
  time for 15 single-image uploads, but 1.4x for 15 uploads of 20 images
  each (a local epoch's), whose searches are large enough already."""
  settings = ({} if attacks["iterations"] == grids.SOURCE_ITERATIONS
              else {"iterations": attacks["iterations"]})
  if ("group_size" in inversion_attacks.attack_class(name).PARAMETERS
      and set(examples) == {1}):
    settings["group_size"] = len(examples)
  return settings


def _examples(updates: str, round_num: int, victims: list[int]) -> list[int]:
  """How many samples each victim's upload of `round_num` stands for."""
  store = UpdateStore(updates)
  return [store.read(round_num, c).num_examples for c in victims]


def per_victim(samples: list[dict]) -> dict[str, list]:
  """{'clients': the victims in order, 'ssim' and 'psnr': each one's mean
  over its reconstructed samples}, from an attack result's samples."""
  clients = list(dict.fromkeys(s["client"] for s in samples))
  return {"clients": clients, **{
      metric: [float(np.mean([s[metric] for s in samples if s["client"] == c]))
               for c in clients] for metric in ("ssim", "psnr")}}


def ssim_by_iterations(samples: list[dict]) -> Optional[dict[str, float]]:
  """{iterations: the mean SSIM over the samples of what the attack had
  found after so many}, from an attack result's samples; None for a result
  that kept no snapshots."""
  if not samples or "ssim_by_iterations" not in samples[0]:
    return None
  return {k: float(np.mean([s["ssim_by_iterations"][k] for s in samples]))
          for k in samples[0]["ssim_by_iterations"]}


def _attribute(updates: str, round_num: int, attacks: dict, out: str,
               seed: int) -> dict[str, Any]:
  path = os.path.join(out, evaluate.attributes_file(round_num, attacks["attribute"]))
  try:
    result = io.read_json(path) if os.path.exists(path) else (
        evaluate.infer_attributes_round(
            updates, round_num, attacks["attribute"], out=out,
            adversaries=attacks["adversaries"],
            shadow_samples=attacks["shadow_samples"], seed=seed))
  except Exception as e:  # noqa: BLE001 -- recorded, see `_failed`
    return _failed(e)
  return {"attribute": attacks["attribute"], "asr": result["asr"],
          "balanced_asr": result["balanced_asr"], "asr_ci": result.get("asr_ci"),
          "balanced_asr_ci": result.get("balanced_asr_ci"), "chance": result["chance"],
          "balanced_chance": result["balanced_chance"], "victims": result["victims"],
          # None in a result made before they were kept
          "truth": result.get("truth"), "guesses": result.get("guesses")}


def _failed(error: Exception) -> dict[str, Any]:
  """An attack's cell for `error`: a refusal is final, any other failure
  is retried."""
  if isinstance(error, UploadRefused):
    return {"error": _one_line(error), "refused": True}
  return {"error": _one_line(error)}


def _one_line(error: Exception) -> str:
  """A refusal's own message; another failure's type too."""
  text = (str(error).splitlines() or [""])[0]
  return text if isinstance(error, ValueError) else f"{type(error).__name__}: {text}"
