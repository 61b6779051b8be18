"""Measures the attack module against undefended uploads on bundled MNIST.

1. FedSGD, 8 clients holding one image each (round-1 uploads captured through
   TFF): DLG (as published, and with 3 restarts) and iDLG on the sigmoid LeNet
   (DLG's setting, U(-0.5, 0.5) initialisation), Inverting Gradients on the
   ReLU CNN.
2. The same with 4 images per client (reconstructions matched to the true
   images by least MSE before scoring).
3. Attribute inference: the task is 'digit >= 5', the sensitive attribute the
   digit's parity; adversaries trained on pooled single-sample uploads of
   shadow data (the training split) and tested on victims' uploads (the test
   split) under the round-1 broadcast model.

Writes OUT/summary.md and OUT/summary.json; each attack's attack.json and
reconstructions.png under OUT/<setting>/.

  python experiments/attack_check.py [--out results/attack_check] [--ig-iterations 4800]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the CUDA plugin lines

import argparse

import numpy as np

from tff_privacy import data, evaluate, io, models, provenance, runner, runtime
from tff_privacy.attacks import attribute


def capture(out: str, model: str, clients: int, batch_size: int,
            partition: str) -> str:
  config = runner.RunConfig(out=out, method="fedsgd", dataset="mnist5k",
                            model=model, clients=clients, partition=partition,
                            rounds=1, batch_size=batch_size, seed=0,
                            capture_rounds=(1,))
  runner.run(config, progress=False)
  return os.path.join(out, "updates")


def inversion_rows(out: str, ig_iterations: int) -> list[dict]:
  rows = []
  ig = ("ig", {"iterations": ig_iterations})
  settings = [("lenet", 1, "one_per_client",
               [("dlg", {}), ("dlg", {"restarts": 3}), ("idlg", {})]),
              ("cnn", 1, "one_per_client", [ig]),
              ("cnn", 4, "iid", [ig])]
  for model, batch, partition, attacks in settings:
    setting = f"{model}_batch{batch}"
    updates = capture(os.path.join(out, setting, "run"), model, 8, batch, partition)
    for name, kwargs in attacks:
      label = name + "".join(f"_{k}{v}" for k, v in kwargs.items()
                             if k != "iterations")
      result = evaluate.attack_round(updates, 1, os.path.join(out, setting, label),
                                     name, attack_kwargs=kwargs)
      m = result["mean"]
      rows.append({"model": model, "images_per_client": batch, "attack": label,
                   "clients": len(result["clients"]), "mse": m["mse"],
                   "psnr": m["psnr"], "ssim": m["ssim"],
                   "feature_mse": m["feature_mse"],
                   "label_accuracy": m["label_accuracy"],
                   "seconds": result["seconds"]})
      print(rows[-1], flush=True)
  return rows


def attribute_rows(shadow: int, victims: int, seed: int = 0) -> tuple[dict, float]:
  src = data.load_source("mnist5k")
  spec = models.ModelSpec("cnn", src.input_shape, 2)
  broadcast = spec.initial_weights(seed)
  protocol = {"batch_size": 1}
  rng = np.random.default_rng(seed)
  tr = rng.choice(len(src.y_train), shadow, replace=False)
  te = rng.choice(len(src.y_test), victims, replace=False)

  def features(x, digits):
    task = (digits >= 5).astype(np.int32)
    return attribute.shadow_features(spec, broadcast, x, task, "gradient", protocol)

  f_train = features(src.x_train[tr], src.y_train[tr])
  f_victim = features(src.x_test[te], src.y_test[te])
  parity_train, parity_victim = src.y_train[tr] % 2, src.y_test[te] % 2
  rates = attribute.attack_success_rates(f_train, parity_train, f_victim,
                                         parity_victim, seed=seed)
  return rates, attribute.chance_rate(parity_victim)


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="results/attack_check")
  parser.add_argument("--ig-iterations", type=int, default=4800)
  parser.add_argument("--shadow", type=int, default=2000)
  parser.add_argument("--victims", type=int, default=500)
  args = parser.parse_args()
  runtime.start()
  rows = inversion_rows(args.out, args.ig_iterations)
  rates, chance = attribute_rows(args.shadow, args.victims)
  lines = ["| model | images/client | attack | clients | MSE | PSNR (dB) | SSIM | "
           "feature MSE | label acc. | seconds |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  lines += [f"| {r['model']} | {r['images_per_client']} | {r['attack']} | "
            f"{r['clients']} | {r['mse']:.4f} | {r['psnr']:.2f} | {r['ssim']:.4f} | "
            f"{r['feature_mse']:.4g} | {r['label_accuracy']:.2f} | "
            f"{r['seconds']:.1f} |" for r in rows]
  lines += ["", "Attribute inference (task: digit >= 5; attribute: parity; "
            f"{args.shadow} shadow, {args.victims} victim single-sample uploads)", "",
            "| adversary | ASR | chance |", "|---|---|---|"]
  lines += [f"| {name} | {rate:.3f} | {chance:.3f} |" for name, rate in rates.items()]
  text = "\n".join(lines) + "\n" + provenance.footnote(args.out)
  io.write_text(os.path.join(args.out, "summary.md"), text)
  io.write_json(os.path.join(args.out, "summary.json"),
                {"inversion": rows, "attribute_inference": {"asr": rates,
                                                            "chance": chance}})
  print(text)
  runtime.stop()


if __name__ == "__main__":
  main()
