"""One worker of a 2-process MultiWorkerMirroredStrategy run with dynamic
tables, on 127.0.0.1.

Launched twice by tests/backends/test_multi_worker.py with ``TF_CONFIG``
set. Two dynamic tables: ``users`` (row-sharded over the two workers' replicas,
constant initializer) and ``tags`` (replicated on both workers, *random*
initializer). Each worker trains 5 steps with gradients that depend on the
activations and checks:

* ``users``: the activations of its replica, the whole table, its slots and
  the vocabulary's statistics and state equal the same steps on one device,
  while each worker holds half of the vocabulary's state (sharded like the
  rows);
* the traced step: tables, slots and vocabulary arrays read and written
  by row only (``check_row_only``);
* ``tags``: both workers' copies are equal (rows given to new keys take
  replica 0's random values everywhere);
* checkpoints saved by both workers (``tf.train.Checkpoint``: the state
  gathered; ``tpe.checkpoints.write``: each worker its own shards) restore
  into a one-device object (tables, slots, vocabulary state, lookups of
  raw keys), and the sliced one into a fresh 2-worker job.

Prints "OK" and exits 0 on success.

In tests/backends/test_multi_worker.py its ``main`` runs as a phase of
``mwms_phases.py`` (several scripts per cluster launch).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mwms_training import check_row_only  # noqa: E402 (this directory)
from mwms_training import one_device_step  # noqa: E402
from mwms_training import training_step  # noqa: E402

import tpu_embedding as tpe  # noqa: E402
from tpu_embedding.vocabularies.sharded_state import ShardedVocabulary  # noqa: E402

CAPACITY, BUCKET, DIM, BATCH, STEPS = 24, 4, 3, 8, 5


def users():
  return tpe.TableConfig(
    CAPACITY,
    DIM,
    name="users",
    combiner="sum",
    initializer=tf.constant_initializer(0.5),
    vocabulary=tpe.DynamicVocabulary(bucket_size=BUCKET, min_count=2),
  )


def tags():
  return tpe.TableConfig(
    6,
    DIM,
    name="tags",
    initializer=tf.random_uniform_initializer(-1.0, 1.0),
    vocabulary=tpe.DynamicVocabulary(bucket_size=2, eviction="lfu"),
  )


def make_embedding(with_tags: bool):
  features = {"user": tpe.FeatureConfig(users())}
  if with_tags:
    features["tag"] = tpe.FeatureConfig(tags())
  return tpe.TPUEmbedding(features, tpe.Adagrad(0.4), row_sharding_threshold=10)


def loss_fn(activations, projection):
  loss = tf.reduce_sum(activations["user"] * projection)
  loss += tf.reduce_sum(tf.square(activations["user"]))
  if "tag" in activations:
    loss += tf.reduce_sum(tf.square(activations["tag"]))
  return loss


def state(emb, name):
  """The vocabulary's whole state, as numpy (sharded over the workers: a
  collective)."""
  whole = emb.engine.dynamic_tables.states[name].whole()
  return {k: v.numpy() for k, v in whole.items()}


def main(checkpoint_dir: str, strategy=None) -> None:
  strategy = strategy or tf.distribute.MultiWorkerMirroredStrategy()
  is_chief = json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0
  replicas = strategy.num_replicas_in_sync
  assert replicas == 2, replicas
  per = BATCH // replicas
  rng = np.random.default_rng(7)
  keys = np.array([10**15, -5, 2**40 + 3, 77, -(2**50), 12, 999, 2**62])
  projection = tf.constant(rng.normal(size=(BATCH, DIM)).astype(np.float32))
  batches = [
    {
      "user": tf.ragged.constant(
        [list(rng.choice(keys, rng.integers(0, 3))) for _ in range(BATCH)],
        dtype=tf.int64,
        ragged_rank=1,
      ),
      "tag": tf.constant(rng.integers(-3, 9, BATCH), tf.int64),
    }
    for _ in range(STEPS)
  ]

  single = make_embedding(with_tags=False)
  single_step = one_device_step(single, loss_fn, projection)
  want = [single_step({"user": b["user"]})["user"].numpy() for b in batches]

  with strategy.scope():
    emb = make_embedding(with_tags=True)

  step = training_step(strategy, emb, loss_fn, projection, per)

  first = strategy.cluster_resolver.task_id
  for number, (batch, expected) in enumerate(zip(batches, want, strict=True)):
    got = strategy.experimental_local_results(step(batch)["user"])[0]
    np.testing.assert_allclose(
      got,
      expected[first * per : (first + 1) * per],
      atol=1e-5,
      err_msg=f"step {number}",
    )
  assert emb.sharding_plan.placements["users"].sharded
  assert not emb.sharding_plan.placements["tags"].sharded
  # Rows, slots and vocabulary arrays by row (the state's scalars whole).
  check_row_only("mwms/dynamic", step, emb)
  for slot, value in single.variables["users"].items():
    np.testing.assert_allclose(
      emb.variables["users"][slot].read_value(),
      value.numpy(),
      atol=1e-5,
      err_msg=slot,
    )
  statistics = emb.engine.dynamic_tables.statistics()
  alone = single.engine.dynamic_tables.statistics()["users"]
  # The state is sharded like the rows: each worker holds half of it.
  states = emb.engine.dynamic_tables.states
  assert isinstance(states["users"], ShardedVocabulary)
  assert not isinstance(states["tags"], ShardedVocabulary)
  assert states["users"].copy(0).layout.local_rows == CAPACITY // 2
  assert statistics["users"]["state_bytes"] < alone["state_bytes"] * 0.6
  for key in ("capacity", "rows_in_use", "evictions", "step"):
    assert statistics["users"][key] == alone[key], key
  assert statistics["users"]["step"] == STEPS
  assert statistics["tags"]["rows_in_use"] > 0
  for key, value in state(single, "users").items():
    np.testing.assert_array_equal(state(emb, "users")[key], value, key)

  # The replicated table's copies: equal on both workers.
  @tf.function
  def both_copies():
    def replica_fn():
      store = emb.table_stores["tags"]
      (block,) = store.blocks
      values = tf.concat([v.read_value() for v in block.values()], 1)
      context = tf.distribute.get_replica_context()
      return context.all_gather(values[None], axis=0)

    return strategy.run(replica_fn)

  copies = strategy.experimental_local_results(both_copies())[0].numpy()
  np.testing.assert_array_equal(copies[0], copies[1])
  assert np.abs(copies[0][:6, :DIM]).max() > 0  # new rows: random values

  # A plain save (every worker gathers the whole state), and the sliced
  # save (every worker writes its own shards) to the same path.
  target = checkpoint_dir if is_chief else os.path.join(checkpoint_dir, "w1")
  plain = tf.train.Checkpoint(embedding=emb).save(os.path.join(target, "ckpt"))
  sliced = tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=emb), os.path.join(checkpoint_dir, "sliced")
  )
  for path in (plain, sliced):
    if is_chief:
      check_one_device_restore(path, single, copies, keys)
  # Restored by both workers into a fresh sharded job.
  with strategy.scope():
    fresh = make_embedding(with_tags=True)
  fresh.build()
  tpe.checkpoints.restore(tf.train.Checkpoint(embedding=fresh), sliced)
  for key, value in state(single, "users").items():
    np.testing.assert_array_equal(state(fresh, "users")[key], value, key)
  for slot, value in single.variables["users"].items():
    np.testing.assert_allclose(
      fresh.variables["users"][slot].read_value(), value.numpy(), atol=1e-5
    )
  print("OK")


def check_one_device_restore(path, single, copies, keys):
  """The checkpoint restores whole into one device and serves as trained."""
  restored = make_embedding(with_tags=True)
  tf.train.Checkpoint(embedding=restored).restore(path)
  for slot, value in single.variables["users"].items():
    np.testing.assert_allclose(
      restored.variables["users"][slot].numpy(), value.numpy(), atol=1e-5
    )
  for key, value in state(single, "users").items():
    np.testing.assert_array_equal(state(restored, "users")[key], value, key)
  np.testing.assert_array_equal(
    restored.variables["tags"]["parameters"].numpy(), copies[0][:, :DIM]
  )
  probe = {"user": tf.constant(keys), "tag": tf.constant([-3, 0, 5, 8])}
  np.testing.assert_allclose(
    restored(probe)["user"].numpy(),
    single({"user": probe["user"]})["user"].numpy(),
    atol=1e-5,
  )


if __name__ == "__main__":
  main(sys.argv[1])
