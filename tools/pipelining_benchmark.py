"""Step time with and without ``pipeline_execution_with_tensor_core``.

Trains the same model twice in one process: tables and a dense MLP sized
so that the embedding work (lookup + Adagrad update) and the dense work
(forward + backward) take comparable time. With pipelining, the update of
step ``n`` runs alongside the dense work of step ``n + 1``. It prints the
time of each part alone, both step times and their ratio, taken within
each repeat (the two steps are timed in turn: ``timed_in_turn``).

Overlap needs an idle resource, as on a TPU, where the dense part runs on
the TensorCore while the SparseCore serves the embedding. By default the
dense part is one XLA op on one core (``--dense xla``: an accelerator of
its own), every op runs on one thread and two ops run at once, and a call
runs 8 steps in one graph (``--steps_per_call``, as Keras'
``steps_per_execution``): while the dense part computes on one core, the
other core applies the held update and prepares the next step's lookup.
Each step's "cores busy" (processor time over wall time) shows the idle
resource: on 2 cores, 2026-11-27, the unpipelined step kept 1.37 cores
busy and the pipelined one 1.87, 1.40x faster (7 repeats, 1.35-1.51x).
With TensorFlow's ops for the dense part and every core on each op
(``--dense ops --intra_op_threads 0 --inter_op_threads 0``) both steps
keep 1.73-1.74 cores busy: nothing is left to overlap on a CPU, and the
ratio, 0.997x (11 repeats, 0.89-1.09x), is the A/A control's, 1.008x
(0.90-1.12x): ``--control`` times a second unpipelined model in turn
with the others, so that a ratio can be told from this machine's noise.

Run:
  python3 tools/pipelining_benchmark.py
  python3 tools/pipelining_benchmark.py --dense ops --intra_op_threads 0 \
    --inter_op_threads 0 --control  # every core on each op, with an A/A
  python3 tools/pipelining_benchmark.py --hidden 256 --steps_per_call 1
  python3 tools/pipelining_benchmark.py --repeats 5 --json /tmp/pipe.json

Each time is measured ``--repeats`` times: the median is printed with the
range and the spread (range / median); ``--json`` writes every repeat,
the per-repeat ratio included.
"""

from __future__ import annotations

import argparse
import time

from model_garden import cli

if __name__ == "__main__":
  cli.quiet_tensorflow()  # before TensorFlow is imported

import _timing  # noqa: E402  (tools/_timing.py, next to this script)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402


def make_model(args, pipelined: bool):
  tables = [
    tpe.TableConfig(args.rows, args.dim, name=f"t{i}")
    for i in range(args.tables)
  ]
  embedding = tpe.TPUEmbedding(
    {f"f{i}": tpe.FeatureConfig(t) for i, t in enumerate(tables)},
    tpe.Adagrad(0.05),
    pipeline_execution_with_tensor_core=pipelined,
  )
  embedding.build()
  keras.utils.set_random_seed(0)
  mlp = keras.Sequential(
    [
      keras.layers.Dense(args.hidden, activation="relu")
      for _ in range(args.layers)
    ]
    + [keras.layers.Dense(1)]
  )
  mlp.build((None, args.tables * args.dim))
  return embedding, mlp, keras.optimizers.SGD(0.01)


def dense_part(args, mlp):
  """``(loss, d loss / d x, d loss / d weights)`` of the MLP on ``x``.

  With ``--dense xla`` it is one XLA cluster: a single op that runs on one
  core (``--intra_op_threads 1``), as the dense part would on an
  accelerator of its own, leaving the other core to the embedding.
  """

  def loss_and_grads(x, labels):
    with tf.GradientTape() as tape:
      tape.watch(x)
      loss = tf.reduce_mean(tf.square(mlp(x)[:, 0] - labels))
    grads = tape.gradient(loss, [x, mlp.trainable_variables])
    return loss, grads[0], grads[1]

  if args.dense == "xla":
    return tf.function(loss_and_grads, jit_compile=True)
  return loss_and_grads


def training_step(args, embedding, mlp, optimizer):
  dense = dense_part(args, mlp)

  def step(features, labels):
    embedding.enqueue(features)
    activations = embedding.dequeue()
    x = tf.concat([activations[f"f{i}"] for i in range(args.tables)], 1)
    loss, x_grads, mlp_grads = dense(x, labels)
    embedding.apply_gradients(
      dict(
        zip(
          [f"f{i}" for i in range(args.tables)],
          tf.split(x_grads, args.tables, axis=1),
          strict=True,
        )
      )
    )
    optimizer.apply_gradients(
      zip(mlp_grads, mlp.trainable_variables, strict=True)
    )
    return loss

  return calls(args, step)


def dense_only_step(args, mlp, optimizer):
  dense = dense_part(args, mlp)

  def step(x, labels):
    loss, _, grads = dense(x, labels)
    optimizer.apply_gradients(zip(grads, mlp.trainable_variables, strict=True))
    return loss

  return calls(args, step)


def embedding_only_step(args, embedding):
  def step(features, labels):
    del labels
    embedding.enqueue(features)
    with tf.GradientTape() as tape:
      activations = embedding.dequeue()
      tape.watch(activations)
      loss = sum(tf.reduce_sum(a) for a in activations.values())
    embedding.apply_gradients(tape.gradient(loss, activations))
    return loss

  return calls(args, step)


def calls(args, step):
  """One ``tf.function`` running ``args.steps_per_call`` steps in order.

  As Keras' ``steps_per_execution`` and TPU host loops do: the steps of a
  call are one graph, so the next step's input work need not wait for
  Python.
  """

  @tf.function
  def run(batches):
    for batch in batches:
      loss = step(*batch)
    return loss

  return run


def seconds_per_step(step, batches, args) -> float:
  """Seconds per step, ``args.steps_per_call`` steps per call."""
  return wall_and_processor_seconds(step, batches, args)[0]


def wall_and_processor_seconds(step, batches, args) -> tuple[float, float]:
  """Wall and processor seconds (this process, all threads) per step."""
  per_call = args.steps_per_call

  def group(i: int) -> list:
    return [batches[(i * per_call + k) % len(batches)] for k in range(per_call)]

  for i in range(args.warmup):
    step(group(i)).numpy()
  count = args.steps // per_call
  processor_start, start = time.process_time(), time.perf_counter()
  for i in range(count):
    loss = step(group(i))
  loss.numpy()
  wall = time.perf_counter() - start
  processor = time.process_time() - processor_start
  return wall / (count * per_call), processor / (count * per_call)


def timed_in_turn(
  args, steps: dict, batches: list
) -> dict[str, _timing.Measurement]:
  """The training steps timed in turn, ``args.repeats`` times each.

  The machine's speed drifts over a run, by more than pipelining changes
  a step on two CPU cores: each repeat times every step one after the
  other (the order reverses every other repeat) and ratios are taken
  within the repeat, so that their median and range compare like with
  like. With ``--control`` a second unpipelined model is timed as well:
  its ratio to the first (an A/A comparison) is this machine's noise.

  Args:
    args: the parsed flags.
    steps: ``unpipelined``, ``pipelined`` and optionally
      ``unpipelined_again``: each a step function.
    batches: the steps' inputs, cycled through.

  Returns:
    Measurements by name: ``{name}_step`` (ms/step) and
    ``{name}_cores_busy`` (processor time over wall time) of each step,
    ``step_ratio_unpipelined_vs_pipelined`` (above 1: pipelining is
    faster) and, with the control, ``step_ratio_unpipelined_vs_again``.
  """
  times: dict[str, list[float]] = {name: [] for name in steps}
  busy: dict[str, list[float]] = {name: [] for name in steps}
  for repeat in range(args.repeats):
    order = list(steps) if repeat % 2 == 0 else list(steps)[::-1]
    for name in order:
      wall, processor = wall_and_processor_seconds(steps[name], batches, args)
      times[name].append(1000 * wall)
      busy[name].append(processor / wall)
  measurements = {}
  for name in steps:
    measurements[f"{name}_step"] = _timing.Measurement(
      f"{name}_step", "ms/step", times[name]
    )
    measurements[f"{name}_cores_busy"] = _timing.Measurement(
      f"{name}_cores_busy", "cores", busy[name]
    )
  for other, key in (
    ("pipelined", "step_ratio_unpipelined_vs_pipelined"),
    ("unpipelined_again", "step_ratio_unpipelined_vs_again"),
  ):
    if other in steps:
      measurements[key] = _timing.per_repeat_ratio(
        key, times["unpipelined"], times[other]
      )
  return measurements


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--tables", type=cli.positive_int, default=8, help="Tables."
  )
  parser.add_argument(
    "--rows", type=cli.positive_int, default=100_000, help="Rows each."
  )
  parser.add_argument(
    "--dim", type=cli.positive_int, default=64, help="Table width."
  )
  parser.add_argument(
    "--ids_per_example",
    type=cli.positive_int,
    default=4,
    help="Ids per feature.",
  )
  parser.add_argument(
    "--batch_size",
    type=cli.positive_int,
    default=4096,
    help="Examples per step.",
  )
  parser.add_argument(
    "--hidden",
    type=cli.positive_int,
    default=128,
    help="Units of each MLP layer.",
  )
  parser.add_argument(
    "--layers", type=cli.positive_int, default=2, help="MLP layers."
  )
  parser.add_argument(
    "--steps", type=cli.positive_int, default=32, help="Timed steps per repeat."
  )
  parser.add_argument(
    "--warmup", type=int, default=3, help="Untimed calls before each repeat."
  )
  parser.add_argument(
    "--steps_per_call",
    type=int,
    default=8,
    help="Steps run by one tf.function call (as Keras' steps_per_execution).",
  )
  parser.add_argument(
    "--repeats",
    type=cli.positive_int,
    default=3,
    help="Timings of each measurement (median and spread are reported).",
  )
  parser.add_argument(
    "--json", default=None, help="Also write every timing to this file."
  )
  parser.add_argument(
    "--dense",
    choices=["xla", "ops"],
    default="xla",
    help="xla: the dense part is one XLA op on one core (an accelerator of "
    "its own); ops: TensorFlow's ops, two at once.",
  )
  parser.add_argument(
    "--intra_op_threads",
    type=int,
    default=1,
    help="Threads per op (0: TensorFlow's default, every core). 1 with "
    "--inter_op_threads 2 leaves a core to the update beside the dense part.",
  )
  parser.add_argument(
    "--control",
    action="store_true",
    help="Also time a second unpipelined model in turn with the others: "
    "its ratio to the first (A/A) shows how far noise alone moves a ratio.",
  )
  parser.add_argument(
    "--inter_op_threads",
    type=int,
    default=2,
    help="Ops run at once (0: TensorFlow's default).",
  )
  return parser


def main(argv: list[str] | None = None) -> None:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.steps_per_call < 1 or args.steps % args.steps_per_call:
    parser.error(
      f"--steps ({args.steps}) must be a multiple of --steps_per_call "
      f"({args.steps_per_call}), which must be >= 1."
    )
  # Before any op runs: with one thread per op and two ops at a time, the
  # dense part leaves a core idle that a held update can use.
  if args.intra_op_threads:
    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
  if args.inter_op_threads:
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)

  rng = np.random.default_rng(0)
  batches = []
  for _ in range(4):
    features = {
      f"f{i}": tf.RaggedTensor.from_uniform_row_length(
        tf.constant(
          rng.integers(0, args.rows, args.batch_size * args.ids_per_example)
        ),
        args.ids_per_example,
      )
      for i in range(args.tables)
    }
    labels = tf.constant(rng.normal(size=args.batch_size).astype(np.float32))
    batches.append((features, labels))

  def ms_per_step(name: str, step, inputs) -> _timing.Measurement:
    return _timing.repeat(
      name,
      "ms/step",
      lambda: 1000 * seconds_per_step(step, inputs, args),
      args.repeats,
    )

  plain = make_model(args, pipelined=False)
  dense_input = [
    (tf.random.normal([args.batch_size, args.tables * args.dim]), labels)
    for _, labels in batches
  ]
  print(
    f"{args.tables} tables x {args.rows:,} x {args.dim}, "
    f"{args.ids_per_example} ids/example, batch {args.batch_size}, MLP "
    f"{args.layers} x {args.hidden} ({args.dense}); {args.steps_per_call} "
    f"steps per call; {args.repeats} repeats; threads per "
    f"op {args.intra_op_threads or 'default'}, ops at once "
    f"{args.inter_op_threads or 'default'}",
    flush=True,
  )
  sparse = ms_per_step(
    "embedding_part", embedding_only_step(args, plain[0]), batches
  )
  print(f"embedding part alone : {sparse.describe('{:.1f}')}", flush=True)
  dense = ms_per_step(
    "dense_part", dense_only_step(args, *plain[1:]), dense_input
  )
  print(f"dense part alone     : {dense.describe('{:.1f}')}", flush=True)
  steps = {
    "unpipelined": training_step(args, *plain),
    "pipelined": training_step(args, *make_model(args, pipelined=True)),
  }
  if args.control:
    steps["unpipelined_again"] = training_step(
      args, *make_model(args, pipelined=False)
    )
  timed = timed_in_turn(args, steps, batches)
  labels = {
    "unpipelined": "unpipelined step     ",
    "pipelined": "pipelined step       ",
    "unpipelined_again": "unpipelined again    ",
  }
  for name in steps:
    step_time, busy = timed[f"{name}_step"], timed[f"{name}_cores_busy"]
    print(
      f"{labels[name]}: {step_time.describe('{:.1f}')}; cores busy "
      f"{busy.median:.2f}",
      flush=True,
    )
  ratio = timed["step_ratio_unpipelined_vs_pipelined"]
  print(
    "step-time ratio (unpipelined / pipelined), per repeat: "
    f"{ratio.describe('{:.3f}')}"
  )
  if args.control:
    control = timed["step_ratio_unpipelined_vs_again"]
    print(
      "A/A control (unpipelined / unpipelined again), per repeat: "
      f"{control.describe('{:.3f}')}: this machine's noise"
    )
  if args.json:
    _timing.write_json(args.json, vars(args), [sparse, dense, *timed.values()])
    print(f"wrote {args.json}")


if __name__ == "__main__":
  cli.run(main)
