"""The `tff-privacy` command end to end, in subprocesses as a user runs it."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from conftest import worker_children

CLI = [os.path.join(os.path.dirname(sys.executable), "tff-privacy")]
SMALL = ["--dataset", "digits", "--model", "mlp", "--model-kwargs",
         '{"hidden": [16]}', "--clients", "4", "--batch-size", "8", "--seed", "1",
         "--quiet"]


def _train(out, *extra, **kwargs):
  return subprocess.run(CLI + ["train", "--out", str(out)] + SMALL + list(extra),
                        capture_output=True, text=True, timeout=300, **kwargs)


def _orphaned_workers(since: float) -> list[int]:
  """TFF workers and their private_worker hosts adopted by init."""
  return [p.pid for p in psutil.process_iter(["cmdline", "ppid", "create_time"])
          if p.info["ppid"] == 1 and p.info["create_time"] >= since
          and any(os.path.basename(part) in ("worker_binary", "private_worker.py")
                  for part in (p.info["cmdline"] or [])[:3])]


def _metrics(out):
  with open(os.path.join(out, "metrics.json")) as f:
    return [{k: v for k, v in m.items() if k != "seconds"} for m in json.load(f)]


@pytest.mark.slow
def test_train_through_a_pipe_finishes_and_leaves_no_worker(tmp_path):
  start = time.time()
  # capture_output pipes stdout: a worker that kept it open would hang this.
  result = _train(tmp_path, "--method", "fedsgd", "--rounds", "1",
                  "--capture-rounds", "1")
  assert result.returncode == 0, result.stderr
  assert "test_accuracy=" in result.stdout and str(tmp_path) in result.stdout
  for name in ("metrics.json", "config.json", "updates/manifest.json",
               "updates/round_0001/client_0000.npz", "ground_truth/manifest.json"):
    assert os.path.exists(tmp_path / name), name
  assert not _orphaned_workers(start)


@pytest.mark.slow  # its parts run in the fast suite: test_runner's resume test
# and test_runtime's worker-dies-with-its-SIGKILLed-parent test
@pytest.mark.parametrize("method_args", [
    ["--method", "fedavg"],
    # private client state and hypernetwork checkpointed together
    ["--method", "hyperfl", "--partition", "label_groups",
     "--samples-per-client", "24", "--embedding-dim", "8", "--hidden-dim", "16"],
], ids=["fedavg", "hyperfl"])
def test_kill_9_mid_run_then_rerun_resumes_to_identical_metrics(tmp_path,
                                                                method_args):
  rounds = 12
  args = method_args + ["--rounds", str(rounds)]
  reference = tmp_path / "reference"
  assert _train(reference, *args).returncode == 0

  killed = tmp_path / "killed"
  proc = subprocess.Popen(CLI + ["train", "--out", str(killed)] + SMALL + args,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  # Wait for an event, not an interval: round 2's checkpoint (TFF writes it
  # to a temporary folder and renames it, so once it exists it is whole).
  checkpoint = killed / "checkpoints" / "program_state_2"
  deadline = time.monotonic() + 300  # a bound for a hung run, not a timing
  while not checkpoint.exists():
    assert proc.poll() is None, "the run ended before its round-2 checkpoint"
    assert time.monotonic() < deadline, "no round-2 checkpoint after 300 s"
    time.sleep(0.05)
  workers = worker_children(proc.pid)
  assert workers, "the CLI should have started a TFF worker"
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  gone, alive = psutil.wait_procs(workers, timeout=15)
  assert not alive, "the TFF worker outlived its SIGKILLed parent"
  assert 2 <= len(_metrics(killed)) < rounds

  result = _train(killed, *args)
  assert result.returncode == 0, result.stderr
  assert _metrics(killed) == _metrics(reference)


def _main(capsys, *argv):
  """Runs the CLI in this process; returns (exit code, stdout, stderr)."""
  from tff_privacy import cli
  try:
    code = cli.main(list(argv))
  except SystemExit as e:  # argparse's own errors
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err


def _train_argv(out, *extra):
  return ["train", "--out", str(out)] + SMALL + list(extra)


@pytest.mark.parametrize("extra,message", [
    (["--partition", "dirichlet", "--alpha", "0"], "alpha must be > 0"),
    (["--rounds", "2", "--capture-rounds", "5"], "capture_rounds must lie in"),
    (["--defense", "ldp_gaussian", "--clip", "1", "--sparsity", "0.5"],
     "--sparsity does not apply to --defense ldp_gaussian"),
    (["--dataset", "adult", "--defense", "recupfl", "--protect", "race",
      "--worker-addresses", "127.0.0.1:1"],
     "--defense recupfl and --worker-addresses: its clients read files"),
    (["--defense", "sparsification", "--sparsity", "1.5"], "p must lie in [0, 1)"),
    (["--defense", "soteria", "--prune-rate", "1.0"], "p must lie in [0, 1)"),
    (["--defense", "ldp_fed", "--cldp-alpha", "0"], "alpha must be > 0"),
    (["--defense", "ldp_gaussian", "--clip", "1"],
     "defense 'ldp_gaussian' needs noise_multiplier"),
    (["--clip", "1"], "--clip needs --defense"),
    (["--method", "fedsgd", "--perturb-steps", "3"],
     "--perturb-steps does not apply to --method fedsgd; it applies to fedem"),
    (["--method", "fedem", "--rho-min", "0.5", "--rho-max", "0.1"],
     "rho_min must lie in [0, rho_max=0.1]"),
    (["--method", "fedsgd", "--client-lr", "0.1"],
     "--client-lr does not apply to --method fedsgd; it applies to fedavg"),
    (["--method", "fedem", "--local-epochs", "2"],
     "--local-epochs does not apply to --method fedem; it applies to centaur, "
     "dp_sgd_fedavg, fedavg, fedre, local_only, pfedhn, pfedhn_pc, ppsgd"),
    (["--method", "fedsgd", "--method-kwargs", '{"local_epochs": 2}'],
     "method 'fedsgd' takes no local_epochs; its parameters: server_learning_rate"),
    (["--data-kwargs", '{"max_images": 3}'],
     "data_kwargs of dataset 'digits' takes no max_images; its parameters: "
     "test_fraction, normalize"),
    (["--data-kwargs", '{"normalize": "mnsit"}'],
     "data_kwargs of dataset 'digits': normalize='mnsit' is no preset"),
    (["--data-kwargs", '{"normalize": "cifar10"}'],
     "data_kwargs of dataset 'digits': normalize='cifar10' has 3 channel(s); "
     "the images have 1"),
    (["--model-kwargs", '{"hiden": [8]}'],
     "model_kwargs: model 'mlp' takes no hiden; its arguments: hidden, activation"),
    (["--method", "fedre", "--rounds", "3", "--budget-rounds", "2"],
     "budget_rounds=2 plans epsilon=50 over 2 rounds and the run has rounds=3"),
])
def test_bad_values_exit_2_with_one_line_naming_the_parameter(capsys, tmp_path,
                                                              extra, message):
  out = tmp_path / "run"
  code, _, err = _main(capsys, *_train_argv(out, *extra))
  assert code == 2
  assert message in err
  assert len(err.strip().splitlines()) == 1, err
  assert not out.exists()  # nothing written for a refused command


def _config_file(tmp_path, text):
  path = tmp_path / "config.json"
  path.write_text(text)
  return ["train", "--config", str(path)]


@pytest.mark.parametrize("config,message", [
    ('{"rounds": 2,}', "config.json: not valid JSON"),
    ('[1, 2]', "config.json: must hold a JSON object of RunConfig fields"),
    ('{"out": "x", "rounds": "ten"}', "rounds must be an integer >= 1, got 'ten'"),
    ('{"out": "x", "rounds": Infinity}', "rounds must be an integer >= 1, got inf"),
    ('{"out": "x", "rounds": 1e400}', "rounds must be an integer >= 1, got inf"),
    ('{"out": "x", "rounds": NaN}', "rounds must be an integer >= 1, got nan"),
    ('{"out": "x", "alpha": NaN}', "alpha must be a finite number > 0, got nan"),
    ('{"out": "x", "capture_rounds": 5}', "capture_rounds must be a list"),
    ('{"out": "x", "method": ["fedavg"]}',
     "method must be a string, got ['fedavg']"),
    ('{"out": "x", "method_kwargs": [1]}', "method_kwargs must be a JSON object"),
    ('{"out": "x", "method_kwargs": {"local_epochs": "2"}}',
     "local_epochs must be an integer >= 1, got '2'"),
    ('{"out": "x", "seed": 1, "lr": 2}', "unknown fields lr"),
])
def test_config_file_errors_name_the_file_or_field(capsys, tmp_path, config,
                                                   message):
  code, _, err = _main(capsys, *_config_file(tmp_path, config), "--client-lr",
                       "0.1")
  assert code == 2 and message in err, err
  assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,message", [
    (["--clip", "nan", "--defense", "dp_clip"], "clip must be a finite number > 0"),
    (["--defense", "ldp_gaussian", "--clip", "1", "--noise-multiplier", "inf"],
     "noise_multiplier must be a finite number >= 0, got inf"),
    (["--dp-delta", "nan"], "dp_delta must be a finite number in (0, 1)"),
    (["--model-kwargs", '{"hidden": 8}'], "model_kwargs {'hidden': 8}: model "
     "'mlp' cannot be built from them"),
    (["--model-kwargs", '{"activation": "wiggly"}'], "cannot be built"),
])
def test_non_finite_numbers_and_unbuildable_models_are_refused(capsys, tmp_path,
                                                               argv, message):
  out = tmp_path / "run"
  code, _, err = _main(capsys, *_train_argv(out, *argv))
  assert code == 2 and message in err, err
  assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_files_and_data_errors_name_the_file(capsys, tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  empty = tmp_path / "tfds"
  empty.mkdir()
  commands = [
      (_train_argv(a_file), f"out={str(a_file)!r} is a file"),
      (["train", "--config", str(tmp_path / "none.json")],
       "none.json: cannot be read"),
      (["train", "--out", str(tmp_path / "m"), "--dataset", "mnist", "--data-dir",
        str(empty), "--quiet"],
       f"data_dir={str(empty)!r} holds no prepared 'mnist'"),
      (["attack", "--updates", str(tmp_path / "nowhere"), "--round", "1", "--out",
        str(tmp_path / "a")], "nowhere/manifest.json: no manifest"),
  ]
  for argv, message in commands:
    code, _, err = _main(capsys, *argv)
    assert code == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_malformed_json_flag_is_an_argparse_error(capsys, tmp_path):
  code, _, err = _main(capsys, *_train_argv(tmp_path, "--method-kwargs", "{oops"))
  assert code == 2
  assert "--method-kwargs: takes a JSON object" in err.strip().splitlines()[-1]


def test_config_file_and_flags_merge(tmp_path):
  from tff_privacy import cli
  config = tmp_path / "run.json"
  config.write_text(json.dumps({
      "out": str(tmp_path / "run"), "method": "fedavg", "rounds": 5,
      "defense": "ldp_gaussian",
      "defense_kwargs": {"clip": 1.0, "noise_multiplier": 1.0},
      "method_kwargs": {"local_epochs": 2}}))
  parser = cli._parser()
  args = parser.parse_args(["train", "--config", str(config), "--rounds", "3",
                            "--noise-multiplier", "2", "--client-lr", "0.05"])
  run = cli._config_from_args(args)
  assert run.rounds == 3 and run.method == "fedavg"
  assert run.defense_kwargs == {"clip": 1.0, "noise_multiplier": 2.0}
  assert run.method_kwargs == {"local_epochs": 2, "client_learning_rate": 0.05}
  # --clip works with the defence named only in the config file
  args = parser.parse_args(["train", "--config", str(config), "--clip", "0.5"])
  assert cli._config_from_args(args).defense_kwargs == {"clip": 0.5,
                                                        "noise_multiplier": 1.0}
  # a flag naming another defence or method drops the file's parameters of
  # the one it replaces
  args = parser.parse_args(["train", "--config", str(config), "--defense",
                            "sparsification", "--sparsity", "0.9", "--method",
                            "fedsgd"])
  run = cli._config_from_args(args)
  assert run.defense_kwargs == {"p": 0.9} and run.method_kwargs == {}
  # and likewise the data set's options
  config.write_text(json.dumps({"out": str(tmp_path / "run"), "dataset": "audiomnist",
                                "data_kwargs": {"max_per_speaker": 5}}))
  args = parser.parse_args(["train", "--config", str(config), "--data-kwargs",
                            '{"test_fraction": 0.3}'])
  assert cli._config_from_args(args).data_kwargs == {"max_per_speaker": 5,
                                                     "test_fraction": 0.3}
  args = parser.parse_args(["train", "--config", str(config), "--dataset", "digits"])
  assert cli._config_from_args(args).data_kwargs == {}
  # a data set of another task changes the default model: the file's model
  # parameters were the old model's
  config.write_text(json.dumps({"out": str(tmp_path / "run"),
                                "model_kwargs": {"filters": 4}}))
  args = parser.parse_args(["train", "--config", str(config), "--model", "cnn"])
  assert cli._config_from_args(args).model_kwargs == {"filters": 4}
  args = parser.parse_args(["train", "--config", str(config), "--dataset", "docs"])
  run = cli._config_from_args(args)
  assert run.model == "unet" and run.model_kwargs == {}


DOCS_PROTOCOL_FIELDS = {"clients": 10, "partition": "groups", "rounds": 20,
                        "batch_size": 16, "positive_weight": 10.0,
                        "data_kwargs": {"size": 32}}
DOCS_PROTOCOL_METHOD = {"client_optimizer": "adam", "client_learning_rate": 0.005,
                        "local_epochs": 2}
# what only FedRE declares: PSI by its estimator on 16 pixels
DOCS_PROTOCOL_FEDRE = {"psi_pixels": 16}


def _docs_method_kwargs(method, **given):
  return {**DOCS_PROTOCOL_METHOD,
          **(DOCS_PROTOCOL_FEDRE if method == "fedre" else {}), **given}


@pytest.mark.parametrize("method", ["fedavg", "fedre"])
def test_docs_runs_take_the_documents_protocol_where_nothing_is_given(
    tmp_path, method):
  from tff_privacy import cli
  parser = cli._parser()
  base = ["train", "--out", str(tmp_path), "--method", method, "--dataset", "docs"]
  run = cli._config_from_args(parser.parse_args(base))
  assert {k: getattr(run, k) for k in DOCS_PROTOCOL_FIELDS} == DOCS_PROTOCOL_FIELDS
  assert run.method_kwargs == _docs_method_kwargs(method)
  saved = run.to_json()  # what config.json records
  assert {k: saved[k] for k in DOCS_PROTOCOL_FIELDS} == DOCS_PROTOCOL_FIELDS
  expected = _docs_method_kwargs(method)
  assert {k: saved["method_kwargs"][k] for k in expected} == expected
  # a flag, or a field of --config, overrides the protocol's value
  config = tmp_path / "run.json"
  config.write_text(json.dumps({"method": method, "rounds": 3,
                                "method_kwargs": {"local_epochs": 1}}))
  run = cli._config_from_args(parser.parse_args(
      base + ["--config", str(config), "--clients", "4", "--partition", "iid",
              "--client-lr", "0.01", "--data-kwargs", '{"num": 40}']))
  assert (run.clients, run.partition, run.rounds, run.batch_size) == (4, "iid", 3, 16)
  assert run.data_kwargs == {"size": 32, "num": 40}
  assert run.method_kwargs == _docs_method_kwargs(
      method, client_learning_rate=0.01, local_epochs=1)


def test_data_sets_without_a_protocol_keep_the_run_defaults(tmp_path):
  from tff_privacy import cli
  args = cli._parser().parse_args(["train", "--out", str(tmp_path), "--method",
                                   "fedsgd", "--dataset", "digits"])
  run = cli._config_from_args(args)
  assert (run.clients, run.partition, run.rounds, run.batch_size,
          run.positive_weight, run.method_kwargs) == (10, "iid", 20, 32, 1.0, {})


def test_a_boolean_flag_alone_means_true(tmp_path):
  from tff_privacy import cli
  parser = cli._parser()
  base = ["train", "--out", str(tmp_path), "--method", "fedre"]
  for extra, expected in (([], None), (["--allow-over-budget"], True),
                          (["--allow-over-budget", "false"], False),
                          (["--allow-over-budget", "true"], True)):
    args = parser.parse_args(base + extra)
    assert cli._config_from_args(args).method_kwargs.get(
        "allow_over_budget") == expected
  for extra, expected in (([], None), (["--adaptive-adversaries"], True),
                          (["--adaptive-adversaries", "false"], False)):
    assert parser.parse_args(base + extra).adaptive_adversaries is expected


def test_shadow_pools_reach_the_run_and_its_config_json(tmp_path):
  from tff_privacy import cli
  parser = cli._parser()
  base = ["train", "--out", str(tmp_path), "--dataset", "adult", "--method",
          "fedsgd", "--defense", "recupfl", "--protect", "race",
          "--capture-rounds", "1", "--infer-attributes", "race"]
  run = cli._config_from_args(parser.parse_args(base))
  assert run.attribute_shadow_pool == "train"
  assert run.to_json()["defense_kwargs"]["shadow_pool"] == "train"
  run = cli._config_from_args(parser.parse_args(
      base + ["--attribute-shadow-pool", "disjoint_test", "--shadow-pool",
              "disjoint_test"]))
  saved = run.to_json()
  assert saved["attribute_shadow_pool"] == "disjoint_test"
  assert saved["defense_kwargs"]["shadow_pool"] == "disjoint_test"
  with pytest.raises(SystemExit):
    parser.parse_args(base + ["--attribute-shadow-pool", "test"])
  # without attribute inference it has no effect, and runs from before it
  # existed resume
  plain = cli._config_from_args(parser.parse_args(["train", "--out", str(tmp_path)]))
  assert "attribute_shadow_pool" not in plain.to_json()


@pytest.mark.slow
def test_a_refused_value_leaves_the_folder_free_for_the_corrected_command(
    capsys, tmp_path):
  out = tmp_path / "run"
  code, _, err = _main(capsys, *_train_argv(out, "--method", "fedsgd", "--rounds",
                                            "1", "--defense", "ldp_gaussian",
                                            "--clip", "1", "--noise-multiplier",
                                            "-1"))
  assert code == 2 and "noise_multiplier must be >= 0" in err
  assert not (out / "config.json").exists()
  code, _, err = _main(capsys, *_train_argv(out, "--method", "fedsgd", "--rounds",
                                            "1", "--defense", "ldp_gaussian",
                                            "--clip", "1", "--noise-multiplier",
                                            "1"))
  assert code == 0, err
  with open(out / "config.json") as f:
    assert json.load(f)["defense_kwargs"] == {"clip": 1.0, "noise_multiplier": 1.0}


def test_fedem_flags_reach_the_method(tmp_path):
  from tff_privacy import cli, runner
  args = cli._parser().parse_args(_train_argv(
      tmp_path, "--method", "fedem", "--rounds", "1", "--perturb-steps", "2",
      "--rho-max", "0.05", "--perturb-norm", "l2", "--capture-rounds", "1"))
  # what the update store's manifest records of the run (training it only
  # builds the method's TFF processes, test_fedem's subject)
  protocol = runner.Run(cli._config_from_args(args)).run_metadata()["protocol"]
  assert (protocol["perturb_steps"], protocol["rho_max"], protocol["norm"]) == (
      2, 0.05, "l2")


@pytest.mark.slow
def test_segmentation_run_takes_the_unet_by_default_and_prints_its_scores(
    capsys, tmp_path):
  # a task with several personal metrics, only the primary one with a spread
  code, out, err = _main(capsys, "train", "--out", str(tmp_path), "--quiet",
                         "--dataset", "docs", "--data-kwargs", '{"num": 40}',
                         "--model-kwargs",
                         '{"widths": [4, 8]}', "--clients", "2", "--partition",
                         "groups", "--samples-per-client", "2", "--batch-size",
                         "2", "--rounds", "1")
  assert code == 0, err
  with open(os.path.join(tmp_path, "config.json")) as f:
    assert json.load(f)["model"] == "unet"
  with open(os.path.join(tmp_path, "metrics.json")) as f:
    last = json.load(f)[-1]
  assert f"test_f_score={last['test_f_score']:.4f}" in out
  assert (f"personal_f_score={last['personal_f_score_mean']:.4f}"
          f"+-{last['personal_f_score_std']:.4f}") in out


def test_train_summary_gives_each_evaluation_with_its_spread(capsys, tmp_path,
                                                              monkeypatch):
  """--evaluate reaches the run's config, and the summary line gives the
  last round's per-client means and spreads of both evaluations as
  metrics.json holds them."""
  from tff_privacy import runner, runtime
  given = []
  last = {"round": 2, "test_accuracy": 0.5, "personal_accuracy_mean": 0.5,
          "personal_accuracy_std": 0.125, "local_after_training_accuracy_mean": 0.75,
          "local_after_training_accuracy_std": 0.0625}
  monkeypatch.setattr(runtime, "start", lambda **kwargs: None)
  monkeypatch.setattr(runner, "run", lambda config, progress: given.append(config)
                      or [last])
  code, out, _ = _main(capsys, *_train_argv(tmp_path, "--rounds", "2",
                                            "--evaluate", "local-after-training"))
  assert code == 0
  assert given[0].evaluate == "local-after-training"
  assert "personal_accuracy=0.5000+-0.1250" in out
  assert "local_after_training_accuracy=0.7500+-0.0625" in out


def test_train_help_names_each_tasks_default_model(capsys):
  code, out, _ = _main(capsys, "train", "--help")
  assert code == 0
  text = " ".join(out.split())
  for default in ("unet for segmentation (docs, doctamper, tsroie)",
                  "mlp for binary_mse (adult)",
                  "cnn for classification (the other data sets)"):
    assert default in text


def test_unknown_method_is_rejected_by_the_parser(capsys, tmp_path):
  code, _, err = _main(capsys, *_train_argv(tmp_path, "--method", "bogus"))
  assert code == 2
  assert "invalid choice: 'bogus'" in err


@pytest.fixture(scope="module")
def lenet_run(tmp_path_factory):
  """A run that captured round 1 of FedSGD on LeNet: three clients of one
  digit each, for the attack commands."""
  from tff_privacy import cli
  run = tmp_path_factory.mktemp("lenet") / "run"
  assert cli.main(["train", "--out", str(run), "--method", "fedsgd", "--dataset",
                   "digits", "--model", "lenet", "--clients", "3", "--partition",
                   "one_per_client", "--batch-size", "1", "--rounds", "1",
                   "--capture-rounds", "1", "--quiet"]) == 0
  return run


@pytest.mark.slow
def test_attack_command_writes_scores_and_figure(capsys, tmp_path, lenet_run):
  run = lenet_run
  out = tmp_path / "attack"
  # as a user runs it: its own process, its output through a pipe (IG: its
  # Adam steps trace in a second, iDLG's L-BFGS loop in about ten)
  result = subprocess.run(
      CLI + ["attack", "--updates", str(run / "updates"), "--round", "1",
             "--client", "all", "--attack", "ig", "--iterations", "200",
             "--out", str(out)], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  with open(out / "attack.json") as f:
    report = json.load(f)
  assert report["clients"] == [0, 1, 2] and len(report["samples"]) == 3
  for sample in report["samples"]:
    assert {"mse", "psnr", "ssim", "recovered_label", "true_label"} <= set(sample)
  assert report["mean"]["ssim"] > 0.9  # undefended single-sample gradients leak
  assert report["lpips"].startswith("not computed") and "lpips" not in report["mean"]
  assert "lpips: not computed" in result.stdout
  # the plan and a time estimate come before the attack, a progress bar
  # during it; the summary names every file written
  assert "ig: 3 record(s), 1 image(s) per record" in result.stdout
  assert "ig: estimated time about" in result.stdout
  assert "600/600" in result.stderr  # tqdm: 3 records x 200 iterations
  files = result.stdout.strip().splitlines()[-1]
  for name in ("attack.json", "reconstructions.png", "reconstructions.npz"):
    assert name in files and (out / name).exists()
  assert (out / "reconstructions.png").stat().st_size > 1000
  with np.load(out / "reconstructions.npz") as arrays:
    assert arrays["original"].shape == arrays["reconstructed"].shape == (3, 8, 8, 1)
    mse = ((arrays["original"] - arrays["reconstructed"]) ** 2).mean(axis=(1, 2, 3))
  np.testing.assert_allclose(mse, [s["mse"] for s in report["samples"]], rtol=1e-4)
  code, _, err = _main(capsys, "attack", "--updates", str(run / "updates"),
                       "--round", "1", "--attack", "dlg", "--tv-weight", "0.1",
                       "--out", str(out))
  assert code == 2 and "--tv-weight does not apply" in err
  # quiet: no estimate, no progress
  code, stdout, err = _main(capsys, "attack", "--updates", str(run / "updates"),
                            "--round", "1", "--client", "0", "--attack", "ig",
                            "--iterations", "5", "--quiet", "--out",
                            str(tmp_path / "quiet"))
  assert code == 0, err
  assert "estimated time" not in stdout and "it/s" not in err


@pytest.mark.slow
def test_sharded_attack_merges_into_the_unsharded_result(capsys, tmp_path,
                                                         lenet_run):
  run = lenet_run
  attack = ["attack", "--updates", str(run / "updates"), "--round", "1",
            "--attack", "ig", "--iterations", "20", "--seed", "3", "--quiet"]
  assert _main(capsys, *attack, "--out", str(tmp_path / "whole"))[0] == 0
  for i in (0, 1):
    code, _, err = _main(capsys, *attack, "--shard", f"{i}/2",
                         "--out", str(tmp_path / f"shard{i}"))
    assert code == 0, err
  with open(tmp_path / "shard1" / "attack.json") as f:
    assert json.load(f)["clients"] == [1]
  code, stdout, err = _main(capsys, "merge-attacks", str(tmp_path / "shard1"),
                            str(tmp_path / "shard0"), "--out", str(tmp_path / "merged"))
  assert code == 0, err
  assert "records=3" in stdout
  with open(tmp_path / "whole" / "attack.json") as f:
    whole = json.load(f)
  with open(tmp_path / "merged" / "attack.json") as f:
    merged = json.load(f)
  assert merged["clients"] == [0, 1, 2]
  for result in (whole, merged):
    del result["seconds"]
  assert merged == whole
  with np.load(tmp_path / "whole" / "reconstructions.npz") as a, \
       np.load(tmp_path / "merged" / "reconstructions.npz") as b:
    for key in ("original", "reconstructed"):
      np.testing.assert_array_equal(a[key], b[key])
  assert (tmp_path / "merged" / "reconstructions.png").exists()
  # a missing shard, an unsharded result, another seed, a bad --shard
  for shards, message in (
      (["shard0"], "needs shards 0..1 once each; got 0"),
      (["shard0", "whole"], "is not a shard"),
      (["shard0", "shard0"], "needs shards 0..1 once each; got 0, 0")):
    code, _, err = _main(capsys, "merge-attacks",
                         *[str(tmp_path / s) for s in shards],
                         "--out", str(tmp_path / "bad"))
    assert code == 2 and message in err, err
  attack[attack.index("3")] = "4"
  assert _main(capsys, *attack, "--shard", "1/2", "--out", str(tmp_path / "other"))[0] == 0
  code, _, err = _main(capsys, "merge-attacks", str(tmp_path / "shard0"),
                       str(tmp_path / "other"), "--out", str(tmp_path / "bad"))
  assert code == 2 and "its 'seed' differs" in err
  code, _, err = _main(capsys, *attack, "--shard", "2/2", "--out", str(tmp_path / "x"))
  assert code == 2 and "--shard: takes i/N with 0 <= i < N" in err
  for text in ("6/7", "0/7"):
    code, _, err = _main(capsys, *attack, "--shard", text, "--out", str(tmp_path / "x"))
    assert code == 2 and f"shard={text}: the round has 3 records to attack; " \
        "use at most 3 shards" in err, err
  # a shard scored in a region joins no shard scored without one
  attack[attack.index("4")] = "3"
  code, _, err = _main(capsys, *attack, "--shard", "1/2", "--region", "0,0,8,8",
                       "--out", str(tmp_path / "region"))
  assert code == 0, err
  code, _, err = _main(capsys, "merge-attacks", str(tmp_path / "shard0"),
                       str(tmp_path / "region"), "--out", str(tmp_path / "bad"))
  assert code == 2 and "its 'region_setting' differs" in err, err
  # a shard whose npz lost a pair
  shutil.copytree(tmp_path / "shard1", tmp_path / "cut")
  with np.load(tmp_path / "cut" / "reconstructions.npz") as f:
    pairs = {k: f[k][:-1] for k in f.files}
  np.savez(tmp_path / "cut" / "reconstructions.npz", **pairs)
  code, _, err = _main(capsys, "merge-attacks", str(tmp_path / "shard0"),
                       str(tmp_path / "cut"), "--out", str(tmp_path / "bad"))
  assert code == 2 and "does not hold one pair per sample" in err, err
  assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_readme_tour_runs_and_leaks(tmp_path):
  """The training guide's tour as a user types it: FedSGD on mnist5k with 4-image
  batches, then Inverting Gradients on round 1, in a few minutes; the
  reconstructions resemble the originals (the demo's mean SSIM is 0.6).
  A FedAvg delta of hundreds of images is refused with a one-line error."""
  run = tmp_path / "fedsgd"
  trained = subprocess.run(
      CLI + ["train", "--method", "fedsgd", "--dataset", "mnist5k", "--model",
             "cnn", "--clients", "10", "--rounds", "50", "--batch-size", "4",
             "--partition", "dirichlet", "--alpha", "0.5", "--capture-rounds",
             "1,50", "--out", str(run), "--quiet"],
      capture_output=True, text=True, timeout=900)
  assert trained.returncode == 0, trained.stderr
  attacked = subprocess.run(
      CLI + ["attack", "--updates", str(run / "updates"), "--round", "1",
             "--client", "all", "--attack", "ig", "--iterations", "1000",
             "--out", str(run / "attack_ig")],
      capture_output=True, text=True, timeout=900)
  assert attacked.returncode == 0, attacked.stderr
  with open(run / "attack_ig" / "attack.json") as f:
    report = json.load(f)
  assert len(report["samples"]) == 40 and report["mean"]["ssim"] > 0.3

  fedavg = tmp_path / "fedavg"
  assert subprocess.run(
      CLI + ["train", "--method", "fedavg", "--dataset", "mnist5k", "--clients",
             "10", "--rounds", "1", "--capture-rounds", "1", "--out", str(fedavg),
             "--quiet"], capture_output=True, timeout=900).returncode == 0
  refused = subprocess.run(
      CLI + ["attack", "--updates", str(fedavg / "updates"), "--round", "1",
             "--out", str(fedavg / "attack")], capture_output=True, text=True,
      timeout=300)
  assert refused.returncode == 2
  assert "more than max_examples=64" in refused.stderr
