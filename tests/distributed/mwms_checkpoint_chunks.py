"""Sliced checkpoints whose tables span several chunks per worker's block.

Launched by tests/backends/test_multi_worker.py (twice per cluster,
``TF_CONFIG`` set): ``python mwms_checkpoint_chunks.py MODE DIR``.

* ``MODE=save``: 2 workers train two row-sharded Adam tables for
  ``STEPS`` steps and write them with ``tpe.checkpoints.write(...,
  chunk_bytes=CHUNK_BYTES)``: every block is written as several chunks
  (the last one short). The chief writes the whole values (gathered) to
  ``DIR/saved.npz``.
* ``MODE=restore``: 2 fresh workers restore ``DIR/ckpt`` into built
  tables chunk by chunk (``chunk_bytes=CHUNK_BYTES``, then the default:
  one chunk reading several stored slices) and before the tables exist;
  each time every worker gathers the tables and asserts they equal the
  saved values exactly.

The one-device restore is done by the test itself (``make_embedding``
without a strategy). Prints "OK" last on success.

In tests/backends/test_multi_worker.py its ``main`` runs as a phase of
``mwms_phases.py`` (several scripts per cluster launch).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402
from tpu_embedding.checkpointing import parts  # noqa: E402

#: Tables ``name: (rows, dim)``; different dims, so they are not stacked.
TABLES = {"a": (29, 3), "b": (23, 5)}
#: Bytes per chunk: 4 rows of "a", 2 rows of "b" (blocks of 11 to 15 rows).
CHUNK_BYTES = 48
PER_REPLICA, STEPS = 6, 2
#: ``(build first, chunk_bytes)`` of each restore: chunk by chunk into
#: built tables, one chunk per block, restore-on-create.
RESTORES = [(True, CHUNK_BYTES), (True, None), (False, None)]


def make_embedding(init: bool = True) -> tpe.TPUEmbedding:
  """The embedding: random tables (``init``) or zeros (to restore into)."""
  features = {}
  for seed, (name, (rows, dim)) in enumerate(sorted(TABLES.items())):
    initializer = (
      tf.random_uniform_initializer(seed=seed + 1)
      if init
      else tf.zeros_initializer()
    )
    table = tpe.TableConfig(rows, dim, name=name, initializer=initializer)
    features[name] = tpe.FeatureConfig(table)
  return tpe.TPUEmbedding(features, tpe.Adam(0.05), row_sharding_threshold=0)


def values(emb: tpe.TPUEmbedding) -> dict[str, np.ndarray]:
  """Every table and slot, whole (a collective under several workers)."""
  return {
    f"{table}/{slot}": tf.convert_to_tensor(variable).numpy()
    for table, slots in emb.variables.items()
    for slot, variable in slots.items()
  }


def batch(step: int, replica: int) -> dict[str, tf.Tensor]:
  rng = np.random.default_rng(100 * step + replica)
  return {
    name: tf.constant(rng.integers(0, rows, PER_REPLICA), tf.int64)
    for name, (rows, _) in TABLES.items()
  }


def train(strategy: tf.distribute.Strategy, emb: tpe.TPUEmbedding) -> None:
  @tf.function
  def step(features):
    emb.enqueue(features)

    def replica_fn():
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        loss = sum(tf.reduce_sum(tf.sin(a)) for a in activations.values())
      emb.apply_gradients(tape.gradient(loss, activations))

    strategy.run(replica_fn)

  for n in range(STEPS):
    step(
      strategy.experimental_distribute_values_from_function(
        lambda ctx, n=n: batch(n, ctx.replica_id_in_sync_group)
      )
    )


def check_several_chunks(emb: tpe.TPUEmbedding) -> None:
  """Each block is several chunks at ``CHUNK_BYTES``, one by default."""
  for name, (_, dim) in TABLES.items():
    for shard in emb.backend.shards(name):
      rows = int(shard.shape[0])
      assert parts.chunk_rows(rows, dim, CHUNK_BYTES) * 2 < rows
      assert parts.chunk_rows(rows, dim) >= rows


def main(mode: str, directory: str, strategy=None) -> None:
  strategy = strategy or tf.distribute.MultiWorkerMirroredStrategy()
  assert strategy.num_replicas_in_sync == 2
  path = os.path.join(directory, "ckpt")
  if mode == "save":
    with strategy.scope():
      emb = make_embedding()
    emb.build()
    check_several_chunks(emb)
    train(strategy, emb)
    saved = values(emb)
    tpe.checkpoints.write(
      tf.train.Checkpoint(embedding=emb), path, chunk_bytes=CHUNK_BYTES
    )
    if strategy.cluster_resolver.task_id == 0:
      np.savez(os.path.join(directory, "saved.npz"), **saved)
  else:
    saved = dict(np.load(os.path.join(directory, "saved.npz")))
    for build_first, chunk_bytes in RESTORES:
      with strategy.scope():
        emb = make_embedding(init=False)
      if build_first:
        emb.build()
        check_several_chunks(emb)
      tpe.checkpoints.restore(
        tf.train.Checkpoint(embedding=emb), path, chunk_bytes=chunk_bytes
      )
      if not build_first:
        emb.build()
      got = values(emb)
      assert sorted(got) == sorted(saved), (sorted(got), sorted(saved))
      for key, value in saved.items():
        np.testing.assert_array_equal(
          got[key], value, err_msg=f"{key} {build_first} {chunk_bytes}"
        )
  print("OK")


if __name__ == "__main__":
  main(*sys.argv[1:3])
