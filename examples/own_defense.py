"""A defense of your own, in your own script, on the leaderboard.

QSGD-style quantization (Alistarh et al., NeurIPS 2017): each tensor u of
the client's update is sent as its norm and, per entry, a sign and one of
s = 2^bits - 1 levels of |u_i| / ||u||, rounded up or down at random so
that the upload is u in expectation. Nothing in tff_privacy is edited:

* `@defenses.register` makes "qsgd" a defense like the package's own
  (`RunConfig(defense="qsgd")`, config checks, run metadata; installed as
  a package's entry point, `tff-privacy train --defense qsgd` too);
* `DISCLOSURE` says what an attacker who knows the defense can compute:
  the rounding error's std on each tensor, estimated from the step
  Delta = ||u|| / s that the upload shows (`rounding_noise`). The
  noise-aware inversion (`ig_noise_aware`) reads that declaration, so it
  attacks QSGD's uploads beside plain IG;
* `LISTING` puts it on the built-in leaderboards at 4 bits.

  python examples/own_defense.py --out results/qsgd            # minutes
  python examples/own_defense.py --out /tmp/qsgd --small       # a minute

runs the compact leaderboard's FedSGD and QSGD rows (with `--small`, on
fewer clients, rounds, victims and iterations) and writes its report.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
import tensorflow as tf

from tff_privacy import attacks, defenses, runtime
from tff_privacy.disclosure import Disclosure
from tff_privacy.leaderboard import board, defaults, grid, report
from tff_privacy.listing import Listing
from tff_privacy.params import Param, Params


def level_step(sent: np.ndarray) -> float:
  """The step Delta = ||u|| / s of a tensor's levels: the largest unit of
  which every non-zero magnitude sent is a whole multiple (the smallest
  magnitude over the fewest levels that divide them all); 0 for zeros."""
  magnitudes = sent[sent > 0]
  if magnitudes.size == 0:
    return 0.0
  smallest = magnitudes.min()
  for k in range(1, 2 ** 16):
    ratio = magnitudes / (smallest / k)
    if np.all(np.abs(ratio - np.round(ratio)) < 1e-3 * ratio.max() / k + 1e-3):
      return float(smallest / k)
  return float(smallest)


def rounding_noise(record) -> list[float]:
  """An estimate of the std of QSGD's rounding error on each tensor of an
  upload, from what the upload shows. An entry a fraction p of a step
  above a level rounds with variance Delta^2 p (1 - p). Where most entries
  lie below one level (few bits, large tensors), p is the entry's share of
  a step and the mean variance is about Delta^2 times the share of
  entries sent non-zero; where the levels are fine, p is spread evenly and
  the mean variance is Delta^2 / 6. The smaller of the two is taken."""
  levels = []
  for u in record.upload:
    sent = np.abs(np.asarray(u, np.float64))
    share = np.count_nonzero(sent) / max(sent.size, 1)
    levels.append(level_step(sent) * math.sqrt(min(share, 1 / 6)))
  return levels


@defenses.register
class QSGD(defenses.UpdateDefense):
  """Stochastic quantization of each tensor to 2^bits - 1 levels of its norm."""

  name = "qsgd"
  PARAMETERS = Params(Param("bits", int, 4, "bits of each entry's level "
                            "(2^bits - 1 levels of |u_i| / ||u||)", minimum=1,
                            maximum=16, flag="qsgd-bits"))
  DISCLOSURE = Disclosure(noise_levels=rounding_noise)
  LISTING = Listing("QSGD", "bits", 4, (2, 4, 8), method="fedsgd")

  def __init__(self, bits: int = 4):
    self.bits = self.PARAMETERS.check(bits=bits)["bits"]

  def apply(self, update, seed, client=None):
    levels = 2 ** self.bits - 1
    out = []
    for i, u in enumerate(update):
      norm = tf.norm(u)
      scaled = tf.abs(u) / tf.maximum(norm, 1e-30) * levels
      low = tf.floor(scaled)
      draw = tf.random.stateless_uniform(
          tf.shape(u), tf.random.experimental.stateless_fold_in(seed, i))
      rounded = low + tf.cast(draw < scaled - low, u.dtype)
      out.append(tf.sign(u) * rounded * norm / levels)
    return out


def leaderboard_grid(small: bool) -> grid.Grid:
  """The compact leaderboard's reference and QSGD rows; `small`: a run of
  about a minute."""
  config = defaults.grid("compact")
  if small:
    config["protocol"].update(clients=20, clients_per_round=4, rounds=2,
                              evaluate_every=2, checkpoint_every=2)
    config["attacks"].update(iterations=20, victims=2, shadow_samples=20)
  return grid.only(grid.parse(config), ["QSGD"])


def main(argv=None) -> int:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="the leaderboard's folder")
  parser.add_argument("--small", action="store_true",
                      help="fewer clients, rounds, victims and iterations")
  args = parser.parse_args(argv)
  print("attacks that know qsgd:", ", ".join(attacks.adaptive_attacks("qsgd")))
  chosen = leaderboard_grid(args.small)
  runtime.start()  # this machine's private TFF worker, stopped at exit
  try:
    results = board.run(chosen, args.out)
  except ValueError as e:  # a wrong --out: one line, as the CLI says it
    print(f"own_defense.py: {e}", file=sys.stderr)
    return 2
  print("report:", report.write(chosen, results, args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
