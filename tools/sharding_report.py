"""Prints the sharding plan and the table bytes each replica holds.

For a feature config (the benchmark's 26 tables, or Criteo's published
vocabulary sizes) and each replica count, it prints where every table lives
and the parameter + slot bytes per replica. With ``--build`` it also creates
the tables under ``MirroredStrategy`` over logical CPU devices and reports
the bytes of the variables actually placed on each device, which must equal
the plan.

With ``--experiment NAME`` the tables are those of a named ranking
experiment (``model_garden.ranking``: its table names, vocabularies,
widths, embedding optimizer and sharding threshold).

With ``--dynamic`` the tables have a ``DynamicVocabulary``: it prints each
one's capacity and the vocabulary state every replica holds beside its
rows; with ``--build`` also the rows in use and the evictions after
``--steps`` steps of random keys (the same on any replica count).

Run:
  python3 tools/sharding_report.py --replicas 1,2,4
  python3 tools/sharding_report.py --config benchmark --rows 20000 --build
  python3 tools/sharding_report.py --experiment dlrm_criteo --replicas 8,16
"""

from __future__ import annotations

import argparse
import collections
import json

from model_garden import cli

if __name__ == "__main__":
  cli.quiet_tensorflow()  # before TensorFlow is imported

import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402
from tpu_embedding.backends.sharded import replicas_planner  # noqa: E402
from tpu_embedding.resolved import resolve  # noqa: E402
from tpu_embedding.sharding import PlacementPolicy  # noqa: E402
from tpu_embedding.vocabularies.dynamic_tables import dynamic_mappings  # noqa: E402
from tpu_embedding.vocabularies.transition import VocabularyVariables  # noqa: E402

#: Criteo 1TB vocabulary sizes as published with Model Garden's DLRM.
CRITEO_VOCAB_SIZES = [
  39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951,
  2953546, 403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771, 25641295,
  39664984, 585935, 12972, 108, 36,
]  # fmt: skip


def experiment_tables(name: str) -> tuple[list[tpe.TableConfig], int]:
  """A ranking experiment's tables (with its optimizer) and threshold."""
  from model_garden.ranking import configs  # noqa: PLC0415
  from model_garden.ranking import embedding  # noqa: PLC0415
  from model_garden.ranking import optimizers  # noqa: PLC0415

  if name not in configs.experiments():
    raise cli.UsageError(
      f"--experiment {name!r}: not an experiment; one of "
      f"{', '.join(configs.experiments())}."
    )
  config = configs.get_config(name)
  model = config.task.model
  optimizer = optimizers.embedding_optimizer(
    config.trainer.optimizer_config,
    config.task.train_data.global_batch_size,
    tf.Variable(0, dtype=tf.int64),
  )
  tables = [
    tpe.TableConfig(
      f.table.vocabulary_size, f.table.dim, name=f.table.name,
      optimizer=optimizer,
    )
    for f in embedding.feature_config(model).values()
  ]  # fmt: skip
  return tables, model.row_sharding_threshold()


def tables_for(args) -> list[tpe.TableConfig]:
  if args.config == "criteo":
    sizes = CRITEO_VOCAB_SIZES
  else:
    sizes = [args.rows] * args.tables
  vocabulary = tpe.DynamicVocabulary() if args.dynamic else None
  return [
    tpe.TableConfig(
      size, args.dim, name=f"t{i}", optimizer=tpe.Adagrad(0.1),
      vocabulary=vocabulary,
    )
    for i, size in enumerate(sizes)
  ]  # fmt: skip


def vocabulary_bytes(mapping, shards: int = 1) -> int:
  """Bytes of a dynamic table's vocabulary state (``mapping``: its key
  mapping) on the replica holding the most: the whole state, or
  (``shards`` > 1: the table is row-sharded and its state with it) its
  largest shard."""
  return max(
    VocabularyVariables.bytes_of(
      mapping.vocabulary, mapping.capacity, shard, shards
    )
    for shard in range(shards)
  )


def dynamic_statistics(tables, steps: int, batch: int) -> dict:
  """Each dynamic table's statistics after ``steps`` of random keys drawn
  from three times its capacity (one device)."""
  emb = tpe.TPUEmbedding({t.name: tpe.FeatureConfig(t) for t in tables})
  rng = tf.random.Generator.from_seed(0)

  @tf.function
  def step():
    emb.enqueue(
      {
        t.name: rng.uniform([batch], 0, 3 * t.vocabulary_size, tf.int64)
        for t in tables
      },
      training=True,
    )
    activations = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))

  for _ in range(steps):
    step()
  return emb.engine.dynamic_tables.statistics()


def stacking_value(text: str):
  """``--table_stacking``: auto, none, or stacks like ``t0+t1,t2+t3``."""
  if text in ("auto", "none"):
    return None if text == "none" else "auto"
  return [stack.split("+") for stack in text.split(",")]


def measured_bytes_per_device(
  tables, replicas: int, threshold: int, stacking="auto"
):
  """Bytes of the table and slot variables placed on each device."""
  strategy = tf.distribute.MirroredStrategy(
    [f"/cpu:{i}" for i in range(replicas)]
  )
  with strategy.scope():
    emb = tpe.TPUEmbedding(
      {t.name: tpe.FeatureConfig(t) for t in tables},
      row_sharding_threshold=threshold,
      table_stacking=stacking,
    )
  emb.build()
  per_device = collections.Counter()
  for store in emb.table_stores.values():
    per_device.update(store.bytes_per_device())
  return [per_device[d] for d in sorted(per_device)]


def rows_on_replicas(sizes: tuple[int, ...]) -> str:
  """A table's rows on each replica, as they are: ``"200,000 | 0"``, or
  runs of replicas holding the same (``"200,000 (r0-r3), 0 (r4-r7)"``).

  Example:
    >>> rows_on_replicas((100, 0)), rows_on_replicas((5, 5, 5, 0, 0))
    ('100 | 0', '5 (r0-r2), 0 (r3-r4)')
  """
  if len(sizes) <= 4:
    return " | ".join(f"{n:,}" for n in sizes)
  runs: list[list[int]] = []  # [rows, first, last]
  for i, n in enumerate(sizes):
    if runs and runs[-1][0] == n:
      runs[-1][2] = i
    else:
      runs.append([n, i, i])
  return ", ".join(
    f"{n:,} (r{a})" if a == b else f"{n:,} (r{a}-r{b})" for n, a, b in runs
  )


def placements_report(plan) -> str:
  """The plan's table: each table's rows on every replica (a stacked
  table's rows sit where its stack's row blocks put them)."""
  stack_width = max(
    [5] + [len(p.stack or "-") for p in plan.placements.values()]
  )
  lines = plan.report().splitlines()[:1]
  lines.append(
    f"{'table':<24} {'placement':<12} {'MiB (largest)':>13}  "
    f"{'stack':<{stack_width}}  rows on each replica"
  )
  for p in plan.placements.values():
    lines.append(
      f"{p.table:<24} {p.kind:<12} "
      f"{max(p.bytes_per_replica()) / 2**20:>13.2f}  "
      f"{p.stack or '-':<{stack_width}}  {rows_on_replicas(p.shard_sizes)}"
    )
  total = max(plan.bytes_per_replica()) / 2**20
  lines.append(f"{'total (largest replica)':<37} {total:>13.2f}")
  return "\n".join(lines)


def plan_figures(plan, stacks) -> dict:
  """``--json``: one replica count's placements."""
  return {
    "replicas": plan.num_replicas,
    "bytes_per_replica": list(plan.bytes_per_replica()),
    "stores": len(stacks),
    "tables": [
      {
        "table": p.table,
        "placement": p.kind,
        "rows_per_replica": list(p.shard_sizes),
        "bytes_per_replica": list(p.bytes_per_replica()),
        "stack": p.stack,
      }
      for p in plan.placements.values()
    ],
  }


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--experiment",
    default=None,
    help="A ranking experiment (e.g. dlrm_criteo): its tables, optimizer "
    "and threshold (--config, --tables, --rows, --dim, --row_threshold "
    "are then ignored).",
  )
  parser.add_argument(
    "--config",
    choices=["benchmark", "criteo"],
    default="benchmark",
    help="benchmark: --tables tables of --rows rows; criteo: Criteo 1TB's "
    "26 vocabulary sizes.",
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
    "--replicas",
    type=cli.positive_ints,
    default=[1, 2, 4],
    help="Comma-separated replica counts.",
  )
  parser.add_argument(
    "--row_threshold",
    type=int,
    default=10_000,
    help="Tables with more rows are row-sharded (0: all).",
  )
  parser.add_argument(
    "--table_stacking",
    default="auto",
    help="auto (tables of the same width, optimizer and placement held as "
    "one), none, or explicit stacks such as t0+t1,t2+t3.",
  )
  parser.add_argument(
    "--build",
    action="store_true",
    help="Create the variables on logical CPU devices and measure them.",
  )
  parser.add_argument(
    "--dynamic",
    action="store_true",
    help="Tables with a DynamicVocabulary (raw keys, bounded rows).",
  )
  parser.add_argument(
    "--steps",
    type=cli.positive_int,
    default=20,
    help="With --dynamic --build: steps of random keys before the "
    "vocabulary statistics.",
  )
  parser.add_argument(
    "--batch_size",
    type=cli.positive_int,
    default=4096,
    help="Keys per table per step.",
  )
  parser.add_argument(
    "--json", default="", help="Write the plans' figures here (JSON)."
  )
  return parser


def main(argv: list[str] | None = None) -> None:
  args = build_parser().parse_args(argv)
  cli.run(lambda: report(args), _flag_values)


def _flag_values(error: BaseException) -> BaseException | None:
  """A table config refused (from the flags' values) is a usage error."""
  if isinstance(error, ValueError):
    return cli.UsageError(str(error))
  return None


def report(args: argparse.Namespace) -> None:
  """Prints (and with ``--json`` writes) the plans."""
  counts = args.replicas
  figures: list[dict] = []
  if args.build:
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * max(counts)
    )
  if args.experiment:
    tables, threshold = experiment_tables(args.experiment)
    optimizer = type(tables[0].optimizer).__name__
    print(
      f"experiment {args.experiment}: {len(tables)} tables "
      f"({sum(t.vocabulary_size for t in tables):,} rows), {optimizer} "
      "on the tables"
    )
  else:
    tables, threshold = tables_for(args), args.row_threshold
  stacking = stacking_value(args.table_stacking)
  resolved = resolve(
    [tpe.FeatureConfig(t) for t in tables], tpe.Adagrad(0.1)
  ).tables
  one = replicas_planner(1).plan(resolved, PlacementPolicy(threshold), None)
  single = one.tables.bytes_per_replica()[0]
  for replicas in counts:
    planned = replicas_planner(replicas).plan(
      resolved, PlacementPolicy(threshold), stacking
    )
    plan, stacks = planned.tables, planned.stacks
    print(placements_report(plan))
    figures.append(plan_figures(plan, stacks))
    stacked = [s for s in stacks if s.stacked]
    print(
      f"{len(stacked)} stack(s) hold {sum(len(s.tables) for s in stacked)} "
      f"of the {len(tables)} tables; a step deduplicates, gathers and "
      f"updates {len(stacks)} store(s)"
    )
    largest = max(plan.bytes_per_replica())
    print(
      f"largest replica holds {largest / single:.3f} of the one-device "
      f"bytes ({1 / replicas:.3f} would be a perfect split)"
    )
    if args.build:
      measured = measured_bytes_per_device(
        tables, replicas, threshold, stacking
      )
      print(f"measured bytes per device: {measured}")
      assert measured == plan.bytes_per_replica(), "plan and variables differ"
    dynamic = dynamic_mappings(resolved)
    if dynamic:
      sharded = [t for t, _ in dynamic if plan.placements[t.name].sharded]
      state = sum(
        vocabulary_bytes(m, replicas if t in sharded else 1) for t, m in dynamic
      )
      print(
        f"{len(dynamic)} dynamic table(s), capacity "
        f"{sum(m.capacity for _, m in dynamic):,} rows (+1 default "
        f"row each); vocabulary state at most {state / 2**20:,.2f} MiB per "
        f"replica beside its rows ({len(sharded)} sharded with their rows, "
        f"{len(dynamic) - len(sharded)} replicated)"
      )
    print()
  if args.dynamic and args.build:
    print(f"after {args.steps} steps of random keys (any replica count):")
    for name, stats in dynamic_statistics(
      tables, args.steps, args.batch_size
    ).items():
      used = stats["rows_in_use"]
      print(
        f"  {name}: capacity {stats['capacity']:,}, rows in use {used:,} "
        f"({used / stats['capacity']:.1%}), evictions {stats['evictions']:,}"
      )
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"settings": vars(args), "plans": figures}, f, indent=1)


if __name__ == "__main__":
  main()
