"""HyperFL: hypernetwork, partition, the TFF process against a plain
TensorFlow reference, and the runner's private client state."""

import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_privacy import algorithms, data, io, models, runner
from tff_privacy.aggregation import wide_sum
from tff_privacy.algorithms import hyperfl, personalized
from tff_privacy.algorithms.hyperfl import build_hyperfl
from tff_privacy.data import partitioners
from tff_privacy.models.functional import forward
from tff_privacy.models.hypernetwork import Hypernetwork
from tff_privacy.updates import UpdateStore
from tff_privacy.updates.capture import ClientPlacedCapture

SMALL = dict(embedding_dim=8, hidden_dim=16)


def test_sgd_step_is_pytorchs_sgd_by_hand():
  p, g = [tf.constant([1.0, -2.0])], [tf.constant([0.5, 0.25])]
  p1, b1 = personalized.sgd_step(p, g, [tf.zeros(2)], 0.1, 0.5, 0.01)
  # b = g + wd p = [0.51, 0.23]; p = p - 0.1 b
  np.testing.assert_allclose(b1[0], [0.51, 0.23], rtol=1e-6)
  np.testing.assert_allclose(p1[0], [0.949, -2.023], rtol=1e-6)
  p2, b2 = personalized.sgd_step(p1, g, b1, 0.1, 0.5, 0.01)
  # b = 0.5 [0.51, 0.23] + [0.5 + 0.00949, 0.25 - 0.02023]
  np.testing.assert_allclose(b2[0], [0.76449, 0.34477], rtol=1e-6)
  np.testing.assert_allclose(p2[0], [0.949 - 0.076449, -2.023 - 0.034477],
                             rtol=1e-6)


def test_hypernetwork_generates_the_extractor_by_hand():
  model = models.build("hyperfl_cnn", (28, 28, 1), 10)
  hyper = Hypernetwork.for_model(model)
  assert hyper.target_names == ("conv1/kernel", "conv1/bias", "conv2/kernel",
                                "conv2/bias", "fc1/kernel", "fc1/bias")
  # the authors' 28x28 hypernetwork: 8,320 + 129 x 115,776 parameters
  assert hyper.num_parameters == 8320 + 129 * 115776 == 14943424
  weights = hyper.initial_weights(3)
  assert np.abs(weights[0]).max() <= 1 / 8 and np.abs(weights[2]).max() <= 1 / np.sqrt(128)
  v = hyper.initial_embedding(3)
  h = np.maximum(v @ weights[0] + weights[1], 0)
  out = hyper.generate([tf.constant(w) for w in weights], tf.constant(v))
  for i, (t, shape) in enumerate(zip(out, hyper.target_shapes)):
    expected = (h @ weights[2 + 2 * i] + weights[3 + 2 * i]).reshape(shape)
    np.testing.assert_allclose(t.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_label_groups_partition_by_hand():
  labels = np.repeat(np.arange(10), 100)
  parts = partitioners.label_groups(labels, 10, 50, seed=0)
  for client, part in enumerate(parts):
    counts = np.bincount(labels[part], minlength=10)
    # 10 iid samples: one per class; 40 over the group's three labels: 13, 13, 14
    group = [(2 * (client % 5) + j) % 10 for j in range(3)]
    expected = np.ones(10, int)
    expected[group] += [13, 13, 14]
    np.testing.assert_array_equal(counts, expected)
  # label 0 is in groups 0 and 4: 2 clients x 13 + 2 x 14 + 10 x 1 = 64 <= 100,
  # so no sample is dealt twice
  flat = np.concatenate(parts)
  assert len(np.unique(flat)) == len(flat)
  assert partitioners.label_group_sets(62)[1] == list(range(10, 36))
  with pytest.raises(ValueError, match=">= 3 classes"):
    partitioners.label_groups(np.array([0, 1, 0, 1]), 2, 2, seed=0)


def test_client_test_splits_follow_the_training_groups():
  fed = data.load("mnist5k", 10, "label_groups", seed=1)
  for client in range(10):
    _, y_train = fed.client_arrays(client)
    _, y_test = fed.client_test_arrays(client)
    group = [(2 * (client % 5) + j) % 10 for j in range(3)]
    assert len(y_train) == 400 and len(y_test) == 100
    # 80 % of each split from the group's labels, 20 % spread over all ten
    assert np.isin(y_train, group).sum() == 320 + 24
    assert np.isin(y_test, group).sum() == 80 + 6
  with pytest.raises(ValueError, match="samples_per_client applies"):
    data.load("mnist5k", 10, "iid", samples_per_client=10)


def _reference_client(model, hyper, varphi, phi, v, cls_batches, hyp_batches, p):
  """HyperFL's client round written out directly on full tensors."""
  def sgd(params, grads, bufs, lr):
    bufs = [p["momentum"] * b + g + p["weight_decay"] * w
            for w, g, b in zip(params, grads, bufs)]
    return [w - lr * b for w, b in zip(params, bufs)], bufs

  varphi = [tf.constant(w) for w in varphi]
  phi, v = [tf.constant(w) for w in phi], tf.constant(v)
  extractor = hyper.generate(varphi, v)
  bufs = [tf.zeros_like(w) for w in phi]
  for x, y in cls_batches:
    with tf.GradientTape() as tape:
      tape.watch(phi)
      loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
          y, forward(model, extractor + phi, x), from_logits=True))
    phi, bufs = sgd(phi, tape.gradient(loss, phi), bufs,
                    p["classifier_learning_rate"])
  hbufs, vbuf = [tf.zeros_like(w) for w in varphi], [tf.zeros_like(v)]
  for x, y in hyp_batches:
    with tf.GradientTape() as tape:
      tape.watch(varphi + [v])
      loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
          y, forward(model, hyper.generate(varphi, v) + phi, x),
          from_logits=True))
    grads = tape.gradient(loss, varphi + [v])
    g_h, _ = tf.clip_by_global_norm(grads[:-1], p["max_grad_norm"])
    g_v, _ = tf.clip_by_global_norm(grads[-1:], p["max_grad_norm"])
    varphi, hbufs = sgd(varphi, g_h, hbufs, p["hypernetwork_learning_rate"])
    (v,), vbuf = sgd([v], g_v, vbuf, p["hypernetwork_learning_rate"])
  return varphi, phi, v


@pytest.mark.slow
def test_process_matches_a_plain_reference_round(tmp_path):
  spec = models.ModelSpec("hyperfl_cnn", (28, 28, 1), 10)
  declared = algorithms.method("hyperfl").resolve(
      dict(SMALL, hypernetwork_epochs=2, max_grad_norm=0.5))
  alg = algorithms.get("hyperfl", spec, batch_size=4, seed=0, **declared)
  process = alg.build_process(None)
  rng = np.random.default_rng(0)
  clients, batches = [], []
  for n in (6, 9):  # batches 4+2 and 4+4+1, three epochs each
    x = rng.random((n, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    sizes = [4] * (n // 4) + ([n % 4] if n % 4 else [])
    clients.append(runner.client_dataset(np.concatenate([x] * 3),
                                         np.concatenate([y] * 3), sizes * 3))
    cuts = np.cumsum([0] + sizes)
    batches.append([(x[a:b], y[a:b]) for a, b in zip(cuts[:-1], cuts[1:])])
  state = process.initialize()
  states = [alg.private_state.initial(c) for c in range(2)]
  out = process.next(state, clients, states)

  model = spec.keras()
  hyper = Hypernetwork.for_model(model, **SMALL)
  varphi0 = hyper.initial_weights(0)
  results = [_reference_client(model, hyper, varphi0, s["classifier"],
                               s["embedding"][0], b, b * 2, declared)
             for s, b in zip(states, batches)]
  for got, (_, phi, v) in zip(out["client_states"], results):
    np.testing.assert_allclose(got["embedding"][0], v, rtol=1e-4, atol=1e-5)
    for a, b in zip(got["classifier"], phi):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  mean = [(6 * a + 9 * b) / 15 for a, b in zip(results[0][0], results[1][0])]
  for a, b in zip(process.get_model_weights(out["state"]), mean):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)
  # the clipped gradients moved the hypernetwork
  assert not np.allclose(mean[-2], varphi0[-2])


# HyperFL generates any model's extractor: a small MLP keeps runs quick
MLP = models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": (16,)})


def _config(out, **kw):
  base = dict(out=str(out), method="hyperfl", dataset="digits", model="mlp",
              model_kwargs=MLP.kwargs, clients=4, rounds=2, batch_size=10,
              partition="label_groups", samples_per_client=30, seed=0,
              method_kwargs=dict(SMALL, hypernetwork_epochs=1))
  return runner.RunConfig(**{**base, **kw})


@pytest.mark.slow
def test_hyperfl_run_keeps_state_private_and_resumes_exactly(tmp_path):
  full = runner.run(_config(tmp_path / "full", capture_rounds=(2,)),
                    progress=False)
  first = runner.run(_config(tmp_path / "resumed", rounds=1), progress=False)
  resumed = runner.run(_config(tmp_path / "resumed", rounds=2), progress=False)
  assert resumed[0] == first[0]
  # only the captured round says why it reports no update fidelity
  skip = {"seconds", "update_error_unavailable"}
  for a, b in zip(full, resumed):
    assert {k: v for k, v in a.items() if k not in skip} == {
        k: v for k, v in b.items() if k not in skip}
  assert "keeps private client state" in full[-1]["update_error_unavailable"]
  entry = full[-1]
  assert "test_accuracy" not in entry  # no global model
  assert 0 <= entry["personal_accuracy_min"] <= entry["personal_accuracy_mean"] <= 1

  records = UpdateStore(str(tmp_path / "full" / "updates")).records(2)
  spec = MLP
  hyper = Hypernetwork.for_model(spec.keras(), **SMALL)
  assert len(records) == 4
  for record in records:
    assert record.upload_kind == "hypernetwork_weights"
    assert [u.shape for u in record.upload] == hyper.shapes
    assert record.num_examples == 30
  # the personal models: each client's own classifier
  with np.load(os.path.join(tmp_path, "full", runner.PERSONAL_MODELS)) as f:
    fc2 = [f[f"{data.client_id(c)}/fc2/kernel"] for c in range(4)]
  assert not np.allclose(fc2[0], fc2[1])
  # what the evaluator scored is what the file holds
  fed = data.load("digits", 4, "label_groups", seed=0, samples_per_client=30)
  with np.load(os.path.join(tmp_path, "full", runner.PERSONAL_MODELS)) as f:
    accs = []
    for c in range(4):
      w = [f[f"{data.client_id(c)}/{n}"] for n in spec.variable_names()]
      x, y = fed.client_test_arrays(c)
      logits = forward(spec.keras(), [tf.constant(a) for a in w], tf.constant(x))
      accs.append(np.mean(np.argmax(logits, 1) == y))
  assert entry["personal_accuracy_mean"] == pytest.approx(np.mean(accs), abs=1e-6)
  assert entry["personal_accuracy_by_client"] == pytest.approx(accs, abs=1e-6)


@pytest.mark.slow
def test_fedavg_is_evaluated_per_client_with_its_global_model(tmp_path):
  history = runner.run(runner.RunConfig(
      out=str(tmp_path), method="fedavg", dataset="digits", model="mlp",
      model_kwargs=MLP.kwargs, clients=3, rounds=1, batch_size=16,
      partition="label_groups", samples_per_client=32, seed=0), progress=False)
  weights = runner.load_model_weights(str(tmp_path), MLP)
  fed = data.load("digits", 3, "label_groups", seed=0, samples_per_client=32)
  model = MLP.keras()
  accs = [np.mean(np.argmax(forward(model, weights, fed.client_test_arrays(c)[0]),
                            1) == fed.client_test_arrays(c)[1]) for c in range(3)]
  assert history[0]["personal_accuracy_mean"] == pytest.approx(np.mean(accs), abs=1e-6)
  assert history[0]["personal_accuracy_std"] == pytest.approx(np.std(accs), abs=1e-6)
  assert io.read_json(str(tmp_path / "config.json"))["samples_per_client"] == 32


@pytest.mark.slow
@pytest.mark.parametrize("method,kwargs", [
    ("hyperfl", dict(method_kwargs=dict(SMALL, hypernetwork_epochs=1))),
    ("centaur", dict(method_kwargs={})),
    ("ppsgd", dict(method_kwargs={})),
    ("local_only", dict(method_kwargs={}))])
def test_a_lone_clients_model_after_training_is_its_own_model(tmp_path, method,
                                                              kwargs):
  """With one client, the server's mean of its upload (a hypernetwork, a
  body) is the upload (and local-only shares nothing), so the model it
  reached by its local training is the one personal evaluation scores after
  the round."""
  entry = runner.run(_config(tmp_path, method=method, clients=1, rounds=1,
                             evaluate="local-after-training", **kwargs),
                     progress=False)[0]
  assert entry["local_after_training_clients"] == 1
  for name in ("accuracy_mean", "loss_mean", "accuracy_min"):
    assert entry[f"local_after_training_{name}"] == pytest.approx(
        entry[f"personal_{name}"], abs=1e-5)


@pytest.mark.slow
def test_uploads_returned_by_the_clients_equal_the_aggregated_capture(tmp_path,
                                                                      monkeypatch):
  """A personalised process returns the captured uploads CLIENTS-placed
  instead of stacking them in a `federated_aggregate`: the stored uploads
  and the local-after-training scores equal the aggregate's."""
  def run(out):
    history = runner.run(_config(out, rounds=1, capture_rounds=(1,),
                                 evaluate="local-after-training"), progress=False)
    store = UpdateStore(str(out / "updates"))
    return history[0], [store.read(1, c) for c in store.clients(1)]

  stacked, stack = [], runner.stacked_capture
  monkeypatch.setattr(runner, "stacked_capture",
                      lambda *a: stacked.append(1) or stack(*a))
  returned, records = run(tmp_path / "returned")
  assert stacked == [1]  # the uploads came back CLIENTS-placed
  # the builder that knows no `ClientPlacedCapture` gets a `CaptureFactory`
  monkeypatch.setattr(personalized, "ClientPlacedCapture", type("Nothing", (), {}))
  aggregated, expected = run(tmp_path / "aggregated")
  assert stacked == [1]
  assert len(records) == len(expected) == 4
  for got, want in zip(records, expected):
    assert got.num_examples == want.num_examples
    for u, v in zip(got.upload, want.upload):
      np.testing.assert_array_equal(u, v)
  drop = ("seconds",)
  assert {k: v for k, v in returned.items() if k not in drop} == {
      k: v for k, v in aggregated.items() if k not in drop}


def _assert_same(a, b):
  """Equal structures of arrays, to the bit."""
  tf.nest.map_structure(np.testing.assert_array_equal, a, b)


@pytest.mark.slow
def test_a_round_in_calls_of_few_clients_is_the_round_in_one_call():
  """`run_round` with 5 clients in calls of 2 (2 + 2, then 1 that finishes
  the round) equals the one call of `next`: the hypernetwork, every private
  state, the metrics and each captured upload (the uncaptured calls run
  in `tests/test_workers.py` on two workers)."""
  spec = MLP
  declared = algorithms.method("hyperfl").resolve(dict(SMALL, hypernetwork_epochs=1))
  aggregator = ClientPlacedCapture(wide_sum.wide_mean_factory(), 5)
  process = build_hyperfl(spec.keras, seed=0, clients_per_call=2,
                          model_aggregator=aggregator, **declared)
  alg = algorithms.get("hyperfl", spec, batch_size=4, seed=0, **declared)
  rng = np.random.default_rng(0)
  clients = []
  for n in (6, 9, 3, 7, 5):
    x = rng.random((n, 8, 8, 1), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    clients.append(runner.client_dataset(np.concatenate([x] * 2),
                                         np.concatenate([y] * 2), [n] * 2))
  state = process.initialize()
  states = [alg.private_state.initial(c) for c in range(5)]
  one_call = process.next(state, clients, states)
  calls, (_, update, finish) = [], process._in_calls
  process._in_calls = process._in_calls._replace(
      update=lambda *a: calls.append(("update", len(a[1]))) or update(*a),
      finish=lambda *a: calls.append(("finish", len(a[2]))) or finish(*a))
  in_calls = process.run_round(state, clients, states)
  assert calls == [("update", 2), ("update", 2), ("finish", 1)]
  assert sorted(in_calls) == sorted(one_call)
  assert len(one_call["uploads"]) == len(one_call["client_states"]) == 5
  for key in one_call:
    _assert_same(in_calls[key], one_call[key])
  # the round moved the hypernetwork
  assert not np.array_equal(one_call["state"]["shared"][0], state["shared"][0])


def test_only_the_default_mean_runs_a_round_in_calls():
  declared = algorithms.method("hyperfl").resolve(dict(SMALL, hypernetwork_epochs=1))
  build = lambda **kw: build_hyperfl(MLP.keras, seed=0, **declared, **kw)
  assert build(clients_per_call=2)._in_calls.clients_per_call == 2
  assert build(clients_per_call=None)._in_calls is None
  other = tff.aggregators.MeanFactory()
  assert build(clients_per_call=2, model_aggregator=other)._in_calls is None
  with pytest.raises(ValueError, match="clients_per_call=0; give a positive"):
    build(clients_per_call=0)


@pytest.mark.parametrize("capture", [False, True])
def test_the_initial_state_assembled_in_python_is_what_initialize_returns(capture):
  """`PersonalizedProcess.initial_state` (HyperFL's Python form, which the
  runner starts from) against TFF's `initialize`, to the bit and in
  structure, with the default mean and with a capturing aggregator."""
  declared = algorithms.method("hyperfl").resolve(SMALL)
  inner = wide_sum.wide_mean_factory()
  process = build_hyperfl(
      MLP.keras, seed=3, **declared,
      model_aggregator=ClientPlacedCapture(inner, 2) if capture else inner)
  python, tffs = process.initial_state(), process.initialize()
  tf.nest.assert_same_structure(python, tffs)
  _assert_same(python, tffs)
  assert [w.dtype for w in python["shared"]] == [np.float32] * len(tffs["shared"])
  assert not np.array_equal(python["shared"][0], build_hyperfl(
      MLP.keras, seed=4, **declared).initial_state()["shared"][0])


@pytest.mark.parametrize("part_elements", [wide_sum.PART_ELEMENTS, 100])
def test_the_mean_folded_from_compact_uploads_is_the_mean_of_the_uploads(
    monkeypatch, part_elements):
  """HyperFL's clients hand their hypernetworks to the default mean in a
  compact form that the fold expands part by part (`upload_rows`): the new
  hypernetwork equals the weighted mean of the uploads a capture returns
  (formed whole), computed here in numpy as the mean weighs them (each
  product in float32, the sums in float64, rounded once, then divided).
  With 100 entries a part, the heads' kernels are folded in blocks of rows."""
  monkeypatch.setattr(wide_sum, "PART_ELEMENTS", part_elements)
  declared = algorithms.method("hyperfl").resolve(dict(SMALL, hypernetwork_epochs=2))
  process = build_hyperfl(MLP.keras, seed=0, **declared,
                          model_aggregator=ClientPlacedCapture(
                              wide_sum.wide_mean_factory(), 3))
  alg = algorithms.get("hyperfl", MLP, batch_size=4, seed=0, **declared)
  rng = np.random.default_rng(1)
  clients = []
  for n in (6, 9, 5):
    x = rng.random((n, 8, 8, 1), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    clients.append(runner.client_dataset(np.concatenate([x] * 3),
                                         np.concatenate([y] * 3), [4, n - 4] * 3))
  state = process.initial_state()
  out = process.next(state, clients, [alg.private_state.initial(c) for c in range(3)])
  weights = np.asarray(out["upload_weights"], np.float32)
  assert sorted(weights) == [5, 6, 9]
  for i, got in enumerate(out["state"]["shared"]):
    total = sum((u[i] * w).astype(np.float64)
                for u, w in zip(out["uploads"], weights))
    want = total.astype(np.float32) / np.float32(weights.sum(dtype=np.float64))
    np.testing.assert_array_equal(got, want)
  assert not np.array_equal(out["state"]["shared"][2], state["shared"][2])


@pytest.mark.parametrize("hidden_dim", [16, 4])
def test_captured_uploads_are_the_plain_reference_clients_hypernetworks(hidden_dim):
  """The uploads a capture returns, formed whole from the clients' compact
  forms (`upload_rows`), against `_reference_client`'s hypernetworks, with
  a weight decay large enough that the kernels' scale a moves (to about
  0.93 in 6 steps) and a clip norm small enough that the gradients are
  clipped (each row of the low-rank form holds a clipped gradient). With 4
  hidden units the client of 6 steps hands H^T C
  over formed (more steps than hidden units), the client of 4 its rows."""
  sizes = dict(embedding_dim=8, hidden_dim=hidden_dim)
  declared = algorithms.method("hyperfl").resolve(
      dict(sizes, hypernetwork_epochs=2, weight_decay=0.5, max_grad_norm=0.5))
  process = build_hyperfl(MLP.keras, seed=0, **declared,
                          model_aggregator=ClientPlacedCapture(
                              wide_sum.wide_mean_factory(), 2))
  alg = algorithms.get("hyperfl", MLP, batch_size=4, seed=0, **declared)
  rng = np.random.default_rng(2)
  clients, batches = [], []
  for n in (6, 9):  # 2 and 3 batches an epoch: 4 and 6 hypernetwork steps
    x = rng.random((n, 8, 8, 1), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    sizes_ = [4] * (n // 4) + [n % 4]
    clients.append(runner.client_dataset(np.concatenate([x] * 3),
                                         np.concatenate([y] * 3), sizes_ * 3))
    cuts = np.cumsum([0] + sizes_)
    batches.append([(x[a:b], y[a:b]) for a, b in zip(cuts[:-1], cuts[1:])])
  states = [alg.private_state.initial(c) for c in range(2)]
  out = process.next(process.initial_state(), clients, states)

  model = MLP.keras()
  hyper = Hypernetwork.for_model(model, **sizes)
  varphi0 = hyper.initial_weights(0)
  settings = {k: v for k, v in declared.items() if k not in sizes}
  formed = []
  for upload, state, b, data_ in zip(out["uploads"], states, batches, clients):
    want, _, _ = _reference_client(model, hyper, varphi0, state["classifier"],
                                   state["embedding"][0], b, b * 2, declared)
    for got, w in zip(upload, want):
      np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    compact = hyperfl.local_training(
        model, hyper, [tf.constant(w) for w in varphi0],
        tf.nest.map_structure(tf.constant, state), data_, **settings)[0]
    formed.append(bool(compact["formed"]))
  assert formed == [False, hidden_dim == 4]
