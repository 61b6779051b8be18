"""FedAvg rounds of the HyperFL authors' PyTorch code, timed: the baseline
that `hyperfl_authors_fedavg.py` starts in the separate PyTorch virtualenv
of `make venv-torch`. It imports nothing of this library, and the library
never imports it.

It runs the authors' own round (`cnn/running.py`'s `train_round_fedavg`:
each client's `LocalUpdate_FedAvg.local_training`, SGD at their lr 0.02,
momentum 0.5, weight decay 5e-4, then `average_weights_weighted`) with their
`CNN_FMNIST` on the clients of `--clients-file`, and their
`torch.set_num_threads` (4 in their `federated_main.py`). Two departures,
both of which can only make their round faster: each client's evaluation
before and after training (`local_test`) is skipped, since the round it is
compared with evaluates nothing; and the samples are ready float tensors,
where their loaders turn each one from an image when it is read.

  python authors_fedavg_round.py --authors-code DIR --clients-file NPZ
      --rounds N --times-file JSON [--threads 4] [--batch-size 50]
      [--local-epochs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import sys
import time
import types

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset


def _clients(path: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
  """Each client's (x NCHW float32, y int64) from the NPZ's x0, y0, x1, ..."""
  arrays = np.load(path)
  return [(torch.from_numpy(arrays[f"x{c}"]).permute(0, 3, 1, 2).contiguous(),
           torch.from_numpy(arrays[f"y{c}"]).long())
          for c in range(len(arrays.files) // 2)]


def _positive(text: str) -> int:
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"takes an integer >= 1, got {text!r}")
  return int(text)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--authors-code", required=True)
  parser.add_argument("--clients-file", required=True)
  parser.add_argument("--rounds", type=_positive, required=True)
  parser.add_argument("--times-file", required=True)
  parser.add_argument("--threads", type=_positive, default=4)
  parser.add_argument("--batch-size", type=_positive, default=50)
  parser.add_argument("--local-epochs", type=_positive, default=5)
  args = parser.parse_args()
  sys.path.insert(0, os.path.join(args.authors_code, "cnn"))
  from methods.fedavg import LocalUpdate_FedAvg  # the authors' modules
  from models.cnn import CNN_FMNIST
  from running import train_round_fedavg

  torch.set_num_threads(args.threads)
  np.random.seed(520)  # their seed
  torch.manual_seed(520)
  LocalUpdate_FedAvg.local_test = lambda self, *unused, **unused_kw: 0.0
  clients = _clients(args.clients_file)
  settings = types.SimpleNamespace(
      num_users=len(clients), frac=1.0, epochs=args.rounds + 1,
      local_epoch=args.local_epochs, lr=0.02, local_iter=1,
      device=torch.device("cpu"))
  model = CNN_FMNIST()
  local = [LocalUpdate_FedAvg(
      idx=c, args=settings, test_set=None, model=copy.deepcopy(model),
      train_set=DataLoader(TensorDataset(x, y), batch_size=args.batch_size,
                           shuffle=True))
           for c, (x, y) in enumerate(clients)]
  times = []
  for round_num in range(args.rounds + 1):  # the first one warms up
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # their per-round prints
      train_round_fedavg(settings, model, local, round_num)
    times.append(time.perf_counter() - start)
  with open(args.times_file, "w") as f:
    json.dump(times[1:], f)


if __name__ == "__main__":
  main()
