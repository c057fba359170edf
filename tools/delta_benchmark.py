"""Measures a delta checkpoint against a full one: bytes on disk, wall time.

One table of ``--rows`` x ``--dim`` on one device (SGD: no slots, so the
full checkpoint is the table; ``--optimizer adagrad`` adds its slot). The
tool writes a full checkpoint, updates ``--touched`` of the rows (random,
distinct), then writes a delta (the rows changed since) and a full
checkpoint of the same state, and reports their sizes on disk and their
wall times; unless ``--no-verify``, a fresh table restored from the first
full checkpoint plus the delta is compared with the live one, bit for bit.

``--export`` also times serving exports, each ``tools/export.py`` in its
own process (one at a time): version 1 is exported from the first full
checkpoint, then version 2 both ways: ``--apply_delta`` (version 1 plus
the delta) and a full export of the second full checkpoint, in
``--table_dtype``; it reports each process's wall time and the time the
tool reports itself (``Done in``, without Python's and TensorFlow's
start-up), and whether the two versions' variables are bit-identical.

Run:
  python3 tools/delta_benchmark.py --rows 2000000 --dim 128 --json
  python3 tools/delta_benchmark.py --rows 1000000 --dim 64 --export --json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from model_garden import cli

if __name__ == "__main__":
  cli.quiet_tensorflow()  # before TensorFlow is imported

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402
from tpu_embedding.gradients import RowGradients  # noqa: E402

#: Rows updated per call while touching rows.
CHUNK = 65536


def _embedding(args: argparse.Namespace) -> tpe.TPUEmbedding:
  table = tpe.TableConfig(
    args.rows,
    args.dim,
    name="table",
    initializer=tf.random_uniform_initializer(-0.05, 0.05, seed=1),
  )
  optimizer = tpe.SGD(0.1) if args.optimizer == "sgd" else tpe.Adagrad(0.1)
  emb = tpe.TPUEmbedding({"f": tpe.FeatureConfig(table)}, optimizer)
  emb.build()
  return emb


def _bytes(prefix: str) -> int:
  """Bytes on disk of the save ``prefix`` (index and data files)."""
  return sum(
    os.path.getsize(path)
    for path in tf.io.gfile.glob(f"{prefix}.index")
    + tf.io.gfile.glob(f"{prefix}.data-*")
  )


def _timed(function, *args):
  start = time.perf_counter()
  result = function(*args)
  return result, time.perf_counter() - start


def measure(args: argparse.Namespace, directory: str) -> dict:
  """The figures (see the module docstring)."""
  emb = _embedding(args)
  checkpoint = tf.train.Checkpoint(embedding=emb)
  store = emb.table_stores["table"]
  base = tpe.checkpoints.write(checkpoint, os.path.join(directory, "ckpt-1"))
  touched = max(1, round(args.rows * args.touched))
  ids = np.random.default_rng(0).choice(args.rows, touched, replace=False)
  for first in range(0, touched, CHUNK):
    chunk = tf.constant(np.sort(ids[first : first + CHUNK]), tf.int64)
    grads = RowGradients.dense(tf.fill([tf.size(chunk), args.dim], 0.5))
    store.update(chunk, grads)
  delta, delta_s = _timed(
    tpe.checkpoints.write_delta,
    checkpoint,
    os.path.join(directory, "delta-2"),
  )
  full, full_s = _timed(
    tpe.checkpoints.write, checkpoint, os.path.join(directory, "ckpt-2")
  )
  figures = {
    "rows": args.rows,
    "dim": args.dim,
    "optimizer": args.optimizer,
    "touched_rows": touched,
    "full_bytes": _bytes(full),
    "delta_bytes": _bytes(delta),
    "full_save_s": round(full_s, 4),
    "delta_save_s": round(delta_s, 4),
  }
  figures["size_ratio"] = round(
    figures["delta_bytes"] / figures["full_bytes"], 5
  )
  figures["speedup"] = round(full_s / delta_s, 2)
  if args.export:
    figures.update(measure_exports(args, directory, base, delta, full))
  if args.verify:
    live = {key: store.read(key).numpy() for key in store.keys}
    del emb, checkpoint, store
    fresh = _embedding(args)
    restored = tf.train.Checkpoint(embedding=fresh)
    _, restore_s = _timed(
      lambda: tpe.checkpoints.restore(restored, base, deltas=[delta])
    )
    figures["restore_full_plus_delta_s"] = round(restore_s, 4)
    figures["bit_identical"] = all(
      np.array_equal(fresh.table_stores["table"].read(key).numpy(), value)
      for key, value in live.items()
    )
  return figures


_SPEC = """
import tpu_embedding as tpe
from tpu_embedding.export import ExportSpec, FeatureSpec

def build():
  table = tpe.TableConfig({rows}, {dim}, name="table")
  return ExportSpec({{"f": tpe.FeatureConfig(table)}}, {{"f": FeatureSpec()}})
"""


def _export_tool(*args: str) -> tuple[float, float]:
  """Runs ``tools/export.py args``: ``(process wall s, its "Done in" s)``."""
  command = [
    sys.executable,
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "export.py"),
    *args,
  ]
  start = time.perf_counter()
  process = subprocess.run(command, capture_output=True, text=True, check=False)
  wall = time.perf_counter() - start
  if process.returncode:
    raise cli.FixableError(
      f"tools/export.py {' '.join(args)} failed: {process.stderr.strip()}"
    )
  done = re.findall(r"Done in ([0-9.]+)s", process.stderr)
  return wall, float(done[-1]) if done else float("nan")


def _saved_variables(export_dir: str) -> dict:
  reader = tf.train.load_checkpoint(
    os.path.join(export_dir, "variables", "variables")
  )
  return {
    key: reader.get_tensor(key)
    for key in reader.get_variable_to_shape_map()
    if key != "_CHECKPOINTABLE_OBJECT_GRAPH"
  }


def measure_exports(
  args: argparse.Namespace, directory: str, base: str, delta: str, full: str
) -> dict:
  """``--export``: version 2 by ``--apply_delta`` and by a full export."""
  spec = os.path.join(directory, "spec.py")
  with open(spec, "w") as f:
    f.write(_SPEC.format(rows=args.rows, dim=args.dim))
  dtype = ["--table_dtype", args.table_dtype]
  versions = {v: os.path.join(directory, "serving", v) for v in "12"}
  full_dir = os.path.join(directory, "serving_full", "2")
  _export_tool(
    "--spec", f"{spec}:build", "--checkpoint", base, "--export_dir",
    versions["1"], *dtype,
  )  # fmt: skip
  applied, exported = [], []
  for _ in range(args.export_repeats):  # alternated; medians reported
    for path in (versions["2"], full_dir):
      if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)
    applied.append(
      _export_tool(
        "--apply_delta",
        delta,
        "--base_export",
        versions["1"],
        "--export_dir",
        versions["2"],
      )  # fmt: skip
    )
    exported.append(
      _export_tool(
        "--spec",
        f"{spec}:build",
        "--checkpoint",
        full,
        "--export_dir",
        full_dir,
        *dtype,
      )  # fmt: skip
    )
  apply_wall, apply_done = (
    float(np.median(x)) for x in zip(*applied, strict=True)
  )
  full_wall, full_done = (
    float(np.median(x)) for x in zip(*exported, strict=True)
  )
  got, want = _saved_variables(versions["2"]), _saved_variables(full_dir)
  return {
    "export_repeats": args.export_repeats,
    "export_table_dtype": args.table_dtype,
    "apply_delta_process_s": round(apply_wall, 3),
    "apply_delta_tool_s": round(apply_done, 3),
    "full_export_process_s": round(full_wall, 3),
    "full_export_tool_s": round(full_done, 3),
    "export_speedup_process": round(full_wall / apply_wall, 2),
    "export_speedup_tool": round(full_done / apply_done, 2),
    "export_bit_identical": sorted(got) == sorted(want)
    and all(got[k].tobytes() == want[k].tobytes() for k in want),
  }


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(
    description=__doc__.split("\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--rows", type=int, default=2_000_000, help="Rows of the table."
  )
  parser.add_argument("--dim", type=int, default=128, help="Its width.")
  parser.add_argument(
    "--touched", type=float, default=0.01, help="Fraction of rows updated."
  )
  parser.add_argument(
    "--optimizer",
    choices=("sgd", "adagrad"),
    default="sgd",
    help="The table's optimizer (Adagrad adds a slot to each save).",
  )
  parser.add_argument(
    "--dir", default=None, help="Where to write (None: a temporary one)."
  )
  parser.add_argument(
    "--no-verify",
    dest="verify",
    action="store_false",
    help="Skip the bit-identical restore check.",
  )
  parser.add_argument(
    "--export",
    action="store_true",
    help="Also time tools/export.py --apply_delta against a full export.",
  )
  parser.add_argument(
    "--export_repeats",
    type=int,
    default=3,
    help="With --export: runs of each (alternated); medians reported.",
  )
  parser.add_argument(
    "--table_dtype",
    default="float32",
    choices=("float32", "float16", "bfloat16", "int8"),
    help="With --export: the exported tables' type.",
  )
  parser.add_argument(
    "--json", action="store_true", help="Print the figures as JSON."
  )
  return parser


def main(argv: list[str] | None = None) -> None:
  args = build_parser().parse_args(argv)
  if args.rows < 1 or args.dim < 1 or not 0 < args.touched <= 1:
    raise cli.UsageError(
      f"--rows and --dim must be positive and --touched in (0, 1], got "
      f"{args.rows}, {args.dim}, {args.touched}."
    )
  with tempfile.TemporaryDirectory(dir=args.dir) as directory:
    figures = measure(args, directory)
  if args.json:
    print(json.dumps(figures, sort_keys=True))
    return
  for key, value in figures.items():
    print(f"{key}: {value}")


if __name__ == "__main__":
  cli.run(main)
