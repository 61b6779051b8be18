"""Time each defence adds to one client's round, RECUP-FL's Table 1, as
ratios to DP (Gaussian), all measured in this process.

The client: one Adult record (RECUP-FL's one sample per client), the
paper's model (103 -> 50 ReLU -> 1 sigmoid, MSE), its gradient at a fresh
model. Each defence transforms that upload in a compiled `tf.function`:
DP Gaussian and DP Laplace (clip 20, noise multiplier 1e-3), gradient
sparsification (p 0.5), Soteria (p 0.5, its default layer) and RECUP-FL
(P 10, Q 5, epsilon 0.01, protecting race with a 20-model zoo read from
files, pooled length 1024). The zoo's models are trained for
`--zoo-epochs` epochs only (default 1): the time of a perturbation does not
depend on how well its defenders fit. Timings are medians over `--repeats`
runs of its graph (graph mode, as TFF runs client work) after one warm-up; the paper's 72 ms was measured on LFW on an
A100.

Prints one line per defence and `recupfl_ms_per_client=<x>`, with the zoo's
size on disk, the size of the compiled RECUP-FL graph, and the size of the
serialized TFF computation of a FedSGD round on Adult (20 clients) with no
defence, DP Gaussian and RECUP-FL: the zoo reaches the client work as file
paths, so its weights are not in the computation.

  python benchmarks/recupfl_client_time.py [--repeats 50] [--zoo-epochs 1]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # also the CUDA plugin lines

import argparse
import statistics
import tempfile
import time

import tensorflow as tf

from tff_privacy import data, defenses, models, runtime
from tff_privacy.attacks import attribute
from tff_privacy.defenses import defender_zoo, recupfl
from tff_privacy.defenses.updates import ClientView

POOL_LENGTH = 1024


def _median_ms(session, op, repeats: int) -> float:
  session.run(op)  # warms up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    session.run(op)
    times.append(time.perf_counter() - start)
  return 1000 * statistics.median(times)


def _folder_bytes(folder: str) -> int:
  return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def tff_round_bytes(out: str) -> dict[str, int]:
  """Bytes of the serialized TFF computation of one round (`next`) of a
  FedSGD run on Adult with each defence."""
  import tensorflow_federated as tff

  from tff_privacy import runner
  settings = {"none": (None, {}),
              "dp_gaussian": ("ldp_gaussian", {"clip": 20.0, "noise_multiplier": 1e-3}),
              "recupfl": ("recupfl", {"protect": "race"})}
  sizes = {}
  for name, (defense, kwargs) in settings.items():
    run = runner.Run(runner.RunConfig(
        out=os.path.join(out, name), method="fedsgd", dataset="adult", model="mlp",
        model_kwargs={"hidden": [50]}, clients=20, batch_size=1,
        defense=defense, defense_kwargs=kwargs))
    proto = tff.framework.serialize_computation(run.process(capture=False).next)
    sizes[name] = proto.ByteSize()
  return sizes


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=50)
  parser.add_argument("--zoo-epochs", type=int, default=1)
  parser.add_argument("--shadow", type=int, default=400,
                      help="shadow records the zoo is trained on")
  args = parser.parse_args()
  runtime.start()
  source = data.load_source("adult")
  spec = models.ModelSpec("mlp", source.input_shape, 2, {"hidden": (50,)}, "binary_mse")
  broadcast = spec.initial_weights(0)
  x, y = source.x_train[:1], source.y_train[:1]
  model = spec.keras()
  model.set_weights(broadcast)
  with tf.GradientTape() as tape:
    loss = spec.task_object.loss(model(x), y)
  upload = tape.gradient(loss, model.trainable_variables)
  upload = [u.numpy() for u in upload]
  features = attribute.shadow_features(spec, broadcast, source.x_train[1:args.shadow + 1],
                                       source.y_train[1:args.shadow + 1], "gradient",
                                       {"batch_size": 1}, length=POOL_LENGTH)
  race = source.attributes.train["race"]
  pipelines = defender_zoo.fit_defenders(features, race[1:args.shadow + 1],
                                         epochs=args.zoo_epochs)
  with tempfile.TemporaryDirectory() as tmp:
    folder = os.path.join(tmp, "zoo")
    defender_zoo.save_zoo(defender_zoo.zoo_from_pipelines(
        pipelines, "race", source.attributes.classes["race"]), folder)
    zoo_bytes = _folder_bytes(folder)
    # graph mode, as TFF runs a client's work
    with tf.Graph().as_default() as graph:
      seed = tf.constant([0, 1], tf.int64)
      update = [tf.constant(u) for u in upload]
      view = ClientView([tf.constant(w) for w in broadcast],
                        tf.data.Dataset.from_tensor_slices({"x": x, "y": y}).batch(1))
      ops = {"dp_gaussian": defenses.build("ldp_gaussian", clip=20.0,
                                           noise_multiplier=1e-3),
             "dp_laplace": defenses.build("ldp_laplace", clip=20.0,
                                          noise_multiplier=1e-3),
             "sparsification": defenses.build("sparsification", p=0.5),
             "soteria": defenses.build("soteria", spec, p=0.5)}
      ops = {name: d.apply(update, seed, view) for name, d in ops.items()}
      before = len(graph.as_graph_def().SerializeToString())
      ops["recupfl"] = recupfl.perturb_upload(update, [(
          int(race[0]), defender_zoo.defenders(defender_zoo.load_zoo(folder, in_graph=True)),
          1.0, seed)], epsilon=0.01, pool_length=POOL_LENGTH, iterations=10, sampled=5)
      graph_bytes = len(graph.as_graph_def().SerializeToString()) - before
    with tf.compat.v1.Session(graph=graph) as session:
      results = {name: _median_ms(session, op, args.repeats) for name, op in ops.items()}
  base = results["dp_gaussian"]
  for name, ms in results.items():
    print(f"{name}: {ms:.3f} ms per client, {ms / base:.2f}x DP (Gaussian)")
  print(f"recupfl_ms_per_client={results['recupfl']:.2f}")
  print(f"zoo: {len(pipelines)} models, {zoo_bytes / 2**20:.1f} MiB on disk; "
        f"compiled RECUP-FL graph {graph_bytes / 2**10:.0f} KiB")
  with tempfile.TemporaryDirectory() as out:
    sizes = tff_round_bytes(out)
  print("TFF round computation: " + ", ".join(
      f"{name} {size / 2**10:.0f} KiB" for name, size in sizes.items())
        + f"; RECUP-FL adds {(sizes['recupfl'] - sizes['none']) / 2**10:.0f} KiB")


if __name__ == "__main__":
  main()
