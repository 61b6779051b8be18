"""One LFW client's round with RECUP-FL and with DP (Gaussian), RECUP-FL's
Table 1, and each defence alone, measured in this process.

Table 1 times a client's whole round on LFW, Algorithm 1 lines 10-25 (local
training, then the perturbation), on an Nvidia A100: 72.2 ms with RECUP-FL,
5.92 ms with DP (Gaussian). Here a client is the paper's default one (Sec.
5.1: one sample; its local training, batch 1 and one epoch, is that
sample's gradient, the FedSGD upload) on RECUP-FL's LFW CNN (`recupfl_lfw`,
Appendix Table 2) at its initial weights. LFW cannot be downloaded here:
every client's face is a random 62 x 47 RGB image in [0, 1], the shape the
model reads (the time does not depend on the pixels). Timed per client:

* the round with RECUP-FL: local training, then the perturbation protecting
  race (3 classes) with P 10, Q 5 and budget `--epsilon` against a zoo of 20
  three-layer networks of the paper's widths (128 to 2,048) on the upload
  max-pooled to 1,024 entries, the zoo read from its files at every call as
  the library's client work reads it;
* the round with DP (Gaussian): local training, then clipping to B 1e-3 and
  noise of sigma 1e-3 (Sec. 5.5's ranges on LFW);
* local training alone, the perturbation alone and DP (Gaussian) alone, the
  defences on the client's clean upload.

The zoo's weights are random, drawn as scikit-learn initialises its MLPs
(untrained: the time of a perturbation does not depend on them), with the
standardisation fitted to the pooled uploads of 32 random faces, which keeps
the defenders' logits moderate. Every timed client's perturbation must move
its upload (else the script fails: its steps would move nothing), and the
largest share of a client's FGSM steps whose gradient was zero is printed
(`zero_gradient_steps`).

Each step is a `tf.function` (graph mode, as TFF runs client work), traced
and run once before timing; a client's time is the median of `--repeats`
calls, the steps interleaved call by call so that they share the machine's
load alike. Printed: the median over `--clients` clients and their range,
ratios to DP (Gaussian) measured here, each step's peak resident memory over
the memory before one call (Linux's peak, reset before it, with the heap's
free memory returned to the system first so that reused memory counts) and
this process's peak. The paper's times are a reference only: other hardware.

  python benchmarks/recupfl_client_time.py [--clients 3] [--repeats 3]
      [--epsilon 1e-3]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the CUDA plugin lines

import argparse
import ctypes
import math
import resource
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf

from tff_privacy import models, runtime
from tff_privacy.algorithms import fedsgd
from tff_privacy.attacks import attribute, functional
from tff_privacy.cli import _positive_int
from tff_privacy.defenses import defender_zoo, recupfl
from tff_privacy.defenses.updates import LocalGaussian

IMAGE_SHAPE = (62, 47, 3)
RACE_CLASSES = ("asian", "white", "black")
POOL_LENGTH = 1024
ITERATIONS, SAMPLED = 10, 5
SHADOW_IMAGES = 32
DP_CLIP, DP_SIGMA = 1e-3, 1e-3
# FedSGD at batch 1: a one-sample client uploads its sample's gradient (the
# server's learning rate, 0.01 as on Adult and CelebA, is not the client's)
PROTOCOL = fedsgd.protocol(0.01, 1)
PAPER_MS = {"recupfl": 72.2, "dp_gaussian": 5.92}  # Table 1, Nvidia A100
STEPS = {"training": "local training alone",
         "dp_gaussian_round": "round with DP (Gaussian)",
         "recupfl_round": "round with RECUP-FL",
         "dp_gaussian": "DP (Gaussian) alone",
         "recupfl": "RECUP-FL's perturbation alone"}


def lfw_spec() -> models.ModelSpec:
  """RECUP-FL's LFW CNN on 62 x 47 RGB faces, smiling or not."""
  return models.ModelSpec("recupfl_lfw", IMAGE_SHAPE, 2)


def random_zoo(pooled: np.ndarray, seed: int = 0) -> defender_zoo.DefenderZoo:
  """A race zoo of the paper's 20 widths (`defender_zoo.ZOO_WIDTHS`) with
  weights drawn as scikit-learn initialises an MLP (uniform in +-sqrt(6 /
  (fan_in + fan_out))), standardising features as fitted to `pooled`
  [N, POOL_LENGTH] (a constant feature scaled by 1)."""
  rng = np.random.default_rng(seed)
  scale = pooled.std(0)
  nets = []
  for h1, h2 in defender_zoo.ZOO_WIDTHS:
    arrays = []
    for fan_in, fan_out in ((POOL_LENGTH, h1), (h1, h2), (h2, len(RACE_CLASSES))):
      bound = np.sqrt(6 / (fan_in + fan_out))
      arrays += [rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32),
                 rng.uniform(-bound, bound, fan_out).astype(np.float32)]
    nets.append(tuple(arrays))
  return defender_zoo.DefenderZoo(
      "race", RACE_CLASSES, pooled.mean(0).astype(np.float32),
      np.where(scale > 0, scale, 1).astype(np.float32), tuple(nets))


def client_steps(spec: models.ModelSpec, broadcast, zoo_folder: str,
                 epsilon: float) -> dict:
  """`STEPS` as `tf.function`s: the training and the rounds of a client
  (x [1, 62, 47, 3], y [1], race, seed), the defences alone of (clean
  upload, race, seed). Each returns the upload, RECUP-FL's steps with the
  share of their FGSM steps whose gradient was zero; every call of them
  reads the zoo from `zoo_folder`."""
  model, weights = spec.keras(), [tf.constant(w) for w in broadcast]
  gaussian = LocalGaussian(DP_CLIP, DP_SIGMA / DP_CLIP)
  upload_spec = [tf.TensorSpec(w.shape, tf.float32) for w in broadcast]
  client_spec = (tf.TensorSpec((1,) + IMAGE_SHAPE, tf.float32),
                 tf.TensorSpec([1], tf.int32))
  defense_spec = (tf.TensorSpec([], tf.int32), tf.TensorSpec([2], tf.int64))

  def train(x, y):
    return functional.simulate_upload(
        model, weights, x, tf.one_hot(y, spec.num_classes), "gradient",
        PROTOCOL, task=spec.task_object)

  def dp_gaussian(upload, race, seed):
    del race
    return gaussian.apply(upload, seed)

  def perturb(upload, race, seed):
    zoo = defender_zoo.load_zoo(zoo_folder, in_graph=True)
    return recupfl.measured_upload(
        upload, [(race, defender_zoo.defenders(zoo), 1.0, seed)], epsilon=epsilon,
        pool_length=POOL_LENGTH, iterations=ITERATIONS, sampled=SAMPLED)

  def client_round(defend):
    def run(x, y, race, seed):
      return defend(train(x, y), race, seed)
    return tf.function(run, input_signature=client_spec + defense_spec)

  def alone(defend):
    return tf.function(defend, input_signature=(upload_spec,) + defense_spec)

  return {"training": tf.function(train, input_signature=client_spec),
          "dp_gaussian_round": client_round(dp_gaussian),
          "recupfl_round": client_round(perturb),
          "dp_gaussian": alone(dp_gaussian), "recupfl": alone(perturb)}


def clients(count: int, seed: int = 1) -> list[tuple]:
  """(x, y, race, seed) of `count` clients of one random image each."""
  rng = np.random.default_rng(seed)
  return [(tf.constant(rng.uniform(0, 1, (1,) + IMAGE_SHAPE), tf.float32),
           tf.constant(rng.integers(0, 2, 1), tf.int32),
           tf.constant(rng.integers(0, len(RACE_CLASSES)), tf.int32),
           tf.constant([seed, k], tf.int64)) for k in range(count)]


def step_inputs(steps: dict, group: list[tuple]) -> dict:
  """{step: [its arguments per client]}: training takes (x, y), the rounds
  the whole client, the defences alone its clean upload, race and seed."""
  uploads = [steps["training"](*c[:2]) for c in group]
  return {name: [c[:2] if name == "training" else
                 (u,) + c[2:] if name in ("dp_gaussian", "recupfl") else c
                 for c, u in zip(group, uploads)] for name in steps}


def timed(steps: dict, inputs: dict, repeats: int) -> tuple[dict, dict]:
  """For `inputs` {step: [its arguments per client]}: {step: [median ms of
  `repeats` calls, per client]} and {step: [its last result, per client]},
  the steps interleaved call by call."""
  times = {name: [[] for _ in args] for name, args in inputs.items()}
  results = {name: [None] * len(args) for name, args in inputs.items()}
  for _ in range(repeats):
    for name, fn in steps.items():
      for k, args in enumerate(inputs[name]):
        start = time.perf_counter()
        results[name][k] = fn(*args)
        times[name][k].append(time.perf_counter() - start)
  return ({name: [1000 * statistics.median(t) for t in per_client]
           for name, per_client in times.items()}, results)


def resident_mib(field: str) -> float:
  """This process's VmRSS (resident memory) or VmHWM (its peak since the
  last reset), MiB, as Linux reports them."""
  with open("/proc/self/status") as f:
    line = next(line for line in f if line.startswith(field + ":"))
  return int(line.split()[1]) / 2**10


def memory_added(fn, args: tuple) -> tuple[float, float]:
  """(resident MiB before, MiB more at the peak) of one call `fn(*args)`.
  The heap's free memory is first returned to the system (`malloc_trim`),
  so that memory the call reuses counts again, and Linux's peak is reset to
  the current resident memory."""
  ctypes.CDLL("libc.so.6").malloc_trim(0)
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM
  before = resident_mib("VmRSS")
  fn(*args)
  return before, resident_mib("VmHWM") - before


def moved_entries(clean, perturbed) -> int:
  """Entries of upload `perturbed` that differ from `clean`."""
  return int(np.count_nonzero(np.concatenate([np.ravel(p) != np.ravel(c)
                                              for c, p in zip(clean, perturbed)])))


def shadow_uploads(spec: models.ModelSpec, broadcast) -> np.ndarray:
  """Pooled uploads [SHADOW_IMAGES, POOL_LENGTH] of one-image clients of
  random faces, which the zoo's standardisation is fitted to."""
  rng = np.random.default_rng(0)
  x = rng.uniform(0, 1, (SHADOW_IMAGES,) + IMAGE_SHAPE).astype(np.float32)
  return attribute.shadow_features(spec, broadcast, x, rng.integers(0, 2, SHADOW_IMAGES),
                                   "gradient", PROTOCOL, length=POOL_LENGTH)


def measure(clients_count: int, repeats: int, epsilon: float) -> dict:
  """The measurements `report` prints (see the module)."""
  spec = lfw_spec()
  broadcast = spec.initial_weights(0)
  zoo = random_zoo(shadow_uploads(spec, broadcast))
  with tempfile.TemporaryDirectory() as tmp:
    folder = os.path.join(tmp, "zoo")
    defender_zoo.save_zoo(zoo, folder)
    steps = client_steps(spec, broadcast, folder, epsilon)
    inputs = step_inputs(steps, clients(clients_count))
    for name, fn in steps.items():
      fn(*inputs[name][0])  # traces
    ms, results = timed(steps, inputs, repeats)
    memory = {name: memory_added(fn, inputs[name][0]) for name, fn in steps.items()}
  recupfl_steps = ("recupfl_round", "recupfl")
  clean = [args[0] for args in inputs["recupfl"]]
  return {"ms": ms, "memory": memory, "zoo_mib": zoo.size_bytes() / 2**20,
          "weights": sum(w.size for w in broadcast),
          "moved": [moved_entries(c, r[0]) for name in recupfl_steps
                    for c, r in zip(clean, results[name])],
          "zero_steps": max(float(r[1]) for name in recupfl_steps
                            for r in results[name])}


def report(m: dict, args) -> None:
  """Prints the measurements `m` of `measure`."""
  print(f"clients={args.clients} repeats={args.repeats} epsilon={args.epsilon:g}: "
        f"recupfl_lfw ({m['weights']} weights) at its initial weights, one random "
        f"62x47x3 image per client; race zoo of {len(defender_zoo.ZOO_WIDTHS)} "
        f"random models on {POOL_LENGTH} pooled entries, {m['zoo_mib']:.1f} MiB, "
        "read from its files at every call")
  ms = m["ms"]
  median = {name: statistics.median(per_client) for name, per_client in ms.items()}
  for name, label in STEPS.items():
    before, added = m["memory"][name]
    print(f"{label}: {median[name]:.2f} ms per client (clients {min(ms[name]):.2f} "
          f"to {max(ms[name]):.2f}), peak resident memory +{added:.0f} MiB over "
          f"{before:.0f} MiB")
  print(f"ratio_recupfl_round_over_dp_gaussian_round="
        f"{median['recupfl_round'] / median['dp_gaussian_round']:.2f}")
  print(f"ratio_recupfl_over_dp_gaussian={median['recupfl'] / median['dp_gaussian']:.2f}")
  print(f"this process's peak resident memory: "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 2**10} MiB")
  print(f"RECUP-FL moved {min(m['moved'])} to {max(m['moved'])} entries of a "
        f"client's upload; zero_gradient_steps={m['zero_steps']:.3f} (the largest "
        f"share of a client's {ITERATIONS * SAMPLED} FGSM steps)")
  print(f"the paper's Table 1, a reference only (an Nvidia A100, not this "
        f"machine): RECUP-FL {PAPER_MS['recupfl']} ms and DP (Gaussian) "
        f"{PAPER_MS['dp_gaussian']} ms per client round")
  print(f"recupfl_round_ms_per_client={median['recupfl_round']:.2f}")
  print(f"recupfl_ms_per_client={median['recupfl']:.2f}")


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--clients", type=_positive_int, default=3)
  parser.add_argument("--repeats", type=_positive_int, default=3,
                      help="timed calls per client and step, the median kept")
  parser.add_argument("--epsilon", type=float, default=1e-3,
                      help="RECUP-FL's perturbation budget (Sec. 5.3 on LFW: "
                      "5e-5 to 0.5)")
  args = parser.parse_args()
  if not 0 < args.epsilon < math.inf:
    parser.error(f"--epsilon must be a finite number > 0, got {args.epsilon}")
  measured = measure(args.clients, args.repeats, args.epsilon)
  if min(measured["moved"]) == 0:
    raise SystemExit(f"--epsilon {args.epsilon:g}: RECUP-FL left a client's "
                     "upload unchanged (every step's gradient vanished), so its "
                     "times are of steps that move nothing")
  report(measured, args)


if __name__ == "__main__":
  main()
