"""A disk-tiered table 8x its cache: VmHWM per phase, as JSON.

``python tiered_memory_job.py DIRECTORY``: builds an 8,388,608 x 32
Adagrad table (2 GiB of table and slots) kept on disk with a 256 MiB
cache,
trains 20 steps, saves it with ``tpe.checkpoints.write``, exports it with
``export_for_serving`` as float32 and as int8, builds a second one and
restores into it, restores into a third before building it (a plain
``tf.train.Checkpoint.restore``), and prints ``{"phase": VmHWM bytes,
...}`` (the peak reset before each phase), whether the restored rows are
the saved ones and whether the exports serve the trained rows (int8:
quantized row by row). Run by tests/tables/test_tiered_memory.py.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys

import numpy as np
import tensorflow as tf

import tpu_embedding as tpe
from tpu_embedding import export
from tpu_embedding.export.quantize import dequantize_rows
from tpu_embedding.export.quantize import quantize_rows
from tpu_embedding.sharding import DiskTier
from tpu_embedding.sharding import PlacementPolicy

ROWS, DIM, CACHE = 2**23, 32, 256 * 2**20
EXPORTS = ("float32", "int8")


def peak() -> int:
  for line in open("/proc/self/status"):
    if line.startswith("VmHWM"):
      return int(line.split()[1]) * 1024
  raise AssertionError("no VmHWM")


def reset() -> None:
  """Peak := now, after giving the heap's free pages back (so a phase is
  not charged with what earlier phases freed but malloc kept)."""
  gc.collect()
  ctypes.CDLL("libc.so.6").malloc_trim(0)
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def make(directory: str, build: bool = True):
  table = tpe.TableConfig(
    ROWS, DIM, name="big", initializer=tf.random_uniform_initializer(seed=1)
  )
  emb = tpe.TPUEmbedding(
    {"f": tpe.FeatureConfig(table)},
    tpe.Adagrad(0.1),
    row_sharding_threshold=PlacementPolicy(
      disk=DiskTier(directory, CACHE, ("big",))
    ),
  )
  if build:
    emb.build(per_replica_batch_size=4096)
  return emb


def main(directory: str) -> None:
  phases = {}
  reset()
  phases["before"] = peak()
  emb = make(os.path.join(directory, "a"))
  phases["build"] = peak()
  reset()

  @tf.function
  def step(ids):
    emb.enqueue({"f": ids})
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = tf.reduce_sum(activations["f"] ** 2)
    emb.apply_gradients(tape.gradient(loss, activations))

  rng = np.random.default_rng(0)
  for _ in range(20):  # Zipf ids over a few grid blocks' rows
    step(tf.constant(rng.zipf(1.1, 4096) % 200_000, tf.int64))
  phases["train"] = peak()
  reset()
  prefix = os.path.join(directory, "ckpt")
  tpe.checkpoints.write(tf.train.Checkpoint(embedding=emb), prefix)
  phases["save"] = peak()
  for table_dtype in EXPORTS:
    reset()
    export.export_for_serving(
      os.path.join(directory, table_dtype),
      emb,
      None,
      {"f": export.FeatureSpec([None])},
      table_dtype=table_dtype,
    )
    phases[f"export_{table_dtype}"] = peak()
  reset()
  again = make(os.path.join(directory, "b"))
  tpe.checkpoints.restore(tf.train.Checkpoint(embedding=again), prefix)
  phases["restore"] = peak()
  ids = tf.constant(rng.integers(0, ROWS, 2000), tf.int64)
  rows = emb.table_stores["big"].gather(ids)
  same = bool(tf.reduce_all(rows == again.table_stores["big"].gather(ids)))
  del again
  np.savez(os.path.join(directory, "rows.npz"), ids=ids, rows=rows)
  ids = tf.concat([ids, tf.range(100, dtype=tf.int64)], 0)  # trained too
  rows = emb.table_stores["big"].gather(ids)
  expected = {
    "float32": rows,
    "int8": dequantize_rows(quantize_rows(rows, "int8")),
  }
  exported = True
  for table_dtype in EXPORTS:  # each loaded whole, once measured
    loaded = tf.saved_model.load(os.path.join(directory, table_dtype))
    served = loaded.signatures["serving_default"](f=ids)["f"]
    exported &= bool(tf.reduce_all(served == expected[table_dtype]))
    del loaded
  print(json.dumps({"phases": phases, "same": same, "exported": exported}))


def resume(directory: str) -> None:
  """A fresh process resuming: a plain restore of the checkpoint before
  the table exists, then ``build()``; the rows ``main`` trained."""
  reset()
  phases = {"before": peak()}
  early = make(os.path.join(directory, "c"), build=False)
  tf.train.Checkpoint(embedding=early).restore(os.path.join(directory, "ckpt"))
  early.build(per_replica_batch_size=4096)
  phases["restore_before_build"] = peak()
  saved = np.load(os.path.join(directory, "rows.npz"))
  rows = early.table_stores["big"].gather(tf.constant(saved["ids"]))
  same = bool(np.array_equal(rows.numpy(), saved["rows"]))
  print(json.dumps({"phases": phases, "same": same, "exported": True}))


if __name__ == "__main__":
  (resume if sys.argv[2:] == ["resume"] else main)(sys.argv[1])
