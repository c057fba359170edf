"""Training-step throughput: tpu_embedding vs. plain Keras embeddings.

Both sides train the same model in the same process on the same batches:
``--tables`` tables of ``--rows`` x ``--dim``, one feature per table with
ids of ``--dist``, batch ``--batch_size``, a small shared dense head, and
Adagrad on the tables. The baseline is the plain Keras way: one
``keras.layers.Embedding`` per feature and ``keras.optimizers.Adagrad``.
The script prints examples/s for both and their ratio.

With ``--replicas 1,2,4`` it also trains the tables sharded over that many
logical CPU devices (``MirroredStrategy``, same global batch) and prints
examples/s and the step-time ratio to one replica for each count.

With ``--multi_hot mlperf`` every example has MLPerf DLRM-DCNv2's 214 ids
over the 26 features (hotness 3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9,
5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1), summed per feature, as ``--input``
ragged or sparse tensors (batch 2048 unless given); the Keras baseline
sums each feature's ``[batch, hotness]`` embeddings.

With ``--membench FILE`` (a JSON of ``../shared/membench/membench.py`` run
with ``--extra <dim>:0.001``, measured just before on the same machine) it
prints each setting's memory floor and our fraction of it (``_floor.py``:
distinct rows from DRAM, each id's row and gradient from cache); every
setting also reports the
peak resident growth of our step against the tables' state. ``--sweep``
runs several id distributions and/or table sizes; ``--plot`` draws them.

Run:
  python3 tools/benchmark.py                       # the issue's setting
  python3 tools/benchmark.py --rows 20000 --steps 5  # a quick look
  python3 tools/benchmark.py --dist zipf --zipf 1.05 --membench m.json
  python3 tools/benchmark.py --multi_hot mlperf --dist uniform --membench m.json
  python3 tools/benchmark.py --sweep all --membench m.json --plot b.png
  python3 tools/benchmark.py --replicas 1,2,4 --skip_keras
  python3 tools/benchmark.py --repeats 5 --json /tmp/benchmark.json

Every rate is measured ``--repeats`` times (warm-up steps before each):
the median is printed with the range and the spread (range / median).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
from typing import Any

from model_garden import cli

if __name__ == "__main__":
  cli.quiet_tensorflow()  # before TensorFlow is imported

import _disk  # noqa: E402  (tools/_disk.py, next to this script)
import _floor  # noqa: E402
import _plots  # noqa: E402
import _timing  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import proc_memory  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402
from tpu_embedding import data  # noqa: E402
from tpu_embedding.tables.row_cache import CacheCounts  # noqa: E402


def skewed_ids(
  rng: np.random.Generator, rows: int, size: int, exponent: float
) -> np.ndarray:
  """Skewed ids in ``[0, rows)``: unbounded Zipf ranks folded modulo
  ``rows``, shuffled over the table (this tool's original distribution)."""
  ranks = rng.zipf(exponent, size) - 1
  ranks = ranks % rows
  permutation = rng.permutation(rows)
  return permutation[ranks].astype(np.int64)


def zipf_ids(
  rng: np.random.Generator, rows: int, size: int, exponent: float
) -> np.ndarray:
  """Zipf ids in ``[0, rows)``: rank ``r`` (1-based) drawn with probability
  ``r**-exponent`` normalized over the table, ranks scattered by a random
  permutation (membench's distribution)."""
  weights = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
  cdf = np.cumsum(weights / weights.sum())
  ranks = np.minimum(np.searchsorted(cdf, rng.random(size)), rows - 1)
  return rng.permutation(rows)[ranks].astype(np.int64)


def uniform_ids(
  rng: np.random.Generator, rows: int, size: int, exponent: float
) -> np.ndarray:
  """Uniform ids in ``[0, rows)`` (``exponent`` is ignored)."""
  del exponent
  return rng.integers(0, rows, size, dtype=np.int64)


#: ``--dist`` choices: id sampler ``(rng, rows, size, exponent) -> ids``.
DISTRIBUTIONS = {"uniform": uniform_ids, "zipf": zipf_ids, "skewed": skewed_ids}


#: ``--multi_hot`` choices: ids per example of each feature.
HOTNESS = {
  "mlperf": (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12,
             100, 27, 10, 3, 1, 1),
}  # fmt: skip


def hotness(args: argparse.Namespace) -> list[int]:
  """Ids per example of each feature (1 each without ``--multi_hot``)."""
  if args.multi_hot == "none":
    return [1] * args.tables
  return list(HOTNESS[args.multi_hot])


def _feature(ids: np.ndarray, hot: int, args: argparse.Namespace) -> Any:
  """One feature's ids: a vector (one-hot) or a ragged or sparse batch."""
  if args.multi_hot == "none":
    return tf.constant(ids)
  lengths = np.full(args.batch_size, hot, np.int64)
  bags = tf.RaggedTensor.from_row_lengths(tf.constant(ids), lengths)
  return bags if args.input == "ragged" else bags.to_sparse()


def make_batches(args: argparse.Namespace) -> list[dict[str, Any]]:
  rng = np.random.default_rng(0)
  sample = DISTRIBUTIONS[args.dist]
  return [
    {
      f"f{t}": _feature(
        sample(rng, args.rows, args.batch_size * hot, args.zipf), hot, args
      )
      for t, hot in enumerate(hotness(args))
    }
    for _ in range(args.distinct_batches)
  ]


def dense_batches(batches: list[dict[str, Any]], args) -> list[dict]:
  """The batches as ``[batch, hotness]`` tensors (the Keras baseline's)."""
  if args.multi_hot == "none":
    return batches
  return [
    {
      name: tf.reshape(bags.values, [args.batch_size, -1])
      for name, bags in batch.items()
    }
    for batch in batches
  ]


def head_loss(activations: list[tf.Tensor], head: tf.Tensor) -> tf.Tensor:
  """The shared dense part: a linear head and a squared loss.

  ``concat(activations) @ head`` computed as the sum of each feature's
  activations times its slice of ``head``: the same function, without
  copying every activation (and its gradient) into one wide tensor, so
  the step measures the embedding rather than that copy.
  """
  dim = activations[0].shape[-1]
  logits = tf.add_n(
    [a @ head[i * dim : (i + 1) * dim] for i, a in enumerate(activations)]
  )
  return tf.reduce_mean(tf.square(logits - 1.0))


#: ``--table_stacking`` values: the layer's argument for the tables.
STACKING = {
  "auto": lambda tables: "auto",
  "none": lambda tables: None,
  "all": lambda tables: [[t.name for t in tables]],
}


def row_storage(table_dtype: str, rounding: str = "stochastic"):
  """The tables' ``RowStorage``: Adagrad's accumulators in bfloat16 beside
  16-bit rows (float16 slots are refused for Adagrad), float32 beside
  float32 ones."""
  slots = "float32" if table_dtype == "float32" else "bfloat16"
  return tpe.RowStorage(table_dtype, slots, rounding)


def make_embedding(args, disk=None, storage=None, optimizer=None):
  """The tables (kept on ``disk``, a ``DiskTier``, if given: unstacked),
  stored as ``storage`` (default: float32), trained by ``optimizer``
  (default: Adagrad)."""
  storage = storage or tpe.RowStorage()
  tables = [
    tpe.TableConfig(
      args.rows, args.dim, combiner="sum", name=f"t{t}", storage=storage
    )
    for t in range(args.tables)
  ]
  config = {f"f{t}": tpe.FeatureConfig(tables[t]) for t in range(args.tables)}
  embedding = tpe.TPUEmbedding(
    config,
    optimizer or tpe.Adagrad(learning_rate=0.05),
    table_stacking=None
    if disk is not None
    else STACKING[args.table_stacking](tables),
    row_sharding_threshold=tpe.sharding.PlacementPolicy(disk=disk)
    if disk is not None
    else tpe.sharding.DEFAULT_ROW_THRESHOLD,
  )
  embedding.build()
  return embedding


def tpu_embedding_step(args, head, embedding=None):
  embedding = embedding or make_embedding(args)
  return embedding_step(args, head, embedding)


def embedding_step(args, head, embedding):
  """The timed step on ``embedding``: lookup, head loss, update."""

  @tf.function
  def step(features):
    embedding.enqueue(features, training=True)
    with tf.GradientTape() as tape:
      activations = embedding.dequeue()
      tape.watch(activations)
      loss = head_loss([activations[f"f{t}"] for t in range(args.tables)], head)
    embedding.apply_gradients(tape.gradient(loss, activations))
    return loss

  return step


def keras_step(args, head):
  layers = [
    keras.layers.Embedding(args.rows, args.dim) for _ in range(args.tables)
  ]
  for layer in layers:
    layer.build((None,))
  variables = [layer.embeddings for layer in layers]
  optimizer = keras.optimizers.Adagrad(learning_rate=0.05)
  optimizer.build(variables)

  @tf.function
  def step(features):
    with tf.GradientTape() as tape:
      activations = [layers[t](features[f"f{t}"]) for t in range(args.tables)]
      if args.multi_hot != "none":  # [batch, hotness, dim] summed per bag
        activations = [tf.reduce_sum(a, axis=1) for a in activations]
      loss = head_loss(activations, head)
    grads = tape.gradient(loss, variables)
    optimizer.apply_gradients(zip(grads, variables, strict=True))
    return loss

  return step


def sharded_step(args, head, replicas: int):
  """The same step with tables sharded over ``replicas`` logical CPUs."""
  # Strategies over different device sets in one process need their own
  # collective key ranges.
  tf.distribute.MirroredStrategy._collective_key_base = 1000 * replicas
  strategy = tf.distribute.MirroredStrategy(
    [f"/cpu:{i}" for i in range(replicas)]
  )
  with strategy.scope():
    embedding = make_embedding(args)
  per_replica = args.batch_size // replicas

  @tf.function
  def step(features):
    embedding.enqueue(
      strategy.experimental_distribute_values_from_function(
        lambda ctx: {
          k: _rows_of(
            v, ctx.replica_id_in_sync_group * per_replica, per_replica
          )
          for k, v in features.items()
        }  # fmt: skip
      )
    )

    def replica_fn():
      with tf.GradientTape() as tape:
        activations = embedding.dequeue()
        tape.watch(activations)
        loss = head_loss(
          [activations[f"f{t}"] for t in range(args.tables)], head
        )
      embedding.apply_gradients(tape.gradient(loss, activations))
      return loss

    return strategy.reduce("SUM", strategy.run(replica_fn), axis=None)

  return step


def _rows_of(ids: Any, start: int, size: int) -> Any:
  """Examples ``[start, start + size)`` of one feature's ids."""
  if isinstance(ids, tf.SparseTensor):
    return tf.sparse.slice(ids, [start, 0], [size, ids.dense_shape[1]])
  return ids[start : start + size]


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--tables", type=cli.positive_int, default=26, help="Tables."
  )
  parser.add_argument(
    "--rows", type=cli.positive_int, default=200_000, help="Rows each."
  )
  parser.add_argument(
    "--dim", type=cli.positive_int, default=64, help="Table width."
  )
  parser.add_argument(
    "--batch_size",
    type=cli.positive_int,
    default=None,
    help="Examples per step (default: 4096; 2048 with --multi_hot).",
  )
  parser.add_argument(
    "--multi_hot",
    choices=["none", *sorted(HOTNESS)],
    default="none",
    help="Ids per example of each feature: one (none) or MLPerf "
    "DLRM-DCNv2's multi-hot sizes over 26 tables (mlperf), sum combiner.",
  )
  parser.add_argument(
    "--input",
    choices=["ragged", "sparse"],
    default="ragged",
    help="How multi-hot ids come in (--multi_hot).",
  )
  parser.add_argument(
    "--dist",
    choices=sorted(DISTRIBUTIONS),
    default="skewed",
    help="Id distribution: uniform; zipf (truncated Zipf over the table, "
    "ranks scattered, as membench's floor assumes); skewed (unbounded "
    "Zipf ranks folded modulo the rows).",
  )
  parser.add_argument(
    "--zipf",
    type=float,
    default=1.2,
    help="Zipf exponent of the ids (zipf and skewed; membench uses 1.05).",
  )
  parser.add_argument(
    "--steps", type=cli.positive_int, default=20, help="Timed steps per repeat."
  )
  parser.add_argument(
    "--warmup",
    type=cli.non_negative_int,
    default=3,
    help="Untimed steps before each repeat.",
  )
  parser.add_argument(
    "--distinct_batches",
    type=cli.positive_int,
    default=4,
    help="Batches generated (and cycled through).",
  )
  parser.add_argument(
    "--replicas",
    type=cli.positive_ints,
    default=[1],
    help="Comma-separated replica counts for sharded runs, e.g. 1,2,4.",
  )
  parser.add_argument(
    "--skip_keras",
    action="store_true",
    help="Do not time the plain Keras baseline.",
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
    "--table_stacking",
    choices=sorted(STACKING),
    default="auto",
    help="Stack the tables (one store, one update per stack): the "
    "platform's choice (auto), never (none) or all in one stack (all).",
  )
  parser.add_argument(
    "--membench",
    default=None,
    help="A membench.py JSON (../shared/membench, measured just before on "
    "this machine): also print the memory floor of each setting and our "
    "fraction of it.",
  )
  parser.add_argument(
    "--sweep",
    choices=["none", "dist", "rows", "all"],
    default="none",
    help="dist: uniform, zipf 1.05 and skewed 1.2 ids; rows: "
    "--sweep_tables tables of each --sweep_rows size; all: both.",
  )
  parser.add_argument(
    "--sweep_rows",
    type=cli.positive_ints,
    default=[100000, 250000, 500000, 1000000, 2000000],
    help="Rows per table of the rows sweep.",
  )
  parser.add_argument(
    "--sweep_tables",
    type=cli.positive_int,
    default=8,
    help="Tables of the rows sweep.",
  )
  parser.add_argument(
    "--plot",
    default=None,
    help="Draw examples/s (ours, Keras, the floor) across the sweeps to "
    "this PNG.",
  )
  parser.add_argument(
    "--table_dtype",
    choices=["float32", "bfloat16", "float16"],
    default="float32",
    help="bfloat16 or float16: time the tables stored in 16 bits "
    "(RowStorage, Adagrad's slots in bfloat16) against float32 ones, in "
    "turn within each repeat, with peak memory and the floors of each.",
  )
  parser.add_argument(
    "--rounding",
    choices=["stochastic", "nearest"],
    default="stochastic",
    help="--table_dtype: how the 16-bit tables round each update.",
  )
  parser.add_argument(
    "--storage",
    choices=["memory", "disk"],
    default="memory",
    help="disk: also train the tables kept on a local disk behind a RAM "
    "cache (DiskTier), against the in-memory tables and the IO floor "
    "(each table's hot rows fixed across steps; fresh batches each step).",
  )
  parser.add_argument(
    "--cache_fraction",
    type=float,
    default=0.1,
    help="--storage disk: each table's cache, a fraction of its rows.",
  )
  parser.add_argument(
    "--disk_probe_mib",
    type=cli.positive_int,
    default=1024,
    help="--storage disk: MiB of the file whose random reads measure the "
    "disk (each page read once, so the reads cannot come from memory).",
  )
  parser.add_argument(
    "--disk_dir",
    default=None,
    help="--storage disk: a directory on the local disk (default: a new "
    "one in the temporary directory).",
  )
  parser.add_argument(
    "--disk_warmup",
    type=cli.non_negative_int,
    default=500,
    help="--storage disk: untimed steps on disk first (more until every "
    "cache is full), so that the cache's counts of each row's lookups "
    "have learnt which rows are hot, as in a long training run.",
  )
  parser.add_argument(
    "--batches_ahead",
    type=cli.positive_int,
    default=2,
    help="--storage disk: batches whose missed rows data.prefetch_rows "
    "reads ahead of the step (2: the disk kept busy; 1: less CPU beside "
    "the step).",
  )
  return parser


def describe_ids(args: argparse.Namespace) -> str:
  if args.dist == "uniform":
    return "uniform"
  return f"{args.dist} Zipf({args.zipf})"


def _head(args) -> tf.Tensor:
  return tf.constant(
    np.random.default_rng(1)
    .normal(size=(args.tables * args.dim, 1))
    .astype(np.float32)
    * 0.01
  )


def _measure(name: str, step, batches, args) -> _timing.Measurement:
  return _timing.repeat(
    name,
    "examples/s",
    lambda: _timing.examples_per_second(step, batches, args),
    args.repeats,
  )


def _unique_rows(batches, args) -> float:
  """Distinct ids of a step (all tables), measured or expected."""
  if args.dist == "skewed":
    return float(
      np.mean(
        [
          sum(len(np.unique(dense.numpy())) for dense in batch.values())
          for batch in dense_batches(batches, args)
        ]
      )
    )
  return sum(
    _floor.expected_unique(args.dist, args.rows, args.batch_size * hot,
                           args.zipf)
    for hot in hotness(args)
  )  # fmt: skip


#: Labels of the settings whose peak memory was measured (the first one).
_MEASURED_MEMORY: list[str] = []


def measure_setting(args, label: str, key: str | None = None) -> dict:
  """Ours (with peak memory) and Keras for one setting; prints as it goes.

  Measurements are named ``tpu_embedding[key]`` and ``keras[key]`` (plain
  ``tpu_embedding`` and ``keras`` without a key).
  """
  suffix = "" if key is None else f"[{key}]"
  batches = make_batches(args)
  head = _head(args)
  result: dict = {"label": label, "rows": args.rows, "tables": args.tables}
  gc.collect()
  baseline = proc_memory.resident()
  try:
    proc_memory.reset_peak()
  except OSError:  # /proc/self/clear_refs not writable: no memory figure
    baseline = None
  ours = _measure(f"tpu_embedding{suffix}", tpu_embedding_step(args, head),
                  batches, args)  # fmt: skip
  result["ours"] = ours
  print(f"  {label:<24} tpu_embedding: {ours.describe()}", flush=True)
  state = args.tables * args.rows * args.dim * 4 * 2  # table + accumulator
  if baseline is not None and not _MEASURED_MEMORY:
    # The first setting of the process only: later ones start from memory
    # that earlier ones freed but the allocator kept.
    _MEASURED_MEMORY.append(label)
    peak = proc_memory.peak()
    result.update(peak_bytes=peak, baseline_bytes=baseline, state_bytes=state)
    print(
      f"  {label:<24} peak resident {peak / 2**20:,.0f} MiB = "
      f"{peak / (state + baseline):.3f}x (tables and slots "
      f"{state / 2**20:,.0f} MiB + the process before them "
      f"{baseline / 2**20:,.0f} MiB); a transient copy of a table would "
      "exceed 1.10x",
      flush=True,
    )
  if args.membench:
    rates = _floor.rates(
      args.membench, args.dim, "uniform" if args.dist == "uniform" else "zipf"
    )
    result["floor"] = _floor.floor(
      rates,
      args.batch_size,
      _unique_rows(batches, args),
      args.batch_size * sum(hotness(args)),
    )
    print(
      f"  {label:<24} memory floor {result['floor']:,.0f} examples/s "
      f"({rates.pages} page rates): tpu_embedding at "
      f"{ours.median / result['floor']:.0%} of it",
      flush=True,
    )
  gc.collect()
  if not args.skip_keras:
    keras_rate = _measure(f"keras{suffix}", keras_step(args, head),
                          dense_batches(batches, args), args)  # fmt: skip
    result["keras"] = keras_rate
    print(
      f"  {label:<24} keras: {keras_rate.describe()}; tpu_embedding / "
      f"keras {ours.median / keras_rate.median:.1f}x",
      flush=True,
    )
  gc.collect()
  return result


def dist_sweep(args) -> list[dict]:
  settings = [("uniform", 1.05), ("zipf", 1.05), ("skewed", 1.2)]
  results = []
  for dist, exponent in settings:
    variant = argparse.Namespace(
      **{**vars(args), "dist": dist, "zipf": exponent}
    )
    results.append(measure_setting(variant, describe_ids(variant), dist))
  return results


def rows_sweep(args) -> list[dict]:
  results = []
  sizes = args.sweep_rows
  for rows in sizes:
    variant = argparse.Namespace(
      **{**vars(args), "rows": rows, "tables": args.sweep_tables}
    )
    results.append(measure_setting(variant, f"{rows:,} rows", f"{rows}_rows"))
  base = results[0]["ours"].median
  print(
    f"step time of tpu_embedding vs {sizes[0]:,} rows (target <= 1.5x at "
    f"{sizes[-1]:,}):"
  )
  for r in results:
    line = f"  {r['rows']:>11,} rows: {base / r['ours'].median:.2f}x"
    if "keras" in r:
      line += f"   keras {results[0]['keras'].median / r['keras'].median:.2f}x"
    print(line)
  return results


def _record(results: list[dict]) -> list[_timing.Measurement]:
  measurements = []
  for r in results:
    measurements.append(r["ours"])
    if "keras" in r:
      measurements.append(r["keras"])
  return measurements


def main(argv: list[str] | None = None) -> None:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.multi_hot != "none":
    if args.tables != len(HOTNESS[args.multi_hot]):
      parser.error(
        f"--multi_hot {args.multi_hot} has {len(HOTNESS[args.multi_hot])} "
        f"features, one per table; --tables is {args.tables}"
      )
    if args.sweep in ("rows", "all"):
      parser.error(
        f"--sweep {args.sweep} changes the number of tables; with "
        "--multi_hot use --sweep dist or none"
      )
  if args.batch_size is None:
    args.batch_size = 4096 if args.multi_hot == "none" else 2048
  if args.membench:  # Before minutes of timing: the rates the floor needs.
    sweeping = args.sweep in ("dist", "all")
    dists = ["uniform", "zipf"] if sweeping else [args.dist]
    for dist in dists:
      try:
        _floor.rates(args.membench, args.dim, "uniform" if dist == "uniform"
                     else "zipf")  # fmt: skip
      except (OSError, ValueError, KeyError) as error:
        raise cli.FixableError(f"--membench: {error}") from None
  replica_counts = args.replicas
  cpus = tf.config.list_physical_devices("CPU")
  tf.config.set_logical_device_configuration(
    cpus[0], [tf.config.LogicalDeviceConfiguration()] * max(replica_counts)
  )
  ids = (
    "one id per feature"
    if args.multi_hot == "none"
    else f"{args.multi_hot} multi-hot ({sum(hotness(args))} ids per "
    f"example, {args.input}, sum)"
  )
  print(
    f"{args.tables} tables x {args.rows:,} rows x {args.dim}, batch "
    f"{args.batch_size}, {ids}, {describe_ids(args)} ids, Adagrad, stacking "
    f"{args.table_stacking}; {args.steps} timed steps after {args.warmup} "
    f"warm-up steps, {args.repeats} repeats",
    flush=True,
  )
  extra: dict = {}
  if args.sweep in ("dist", "all"):
    print("across id distributions:")
    extra["dists"] = dist_sweep(args)
  if args.sweep in ("rows", "all"):
    print(f"across table sizes ({args.sweep_tables} tables):")
    extra["rows"] = rows_sweep(args)
  results: list[_timing.Measurement] = []
  for found in extra.values():
    results += _record(found)
  if args.storage == "disk":
    results += disk_setting(args)
  elif args.table_dtype != "float32":
    results += precision_pair(args)
  elif args.sweep == "none":
    base = measure_setting(args, describe_ids(args))
    results += _record([base])
    sharded = [r for r in replica_counts if r > 1]
    if sharded:
      results += replica_scaling(args, sharded)
    extra["base"] = [base]
  if args.plot:
    _plots.benchmark_figure(args.plot, extra.get("dists"), extra.get("rows"),
                            title=_plots.title(args))  # fmt: skip
    print(f"wrote {args.plot}")
  if args.json:
    _timing.write_json(
      args.json, {**vars(args), "figures": _figures(extra)}, results
    )
    print(f"wrote {args.json}")


def _disk_batches(args, count: int, seed: int) -> list[dict[str, Any]]:
  """``count`` fresh batches, each table's hot rows fixed (``_disk.py``)."""
  rng = np.random.default_rng(seed)
  p = _disk.probabilities(args.dist, args.rows, args.zipf)
  orders = [
    np.random.default_rng(1000 + t).permutation(args.rows)
    for t in range(args.tables)
  ]
  return [
    {
      f"f{t}": _feature(
        _disk.fixed_ids(rng, orders[t], p, args.batch_size * hot), hot, args
      )
      for t, hot in enumerate(hotness(args))
    }
    for _ in range(count)
  ]


def disk_setting(args) -> list[_timing.Measurement]:
  """In memory and on disk, the same fresh batches, against the IO floor
  (the tables' files in a new folder of ``--disk_dir``, removed after)."""
  if args.disk_dir:
    os.makedirs(args.disk_dir, exist_ok=True)
  directory = tempfile.mkdtemp(prefix="tpe_disk_", dir=args.disk_dir)
  try:
    return _disk_setting(args, directory)
  finally:
    shutil.rmtree(directory, ignore_errors=True)


def _disk_setting(args, directory: str) -> list[_timing.Measurement]:
  cache_rows = max(1, int(args.cache_fraction * args.rows))
  cache_bytes = cache_rows * args.dim * 4 * 2  # rows and accumulators
  rate = _disk.disk_read_rate(directory, size=args.disk_probe_mib * 2**20)
  print(
    f"disk {directory}: {rate:,.0f} random 4 KiB reads/s (64 in flight); "
    f"cache {args.cache_fraction:.0%} of each table ({cache_rows:,} rows, "
    f"{cache_bytes / 2**20:,.1f} MiB)",
    flush=True,
  )
  head = _head(args)
  timed = args.repeats * args.steps
  batches = _disk_batches(args, timed, seed=1)
  memory_step = tpu_embedding_step(args, head)
  for batch in batches[: args.warmup]:
    memory_step(batch).numpy()
  memory = _timed("in memory", memory_step, batches, args)
  del memory_step
  gc.collect()
  disk = tpe.sharding.DiskTier(
    directory, cache_bytes, tuple(f"t{t}" for t in range(args.tables))
  )
  embedding = make_embedding(args, disk)
  disk_step = tpu_embedding_step(args, head, embedding)
  caches = [embedding.table_stores[f"t{t}"].cache for t in range(args.tables)]
  # Warm up --disk_warmup steps, and on until every cache is full (at
  # most twice as many), 50 fresh batches at a time.
  for step in range(2 * max(args.disk_warmup, 50)):
    if step % 50 == 0:
      warming = iter(_disk_batches(args, 50, seed=2 + step))
    disk_step(next(warming)).numpy()
    full = all(c.misses >= c.size for c in caches)
    if step + 1 >= args.disk_warmup and full:
      break
  before = _counts(embedding)
  on_disk = _timed("on disk", disk_step, batches, args, embedding)
  seconds = timed * args.batch_size / on_disk.median
  run = _counts(embedding) - before
  hits, misses, reads, writes = (
    run.hits,
    run.misses,
    run.rows_read,
    run.rows_written,
  )
  steps = timed
  ideal = sum(
    _disk.ideal_misses(args.dist, args.rows, args.batch_size * hot, args.zipf,
                       cache_rows)
    for hot in hotness(args)
  )  # fmt: skip
  files = 1  # one record (parameters and accumulators) per missed row
  floor = min(memory.median, args.batch_size * rate / (ideal * files))
  print(
    f"  hit rate {hits / (hits + misses):.1%}; per step {misses / steps:,.0f} "
    f"misses (an ideal cache: {ideal:,.0f}), {reads / steps * files:,.0f} "
    f"row reads ({run.read_ahead_rate:.0%} read ahead) and "
    f"{writes / steps * files:,.0f} row writes; "
    f"{reads * files / seconds:,.0f} reads/s; the files' pages in the page "
    f"cache {sum(c.files.cached_bytes() for c in caches) / 2**20:,.0f} MiB",
    flush=True,
  )
  print(
    f"  IO floor {floor:,.0f} examples/s = min(in memory, {rate:,.0f} "
    f"reads/s / {ideal * files:,.0f} reads a step x batch); on disk at "
    f"{on_disk.median / floor:.0%} of it, "
    f"{on_disk.median / memory.median:.2f}x the in-memory rate",
    flush=True,
  )
  # Where the disk bounds the floor, its ratio is the product of these two.
  print(
    f"  of it: the cache misses {misses / steps / ideal:.2f}x an ideal "
    f"cache's rows (it learns the hot rows as it trains), and the step "
    f"reads at {reads * files / seconds / rate:.0%} of the disk's rate",
    flush=True,
  )
  return [memory, on_disk]


def _counts(embedding) -> CacheCounts:
  """What every disk table's cache counted, together."""
  return sum(embedding.disk_tier_counts().values(), CacheCounts())


def _timed(
  name: str, step, batches, args, embedding=None
) -> _timing.Measurement:
  """``args.repeats`` timings of ``args.steps`` steps, each over batches
  not seen before (through ``data.prefetch_rows`` given ``embedding``:
  a disk tier's rows read while the step before runs)."""

  def once(repeat: list[int] = [0]) -> float:  # noqa: B006 (a counter)
    first = repeat[0] * args.steps
    repeat[0] += 1
    chosen = batches[first : first + args.steps]
    fed: Any = chosen
    if embedding is not None:
      fed = data.prefetch_rows(
        tf.data.Dataset.from_generator(
          lambda: iter(chosen),
          output_signature=tf.nest.map_structure(
            tf.type_spec_from_value, chosen[0]
          ),
        ),
        embedding,
        batches_ahead=args.batches_ahead,
      )
    start = time.perf_counter()
    for batch in fed:
      loss = step(batch)
    loss.numpy()
    return args.steps * args.batch_size / (time.perf_counter() - start)

  measured = _timing.repeat(name, "examples/s", once, args.repeats)
  print(f"  {name:<10}: {measured.describe()}", flush=True)
  return measured


def precision_pair(args) -> list[_timing.Measurement]:
  """The step on 16-bit tables against float32 ones, in turn each repeat.

  The 16-bit tables are built first, so the peak resident memory after
  their steps (``/proc/self/status`` VmHWM) is theirs alone; then the
  float32 tables'. Each repeat times both, one after the other (the
  ratio per repeat compares like with like on a drifting machine).
  """
  batches, head = make_batches(args), _head(args)
  low_storage = row_storage(args.table_dtype, args.rounding)
  name = f"{args.table_dtype} ({args.rounding})"
  phases = {}
  steps = {}
  for label, storage in ((name, low_storage), ("float32", tpe.RowStorage())):
    gc.collect()
    before = proc_memory.resident()
    proc_memory.reset_peak()
    embedding = make_embedding(args, storage=storage)
    steps[label] = embedding_step(args, head, embedding)
    _timing.examples_per_second(steps[label], batches, args)
    phases[label] = (proc_memory.peak() - before, embedding)
    state = sum(
      sum(store.bytes_per_device().values())
      for store in embedding.table_stores.values()
    )
    print(
      f"  {label:<22} tables and slots {state / 2**20:,.0f} MiB; peak "
      f"resident growth {phases[label][0] / 2**20:,.0f} MiB",
      flush=True,
    )
  rates: dict[str, list[float]] = {label: [] for label in steps}
  for _ in range(args.repeats):
    for label, step in steps.items():
      rates[label].append(_timing.examples_per_second(step, batches, args))
  low, full = (
    _timing.Measurement(f"tpu_embedding[{label}]", "examples/s", rates[label])
    for label in steps
  )
  ratio = _timing.per_repeat_ratio(
    f"{args.table_dtype}/float32", low.values, full.values
  )
  print(f"  {name:<22} {low.describe()}")
  print(f"  {'float32':<22} {full.describe()}")
  print(f"  {args.table_dtype} / float32: {ratio.describe('{:.2f}')} "
        "(per repeat)")  # fmt: skip
  growth = phases[name][0] / max(phases["float32"][0], 1)
  print(f"  peak resident growth {args.table_dtype} / float32: {growth:.2f}")
  if args.membench:
    unique = _unique_rows(batches, args)
    occurrences = args.batch_size * sum(hotness(args))
    dist = "uniform" if args.dist == "uniform" else "zipf"
    for label, measured, dim in (
      (name, low, args.dim // 2),  # 2-byte values: a float32 row half as wide
      ("float32", full, args.dim),
    ):
      try:
        rates_at = _floor.rates(args.membench, dim, dist)
      except (KeyError, ValueError) as error:
        print(f"  {label:<22} no floor: membench has no dim {dim} ({error})")
        continue
      floor = _floor.floor(rates_at, args.batch_size, unique, occurrences)
      print(
        f"  {label:<22} floor {floor:,.0f} examples/s ({rates_at.pages} page "
        f"rates, rows of {dim * 4} bytes): at {measured.median / floor:.0%}",
        flush=True,
      )
  return [low, full, ratio]


def replica_scaling(args, counts: list[int]) -> list[_timing.Measurement]:
  """Sharded steps against one device, timed in turn (paired ratios).

  The machine's speed drifts: each repeat times one device and then every
  replica count, and the step-time ratio is taken within the repeat.
  """
  head, batches = _head(args), make_batches(args)
  steps = {1: tpu_embedding_step(args, head)}
  for replicas in counts:
    steps[replicas] = sharded_step(args, head, replicas)
  rates: dict[int, list[float]] = {r: [] for r in steps}
  for _ in range(args.repeats):
    for replicas, step in steps.items():
      rates[replicas].append(_timing.examples_per_second(step, batches, args))
  results = [
    _timing.Measurement(
      "one_device" if r == 1 else f"sharded_{r}_replicas", "examples/s", v
    )
    for r, v in rates.items()
  ]
  print("sharded tables (MirroredStrategy over logical CPUs), timed in turn:")
  print(f"  1 replica  (one device) : {results[0].describe()}")
  for replicas, rate in zip(counts, results[1:], strict=True):
    ratio = _timing.per_repeat_ratio(
      f"step_ratio_{replicas}_replicas", rates[1], rates[replicas]
    )
    results.append(ratio)
    print(
      f"  {replicas} replicas             : {rate.describe()}\n"
      f"    step vs one device, per repeat: {ratio.describe('{:.2f}')}",
      flush=True,
    )
  return results


def _figures(extra: dict) -> dict:
  """Medians and floors of every setting, for --json."""
  return {
    kind: [
      {
        "label": r["label"],
        "rows": r["rows"],
        "tables": r["tables"],
        "ours": r["ours"].median,
        "keras": r["keras"].median if "keras" in r else None,
        "floor": r.get("floor"),
        "peak_bytes": r.get("peak_bytes"),
        "baseline_bytes": r.get("baseline_bytes"),
        "state_bytes": r.get("state_bytes"),
      }
      for r in found
    ]
    for kind, found in extra.items()
  }


if __name__ == "__main__":
  cli.run(main)
