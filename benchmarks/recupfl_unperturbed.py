"""How often RECUP-FL leaves an Adult client's upload unperturbed, and how
many entries its FGSM steps move per pooling window, with the paper's loss
and tie-splitting pooling against the library's defaults.

Two defects once made RECUP-FL (`tff_privacy.defenses.recupfl`) send clean
or over-perturbed uploads:
* the paper's cross-entropy loss saturates in float32 at large budgets, so
  the FGSM gradient is exactly 0 and the upload leaves unperturbed (fixed
  by attack_loss 'logit_margin', the default; 'cross_entropy' keeps the
  paper's loss);
* the max-pooling the defenders read split its gradient over every tied
  entry of a bin, as `tf.math.segment_max`'s gradient does, so that one
  FGSM step moved most of a one-record gradient's entries (mostly exact
  zeros, tied) instead of at most one per pooling window (fixed by
  `recupfl.first_maxima`, which routes it to the bin's first maximum, as
  PyTorch's max_pool1d does).
The tie-splitting pooling is no longer in the library; it lives here only,
as a reference of the old behaviour (`tie_splitting_gradient`, patched in
by `tie_splitting_pooling`), so that its effect stays measurable beside
the fix.

The setting (flags in brackets): Adult and the MLP the RECUP-FL experiments
train on it (`experiments/recupfl_tables.py`: hidden layer 50, one sigmoid
output, MSE loss) at its initial weights of --seed, the round-1 broadcast
model. A race zoo of --zoo-size defenders (the defence's widths,
`RecupFL`) trained --zoo-epochs epochs on the pooled one-record FedSGD
uploads of --shadow-samples training records (`attribute.training_sample`,
the defence's shadow records), as `RecupFL.prepare_round` trains it at
round 1. --victims one-record clients drawn as the experiments' one-record
partition draws them (seeded by --seed), each protecting its record's race
(gamma 1) in its clean FedSGD upload. For each configuration and budget
(--budgets), printed per row:
* unperturbed: the share of victims whose upload after Algorithm 1 (P
  --iterations, Q --sampled-models) equals the clean upload in every entry;
* zero_grad: the mean over victims of the share of Algorithm 1's FGSM
  steps whose gradient was zero in every entry (`measured_upload`);
* the mean (over every victim's every pooling window) and the max number of
  entries moved per pooling window after one FGSM step (fgsm 'one_step', Q
  1) and after Algorithm 1 (first-maximum pooling moves at most one entry
  per window in a step, but a window's first maximum may change between
  Algorithm 1's steps).
Configurations: the paper's loss with tie-splitting pooling (both defects),
the paper's loss with first-maximum pooling, and the defaults (logit
margin, first maximum). --out DIR writes the rows to
DIR/recupfl_unperturbed.csv and, with the settings and the wall time,
DIR/recupfl_unperturbed.json. At its defaults it ran 770 s on two busy
cores (the zoo's training and 3,600 perturbations), too long for `make
benchmark`; start it by hand:

  python benchmarks/recupfl_unperturbed.py [--victims 100] [--zoo-epochs 20]
      [--budgets 1e-5,1e-4,1e-3,1e-2,0.05,0.1] [--out DIR]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the CUDA plugin lines

import argparse
import contextlib
import dataclasses
import math
import time
from typing import Iterator, Optional, Sequence
from unittest import mock

import numpy as np
import tensorflow as tf
import tqdm

from tff_privacy import data, io, models, runtime
from tff_privacy.algorithms import fedsgd
from tff_privacy.attacks import attribute, functional
from tff_privacy.cli import _positive_int
from tff_privacy.data import partitioners
from tff_privacy.defenses import defender_zoo, recupfl

ATTRIBUTE = "race"
POOL_LENGTH = 1024
# the RECUP-FL experiments' Adult model and FedSGD server learning rate
MODEL, MODEL_KWARGS, LEARNING_RATE = "mlp", {"hidden": [50]}, 0.01
PROTOCOL = fedsgd.protocol(LEARNING_RATE, 1)
ZOO_ROUND = 1  # the zoo's seed, as `RecupFL.prepare_round` trains it at round 1
BUDGETS = (1e-5, 1e-4, 1e-3, 1e-2, 0.05, 0.1)
VARIANTS = ("one_step", "recupfl")
OUT_NAME = "recupfl_unperturbed"


@dataclasses.dataclass(frozen=True)
class Configuration:
  """A loss for the FGSM steps' signs and a pooling of the upload."""

  name: str
  label: str
  attack_loss: str
  tie_splitting: bool


CONFIGURATIONS = (
    Configuration("paper_tie_splitting", "paper loss, tie-splitting pooling",
                  "cross_entropy", True),
    Configuration("paper_first_max", "paper loss, first-max pooling",
                  "cross_entropy", False),
    Configuration("default", "default (logit margin, first max)", "logit_margin",
                  False))
COLUMNS = ("configuration", "budget", "unperturbed_share", "zero_gradient_steps",
           "one_step_moved_per_window_mean", "one_step_moved_per_window_max",
           "recupfl_moved_per_window_mean", "recupfl_moved_per_window_max")


def tie_splitting_gradient(defenders, index, x, label, attack_loss):
  """d loss(S_index(each bin's maximum), label) / dx
  (`recupfl.logit_gradient`) through `tf.reduce_max`, whose gradient splits
  each bin's share equally over every entry tied at the bin's maximum: the
  pooling RECUP-FL once had. A reference of that defect, with
  `recupfl._attack_gradient`'s arguments (x: the upload's entries by bin,
  [bins, width], `every_entry`'s) and result (every (bin, column) index,
  the gradient there)."""
  def branch(defender):
    def gradient():
      with tf.GradientTape() as tape:
        tape.watch(x)
        logits = defender(tf.reduce_max(x, axis=1)[None])
      return tape.gradient(logits, x, output_gradients=recupfl.logit_gradient(
          logits, label, attack_loss))
    return gradient

  rows, columns = tf.meshgrid(tf.range(tf.shape(x)[0]), tf.range(tf.shape(x)[1]),
                              indexing="ij")
  return (tf.reshape(tf.stack([rows, columns], -1), [-1, 2]),
          tf.reshape(tf.switch_case(index, [branch(d) for d in defenders]), [-1]))


def every_entry(flat, segments, steps):
  """`recupfl._candidates` keeping every entry of every bin: a gradient
  that reaches every tied entry may move any of them."""
  del flat, steps
  return tf.constant(recupfl._bin_table(segments, pad=len(segments))[1])


@contextlib.contextmanager
def tie_splitting_pooling() -> Iterator[None]:
  """RECUP-FL's perturbations traced within take their gradient through
  `tie_splitting_gradient` instead of each bin's first maximum."""
  with mock.patch.object(recupfl, "_attack_gradient", tie_splitting_gradient), \
       mock.patch.object(recupfl, "_candidates", every_entry):
    yield


@dataclasses.dataclass(frozen=True)
class Setting:
  """The victims (`records`, training-split indices; `labels`, their race
  classes; `clean`, their flat clean uploads [victims, weights]) and the
  zoo's `defenders`."""

  records: np.ndarray
  labels: np.ndarray
  clean: np.ndarray
  defenders: list


def adult_spec(source) -> models.ModelSpec:
  """The RECUP-FL experiments' Adult model."""
  return models.ModelSpec(MODEL, source.input_shape, source.num_classes,
                          MODEL_KWARGS, source.task)


def clean_uploads(spec: models.ModelSpec, broadcast, x: np.ndarray,
                  y: np.ndarray) -> np.ndarray:
  """Each record's one-record FedSGD upload at `broadcast`, flattened in
  the model's variable order, [records, weights]."""
  weights = [tf.constant(w) for w in broadcast]
  model, task = spec.keras(), spec.task_object
  compute = tf.function(lambda xb, yb: functional.simulate_upload(
      model, weights, xb, tf.one_hot(yb, spec.num_classes), "gradient",
      PROTOCOL, task=task))
  return np.stack([np.concatenate([np.ravel(u) for u in compute(x[k:k + 1],
                                                                  y[k:k + 1])])
                   for k in range(len(y))])


def race_zoo(spec: models.ModelSpec, broadcast, source, shadow_samples: int,
             zoo_size: int, epochs: int) -> defender_zoo.DefenderZoo:
  """The race zoo `RecupFL.prepare_round` trains at round 1 on the pooled
  uploads of `shadow_samples` training records."""
  x, y, classes = attribute.shadow_split(source, "train")
  rows = attribute.training_sample(len(y), shadow_samples)
  names = source.attributes.classes[ATTRIBUTE]
  missing = [names[c] for c in sorted(set(range(len(names)))
                                      - set(classes[ATTRIBUTE][rows]))]
  if missing:
    raise ValueError(f"--shadow-samples {shadow_samples}: the shadow records hold "
                     f"no {ATTRIBUTE} {', '.join(missing)}, which every defender "
                     "must know; give more")
  features = attribute.shadow_features(spec, broadcast, x[rows], y[rows],
                                       "gradient", PROTOCOL, length=POOL_LENGTH)
  pipelines = defender_zoo.fit_defenders(
      features, classes[ATTRIBUTE][rows], widths=recupfl._zoo_widths(zoo_size),
      epochs=epochs, seed=ZOO_ROUND, progress=f"zoo of {ATTRIBUTE}")
  return defender_zoo.zoo_from_pipelines(pipelines, ATTRIBUTE,
                                         source.attributes.classes[ATTRIBUTE])


def setting(args) -> Setting:
  """The victims and the zoo of the module's setting."""
  source = data.load_source("adult")
  spec = adult_spec(source)
  broadcast = spec.initial_weights(args.seed)
  if args.victims > len(source.y_train):
    raise ValueError(f"--victims must be at most the {len(source.y_train)} "
                     f"training records, got {args.victims}")
  records = np.concatenate(partitioners.one_per_client(source.y_train, args.victims,
                                                       args.seed))
  zoo = race_zoo(spec, broadcast, source, args.shadow_samples, args.zoo_size,
                 args.zoo_epochs)
  # eager tensors: captured by the traced perturbations, not copied into them
  zoo = dataclasses.replace(
      zoo, mean=tf.constant(zoo.mean), scale=tf.constant(zoo.scale),
      models=tuple(tuple(tf.constant(a) for a in m) for m in zoo.models))
  return Setting(records, source.attributes.train[ATTRIBUTE][records],
                 clean_uploads(spec, broadcast, source.x_train[records],
                               source.y_train[records]),
                 defender_zoo.defenders(zoo))


def perturbed_uploads(victims: Setting, config: Configuration, budget: float,
                      variant: str, args, bar: tqdm.tqdm
                      ) -> tuple[np.ndarray, np.ndarray]:
  """Each victim's upload [victims, weights] after `variant` ('one_step':
  Q 1; 'recupfl': Algorithm 1, P and Q of `args`) and the share of its FGSM
  steps whose gradient was zero [victims]; the victim's stateless seed is
  (--seed, its index)."""
  sampled = 1 if variant == "one_step" else args.sampled_models

  @tf.function
  def perturb(flat, label, seed):
    upload, zero_share = recupfl.measured_upload(
        [flat], [(label, victims.defenders, 1.0, seed)], epsilon=budget,
        pool_length=POOL_LENGTH, iterations=args.iterations, sampled=sampled,
        variant=variant, attack_loss=config.attack_loss)
    return upload[0], zero_share

  uploads, zero_shares = [], []
  with tie_splitting_pooling() if config.tie_splitting else contextlib.nullcontext():
    for k, (clean, label) in enumerate(zip(victims.clean, victims.labels)):
      upload, zero_share = perturb(tf.constant(clean), tf.constant(label, tf.int32),
                                   tf.constant([args.seed, k], tf.int64))
      uploads.append(upload.numpy())
      zero_shares.append(float(zero_share))
      bar.update()
  return np.stack(uploads), np.array(zero_shares)


def moved_per_window(clean: np.ndarray, uploads: np.ndarray) -> np.ndarray:
  """[victims, POOL_LENGTH]: the entries of each pooling window
  (`recupfl.pool_segments`) where a victim's upload differs from its clean
  one."""
  windows = recupfl.pool_segments(clean.shape[1], POOL_LENGTH)
  return np.stack([np.bincount(windows, weights=moved, minlength=POOL_LENGTH)
                   for moved in uploads != clean]).astype(int)


def summary(config: Configuration, budget: float, clean: np.ndarray,
            results: dict) -> dict:
  """One row of `COLUMNS` from `results` {variant: (uploads, zero shares)}."""
  uploads, zero_shares = results["recupfl"]
  row = {"configuration": config.name, "budget": budget,
         "unperturbed_share": float(np.mean(np.all(uploads == clean, axis=1))),
         "zero_gradient_steps": float(np.mean(zero_shares))}
  for variant in VARIANTS:
    moved = moved_per_window(clean, results[variant][0])
    row[f"{variant}_moved_per_window_mean"] = float(moved.mean())
    row[f"{variant}_moved_per_window_max"] = int(moved.max())
  return row


def measure(victims: Setting, args) -> dict:
  """{'setting': `victims`, 'uploads': {(configuration name, budget,
  variant): (uploads, zero shares)}, 'rows': one `summary` per
  configuration and budget}."""
  uploads, rows = {}, []
  total = len(CONFIGURATIONS) * len(args.budgets) * len(VARIANTS) * args.victims
  with tqdm.tqdm(total=total, desc="perturbations", unit="upload", leave=False,
                 disable=None) as bar:
    for config in CONFIGURATIONS:
      for budget in args.budgets:
        results = {v: perturbed_uploads(victims, config, budget, v, args, bar)
                   for v in VARIANTS}
        uploads.update({(config.name, budget, v): r for v, r in results.items()})
        rows.append(summary(config, budget, victims.clean, results))
  return {"setting": victims, "uploads": uploads, "rows": rows}


def table(rows: Sequence[dict]) -> str:
  """The rows as an aligned text table, one per configuration and budget."""
  labels = {c.name: c.label for c in CONFIGURATIONS}
  lines = [f"{'configuration':<36}{'budget':>8}{'unperturbed':>13}{'zero_grad':>11}"
           f"{'1 step mean':>13}{'max':>5}{'Alg. 1 mean':>13}{'max':>5}"]
  for r in rows:
    lines.append(
        f"{labels[r['configuration']]:<36}{r['budget']:>8g}"
        f"{r['unperturbed_share']:>13.3f}{r['zero_gradient_steps']:>11.3f}"
        f"{r['one_step_moved_per_window_mean']:>13.3f}"
        f"{r['one_step_moved_per_window_max']:>5d}"
        f"{r['recupfl_moved_per_window_mean']:>13.3f}"
        f"{r['recupfl_moved_per_window_max']:>5d}")
  return "\n".join(lines)


def _budgets(text: str) -> tuple[float, ...]:
  """--budgets: comma-separated finite numbers > 0."""
  try:
    values = tuple(float(v) for v in text.split(","))
  except ValueError:
    values = (math.nan,)
  if not all(0 < v < math.inf for v in values):
    raise argparse.ArgumentTypeError(
        f"takes comma-separated finite numbers > 0, got {text!r}")
  return values


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Runs the benchmark on `argv` (default: the command line), prints the
  table and the wall time, and returns `measure`'s result."""
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--victims", type=_positive_int, default=100)
  parser.add_argument("--budgets", type=_budgets, default=BUDGETS,
                      help="comma-separated perturbation budgets epsilon")
  parser.add_argument("--zoo-size", type=_positive_int, default=20,
                      help="defenders in the zoo, 2 to "
                      f"{len(defender_zoo.ZOO_WIDTHS)}")
  parser.add_argument("--zoo-epochs", type=_positive_int, default=20)
  parser.add_argument("--shadow-samples", type=_positive_int, default=1000,
                      help="training records the zoo is trained on")
  parser.add_argument("--iterations", type=_positive_int, default=10,
                      help="P of Algorithm 1")
  parser.add_argument("--sampled-models", type=_positive_int, default=5,
                      help="Q of Algorithm 1, 2 to --zoo-size")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", help="folder for the rows as CSV and JSON")
  args = parser.parse_args(argv)
  if not 2 <= args.zoo_size <= len(defender_zoo.ZOO_WIDTHS):
    parser.error(f"--zoo-size must be in [2, {len(defender_zoo.ZOO_WIDTHS)}], "
                 f"got {args.zoo_size}")
  if not 2 <= args.sampled_models <= args.zoo_size:
    parser.error(f"--sampled-models must be in [2, --zoo-size {args.zoo_size}], "
                 f"got {args.sampled_models}")
  start = time.perf_counter()
  try:
    victims = setting(args)
  except ValueError as e:  # too many victims or too few shadow records
    parser.error(str(e))
  measured = measure(victims, args)
  wall_s = time.perf_counter() - start
  print(f"victims={args.victims} zoo={args.zoo_size} defenders of {ATTRIBUTE}, "
        f"{args.zoo_epochs} epochs on {args.shadow_samples} shadow records; "
        f"P={args.iterations} Q={args.sampled_models} seed={args.seed}; entries "
        f"moved per pooling window of {POOL_LENGTH} after one FGSM step (Q=1) "
        "and after Algorithm 1")
  print(table(measured["rows"]))
  print(f"wall_s={wall_s:.1f}")
  if args.out:
    path = os.path.join(args.out, OUT_NAME)
    io.write_csv(path + ".csv", measured["rows"], COLUMNS)
    io.write_json(path + ".json", {"settings": {k: v for k, v in vars(args).items()
                                                if k != "out"},
                                   "wall_s": wall_s, "rows": measured["rows"]})
  return measured


if __name__ == "__main__":
  main()
