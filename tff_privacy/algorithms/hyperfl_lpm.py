"""HyperFL-LPM (Guo et al., Sec. 3.3): HyperFL on a frozen pre-trained
backbone, whose adapters the shared hypernetwork generates.

The algorithm is HyperFL's (`tff_privacy.algorithms.hyperfl`): eqs. 4-6 with
the classifier and the embedding private and only the hypernetwork uploaded.
What changes is the client model, `lpm_resnet` (`tff_privacy.models.lpm`):
its trainable tensors before the classifier are the adapters' (the backbone
is frozen and holds no variables), so the hypernetwork generates the
adapters. The defaults are the authors' ResNet setting: hypernetwork step
0.01 (their `--lr` for ResNet), the rest as HyperFL's; their batch size 16 is
a run parameter (`--batch-size 16`).
"""

from __future__ import annotations

import dataclasses

from tff_privacy import params
from tff_privacy.algorithms import hyperfl, personalized
from tff_privacy.algorithms.base import Algorithm, Method
from tff_privacy.models.lpm import LPM_MODELS
from tff_privacy.registry import METHODS

PARAMETERS = params.Params(*(
    dataclasses.replace(p, default=0.01)
    if p.name == "hypernetwork_learning_rate" else p
    for p in hyperfl.PARAMETERS))


def build_hyperfl_lpm(keras_model_fn, *, hypernetwork_learning_rate: float = 0.01,
                      **kwargs) -> personalized.PersonalizedProcess:
  """Builds HyperFL-LPM's `PersonalizedProcess`: HyperFL's rounds on an
  adapter model, with HyperFL-LPM's defaults.

  Args:
    keras_model_fn: returns the client model, an adapter model on a frozen
      backbone (`lpm_resnet`); the hypernetwork generates its trainable
      tensors before the classifier, the adapters.
    hypernetwork_learning_rate: eq. 5's step (0.01, the authors' ResNet
      setting).
    **kwargs: the other arguments of `hyperfl.build_hyperfl`, with its
      defaults.

  Returns:
    The `PersonalizedProcess` of `hyperfl.build_hyperfl`.

  Raises:
    ValueError: as `hyperfl.build_hyperfl`.
  """
  return hyperfl.build_hyperfl(
      keras_model_fn, hypernetwork_learning_rate=hypernetwork_learning_rate,
      **kwargs)


def algorithm(spec, *, batch_size: int, seed: int, defense,
              **declared) -> Algorithm:
  """HyperFL-LPM as the runner drives it: HyperFL's `Algorithm` on an
  adapter model.

  Raises:
    ValueError: for a model other than an `LPM_MODELS` one with adapters.
  """
  if spec.name not in LPM_MODELS or not spec.kwargs.get("adapters", True):
    raise ValueError(f"method 'hyperfl_lpm' needs --model {' or '.join(LPM_MODELS)}"
                     f" with adapters, got model {spec.name!r} {spec.kwargs}")
  base = hyperfl.algorithm(spec, batch_size=batch_size, seed=seed,
                           defense=defense, **declared)
  return dataclasses.replace(
      base, name="hyperfl_lpm", build_process=lambda aggregator: build_hyperfl_lpm(
          spec.keras, seed=seed, model_aggregator=aggregator,
          clients_per_call=hyperfl.clients_per_call_for(
              base.protocol["hypernetwork_parameters"]), **declared))


METHOD = Method("hyperfl_lpm", PARAMETERS, algorithm,
                "HyperFL on a frozen pre-trained backbone: the shared "
                "hypernetwork generates the adapters")
METHODS.register(METHOD)
