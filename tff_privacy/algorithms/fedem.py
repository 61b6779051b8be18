"""FedEM (Xu et al.): error-minimizing data perturbation, then FedSGD.

Round t (Algorithm 1, lines 3-14). The server broadcasts theta; client k,
holding batch (x_k, y_k), draws a random perturbation delta_k, copies
theta_u <- theta and repeats N times:

```text
delta_k <- Proj(delta_k - alpha_u sign(grad_delta L(f_theta_u(t(x_k + delta_k)), y_k)))
theta_u <- theta_u - eta_u grad_theta_u L(f_theta_u(t(x_k + delta_k)), y_k)
```

where Proj keeps rho_min <= ||delta_k|| <= rho_max; it then uploads the FedSGD
gradient g_k = grad_theta L(f_theta(t(x_k + delta_k)), y_k) of the broadcast
model, and the server applies theta <- theta - eta mean_k g_k. The perturbed
data never leave the client; a gradient-inversion attacker recovers at best
t(x_k + delta_k). One client costs 2N + 1 forward-backward passes.

Reading of what the paper leaves open (all data here are scaled to [0, 1]):
* the norm is L-infinity, as in the error-minimizing noise FedEM builds on
  (sign steps are L-infinity steepest descent); "radius 8" is 8 on the 0-255
  scale, rho_max = 8/255. After a sign step some entry always sits at the
  L-infinity boundary, so a lower bound on ||delta||_inf alone would never
  bind, while Table 5 shows rho_min changing the results: the bounds apply
  to every entry, rho_min <= |delta_i| <= rho_max (which implies
  rho_min <= ||delta||_inf <= rho_max). `norm='l2'` instead rescales each
  sample's delta into the annulus rho_min <= ||delta||_2 <= rho_max.
* t(.) is the normalisation the model expects: here inputs are used as they
  are on [0, 1], so t clips x + delta to the data's value range.
* "learning rates 0.01" are alpha_u and eta_u (both on the [0, 1] scale);
  the initial delta is uniform in [-rho_max, rho_max] per entry, drawn from a
  per-client, per-round seed that travels in the client's data, so runs are
  reproducible.
* the server mean is unweighted (eq. in line 14), unlike TFF FedSGD's
  example-weighted mean; both agree when clients hold equal batches.
* the paper's server learning rate is 0.01 for rounds made of a whole local
  epoch; here a round is one FedSGD step, so the default is FedSGD's 0.1.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional

import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import params
from tff_privacy.aggregation.wide_sum import wide_sum_then_finalize
from tff_privacy.algorithms import client_data, defended, fedsgd
from tff_privacy.algorithms.base import (Algorithm, Method, check_positive,
                                         refuse_defense, server_learning_rate)
from tff_privacy.algorithms.client_data import SEED_KEY, client_seed
from tff_privacy.models import loss_fn
from tff_privacy.disclosure import Disclosure
from tff_privacy.listing import Listing
from tff_privacy.registry import METHODS

NORMS = ("linf", "l2")


def project(delta: tf.Tensor, rho_min: float, rho_max: float,
            norm: str = "linf") -> tf.Tensor:
  """Moves each sample's delta (leading axis) within the bounds.

  'linf': every entry's magnitude into [rho_min, rho_max], keeping its sign
  (0 counts as +), hence rho_min <= ||delta||_inf <= rho_max. 'l2': each
  sample rescaled into the annulus rho_min <= ||delta||_2 <= rho_max.
  """
  if norm == "linf":
    sign = tf.where(delta < 0, -1.0, 1.0)
    return sign * tf.clip_by_value(tf.abs(delta), rho_min, rho_max)
  axes = list(range(1, delta.shape.rank))
  size = tf.norm(tf.reshape(delta, [tf.shape(delta)[0], -1]), axis=1)
  size = tf.reshape(size, [-1] + [1] * len(axes))
  target = tf.clip_by_value(size, rho_min, rho_max)
  return delta * target / tf.maximum(size, 1e-12)


PERTURBATION = params.Params(
    params.Param("perturb_steps", int, 5,
                 "N, perturbation iterations per client and round", minimum=0),
    params.Param("perturb_lr", float, 0.01,
                 "alpha_u, the sign step on the perturbation", minimum=0,
                 exclusive_minimum=True),
    params.Param("model_lr", float, 0.01,
                 "eta_u, the step of the local model copy", minimum=0,
                 exclusive_minimum=True, flag="local-model-lr"),
    params.Param("rho_min", float, 0.0,
                 "lower bound of each perturbation entry's magnitude (linf) or "
                 "each sample's L2 norm", minimum=0),
    params.Param("rho_max", float, 8 / 255,
                 "upper bound of each perturbation entry's magnitude (linf) or "
                 "each sample's L2 norm, on [0, 1] data (8/255: radius 8 of 255)",
                 minimum=0, exclusive_minimum=True),
    params.Param("norm", str, "linf", "norm of the bounds", choices=NORMS,
                 flag="perturb-norm"))

PARAMETERS = params.Params(server_learning_rate(0.1), *PERTURBATION)


def _default(name: str):
  return PERTURBATION[name].default


@dataclasses.dataclass(frozen=True)
class Perturbation:
  """FedEM's client-side perturbation; defaults from Sec. 4.1.2 (declared
  in `PERTURBATION`).

  Attributes:
    perturb_steps: N, the perturbation iterations per client and round.
    perturb_lr: alpha_u, the sign-gradient step on the perturbation.
    model_lr: eta_u, the gradient step on the local model copy theta_u.
    rho_min, rho_max: the bounds of `project` (rho_max = 8/255: radius 8 on
      the 0-255 scale).
    norm: 'linf' or 'l2', see `project`.
    value_range: the data's range, to which t(.) clips x + delta.
  """

  perturb_steps: int = _default("perturb_steps")
  perturb_lr: float = _default("perturb_lr")
  model_lr: float = _default("model_lr")
  rho_min: float = _default("rho_min")
  rho_max: float = _default("rho_max")
  norm: str = _default("norm")
  value_range: tuple[float, float] = (0.0, 1.0)

  def __post_init__(self):
    checked = PERTURBATION.check(
        **{name: getattr(self, name) for name in PERTURBATION.names})
    for name, value in checked.items():
      object.__setattr__(self, name, value)
    if not self.rho_min <= self.rho_max:
      raise ValueError(f"rho_min must lie in [0, rho_max={self.rho_max}], got "
                       f"{self.rho_min}")
    low, high = self.value_range
    if not low < high:
      raise ValueError(f"value_range must be (low, high) with low < high, "
                       f"got {self.value_range}")
    object.__setattr__(self, "value_range", (float(low), float(high)))


def build_fedem_client_work(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    perturbation: Perturbation = Perturbation(),
) -> tff.learning.templates.ClientWorkProcess:
  """FedEM's client work: perturb each batch, upload the FedSGD gradient.

  A client's data carry its round's 'seed' (int64[2]) beside its batches
  (`tff_privacy.algorithms.client_data`).
  """
  with tf.Graph().as_default():
    model = model_fn()
    metrics_aggregation_fn = wide_sum_then_finalize(
        model.metric_finalizers())
  element = collections.OrderedDict(
      (k, tff.types.tensorflow_to_type(v)) for k, v in model.input_spec.items())
  data_type = client_data.seeded_type(element)
  weights_type = tff.learning.models.weights_type_from_model(model)
  p = perturbation
  low, high = p.value_range

  def client_update(model, initial_weights, dataset, seed):
    weights = tff.learning.models.ModelWeights.from_model(model)
    loss = loss_fn()

    def loss_of(x, y):
      return loss(y, model.predict_on_batch(x, training=True))

    def perturbed(x, delta):  # t(x + delta)
      return tf.clip_by_value(x + delta, low, high)

    def one_batch(total, batch):
      gradient_sum, count = total
      tf.nest.map_structure(lambda v, w: v.assign(w), weights, initial_weights)
      x, y = batch["x"], batch["y"]
      delta = project(tf.random.stateless_uniform(
          tf.shape(x), tf.cast(seed, tf.int64), -p.rho_max, p.rho_max),
          p.rho_min, p.rho_max, p.norm)
      for _ in range(p.perturb_steps):
        with tf.GradientTape() as tape:
          tape.watch(delta)
          delta_loss = loss_of(perturbed(x, delta), y)
        step = tf.sign(tape.gradient(delta_loss, delta))
        delta = project(delta - p.perturb_lr * step, p.rho_min, p.rho_max, p.norm)
        with tf.GradientTape() as tape:
          model_loss = loss_of(perturbed(x, delta), y)
        grads = tape.gradient(model_loss, weights.trainable)
        for v, g in zip(weights.trainable, grads):
          v.assign_sub(p.model_lr * g)
      tf.nest.map_structure(lambda v, w: v.assign(w), weights, initial_weights)
      with tf.GradientTape() as tape:
        output = model.forward_pass(
            collections.OrderedDict(x=perturbed(x, delta), y=y), training=True)
      grads = tape.gradient(output.loss, weights.trainable,
                            unconnected_gradients=tf.UnconnectedGradients.ZERO)
      n = tf.cast(output.num_examples, tf.float32)
      return (tuple(s + n * g for s, g in zip(gradient_sum, grads)), count + n)

    zeros = tuple(tf.zeros_like(v) for v in weights.trainable)
    gradient_sum, count = dataset.reduce((zeros, tf.constant(0.0)), one_batch)
    gradient = tuple(s / tf.maximum(count, 1.0) for s in gradient_sum)
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in gradient])
    # an unweighted mean over clients (Algorithm 1, line 14); a client whose
    # gradient is not finite is left out, as TFF's FedSGD does
    return tff.learning.templates.ClientResult(
        update=tuple(tf.where(finite, g, tf.zeros_like(g)) for g in gradient),
        update_weight=tf.where(finite, 1.0, 0.0))

  @tff.tensorflow.computation(weights_type, data_type)
  def client_update_computation(initial_weights, data):
    fresh = model_fn()
    dataset, inputs = client_data.split(data)

    @tf.function  # orders the variable updates (automatic control dependencies)
    def run(initial_weights, dataset, seed):
      result = client_update(fresh, initial_weights, dataset, seed)
      return result, fresh.report_local_unfinalized_metrics()

    return run(initial_weights, dataset, inputs[SEED_KEY])

  @tff.federated_computation
  def init_fn():
    return tff.federated_value((), tff.SERVER)

  @tff.federated_computation(init_fn.type_signature.result,
                             tff.FederatedType(weights_type, tff.CLIENTS),
                             tff.FederatedType(data_type, tff.CLIENTS))
  def next_fn(state, weights, data):
    result, metrics = tff.federated_map(client_update_computation, (weights, data))
    measurements = tff.federated_zip(
        collections.OrderedDict(train=metrics_aggregation_fn(metrics)))
    return tff.templates.MeasuredProcessOutput(state, result, measurements)

  return tff.learning.templates.ClientWorkProcess(init_fn, next_fn)


def build_fedem(
    model_fn: Callable[[], tff.learning.models.VariableModel],
    *,
    perturbation: Perturbation = Perturbation(),
    server_learning_rate: float = 0.1,
    model_aggregator: Optional[tff.aggregators.WeightedAggregationFactory] = None,
) -> tff.learning.templates.LearningProcess:
  """Builds the FedEM `LearningProcess` (see the module docstring).

  Args:
    model_fn: a no-argument function returning a
      `tff.learning.models.VariableModel`.
    perturbation: the clients' perturbation parameters (`Perturbation`).
    server_learning_rate: eta of the server's SGD step.
    model_aggregator: the aggregator of the uploaded gradients (default
      `aggregation.wide_sum.wide_mean_factory`).
  """
  check_positive(server_learning_rate=server_learning_rate)
  return defended.compose_defended(
      model_fn, build_fedem_client_work(model_fn, perturbation),
      tff.learning.optimizers.build_sgdm(server_learning_rate), model_aggregator)


def algorithm(spec, *, batch_size: int, seed: int, defense,
              server_learning_rate: float, **perturbation) -> Algorithm:
  """FedEM as the runner drives it: one batch per client and round, its
  perturbation (keyword arguments: the fields of `Perturbation`) seeded per
  (run, round, client). FedEM is itself the client-side defence; `defense`
  must be None (server-side dp_fedavg still applies through the aggregator)."""
  refuse_defense("fedem", defense)
  check_positive(batch_size=batch_size)
  perturb = Perturbation(**perturbation)
  return Algorithm(
      name="fedem", upload_kind="gradient", local_data="one_batch",
      build_process=lambda aggregator: build_fedem(
          spec.tff_model_fn(), perturbation=perturb,
          server_learning_rate=server_learning_rate, model_aggregator=aggregator),
      protocol={**fedsgd.protocol(server_learning_rate, batch_size,
                                  "mean loss over the perturbed batch"),
                **dataclasses.asdict(perturb)},
      client_inputs=lambda client, round_num: {
          SEED_KEY: client_seed(seed, round_num, client)})


def input_perturbation(record) -> tuple[float, str]:
  """(rho_max, norm) of the FedEM run that captured `record`, from its
  public protocol: the clean inputs lie within it of what was trained on."""
  protocol = record.metadata["protocol"]
  return protocol["rho_max"], protocol["norm"]


METHOD = Method("fedem", PARAMETERS, algorithm,
                "error-minimizing perturbation of each client's batch, then FedSGD",
                disclosure=Disclosure(input_perturbation=input_perturbation),
                listing=Listing("FedEM", "rho_max", 8 / 255,
                                (4 / 255, 8 / 255, 16 / 255, 32 / 255),
                                kwargs={"server_learning_rate": 0.2}, seconds=23.4))
METHODS.register(METHOD)
