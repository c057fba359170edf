"""Prints the sharding plan and the table bytes each replica holds.

For a feature config (the benchmark's 26 tables, or Criteo's published
vocabulary sizes) and each replica count, it prints where every table lives
and the parameter + slot bytes per replica. With ``--build`` it also creates
the tables under ``MirroredStrategy`` over logical CPU devices and reports
the bytes of the variables actually placed on each device, which must equal
the plan.

Run:
  python3 tools/sharding_report.py --replicas 1,2,4
  python3 tools/sharding_report.py --config benchmark --rows 20000 --build
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402
from tpu_embedding.sharding import make_plan  # noqa: E402

#: Criteo 1TB vocabulary sizes as published with Model Garden's DLRM.
CRITEO_VOCAB_SIZES = [
  39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951,
  2953546, 403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771, 25641295,
  39664984, 585935, 12972, 108, 36,
]  # fmt: skip


def tables_for(args) -> list[tpe.TableConfig]:
  if args.config == "criteo":
    sizes = CRITEO_VOCAB_SIZES
  else:
    sizes = [args.rows] * args.tables
  return [
    tpe.TableConfig(size, args.dim, name=f"t{i}", optimizer=tpe.Adagrad(0.1))
    for i, size in enumerate(sizes)
  ]


def measured_bytes_per_device(tables, replicas: int, threshold: int):
  """Bytes of the table and slot variables placed on each device."""
  strategy = tf.distribute.MirroredStrategy(
    [f"/cpu:{i}" for i in range(replicas)]
  )
  with strategy.scope():
    emb = tpe.TPUEmbedding(
      {t.name: tpe.FeatureConfig(t) for t in tables},
      row_sharding_threshold=threshold,
    )
  emb.build()
  per_device = collections.Counter()
  for store in emb.table_stores.values():
    per_device.update(store.bytes_per_device())
  return [per_device[d] for d in sorted(per_device)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--config", choices=["benchmark", "criteo"], default="benchmark"
  )
  parser.add_argument("--tables", type=int, default=26)
  parser.add_argument("--rows", type=int, default=200_000)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--replicas", default="1,2,4")
  parser.add_argument("--row_threshold", type=int, default=10_000)
  parser.add_argument(
    "--build", action="store_true", help="create the variables and measure them"
  )
  args = parser.parse_args()
  counts = [int(r) for r in args.replicas.split(",")]
  if args.build:
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * max(counts)
    )
  tables = tables_for(args)
  single = make_plan(tables, 1, args.row_threshold).bytes_per_replica()[0]
  for replicas in counts:
    plan = make_plan(tables, replicas, args.row_threshold)
    print(plan.report())
    largest = max(plan.bytes_per_replica())
    print(
      f"largest replica holds {largest / single:.3f} of the one-device "
      f"bytes ({1 / replicas:.3f} would be a perfect split)"
    )
    if args.build:
      measured = measured_bytes_per_device(tables, replicas, args.row_threshold)
      print(f"measured bytes per device: {measured}")
      assert measured == plan.bytes_per_replica(), "plan and variables differ"
    print()


if __name__ == "__main__":
  main()
