"""The epsilons runs report, beside dp_accounting called directly.

For each setting it prints the (epsilon, delta) a run's metrics.json would
hold after its last round (`runner.Run.privacy_spent`, no training needed),
dp_accounting's value for the same mechanism computed here from first
principles, and the value of the accounting used before local DP counted
twice the clip and before dp_fedavg's fixed-size sampling was accounted as
sampling without replacement:

* ldp_gaussian, clip 1, noise multiplier 1, 20 rounds: local DP, any two
  uploads are neighbours, sensitivity 2 -> Gaussian multiplier 1/2;
  previously multiplier 1.
* ldp_laplace (L1 clipping), clip 1, scale 20, 20 rounds: L1 sensitivity 2
  -> Laplace multiplier 10; previously 20.
* dp_fedavg, clip 1, noise multiplier 1, 5 of 10 clients per round, 20
  rounds: sampling without replacement, replace-one neighbours (sum moves by
  up to 2) -> SampledWithoutReplacement(10, 5, Gaussian(1/2)); previously
  Poisson(0.5, Gaussian(1)) under add/remove.

  python experiments/dp_accounting_check.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the CUDA plugin lines

import dp_accounting  # noqa: E402

from tff_privacy import runner, runtime  # noqa: E402

ROUNDS, DELTA = 20, 1e-5
Rel = dp_accounting.NeighboringRelation


def direct(event, accountant="rdp", relation=Rel.ADD_OR_REMOVE_ONE) -> float:
  acc = (dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
         if accountant == "rdp" else dp_accounting.pld.PLDAccountant(relation))
  acc.compose(dp_accounting.SelfComposedDpEvent(event, ROUNDS))
  return acc.get_epsilon(DELTA)


def reported(**fields) -> dict:
  config = runner.RunConfig(out="unused", method="fedsgd", rounds=ROUNDS,
                            dataset="digits", model="mlp", dp_delta=DELTA,
                            **fields)
  return runner.Run(config).privacy_spent(ROUNDS)


def main() -> None:
  runtime.install()  # no computation runs, but TFF's default context is replaced
  rows = [
      ("ldp_gaussian clip=1 z=1",
       reported(defense="ldp_gaussian",
                defense_kwargs={"clip": 1.0, "noise_multiplier": 1.0}),
       direct(dp_accounting.GaussianDpEvent(0.5)),
       direct(dp_accounting.GaussianDpEvent(1.0))),
      ("ldp_laplace l1 clip=1 b=20",
       reported(defense="ldp_laplace",
                defense_kwargs={"clip": 1.0, "noise_multiplier": 20.0,
                                "norm": "l1"}),
       direct(dp_accounting.LaplaceDpEvent(10.0), "pld"),
       direct(dp_accounting.LaplaceDpEvent(20.0), "pld")),
      ("dp_fedavg clip=1 z=1, 5 of 10 clients",
       reported(defense="dp_fedavg", clients=10, clients_per_round=5,
                defense_kwargs={"clip": 1.0, "noise_multiplier": 1.0}),
       direct(dp_accounting.SampledWithoutReplacementDpEvent(
           10, 5, dp_accounting.GaussianDpEvent(0.5)), relation=Rel.REPLACE_ONE),
       direct(dp_accounting.PoissonSampledDpEvent(
           0.5, dp_accounting.GaussianDpEvent(1.0)))),
  ]
  print(f"{ROUNDS} rounds, delta {DELTA:g}")
  print("| setting | reported epsilon | dp_accounting directly | previous "
        "accounting | relation |")
  print("|---|---|---|---|---|")
  for name, spent, want, before in rows:
    print(f"| {name} | {spent['epsilon']:.4f} | {want:.4f} | {before:.4f} | "
          f"{spent['dp_relation']}; {spent['dp_sampling']} |")


if __name__ == "__main__":
  main()
