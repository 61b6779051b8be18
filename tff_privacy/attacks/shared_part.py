"""Gradient inversion when the server holds only the shared part of a
client's model, never its classifier.

HyperFL's clients upload their hypernetwork (upload kind
'hypernetwork_weights'); PPSGD's and CENTAUR's their feature extractor
('body_weights'). The attacker holds what it broadcast and what came back;
the client's classifier phi, embedding v (HyperFL) and labels are unknown
and searched for together with the inputs. Three attacks, all Inverting
Gradients (Geiping et al.) at heart: 1 - cosine similarity of a simulated
update and the observed one, plus a total-variation prior, Adam with IG's
schedule (the inputs step on the gradient's sign and stay in the data
range; classifier, embedding and label logits take plain Adam steps):

* `HyperFLInversion` ('ig_hyperfl', Guo et al. eq. 8): one simulated
  gradient of the shared part at the broadcast weights, matched to the
  observed change (broadcast - upload), the unknowns (x, labels, v, phi).
  The gradient of the hypernetwork, whose heads hold ~15M numbers, is
  matched in its exact low-rank form: a head kernel's gradient is h g^T
  (hidden activation h, gradient g of the generated tensor), so
  <h g^T, dK> = h^T dK g and |h g^T| = |h| |g|.
* `TailoredHyperFL` ('tailored_hyperfl', eqs. 9-10; it reads the
  `hypernetwork` a defense declares, HyperFL's): first identify the
  generated extractor and its update from the hypernetwork's change, then
  invert the extractor's update (`ExtractorView`). The generated tensor is
  theta = K^T h(v) + c, so the change of the head biases c is the sum of
  the extractor's gradient steps, and the change of the head kernels K is
  sum_s h_s g_s^T. The attacker takes g = dc (the extractor's update, up to
  the clients' weight decay and momentum), h = dK dc / |dc|^2 (exact when h
  stayed constant over the steps), and theta = K^T h + c at the broadcast
  weights: a closed form of eq. 10's search. When every hidden unit is
  inactive (h = 0) theta is the head biases, whatever v.
* `ExtractorInversion` ('ig_body', on 'body_weights' and 'body_delta'):
  the second stage alone, on the extractor the server sent and its update
  (eq. 8 for PPSGD, CENTAUR and pFedHN-PC, whose unknowns are x, labels and
  phi).

Labels: soft label logits are optimised (DLG-style); the classifier that
would reveal them (iDLG) is what the server lacks. The classifier starts
from the model builder's seeded initialisation, which the protocol makes
public (all clients start from it).
"""

from __future__ import annotations

import abc
import dataclasses

import numpy as np
import tensorflow as tf

from tff_privacy.attacks.inversion import (GradientInversion, Target,
                                           _INIT, _MAX_EXAMPLES, _RESTARTS,
                                           _initial, _iterations, adam_step,
                                           cosine_distance, search_steps,
                                           total_variation)
from tff_privacy.models.functional import forward
from tff_privacy.models.hypernetwork import Hypernetwork, num_extractor_tensors
from tff_privacy.params import Param, Params
from tff_privacy.registry import ATTACKS


def _cross_entropy(logits, label_logits):
  return tf.reduce_mean(-tf.reduce_sum(
      tf.nn.softmax(label_logits) * tf.nn.log_softmax(logits), -1))


def hypernetwork_of(target: Target) -> Hypernetwork:
  protocol = target.record.metadata["protocol"]
  return Hypernetwork.for_model(target.model, protocol["embedding_dim"],
                                protocol["hidden_dim"])


@dataclasses.dataclass(frozen=True)
class ExtractorView:
  """A feature extractor and its observed update (broadcast - local)."""

  weights: list[tf.Tensor]
  update: list[tf.Tensor]

  @classmethod
  def of_body(cls, target: Target) -> "ExtractorView":
    """From what the client was sent and its new weights ('body_weights')
    or their change ('body_delta')."""
    if target.record.upload_kind == "body_delta":
      return cls(list(target.broadcast), list(target.upload))
    return cls(list(target.broadcast),
               [b - u for b, u in zip(target.broadcast, target.upload)])

  @classmethod
  def of_hypernetwork(cls, target: Target, hyper: Hypernetwork) -> "ExtractorView":
    """Eq. 10 in closed form (see the module docstring) for the upload of
    hypernetwork `hyper`."""
    change = [b - u for b, u in zip(target.broadcast, target.upload)]
    n = len(hyper.target_shapes)
    d_bias = tf.concat([change[3 + 2 * i] for i in range(n)], 0)
    d_kernel = tf.concat([change[2 + 2 * i] for i in range(n)], 1)
    hidden = tf.linalg.matvec(d_kernel, d_bias) / tf.maximum(
        tf.reduce_sum(d_bias ** 2), 1e-30)
    hidden = tf.nn.relu(hidden)
    weights, update = [], []
    sizes = [int(np.prod(s)) for s in hyper.target_shapes]
    for i, shape in enumerate(hyper.target_shapes):
      kernel, bias = target.broadcast[2 + 2 * i], target.broadcast[3 + 2 * i]
      weights.append(tf.reshape(
          tf.linalg.matvec(kernel, hidden, transpose_a=True) + bias, shape))
    for piece, shape in zip(tf.split(d_bias, sizes), hyper.target_shapes):
      update.append(tf.reshape(piece, shape))
    return cls(weights, update)


class _AdamSearch(GradientInversion):
  """IG's Adam over the inputs and further unknowns (`_unknowns`)."""

  OPTIMISES_LABELS = True  # soft labels are among the unknowns

  PARAMETERS = Params(
      _iterations(2000),
      Param("lr", float, 0.1, "Adam learning rate", minimum=0,
            exclusive_minimum=True),
      Param("tv_weight", float, 1e-4, "total-variation weight", minimum=0),
      _RESTARTS, _INIT, _MAX_EXAMPLES)

  @abc.abstractmethod
  def _objective_fn(self, target: Target):
    """(x, unknowns, constants) -> matching loss without the TV term."""

  @abc.abstractmethod
  def _constants(self, target: Target) -> list[tf.Tensor]:
    """The known tensors the objective reads (weights, observed update)."""

  def _unknowns(self, target: Target, rng: np.random.Generator) -> list[tf.Tensor]:
    """The unknowns besides x, from a random start."""
    split = num_extractor_tensors(target.model)
    classifier = [tf.constant(w) for w in
                  target.record.model_spec.initial_weights(0)[split:]]
    labels = tf.constant(rng.standard_normal(
        (target.num_examples, target.num_classes)), tf.float32)
    return [labels] + classifier

  def _build(self, target: Target):
    lo, hi = target.bounds
    milestones = tf.constant([int(self.iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)])
    matching = self._objective_fn(target)

    def objective(x, unknowns, constants):
      with tf.GradientTape() as tape:
        tape.watch([x] + list(unknowns))
        loss = matching(x, unknowns, constants) + self.tv_weight * total_variation(x)
      grads = tape.gradient(loss, [x] + list(unknowns))
      return loss, grads[0], grads[1:]

    def step(t, state, constants):
      x, unknowns, moments, best, best_loss = state
      loss, gx, gu = objective(x, unknowns, constants)
      better = loss < best_loss
      best = tf.where(better, x, best)
      best_loss = tf.where(better, loss, best_loss)
      count = tf.cast(t + 1, tf.float32)  # Adam's 1-based step
      passed = tf.reduce_sum(tf.cast(t >= milestones, tf.float32))
      lr = self.lr * tf.pow(0.1, passed)
      moved_x, mx, vx = adam_step(x, tf.sign(gx), moments[0], moments[1], count, lr)
      moved_x = tf.clip_by_value(moved_x, lo, hi)
      moved_unknowns, moved_moments = [], [mx, vx]
      for k, (p, g) in enumerate(zip(unknowns, gu)):
        p, m, v = adam_step(p, g, moments[2 + 2 * k], moments[3 + 2 * k], count, lr)
        moved_unknowns.append(p)
        moved_moments += [m, v]
      return ((moved_x, moved_unknowns, moved_moments, best, best_loss),
              (x, unknowns, moments, best, best_loss))

    def advance(x, unknowns, moments, best, best_loss, done, steps, constants):
      return search_steps(lambda t, state: step(t, state, constants), done,
                          steps, (x, list(unknowns), list(moments), best, best_loss))
    return advance

  def _start(self, target, rng):
    x = _initial(target.input_shape, self.init, target.bounds, rng)
    unknowns = self._unknowns(target, rng)
    moments = [tf.zeros_like(t) for t in [x, x]]
    for u in unknowns:
      moments += [tf.zeros_like(u), tf.zeros_like(u)]
    return {"x": x, "unknowns": unknowns, "moments": moments, "best_x": x,
            "best_loss": tf.constant(np.inf, tf.float32),
            "constants": self._constants(target)}

  def _advance(self, target, state, done, steps):
    advance = self.function(target, "adam", self._build)
    x, unknowns, moments, best_x, best_loss = advance(
        state["x"], state["unknowns"], state["moments"], state["best_x"],
        state["best_loss"], tf.constant(done), tf.constant(steps),
        state["constants"])
    return {**state, "x": x, "unknowns": list(unknowns),
            "moments": list(moments), "best_x": best_x,
            "best_loss": best_loss}, False

  def _finish(self, target, state):
    labels = tf.argmax(state["unknowns"][0], -1).numpy()
    return state["best_x"].numpy(), labels, float(state["best_loss"])


def _extractor_matching(target: Target):
  """1 - cos(grad_theta CE(x; theta, phi), observed extractor update)."""
  def matching(x, unknowns, constants):
    labels, classifier = unknowns[0], list(unknowns[1:])
    n = len(constants) // 2
    theta, update = list(constants[:n]), list(constants[n:])
    with tf.GradientTape() as tape:
      tape.watch(theta)
      loss = _cross_entropy(forward(target.model, theta + classifier, x), labels)
    return cosine_distance(tape.gradient(loss, theta), update)
  return matching


class _ExtractorSearch(_AdamSearch):
  """Inverts an extractor's update (`_view`) with the classifier unknown."""

  @abc.abstractmethod
  def _view(self, target: Target) -> ExtractorView:
    """The extractor and its update that the attacker inverts."""

  def _objective_fn(self, target):
    return _extractor_matching(target)

  def _constants(self, target):
    view = self._view(target)
    return view.weights + view.update


@ATTACKS.register
class ExtractorInversion(_ExtractorSearch):
  """IG on a feature extractor's update with the classifier unknown
  ('body_weights' uploads; see the module docstring)."""

  name = "ig_body"
  UPLOAD_KINDS = ("body_weights", "body_delta")

  def _view(self, target):
    return ExtractorView.of_body(target)


@ATTACKS.register
class TailoredHyperFL(_ExtractorSearch):
  """The attack of Guo et al. eqs. 9-10 on HyperFL uploads: extractor and
  update identified from the hypernetwork's change, then inverted (see the
  module docstring). It knows how the shared hypernetwork generates the
  extractor, as the defense declares it (`hypernetwork`: HyperFL's)."""

  name = "tailored_hyperfl"
  UPLOAD_KINDS = ("hypernetwork_weights",)
  READS = "hypernetwork"

  def _view(self, target):
    return ExtractorView.of_hypernetwork(target, Hypernetwork.for_model(
        target.model, **target.disclosed["hypernetwork"]))


@ATTACKS.register
class HyperFLInversion(_AdamSearch):
  """IG on HyperFL's hypernetwork update itself (Guo et al. eq. 8), with
  inputs, labels, classifier and embedding unknown (see the module
  docstring)."""

  name = "ig_hyperfl"
  UPLOAD_KINDS = ("hypernetwork_weights",)

  def _unknowns(self, target, rng):
    hyper = hypernetwork_of(target)
    return super()._unknowns(target, rng) + [tf.constant(
        rng.standard_normal(hyper.embedding_dim), tf.float32)]

  def _constants(self, target):
    # the change's norm is a constant of the search: computed once here,
    # not in every iteration, it saves one pass over the ~6M-entry heads
    change = [b - u for b, u in zip(target.broadcast, target.upload)]
    change_norm = tf.sqrt(tf.add_n([tf.reduce_sum(c ** 2) for c in change]))
    return list(target.broadcast) + change + [change_norm]

  def _objective_fn(self, target):
    hyper = hypernetwork_of(target)

    def matching(x, unknowns, constants):
      labels, classifier, v = unknowns[0], list(unknowns[1:-1]), unknowns[-1]
      half = (len(constants) - 1) // 2
      weights, change = constants[:half], constants[half:-1]
      c_norm = constants[-1]
      hidden_kernel, hidden_bias = weights[0], weights[1]
      with tf.GradientTape() as tape:
        tape.watch([hidden_kernel, hidden_bias])
        h = tf.nn.relu(tf.linalg.matvec(hidden_kernel, v, transpose_a=True)
                       + hidden_bias)
        theta = [tf.reshape(tf.linalg.matvec(weights[2 + 2 * i], h,
                                             transpose_a=True)
                            + weights[3 + 2 * i], shape)
                 for i, shape in enumerate(hyper.target_shapes)]
        tape.watch(theta)
        loss = _cross_entropy(forward(target.model, theta + classifier, x), labels)
      g_kernel, g_bias, *g_theta = tape.gradient(
          loss, [hidden_kernel, hidden_bias] + theta)
      g_flat = [tf.reshape(g, [-1]) for g in g_theta]
      # <grad, change> and |grad| with each head kernel's gradient h g^T
      dot = (tf.reduce_sum(g_kernel * change[0])
             + tf.reduce_sum(g_bias * change[1]))
      for i, g in enumerate(g_flat):
        dot += tf.reduce_sum(h * tf.linalg.matvec(change[2 + 2 * i], g))
        dot += tf.reduce_sum(g * change[3 + 2 * i])
      g_norm = tf.sqrt(tf.reduce_sum(g_kernel ** 2) + tf.reduce_sum(g_bias ** 2)
                       + (tf.reduce_sum(h ** 2) + 1.0)
                       * tf.add_n([tf.reduce_sum(g ** 2) for g in g_flat]))
      return 1.0 - dot / (g_norm * c_norm + 1e-12)

    return matching
