"""Wall time of one FedRE round relative to one FedAvg round on the same
clients, each method in a process of its own, with its peak memory.

Settings (`--setting`):
* docs: the documents' protocol (`tff-privacy train --dataset docs`: 10
  clients of one document format each, the U-Net, Adam at 0.005, 2 local
  epochs, batch 16, FedRE's PSI on 16 of the region's pixels);
  `--data-kwargs '{"num": 16000}'` gives its clients 1,280 documents
  each on average, as in the FedRE paper page's epsilon-10 run, instead
  of 64: FedRE's PSI costs the same per client whatever the client holds
  (10 samples of its own and 10 public ones a round), its training
  grows with the client's data;
* digits: the compact leaderboard's FedRE and FedAvg rows (`make demo`:
  mnist5k_parity, the MLP, 16 one-sample-batch clients a round, FedRE's
  PSI on 2 samples of 8 pixels and PDA-PAM on 2 public samples).
FedRE runs at `--epsilon` (default 50) with its other defaults, or those
of `--fedre-kwargs` (a JSON object of FedRE's parameters, e.g.
'{"budget_split": "even"}' to time it without the clients' PSI scores).

Each method's process builds its TFF process, runs one compiling round,
then `--rounds` timed rounds on round 1's clients, with no capture and no
evaluation. The whole process tree (the driver and its TFF worker) is
sampled every 0.5 s for its resident memory and killed above `--limit-mb`.

What the paper's PSI alone costs bounds the ratio from below: each
FedRE client scores `psi_samples` of its samples and PDA-PAM scores its
upload on `public_samples` public ones, every round, whatever the client
holds. The benchmark times those scores alone in its own process (client
0's, on the run's model, region and public set, at `psi_pixels`, as one
compiled function after a first call) and prints them times the round's
clients as a share of FedAvg's round (`psi_s_per_round`; n/a for a FedRE
that scores nothing, e.g. '{"budget_split": "even", "aggregation":
"mean"}'): an estimate of how far above FedAvg's round FedRE's stays
while it scores the same (timed apart, against the repeats' median FedAvg
round, which moves from run to run).

The benchmark also counts the floating point operations of client 0's
training (its batches' forward and backward passes) and of its PSI
scores, as `psi_scores` computes them and as forward-over-reverse
differentiation with dense tangents needs at least (one forward and
backward pass per JVP), and prints both as multiples of the training's
(`round_flops`: `psi_flops_over_training`, `psi_dense_over_training`):
the work PSI adds to FedAvg's client work whatever the overheads, for
any implementation of that kind.

The two processes alternate `--repeats` times (FedAvg, FedRE, FedAvg,
...): on these 2-core machines one process's rounds can run 30% slower
than the next one's, so a single pair can mis-state the ratio. Each
repeat prints its medians and ratio; the summary gives the median ratio
over the repeats with their smallest and largest, then
`ratio_fedre_over_fedavg=` (that median) and `peak_rss_mb_<method>=`
(the largest over the repeats).

  python benchmarks/fedre_round_time.py [--setting docs|digits] [--rounds 3]
      [--repeats 3] [--epsilon 50] [--fedre-kwargs JSON]
      [--data-kwargs JSON] [--limit-mb 12000]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import collections
import dataclasses
import inspect
import json
import math
import statistics
import time
from typing import Optional

import numpy as np
import tensorflow as tf

import round_timing  # this folder's
from tff_privacy import psi, runner, runtime
from tff_privacy.algorithms import fedre
from tff_privacy.cli import _epsilon_target, _positive_int
from tff_privacy.leaderboard import defaults, grid as grids
from tff_privacy.models.functional import forward
from tff_privacy.runs.clients import local_batches

SETTINGS = ("docs", "digits")
METHODS = ("fedavg", "fedre")
_COMPACT_ROWS = {"fedavg": "FedAvg", "fedre": "FedRE"}


def _epsilon(text: str) -> float:
  if text == "none":  # a target of the library's commands, not a budget
    raise argparse.ArgumentTypeError(f"takes a finite epsilon > 0, got {text!r}")
  return _epsilon_target(text)


def _json_object(text: str) -> dict:
  try:
    value = json.loads(text)
  except json.JSONDecodeError:
    value = None
  if not isinstance(value, dict):
    raise argparse.ArgumentTypeError(f"takes a JSON object, got {text!r}")
  return value


def _object(text: str) -> dict:
  value = _json_object(text)
  if "epsilon" in value:
    raise argparse.ArgumentTypeError(
        f"takes a JSON object of FedRE's parameters but epsilon, got {text!r}")
  return value


def config(setting: str, method: str, out: str, fedre_kwargs: dict,
           data_kwargs: dict) -> runner.RunConfig:
  """The run of `method` in `setting`, writing to `out`, capturing
  nothing; FedRE with `fedre_kwargs`; the documents with `data_kwargs`
  beside the protocol's."""
  fedre_kwargs = fedre_kwargs if method == "fedre" else {}
  if setting == "docs":
    return runner.RunConfig(**runner.with_protocol(
        {"out": out, "method": method, "dataset": "docs", "model": "unet",
         "seed": 0, "method_kwargs": fedre_kwargs, "data_kwargs": data_kwargs}))
  compact = grids.parse(defaults.grid("compact"))
  row = next(r for r in compact.rows() if r.entry == _COMPACT_ROWS[method])
  made = row.run_config(out, capture_round=1)
  return dataclasses.replace(made, capture_rounds=(), method_kwargs={
      **made.method_kwargs, **fedre_kwargs})


@dataclasses.dataclass
class Scoring:
  """What client 0 of the run scores each round: its own `psi_samples`
  under its region (`own`, where its budget is split by PSI) and, where the
  run aggregates by PDA-PAM, its upload on the public set (`public`), at
  `pixels` region pixels a sample (None: all); with the run's model."""
  run: runner.Run
  own: bool
  public: Optional[fedre.PublicRegions]
  mask: np.ndarray
  samples: int
  pixels: Optional[int]
  groups: Optional[list]


def scoring(run_config: runner.RunConfig) -> Optional[Scoring]:
  """The run's `Scoring`; None where it scores nothing."""
  run = runner.Run(run_config)
  mechanism = run.algorithm.audited_mechanism
  settings = {**{p.name: p.default for p in fedre.PARAMETERS},
              **run.config.method_kwargs}
  own = mechanism is not None and mechanism.budget_split == "psi"
  public = None
  masks = [run.algorithm.client_inputs(c, 1)[fedre.MASK_KEY] > 0.5
           for c in range(len(run.federation.client_sizes))]
  if run.algorithm.protocol.get("aggregation") == "pda_pam":
    public = fedre.public_regions(run.federation, settings["regions"], masks,
                                  settings["public_samples"])[0]
  if not own and public is None:
    return None
  groups = (psi.layer_groups(run.spec.keras()) if settings["budget_unit"] == "layer"
            else None)
  return Scoring(run, own, public, masks[0], settings["psi_samples"],
                 settings["psi_pixels"], groups)


def psi_seconds(run_config: runner.RunConfig, repeats: int = 5
                ) -> Optional[float]:
  """Median seconds of client 0's PSI scores in a round of the run
  `run_config` (`scoring`), on random inputs of the run's shape (the
  scores' cost does not depend on the values); None where the run scores
  nothing."""
  scored = scoring(run_config)
  if scored is None:
    return None
  spec = scored.run.spec
  model = spec.keras()
  weights = [tf.constant(w) for w in spec.initial_weights(0)]

  def scores(x, y, masks, groups):
    return psi.psi_scores(model, weights, x, y, masks, spec.task_object.loss,
                          pixels=scored.pixels, groups=groups).scores

  def client_work():
    out = []
    if scored.own:
      n = scored.samples
      x = tf.random.stateless_uniform((n, *spec.input_shape), (0, 1))
      y = tf.zeros((n, *spec.task_object.label_shape(spec.input_shape)), tf.int32)
      out.append(scores(x, y, tf.constant(scored.mask[None].repeat(n, 0)),
                        scored.groups))
    if scored.public is not None:  # PDA-PAM scores every tensor
      public = scored.public
      out.append(scores(public.x, public.y, public.masks, None))
    return out

  compiled = tf.function(client_work)
  compiled()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    compiled()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def round_flops(run_config: runner.RunConfig) -> tuple[int, int, int]:
  """(training, PSI, PSI dense) floating point operations of client 0's
  round in the run `run_config`, by the counts TensorFlow registers
  (`round_timing.graph_flops`):
  * its batches' forward and backward passes;
  * its PSI scores (`scoring`; 0 where it scores nothing) as `psi_scores`
    computes them: per chunk of JVPs through the gradient, once what does
    not depend on the tangent (the sample's forward and backward pass) and
    per JVP, padding included, what does (`psi.pixel_jvp_squares`);
  * one forward and backward pass of the sample per JVP (padding
    excluded): what forward-over-reverse differentiation with dense
    tangents needs at least, whose every op depends on the tangent. An
    implementation that used the one-hot tangents' sparsity (a pixel
    reaches few of the first layers' outputs) could need less.
  Part of the PSI scored is the server's (PDA-PAM's scores of the client's
  upload), placed beside the uploads. The training counted is FedAvg's
  local update, as FedRE's noise_on='update' runs it."""
  scored = scoring(run_config)
  run = scored.run if scored else runner.Run(run_config)
  spec = run.spec
  model = spec.keras()
  weights = [tf.TensorSpec(v.shape) for v in model.trainable_variables]
  label = spec.task_object.label_shape(spec.input_shape)

  def step(w, x, y):
    with tf.GradientTape() as tape:
      tape.watch(w)
      loss = spec.task_object.loss(forward(model, w, x), y)
    return tape.gradient(loss, w)

  def step_flops(batch: int) -> int:
    return round_timing.graph_flops(
        step, weights, tf.TensorSpec((batch, *spec.input_shape)),
        tf.TensorSpec((batch, *label), tf.int32))

  sizes = local_batches(len(run.fed.client_indices[0]), run.algorithm, run.config)
  training = sum(count * step_flops(b) for b, count in collections.Counter(sizes).items())
  if scored is None:
    return training, 0, 0

  def one_jvp(w, x1, y1, triple):
    return psi.pixel_jvp_squares(model, w, x1, y1, triple, spec.task_object.loss)

  jvp_specs = (weights, tf.TensorSpec(spec.input_shape), tf.TensorSpec(label, tf.int32),
               tf.TensorSpec([3], tf.int32))
  per_jvp = round_timing.graph_flops(one_jvp, *jvp_specs, depending_on=3)
  per_chunk = round_timing.graph_flops(one_jvp, *jvp_specs) - per_jvp
  primal = step_flops(1)
  height, width, channels = spec.input_shape
  most = (height * width if scored.pixels is None else scored.pixels) * channels
  chunk = min(inspect.signature(psi.psi_scores).parameters["chunk"].default, most)

  def jvps(mask) -> int:
    pixels = int(np.sum(mask))
    return (pixels if scored.pixels is None else min(scored.pixels, pixels)) * channels

  masks = [scored.mask] * min(scored.samples, sum(sizes)) if scored.own else []
  if scored.public is not None:
    masks += list(scored.public.masks)
  chunks = [math.ceil(jvps(m) / chunk) for m in masks]
  return (training, sum(c * (per_chunk + chunk * per_jvp) for c in chunks),
          sum(jvps(m) * primal for m in masks))


def measured(method: str, args) -> tuple[list[float], int]:
  """(seconds of each timed round, peak resident bytes of the process
  tree) of `method` in a process of its own (`round_timing`)."""
  return round_timing.measured(
      __file__, ["--time-method", method, "--setting", args.setting, "--rounds",
                 str(args.rounds), "--epsilon", str(args.epsilon),
                 "--fedre-kwargs", json.dumps(args.fedre_kwargs),
                 "--data-kwargs", json.dumps(args.data_kwargs)],
      args.limit_mb, method)


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--setting", choices=SETTINGS, default="docs")
  parser.add_argument("--rounds", type=_positive_int, default=3)
  parser.add_argument("--repeats", type=_positive_int, default=3,
                      help="alternations of the two methods' processes")
  parser.add_argument("--epsilon", type=_epsilon, default=50.0)
  parser.add_argument("--fedre-kwargs", type=_object, default={},
                      help="FedRE's parameters other than epsilon, a JSON object")
  parser.add_argument("--data-kwargs", type=_json_object, default={},
                      help="the documents' generator's arguments beside the "
                      "protocol's, a JSON object (docs only)")
  parser.add_argument("--limit-mb", type=_positive_int, default=12000,
                      help="kill a method's process tree above this resident size")
  parser.add_argument("--time-method", choices=METHODS, help=argparse.SUPPRESS)
  parser.add_argument("--times-file", help=argparse.SUPPRESS)
  args = parser.parse_args()
  fedre_kwargs = {**args.fedre_kwargs, "epsilon": args.epsilon}
  if args.time_method:
    round_timing.time_rounds(config(args.setting, args.time_method, "unused",
                                    fedre_kwargs, args.data_kwargs),
                             args.rounds, args.times_file)
    return
  if args.data_kwargs and args.setting != "docs":
    parser.error("--data-kwargs: takes the documents' arguments; --setting docs only")
  try:  # a parameter FedRE lacks: one line here, not a worker's traceback
    config(args.setting, "fedre", "unused", fedre_kwargs, args.data_kwargs)
  except ValueError as e:
    parser.error(f"--fedre-kwargs or --data-kwargs: {e}")
  print(f"setting: {args.setting}, FedRE at epsilon {args.epsilon:g}"
        + (f" with {json.dumps(args.fedre_kwargs)}" if args.fedre_kwargs else "")
        + (f", documents {json.dumps(args.data_kwargs)}" if args.data_kwargs else ""))
  ratios, fedavg_seconds, peaks = [], [], {m: 0 for m in METHODS}
  for repeat in range(1, args.repeats + 1):
    seconds = {}
    for method in METHODS:
      times, peak = measured(method, args)
      seconds[method] = statistics.median(times)
      peaks[method] = max(peaks[method], peak)
    ratios.append(seconds["fedre"] / seconds["fedavg"])
    fedavg_seconds.append(seconds["fedavg"])
    print(f"repeat {repeat}: "
          + ", ".join(f"{m}: {seconds[m]:.3f} s/round" for m in METHODS)
          + f" (medians of {args.rounds}), ratio {ratios[-1]:.2f}", flush=True)
  print(f"ratio over {args.repeats} repeats: median {statistics.median(ratios):.2f}, "
        f"from {min(ratios):.2f} to {max(ratios):.2f}")
  print(f"ratio_fedre_over_fedavg={statistics.median(ratios):.2f} "
        + " ".join(f"peak_rss_mb_{m}={peaks[m] // 2**20}" for m in METHODS))
  fedavg_median = statistics.median(fedavg_seconds)
  run_config = config(args.setting, "fedre", "unused", fedre_kwargs, args.data_kwargs)
  training, psi_flops, dense = round_flops(run_config)
  print(f"flops_per_client_round: training={training:.3g} psi={psi_flops:.3g} "
        f"psi_dense={dense:.3g} (client 0, TensorFlow's op counts)")
  print(f"psi_flops_over_training={psi_flops / training:.2f} "
        f"psi_dense_over_training={dense / training:.2f}")
  one_client = psi_seconds(run_config)
  if one_client is None:
    print("psi_s_per_round=n/a (this FedRE scores no PSI)")
    return
  clients = run_config.sampled_per_round
  scored = clients * one_client
  print(f"psi_s_per_round={scored:.3f} ({scored / fedavg_median:.2f} of FedAvg's "
        f"round; {clients} clients, their PSI scores alone)")


if __name__ == "__main__":
  main()
