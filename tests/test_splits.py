"""The user's own federation: split files and TFF ClientData."""

import collections
import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_federated as tff

from tff_privacy import data, io, runner
from tff_privacy.data import sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(dataset="digits", model="mlp", model_kwargs={"hidden": [16]},
             batch_size=8, seed=3)
# four clients of digits: their train and test indices
SPLIT = [([0, 5, 9, 14, 20, 21, 30, 31, 40], [0, 1, 2]),
         ([1, 2, 3, 50, 51, 52, 53], [3, 4]),
         ([100, 7, 101, 102, 103], [5, 6, 7, 8]),
         ([200, 201, 202, 203, 204, 205], [])]


def _write(path, clients) -> str:
  """A split file written by hand (not by the library)."""
  with open(path, "w") as f:
    json.dump({"clients": [{"train": a, "test": b} for a, b in clients]}, f)
  return str(path)


def test_a_split_file_gives_each_client_its_listed_samples(tmp_path):
  path = _write(tmp_path / "split.json", SPLIT)
  fed = data.load("digits", 4, f"file:{path}")
  src = sources.load_digits()
  for k, (train, test) in enumerate(SPLIT):
    np.testing.assert_array_equal(fed.client_arrays(k)[0], src.x_train[train])
    np.testing.assert_array_equal(fed.client_arrays(k)[1], src.y_train[train])
    np.testing.assert_array_equal(fed.client_test_arrays(k)[1], src.y_test[test])
  # the global model is tested on the clients' test samples, pooled
  np.testing.assert_array_equal(fed.test[1], src.y_test[list(range(9))])


@pytest.mark.parametrize("content,message", [
    ('{"clients": [', "split file {}: not valid JSON"),
    ('[1, 2]', "split file {}: must hold a JSON object with a non-empty list"),
    ('{"clients": []}', "split file {}: must hold a JSON object with a non-empty"),
    ('{"clients": [{"train": [1]}]}',
     "split file {}: client 0 must be an object with the lists 'train' and 'test'"),
    ('{"clients": [{"train": [1], "test": []}, {"train": [], "test": [1]}]}',
     "split file {}: client 1 has no training samples"),
    ('{"clients": [{"train": [1, -2], "test": []}]}',
     "split file {}: client 0's train must be a list of indices >= 0"),
    ('{"clients": [{"train": [1], "test": [2.5]}]}',
     "split file {}: client 0's test must be a list of indices >= 0"),
    ('{"clients": [{"train": [1, 4, 1], "test": [0]}]}',
     "split file {}: client 0's train lists an index more than once"),
])
def test_malformed_split_files_are_refused_in_one_line(tmp_path, content, message):
  path = tmp_path / "split.json"
  path.write_text(content)
  with pytest.raises(ValueError) as e:
    runner.RunConfig(out=str(tmp_path / "run"), partition=f"file:{path}", **SMALL)
  assert message.format(path) in str(e.value)
  assert "\n" not in str(e.value)


def test_indices_outside_the_data_set_are_refused_naming_the_client(tmp_path):
  n_train, n_test = len(sources.load_digits().y_train), len(sources.load_digits().y_test)
  path = _write(tmp_path / "split.json", [([0], [0]), ([1, n_train], [1])])
  with pytest.raises(ValueError, match=f"client 1's train index {n_train} is out "
                     f"of range: the data set has {n_train} train samples"):
    data.load("digits", 2, f"file:{path}")
  path = _write(tmp_path / "split.json", [([0], [0]), ([1], [n_test + 4])])
  with pytest.raises(ValueError, match=f"client 1's test index {n_test + 4} is"):
    data.load("digits", 2, f"file:{path}")
  path = _write(tmp_path / "split.json", [([0], []), ([1], [])])
  with pytest.raises(ValueError, match="no client has test samples"):
    data.load("digits", 2, f"file:{path}")


def test_a_client_tested_on_one_of_its_training_samples_is_refused(tmp_path):
  x = np.arange(6 * 4, dtype=np.float32).reshape(6, 2, 2, 1)
  # test sample 1 is training sample 4
  src = sources.Source("toy", x[:5], np.zeros(5, np.int32),
                       np.stack([x[5], x[4]]), np.zeros(2, np.int32), 2, 1.0)
  path = _write(tmp_path / "split.json", [([0, 1], [1]), ([2, 3, 4], [0, 1])])
  with pytest.raises(ValueError, match=r"client 1's test samples include one of "
                     "its training samples"):
    data.federated.from_split(src, path, 2)
  path = _write(tmp_path / "split.json", [([0, 1, 4], [0]), ([2, 3], [1])])
  assert data.federated.from_split(src, path, 2).num_clients == 2


def test_the_clients_come_from_the_split_file_with_its_sha256(tmp_path):
  path = _write(tmp_path / "split.json", SPLIT)
  config = runner.RunConfig(out=str(tmp_path / "run"), partition=f"file:{path}",
                            **SMALL)
  assert config.clients == 4
  saved = config.to_json()
  with open(path, "rb") as f:
    assert saved["split_sha256"] == hashlib.sha256(f.read()).hexdigest()
  assert saved["partition"] == f"file:{path}" and saved["clients"] == 4
  with pytest.raises(ValueError, match=f"clients=5, but split file {path} holds "
                     "4 clients; leave clients out"):
    runner.RunConfig(out=str(tmp_path / "run"), partition=f"file:{path}",
                     clients=5, **SMALL)
  assert "split_sha256" not in runner.RunConfig(out="x", **SMALL).to_json()


def test_a_resumed_run_refuses_a_changed_split_file(tmp_path):
  path = _write(tmp_path / "split.json", SPLIT)
  config = runner.RunConfig(out=str(tmp_path / "run"), partition=f"file:{path}",
                            **SMALL)
  os.makedirs(config.out)
  io.write_json(os.path.join(config.out, "config.json"), config.to_json())
  runner.check_config(config)  # the same split resumes
  _write(path, SPLIT[:3] + [([200, 201, 202, 203, 204, 206], [])])
  changed = runner.RunConfig(out=config.out, partition=f"file:{path}", **SMALL)
  with pytest.raises(ValueError, match="holds a run with another config "
                     r"\(differs in split_sha256: "):
    runner.check_config(changed)
  # a config file that pins the old hash names the change itself
  with pytest.raises(ValueError, match=f"split file {path} has changed"):
    dataclasses.replace(changed, split_sha256=config.split_sha256)


def _main(capsys, *argv):
  from tff_privacy import cli
  code = cli.main(list(argv))
  return code, *capsys.readouterr()


@pytest.mark.parametrize("extra,message", [
    (["--clients", "3"], "clients=3, but split file {} holds 4 clients"),
    (["--partition", "file:{}.missing"],
     "split file {}.missing: cannot be read (No such file or directory)"),
])
def test_the_command_line_refuses_a_split_in_one_line(capsys, tmp_path, extra,
                                                      message):
  path = _write(tmp_path / "split.json", SPLIT)
  out = tmp_path / "run"
  argv = ["train", "--out", str(out), "--dataset", "digits", "--model", "mlp",
          "--model-kwargs", '{"hidden": [16]}', "--partition", f"file:{path}",
          *[a.format(path) for a in extra]]
  code, _, err = _main(capsys, *argv)
  assert code == 2 and message.format(path) in err
  assert len(err.strip().splitlines()) == 1, err
  assert not out.exists()


def test_a_split_file_takes_the_place_of_a_protocols_clients(tmp_path):
  path = _write(tmp_path / "split.json", SPLIT)
  fields = runner.with_protocol({"dataset": "docs", "partition": f"file:{path}",
                                 "out": str(tmp_path / "run")})
  assert "clients" not in fields and fields["rounds"] == 20


@pytest.mark.slow
def test_the_hyperfl_split_script_deals_label_groups_as_the_paper(tmp_path):
  path = tmp_path / "split.json"
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "write_split.py"),
       "--out", str(path), "--dataset", "digits"],
      capture_output=True, text=True, timeout=300,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
  assert result.returncode == 0, result.stderr
  clients = json.loads(path.read_text())["clients"]
  src = sources.load_digits()
  assert len(clients) == 20
  for i, client in enumerate(clients):
    group = [(2 * (i % 5) + j) % 10 for j in range(3)]  # [0,1,2], [2,3,4], ...
    # 20% (30 train, 10 test) over the 10 classes, the rest over the group's
    # three labels, the last taking the remainder
    train = np.bincount(src.y_train[client["train"]], minlength=10)
    test = np.bincount(src.y_test[client["test"]], minlength=10)
    assert train.tolist() == [3 + 40 * (k in group) for k in range(10)]
    assert test.tolist() == [1 + (13 + (k == group[2])) * (k in group)
                             for k in range(10)]


def _client_data(arrays: dict[str, tuple[np.ndarray, np.ndarray]]):
  """ClientData holding each client's (x, y), built as a TFF user builds it
  from arrays."""
  return tff.simulation.datasets.TestClientData({
      client: collections.OrderedDict(x=x, y=y) for client, (x, y) in arrays.items()})


def _as_client_data(split):
  """The clients of `split` on digits, as ClientData named a, b, c, d."""
  src = sources.load_digits()
  names = "abcd"
  return (_client_data({n: (src.x_train[tr], src.y_train[tr])
                        for n, (tr, _) in zip(names, split)}),
          _client_data({n: (src.x_test[te], src.y_test[te])
                        for n, (_, te) in zip(names, split) if te}))


def test_client_data_gives_the_clients_their_own_samples():
  train, test = _as_client_data(SPLIT)
  fed = data.from_client_data(sources.load_digits(), train, test)
  src = sources.load_digits()
  assert fed.num_clients == 4
  for k, (tr, te) in enumerate(SPLIT):
    np.testing.assert_array_equal(fed.client_arrays(k)[0], src.x_train[tr])
    np.testing.assert_array_equal(fed.client_test_arrays(k)[1], src.y_test[te])
  np.testing.assert_array_equal(fed.test[1], src.y_test[list(range(9))])


@pytest.mark.parametrize("change,message", [
    (lambda x, y: (x[..., 0], y), "train_data: elements must be single samples "
     "OrderedDict(x=float32 [8, 8, 1], y=int32 []), the inputs and labels of "
     "dataset 'digits' that the model takes; got"),
    (lambda x, y: (x.astype(np.float64), y), "train_data: elements must be"),
    (lambda x, y: (x, y + 9), "train_data: client 'a' has labels outside [0, 10)"),
])
def test_client_data_of_another_kind_is_refused_in_one_line(change, message):
  src = sources.load_digits()
  train = _client_data({"a": change(src.x_train[:5], src.y_train[:5])})
  test = _client_data({"a": (src.x_test[:2], src.y_test[:2])})
  with pytest.raises(ValueError) as e:
    data.from_client_data(src, train, test)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_test_clients_must_be_training_clients():
  src = sources.load_digits()
  train = _client_data({"a": (src.x_train[:5], src.y_train[:5])})
  test = _client_data({"z": (src.x_test[:2], src.y_test[:2])})
  with pytest.raises(ValueError, match="test_data has clients that train_data "
                     "lacks: z"):
    data.from_client_data(src, train, test)


def test_client_data_replaces_no_other_partition(tmp_path):
  train, test = _as_client_data(SPLIT)
  config = runner.RunConfig(out=str(tmp_path), partition="dirichlet", **SMALL)
  with pytest.raises(ValueError, match="partition='dirichlet' and train_data: "
                     "the ClientData gives the clients"):
    runner.run(config, train_data=train, test_data=test)
  with pytest.raises(ValueError, match="give both ClientData"):
    runner.run(runner.RunConfig(out=str(tmp_path), **SMALL), train_data=train)
  assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_a_split_file_and_the_same_clients_as_client_data_train_alike(tmp_path):
  path = _write(tmp_path / "split.json", SPLIT)
  by_file = runner.RunConfig(out=str(tmp_path / "file"), method="fedavg",
                             rounds=1, partition=f"file:{path}", **SMALL)
  by_client_data = runner.RunConfig(out=str(tmp_path / "client_data"),
                                    method="fedavg", rounds=1, **SMALL)
  train, test = _as_client_data(SPLIT)
  a = runner.run(by_file, progress=False)
  b = runner.run(by_client_data, progress=False, train_data=train, test_data=test)
  for entry in a + b:
    entry.pop("seconds")
  assert a == b and a[-1]["clients_without_test_data"] == 1
  saved = io.read_json(os.path.join(by_client_data.out, "config.json"))
  assert saved["partition"] == "client_data" and saved["clients"] == 4
  # a resume needs the same clients: one sample changed is refused
  src = sources.load_digits()
  changed = _client_data({n: (src.x_train[tr], src.y_train[tr]) for n, (tr, _)
                          in zip("abcd", SPLIT[:3] + [([1] + SPLIT[3][0][1:], [])])})
  with pytest.raises(ValueError, match="differs in split_sha256"):
    runner.run(dataclasses.replace(by_client_data, rounds=2), progress=False,
               train_data=changed, test_data=test)
