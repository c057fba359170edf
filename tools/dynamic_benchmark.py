"""Dynamic vocabularies: step time against fixed tables, and memory.

Two measurements in one process:

1. **Speed.** The same training step (``--tables`` tables of ``--rows`` x
   ``--dim``, Adagrad, batch ``--batch_size``, a linear head) on raw keys
   from a space of ``--key_space`` keys (Zipf ranks, scattered): once with
   fixed tables fed ``key mod rows`` (the usual modulo hashing), once with
   dynamic tables of the same capacity fed the raw keys. Repeats alternate
   the two and the ratio is taken per repeat.
2. **Memory.** A stream of ``--stream_keys`` distinct keys (every key new)
   through the dynamic tables: the process's resident memory (``VmRSS``)
   once the tables are full, and its peak (``VmHWM``, reset then) over the
   rest of the stream, both from ``/proc/self/status``. The vocabulary
   state is fixed by the capacity, so the two are equal up to noise: a
   ratio above 1 is memory kept per key or per step.

Prints progress lines with examples/s; ``--json`` writes every figure.

Run:
  python3 tools/dynamic_benchmark.py
  python3 tools/dynamic_benchmark.py --stream_keys 10000000 --rows 100000
"""

from __future__ import annotations

import argparse
import time

from model_garden import cli

if __name__ == "__main__":
  cli.quiet_tensorflow()  # before TensorFlow is imported

import _timing  # noqa: E402  (tools/_timing.py, next to this script)
import numpy as np  # noqa: E402
import proc_memory  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402


def make_embedding(args, dynamic: bool) -> tpe.TPUEmbedding:
  vocabulary = tpe.DynamicVocabulary(eviction="lru") if dynamic else None
  tables = [
    tpe.TableConfig(args.rows, args.dim, name=f"t{t}", vocabulary=vocabulary)
    for t in range(args.tables)
  ]
  embedding = tpe.TPUEmbedding(
    {f"f{t}": tpe.FeatureConfig(table) for t, table in enumerate(tables)},
    tpe.Adagrad(0.05),
  )
  embedding.build()
  return embedding


def make_step(args, embedding: tpe.TPUEmbedding):
  head = tf.constant(
    np.random.default_rng(0).normal(size=(args.dim, 1)), tf.float32
  )

  @tf.function
  def step(features):
    embedding.enqueue(features, training=True)
    with tf.GradientTape() as tape:
      activations = embedding.dequeue()
      tape.watch(activations)
      loss = tf.add_n(
        [tf.reduce_mean(tf.square(a @ head)) for a in activations.values()]
      )
    embedding.apply_gradients(tape.gradient(loss, activations))
    return loss

  return step


def key_batches(args, rng) -> list[np.ndarray]:
  """Raw keys, Zipf(--zipf) ranks scattered over the key space."""
  scatter = rng.permutation(args.key_space).astype(np.int64)
  scatter = scatter * 1_000_003 + 2**40
  batches = []
  for _ in range(args.distinct_batches):
    ranks = np.minimum(
      rng.zipf(args.zipf, (args.tables, args.batch_size)), args.key_space
    )
    batches.append(scatter[ranks - 1])
  return batches


def speed(args) -> list[_timing.Measurement]:
  rng = np.random.default_rng(1)
  keys = key_batches(args, rng)
  fixed_batches = [
    {f"f{t}": tf.constant(k[t] % args.rows) for t in range(args.tables)}
    for k in keys
  ]
  raw_batches = [
    {f"f{t}": tf.constant(k[t]) for t in range(args.tables)} for k in keys
  ]
  fixed = make_step(args, make_embedding(args, dynamic=False))
  dynamic = make_step(args, make_embedding(args, dynamic=True))
  rates: dict[str, list[float]] = {"fixed": [], "dynamic": []}
  for repeat in range(args.repeats):
    rates["fixed"].append(
      _timing.examples_per_second(fixed, fixed_batches, args)
    )
    rates["dynamic"].append(
      _timing.examples_per_second(dynamic, raw_batches, args)
    )
    print(
      f"  repeat {repeat + 1}/{args.repeats}: fixed "
      f"{rates['fixed'][-1]:,.0f}, dynamic {rates['dynamic'][-1]:,.0f} "
      "examples/s",
      flush=True,
    )
  results = [
    _timing.Measurement(f"{k}_tables", "examples/s", v)
    for k, v in rates.items()
  ]
  ratio = _timing.per_repeat_ratio(
    "step_ratio_dynamic_vs_fixed", rates["fixed"], rates["dynamic"]
  )
  print(f"fixed tables (key mod rows): {results[0].describe()}")
  print(f"dynamic tables (raw keys)  : {results[1].describe()}")
  print(f"step time, dynamic / fixed : {ratio.describe('{:.2f}')}")
  return [*results, ratio]


def memory(args) -> list[_timing.Measurement]:
  """Resident memory once the tables are full, and its peak while the rest
  of the stream (every key new) goes through them."""
  embedding = make_embedding(args, dynamic=True)
  step = make_step(args, embedding)
  per_step = args.tables * args.batch_size
  steps = max(1, args.stream_keys // per_step)
  fill_steps = max(1, -(-args.rows // args.batch_size))
  meter = proc_memory.Meter()
  meter.begin()
  next_key = 2**50
  after_fill = None
  start = time.perf_counter()
  for i in range(steps):
    batch = {
      f"f{t}": tf.range(
        next_key + t * args.batch_size,
        next_key + (t + 1) * args.batch_size,
        dtype=tf.int64,
      )
      for t in range(args.tables)
    }
    next_key += per_step
    step(batch).numpy()
    if i + 1 == fill_steps:
      after_fill = proc_memory.resident()
      proc_memory.reset_peak()  # The rest of the stream's peak, from here.
    if (i + 1) % args.log_every == 0 or i + 1 == steps:
      rate = (i + 1) * args.batch_size / (time.perf_counter() - start)
      print(
        f"  stream step {i + 1}/{steps}: {(i + 1) * per_step:,} distinct "
        f"keys, peak resident {proc_memory.peak() / 2**20:,.0f} MiB, "
        f"{rate:,.0f} examples/s",
        flush=True,
      )
  end = proc_memory.peak()
  after_fill = after_fill or end
  print(
    f"resident once the tables filled: {after_fill / 2**20:,.0f} MiB; peak "
    f"until {steps * per_step:,} distinct keys: {end / 2**20:,.0f} MiB "
    f"({end / after_fill:.3f}x)"
  )
  return [
    _timing.Measurement("resident_after_fill", "bytes", [after_fill]),
    _timing.Measurement("peak_resident_to_end", "bytes", [end]),
  ]


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--tables", type=cli.positive_int, default=8, help="Tables."
  )
  parser.add_argument(
    "--rows", type=cli.positive_int, default=100_000, help="Capacity."
  )
  parser.add_argument(
    "--dim", type=cli.positive_int, default=64, help="Table width."
  )
  parser.add_argument(
    "--batch_size", type=cli.positive_int, default=4096, help="Batch."
  )
  parser.add_argument(
    "--key_space",
    type=cli.positive_int,
    default=10_000_000,
    help="Distinct raw keys.",
  )
  parser.add_argument("--zipf", type=float, default=1.05, help="Skew.")
  parser.add_argument(
    "--steps", type=cli.positive_int, default=20, help="Timed steps."
  )
  parser.add_argument("--warmup", type=int, default=3, help="Untimed steps.")
  parser.add_argument(
    "--distinct_batches",
    type=cli.positive_int,
    default=8,
    help="Batches cycled.",
  )
  parser.add_argument(
    "--repeats", type=cli.positive_int, default=3, help="Repeats."
  )
  parser.add_argument(
    "--stream_keys",
    type=int,
    default=10_000_000,
    help="Distinct keys streamed for the memory measurement (0: skip).",
  )
  parser.add_argument(
    "--log_every", type=int, default=50, help="Stream steps per log line."
  )
  parser.add_argument("--json", default=None, help="Write figures here.")
  return parser


def main(argv: list[str] | None = None) -> None:
  args = build_parser().parse_args(argv)
  print(
    f"{args.tables} tables x {args.rows:,} rows x {args.dim}, batch "
    f"{args.batch_size}, Adagrad, Zipf({args.zipf}) keys over "
    f"{args.key_space:,}",
    flush=True,
  )
  results = speed(args)
  if args.stream_keys:
    results += memory(args)
  if args.json:
    _timing.write_json(args.json, vars(args), results)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  cli.run(main)
