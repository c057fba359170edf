"""A disk table restored before it exists, and read without its cache.

A checkpoint restored before ``build()`` (``tpe.checkpoints.restore``, a
plain ``tf.train.Checkpoint.restore`` or the ``CheckpointManager``) is
streamed into the files when the table is made, never read whole; a
manager's ``restore_or_initialize`` into a built table streams too. The
oracle is the in-memory layout restored from the same checkpoint: values
and the training after, bit for bit. Serving lookups
(``ServingLookup``, ``serving_embedding_lookup``, a Keras layer's) read a
disk table's rows without admitting them: the cache is left as it was.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy
from tests.tables import test_tiered_sharded as sharded
from tests.tables import test_tiered_stacks as stacks
from tests.tables.test_tiered import BATCH
from tests.tables.test_tiered import DIM
from tests.tables.test_tiered import ROWS
from tests.tables.test_tiered import assert_same
from tests.tables.test_tiered import batches
from tests.tables.test_tiered import train
from tests.tables.test_tiered import values
from tpu_embedding.export import ServingLookup
from tpu_embedding.sharding import DiskTier
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.tables import tiered

CACHE_ROWS = 48


def features(rows=ROWS):
  big = tpe.TableConfig(
    rows, DIM, name="big", initializer=tf.random_uniform_initializer(seed=7)
  )
  small = tpe.TableConfig(
    7, DIM, name="small", initializer=tf.random_uniform_initializer(seed=8)
  )
  return {
    "a": tpe.FeatureConfig(big, name="a"),
    "b": tpe.FeatureConfig(big, name="b"),
    "c": tpe.FeatureConfig(small, name="c"),
  }


def unbuilt(directory=None, rows=ROWS):
  """``test_tiered.make_embedding``'s embedding (Adagrad), not built."""
  policy = PlacementPolicy()
  if directory is not None:
    cache = CACHE_ROWS * DIM * 4 * 2
    policy = PlacementPolicy(disk=DiskTier(str(directory), cache, ("big",)))
  return tpe.TPUEmbedding(
    features(rows), tpe.Adagrad(0.3), row_sharding_threshold=policy
  )


def built(directory=None):
  emb = unbuilt(directory)
  emb.build(per_replica_batch_size=BATCH)
  return emb


@pytest.fixture
def whole_reads_refused(monkeypatch):
  """A disk table's whole-value writes (TensorFlow's restore) fail."""

  def assign(*args, **kwargs):
    raise AssertionError("a disk table was assigned a whole value")

  monkeypatch.setattr(tiered.TieredTable, "assign", assign)


def saved(tmp_path):
  """``(in-memory embedding trained 6 steps, the batches, its manager
  directory)`` with one save of it."""
  data = batches("dense", np.random.default_rng(4))
  memory = built()
  train(memory, data[:6], "dense")
  directory = str(tmp_path / "run")
  checkpoint = tf.train.Checkpoint(embedding=memory)
  tpe.checkpoints.CheckpointManager(checkpoint, directory, 2).save()
  return memory, data, directory


RESTORES = {
  "checkpoints": lambda checkpoint, directory: tpe.checkpoints.restore(
    checkpoint, tf.train.latest_checkpoint(directory)
  ),
  "plain": lambda checkpoint, directory: checkpoint.restore(
    tf.train.latest_checkpoint(directory)
  ),
  "manager": lambda checkpoint, directory: tpe.checkpoints.CheckpointManager(
    checkpoint, directory, 2
  ).restore_or_initialize(),
}


@pytest.mark.parametrize("restore", sorted(RESTORES))
def test_a_restore_before_build_streams_into_the_files(
  restore, tmp_path, whole_reads_refused
):
  memory, data, directory = saved(tmp_path)
  emb = unbuilt(tmp_path / "disk")
  status = RESTORES[restore](tf.train.Checkpoint(embedding=emb), directory)
  emb.build(per_replica_batch_size=BATCH)
  if restore != "manager":  # (which gives the path)
    status.assert_consumed()
  assert emb.table_stores["big"].layout == "tiered"
  assert_same(values(emb), values(memory))
  # Both go on training alike from the restored state.
  train(emb, data[6:], "dense")
  train(memory, data[6:], "dense")
  assert_same(values(emb), values(memory))


def test_a_restore_before_build_of_another_shape_is_refused(tmp_path):
  _, _, directory = saved(tmp_path)
  emb = unbuilt(tmp_path / "disk", rows=ROWS + 1)
  tpe.checkpoints.restore(
    tf.train.Checkpoint(embedding=emb), tf.train.latest_checkpoint(directory)
  )
  with pytest.raises(ValueError, match="Table 'big'.*configured as the"):
    emb.build(per_replica_batch_size=BATCH)


def test_a_resumed_run_equals_the_uninterrupted_one(
  tmp_path, whole_reads_refused
):
  """6 steps, a save, a new embedding built and ``restore_or_initialize``
  (streamed into the built table), 6 more: the 12 steps in memory."""
  data = batches("ragged", np.random.default_rng(8))
  first = built(tmp_path / "disk1")
  train(first, data[:6], "ragged")
  directory = str(tmp_path / "run")
  tpe.checkpoints.CheckpointManager(
    tf.train.Checkpoint(embedding=first), directory, 2
  ).save()
  del first
  resumed = built(tmp_path / "disk2")
  manager = tpe.checkpoints.CheckpointManager(
    tf.train.Checkpoint(embedding=resumed), directory, 2
  )
  assert manager.restore_or_initialize() == tf.train.latest_checkpoint(
    directory
  )
  train(resumed, data[6:], "ragged")
  memory = built()
  train(memory, data, "ragged")
  assert_same(values(resumed), values(memory))


def cache_state(store):
  rows = store.cache
  return {
    "map": rows._slot_of_row.copy(),  # pylint: disable=protected-access
    "rows": rows.row_of_slot.copy(),
    "use": rows.last_use.copy(),
    "dirty": rows.dirty.copy(),
    "frequency": rows.frequency.copy(),
    "hand": rows._hand,  # pylint: disable=protected-access
    "changed": rows.changed_rows().copy(),
    "counts": (rows.step, rows.hits, rows.misses, rows.reads, rows.writes),
  }


def test_serving_lookups_read_a_disk_table_without_its_cache(tmp_path):
  """Every row (cached and changed, evicted to the files, never looked
  up), through each serving lookup, eager and traced: the in-memory
  table's rows; the cache's map, counts and changed rows as they were."""
  data = batches("ragged", np.random.default_rng(6))
  emb, memory = built(tmp_path / "disk"), built()
  for trained in (emb, memory):
    train(trained, data, "ragged")
  store = emb.table_stores["big"]
  assert store.cache.writes > 0 and store.cache.dirty.any()
  before = cache_state(store)
  ids = {"a": tf.range(ROWS, dtype=tf.int64), "c": tf.range(7, dtype=tf.int64)}

  def lookups(embedding):
    live = ServingLookup(embedding)

    def serve():
      return tpe.serving_embedding_lookup(
        ids, None, embedding.embedding_tables, embedding.feature_config
      )

    return [live(ids), tf.function(lambda: live(ids))(), serve()]

  got, want = lookups(emb), lookups(memory)
  for one, other in zip(got, want, strict=True):
    for name in ids:
      np.testing.assert_array_equal(one[name].numpy(), other[name].numpy())
  after = cache_state(store)
  for key, value in before.items():
    np.testing.assert_array_equal(after[key], value, err_msg=key)
  # Training goes on as in memory.
  more = batches("ragged", np.random.default_rng(7))
  train(emb, more, "ragged")
  train(memory, more, "ragged")
  assert_same(values(emb), values(memory))


def test_only_a_plain_save_or_restore_of_a_built_table_warns(
  tmp_path, monkeypatch, caplog
):
  """``tpe.checkpoints`` (full saves, deltas, the manager) and restores
  before build stream a disk table silently; a plain
  ``tf.train.Checkpoint`` save or restore of the built table, which holds
  its values whole, warns once (tables of 64 MiB and more: here any)."""
  monkeypatch.setattr(tiered.slicing, "LARGE_TABLE_BYTES", 0)
  monkeypatch.setattr(tiered, "_WARNED", set())
  data = batches("dense", np.random.default_rng(2))
  emb = built(tmp_path / "disk")
  train(emb, data[:3], "dense")
  checkpoint = tf.train.Checkpoint(embedding=emb)
  manager = tpe.checkpoints.CheckpointManager(
    checkpoint, str(tmp_path / "run"), 3, delta_interval=1
  )
  prefix = tpe.checkpoints.write(checkpoint, str(tmp_path / "ckpt"))
  manager.save()
  train(emb, data[3:6], "dense")
  manager.save()  # a delta
  tpe.checkpoints.restore(checkpoint, prefix)
  manager.restore_or_initialize()
  early = unbuilt(tmp_path / "disk2")
  tf.train.Checkpoint(embedding=early).restore(prefix)
  early.build(per_replica_batch_size=BATCH)
  assert manager.deltas and not caplog.records
  for plain in (
    lambda: checkpoint.save(str(tmp_path / "plain")),
    lambda: checkpoint.restore(prefix),
  ):
    plain()
    (record,) = caplog.records
    assert "Table 'big' is kept on disk, but a plain" in record.getMessage()
    caplog.clear()
    monkeypatch.setattr(tiered, "_WARNED", set())


def unbuilt_by(make, *args):
  """``(make(*args)``'s embedding, not built yet; its ``build()``)."""
  calls = []
  with mock.patch.object(
    tpe.TPUEmbedding, "build", lambda _, *a, **k: calls.append((a, k))
  ):
    emb = make(*args)
  ((build_args, build_kwargs),) = calls
  return emb, lambda: emb.build(*build_args, **build_kwargs)


def serves_without_its_cache(got, want, features, stores):
  """``ServingLookup`` reads ``got`` as ``want``; ``stores``' caches are
  left as they were."""
  before = [cache_state(store) for store in stores]
  read = [ServingLookup(emb)(features) for emb in (got, want)]
  for name in features:
    np.testing.assert_array_equal(read[0][name], read[1][name], err_msg=name)
  for store, state in zip(stores, before, strict=True):
    after = cache_state(store)
    for key, value in state.items():
      np.testing.assert_array_equal(after[key], value, err_msg=key)


def test_a_disk_stack_restores_before_build_and_serves(
  tmp_path, whole_reads_refused
):
  """Each stacked table's rows stream into the stack's files at its
  offset; serving reads them without the stack's cache."""
  data = stacks.batches("ragged", seed=5)
  memory = stacks.make_embedding(tpe.Adagrad(0.3), None, stacks.STACK)
  stacks.train(memory, data[:4], "ragged")
  prefix = tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=memory), str(tmp_path / "ckpt")
  )
  emb, build = unbuilt_by(
    stacks.make_embedding, tpe.Adagrad(0.3), tmp_path / "disk", stacks.STACK
  )
  tf.train.Checkpoint(embedding=emb).restore(prefix)
  build()
  store = stacks.disk_stack(emb)
  assert_same(values(emb), values(memory))
  stacks.train(emb, data[4:], "ragged")
  stacks.train(memory, data[4:], "ragged")
  ids = {
    name: tf.range(rows, dtype=tf.int64)
    for name, rows in (("a1", 300), ("b", 200))
  }
  serves_without_its_cache(emb, memory, ids, [store])
  assert_same(values(emb), values(memory))


def test_disk_blocks_under_mirrored_restore_before_build_and_serve(
  tmp_path, whole_reads_refused
):
  """Each replica's block streams its rows into its files; serving reads
  every block without its cache."""
  strategy = mirrored_strategy(sharded.REPLICAS)
  data = sharded.batches("ragged", np.random.default_rng(3))
  memory = sharded.make_embedding(tpe.Adagrad(0.3), strategy)
  sharded.train(memory, data[:4], strategy)
  prefix = tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=memory), str(tmp_path / "ckpt")
  )
  emb, build = unbuilt_by(
    sharded.make_embedding, tpe.Adagrad(0.3), strategy, tmp_path / "disk"
  )
  tf.train.Checkpoint(embedding=emb).restore(prefix)
  build()
  store = emb.table_stores["big"]
  assert store.layout == "tiered_row_sharded"
  assert_same(values(emb), values(memory))
  sharded.train(emb, data[4:], strategy)
  sharded.train(memory, data[4:], strategy)
  tiers = [store.tier(block) for block in range(sharded.REPLICAS)]
  ids = {"a": tf.range(sharded.ROWS, dtype=tf.int64)}
  serves_without_its_cache(emb, memory, ids, tiers)
  assert_same(values(emb), values(memory))
