"""Delta checkpoints on a parameter-server cluster, in one process.

Run by tests/checkpointing/test_delta_distributed.py as a script (connecting
to a cluster changes the whole process's TensorFlow context): ``python
ps_delta.py DIR``. Starts 2 workers and 2 parameter servers on 127.0.0.1
(``ps_training.start_cluster``); ``big`` is split over both PS tasks,
``small`` lives whole on one; Adagrad; a dense variable. A
``ClusterCoordinator`` schedules every step on the workers (joined before
each save). Phases:

1. step 0; full save ``ckpt-1``; steps 1-2; ``delta-2``; steps 3-4;
   ``delta-3``; full save ``final`` (the oracle: the live state).
2. a fresh object (zeros) on the same PS tasks restores ``ckpt-1`` plus
   ``[delta-2, delta-3]`` and must equal the live one bit for bit (tables,
   slots, dense variable); it writes itself as ``restored``.

The test compares ``restored`` with ``final`` tensor by tensor, restores
the chain on one device, and checks each delta's rows. Prints "OK" last.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402

#: ``name: rows``; ``big`` is over the row threshold (split over the PS).
TABLES = {"big": 37, "small": 5}
DIM, PER_STEP = 3, 6
#: Training steps before each save.
SAVES = [("ckpt-1", 1), ("delta-2", 2), ("delta-3", 2), ("final", 0)]


def make_embedding(init: bool = True) -> tpe.TPUEmbedding:
  """Random tables (``init``) or zeros (to restore into)."""
  initializer = (
    tf.random_uniform_initializer(-1.0, 1.0, seed=5)
    if init
    else tf.zeros_initializer()
  )
  features = {
    name: tpe.FeatureConfig(
      tpe.TableConfig(rows, DIM, name=name, initializer=initializer)
    )
    for name, rows in TABLES.items()
  }
  return tpe.TPUEmbedding(
    features,
    tpe.Adagrad(0.2, initial_accumulator_value=0.1),
    row_sharding_threshold=10,
  )


def batch(step: int) -> dict[str, np.ndarray]:
  """Step ``step``'s ids."""
  rng = np.random.default_rng(step)
  return {
    name: rng.integers(0, rows, PER_STEP) for name, rows in TABLES.items()
  }


def values(emb: tpe.TPUEmbedding) -> dict[str, np.ndarray]:
  return {
    f"{table}/{slot}": tf.convert_to_tensor(variable).numpy()
    for table, slots in emb.variables.items()
    for slot, variable in slots.items()
  }


def main(directory: str) -> None:
  from ps_training import in_process_cluster  # (this directory)

  strategy, coordinator = in_process_cluster(num_workers=2, num_ps=2)
  with strategy.scope():
    emb = make_embedding()
    emb.build()
    dense = tf.Variable(tf.zeros([2]), name="dense")
  assert [v.shape[0] for v in emb.backend.shards("big")] == [19, 18]

  def replica_step(features):
    emb.enqueue(features, training=True)
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = sum(tf.reduce_sum(tf.sin(a)) for a in activations.values())
    emb.apply_gradients(tape.gradient(loss, activations))

  @tf.function
  def worker_step(features):
    strategy.run(replica_step, args=(features,))
    dense.assign_add(tf.constant([1.0, 0.5]))

  checkpoint = tf.train.Checkpoint(embedding=emb, dense=dense)
  path = {name: os.path.join(directory, name) for name, _ in SAVES}
  steps = 0
  for name, count in SAVES:
    for _ in range(count):
      features = {k: tf.constant(v) for k, v in batch(steps).items()}
      coordinator.schedule(worker_step, args=(features,))
      coordinator.join()
      steps += 1
    if name.startswith("delta"):
      tpe.checkpoints.write_delta(checkpoint, path[name])
    else:
      tpe.checkpoints.write(checkpoint, path[name])
  live = values(emb)

  with strategy.scope():
    fresh = make_embedding(init=False)
    fresh.build()
    fresh_dense = tf.Variable(tf.zeros([2]), name="dense")
  restored = tf.train.Checkpoint(embedding=fresh, dense=fresh_dense)
  tpe.checkpoints.restore(
    restored, path["ckpt-1"], deltas=[path["delta-2"], path["delta-3"]]
  )
  got = values(fresh)
  assert sorted(got) == sorted(live)
  for key, value in live.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)
  np.testing.assert_array_equal(fresh_dense.numpy(), dense.numpy())
  tpe.checkpoints.write(restored, os.path.join(directory, "restored"))
  print("OK")


if __name__ == "__main__":
  main(sys.argv[1])
