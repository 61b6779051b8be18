"""`tff-privacy audit`: audit.json's fields, what it says where an audit
does not apply, the membership-inference wrapper against scikit-learn, and
its one-line errors."""

import json
import math
import os

import dp_accounting
import numpy as np
import pytest
import sklearn.metrics

from tff_privacy import cli, io, runner
from tff_privacy.audit import membership, report
from tff_privacy.dp import queries

SMALL = dict(dataset="digits", model="mlp", model_kwargs={"hidden": [16]},
             clients=4, batch_size=8, seed=3)


def _config_only(tmp_path, **fields):
  """A run folder holding only config.json, as a run writes it."""
  config = runner.RunConfig(out=str(tmp_path),
                            **{"method": "fedsgd", "rounds": 2, **SMALL, **fields})
  io.write_json(os.path.join(tmp_path, "config.json"), config.to_json())
  return str(tmp_path)


@pytest.mark.slow  # the library's grid searches: about a minute on 2 cores
def test_the_threshold_attacks_auc_is_scikit_learns_of_the_loss():
  library, why = membership._library()
  assert library is not None, why
  rng = np.random.default_rng(0)
  labels_in, labels_out = rng.integers(0, 3, 200), rng.integers(0, 3, 200)
  # members: the right class ahead by a margin that varies; others: noise
  logits_in = rng.normal(0, 1, (200, 3)) + 3 * np.eye(3)[labels_in] * rng.random((200, 1))
  logits_out = rng.normal(0, 1, (200, 3))
  result = membership._attack(library, logits_in, logits_out, labels_in, labels_out, None)

  def loss(logits, labels):
    shifted = logits - logits.max(1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    return -log_p[np.arange(len(labels)), labels]

  scores = -np.concatenate([loss(logits_in, labels_in), loss(logits_out, labels_out)])
  member = np.r_[np.ones(200), np.zeros(200)]
  assert result["attacks"]["threshold"]["auc"] == pytest.approx(
      sklearn.metrics.roc_auc_score(member, scores), abs=1e-6)
  assert set(result["attacks"]) == {"threshold", "threshold-entropy", "lr", "mlp",
                                    "rf", "knn"}
  assert result["mia_auc"] == max(a["auc"] for a in result["attacks"].values())
  low, high = result["mia_auc_ci"]
  assert 0.5 < low < high <= 1.0  # the members stand out


def test_a_local_dp_run_is_audited_per_upload_and_a_missing_model_is_named(tmp_path):
  # z 4: one upload claims 1.99, within the 4.5 that 200 canaries can show
  run = _config_only(tmp_path, defense="ldp_gaussian",
                     defense_kwargs={"clip": 1.0, "noise_multiplier": 4.0})
  result = report.audit_run(run, canaries=200)
  assert result["canary_audit"]["computed"] and result["canaries"] == 200
  assert result["relation"].startswith("local DP")
  assert result["epsilon_claimed"] < result["canary_audit"]["epsilon_reachable"]
  assert result["epsilon_lower_bound"] <= result["epsilon_claimed"]
  assert result["claim_refuted"] is False
  assert not result["membership_inference"]["computed"]
  assert "model_weights.npz" in result["membership_inference"]["reason"]
  assert json.load(open(os.path.join(run, "audit.json")))["canaries"] == 200


@pytest.mark.parametrize("fields, reason", [
    ({}, "method 'fedsgd' claims no epsilon: no claim to audit"),
    ({"defense": "sparsification", "defense_kwargs": {"p": 0.5}},
     "makes no per-upload claim"),
])
def test_runs_without_a_claim_to_audit_say_why(tmp_path, fields, reason):
  run = _config_only(tmp_path, **fields)
  result = report.audit_run(run, canaries=2)
  assert not result["canary_audit"]["computed"]
  assert reason in result["canary_audit"]["reason"]
  assert result["epsilon_lower_bound"] is None


def test_fedres_own_mechanism_is_audited_per_upload_of_one_record(tmp_path):
  run = _config_only(tmp_path, method="fedre", method_kwargs={
      "aggregation": "mean", "epsilon": 10.0, "psi_samples": 2, "psi_pixels": 4})
  result = report.audit_run(run, canaries=100)
  assert result["canary_audit"]["computed"]
  assert (result["unit"], result["applied_to"]) == ("one record", "one upload")
  assert result["relation"].startswith("sample-level local DP, heuristic")
  # the PSI split's claim for one round, whatever the split: the Gaussian
  # mechanism at sqrt(2 T ln(L / delta)) / epsilon, T 2 rounds, L 4 tensors
  multiplier = math.sqrt(2 * 2 * math.log(4 / 1e-5)) / 10.0
  assert result["epsilon_claimed"] == pytest.approx(
      dp_accounting.pld.PLDAccountant().compose(
          dp_accounting.GaussianDpEvent(multiplier)).get_epsilon(1e-5), rel=1e-2)
  assert result["claim_refuted"] in (True, False)


@pytest.mark.slow  # 9 to 23 s: FedRE's PSI split, a round's steps per canary
@pytest.mark.parametrize("method, method_kwargs", [
    ("fedre", {"noise_on": "steps", "budget_split": "even", "aggregation": "mean"}),
    ("dp_sgd_fedavg", {"local_epochs": 1}),
])
def test_dp_sgd_in_the_local_steps_is_audited_per_record(tmp_path, method,
                                                         method_kwargs):
  run = _config_only(tmp_path, method=method, method_kwargs=method_kwargs)
  result = report.audit_run(run, canaries=100)
  assert result["canary_audit"]["computed"]
  assert (result["unit"], result["applied_to"]) == ("one record", "one upload")
  assert result["relation"].startswith("sample-level: add or remove one")


def test_a_dp_fedavg_run_is_audited_one_round_at_a_time(tmp_path):
  # z 2: one round claims 2.13 for adding or removing a client
  run = _config_only(tmp_path, defense="dp_fedavg",
                     defense_kwargs={"clip": 1.0, "noise_multiplier": 2.0})
  result = report.audit_run(run, canaries=200)
  assert result["canary_audit"]["computed"]
  assert (result["unit"], result["applied_to"]) == ("a client's data", "one round")
  assert 0 <= result["epsilon_lower_bound"] <= result["epsilon_claimed"]


@pytest.mark.parametrize("argv, message", [
    (["--canaries", "1"], "argument --canaries: takes an integer >= 2, got '1'"),
    (["--mia-samples", "5"], "argument --mia-samples: takes an integer >= 20, got '5'"),
    ([], "no run here (config.json is missing)"),
])
def test_audit_errors_name_the_flag_or_folder(capsys, tmp_path, argv, message):
  try:
    code = cli.main(["audit", "--run", str(tmp_path / "none")] + argv)
  except SystemExit as e:  # argparse's own errors
    code = e.code
  err = capsys.readouterr().err
  assert code == 2 and message in err and "Traceback" not in err
  assert message in err.strip().splitlines()[-1]


@pytest.mark.slow
def test_the_audit_command_on_a_trained_local_dp_run(capsys, tmp_path):
  run = tmp_path / "run"
  config = runner.RunConfig(out=str(run), method="fedsgd", rounds=2,
                            capture_rounds=(2,), defense="ldp_gaussian",
                            defense_kwargs={"clip": 1.0, "noise_multiplier": 4.0},
                            **SMALL)
  history = runner.run(config, progress=False)
  assert cli.main(["audit", "--run", str(run), "--canaries", "300",
                   "--mia-samples", "200"]) == 0
  out = capsys.readouterr().out
  assert "audited lower bound" in out and "membership inference: AUC" in out
  audit = json.load(open(run / "audit.json"))
  # one upload's claim: the Gaussian mechanism at noise multiplier z / 2,
  # 1.99, within what 300 canaries can show
  assert audit["epsilon_claimed"] > audit["epsilon_lower_bound"] > 0
  assert audit["epsilon_claimed"] < audit["canary_audit"]["epsilon_reachable"]
  mia = audit["membership_inference"]
  assert mia["computed"] and (run / "mia_roc.png").exists()
  # the attacked model is the run's final one: its test accuracy is the run's
  assert mia["model_test_accuracy"] == pytest.approx(history[-1]["test_accuracy"],
                                                     abs=1e-6)
  assert 0 <= audit["mia_auc"] <= 1


def test_a_personalised_run_is_attacked_through_each_clients_own_model(tmp_path):
  run = _config_only(tmp_path, method="hyperfl", rounds=1, clients_per_round=2)
  config = membership.run_config(run)
  fed = membership.federated.load(config.dataset, config.clients, config.partition,
                                  config.alpha, config.seed, config.data_dir,
                                  config.samples_per_client, config.data_kwargs)
  spec = membership.spec_of(config, fed.source)
  own = {c: spec.initial_weights(10 + c) for c in range(config.clients)}
  io.write_npz(os.path.join(run, runner.PERSONAL_MODELS), {
      f"client_{c:04d}/{name}": w for c, weights in own.items()
      for name, w in zip(spec.variable_names(), weights)})
  (logits_in, labels_in), (logits_out, labels_out), accuracy = \
      membership._personal_logits(run, config, fed, spec, np.random.default_rng(0), 10**6)
  trained = runner.sample_clients(config, 1)
  assert len(trained) == 2
  # every training and own-test sample of the round's two clients, in order
  owners_in = [(c, i) for c in trained for i in fed.client_indices[c]]
  owners_out = [(c, i) for c in trained for i in fed.client_test_indices[c]]
  assert len(labels_in) == len(owners_in) and len(labels_out) == len(owners_out)

  def by_own_model(pairs, x):
    model = spec.keras()
    rows = []
    for c, i in pairs:
      model.set_weights(own[c])
      rows.append(model(x[i][None]).numpy()[0])
    return np.stack(rows)

  np.testing.assert_allclose(logits_in, by_own_model(owners_in, fed.source.x_train),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits_out, by_own_model(owners_out, fed.source.x_test),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(labels_in, fed.source.y_train[[i for _, i in owners_in]])
  accuracies = [np.mean(np.argmax(by_own_model([(c, i) for i in fed.client_test_indices[c]],
                                               fed.source.x_test), 1)
                        == fed.source.y_test[fed.client_test_indices[c]]) for c in trained]
  assert accuracy == pytest.approx(np.mean(accuracies))


@pytest.mark.slow  # a 2-round training through TFF
def test_canary_clients_train_with_dp_fedavg_and_audit_the_whole_training(tmp_path):
  run = tmp_path / "run"
  config = runner.RunConfig(out=str(run), method="fedavg", rounds=2,
                            defense="dp_fedavg", defense_kwargs={
                                "clip": 1.0, "noise_multiplier": 0.1,
                                "audit_canaries": 40}, **SMALL)
  runner.run(config, progress=False)
  audit = report._training_audit(str(run), membership.run_config(str(run)))
  assert audit["computed"] and audit["canaries"] == 40
  # the runner's cosines of each round's descent, scored by their largest
  cosines = np.load(run / runner.CANARY_COSINES)["cosines"]
  assert cosines.shape == (2, 40) and audit["every_round"]["canaries"] == 40
  # every client takes part in both rounds: a canary's claim is the
  # Gaussian mechanism at z 0.1 composed twice, dp_accounting's
  event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.1), 2)
  assert audit["epsilon_claimed"] == pytest.approx(
      dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(1e-5), rel=1e-3)
  # the inserted canaries are in the model's descent, the held-out ones not
  spec = membership.spec_of(config)
  initial, final = spec.initial_weights(3), runner.load_model_weights(str(run), spec)
  descent = np.concatenate([np.ravel(a - b) for a, b in zip(initial, final)])
  directions = np.concatenate([d.numpy().reshape(40, -1) for d in queries.canary_directions(
      [w.shape for w in initial], 40, 3)], axis=1)
  inserted = queries.inserted_canaries(40, 3)
  scores = directions @ descent
  assert scores[inserted].min() > scores[~inserted].max()


@pytest.mark.parametrize("method", ["ppsgd", "hyperfl"])
def test_canary_clients_are_refused_where_the_server_averages_weights(tmp_path, method):
  config = runner.RunConfig(out=str(tmp_path), method=method, rounds=1,
                            defense="dp_fedavg", defense_kwargs={
                                "clip": 1.0, "noise_multiplier": 1.0,
                                "audit_canaries": 10}, **SMALL)
  with pytest.raises(ValueError, match=f"audit_canaries: method '{method}' uploads"):
    runner.Run(config)
