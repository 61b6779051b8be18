import asyncio
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import dp_accounting
import numpy as np
import pytest
import scipy.special
import tensorflow as tf

from tff_privacy import cli, data, io, models, provenance, runner, runtime
from tff_privacy.runs import evaluation as run_evaluation
from tff_privacy.runs import outputs as run_outputs
from tff_privacy.updates import GroundTruthStore, UpdateStore

SMALL = dict(dataset="digits", model="mlp", model_kwargs={"hidden": [16]},
             clients=4, batch_size=8, seed=3)


def _true_gradient(record, x, y):
  """The gradient a client holding (x, y) computes at the record's broadcast."""
  model = record.model_spec.keras()
  for v, w in zip(model.trainable_variables, record.broadcast):
    v.assign(w)
  with tf.GradientTape() as tape:
    loss = models.loss_fn()(y, model(x))
  return tape.gradient(loss, model.trainable_variables)


def _rdp_epsilon(event, rounds, delta,
                 relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE):
  """dp_accounting called directly: `event` composed `rounds` times."""
  accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
  accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
  return accountant.get_epsilon(delta)


def _without_timing(history):
  return [{k: v for k, v in m.items() if k != "seconds"} for m in history]


@pytest.fixture(scope="module")
def fedsgd_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("fedsgd"))
  config = runner.RunConfig(out=out, method="fedsgd", rounds=3,
                            capture_rounds=(2,), **SMALL)
  return config, runner.run(config, progress=False)


def test_metrics_json_and_tensorboard(fedsgd_run):
  config, history = fedsgd_run
  saved = io.read_json(os.path.join(config.out, "metrics.json"))
  assert saved == history
  run = runner.Run(config)
  final = runner.load_model_weights(config.out, run.spec)
  assert runner.Evaluator(run.spec)(final, *run.fed.test) == tuple(
      history[-1][k] for k in ("test_accuracy", "test_loss"))
  assert [m["round"] for m in saved] == [1, 2, 3]
  for m in saved:
    assert {"round", "test_accuracy", "test_loss", "seconds"} <= set(m)
    assert 0.0 <= m["test_accuracy"] <= 1.0 and m["test_loss"] > 0
  assert glob.glob(os.path.join(config.out, "tensorboard", "events.out.tfevents.*"))
  assert [m["server_update_rejected"] for m in saved] == [0, 0, 0]


def test_an_undefended_round_updates_as_its_clean_uploads(fedsgd_run):
  _, history = fedsgd_run
  assert "update_cosine" not in history[0] and "update_cosine" not in history[2]
  assert history[1]["update_cosine"] == pytest.approx(1.0, abs=1e-12)
  assert history[1]["update_relative_error"] < 1e-6


def test_server_step_measurements_name_rejections_and_aggregation_values():
  metrics = {"finalizer": {"update_non_finite": np.int32(1)},
             "server_aggregation": {"score_max": np.array([1.0, 2.0], np.float32),
                                    "count": np.float32(3.0)}}
  assert runner.server_step_measurements(metrics) == {
      "server_update_rejected": 1, "server_aggregation/score_max": [1.0, 2.0],
      "server_aggregation/count": 3.0}
  assert runner.server_step_measurements({"client_work": {}}) == {}


def test_client_defense_measurements_are_named_by_their_defense():
  metrics = {"client_work": {"train": {"loss": 1.0}, "defense": {
      "unperturbed_share": np.float32(0.25),
      "recupfl": {"zero_gradient_steps": np.float32(0.5)}}}}
  assert runner.client_defense_measurements(metrics) == {
      "unperturbed_share": 0.25, "recupfl/zero_gradient_steps": 0.5}
  assert runner.client_defense_measurements({"client_work": {"train": {}}}) == {}


def test_per_client_defense_measurements_are_written_for_the_rounds_clients():
  rows = np.array([[0.0, 0.0], [1.5, 2.5], [0.0, 0.0], [3.0, 4.0]], np.float32)
  metrics = {"client_work": {"train": {}, "defense": {},
                             "defense_per_client": {"fedre": {"tensor_epsilons": rows}}}}
  assert runner.client_defense_measurements(metrics, [3, 1]) == {
      "fedre/tensor_epsilons": {"3": [3.0, 4.0], "1": [1.5, 2.5]}}


def _fidelity_of(monkeypatch, clean, defended, weights):
  """`runner.update_fidelity` of a round whose clients' clean uploads are
  `clean` and whose captured uploads and weights are `defended`, `weights`."""
  monkeypatch.setattr(run_outputs, "clean_uploads_unavailable", lambda r, c: None)
  monkeypatch.setattr(run_outputs, "_clean_uploads", lambda r, b, c: clean)
  captured = {"uploads": [np.stack([u[k] for u in defended])
                          for k in range(len(defended[0]))],
              "upload_weights": np.asarray(weights, np.float32)}
  return runner.update_fidelity(None, [], list(range(len(clean))), captured)


def test_update_fidelity_leaves_out_clients_of_weight_zero(monkeypatch):
  """TFF sends a non-finite update as zeros of weight 0; the clean
  simulation of that client is NaN, and without a weighed client the
  round says why instead of failing."""
  rng = np.random.default_rng(0)
  clean = [[rng.normal(size=(2, 3)), rng.normal(size=3)] for _ in range(3)]
  defended = [[t + 0.1 for t in u] for u in clean]
  clean[1] = [np.full_like(t, np.nan) for t in clean[1]]
  defended[1] = [np.zeros_like(t) for t in clean[1]]
  c = (np.r_[clean[0][0].ravel(), clean[0][1]]
       + 3 * np.r_[clean[2][0].ravel(), clean[2][1]]) / 4
  d = c + 0.1
  got = _fidelity_of(monkeypatch, clean, defended, [1, 0, 3])
  assert got["update_cosine"] == pytest.approx(
      c @ d / np.sqrt((c @ c) * (d @ d)), rel=1e-9)
  assert got["update_relative_error"] == pytest.approx(
      np.linalg.norm(d - c) / np.linalg.norm(c), rel=1e-9)
  assert _fidelity_of(monkeypatch, clean, defended, [0, 0, 0]) == {
      "update_error_unavailable": "no client has a positive weight (weights "
      "[0.0, 0.0, 0.0]): the mean update is undefined"}
  assert _fidelity_of(monkeypatch, clean, defended, [1, 1, 1]) == {
      "update_error_unavailable": "the clean aggregate update is not finite"}


@pytest.mark.slow
def test_metrics_count_the_uploads_a_defense_left_unchanged(tmp_path):
  # sparsification with p=0 keeps every entry; the defences of
  # test_captured_upload_is_the_defended_gradient change every upload
  config = runner.RunConfig(out=str(tmp_path), method="fedsgd", rounds=2,
                            defense="sparsification", defense_kwargs={"p": 0.0},
                            **SMALL)
  runner.run(config, progress=False)
  saved = io.read_json(os.path.join(config.out, "metrics.json"))
  assert [m["unperturbed_share"] for m in saved] == [1.0, 1.0]
  assert not [k for k in saved[0] if k.startswith("sparsification/")]


@pytest.mark.slow
def test_a_diverging_run_records_the_rejected_updates(tmp_path):
  # a learning rate of 1e30 overflows the model in every round; TFF's
  # finalizer then rejects the non-finite aggregate and keeps the model
  config = runner.RunConfig(out=str(tmp_path), method="fedavg", rounds=2,
                            method_kwargs={"client_learning_rate": 1e30}, **SMALL)
  history = runner.run(config, progress=False)
  assert max(m["server_update_rejected"] for m in history) == 1
  final = runner.load_model_weights(config.out, runner.Run(config).spec)
  assert all(np.isfinite(w).all() for w in final)


def test_captured_upload_is_the_gradient_of_the_true_batch(fedsgd_run):
  config, _ = fedsgd_run
  store = UpdateStore(os.path.join(config.out, "updates"))
  truth = GroundTruthStore(os.path.join(config.out, "ground_truth"))
  assert store.rounds() == [2] and store.clients(2) == [0, 1, 2, 3]
  for client in store.clients(2):
    record = store.read(2, client)
    x, y = truth.read(2, client)
    assert len(y) == config.batch_size == record.weight == record.num_examples
    assert record.upload_kind == "gradient"
    grads = _true_gradient(record, x, y)
    for got, want in zip(record.upload, grads):
      np.testing.assert_allclose(got, want.numpy(), atol=2e-6)


@pytest.mark.slow
def test_resumed_run_ends_with_identical_metrics(fedsgd_run, tmp_path):
  """A run of 2 rounds extended to 3, checkpointing every 2 rounds (and the
  last), keeps rounds 2 and 3; stopped after round 3's metrics but before
  its checkpoint, it goes on from round 2. Each way it ends as the
  uninterrupted run did, and a finished run re-run does no more rounds."""
  config, history = fedsgd_run
  sparse = runner.RunConfig(**{**vars(config), "out": str(tmp_path / "sparse"),
                               "checkpoint_every": 2})
  assert sparse.to_json() == config.to_json()  # it computes the same run
  first = runner.run(runner.RunConfig(**{**vars(sparse), "rounds": 2}), progress=False)
  assert len(first) == 2
  assert _without_timing(runner.run(sparse, progress=False)) == _without_timing(history)
  saved = sorted(os.listdir(os.path.join(sparse.out, "checkpoints")))
  assert saved == ["program_state_2", "program_state_3"]
  shutil.rmtree(os.path.join(sparse.out, "checkpoints", "program_state_3"))
  resumed = runner.run(sparse, progress=False)
  assert _without_timing(resumed) == _without_timing(history)
  assert [m["round"] for m in resumed] == [1, 2, 3]
  again = runner.run(sparse, progress=False)
  assert again == resumed


@pytest.mark.slow
def test_a_checkpoint_of_another_state_form_is_refused_in_one_line(fedsgd_run, tmp_path):
  """A checkpoint whose state has another form (an earlier version's) stops
  the run with a one-line error naming the checkpoints folder."""
  config, _ = fedsgd_run
  out = str(tmp_path / "run")
  shutil.copytree(config.out, out)
  for name in os.listdir(os.path.join(out, "checkpoints")):
    shutil.rmtree(os.path.join(out, "checkpoints", name))
  asyncio.run(runner.checkpoint_manager(out).save({"other": np.zeros(3, np.float32)}, 2))
  with pytest.raises(ValueError, match="checkpoints: its last checkpoint holds another form") as e:
    runner.run(runner.RunConfig(**{**vars(config), "out": out}), progress=False)
  assert "\n" not in str(e.value)


@pytest.mark.slow
def test_config_json_names_the_code_that_trained_the_run(fedsgd_run, tmp_path,
                                                         monkeypatch):
  """Each code version that trained rounds of the run, once; a finished run
  run again adds none, and the file still reads back as a --config."""
  config, _ = fedsgd_run
  first = io.read_json(os.path.join(config.out, "config.json"))[provenance.KEY]
  assert [v["commit"] for v in first] == [provenance.code_version()["commit"]]
  out = str(tmp_path / "run")
  shutil.copytree(config.out, out)
  shutil.rmtree(os.path.join(out, "checkpoints", "program_state_3"))  # 2 done
  other = {"commit": "a" * 40, "dirty": True, "diff_sha256": "b" * 64}
  monkeypatch.setattr(provenance, "code_version", lambda: dict(other))
  resumed = runner.RunConfig(**{**vars(config), "out": out})
  runner.run(resumed, progress=False)
  path = os.path.join(out, "config.json")
  assert io.read_json(path)[provenance.KEY] == first + [other]
  monkeypatch.setattr(provenance, "code_version", lambda: {**other, "commit": "c" * 40})
  runner.run(resumed, progress=False)
  assert io.read_json(path)[provenance.KEY] == first + [other]
  args = cli._parser().parse_args(["train", "--config", path, "--out", out])
  assert cli._config_from_args(args).to_json() == config.to_json()


def test_other_config_in_same_folder_is_refused(fedsgd_run):
  config, _ = fedsgd_run
  with pytest.raises(ValueError, match="differs in seed"):
    runner.run(runner.RunConfig(**{**vars(config), "seed": 4}), progress=False)
  # a parameter given at its default is the same config
  same = runner.RunConfig(**{**vars(config), "method_kwargs":
                             {"server_learning_rate": 0.1}})
  assert same.to_json() == config.to_json()
  assert config.to_json()["method_kwargs"] == {"server_learning_rate": 0.1}


def _files(out, names) -> dict[str, bytes]:
  return {n: open(os.path.join(out, n), "rb").read() for n in names}


def test_fewer_rounds_than_done_are_refused_and_leave_the_run_as_it_was(
    fedsgd_run, tmp_path):
  config, _ = fedsgd_run
  out = str(tmp_path / "run")
  shutil.copytree(config.out, out)
  names = ("config.json", "metrics.json", runner.MODEL_WEIGHTS)
  before = _files(out, names)
  with pytest.raises(ValueError, match=r"differs in rounds: 3 there, 2 now "
                     r"\(3 done: a run resumes to more rounds only\)"):
    runner.run(runner.RunConfig(**{**vars(config), "out": out, "rounds": 2}),
               progress=False)
  assert _files(out, names) == before
  # stopped after round 2's checkpoint: 2 rounds are done, not 3
  shutil.rmtree(os.path.join(out, "checkpoints", "program_state_3"))
  with pytest.raises(ValueError, match=r"rounds: 3 there, 2 now \(2 done"):
    runner.run(runner.RunConfig(**{**vars(config), "out": out, "rounds": 2}),
               progress=False)
  assert _files(out, names) == before


def test_a_refused_config_names_every_differing_key_with_both_values(
    fedsgd_run, tmp_path):
  config, _ = fedsgd_run
  changed = runner.RunConfig(**{**vars(config), "seed": 4, "method_kwargs":
                                {"server_learning_rate": 0.2}})
  with pytest.raises(ValueError, match=(
      r"differs in method_kwargs.server_learning_rate: 0.1 there, 0.2 now; "
      r"seed: 3 there, 4 now\); choose another --out")):
    runner.run(changed, progress=False)
  # a key this config does not have, e.g. written by another version
  out = str(tmp_path / "run")
  shutil.copytree(config.out, out)
  saved = io.read_json(os.path.join(out, "config.json"))
  io.write_json(os.path.join(out, "config.json"), {**saved, "extra": [1, 2]})
  with pytest.raises(ValueError, match=r"differs in extra: \[1, 2\] there, "
                     r"unset now\)"):
    runner.run(runner.RunConfig(**{**vars(config), "out": out}), progress=False)


@pytest.mark.parametrize("dataset,data_kwargs,model", [
    ("digits", {}, "cnn"), ("docs", {"num": 10}, "unet"), ("adult", {}, "mlp")])
def test_the_default_model_follows_the_data_sets_task(tmp_path, dataset,
                                                      data_kwargs, model):
  config = runner.RunConfig(out=str(tmp_path), dataset=dataset,
                            data_kwargs=data_kwargs)
  assert config.model == model and config.to_json()["model"] == model
  # the task the data set's loader gives its samples: the model fits it
  source = data.sources.load_source(dataset, data_kwargs=data_kwargs)
  models.ModelSpec(config.model, source.input_shape, source.num_classes, {},
                   source.task).check_builds()


def test_data_options_at_their_defaults_leave_config_json_as_before(fedsgd_run):
  config, _ = fedsgd_run
  with open(os.path.join(config.out, "config.json")) as f:
    assert "data_kwargs" not in json.load(f)  # runs from before the field resume
  default = runner.RunConfig(**{**vars(config), "data_kwargs": {"test_fraction": 0.2}})
  assert default.to_json() == config.to_json()
  other = runner.RunConfig(**{**vars(config), "data_kwargs": {"test_fraction": 0.5}})
  assert other.to_json()["data_kwargs"] == {"test_fraction": 0.5}
  with pytest.raises(ValueError, match="differs in data_kwargs"):
    runner.run(other, progress=False)


@pytest.mark.slow
def test_evaluating_every_second_round_trains_the_same_model(fedsgd_run, tmp_path):
  config, history = fedsgd_run
  with open(os.path.join(config.out, "config.json")) as f:
    assert "evaluate_every" not in json.load(f)  # runs from before it resume
  sparse = runner.run(runner.RunConfig(**{**vars(config), "out": str(tmp_path),
                                          "evaluate_every": 2}), progress=False)
  assert ["test_accuracy" in m for m in sparse] == [False, True, True]  # 2, last
  for every, some in zip(_without_timing(history), _without_timing(sparse)):
    assert {k: v for k, v in every.items() if k in some} == some


@pytest.mark.slow
def test_fedavg_learns_digits_and_records_its_deltas(tmp_path):
  # 0.92 after round 2 (0.95 after 4)
  config = runner.RunConfig(out=str(tmp_path), method="fedavg", rounds=2,
                            method_kwargs={"local_epochs": 2}, capture_rounds=(1,),
                            **{**SMALL, "model_kwargs": {}})
  history = runner.run(config, progress=False)
  assert history[-1]["test_accuracy"] > 0.8
  assert history[-1]["test_loss"] < history[0]["test_loss"]
  record = UpdateStore(os.path.join(config.out, "updates")).read(1, 0)
  x, _ = GroundTruthStore(os.path.join(config.out, "ground_truth")).read(1, 0)
  assert record.upload_kind == "model_delta"
  assert record.metadata["protocol"]["local_epochs"] == 2
  assert record.weight == 2 * len(x)  # TFF counts every local epoch's examples
  assert record.num_examples == len(x)  # the distinct samples, recorded apart


def _pytorch_sgd(model, weights, x, y, batch_size, learning_rate, momentum,
                 weight_decay):
  """PyTorch's SGD by hand over consecutive batches of (x, y): b = momentum b
  + g + weight_decay w, w = w - learning_rate b, b from 0."""
  w = [tf.constant(v) for v in weights]
  b = [tf.zeros_like(v) for v in w]
  for start in range(0, len(y), batch_size):
    for v, value in zip(model.trainable_variables, w):
      v.assign(value)
    with tf.GradientTape() as tape:
      loss = models.loss_fn()(y[start:start + batch_size],
                              model(x[start:start + batch_size]))
    g = tape.gradient(loss, model.trainable_variables)
    b = [momentum * bi + gi + weight_decay * wi for bi, gi, wi in zip(b, g, w)]
    w = [wi - learning_rate * bi for wi, bi in zip(w, b)]
  return [v.numpy() for v in w]


@pytest.mark.slow
def test_fedavg_weight_decay_is_pytorchs_coupled_decay(tmp_path):
  """Each client's delta is w_t minus PyTorch's SGD with momentum and
  coupled weight decay over its batches (by hand), and differs from the
  undecayed step."""
  sgd = {"client_learning_rate": 0.3, "client_momentum": 0.5}
  config = runner.RunConfig(
      out=str(tmp_path), method="fedavg", clients=30, clients_per_round=2,
      batch_size=5, rounds=1, capture_rounds=(1,), seed=3,
      method_kwargs={**sgd, "weight_decay": 0.2}, dataset="digits",
      model="mlp", model_kwargs={"hidden": [16]})
  runner.run(config, progress=False)
  store = UpdateStore(os.path.join(config.out, "updates"))
  truth = GroundTruthStore(os.path.join(config.out, "ground_truth"))
  for client in store.clients(1):
    record = store.read(1, client)
    assert record.metadata["protocol"]["weight_decay"] == 0.2
    x, y = truth.read(1, client)
    model = record.model_spec.keras()
    reached = [w - u for w, u in zip(record.broadcast, record.upload)]
    decayed = _pytorch_sgd(model, record.broadcast, x, y, 5, 0.3, 0.5, 0.2)
    for got, want in zip(reached, decayed):
      np.testing.assert_allclose(got, want, atol=2e-5)
    undecayed = _pytorch_sgd(model, record.broadcast, x, y, 5, 0.3, 0.5, 0.0)
    assert max(np.abs(a - b).max() for a, b in zip(reached, undecayed)) > 1e-3


def test_fedavg_weight_decay_is_for_sgd():
  from tff_privacy.algorithms.base import build_client_optimizer
  with pytest.raises(ValueError, match="weight_decay applies to client_optimizer='sgd'"):
    build_client_optimizer("adam", 0.01, weight_decay=5e-4)


@pytest.mark.slow
def test_local_after_training_scores_each_clients_trained_model(tmp_path):
  """Beside the global model's metrics, the mean and spread over the
  round's clients of each one's model after its local epoch (Keras' SGD
  from the initial model on its samples in training order), scored on its
  own test split."""
  config = runner.RunConfig(
      out=str(tmp_path), method="fedavg", rounds=1,
      evaluate="local-after-training",
      method_kwargs={"client_learning_rate": 0.3, "client_momentum": 0.5},
      **SMALL)
  entry = runner.run(config, progress=False)[0]
  run = runner.Run(config)
  model = run.spec.keras()
  accuracies = []
  for client in run.round_data(1):  # one epoch: x, y in training order
    trained = _keras_sgd(model, run.spec.initial_weights(config.seed), client.x,
                         client.y, config.batch_size, 0.3, 0.5)
    x, y = run.fed.client_test_arrays(client.index)
    accuracies.append(np.mean(np.argmax(trained.predict(x, verbose=0), 1) == y))
  assert entry["local_after_training_clients"] == config.clients
  assert entry["local_after_training_accuracy_mean"] == pytest.approx(
      np.mean(accuracies), abs=1e-6)
  assert entry["local_after_training_accuracy_std"] == pytest.approx(
      np.std(accuracies), abs=1e-6)
  assert entry["local_after_training_accuracy_min"] == pytest.approx(
      np.min(accuracies), abs=1e-6)
  assert "test_accuracy" in entry and "personal_accuracy_mean" in entry
  assert io.read_json(os.path.join(config.out, "config.json"))["evaluate"] == (
      "local-after-training")


def _keras_sgd(model, weights, x, y, batch_size, learning_rate, momentum):
  """`model` set to `weights` after Keras' SGD over consecutive batches."""
  model.set_weights(weights)
  optimizer = tf.keras.optimizers.SGD(learning_rate, momentum=momentum)
  for start in range(0, len(y), batch_size):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
          y[start:start + batch_size], model(x[start:start + batch_size]),
          from_logits=True))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                  model.trainable_variables))
  return model


@pytest.mark.parametrize("kwargs,what", [
    (dict(method="fedsgd"), "method 'fedsgd'"),
    (dict(method="fedavg", defense="dp_fedavg",
          defense_kwargs={"clip": 1.0, "noise_multiplier": 1.0}),
     "method 'fedavg' with defense 'dp_fedavg'")])
def test_local_after_training_is_refused_where_uploads_do_not_give_it(kwargs, what):
  with pytest.raises(ValueError, match=(
      f"evaluate='local-after-training': the uploads of {what} do not give")):
    runner.Run(runner.RunConfig(out="unused", evaluate="local-after-training",
                                **{**SMALL, **kwargs}))


def test_client_sampling_is_seeded_and_in_range():
  config = runner.RunConfig(out="unused", clients=10, clients_per_round=4, seed=1)
  a, b = runner.sample_clients(config, 5), runner.sample_clients(config, 5)
  np.testing.assert_array_equal(a, b)
  assert len(set(a.tolist())) == 4 and a.min() >= 0 and a.max() < 10
  assert not np.array_equal(a, runner.sample_clients(config, 6)) or \
      not np.array_equal(a, runner.sample_clients(config, 7))


_HOLD_CLIENT_FILES = """
import os, sys, tempfile, time
import numpy as np
tempfile.tempdir = sys.argv[1]
os.getpid = lambda: 4194303  # as a PID of another namespace reads here
from tff_privacy import runner
files = runner.ClientFiles(np.zeros((1, 2)), np.zeros(1), [np.array([0])])
print(files.folder(0), flush=True)
time.sleep(600)
"""


def _holder(tmp_path) -> tuple[subprocess.Popen, str]:
  """A process holding a `ClientFiles` folder in `tmp_path`, whose PID
  means nothing here (the PID of another namespace): the process and its
  client's folder."""
  holder = subprocess.Popen([sys.executable, "-c", _HOLD_CLIENT_FILES, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
  return holder, os.path.dirname(holder.stdout.readline().strip())


@pytest.mark.slow
def test_client_files_are_removed_only_once_their_process_ended(tmp_path, monkeypatch):
  """Liveness by the folder's lock, which the kernel holds for the process
  wherever its PID lives: a live process's folder stays, also when its PID
  is dead here; a SIGKILLed one's goes with the next `ClientFiles`."""
  holder, theirs = _holder(tmp_path)
  (tmp_path / f"{runner.ClientFiles.PREFIX}unlocked").mkdir()  # no lock file
  (tmp_path / "other").mkdir()
  # an earlier version's folders, named by their process: ended, running
  ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                         capture_output=True, text=True).stdout.strip()
  (tmp_path / f"{runner.ClientFiles.PREFIX}{ended}-abc").mkdir()
  running = f"{runner.ClientFiles.PREFIX}{os.getpid()}-abc"
  (tmp_path / running).mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  try:
    with pytest.raises(ProcessLookupError):
      os.kill(4194303, 0)  # the PID in their name: none here
    runner.ClientFiles(np.zeros((1, 2)), np.zeros(1), [np.array([0])]).close()
    assert os.path.isdir(os.path.join(theirs, "client_0"))
  finally:
    holder.kill()
    holder.wait()
  files = runner.ClientFiles(np.zeros((1, 2)), np.zeros(1), [np.array([0])])
  mine = os.path.basename(os.path.dirname(files.folder(0)))
  assert sorted(os.listdir(tmp_path)) == sorted([
      f"{runner.ClientFiles.PREFIX}unlocked", "other", running, mine])
  files.close()
  assert sorted(os.listdir(tmp_path)) == sorted([
      f"{runner.ClientFiles.PREFIX}unlocked", "other", running])


@pytest.mark.parametrize("sizes", [[1], [3, 3, 3], [4, 4, 2, 4, 4, 2], [3, 1, 3, 1]])
def test_a_client_dataset_read_from_files_has_the_in_memory_batches(sizes):
  x = np.random.default_rng(0).normal(size=(30, 2, 3)).astype(np.float32)
  y = np.arange(30, dtype=np.int32)
  idx = np.array([29, 3, 17, 8, 11, 0])  # the client's samples
  order = np.random.default_rng(1).integers(0, len(idx), sum(sizes))
  files = runner.ClientFiles(x, y, [np.array([1])] * 7 + [idx])
  try:
    folder = files.folder(7)
    assert files.folder(7) == folder and len(os.listdir(folder)) == len(idx)
    ds = runner.file_client_dataset(folder, (tf.TensorSpec((None, 2, 3), tf.float32),
                                            tf.TensorSpec((None,), tf.int32)),
                                    order, sizes)
    expected = runner.client_dataset(x[idx[order]], y[idx[order]], sizes)
    assert ds.element_spec == expected.element_spec
    # each pass would rewrite the pipeline: a few ms a client on a worker
    for d in (ds, expected):
      assert d.options().experimental_optimization.apply_default_optimizations is False
    got, want = list(ds), list(expected)
    assert len(got) == len(want) == len(sizes)
    for a, b in zip(got, want):
      assert a.keys() == b.keys()
      assert all(np.array_equal(a[k], b[k]) for k in b)
  finally:
    files.close()
  assert not os.path.exists(os.path.dirname(folder))


def test_client_files_read_with_other_specs_fail():
  x, y = np.zeros((3, 2, 3), np.float32), np.arange(3, dtype=np.int32)
  files = runner.ClientFiles(x, y, [np.arange(3)])
  try:
    ds = runner.file_client_dataset(files.folder(0), (
        tf.TensorSpec((None, 2, 3), tf.float64), tf.TensorSpec((None,), tf.int32)),
                                    np.arange(3), [3])
    with pytest.raises(tf.errors.InvalidArgumentError, match="other specs"):
      list(ds)
  finally:
    files.close()


def test_client_inputs_travel_beside_the_batches():
  from tff_privacy.algorithms import client_data
  x = np.zeros((5, 2), np.float32)
  y = np.arange(5, dtype=np.int32)
  ds = runner.client_dataset(x, y, [2, 2, 1])
  inputs = {"budget": np.float32(0.5), "mask": np.array([1, 0, 1], np.int32)}
  batches, got = tf.function(client_data.split)(client_data.with_inputs(ds, inputs))
  assert [len(b["y"]) for b in batches] == [2, 2, 1]
  assert list(got) == ["budget", "mask"] and float(got["budget"]) == 0.5
  np.testing.assert_array_equal(got["mask"], [1, 0, 1])
  client = runner.RoundClient(0, np.arange(5), ds, {}, None, inputs)
  assert client.process_data.keys() == {"batches", "inputs"}
  assert runner.RoundClient(0, np.arange(5), ds, {}, None).process_data is ds


@pytest.mark.parametrize("sizes", [[1], [3, 3, 3], [4, 4, 2, 4, 4, 2], [3, 1, 3, 1],
                                   [2, 2, 2, 2], [5, 2, 2]])
def test_client_batches_are_consecutive_slices_of_the_given_sizes(sizes):
  x = np.arange(sum(sizes) * 2, dtype=np.float32).reshape(-1, 2)
  y = np.arange(sum(sizes), dtype=np.int32)
  ds = runner.client_dataset(x, y, sizes)
  ends = np.cumsum(sizes)
  expected = [y[end - size:end] for size, end in zip(sizes, ends)]
  batches = list(ds)
  assert [b["y"].numpy().tolist() for b in batches] == [e.tolist() for e in expected]
  assert all(np.array_equal(b["x"].numpy(), x[b["y"].numpy()]) for b in batches)
  assert ds.element_spec["x"].shape.as_list() == [None, 2]


@pytest.mark.parametrize("kwargs,match", [
    (dict(rounds=0), "rounds must be >= 1"),
    (dict(clients_per_round=11, clients=10), "clients_per_round must be in"),
    (dict(clients_per_round=0), "clients_per_round must be >= 1"),
    (dict(method_kwargs={"local_epochs": 0}), "local_epochs must be >= 1"),
    (dict(method="fedsgd", method_kwargs={"local_epochs": 2}),
     "method 'fedsgd' takes no local_epochs"),
    (dict(defense_kwargs={"clip": 1.0}), "given without a defense"),
    (dict(model="mlp", model_kwargs={"width": 3}), "model 'mlp' takes no width"),
    (dict(capture_rounds=(0, 3)), "capture_rounds must lie in"),
    (dict(method="fedprox"), "method='fedprox'"),
    (dict(dataset="imagenet"), "dataset='imagenet'"),
    (dict(batch_size=0), "batch_size must be >= 1"),
    (dict(data_kwargs={"max_per_speaker": 3}),
     "data_kwargs of dataset 'mnist5k' takes no max_per_speaker; its parameters: "
     "test_fraction"),
    (dict(dataset="docs", data_kwargs={"size": 8}), "size must be >= 32"),
    (dict(method="fedem", data_kwargs={"normalize": "mnist"}),
     "data_kwargs 'normalize' and method 'fedem': its input perturbation is "
     "stated in pixel units"),
    (dict(method="fedre", method_kwargs={"perturbation": "pixels"},
          data_kwargs={"normalize": [[0.5], [0.5]]}),
     "data_kwargs 'normalize' and method 'fedre'"),
])
def test_bad_config_raises(kwargs, match):
  with pytest.raises(ValueError, match=match):
    runner.RunConfig(out="unused", **kwargs)


def test_attack_round_reports_lpips_only_with_weights(fedsgd_run, tmp_path):
  from conftest import fake_lpips_weights
  from tff_privacy import evaluate
  config, _ = fedsgd_run
  updates = os.path.join(config.out, "updates")
  plain = evaluate.attack_round(updates, 2, str(tmp_path / "a"), "ig", [0],
                                {"iterations": 5})
  assert plain["lpips"].startswith("not computed")
  assert all("lpips" not in row for row in plain["samples"])
  fake_lpips_weights(tmp_path / "w.npz")
  with_weights = evaluate.attack_round(updates, 2, str(tmp_path / "b"), "ig", [0],
                                       {"iterations": 5},
                                       lpips_weights=str(tmp_path / "w.npz"))
  assert len(with_weights["samples"]) == config.batch_size
  assert all(row["lpips"] >= 0 for row in with_weights["samples"])
  assert np.isfinite(with_weights["mean"]["lpips"])


def test_attack_round_scores_the_region_crop(fedsgd_run, tmp_path):
  from skimage import metrics as skm
  from tff_privacy import evaluate
  config, _ = fedsgd_run
  updates = os.path.join(config.out, "updates")
  result = evaluate.attack_round(updates, 2, str(tmp_path / "r"), "ig", [0],
                                 {"iterations": 5}, region=[2, 1, 6, 4])
  pairs = np.load(tmp_path / "r" / "reconstructions.npz")
  for row, true, rec in zip(result["samples"], pairs["original"],
                            pairs["reconstructed"]):
    expected = skm.mean_squared_error(true[1:4, 2:6],
                                      np.clip(rec[1:4, 2:6], 0.0, 1.0))
    assert row["region_mse"] == pytest.approx(expected, rel=1e-6)  # npz: float32
  assert result["region"] == {"0": [[2, 1, 6, 4]]}
  assert result["mean"]["region_ssim"] == pytest.approx(
      np.mean([r["region_ssim"] for r in result["samples"]]))
  for box, message in (([0, 0, 9, 2], r"region\[0\]=\[0, 0, 9, 2\]"),
                       ([0, 0, 2, 5], "at least 3x3")):
    with pytest.raises(ValueError, match=message):
      evaluate.attack_round(updates, 2, str(tmp_path / "bad"), "ig", [0],
                            {"iterations": 5}, region=box)


@pytest.mark.parametrize("defense,kwargs", [
    ("ldp_gaussian", {"clip": 0.5, "noise_multiplier": 0.5}),
    ("sparsification", {"p": 0.9}),
    ("soteria", {"p": 0.5}),
    ("ldp_fed", {"alpha": 1.0, "clip": 0.05, "precision": 3}),
])
@pytest.mark.slow
def test_captured_upload_is_the_defended_gradient(tmp_path, defense, kwargs):
  from tff_privacy import defenses
  from tff_privacy.algorithms.client_data import client_seed
  config = runner.RunConfig(out=str(tmp_path), method="fedsgd", rounds=2,
                            capture_rounds=(2,), defense=defense,
                            defense_kwargs=kwargs, **SMALL)
  history = runner.run(config, progress=False)
  if defense == "ldp_gaussian":  # local DP of each client over both rounds
    assert history[-1]["epsilon"] == pytest.approx(
        _rdp_epsilon(dp_accounting.GaussianDpEvent(0.25), 2, config.dp_delta))
    assert "any two uploads of one client" in history[-1]["dp_relation"]
  elif defense == "ldp_fed":  # pure epsilon, basic composition
    num_params = 64 * 16 + 16 + 16 * 10 + 10
    assert history[-1]["epsilon"] == pytest.approx(2 * num_params * 1.0 * 2 * 50)
    assert history[-1]["delta"] == 0.0
  else:
    assert "epsilon" not in history[-1]
  # each defence changes every upload (noise, zeroed or quantised entries)
  assert [m["unperturbed_share"] for m in history] == [0.0, 0.0]
  assert not [k for k in history[0] if k.startswith(defense + "/")]
  store = UpdateStore(os.path.join(config.out, "updates"))
  truth = GroundTruthStore(os.path.join(config.out, "ground_truth"))
  weights, clean, defended = [], [], []
  for client in store.clients(2):
    record = store.read(2, client)
    transform = defenses.build(defense, record.model_spec, **kwargs)
    assert record.metadata["defense"]["name"] == defense
    x, y = truth.read(2, client)
    grads = _true_gradient(record, x, y)
    view = defenses.ClientView([tf.constant(w) for w in record.broadcast],
                               tf.data.Dataset.from_tensors({"x": x, "y": y}))
    want = transform.apply(grads, client_seed(config.seed, 2, client), view)
    for got, w in zip(record.upload, want):
      np.testing.assert_allclose(got, w.numpy(), atol=2e-6)
    weights.append(record.weight)
    clean.append(np.concatenate([g.numpy().ravel() for g in grads]))
    defended.append(np.concatenate([u.ravel() for u in record.upload]))
  # the aggregate against the clean gradients', in numpy
  c, d = (np.average(np.array(v, np.float64), axis=0, weights=weights)
          for v in (clean, defended))
  assert history[-1]["update_cosine"] == pytest.approx(
      c @ d / np.linalg.norm(c) / np.linalg.norm(d), rel=1e-5, abs=1e-6)
  assert history[-1]["update_relative_error"] == pytest.approx(
      np.linalg.norm(d - c) / np.linalg.norm(c), rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_dp_fedavg_records_clipped_updates_and_is_reproducible(tmp_path):
  kwargs = {"clip": 0.05, "noise_multiplier": 1.0}
  config = runner.RunConfig(out=str(tmp_path / "a"), method="fedsgd", rounds=2,
                            capture_rounds=(2,), defense="dp_fedavg",
                            defense_kwargs=kwargs, **SMALL)
  history = runner.run(config, progress=False)
  # seeded server noise: a run without capture (one TFF process to build,
  # not two) trains the same model
  again = runner.run(runner.RunConfig(**{**vars(config), "out": str(tmp_path / "b"),
                                         "capture_rounds": ()}), progress=False)
  assert _without_timing(again) == [
      {k: m[k] for k in a} for m, a in zip(_without_timing(history),
                                           _without_timing(again))]
  assert "test_loss" in again[-1] and "epsilon" in again[-1]
  assert history[-1]["epsilon"] == pytest.approx(
      _rdp_epsilon(dp_accounting.GaussianDpEvent(1.0), 2, config.dp_delta))
  assert "adding or removing one client" in history[-1]["dp_relation"]
  store = UpdateStore(os.path.join(config.out, "updates"))
  truth = GroundTruthStore(os.path.join(config.out, "ground_truth"))
  for client in store.clients(2):
    record = store.read(2, client)
    assert record.metadata["defense"] == {"name": "dp_fedavg", **kwargs}
    grads = _true_gradient(record, *truth.read(2, client))
    clipped, _ = tf.clip_by_global_norm(grads, 0.05)
    for got, want in zip(record.upload, clipped):  # clipped, not noised
      np.testing.assert_allclose(got, want.numpy(), atol=1e-7)


def test_local_dp_is_accounted_with_twice_the_clip():
  """Clip 1, noise multiplier 1, 20 rounds: a clipped upload's local
  sensitivity is 2, so each round is a Gaussian mechanism of multiplier 1/2."""
  config = runner.RunConfig(out="unused", method="fedsgd", rounds=20,
                            defense="ldp_gaussian",
                            defense_kwargs={"clip": 1.0, "noise_multiplier": 1.0},
                            **SMALL)
  spent = runner.Run(config).privacy_spent(20)
  assert spent["epsilon"] == pytest.approx(
      _rdp_epsilon(dp_accounting.GaussianDpEvent(0.5), 20, 1e-5))
  assert spent["delta"] == 1e-5
  assert "any two uploads of one client" in spent["dp_relation"]
  assert spent["dp_sampling"].startswith("none assumed")


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_local_laplace_is_accounted_with_twice_the_clip(norm):
  config = runner.RunConfig(out="unused", method="fedsgd", rounds=3,
                            defense="ldp_laplace",
                            defense_kwargs={"clip": 1.0, "noise_multiplier": 50.0,
                                            "norm": norm}, **SMALL)
  run = runner.Run(config)
  d = 64 * 16 + 16 + 16 * 10 + 10
  sensitivity = 2.0 * (np.sqrt(d) if norm == "l2" else 1.0)  # L1, of b = 50
  pld = dp_accounting.pld.PLDAccountant()
  pld.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.LaplaceDpEvent(50.0 / sensitivity), 3))
  assert run.privacy_spent(3)["epsilon"] == pytest.approx(pld.get_epsilon(1e-5))


def test_dp_fedavg_with_sampled_clients_is_accounted_without_replacement():
  config = runner.RunConfig(out="unused", method="fedsgd", rounds=5,
                            clients_per_round=2, defense="dp_fedavg",
                            defense_kwargs={"clip": 1.0, "noise_multiplier": 1.0},
                            **SMALL)
  spent = runner.Run(config).privacy_spent(5)
  # 2 of 4 clients without replacement: replace-one neighbours, for which
  # the clipped sum moves by up to twice the clip
  event = dp_accounting.SampledWithoutReplacementDpEvent(
      4, 2, dp_accounting.GaussianDpEvent(0.5))
  assert spent["epsilon"] == pytest.approx(_rdp_epsilon(
      event, 5, 1e-5, dp_accounting.NeighboringRelation.REPLACE_ONE))
  assert "replacing one client" in spent["dp_relation"]
  assert spent["dp_sampling"] == ("2 of 4 clients drawn uniformly without "
                                  "replacement each round")


# FedSGD captures and resumes on the module's run (fedsgd_run): see
# test_captured_upload_is_the_gradient_of_the_true_batch and
# test_resumed_run_ends_with_identical_metrics
@pytest.mark.slow
@pytest.mark.parametrize("method,kwargs", [
    ("fedavg", {}), ("fedem", {"perturb_steps": 1})])
def test_every_method_captures_two_rounds(tmp_path, method, kwargs):
  # 20 samples a client: FedAvg's 3 batches of 8, 8 and 4 (and the update
  # error's simulation of them) instead of the 45 of a quarter of the digits
  config = runner.RunConfig(out=str(tmp_path), method=method, rounds=2,
                            capture_rounds=(1, 2), method_kwargs=kwargs,
                            partition="label_groups", samples_per_client=20,
                            **{**SMALL, "model_kwargs": {"hidden": (16,)}})
  runner.run(config, progress=False)
  store = UpdateStore(os.path.join(config.out, "updates"))
  assert store.rounds() == [1, 2]
  want = 20 if method == "fedavg" else config.batch_size
  for round_num in (1, 2):
    assert store.read(round_num, 0).num_examples == want
  # the Python API with tuple arguments resumes its own config
  more = runner.run(runner.RunConfig(**{**vars(config), "rounds": 3}),
                    progress=False)
  assert [m["round"] for m in more] == [1, 2, 3]


def test_local_batch_sizes_by_hand():
  from tff_privacy.protocol import local_batch_sizes
  assert local_batch_sizes(10, 4, 2) == [4, 4, 2, 4, 4, 2]
  assert local_batch_sizes(8, 4, 1) == [4, 4]
  assert local_batch_sizes(3, 4, 2) == [3, 3]
  assert local_batch_sizes(10, 4, 3, one_batch=True) == [4]
  assert local_batch_sizes(3, 4, one_batch=True) == [3]
  with pytest.raises(ValueError, match="batch_size must be >= 1"):
    local_batch_sizes(3, 0)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [
    {"client_learning_rate": 0.3, "client_momentum": 0.5},
    {"client_learning_rate": 0.01, "client_optimizer": "adam"}])
def test_one_epoch_fedavg_delta_is_the_attackers_simulated_upload(tmp_path, optimizer):
  """With one local epoch the attacker's own simulation (`simulate_upload`
  on the client's samples in their order, batches by `local_batch_sizes`,
  the protocol's momentum or Adam) equals the delta TFF computed, for N % B
  != 0."""
  from tff_privacy.attacks import functional
  config = runner.RunConfig(
      out=str(tmp_path), method="fedavg", clients=30, clients_per_round=2,
      batch_size=5, rounds=1, capture_rounds=(1,), seed=3,
      method_kwargs=optimizer,
      dataset="digits",
      model="mlp", model_kwargs={"hidden": [16]})
  history = runner.run(config, progress=False)
  # the runner's own simulation, undefended: the aggregate at rounding
  assert history[0]["update_cosine"] == pytest.approx(1.0, abs=1e-10)
  assert history[0]["update_relative_error"] < 1e-5
  store = UpdateStore(os.path.join(config.out, "updates"))
  truth = GroundTruthStore(os.path.join(config.out, "ground_truth"))
  for client in store.clients(1):
    record = store.read(1, client)
    x, y = truth.read(1, client)
    assert len(y) % 5 != 0
    model = record.model_spec.keras()
    simulated = functional.simulate_upload(
        model, [tf.constant(w) for w in record.broadcast], tf.constant(x),
        tf.one_hot(y, 10), "model_delta", record.metadata["protocol"])
    for got, want in zip(record.upload, simulated):
      np.testing.assert_allclose(got, want.numpy(), atol=2e-5)


@pytest.mark.slow
def test_fedavg_schedule_matches_the_attackers_simulation(tmp_path):
  """N % B != 0 and two local epochs: the attacker's simulation of the
  client's local SGD, fed the client's true sample order, reproduces the
  model delta TFF computed and the store captured."""
  from tff_privacy.attacks import functional
  config = runner.RunConfig(
      out=str(tmp_path), method="fedavg", clients=30, clients_per_round=3,
      batch_size=5, rounds=1, capture_rounds=(1,), seed=3,
      method_kwargs={"local_epochs": 2, "client_learning_rate": 0.3},
      dataset="digits", model="mlp", model_kwargs={"hidden": [16]})
  history = runner.run(config, progress=False)
  # which the runner's simulation from the samples alone cannot: no value
  assert "update_cosine" not in history[0]
  assert history[0]["update_error_unavailable"] == (
      "each of the 2 local epochs shuffles a client's samples into new batches")
  run = runner.Run(config)
  store = UpdateStore(os.path.join(config.out, "updates"))
  for client in store.clients(1):
    record = store.read(1, client)
    x, y = run.fed.client_arrays(client)
    n = len(y)
    assert n % 5 != 0
    order = runner.local_order(n, run.algorithm, config, 1, client)
    per_epoch = [5] * (n // 5) + [n % 5]  # by hand: batches end with each epoch
    model = record.model_spec.keras()
    delta = functional.local_sgd(
        model, [tf.constant(w) for w in record.broadcast],
        tf.constant(x[order]), tf.one_hot(y[order], 10), 0.3, per_epoch * 2)
    for got, want in zip(record.upload, delta):
      np.testing.assert_allclose(got, want.numpy(), atol=2e-5)


@pytest.mark.parametrize("kwargs,reason", [
    (dict(method="fedavg", method_kwargs={"local_epochs": 2}), None),  # one batch
    (dict(method="fedavg", method_kwargs={"local_epochs": 2}, batch_size=8),
     "each of the 2 local epochs shuffles"),
    (dict(method="dp_sgd_fedavg", method_kwargs={"noise_multiplier": 1.0}),
     "method 'dp_sgd_fedavg' draws its DP-SGD batches at random"),
    (dict(method="fedsgd", defense="dp_fedavg",
          defense_kwargs={"clip": 1.0, "noise_multiplier": 1.0}),
     "defense 'dp_fedavg' noises the aggregate on the server"),
    (dict(method="fedre"), "the server aggregates by pda_pam"),
    (dict(method="hyperfl"), "method 'hyperfl' keeps private client state")])
def test_clean_uploads_are_simulated_only_where_the_protocol_fixes_them(
    tmp_path, kwargs, reason):
  config = runner.RunConfig(**{"out": str(tmp_path), **SMALL, "clients": 8,
                               "batch_size": 1000, **kwargs})
  run = runner.Run(config)
  clients = run.round_data(1)
  got = runner.clean_uploads_unavailable(run, clients)
  assert got is None if reason is None else got.startswith(reason)


class _Stopped(Exception):
  pass


@pytest.mark.slow
@pytest.mark.parametrize("method_kwargs,limit", [
    ({}, 1),  # PSI scores on the clients, and of every upload by PDA-PAM
    ({"budget_split": "even", "aggregation": "mean"}, -1)])  # no PSI
def test_fedre_runs_one_client_at_a_time_where_it_scores_psi(
    tmp_path, monkeypatch, method_kwargs, limit):
  limits = []

  def record(value):
    limits.append(value)
    raise _Stopped  # before any round: the limit is all this test needs

  monkeypatch.setattr(runtime, "limit_concurrent_calls", record)
  config = runner.RunConfig(**{"out": str(tmp_path), **SMALL, "method": "fedre",
                               "method_kwargs": method_kwargs})
  with pytest.raises(_Stopped):
    runner.run(config, progress=False)
  assert limits == [limit]


def _plain_scores(spec, weights, x, y) -> dict[str, float]:
  """The task's metrics in numpy from the Keras model's logits: accuracy or
  the positive class's pixel scores (0 where undefined), and the mean
  (positive-weighted, per pixel) cross-entropy."""
  model = spec.keras()
  for v, w in zip(model.trainable_variables, weights):
    v.assign(w)
  logits = model(x).numpy().astype(np.float64)
  log_p = logits - scipy.special.logsumexp(logits, -1, keepdims=True)
  ce = -np.take_along_axis(log_p, y[..., None].astype(np.int64), -1)[..., 0]
  predicted = logits.argmax(-1)
  if spec.task == "classification":
    return {"accuracy": np.mean(predicted == y), "loss": ce.mean()}
  weight = np.where(y == 1, spec.task_kwargs.get("positive_weight", 1.0), 1.0)
  tp = np.sum((predicted == 1) & (y == 1))
  fp = np.sum((predicted == 1) & (y != 1))
  fn = np.sum((predicted != 1) & (y == 1))

  def ratio(a, b):
    return a / b if b else 0.0
  precision, recall = ratio(tp, tp + fp), ratio(tp, tp + fn)
  return {"iou": ratio(tp, tp + fp + fn), "precision": precision,
          "recall": recall,
          "f_score": ratio(2 * precision * recall, precision + recall),
          "loss": (ce * weight).mean()}


@pytest.mark.parametrize("spec", [
    models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": [6]}),
    models.ModelSpec("unet", (8, 8, 3), 2, {"widths": (2, 3)}, "segmentation",
                     {"positive_weight": 3.0})])
def test_scores_by_group_score_each_group_and_none_without_samples(spec):
  # the per-client evaluation of a global model runs in one pass; each
  # group's metrics must be the metrics of its samples alone, and a group
  # without samples has none
  rng = np.random.default_rng(0)
  x = rng.random((23,) + spec.input_shape, dtype=np.float32)
  y = rng.integers(0, spec.num_classes, (23,) + spec.task_object.label_shape(
      spec.input_shape)).astype(np.int32)
  groups = rng.integers(0, 3, 23)
  groups[groups == 2] = 3  # groups 2 and 4 are empty
  evaluator = runner.Evaluator(spec)
  weights = spec.keras(1).get_weights()
  grouped = evaluator.scores_by_group(weights, x, y, groups, 5)
  assert grouped[2] is None and grouped[4] is None
  for g in (0, 1, 3):
    want = _plain_scores(spec, weights, x[groups == g], y[groups == g])
    assert grouped[g].keys() == want.keys()
    for name in want:
      np.testing.assert_allclose(grouped[g][name], want[name], rtol=1e-5,
                                 atol=1e-6, err_msg=f"group {g} {name}")
  with pytest.raises(ValueError, match="no samples to score"):
    evaluator.scores(weights, x[:0], y[:0])


@pytest.mark.parametrize("spec", [
    models.ModelSpec("mlp", (8, 8, 1), 10, {"hidden": [6]}),
    models.ModelSpec("unet", (8, 8, 3), 2, {"widths": (2, 3)}, "segmentation",
                     {"positive_weight": 3.0})])
def test_evaluation_in_chunks_scores_the_chosen_samples_as_one_set(spec,
                                                                   monkeypatch):
  # an evaluation holds a few samples at a time and may read a subset of a
  # larger array by index; its metrics must be those of the subset at once
  monkeypatch.setattr(run_evaluation, "EVAL_CHUNK", 4)
  rng = np.random.default_rng(1)
  x = rng.random((30,) + spec.input_shape, dtype=np.float32)
  y = rng.integers(0, spec.num_classes, (30,) + spec.task_object.label_shape(
      spec.input_shape)).astype(np.int32)
  chosen = rng.permutation(30)[:13]
  groups = rng.integers(0, 2, 13)
  evaluator = runner.Evaluator(spec)
  weights = spec.keras(2).get_weights()
  expected = {"all": _plain_scores(spec, weights, x[chosen], y[chosen])}
  got = {"all": evaluator.scores(weights, x, y, indices=chosen)}
  grouped = evaluator.scores_by_group(weights, x, y, groups, 2, indices=chosen)
  for g in (0, 1):
    expected[g] = _plain_scores(spec, weights, x[chosen[groups == g]],
                                y[chosen[groups == g]])
    got[g] = grouped[g]
  for key, want in expected.items():
    for name in want:
      np.testing.assert_allclose(got[key][name], want[name], rtol=1e-5,
                                 atol=1e-6, err_msg=f"{key} {name}")


def _client_models(config, spec) -> list[list[np.ndarray]]:
  """Each client's final model, read from the run's model file."""
  if os.path.exists(os.path.join(config.out, runner.MODEL_WEIGHTS)):
    return [runner.load_model_weights(config.out, spec)] * config.clients
  with np.load(os.path.join(config.out, runner.PERSONAL_MODELS)) as f:
    return [[f[f"{data.client_id(c)}/{n}"] for n in spec.variable_names()]
            for c in range(config.clients)]


@pytest.mark.parametrize("kwargs", [
    # digits: clients 0 and 5 of this Dirichlet split hold no test sample
    dict(SMALL, clients=15, seed=2, partition="dirichlet", alpha=0.1,
         method="fedavg"),
    dict(SMALL, clients=15, seed=2, partition="dirichlet", alpha=0.1,
         method="local_only"),
    # 2 test documents dealt among 4 clients
    dict(dataset="docs", data_kwargs={"num": 10}, model="unet",
         model_kwargs={"widths": [2, 4]}, clients=4, batch_size=4,
         method="local_only")], ids=["global", "personal", "segmentation"])
@pytest.mark.slow
def test_clients_without_test_data_are_left_out_of_personal_metrics(tmp_path,
                                                                   kwargs):
  config = runner.RunConfig(out=str(tmp_path), rounds=1, **kwargs)
  last = runner.run(config, progress=False)[-1]
  run = runner.Run(config)
  tested = [c for c in range(config.clients)
            if len(run.fed.client_test_arrays(c)[1])]
  models_ = _client_models(config, run.spec)
  scores = [_plain_scores(run.spec, models_[c], *run.fed.client_test_arrays(c))
            for c in tested]
  primary = run.spec.task_object.primary_metric
  for name in scores[0]:
    values = [s[name] for s in scores]
    assert last[f"personal_{name}_mean"] == pytest.approx(np.mean(values),
                                                          abs=1e-5), name
  values = [s[primary] for s in scores]
  assert last[f"personal_{primary}_min"] == pytest.approx(min(values), abs=1e-5)
  assert last[f"personal_{primary}_std"] == pytest.approx(np.std(values), abs=1e-5)
  assert last[f"personal_{primary}_by_client"] == pytest.approx(values, abs=1e-5)
  assert last["clients_without_test_data"] == config.clients - len(tested) > 0


def test_many_evaluators_log_no_retracing_warning_and_others_still_do(caplog):
  spec = models.ModelSpec("mlp", (28, 28, 1), 2, {"hidden": [4]})
  weights = spec.initial_weights(0)
  x, y = np.zeros((3, 28, 28, 1), np.float32), np.zeros(3, np.int32)
  for _ in range(7):  # TensorFlow warns from the sixth trace of one function
    runner.Evaluator(spec).scores(weights, x, y)
  assert "retracing" not in caplog.text

  @tf.function
  def square(v):
    return v * v
  for n in range(1, 8):  # a new shape each call: real retracing
    square(tf.zeros([n]))
  assert "triggered tf.function retracing" in caplog.text


MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


@pytest.fixture(scope="module")
def normalised_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("normalised"))
  config = runner.RunConfig(out=out, method="fedsgd", rounds=1, capture_rounds=(1,),
                            **{**SMALL, "clients": 2, "batch_size": 1},
                            data_kwargs={"normalize": "mnist"})
  runner.run(config, progress=False)
  return config


def test_a_normalised_run_records_its_normalisation(normalised_run):
  out = normalised_run.out
  assert io.read_json(os.path.join(out, "config.json"))["data_kwargs"] == {
      "normalize": "mnist"}
  record = UpdateStore(os.path.join(out, "updates")).read(1, 0)
  assert record.metadata["normalize"] == {"mean": [MNIST_MEAN], "std": [MNIST_STD]}
  assert record.metadata["value_range"] == [0.0, 1.0]
  x, _ = GroundTruthStore(os.path.join(out, "ground_truth")).read(1, 0)
  pixels = x * MNIST_STD + MNIST_MEAN  # what the client trained on, in [0, 1]
  assert pixels.min() >= -1e-6 and pixels.max() <= 1 + 1e-6 and x.min() < 0


def test_an_attack_on_a_normalised_run_scores_in_pixel_space(normalised_run,
                                                             tmp_path):
  from skimage import metrics as skm
  from tff_privacy import attacks, evaluate
  updates = os.path.join(normalised_run.out, "updates")
  result = evaluate.attack_round(updates, 1, str(tmp_path / "a"), "ig", [0],
                                 {"iterations": 20})
  record = UpdateStore(updates).read(1, 0)
  rec = attacks.build("ig", iterations=20)([record], seed=0)[0].x[0]
  x, _ = GroundTruthStore(os.path.join(normalised_run.out, "ground_truth")).read(1, 0)
  true = x[0, ..., 0] * MNIST_STD + MNIST_MEAN
  got = np.clip(rec[..., 0] * MNIST_STD + MNIST_MEAN, 0.0, 1.0)
  row = result["samples"][0]
  assert row["ssim"] == pytest.approx(
      skm.structural_similarity(true, got, win_size=7, data_range=1.0), abs=1e-5)
  assert row["mse"] == pytest.approx(np.mean((true - got) ** 2), rel=1e-4)
  assert result["normalize"] == {"mean": [MNIST_MEAN], "std": [MNIST_STD]}
  pairs = np.load(tmp_path / "a" / "reconstructions.npz")
  np.testing.assert_allclose(pairs["original"][0, ..., 0], true, atol=1e-6)


@pytest.mark.parametrize("extra,needed", [
    ({}, [False]), ({"capture_rounds": (1, 2)}, [True]),
    ({"capture_rounds": (2,)}, [False, True]),
    # local-after-training evaluates the uploads of evaluated rounds
    ({"evaluate": "local-after-training"}, [True]),
    ({"evaluate": "local-after-training", "evaluate_every": 2, "rounds": 3},
     [False, True])])
def test_a_run_builds_only_the_processes_its_rounds_run_on(tmp_path, extra, needed):
  config = runner.RunConfig(**{"out": str(tmp_path), "method": "fedavg",
                               "dataset": "digits", "model": "mlp", "clients": 2,
                               "rounds": 2, **extra})
  assert runner.Run(config).needed_processes() == needed


def test_a_round_whose_clients_all_diverged_has_no_train_loss():
  # TFF's client work drops a non-finite client's metrics: Keras then reads
  # the empty sums as loss 0 and accuracy 0, which must not be reported
  dropped = {"loss": 0.0, "sparse_categorical_accuracy": 0.0, "num_examples": 0.0}
  assert all(np.isnan(v) for v in runner.train_measurements(dropped).values())
  trained = {"loss": 0.7, "sparse_categorical_accuracy": 0.25, "num_examples": 8.0}
  assert runner.train_measurements(trained) == {"train_loss": 0.7,
                                                 "train_accuracy": 0.25}
  personal = {"loss": 0.5, "sparse_categorical_accuracy": 0.5}  # no count
  assert runner.train_measurements(personal)["train_loss"] == 0.5


@pytest.mark.slow
def test_a_run_whose_clients_all_diverge_reports_nan_train_loss(tmp_path):
  # every client's model change overflows: TFF drops each one's metrics (and
  # its update, so the server keeps its model)
  config = runner.RunConfig(out=str(tmp_path), rounds=1, method="fedavg",
                            method_kwargs={"client_learning_rate": 1e38}, **SMALL)
  entries = runner.run(config, progress=False)
  assert entries[-1]["server_update_rejected"] == 1
  assert np.isnan(entries[-1]["train_loss"])
  assert np.isnan(entries[-1]["train_accuracy"])
