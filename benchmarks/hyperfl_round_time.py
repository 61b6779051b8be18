"""Wall time of one round of HyperFL and of the DP baselines relative to one
FedAvg round, same process (the HyperFL paper's Table 4).

The paper's setting at a small scale: 20 clients with 150 samples each
(mnist5k, HyperFL's label-group split), batch 50 (`--batch-size`), the
28x28 target CNN; FedAvg runs 5 local epochs (SGD, lr 0.02, momentum 0.5),
HyperFL its 1 classifier epoch and 5 hypernetwork epochs, DP-FedAvg and
PPSGD 5 DP-SGD epochs, CENTAUR 1 classifier epoch and 5 DP-SGD epochs
(`--baselines` chooses which of these to time). All run through TFF on the same round's
clients, each method in a process of its own, one after another: one
compiling round, then `--rounds` timed ones. The whole process tree of each
(the driver and its TFF worker) is sampled every 0.5 s for its peak
resident memory, and killed above `--limit-mb`.

Prints the median seconds per round of each, `ratio_hyperfl_over_fedavg=`
and `ratio_<baseline>_over_fedavg=` for each baseline, beside
`peak_rss_mb_<method>=` of each method's process tree,
the bytes each client uploads per round (float32 tensors), and the floating
point operations per round: TensorFlow's profiler counts one local step's
graph (FedAvg: forward and backward pass of the model; HyperFL's classifier
step: the same on fixed generated weights; its hypernetwork step: generating
the extractor, forward and backward pass, and the gradients HyperFL's client
computes, see `tff_privacy.algorithms.hyperfl`), times the steps of a round;
HyperFL's low-rank terms (about 4 (S - 1) P operations at step S for P
generated weights: the product with the rows of the steps before it and its
gradient) are added by hand.

FLOPs miss what bounds HyperFL's step on a CPU: each hypernetwork step
reads the broadcast head kernel (hidden x P float32, 60 MB for hyperfl_cnn)
twice, once to generate the extractor (K^T h) and once for the gradient of
h (K g); FedAvg's step reads its 0.5 MB model. The benchmark times those
two matrix-vector products alone, in its own process (`head_reads_s_per_round`:
their median time over 20 calls times the round's hypernetwork steps) and
prints them as a share of FedAvg's round. The server state, the
hypernetwork itself, goes through TFF's Python client into the round's
call and back out every round; `state_trip_s_per_round` times that alone
(a TensorFlow computation returning the hypernetwork it is given, on TFF's
worker, median over 5 calls, less the same for FedAvg's model). FedAvg's
round does neither at that size, so HyperFL's round is at least about
FedAvg's plus both (`floor_ratio_hyperfl_over_fedavg`, an estimate: the
reads are timed in the driver, not on the worker, and both move from run
to run), whatever else is made faster.

`client_training_s` times one client's local training alone, in this
process and without TFF, on the dataset round 1 gives client 0 (median of
5 calls of a `tf.function`): FedAvg's arithmetic (`personalized.local_sgd`,
TFF's SGD with momentum) and HyperFL's (`hyperfl.local_training`, what its
client update runs, and the whole upload formed from its compact form,
`hyperfl.upload_rows`, which the round's aggregation does). Their ratio
is what the round ratio would come down to if everything else TFF does
(the state's trip, the sums of the aggregation) cost nothing; TFF's worker
runs two clients at a time, so it is an estimate.

  python benchmarks/hyperfl_round_time.py [--rounds 3] [--clients 20]
      [--samples 150] [--batch-size 50]
      [--baselines dp_sgd_fedavg,ppsgd,centaur]
      [--limit-mb 12000]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import dataclasses
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

import round_timing  # this folder's
from tff_privacy import runner, runtime
from tff_privacy.algorithms import hyperfl, personalized
from tff_privacy.cli import _positive_int
from tff_privacy.models.functional import forward
from tff_privacy.models.hypernetwork import Hypernetwork

BASELINES = ("dp_sgd_fedavg", "ppsgd", "centaur")
METHOD_KWARGS = {"fedavg": dict(local_epochs=5, client_learning_rate=0.02,
                                client_momentum=0.5)}


def _config(method: str, args) -> runner.RunConfig:
  return runner.RunConfig(
      out="unused", method=method, dataset="mnist5k", model="hyperfl_cnn",
      clients=args.clients, batch_size=args.batch_size, partition="label_groups",
      samples_per_client=args.samples, seed=0,
      method_kwargs=METHOD_KWARGS.get(method, {}))


def measured(method: str, args) -> tuple[list[float], int]:
  """(seconds of each timed round, peak resident bytes of the process tree)
  of `method` in a process of its own (`round_timing`)."""
  return round_timing.measured(
      __file__, ["--time-method", method, "--rounds", str(args.rounds),
                 "--clients", str(args.clients), "--samples", str(args.samples),
                 "--batch-size", str(args.batch_size)],
      args.limit_mb, method)


def _step_flops(spec, hyper: Hypernetwork, batch: int) -> tuple[int, int, int]:
  """FLOPs of a FedAvg step, a HyperFL classifier step and a HyperFL
  hypernetwork step on one batch."""
  model = spec.keras()
  weights = [tf.TensorSpec(v.shape) for v in model.trainable_variables]
  x = tf.TensorSpec((batch,) + spec.input_shape)
  y = tf.TensorSpec((batch,), tf.int32)

  def loss(w, x, y):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        y, forward(model, w, x)))

  def model_step(w, x, y):
    with tf.GradientTape() as tape:
      tape.watch(w)
      value = loss(w, x, y)
    return tape.gradient(value, w)

  split = len(hyper.target_shapes)

  def classifier_step(w, x, y):
    with tf.GradientTape() as tape:
      tape.watch(w[split:])
      value = loss(w, x, y)
    return tape.gradient(value, w[split:])

  hyper_specs = [tf.TensorSpec(s) for s in hyper.shapes]
  v = tf.TensorSpec((hyper.embedding_dim,))

  def hypernetwork_step(varphi, v, phi, x, y):
    with tf.GradientTape() as tape:
      tape.watch([varphi[0], varphi[1], v])
      h = tf.nn.relu(tf.linalg.matvec(varphi[0], v, transpose_a=True) + varphi[1])
      theta = tf.concat([tf.linalg.matvec(varphi[2 + 2 * i], h, transpose_a=True)
                         + varphi[3 + 2 * i] for i in range(split)], 0)
      sizes = [int(np.prod(s)) for s in hyper.target_shapes]
      extractor = [tf.reshape(t, s) for t, s in
                   zip(tf.split(theta, sizes), hyper.target_shapes)]
      value = loss(extractor + list(phi), x, y)
    return tape.gradient(value, [varphi[0], varphi[1], theta, v])

  return (round_timing.graph_flops(model_step, weights, x, y),
          round_timing.graph_flops(classifier_step, weights, x, y),
          round_timing.graph_flops(hypernetwork_step, hyper_specs, v, weights[split:],
                                   x, y))


def head_reads_seconds(hyper: Hypernetwork, repeats: int = 20) -> float:
  """Median seconds of one hypernetwork step's two products with the head
  kernels, each head read in place as `_hypernetwork_phase` reads them
  (K^T h, one matvec per head, and the backward pass's K g, their sum)."""
  kernels = [tf.random.stateless_normal(hyper.shapes[2 + 2 * i], (0, i))
             for i in range(len(hyper.target_shapes))]
  h = tf.random.stateless_normal(kernels[0].shape[:1], (1, 0))
  gs = [tf.random.stateless_normal(k.shape[1:], (2, i))
        for i, k in enumerate(kernels)]

  @tf.function
  def reads(h, gs):
    theta = tf.concat([tf.linalg.matvec(k, h, transpose_a=True) for k in kernels], 0)
    return theta[0] + tf.reduce_sum(tf.add_n(
        [tf.linalg.matvec(k, g) for k, g in zip(kernels, gs)]))

  reads(h, gs)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    reads(h, gs).numpy()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def client_training_seconds(args, repeats: int = 5) -> dict[str, float]:
  """Median seconds of one client's local training in this process, without
  TFF, on the dataset round 1's process gives client 0: FedAvg's
  (`personalized.local_sgd`, TFF's SGD with momentum, its client's
  arithmetic, stepping by the data set's iterator as TFF's FedAvg does)
  and HyperFL's (`hyperfl.local_training`, what its client update runs,
  then the whole upload formed from its compact form, which the round's
  aggregation does), each a `tf.function` traced once."""
  out = {}
  for method in ("fedavg", "hyperfl"):
    with tempfile.TemporaryDirectory() as tmp:
      config = dataclasses.replace(_config(method, args), out=tmp)
      run = runner.Run(config)
      client = run.round_data(1)[0]
      target = run.spec.keras()
      if method == "fedavg":
        weights = [tf.constant(w) for w in run.spec.initial_weights(config.seed)]
        kwargs = METHOD_KWARGS["fedavg"]
        train = tf.function(lambda dataset: personalized.local_sgd(
            target, weights, dataset, kwargs["client_learning_rate"],
            kwargs["client_momentum"], 0.0))
      else:
        declared = hyperfl.PARAMETERS.defaults()  # what the config runs
        hyper = Hypernetwork.for_model(target, declared["embedding_dim"],
                                       declared["hidden_dim"])
        varphi = [tf.constant(w) for w in hyper.initial_weights(config.seed)]
        state = tf.nest.map_structure(
            tf.constant, run.algorithm.private_state.initial(client.index))
        settings = {k: v for k, v in declared.items()
                    if k not in ("embedding_dim", "hidden_dim")}
        def train(dataset):
          compact = hyperfl.local_training(target, hyper, varphi, state,
                                           dataset, **settings)[0]
          return [hyperfl.upload_rows(compact, varphi, i, 0, shape[0])
                  for i, shape in enumerate(hyper.shapes)]
        train = tf.function(train)
      train(client.process_data)
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        tf.nest.map_structure(np.asarray, train(client.process_data))
        times.append(time.perf_counter() - start)
      out[method] = statistics.median(times)
  return out


def state_trip_seconds(shapes, repeats: int = 5) -> float:
  """Median seconds of one call of a computation on TFF's worker that
  returns the float32 tensors of `shapes` it is given (a server state)."""
  types = [tff.TensorType(np.float32, shape) for shape in shapes]
  values = [np.zeros(shape, np.float32) for shape in shapes]

  @tff.tensorflow.computation(types)
  def same(weights):
    return [tf.identity(w) for w in weights]

  same(values)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    same(values)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main() -> None:
  runtime.install()  # first: TFF's own default context fails at exit
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=_positive_int, default=3)
  parser.add_argument("--clients", type=_positive_int, default=20)
  parser.add_argument("--samples", type=_positive_int, default=150)
  parser.add_argument("--batch-size", type=_positive_int, default=50)
  parser.add_argument("--baselines", default=",".join(BASELINES),
                      help="comma-separated, from: " + ", ".join(BASELINES))
  parser.add_argument("--limit-mb", type=_positive_int, default=12000,
                      help="kill a method's process tree above this resident size")
  parser.add_argument("--time-method", help=argparse.SUPPRESS)
  parser.add_argument("--times-file", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.time_method:
    round_timing.time_rounds(_config(args.time_method, args), args.rounds,
                             args.times_file)
    return
  baselines = [b for b in args.baselines.split(",") if b]
  if set(baselines) - set(BASELINES):
    parser.error(f"--baselines: {baselines}; choose from {', '.join(BASELINES)}")
  times, peaks = {}, {}
  for name in ["fedavg", "hyperfl", *baselines]:
    times[name], peaks[name] = measured(name, args)
  fedavg, hyperfl = (statistics.median(times[n]) for n in ("fedavg", "hyperfl"))
  spec = runner.Run(_config("fedavg", args)).spec
  hyper = Hypernetwork.for_model(spec.keras())
  model_params = sum(int(np.prod(w.shape)) for w in spec.initial_weights(0))
  steps = -(-args.samples // args.batch_size)  # batches per epoch
  model_step, classifier_step, hyper_step = _step_flops(spec, hyper,
                                                        args.batch_size)
  generated = sum(int(np.prod(s)) for s in hyper.target_shapes)
  rows = sum(4 * s * generated for s in range(5 * steps))  # s rows before
  flops_fedavg = args.clients * 5 * steps * model_step
  flops_hyperfl = args.clients * (steps * classifier_step + 5 * steps * hyper_step
                                  + rows)
  print(f"setting: {args.clients} clients x {args.samples} samples, "
        f"batch {args.batch_size}, "
        "hyperfl_cnn; FedAvg 5 local epochs; HyperFL 1 + 5 epochs")
  print(f"fedavg: {fedavg:.3f} s/round, hyperfl: {hyperfl:.3f} s/round "
        f"(medians of {args.rounds})")
  print(f"ratio_hyperfl_over_fedavg={hyperfl / fedavg:.2f} "
        f"peak_rss_mb_hyperfl={peaks['hyperfl'] // 2**20} "
        f"peak_rss_mb_fedavg={peaks['fedavg'] // 2**20}")
  for name in baselines:
    seconds = statistics.median(times[name])
    print(f"{name}: {seconds:.3f} s/round, "
          f"ratio_{name}_over_fedavg={seconds / fedavg:.2f} "
          f"peak_rss_mb_{name}={peaks[name] // 2**20}")
  print(f"upload_bytes_per_client_per_round: fedavg={4 * model_params} "
        f"hyperfl={4 * hyper.num_parameters}")
  print(f"flops_per_round: fedavg={flops_fedavg:.4g} hyperfl={flops_hyperfl:.4g} "
        f"(ratio {flops_hyperfl / flops_fedavg:.2f})")
  reads = args.clients * 5 * steps * head_reads_seconds(hyper)
  print(f"head_reads_s_per_round={reads:.3f} ({reads / fedavg:.2f} of FedAvg's "
        f"round; {args.clients * 5 * steps} hypernetwork steps reading "
        f"{2 * 4 * hyper.hidden_dim * generated / 2**20:.0f} MiB each)")
  # beyond the trip of FedAvg's state, which its round makes too
  trip = (state_trip_seconds(hyper.shapes)
          - state_trip_seconds([w.shape for w in spec.initial_weights(0)]))
  print(f"state_trip_s_per_round={trip:.3f} ({trip / fedavg:.2f} of FedAvg's "
        f"round; {4 * hyper.num_parameters / 2**20:.0f} MiB in and out, beyond "
        "FedAvg's model)")
  print(f"floor_ratio_hyperfl_over_fedavg={(fedavg + reads + trip) / fedavg:.2f} "
        "(an estimate: FedAvg's round plus both, each timed apart)")
  client = client_training_seconds(args)
  print(f"client_training_s: fedavg={client['fedavg']:.3f} "
        f"hyperfl={client['hyperfl']:.3f} (one client, in this process, no TFF) "
        f"ratio_client_training_hyperfl_over_fedavg="
        f"{client['hyperfl'] / client['fedavg']:.2f}")
  runtime.stop()


if __name__ == "__main__":
  main()
