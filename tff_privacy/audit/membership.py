"""Membership inference on a run's final model, by tensorflow_privacy's own
attack library (`privacy_tests.membership_inference_attack`).

Members are training samples of clients that trained (sampled in some
round); non-members are test samples, which no client held. Where the
clients' data are skewed and some were never sampled, the members'
distribution differs from the test set's, and the AUC measures that shift
as well. A personalised method's run (runner.PERSONAL_MODELS, one model
per client) is attacked through each client's own model: its training
samples against its own test split, pooled over the clients that
trained. From the
model's logits on up to `samples` of each, the library's threshold
(loss), entropy-threshold, logistic-regression, MLP, random-forest and
k-NN attacks each report their AUC and attacker advantage (max |TPR -
FPR|); the largest AUC is the row's `mia_auc`, and its ROC curve is
plotted by the library.

The library ships in tensorflow-privacy up to 0.8.12 but not in the 0.9.0
wheel that tensorflow-federated 0.87 pins; `make` installs it from the
0.8.12 wheel (`tools/install_privacy_tests.py`). Where it is missing, or
the run has no final model, or its task is not classification, the result
says so instead of giving numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any, Optional

import numpy as np

from tff_privacy import io, models, runner
from tff_privacy.data import federated, sources
from tff_privacy.metrics import intervals

DEFAULT_SAMPLES = 1000
# each side, for the library's 3-fold grid searches and a usable ROC
FEWEST_SAMPLES = 20
ROC_FILE = "mia_roc.png"
MODEL_WEIGHTS = "model_weights.npz"  # the runner's final global model


def _library():
  """tensorflow_privacy's membership-inference modules, or why not."""
  try:
    from tensorflow_privacy.privacy.privacy_tests.membership_inference_attack import (
        data_structures, membership_inference_attack, plotting)
  except ImportError as e:
    return None, (f"tensorflow_privacy's membership-inference library is not "
                  f"installed ({e}); `make` installs it "
                  "(tools/install_privacy_tests.py)")
  return (data_structures, membership_inference_attack, plotting), None


def members(config: runner.RunConfig, fed: federated.FederatedData) -> np.ndarray:
  """Indices into the training set of the samples of every client sampled
  in some round of the run `config`."""
  trained = set()
  for round_num in range(1, config.rounds + 1):
    trained.update(runner.sample_clients(config, round_num).tolist())
  return np.concatenate([fed.client_indices[c] for c in sorted(trained)])


def membership_inference(run_dir: str, samples: int = DEFAULT_SAMPLES,
                         seed: int = 0) -> dict[str, Any]:
  """The attacks of the module docstring on the run in `run_dir`; writes
  the ROC plot of the best attack to `run_dir`/mia_roc.png.

  Returns:
    {'computed': True, 'mia_auc', 'mia_advantage' (the largest of each),
    'mia_auc_ci' (the best AUC's 95% interval, `_auc_interval`),
    'attacks': {name: {'auc', 'advantage'}}, 'members', 'non_members'
    (samples scored), 'roc': the plot's file name, 'models': 'global' or
    "each client's own", 'model_test_accuracy' (the global model's on the
    run's test set; the mean of the clients' own on their test splits)} or
    {'computed': False, 'reason': why}.

  Raises:
    ValueError: samples < FEWEST_SAMPLES, `run_dir` holds no run
      (config.json), or its weights file lacks the model's variables.
  """
  if not isinstance(samples, int) or samples < FEWEST_SAMPLES:
    raise ValueError(f"mia samples must be an integer >= {FEWEST_SAMPLES}, "
                     f"got {samples!r}")
  config = run_config(run_dir)
  library, why = _library()
  if library is None:
    return {"computed": False, "reason": why}
  personal = not os.path.exists(os.path.join(run_dir, MODEL_WEIGHTS))
  if personal and not os.path.exists(os.path.join(run_dir, runner.PERSONAL_MODELS)):
    return {"computed": False, "reason": f"no final model ({MODEL_WEIGHTS} or "
            f"{runner.PERSONAL_MODELS}): the run has not finished"}
  if config.partition == federated.CLIENT_DATA:
    return {"computed": False, "reason": "a run on the caller's ClientData: "
            "its samples are not in the run's folder"}
  fed = federated.load(config.dataset, config.clients, config.partition,
                       config.alpha, config.seed, config.data_dir,
                       config.samples_per_client, config.data_kwargs)
  if fed.source.task != "classification":
    return {"computed": False, "reason": f"the attacks score class labels; "
            f"{config.dataset!r} is {fed.source.task}"}
  spec = spec_of(config, fed.source)
  scored = (_personal_logits if personal else _global_logits)(
      run_dir, config, fed, spec, np.random.default_rng(seed), samples)
  (logits_in, labels_in), (logits_out, labels_out), accuracy = scored
  if min(len(labels_in), len(labels_out)) < FEWEST_SAMPLES:
    return {"computed": False, "reason": f"{len(labels_in)} training and "
            f"{len(labels_out)} test samples: the attacks need {FEWEST_SAMPLES} "
            "of each"}
  try:
    with _global_numpy_seed(seed):
      result = _attack(library, logits_in, logits_out, labels_in, labels_out, run_dir)
  except ValueError as e:  # the library's refusals (too few of a class)
    return {"computed": False, "reason": f"tensorflow_privacy's attacks: {e}"}
  return {**result, "models": "each client's own" if personal else "global",
          "model_test_accuracy": accuracy}


def _global_logits(run_dir, config, fed, spec, rng, samples):
  """((member logits, labels), (non-member logits, labels), test accuracy)
  of the final global model: members from every client that trained,
  non-members from the test set, which no client held."""
  tested = (fed.test_indices if fed.test_indices is not None
            else np.arange(len(fed.source.y_test)))
  inside = _some(rng, members(config, fed), samples)
  outside = _some(rng, tested, samples)
  model, src = _final_model(run_dir, spec), fed.source
  logits = model.predict(src.x_test[tested], verbose=0)
  return ((model.predict(src.x_train[inside], verbose=0), src.y_train[inside]),
          (model.predict(src.x_test[outside], verbose=0), src.y_test[outside]),
          float(np.mean(np.argmax(logits, -1) == src.y_test[tested])))


def _personal_logits(run_dir, config, fed, spec, rng, samples):
  """The same of a personalised run's models (runner.PERSONAL_MODELS), each
  client's samples scored by its own model: members are training samples
  of clients that trained, non-members the test samples of the same
  clients (their own test split, which they never trained on); the
  accuracy is the mean over those clients of their model's on their split."""
  trained = sorted({int(c) for r in range(1, config.rounds + 1)
                    for c in runner.sample_clients(config, r)})
  pairs_in = [(c, i) for c in trained for i in fed.client_indices[c]]
  pairs_out = [(c, i) for c in trained for i in fed.client_test_indices[c]]
  chosen_in = [pairs_in[j] for j in _some(rng, np.arange(len(pairs_in)), samples)]
  chosen_out = [pairs_out[j] for j in _some(rng, np.arange(len(pairs_out)), samples)]
  src, model = fed.source, spec.keras()
  logits_in, logits_out, accuracies = {}, {}, []
  path = os.path.join(run_dir, runner.PERSONAL_MODELS)
  with np.load(path) as saved:
    for c in trained:
      try:
        values = [saved[f"{federated.client_id(c)}/{name}"]
                  for name in spec.variable_names()]
      except KeyError as e:
        raise ValueError(f"{path}: no variable {e} of model {spec.name!r}") from None
      for variable, value in zip(model.trainable_variables, values, strict=True):
        variable.assign(value)
      x_test, y_test = fed.client_test_arrays(c)
      if len(y_test):
        accuracies.append(np.mean(np.argmax(model.predict(x_test, verbose=0), -1) == y_test))
      for chosen, x, out in ((chosen_in, src.x_train, logits_in),
                             (chosen_out, src.x_test, logits_out)):
        mine = [i for owner, i in chosen if owner == c]
        if mine:  # keyed by client too: test splits may share samples
          out.update(zip([(c, i) for i in mine], model.predict(x[mine], verbose=0)))
  return ((np.stack([logits_in[p] for p in chosen_in]),
           src.y_train[[i for _, i in chosen_in]]),
          (np.stack([logits_out[p] for p in chosen_out]),
           src.y_test[[i for _, i in chosen_out]]),
          float(np.mean(accuracies)) if accuracies else None)


@contextlib.contextmanager
def _global_numpy_seed(seed: int):
  """NumPy's global generator seeded for the block, then restored: the
  library's trained attacks (scikit-learn models and splits without a
  random_state) draw from it, and their AUCs varied by 0.01 between runs."""
  state = np.random.get_state()
  np.random.seed(seed)
  try:
    yield
  finally:
    np.random.set_state(state)


def _final_model(run_dir: str, spec: models.ModelSpec):
  """The run's final global model as a Keras model.

  Raises:
    ValueError: the weights file does not hold the model's variables.
  """
  model = spec.keras()
  try:
    weights = runner.load_model_weights(run_dir, spec)
  except KeyError as e:
    raise ValueError(f"{os.path.join(run_dir, MODEL_WEIGHTS)}: no variable {e} "
                     f"of model {spec.name!r}") from None
  for variable, value in zip(model.trainable_variables, weights, strict=True):
    variable.assign(value)
  return model


def run_config(run_dir: str) -> runner.RunConfig:
  """The run's configuration as config.json records it."""
  path = os.path.join(run_dir, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"--run {run_dir}: no run here (config.json is missing)")
  recorded = io.read_json(path)
  known = {f.name for f in dataclasses.fields(runner.RunConfig)} - {"out"}
  return runner.RunConfig(**{k: v for k, v in recorded.items() if k in known},
                          out=run_dir)


def spec_of(config: runner.RunConfig, source=None) -> models.ModelSpec:
  """The run's model, built for its data set (`source`, or loaded)."""
  source = source or sources.load_source(config.dataset, config.data_dir,
                                         config.data_kwargs)
  return models.ModelSpec(config.model, source.input_shape, source.num_classes,
                          config.model_kwargs)


def _some(rng: np.random.Generator, indices: np.ndarray, count: int) -> np.ndarray:
  return np.sort(rng.choice(indices, min(count, len(indices)), replace=False))


def _auc_interval(attacks) -> Optional[list[float]]:
  """The 95% interval of the best AUC over the attacks' own scored samples
  (`intervals.best_auc_interval`, 500 resamples: the library's results
  hold each attack's membership scores; None where one lacks them). The
  best of six AUCs is biased upwards where no attack has an edge; the
  interval covers the choice, not that bias."""
  scores = {r.attack_type.value: (r.membership_scores_train, r.membership_scores_test)
            for r in attacks}
  if any(a is None or b is None or min(len(a), len(b)) < 1
         for a, b in scores.values()):
    return None
  return intervals.best_auc_interval(scores, resamples=500)


def _run_attacks(mia, data_structures, kinds, logits_in, logits_out, labels_in,
                 labels_out):
  return mia.run_attacks(
      data_structures.AttackInputData(
          logits_train=logits_in, logits_test=logits_out,
          labels_train=np.asarray(labels_in, np.int64),
          labels_test=np.asarray(labels_out, np.int64)),
      data_structures.SlicingSpec(entire_dataset=True),
      attack_types=[kinds.THRESHOLD_ATTACK, kinds.THRESHOLD_ENTROPY_ATTACK,
                    kinds.LOGISTIC_REGRESSION, kinds.MULTI_LAYERED_PERCEPTRON,
                    kinds.RANDOM_FOREST, kinds.K_NEAREST_NEIGHBORS])


def _attack(library, logits_in, logits_out, labels_in, labels_out,
            out: Optional[str]) -> dict[str, Any]:
  data_structures, mia, plotting = library
  kinds = data_structures.AttackType
  # the library's random-forest grid holds max_features 'auto', which
  # scikit-learn 1.3 refuses: those fits fail (and warn), the rest decide;
  # its interval code divides by zero counts at the ROC's ends
  with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
    warnings.simplefilter("ignore")
    results = _run_attacks(mia, data_structures, kinds, logits_in, logits_out,
                           labels_in, labels_out)
  attacks = {r.attack_type.value: {"auc": float(r.get_auc()),
                                   "advantage": float(r.get_attacker_advantage())}
             for r in results.single_attack_results}
  best = max(results.single_attack_results, key=lambda r: r.get_auc())
  result = {"computed": True, "mia_auc": float(best.get_auc()),
            "mia_auc_ci": _auc_interval(results.single_attack_results),
            "mia_advantage": max(a["advantage"] for a in attacks.values()),
            "best_attack": best.attack_type.value, "attacks": attacks,
            "members": len(labels_in), "non_members": len(labels_out)}
  if out is not None:
    figure = plotting.plot_roc_curve(best.roc_curve)
    with io.atomic_path(os.path.join(out, ROC_FILE)) as tmp:
      figure.savefig(tmp, format="png")
    result["roc"] = ROC_FILE
    import matplotlib.pyplot as plt
    plt.close(figure)
  return result
