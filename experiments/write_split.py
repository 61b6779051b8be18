"""Writes a split file with HyperFL's procedure (Guo et al., Sec. 5.1).

Client i holds `--train` training and `--test` test samples, 20% of them
spread evenly over all classes and the rest over the labels of its group
(for 10 classes, groups of three labels: [0,1,2], [2,3,4], ..., [8,9,0];
`tff_privacy.data.partitioners.label_groups`), dealt as the authors'
loaders deal them; the test indices are drawn the same way from the test
set. The paper's MNIST setting (the defaults): 20 clients, 150 training
and 50 test samples each.

  python experiments/write_split.py --out split.json [--dataset mnist5k]
  tff-privacy train --method hyperfl --dataset mnist5k \\
      --partition file:split.json --out results/hyperfl
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the CUDA plugin lines

import argparse

from tff_privacy import data, runtime
from tff_privacy.data import partitioners


def write_hyperfl_split(path: str, dataset: str, clients: int, train: int,
                        test: int, seed: int, data_dir: str | None = None) -> None:
  """Writes to `path` the split file of HyperFL's label-group split of
  `dataset`: `train` training and `test` test samples for each of
  `clients` clients, seeded by `seed` (the test split by seed + 1, as
  `tff_privacy.data.load` draws it)."""
  if clients < 1:
    raise ValueError(f"--clients must be >= 1, got {clients}")
  source = data.load_source(dataset, data_dir=data_dir)
  data.splits.write(
      path, partitioners.label_groups(source.y_train, clients, train, seed),
      partitioners.label_groups(source.y_test, clients, test, seed + 1))


def main() -> None:
  runtime.install()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="the split file to write")
  parser.add_argument("--dataset", default="mnist5k", choices=data.DATASETS)
  parser.add_argument("--data-dir", help="tensorflow_datasets data directory "
                      "(mnist: the paper's full data set)")
  parser.add_argument("--clients", type=int, default=20)
  parser.add_argument("--train", type=int, default=150,
                      help="training samples per client")
  parser.add_argument("--test", type=int, default=50, help="test samples per client")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  try:
    write_hyperfl_split(args.out, args.dataset, args.clients, args.train,
                        args.test, args.seed, args.data_dir)
  except ValueError as e:
    parser.error(str(e))
  print(f"{args.out}: {args.clients} clients of {args.dataset}, {args.train} "
        f"training and {args.test} test samples each")


if __name__ == "__main__":
  main()
