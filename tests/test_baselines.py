"""The HyperFL paper's baselines: DP-SGD pieces, each method's TFF round
against a plain TensorFlow reference, accounting and the runner."""

import json
import shutil

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_privacy as tfp_privacy

from tff_privacy import algorithms, cli, models, runner
from tff_privacy.algorithms import local_dp_sgd
from tff_privacy.algorithms.client_data import SEED_KEY, with_inputs
from tff_privacy.dp import accounting, dp_sgd
from tff_privacy.protocol import local_batch_sizes
from tff_privacy.models.functional import forward
from tff_privacy.updates import UpdateStore

SPEC = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": (16,)})
SGD = dict(momentum=0.5, weight_decay=5e-4)


def test_clipped_sum_is_tensorflow_privacys_query_record_by_record():
  rng = np.random.default_rng(0)
  grads = [tf.constant(rng.normal(size=(7, 3, 2)), tf.float32),
           tf.constant(rng.normal(size=(7, 4)), tf.float32)]
  query = tfp_privacy.GaussianSumQuery(l2_norm_clip=0.8, stddev=0.0)
  state = query.initial_global_state()
  params = query.derive_sample_params(state)
  total = query.initial_sample_state([g[0] for g in grads])
  for i in range(7):
    total = query.accumulate_record(params, total, [g[i] for g in grads])
  for a, b in zip(dp_sgd.clipped_sum(grads, 0.8), total):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_private_gradient_noise_has_std_sigma_c_over_b_and_follows_its_seed():
  grads = [tf.ones([10, 100, 100])]  # each example's norm is 100: clipped to 2
  seed = tf.constant([3, 4], tf.int64)
  noisy = dp_sgd.private_gradient(grads, 2.0, 3.0, seed)[0].numpy()
  noise = noisy - 2.0 / 100  # clipped mean: every entry 2 / 100
  assert noise.mean() == pytest.approx(0.0, abs=0.01)
  assert noise.std() == pytest.approx(3.0 * 2.0 / 10, rel=0.03)
  again = dp_sgd.private_gradient(grads, 2.0, 3.0, seed)[0].numpy()
  other = dp_sgd.private_gradient(grads, 2.0, 3.0, seed + 1)[0].numpy()
  np.testing.assert_array_equal(noisy, again)
  assert not np.allclose(noisy, other)


def test_private_gradient_divides_by_the_expected_batch_size_given():
  grads = [tf.ones([3, 100, 100])]  # each example clipped to norm 2
  mean = dp_sgd.private_gradient(grads, 2.0, 0.0, tf.constant([3, 4], tf.int64),
                                 denominator=10.0)[0].numpy()
  np.testing.assert_allclose(mean, 3 * 2.0 / 100 / 10, rtol=1e-6)
  # an empty Poisson batch: the noise alone, std sigma C / 10
  empty = dp_sgd.private_gradient([tf.ones([0, 100, 100])], 2.0, 3.0,
                                  tf.constant([3, 4], tf.int64),
                                  denominator=10.0)[0].numpy()
  assert empty.std() == pytest.approx(3.0 * 2.0 / 10, rel=0.03)


def _client_data(x, y, batch_size, epochs):
  """A client's round as the runner cuts it: `epochs` passes in batches."""
  sizes = local_batch_sizes(len(y), batch_size, epochs)
  return runner.client_dataset(np.concatenate([x] * epochs),
                               np.concatenate([y] * epochs), sizes)


def test_poisson_batches_take_each_example_with_probability_batch_over_n():
  n, b, epochs = 50, 10, 200  # q = 0.2; 5 batches a pass: 1000 steps
  x = np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1)  # x: the index
  seed = tf.constant([5, 6], tf.int64)
  batches = list(local_dp_sgd.poisson_batches(
      _client_data(x, np.zeros(n, np.int32), b, epochs), epochs,
      seed).as_numpy_iterator())
  assert len(batches) == 1000
  counts, sizes = np.zeros(n), []
  for batch in batches:
    index = batch["x"].reshape(-1).astype(int)
    assert len(set(index)) == len(index)
    counts[index] += 1
    sizes.append(len(index))
    assert batch[local_dp_sgd.EXPECTED_SIZE_KEY] == b
  # 50 000 independent draws at q = 0.2: the overall frequency has sd
  # 0.0018, each example's (1000 draws) sd 0.0126; tolerances 5 sd
  assert counts.sum() / (n * 1000) == pytest.approx(0.2, abs=0.009)
  assert np.all(np.abs(counts / 1000 - 0.2) < 0.063)
  # batch sizes Binomial(50, 0.2): variance 8 (fixed-size batches: 0); the
  # sample variance of 1000 has sd 0.36, tolerance 5.5 sd
  assert np.var(sizes) == pytest.approx(8.0, abs=2.0)
  # the draws follow the round's seed
  again = local_dp_sgd.poisson_batches(
      _client_data(x, np.zeros(n, np.int32), b, epochs), epochs, seed)
  other = local_dp_sgd.poisson_batches(
      _client_data(x, np.zeros(n, np.int32), b, epochs), epochs,
      tf.constant([5, 7], tf.int64))
  first = [batch["x"].reshape(-1) for batch in batches[:20]]
  assert all(np.array_equal(a, c["x"].reshape(-1))
             for a, c in zip(first, again.take(20).as_numpy_iterator()))
  assert not all(np.array_equal(a, c["x"].reshape(-1))
                 for a, c in zip(first, other.take(20).as_numpy_iterator()))


def test_a_client_smaller_than_the_batch_takes_every_example_every_step():
  x = np.arange(3, dtype=np.float32).reshape(3, 1, 1, 1)
  batches = list(local_dp_sgd.poisson_batches(
      _client_data(x, np.zeros(3, np.int32), 8, 4), 4,
      tf.constant([1, 2], tf.int64)).as_numpy_iterator())
  assert len(batches) == 4  # q = min(1, 8 / 3)
  for batch in batches:
    np.testing.assert_array_equal(np.sort(batch["x"].reshape(-1)), [0, 1, 2])
    assert batch[local_dp_sgd.EXPECTED_SIZE_KEY] == 3


def test_noise_calibration_matches_opacus_for_the_papers_setting():
  # the HyperFL authors' code: Opacus' get_noise_multiplier(4, 1e-5,
  # sample_rate=50/600, epochs=200 x 5) returns 10.63 (tolerance 0.01 in eps)
  sigma = dp_sgd.noise_multiplier_for(4.0, 1e-5, 50 / 600, 12000)
  assert sigma == pytest.approx(10.63, abs=0.05)
  spent = accounting.epsilon(dp_sgd.steps_event(sigma, 50 / 600, 12000), 1e-5)
  assert 3.99 < spent <= 4.0


def _sgd(params, grads, bufs, lr):
  bufs = [SGD["momentum"] * b + g + SGD["weight_decay"] * w
          for w, g, b in zip(params, grads, bufs)]
  return [w - lr * b for w, b in zip(params, bufs)], bufs


def _mean_grad(model, weights, wrt, x, y):
  with tf.GradientTape() as tape:
    free = [weights[i] for i in wrt]
    tape.watch(free)
    full = list(weights)
    for i, t in zip(wrt, free):
      full[i] = t
    loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
        y, forward(model, full, x), from_logits=True))
  return tape.gradient(loss, free)


def _clipped_mean_grad(model, weights, wrt, x, y, clip, denominator=None):
  """Noise-free DP-SGD gradient, one example at a time, divided by
  `denominator` (default: the batch's size)."""
  total = [tf.zeros_like(weights[i]) for i in wrt]
  for i in range(len(y)):
    g, _ = tf.clip_by_global_norm(
        _mean_grad(model, weights, wrt, x[i:i + 1], y[i:i + 1]), clip)
    total = [a + b for a, b in zip(total, g)]
  return [t / (denominator or len(y)) for t in total]


def _poisson_reference(x, y, seed, batch_size, steps):
  """The Poisson batches of a client's DP steps, drawn as documented: at
  step s every example joins when its uniform draw from the round's seed
  folded with `SAMPLING_STREAM`, then s (int64), lies below q = batch_size
  / n."""
  key = tf.random.experimental.stateless_fold_in(
      tf.constant(seed, tf.int64), local_dp_sgd.SAMPLING_STREAM)
  out = []
  for s in range(steps):
    draws = tf.random.stateless_uniform(
        [len(y)], tf.random.experimental.stateless_fold_in(key, np.int64(s)),
        dtype=tf.float64).numpy()
    keep = draws < batch_size / len(y)
    out.append((x[keep], y[keep]))
  return out


def _adam(params, grads, moments, step, lr, weight_decay, b1=0.9, b2=0.999,
          eps=1e-7):
  """Adam as written by Kingma and Ba (TFF's epsilon outside the root), the
  weight decay added to the gradient."""
  out, new = [], []
  for w, g, (m, v) in zip(params, grads, moments):
    g = g + weight_decay * w
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    rate = lr * np.sqrt(1 - b2 ** step) / (1 - b1 ** step)
    out.append(w - rate * m / (tf.sqrt(v) + eps))
    new.append((m, v))
  return out, new


def _zeros(ws):
  return [tf.zeros_like(w) for w in ws]


def _reference(method, weights, batches, p, sampled=None, denominator=None):
  """One client's round of `method`, written out directly; returns its new
  weights (body + classifier). `sampled`: the batches of the DP steps, if
  not `batches` (their DP part), and `denominator` their noisy sums'
  divisor."""
  model = SPEC.keras()
  w = [tf.constant(a) for a in weights]
  body, head = list(range(2)), list(range(2, 4))
  clip = p.get("l2_norm_clip")
  if method == "local_only" and p["client_optimizer"] == "adam":
    moments = [(z, z) for z in _zeros(w)]
    for step, (x, y) in enumerate(batches, start=1):
      w, moments = _adam(w, _mean_grad(model, w, range(4), x, y), moments, step,
                         p["learning_rate"], p["weight_decay"])
  elif method == "local_only":
    bufs = _zeros(w)
    for x, y in batches:
      w, bufs = _sgd(w, _mean_grad(model, w, range(4), x, y), bufs,
                     p["learning_rate"])
  elif method == "dp_sgd_fedavg":
    bufs = _zeros(w)
    for x, y in sampled or batches:
      w, bufs = _sgd(w, _clipped_mean_grad(model, w, range(4), x, y, clip,
                                           denominator),
                     bufs, p["learning_rate"])
  elif method == "ppsgd":
    hb, bb = _zeros(w[2:]), _zeros(w[:2])
    for x, y in sampled or batches:
      # an empty batch leaves the classifier's gradient 0
      g_head = (_mean_grad(model, w, head, x, y) if len(y)
                else _zeros(w[2:]))
      g_body = _clipped_mean_grad(model, w, body, x, y, clip, denominator)
      new_head, hb = _sgd(w[2:], g_head, hb, p["classifier_learning_rate"])
      new_body, bb = _sgd(w[:2], g_body, bb, p["learning_rate"])
      w = new_body + new_head
  elif method == "centaur":
    hb, bb = _zeros(w[2:]), _zeros(w[:2])
    per_epoch = len(batches) // 3  # 1 classifier epoch + 2 DP epochs
    for x, y in batches[:per_epoch]:
      new_head, hb = _sgd(w[2:], _mean_grad(model, w, head, x, y), hb,
                          p["classifier_learning_rate"])
      w = w[:2] + new_head
    for x, y in sampled or batches[per_epoch:]:
      new_body, bb = _sgd(w[:2], _clipped_mean_grad(model, w, body, x, y, clip,
                                                    denominator),
                          bb, p["learning_rate"])
      w = new_body + w[2:]
  return [a.numpy() for a in w]


@pytest.mark.slow
@pytest.mark.parametrize("method,given", [
    ("local_only", {}), ("local_only", {"client_optimizer": "adam"}),
    ("dp_sgd_fedavg", {}), ("ppsgd", {}), ("centaur", {}),
    ("dp_sgd_fedavg", {"batch_sampling": "shuffle"}),
    ("ppsgd", {"batch_sampling": "shuffle"}),
    ("centaur", {"batch_sampling": "shuffle"})])
def test_round_matches_a_plain_reference(method, given):
  _check_round(method, given, batch_size=4)  # batches 4+2 and 4+4+1 per epoch


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ppsgd", "centaur"])
def test_poisson_round_with_empty_batches_matches_a_plain_reference(method):
  # q = 1/6 and 1/9: about a third of the steps draw no example
  _check_round(method, {}, batch_size=1, empty_batches=True)


def _check_round(method, given, batch_size, empty_batches=False):
  """One TFF round of `method` on two clients of 6 and 9 examples against
  `_reference`."""
  epochs = 3  # centaur: 1 classifier epoch + 2 DP epochs
  given = {"local_epochs": 2 if method == "centaur" else 3, **given}
  if method != "local_only":
    given.update(l2_norm_clip=0.5, noise_multiplier=0.0)
  declared = algorithms.method(method).resolve(given)
  alg = algorithms.get(method, SPEC, batch_size=batch_size, seed=0, **declared)
  assert alg.local_epochs == epochs
  process = alg.build_process(None)
  rng = np.random.default_rng(0)
  clients, batches, sampled = [], [], []
  # the DP methods' default is Poisson sampling
  poisson = method != "local_only" and given.get("batch_sampling") != "shuffle"
  for n in (6, 9):
    x = rng.random((n, 8, 8, 1), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    sizes = local_batch_sizes(n, batch_size)
    dataset = runner.client_dataset(np.concatenate([x] * epochs),
                                    np.concatenate([y] * epochs), sizes * epochs)
    clients.append(with_inputs(dataset, {SEED_KEY: np.array([0, n], np.int64)})
                   if alg.client_inputs else dataset)
    cuts = np.cumsum([0] + sizes)
    batches.append([(x[a:b], y[a:b]) for a, b in zip(cuts[:-1], cuts[1:])] * epochs)
    # the DP steps: one per batch of the DP epochs (centaur: 2 of 3)
    dp_steps = len(sizes) * given["local_epochs"]
    sampled.append(_poisson_reference(x, y, [0, n], batch_size, dp_steps)
                   if poisson else None)
  if poisson:  # the draws give batches of varying size
    drawn = [len(y) for s in sampled for _, y in s]
    assert len(set(drawn)) > 2 and (0 in drawn) == empty_batches
  initial = SPEC.initial_weights(0)
  results = [_reference(method, initial, b, declared, s,
                        batch_size if poisson else None)
             for b, s in zip(batches, sampled)]
  mean = [(6 * a + 9 * b) / 15 for a, b in zip(*results)]

  def close(got, expected):
    for a, b in zip(got, expected):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

  if alg.private_state is None:  # dp_sgd_fedavg: one global model
    out = process.next(process.initialize(), clients)
    close(process.get_model_weights(out.state).trainable, mean)
    return
  states = [alg.private_state.initial(c) for c in range(2)]
  out = process.next(process.initialize(), clients, states)
  assert np.isfinite(out["metrics"]["client_work"]["train"]["loss"])
  shared = process.get_model_weights(out["state"])
  if method == "local_only":
    assert list(shared) == []
    for got, expected in zip(out["client_states"], results):
      close(got["model"], expected)
    return
  close(shared, mean[:2])  # the mean of the uploaded bodies
  for got, expected in zip(out["client_states"], results):
    close(got["classifier"], expected[2:])


@pytest.mark.slow
def test_dp_sgd_steps_draw_their_noise_from_the_clients_seed_beside_its_batches():
  """One client, one shuffled batch of 4, one DP-SGD step (server lr 1):
  the round with noise minus the round without is -lr times the step's
  noise, which `dp_sgd.private_gradient` draws for zero gradients under the
  client's seed folded with step 0 as int64 (`fold_in` called here)."""
  x = np.random.default_rng(1).random((4, 8, 8, 1), dtype=np.float32)
  y = np.arange(4, dtype=np.int32)
  seed = np.array([3, 9], np.int64)
  data = with_inputs(runner.client_dataset(x, y, [4]), {SEED_KEY: seed})
  given = {"local_epochs": 1, "batch_sampling": "shuffle", "l2_norm_clip": 0.5}
  weights = []
  for sigma in (0.0, 2.0):
    declared = algorithms.method("dp_sgd_fedavg").resolve(
        {**given, "noise_multiplier": sigma})
    process = algorithms.get("dp_sgd_fedavg", SPEC, batch_size=4, seed=0,
                             **declared).build_process(None)
    out = process.next(process.initialize(), [data])
    weights.append(process.get_model_weights(out.state).trainable)
  step_seed = tf.random.experimental.stateless_fold_in(tf.constant(seed), np.int64(0))
  noise = dp_sgd.private_gradient([tf.zeros([4, *w.shape]) for w in weights[0]],
                                  0.5, 2.0, step_seed)
  assert float(tf.linalg.global_norm(noise)) > 0.1
  lr = declared["learning_rate"]
  for clean, noisy, n in zip(*weights, noise):
    np.testing.assert_allclose(noisy - clean, -lr * n.numpy(), atol=2e-6)


def _config(out, **kw):
  base = dict(out=str(out), method="ppsgd", dataset="digits", model="mlp",
              model_kwargs={"hidden": (16,)}, clients=3, rounds=2,
              batch_size=10, partition="label_groups", samples_per_client=30,
              seed=0, method_kwargs={"local_epochs": 1})
  return runner.RunConfig(**{**base, **kw})


@pytest.mark.slow
def test_ppsgd_run_spends_its_budget_uploads_bodies_and_resumes_exactly(tmp_path):
  # a budget of 0.5 rather than the default 4: a large sigma calibrates in
  # a second, while sigma near 1 (epsilon 4) takes the RDP accountant ten
  budget = {"local_epochs": 1, "target_epsilon": 0.5}
  full = runner.run(_config(tmp_path / "full", capture_rounds=(1,),
                            method_kwargs=budget), progress=False)
  # the run as if stopped after round 1's checkpoint, then started again
  shutil.copytree(tmp_path / "full", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "program_state_2")
  resumed = runner.run(_config(tmp_path / "resumed", capture_rounds=(1,),
                               method_kwargs=budget), progress=False)
  for a, b in zip(full, resumed):
    assert {k: v for k, v in a.items() if k != "seconds"} == {
        k: v for k, v in b.items() if k != "seconds"}
  # the noise was calibrated for 2 rounds: the run cannot grow
  with pytest.raises(ValueError, match="rounds: .* sizes itself by them"):
    runner.run(_config(tmp_path / "resumed", rounds=3, capture_rounds=(1,),
                       method_kwargs=budget), progress=False)
  # sigma spends epsilon 0.5 over 2 rounds x 3 Poisson-sampled steps at
  # rate 10 / 30, as dp_accounting prices them
  sigma = dp_sgd.noise_multiplier_for(0.5, 1e-5, 1 / 3, 6)
  for entry, rounds in zip(full, (1, 2)):
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.PoissonSampledDpEvent(
        1 / 3, dp_accounting.GaussianDpEvent(sigma)), 3 * rounds)
    assert entry["epsilon"] == pytest.approx(rdp.get_epsilon(1e-5), rel=1e-6)
    assert entry["dp_relation"] == dp_sgd.RELATION
    assert entry["batch_sampling"] == "poisson"
  assert full[-1]["epsilon"] <= 0.5
  records = UpdateStore(str(tmp_path / "full" / "updates")).records(1)
  assert len(records) == 3
  for record in records:
    assert record.upload_kind == "body_weights"
    assert [u.shape for u in record.upload] == [(64, 16), (16,)]
    assert record.metadata["protocol"]["noise_multiplier"] == pytest.approx(sigma)


@pytest.mark.slow
def test_shuffled_batches_report_no_epsilon_and_say_why(tmp_path):
  history = runner.run(_config(tmp_path, method="dp_sgd_fedavg", rounds=1,
                               method_kwargs={"local_epochs": 1,
                                              "batch_sampling": "shuffle",
                                              "target_epsilon": 0.5}),
                       progress=False)
  last = history[-1]
  assert last["epsilon"] is None and "not accounted" in last["epsilon_note"]
  assert last["batch_sampling"] == "shuffle" and "delta" not in last
  with open(tmp_path / "metrics.json") as f:
    assert json.load(f)[-1]["epsilon"] is None
  assert cli.privacy_summary(last) == (
      f"epsilon=none ({last['epsilon_note']}) batch_sampling=shuffle")


def test_the_train_summary_names_the_batch_sampling():
  last = {"epsilon": 3.98765, "delta": 1e-5, "batch_sampling": "poisson"}
  assert cli.privacy_summary(last) == (
      "epsilon=3.988 delta=1e-05 batch_sampling=poisson")
  assert cli.privacy_summary({"epsilon": 2.0, "delta": 0.0}) == (
      "epsilon=2 delta=0")
  assert cli.privacy_summary({}) == ""


def test_local_only_refuses_capture_and_shares_nothing(tmp_path):
  with pytest.raises(ValueError, match="uploads nothing"):
    runner.run(_config(tmp_path / "a", method="local_only", method_kwargs={},
                       capture_rounds=(1,)), progress=False)
  assert not (tmp_path / "a").exists()


def _pfedhn_reference(hyper, generator, index, batches, p, classifier):
  """One client's pFedHN round and the server's direction for it, written
  out on full tensors: (new generator direction, delta, new classifier)."""
  model = SPEC.keras()
  generator = [tf.constant(w) for w in generator]
  with tf.GradientTape() as tape:
    tape.watch(generator)
    sent = hyper.generate(generator[:-1], generator[-1][index])
  w = list(sent) + [tf.constant(c) for c in classifier]
  bufs = _zeros(w)
  momentum = dict(momentum=p["momentum"], weight_decay=p["weight_decay"])
  for x, y in batches:
    grads = _mean_grad(model, w, range(len(w)), x, y)
    bufs = [momentum["momentum"] * b + g + momentum["weight_decay"] * a
            for a, g, b in zip(w, grads, bufs)]
    w = [a - p["learning_rate"] * b for a, b in zip(w, bufs)]
  delta = [s - a for s, a in zip(sent, w)]
  direction = tape.gradient(sent, generator, output_gradients=delta)
  return direction, delta, w[len(sent):]


@pytest.mark.parametrize("method,aggregation", [("pfedhn", "sum"),
                                                ("pfedhn_pc", "mean")])
def test_pfedhn_round_matches_a_plain_reference(method, aggregation):
  from tff_privacy.algorithms.pfedhn import hypernetwork_for
  declared = algorithms.method(method).resolve(
      {"local_epochs": 2, "hidden_dim": 8, "server_weight_decay": 0.01,
       "server_aggregation": aggregation})
  federation = algorithms.Federation(1, (6, 9))
  alg = algorithms.get(method, SPEC, batch_size=4, seed=0,
                       federation=federation, **declared)
  assert declared["embedding_dim"] is None and alg.protocol["embedding_dim"] == 1
  process = alg.build_process(None)
  rng = np.random.default_rng(0)
  clients, batches = [], []
  for n in (6, 9):
    x = rng.random((n, 8, 8, 1), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    sizes = [4] * (n // 4) + ([n % 4] if n % 4 else [])
    clients.append(runner.client_dataset(np.concatenate([x] * 2),
                                         np.concatenate([y] * 2), sizes * 2))
    cuts = np.cumsum([0] + sizes)
    batches.append([(x[a:b], y[a:b]) for a, b in zip(cuts[:-1], cuts[1:])] * 2)
  state = process.initialize()
  generator = list(process.get_model_weights(state))
  states = [alg.private_state.initial(c) for c in range(2)]
  out = process.next(state, clients, states)

  pc = method == "pfedhn_pc"
  hyper = hypernetwork_for(SPEC.keras(), pc, 1, 8)
  classifier = SPEC.initial_weights(0)[2:] if pc else []
  results = [_pfedhn_reference(hyper, generator, i, b, declared, classifier)
             for i, b in enumerate(batches)]
  # the server's first step: b = summed (or mean) direction + wd w; w - lr b
  for got, w, d0, d1 in zip(process.get_model_weights(out["state"]), generator,
                            results[0][0], results[1][0]):
    step = ((d0 + d1) / (2 if aggregation == "mean" else 1)
            + declared["server_weight_decay"] * w)
    np.testing.assert_allclose(got, w - declared["server_learning_rate"] * step,
                               rtol=1e-4, atol=1e-7)
  for got, (_, _, head) in zip(out["client_states"], results):
    assert int(got["index"]) in (0, 1)
    for a, b in zip(got.get("classifier", []), head):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # what client 1 was sent, and its own model after the round
  sent = alg.private_state.sent(generator, states[1])
  assert [s.shape for s in sent] == [tuple(t) for t in hyper.target_shapes]
  assert len(alg.private_state.personal_weights(generator, states[1])) == 4


@pytest.mark.slow
def test_pfedhn_capture_records_what_each_client_was_sent(tmp_path):
  config = _config(tmp_path, method="pfedhn", rounds=1, capture_rounds=(1,),
                   method_kwargs={"local_epochs": 1, "hidden_dim": 8})
  runner.run(config, progress=False)
  records = UpdateStore(str(tmp_path / "updates")).records(1)
  sent = [r.broadcast for r in records]
  assert not np.allclose(sent[0][0], sent[1][0])  # each its own model
  for record in records:
    assert record.upload_kind == "model_delta"
    assert [u.shape for u in record.upload] == [(64, 16), (16,), (16, 10), (10,)]
  attacks_module = __import__("tff_privacy.attacks", fromlist=["build"])
  attacks_module.build("ig").check_records(records)  # IG takes them as they are
  with pytest.raises(ValueError, match="transforms the aggregate"):
    runner.Run(_config(tmp_path / "dp", method="pfedhn", defense="dp_fedavg",
                       defense_kwargs={"clip": 1.0, "noise_multiplier": 1.0},
                       method_kwargs={}))


def test_client_optimizers_are_tffs_and_adam_takes_no_momentum():
  from tff_privacy.algorithms.base import build_client_optimizer
  import tensorflow_federated as tff
  adam = build_client_optimizer("adam", 0.01)
  assert type(adam) is type(tff.learning.optimizers.build_adam(0.01))
  with pytest.raises(ValueError, match="client_momentum applies to client_optimizer='sgd'"):
    build_client_optimizer("adam", 0.01, momentum=0.5)
  with pytest.raises(ValueError, match="client_optimizer='rmsprop'"):
    build_client_optimizer("rmsprop", 0.01)


def test_train_sums_count_each_samples_share_of_right_pixels():
  import tensorflow as tf
  from tff_privacy.algorithms.personalized import train_sums
  y = tf.constant([[[1, 0], [0, 0]], [[1, 1], [0, 0]]])
  predicted = tf.constant([[[1, 0], [0, 0]], [[1, 0], [1, 0]]])  # 4/4, 2/4
  sums = train_sums(tf.constant(0.5), predicted, y).numpy()
  np.testing.assert_allclose(sums, [1.0, 1.5, 2.0])


def test_local_adam_is_adam_with_l2_weight_decay_written_out():
  from tff_privacy.algorithms import personalized
  import tensorflow_federated as tff
  rng = np.random.default_rng(5)
  batches = [(rng.random((4, 8, 8, 1)).astype(np.float32), rng.integers(0, 10, 4))
             for _ in range(3)]
  dataset = tf.data.Dataset.from_tensor_slices(
      {"x": np.concatenate([b[0] for b in batches]),
       "y": np.concatenate([b[1] for b in batches]).astype(np.int32)}).batch(4)
  model, w0 = SPEC.keras(), [tf.constant(w) for w in SPEC.initial_weights(2)]
  lr, decay, (b1, b2, eps) = 0.01, 0.1, (0.9, 0.999, 1e-7)
  w, m, v = [x.numpy().astype(np.float64) for x in w0], None, None
  for t, (x, y) in enumerate(batches, 1):
    grads = _mean_grad(model, [tf.constant(a, tf.float32) for a in w],
                       range(len(w)), x, y)
    grads = [g.numpy() + decay * a for g, a in zip(grads, w)]
    m = [b1 * (0 if m is None else mi) + (1 - b1) * g for mi, g in zip(m or w, grads)]
    v = [b2 * (0 if v is None else vi) + (1 - b2) * g * g for vi, g in zip(v or w, grads)]
    step = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    w = [a - step * mi / (np.sqrt(vi) + eps) for a, mi, vi in zip(w, m, v)]
  got, sums = personalized.local_steps(
      model, w0, dataset, tff.learning.optimizers.build_adam(lr), decay)
  for g, e in zip(got, w):
    np.testing.assert_allclose(g.numpy(), e, rtol=1e-4, atol=1e-6)
  assert sums.numpy()[2] == 12


def test_the_epsilon_reported_bounds_every_clients_sizes():
  """Clients of 30 and 31 examples, batches of 10, one DP epoch, 2 rounds:
  the client of 31 takes 4 steps at rate 10/31 and spends more than the one
  of 30 (3 steps at 1/3), as dp_accounting prices them; the noise must hold
  it to the target (0.5: a large sigma calibrates quickly) and the epsilon
  reported must be its."""
  from tff_privacy.algorithms import local_dp_sgd
  from tff_privacy.dp import accounting

  def spent(sigma, rate, steps):
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.PoissonSampledDpEvent(
        rate, dp_accounting.GaussianDpEvent(sigma)), steps)
    return rdp.get_epsilon(1e-5)

  federation = type("Federation", (), {"client_sizes": (30, 31, 30),
                                       "rounds": 2})()
  dp = local_dp_sgd.configure(
      "ppsgd", federation, batch_size=10, dp_epochs=1, l2_norm_clip=1.0,
      noise_multiplier=None, target_epsilon=0.5, target_delta=1e-5,
      batch_sampling="poisson")
  sigma = dp.noise_multiplier
  assert spent(sigma, 10 / 31, 8) == pytest.approx(0.5, abs=1e-3)
  assert spent(sigma, 10 / 30, 6) < spent(sigma, 10 / 31, 8)
  event = accounting.RoundEvent(dp.round_event(), "r", "s")
  for rounds in (1, 2):
    eps, _ = accounting.largest_rounds_epsilon(event, rounds, 1e-5)
    assert eps == pytest.approx(spent(sigma, 10 / 31, 4 * rounds), rel=1e-6)
