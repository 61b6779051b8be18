"""A defense of your own, in your own script, on the leaderboard.

QSGD-style quantization (Alistarh et al., NeurIPS 2017): each tensor u of
the client's update is sent as its norm and, per entry, a sign and one of
s = 2^bits - 1 levels of |u_i| / ||u||, rounded up or down at random so
that the upload is u in expectation. Nothing in tff_privacy is edited:

* `@defenses.register` makes "qsgd" a defense like the package's own
  (`--defense qsgd`, config checks, run metadata);
* `DISCLOSURE` says what an attacker who knows the defense can compute:
  the rounding error's std on each tensor, Delta / sqrt(6) for the step
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

from tff_privacy import attacks, defenses
from tff_privacy.disclosure import Disclosure
from tff_privacy.leaderboard import board, defaults, grid, report
from tff_privacy.listing import Listing
from tff_privacy.params import Param, Params


def rounding_noise(record) -> list[float]:
  """The std of QSGD's rounding error on each tensor of an upload: a
  tensor is sent in units of its norm over s, the step Delta that its
  smallest non-zero entry shows (one level, in all but tiny tensors), and
  a fraction p of a step rounds with variance Delta^2 p (1 - p), on
  average Delta^2 / 6 over p."""
  levels = []
  for u in record.upload:
    sent = np.abs(np.asarray(u))
    step = sent[sent > 0].min() if np.any(sent > 0) else 0.0
    levels.append(float(step) / math.sqrt(6))
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
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="the leaderboard's folder")
  parser.add_argument("--small", action="store_true",
                      help="fewer clients, rounds, victims and iterations")
  args = parser.parse_args(argv)
  print("attacks that know qsgd:", ", ".join(attacks.adaptive_attacks("qsgd")))
  chosen = leaderboard_grid(args.small)
  results = board.run(chosen, args.out)
  print("report:", report.write(chosen, results, args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
