"""Delta checkpoints on 2 MultiWorkerMirroredStrategy workers, one launch.

Launched by tests/test_delta_multi_worker.py (twice, ``TF_CONFIG`` set,
through ``cluster.run_job``): ``python mwms_delta.py DIR``. Three tables,
Adagrad (a slot per table): ``a`` row-sharded over the workers (its full
saves written and read in ``CHUNK_BYTES`` chunks: several per block),
``users`` a row-sharded ``DynamicVocabulary`` table small enough to evict
on both workers' shards, ``small`` replicated (a copy per worker); and a
dense variable. Phases, every worker together:

1. train step 0; full save ``ckpt-1``; steps 1-2; ``delta-2``; steps 3-4;
   ``delta-3``; full save ``final`` (the oracle: the live state at the
   last delta's step). The chief writes the row ranges each worker holds
   to ``DIR/placements.json``.
2. a fresh object (zeros, empty vocabulary) on the same 2 workers restores
   ``ckpt-1`` plus ``[delta-2, delta-3]``, and writes itself as
   ``restored``; the chief writes the live and the restored object's
   tables and slots (gathered), the vocabulary's whole state and
   statistics to ``live.npz`` and ``restored.npz`` (the test compares
   them, and every tensor of ``restored`` with ``final``).
3. prints "phases done"; step 5; ``delta-4`` (following ``delta-3``), in
   whose write worker 1 kills itself (SIGKILL) right after writing its
   part under ``delta-4_temp`` (the hook: ``tf.raw_ops.SaveV2``, wrapped
   here only). The chief, waiting for it, is killed by the launcher.

The one-device restore of ``ckpt-1`` plus the deltas, after the kill, is
done by the test.
"""

from __future__ import annotations

import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402
from tpu_embedding.checkpointing import parts  # noqa: E402

#: ``name: (rows, dim)``; different dims, so nothing is stacked.
TABLES = {"a": (29, 3), "users": (16, 4), "small": (6, 2)}
#: Bytes per chunk of a full save and restore: 4 rows of ``a``.
CHUNK_BYTES = 48
PER_REPLICA = 6
#: Distinct keys of ``users``: more than its 16 rows (evictions).
USER_KEYS = 40
#: Training steps before each save; the last one is the killed delta's.
SAVES = [("ckpt-1", 1), ("delta-2", 2), ("delta-3", 2), ("final", 0)]
KILLED = "delta-4"


def make_embedding(init: bool = True) -> tpe.TPUEmbedding:
  """The embedding: random tables (``init``) or zeros (to restore into)."""
  initializer = (
    tf.random_uniform_initializer(-1.0, 1.0, seed=3)
    if init
    else tf.zeros_initializer()
  )
  features = {}
  for name, (rows, dim) in TABLES.items():
    vocabulary = None
    if name == "users":
      vocabulary = tpe.DynamicVocabulary(bucket_size=2)
    table = tpe.TableConfig(
      rows, dim, name=name, initializer=initializer, vocabulary=vocabulary
    )
    features[name] = tpe.FeatureConfig(table)
  return tpe.TPUEmbedding(
    features,
    tpe.Adagrad(0.2, initial_accumulator_value=0.1),
    row_sharding_threshold=10,
  )


def user_key(index: np.ndarray) -> np.ndarray:
  """Raw int64 keys of ``users``, far from row ids."""
  return 10**12 + 7919 * index.astype(np.int64)


def batch(step: int, replica: int) -> dict[str, np.ndarray]:
  """Replica ``replica``'s ids of step ``step``."""
  rng = np.random.default_rng(100 * step + replica)
  return {
    "a": rng.integers(0, TABLES["a"][0], PER_REPLICA),
    "users": user_key(rng.integers(0, USER_KEYS, PER_REPLICA)),
    "small": rng.integers(0, TABLES["small"][0], PER_REPLICA),
  }


def values(emb: tpe.TPUEmbedding) -> dict[str, np.ndarray]:
  """Every table and slot, and the vocabulary's whole state and
  statistics (collectives: every worker calls it)."""
  got = {
    f"{table}/{slot}": tf.convert_to_tensor(variable).numpy()
    for table, slots in emb.variables.items()
    for slot, variable in slots.items()
  }
  dynamic = emb.engine.dynamic_tables
  for name, value in dynamic.states["users"].whole().items():
    got[f"users/state/{name}"] = value.numpy()
  for name, value in dynamic.statistics()["users"].items():
    got[f"users/statistics/{name}"] = np.asarray(value)
  return got


def trainer(strategy, emb, dense):
  @tf.function
  def step(features):
    emb.enqueue(features, training=True)

    def replica_fn():
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        loss = sum(tf.reduce_sum(tf.sin(a)) for a in activations.values())
      emb.apply_gradients(tape.gradient(loss, activations))

    strategy.run(replica_fn)
    dense.assign_add(tf.constant([1.0, 0.5]))

  def run(number: int) -> None:
    step(
      strategy.experimental_distribute_values_from_function(
        lambda ctx: {
          k: tf.constant(v)
          for k, v in batch(number, ctx.replica_id_in_sync_group).items()
        }
      )
    )

  return run


def kill_after_own_part(prefix: str) -> None:
  """SIGKILL right after this worker writes its part under
  ``<prefix>_temp``."""
  save_v2 = tf.raw_ops.SaveV2

  def wrapped(**kwargs):
    result = save_v2(**kwargs)
    if f"{os.path.basename(prefix)}_temp" in kwargs["prefix"]:
      print("killing this process", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    return result

  tf.raw_ops.SaveV2 = wrapped


def main(directory: str) -> None:
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  assert strategy.num_replicas_in_sync == 2
  worker = strategy.cluster_resolver.task_id
  path = {name: os.path.join(directory, name) for name, _ in SAVES}
  with strategy.scope():
    emb = make_embedding()
    dense = tf.Variable(tf.zeros([2]), name="dense")
  emb.build()
  (shard,) = emb.backend.shards("a")  # Several chunks per block:
  rows = int(shard.shape[0])
  assert parts.chunk_rows(rows, 3, CHUNK_BYTES) * 2 < rows
  checkpoint = tf.train.Checkpoint(embedding=emb, dense=dense)
  train = trainer(strategy, emb, dense)

  # 1. The chain, and the oracle.
  steps = 0
  for name, count in SAVES:
    for _ in range(count):
      train(steps)
      steps += 1
    if name.startswith("delta"):
      tpe.checkpoints.write_delta(checkpoint, path[name])
    else:
      tpe.checkpoints.write(checkpoint, path[name], chunk_bytes=CHUNK_BYTES)
  live = values(emb)
  assert live["users/statistics/evictions"] > 0
  if worker == 0:
    placements = {
      name: {
        "offsets": list(placement.shard_offsets),
        "sizes": list(placement.shard_sizes),
        "kind": placement.kind,
      }
      for name, placement in emb.sharding_plan.placements.items()
    }
    with open(os.path.join(directory, "placements.json"), "w") as f:
      json.dump(placements, f)

  # 2. Restored on the same 2 workers.
  with strategy.scope():
    fresh = make_embedding(init=False)
    fresh_dense = tf.Variable(tf.zeros([2]), name="dense")
  fresh.build()
  restored = tf.train.Checkpoint(embedding=fresh, dense=fresh_dense)
  tpe.checkpoints.restore(
    restored,
    path["ckpt-1"],
    chunk_bytes=CHUNK_BYTES,
    deltas=[path["delta-2"], path["delta-3"]],
  )
  got = values(fresh)
  tpe.checkpoints.write(restored, os.path.join(directory, "restored"))
  if worker == 0:
    np.savez(os.path.join(directory, "live.npz"), **live)
    np.savez(os.path.join(directory, "restored.npz"), **got)

  # 3. A worker killed writing the next delta.
  print("phases done", flush=True)
  train(steps)
  if worker == 1:
    kill_after_own_part(KILLED)
  tpe.checkpoints.write_delta(
    checkpoint,
    os.path.join(directory, KILLED),
    previous=path["delta-3"],
  )
  print("OK")  # (not reached: worker 1 dies, the chief is killed)


if __name__ == "__main__":
  main(sys.argv[1])
