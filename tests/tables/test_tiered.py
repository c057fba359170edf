"""Tables kept on a local disk behind a RAM cache (``DiskTier``).

The oracle is the in-memory layout: the same embedding, the same steps,
tables and slots compared bit for bit, for every optimizer that updates
only looked-up rows, every input kind, a shared table, pipelined steps,
and caches from "every step evicts" to "every row fits". Checkpoints move
between the two layouts both ways. Rows never looked up are never written
(the files stay sparse).
"""

from __future__ import annotations

import dataclasses
import errno
import os

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy
from tpu_embedding import data as input_data
from tpu_embedding.backends.selection import select_backend
from tpu_embedding.sharding import DiskTier
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.tables import tiered
from tpu_embedding.tables.initial_values import grid_rows
from tpu_embedding.tables.row_cache import CacheTooSmallError
from tpu_embedding.tables.row_files import DiskFullError

OPTIMIZERS = {
  "sgd": lambda: tpe.SGD(0.2),
  "adagrad": lambda: tpe.Adagrad(0.3),
  "adagrad_momentum": lambda: tpe.AdagradMomentum(0.2, momentum=0.8),
  "lazy_adam": lambda: tpe.Adam(0.1),
  "ftrl": lambda: tpe.FTRL(0.2, l1_regularization_strength=0.01),
}
ROWS, DIM, BATCH, STEPS = 300, 4, 8, 12
FLOAT32 = tpe.RowStorage()


def make_embedding(
  optimizer,
  directory=None,
  cache_rows=48,
  pipeline=False,
  storage=FLOAT32,
  restore=None,
):
  """Table "big" (features "a" and "b": a shared table) and "small", both
  stored as ``storage`` says; with ``directory``, "big" kept on disk with
  a cache of ``cache_rows`` rows; ``restore``: a checkpoint restored
  before build."""
  big = tpe.TableConfig(
    ROWS,
    DIM,
    name="big",
    initializer=tf.random_uniform_initializer(seed=7),
    storage=storage,
  )
  small = tpe.TableConfig(
    7,
    DIM,
    name="small",
    initializer=tf.random_uniform_initializer(seed=8),
    storage=storage,
  )
  features = {
    "a": tpe.FeatureConfig(big, name="a"),
    "b": tpe.FeatureConfig(big, name="b"),
    "c": tpe.FeatureConfig(small, name="c"),
  }
  policy = PlacementPolicy()
  if directory is not None:
    # A row and its slots as stored, and a 16-bit cache's slot map entry.
    row_bytes = DIM * (
      storage.parameter_dtype.size
      + len(optimizer.SLOT_NAMES) * storage.slot_dtype.size
    ) + (0 if storage.is_float32 else 8)
    policy = PlacementPolicy(
      disk=DiskTier(str(directory), cache_rows * row_bytes, ("big",))
    )
  emb = tpe.TPUEmbedding(
    features,
    optimizer,
    row_sharding_threshold=policy,
    pipeline_execution_with_tensor_core=pipeline,
  )
  if restore is not None:
    tf.train.Checkpoint(embedding=emb).restore(restore).expect_partial()
  emb.build(per_replica_batch_size=BATCH)
  return emb


def batches(kind, rng):
  """``STEPS`` batches of features ``a``, ``b``, ``c`` as ``kind`` says."""
  out = []
  for _ in range(STEPS):
    hot = rng.zipf(1.3, size=(BATCH, 3)) % ROWS
    if kind == "dense":
      a = tf.constant(hot[:, 0], tf.int64)
      b = tf.constant(hot[:, 1], tf.int64)
    elif kind == "ragged":
      a = tf.ragged.constant(
        [list(r[: 1 + i % 3]) for i, r in enumerate(hot)], tf.int64
      )
      b = tf.ragged.constant([[x] for x in hot[:, 2]], tf.int64)
    elif kind == "sparse":
      a = tf.sparse.from_dense(tf.constant(hot[:, :2] + 1, tf.int64))
      a = tf.sparse.map_values(lambda v: v - 1, a)
      b = tf.sparse.from_dense(tf.constant(hot[:, 2:] + 1, tf.int64))
      b = tf.sparse.map_values(lambda v: v - 1, b)
    else:  # weighted: ragged ids with weights
      a = tf.ragged.constant([list(r[:2]) for r in hot], tf.int64)
      b = tf.ragged.constant([[x] for x in hot[:, 2]], tf.int64)
    c = tf.constant(rng.integers(0, 7, BATCH), tf.int64)
    out.append({"a": a, "b": b, "c": c})
  return out


def weights_of(kind, batch):
  if kind != "weighted":
    return None
  return {
    "a": tf.ones_like(batch["a"], tf.float32) * 0.5,
    "b": tf.ones_like(batch["b"], tf.float32) * 2.0,
    "c": None,
  }


def train(emb, data, kind):
  @tf.function
  def step(features, weights):
    emb.enqueue(features, weights)
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = sum(tf.reduce_sum(x * x) for x in tf.nest.flatten(activations))
    emb.apply_gradients(tape.gradient(loss, activations))

  for batch in data:
    step(batch, weights_of(kind, batch))
  emb.flush_pipeline()


def values(emb):
  return {
    (table, key): np.asarray(tf.convert_to_tensor(variable)).copy()
    for table, keys in emb.variables.items()
    for key, variable in keys.items()
  }


def assert_same(got, want):
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["dense", "ragged", "sparse", "weighted"])
def test_training_equals_the_in_memory_table(optimizer, kind, tmp_path):
  """A 48-row cache over 300 rows: twice a step's distinct rows at most
  (steps evict, write back and read back)."""
  data = batches(kind, np.random.default_rng(3))
  want = make_embedding(OPTIMIZERS[optimizer]())
  train(want, data, kind)
  got = make_embedding(OPTIMIZERS[optimizer](), tmp_path)
  train(got, data, kind)
  store = got.table_stores["big"]
  assert store.layout == "tiered"
  assert got.table_stores["small"].layout == "whole"
  # Rows were evicted, written back and read back.
  assert store.cache.writes > 0 and store.cache.reads > 0
  assert_same(values(got), values(want))


@pytest.mark.parametrize("cache_rows", [32, ROWS])
@pytest.mark.parametrize("pipeline", [False, True])
def test_cache_sizes_and_pipelining(cache_rows, pipeline, tmp_path):
  """The smallest cache two steps' distinct rows fit in, and every row."""
  data = batches("dense", np.random.default_rng(5))
  want = make_embedding(tpe.Adagrad(0.3), pipeline=pipeline)
  train(want, data, "dense")
  got = make_embedding(tpe.Adagrad(0.3), tmp_path, cache_rows, pipeline)
  train(got, data, "dense")
  assert_same(values(got), values(want))


def storage_16(dtype, optimizer):
  """``dtype`` parameters; bfloat16 slots where the rule takes them."""
  slots = "bfloat16" if optimizer in ("sgd", "adagrad") else "float32"
  return tpe.RowStorage(dtype, slots=slots, seed=11)


def as_float64(state):
  return {key: value.astype(np.float64) for key, value in state.items()}


@pytest.mark.parametrize(
  "dtype, optimizer, cache_rows",
  [
    ("bfloat16", "adagrad", 32),
    ("bfloat16", "ftrl", 48),
    ("float16", "sgd", 32),
    ("float16", "adagrad", ROWS),
  ],
)
def test_16_bit_tables_on_disk_equal_the_in_memory_table(
  dtype, optimizer, cache_rows, tmp_path
):
  """16-bit rows on disk: the cache holds the stored types (twice the rows
  for the bytes), the files values exact in them; each update rounds by
  global row, not by cache slot: the in-memory 16-bit table's numbers."""
  storage = storage_16(dtype, optimizer)
  data = batches("ragged", np.random.default_rng(4))
  want = make_embedding(OPTIMIZERS[optimizer](), storage=storage)
  train(want, data, "ragged")
  got = make_embedding(
    OPTIMIZERS[optimizer](), tmp_path, cache_rows, storage=storage
  )
  train(got, data, "ragged")
  store = got.table_stores["big"]
  assert store.layout == "tiered" and store.cache.size == cache_rows
  assert store.blocks[0]["parameters"].dtype == tf.as_dtype(dtype)
  if cache_rows < ROWS:
    assert store.cache.writes > 0 and store.cache.reads > 0
  assert_same(as_float64(values(got)), as_float64(values(want)))


@pytest.mark.parametrize("when", ["before_build", "after_build"])
def test_16_bit_checkpoints_move_between_disk_and_memory(when, tmp_path):
  """Memory (bfloat16 saved) to disk, trained alike, and back (float32
  saved, exact in bfloat16)."""
  storage = storage_16("bfloat16", "adagrad")
  data = batches("ragged", np.random.default_rng(6))

  def restored(path, directory=None):
    if when == "before_build":
      return make_embedding(
        tpe.Adagrad(0.3), directory, 32, storage=storage, restore=path
      )
    emb = make_embedding(tpe.Adagrad(0.3), directory, 32, storage=storage)
    tpe.checkpoints.restore(tf.train.Checkpoint(embedding=emb), path)
    return emb

  memory = make_embedding(tpe.Adagrad(0.3), storage=storage)
  train(memory, data[:6], "ragged")
  path = tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=memory), str(tmp_path / "mem")
  )
  disk = restored(path, tmp_path / "disk")
  assert disk.table_stores["big"].layout == "tiered"
  assert_same(as_float64(values(disk)), as_float64(values(memory)))
  train(memory, data[6:], "ragged")
  train(disk, data[6:], "ragged")
  assert_same(as_float64(values(disk)), as_float64(values(memory)))
  path = tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=disk), str(tmp_path / "disk_ckpt")
  )
  again = restored(path)
  assert again.variables["big"]["parameters"].dtype == tf.bfloat16
  assert_same(as_float64(values(again)), as_float64(values(memory)))


def test_a_restore_drops_the_held_update_of_a_pipelined_disk_table(tmp_path):
  """Restored while a pipelined update is held (its rows no longer
  cached): the flush applies nothing, the files hold the checkpoint."""
  data = batches("dense", np.random.default_rng(2))
  emb = make_embedding(tpe.Adagrad(0.3), tmp_path / "disk", 32, pipeline=True)
  train(emb, data[:4], "dense")
  checkpoint = tf.train.Checkpoint(embedding=emb)
  path = tpe.checkpoints.write(checkpoint, str(tmp_path / "c"))
  saved = values(emb)
  step = data[4]
  emb.enqueue(step)
  activations = emb.dequeue()
  emb.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))
  tpe.checkpoints.restore(checkpoint, path)
  emb.flush_pipeline()
  assert_same(values(emb), saved)


def test_checkpoints_move_between_disk_and_memory(tmp_path):
  data = batches("ragged", np.random.default_rng(9))
  tiered = make_embedding(tpe.Adagrad(0.3), tmp_path / "disk")
  train(tiered, data[:6], "ragged")
  saved = values(tiered)
  path = tf.train.Checkpoint(embedding=tiered).save(str(tmp_path / "ckpt"))
  memory = make_embedding(tpe.Adagrad(0.3))
  tf.train.Checkpoint(embedding=memory).restore(path).assert_consumed()
  assert_same(values(memory), saved)
  # ... and back, into a fresh disk table, then both train alike.
  train(memory, data[6:], "ragged")
  path = tf.train.Checkpoint(embedding=memory).save(str(tmp_path / "mem"))
  again = make_embedding(tpe.Adagrad(0.3), tmp_path / "disk2")
  tf.train.Checkpoint(embedding=again).restore(path).assert_consumed()
  assert_same(values(again), values(memory))


def test_grid_blocks_never_looked_up_are_never_written(tmp_path):
  """A table of 3 grid blocks (and a bit), its rows looked up in the
  second only: the file holds that block alone; the table still reads
  whole (initial values elsewhere) and equals the in-memory one."""
  rows = 3 * grid_rows(DIM) + 5
  table = tpe.TableConfig(
    rows, DIM, name="t", initializer=tf.random_uniform_initializer(seed=2)
  )
  made = []
  for disk in (DiskTier(str(tmp_path), 2**16, ("t",)), DiskTier()):
    emb = tpe.TPUEmbedding(
      {"f": tpe.FeatureConfig(table)},
      tpe.SGD(0.1),
      row_sharding_threshold=PlacementPolicy(disk=disk),
    )
    emb.build(per_replica_batch_size=BATCH)
    ids = grid_rows(DIM) + np.arange(BATCH, dtype=np.int64) * 7
    train(emb, [{"f": tf.constant(ids)}] * 3, "dense")
    made.append(emb)
  assert_same(values(made[0]), values(made[1]))
  # SGD: records of parameters, each with its row id (8 bytes); a grid
  # block, the step's write-backs and the cleaner's slack.
  record = DIM * 4 + 8
  written = os.path.getsize(tmp_path / "t" / "rows.records")
  assert grid_rows(DIM) * record <= written < 1.5 * grid_rows(DIM) * record


def test_the_counts_of_hits_misses_reads_and_writes(tmp_path):
  """A cache of 16 rows and steps of 8 distinct ids: blocks of 8 ids
  first seen miss and are read; seen again while cached, they hit; the
  third new block evicts the first, updated, so it is written back.
  Tables in memory count nothing."""
  table = tpe.TableConfig(1000, DIM, name="t")
  small = tpe.TableConfig(10, DIM, name="small")
  emb = tpe.TPUEmbedding(
    {"f": tpe.FeatureConfig(table), "g": tpe.FeatureConfig(small)},
    tpe.SGD(0.1),
    row_sharding_threshold=PlacementPolicy(
      disk=DiskTier(str(tmp_path), 16 * DIM * 4, ("t",))
    ),
  )
  emb.build(per_replica_batch_size=BATCH)
  counts = []
  for first in (0, 0, 100, 200, 200, 0):
    ids = first + np.arange(BATCH, dtype=np.int64)
    train(emb, [{"f": tf.constant(ids), "g": tf.constant(ids % 10)}], "dense")
    counts.append(emb.disk_tier_counts())
  assert [sorted(c) for c in counts] == [["t"]] * 6
  got = [dataclasses.astuple(c["t"]) for c in counts]
  # (hits, misses, rows read, rows written, rows read ahead: none without
  # data.prefetch_rows), summed so far.
  assert got == [
    (0, 8, 8, 0, 0),
    (8, 8, 8, 0, 0),
    (8, 16, 16, 0, 0),
    (8, 24, 24, 8, 0),  # rows 0-7 leave (100-107 were the step before)
    (16, 24, 24, 8, 0),
    (16, 32, 32, 16, 0),  # 0-7 come back, 100-107 leave
  ]
  interval = counts[-1]["t"] - counts[3]["t"]
  assert interval.hit_rate == 0.5 and interval.rows_written == 8


def test_a_restore_writes_each_row_once(tmp_path):
  """A restore into a disk table writes each grid block once (the
  restored rows, not the initial values first): the file holds about the
  table's records, and the table equals the one saved."""
  rows = 3 * grid_rows(DIM) + 5
  table = tpe.TableConfig(
    rows, DIM, name="t", initializer=tf.random_uniform_initializer(seed=2)
  )

  def embedding(disk):
    emb = tpe.TPUEmbedding(
      {"f": tpe.FeatureConfig(table)},
      tpe.SGD(0.1),
      row_sharding_threshold=PlacementPolicy(disk=disk),
    )
    emb.build(per_replica_batch_size=BATCH)
    return emb

  memory = embedding(DiskTier())
  train(memory, [{"f": tf.constant(np.arange(BATCH) * 1000)}] * 2, "dense")
  prefix = tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=memory), str(tmp_path / "ckpt")
  )
  disk = embedding(DiskTier(str(tmp_path / "ssd"), 2**16, ("t",)))
  tpe.checkpoints.restore(tf.train.Checkpoint(embedding=disk), prefix)
  assert_same(values(disk), values(memory))
  record = DIM * 4 + 8  # SGD: the parameters and the row's id
  written = os.path.getsize(tmp_path / "ssd" / "t" / "rows.records")
  assert rows * record <= written < 1.2 * rows * record


def test_a_cache_too_small_for_two_steps_is_refused(tmp_path):
  emb = make_embedding(tpe.SGD(0.1), tmp_path, cache_rows=3)
  data = batches("dense", np.random.default_rng(1))
  with pytest.raises(Exception, match="give the cache at least twice"):
    train(emb, data, "dense")


def test_refusals_name_the_table(tmp_path):
  with pytest.raises(ValueError, match="Table 'big'.*updates every row"):
    make_embedding(tpe.Adam(0.1, lazy_adam=False), tmp_path)
  # (MirroredStrategy row-shards them: tests/tables/test_tiered_sharded.py.)
  parameter_servers = object.__new__(
    tf.distribute.experimental.ParameterServerStrategy
  )
  with pytest.raises(
    ValueError,
    match=r"^Tables \['big'\] are kept on disk .*, not under "
    r"ParameterServerStrategy.*: its rows live on the parameter servers",
  ):
    with mirrored_strategy(2).scope():
      select_backend(
        parameter_servers,
        (),
        PlacementPolicy(disk=DiskTier(str(tmp_path), 1, ("big",))),
      )
  with pytest.raises(ValueError, match="directory must name"):
    DiskTier("", 0, ("big",))


def test_checkpoints_write_and_restore_by_parts(tmp_path):
  """``tpe.checkpoints.write`` / ``restore`` stream a disk table in chunks
  (here 3 rows each: 100 parts), to and from the in-memory layout."""
  data = batches("dense", np.random.default_rng(4))
  tiered = make_embedding(tpe.Adagrad(0.3), tmp_path / "disk")
  train(tiered, data[:6], "dense")
  saved = values(tiered)
  chunk = 3 * DIM * 4
  prefix = str(tmp_path / "ckpt")
  tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=tiered), prefix, chunk_bytes=chunk
  )
  assert len(tf.train.list_variables(prefix)) >= len(saved)
  memory = make_embedding(tpe.Adagrad(0.3))
  tpe.checkpoints.restore(tf.train.Checkpoint(embedding=memory), prefix)
  assert_same(values(memory), saved)
  again = make_embedding(tpe.Adagrad(0.3), tmp_path / "disk2")
  tpe.checkpoints.restore(
    tf.train.Checkpoint(embedding=again), prefix, chunk_bytes=chunk
  )
  assert_same(values(again), saved)
  # Both go on training alike from the restored state.
  train(again, data[6:], "dense")
  train(memory, data[6:], "dense")
  assert_same(values(again), values(memory))


def test_a_directory_serves_one_table_at_a_time(tmp_path):
  make_embedding(tpe.SGD(0.1), tmp_path)
  with pytest.raises(ValueError, match="holds another disk-tiered table"):
    make_embedding(tpe.SGD(0.1), tmp_path)
  with pytest.raises(ValueError, match="is not local"):
    make_embedding(tpe.SGD(0.1), "gs://bucket/tables")


def test_dynamic_vocabularies_stay_in_memory(tmp_path):
  table = tpe.TableConfig(
    128, DIM, name="keys", vocabulary=tpe.DynamicVocabulary()
  )
  with pytest.raises(ValueError, match="'keys' has a DynamicVocabulary"):
    tpe.TPUEmbedding(
      tpe.FeatureConfig(table),
      tpe.SGD(0.1),
      row_sharding_threshold=PlacementPolicy(
        disk=DiskTier(str(tmp_path), 2**16, ("keys",))
      ),
    ).build(per_replica_batch_size=BATCH)


def test_the_keras_layer_trains_a_disk_table_and_saves_its_tier(tmp_path):
  """``layers.TPUEmbedding`` in ``model.fit``, a sequence feature
  included: the same tables as in memory; its config keeps the tier."""
  from tests.layers import builders
  from tpu_embedding.layers import TPUEmbedding
  from tpu_embedding.layers import serialization
  from tpu_embedding.layers.keras_compat import keras

  made = []
  for disk in (DiskTier(str(tmp_path), 38 * builders.DIM * 4 * 2, ("big",)),
               DiskTier()):  # fmt: skip
    big, small = builders.tables(big_optimizer=tpe.Adagrad(0.3))
    features = builders.mixed_features(big, small)
    layer = TPUEmbedding(
      features,
      tpe.Adam(0.1),
      row_sharding_threshold=PlacementPolicy(disk=disk),
    )
    model = builders.LinearModel(layer, builders.kernel_for(features))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    for seed in range(1, 4):
      ids, weights = builders.mixed_batch(seed)
      model.train_on_batch(
        builders.model_inputs(ids, weights), builders.labels(seed)
      )
    made.append(layer)
  tiered, memory = made
  assert tiered.mid_level_api.table_stores["big"].layout == "tiered"
  got = builders.full_values(tiered.mid_level_api.variables)
  want = builders.full_values(memory.mid_level_api.variables)
  assert_same(got, want)
  # (A layer made from the config would hold the same directory: refused
  # while this one lives, as two writers of one directory are.)
  saved = tiered.get_config()["row_sharding_threshold"]
  assert serialization.deserialize_row_threshold(saved).disk == DiskTier(
    str(tmp_path), 38 * builders.DIM * 4 * 2, ("big",)
  )


def _full_disk(monkeypatch):
  """The disk tier's writes fail as on a full disk (ENOSPC)."""

  def pwritev(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(os, "pwritev", pwritev)


def _step_ids(emb, ids):
  ids = tf.constant(ids, tf.int64)
  train(emb, [{"a": ids, "b": ids, "c": tf.zeros_like(ids)}], "dense")


def test_a_full_disk_mid_save_is_one_line_and_the_last_save_stays(
  tmp_path, monkeypatch
):
  emb = make_embedding(tpe.Adagrad(0.3), tmp_path / "disk")
  checkpoint = tf.train.Checkpoint(embedding=emb)
  train(emb, batches("dense", np.random.default_rng(2))[:3], "dense")
  base = tpe.checkpoints.write(checkpoint, str(tmp_path / "ckpt-1"))
  saved = values(emb)
  _step_ids(emb, np.arange(8))  # changed rows in the cache
  _full_disk(monkeypatch)
  with pytest.raises(DiskFullError) as raised:
    tpe.checkpoints.write_delta(checkpoint, str(tmp_path / "delta-2"))
  assert str(raised.value) == (
    f"Table 'big': the disk of its DiskTier directory {tmp_path / 'disk'} "
    "is full, its rows could not be written (free space there, or give "
    "the tables on disk another directory)."
  )
  assert not os.path.exists(tmp_path / "delta-2.index")
  memory = make_embedding(tpe.Adagrad(0.3))
  tpe.checkpoints.restore(tf.train.Checkpoint(embedding=memory), base)
  assert_same(values(memory), saved)
  # The files lack rows now: the table keeps refusing (resume from the
  # last save), never saves what it lost.
  monkeypatch.undo()
  with pytest.raises(DiskFullError):
    tpe.checkpoints.write(checkpoint, str(tmp_path / "ckpt-3"))


def test_step_failures_are_one_line_behind_tensorflows_error(
  tmp_path, monkeypatch
):
  """A cache too small and a full disk inside a step: TensorFlow's error
  carries them; ``tiered.own_error`` gives them back alone."""
  emb = make_embedding(tpe.SGD(0.1), tmp_path / "small", cache_rows=3)
  with pytest.raises(tf.errors.OpError) as raised:
    _step_ids(emb, np.arange(8))
  error = tiered.own_error(raised.value)
  assert isinstance(error, CacheTooSmallError)
  assert str(error).startswith(
    f"Table 'big' (DiskTier directory {tmp_path / 'small'}): a step asks "
    "for 8 distinct rows"
  )
  assert "\n" not in str(error)
  emb = make_embedding(tpe.SGD(0.1), tmp_path / "disk", cache_rows=32)
  _step_ids(emb, np.arange(8))  # rows 0-7 changed
  _full_disk(monkeypatch)
  with pytest.raises(tf.errors.OpError) as raised:
    for first in range(100, 164, 8):  # 0-7 evicted: their writes fail
      _step_ids(emb, np.arange(first, first + 8))
    _step_ids(emb, np.arange(8))  # read back: waits for those writes
  error = tiered.own_error(raised.value)
  assert isinstance(error, DiskFullError)
  assert str(error).startswith(
    f"Table 'big': the disk of its DiskTier directory {tmp_path / 'disk'} "
    "is full"
  )
  assert tiered.own_error(ValueError(str(error))) is None


def _fed(emb, data, warm_all=None):
  """``data`` through ``data.prefetch_rows`` (and, with ``warm_all``, a
  prefetch of every row of that store before each batch)."""

  def each():
    for batch in data:
      if warm_all is not None:
        warm_all.prefetch_rows(np.arange(-2, ROWS + 2))
      yield batch

  spec = tf.nest.map_structure(tf.type_spec_from_value, data[0])
  dataset = tf.data.Dataset.from_generator(each, output_signature=spec)
  return input_data.prefetch_rows(dataset, emb)


def test_prefetched_batches_train_as_in_memory(tmp_path):
  """Batches read ahead by ``data.prefetch_rows``, and every row (ids out
  of range too) prefetched before each step while a 32-row cache evicts,
  writes back and reads back rows: the numbers of the in-memory table,
  whose batches pass through the stage unchanged."""
  data = batches("dense", np.random.default_rng(5))
  want = make_embedding(tpe.Adagrad(0.3))
  fed = list(_fed(want, data))
  for got, batch in zip(fed, data, strict=True):
    assert_same(
      {k: v.numpy() for k, v in got.items()},
      {k: v.numpy() for k, v in batch.items()},
    )
  train(want, fed, "dense")
  got = make_embedding(tpe.Adagrad(0.3), tmp_path, 32)
  store = got.table_stores["big"]
  train(got, _fed(got, data, warm_all=store), "dense")
  assert store.cache.writes > 0 and store.cache.reads > 0
  assert_same(values(got), values(want))


@pytest.mark.parametrize("batches_ahead", [1, 2])
def test_batches_read_one_or_two_ahead_train_as_in_memory(
  batches_ahead, tmp_path
):
  """Read ahead one batch or two (rows two batches share read once; a
  batch's features of one table, "a" and "b", one read ahead): the rows
  come from RAM and the numbers are the in-memory table's; fewer than one
  batch ahead is refused in one line."""
  data = batches("dense", np.random.default_rng(6))
  want = make_embedding(tpe.Adagrad(0.3))
  train(want, data, "dense")
  got = make_embedding(tpe.Adagrad(0.3), tmp_path, 32)
  store, asked = got.table_stores["big"], []
  read_ahead = store.prefetch_rows
  store.prefetch_rows = lambda ids: asked.append(ids) or read_ahead(ids)
  spec = tf.nest.map_structure(tf.type_spec_from_value, data[0])
  dataset = tf.data.Dataset.from_generator(
    lambda: iter(data), output_signature=spec
  )
  train(
    got,
    input_data.prefetch_rows(dataset, got, batches_ahead=batches_ahead),
    "dense",
  )
  assert got.disk_tier_counts()["big"].rows_read_ahead > 0
  assert [ids.tolist() for ids in asked] == [
    np.concatenate([batch["a"], batch["b"]]).reshape(-1).tolist()
    for batch in data
  ]
  assert_same(values(got), values(want))
  with pytest.raises(
    ValueError, match="^batches_ahead must be at least 1, got 0.$"
  ):
    input_data.prefetch_rows(dataset, got, batches_ahead=0)
  renamed = dataset.map(lambda batch: {"z": batch["a"]})
  with pytest.raises(ValueError) as raised:
    input_data.prefetch_rows(renamed, got)
  assert str(raised.value) == (
    "prefetch_rows: the batches' features are not shaped like the "
    "embedding's feature_config (a, b, c; got z): pass features= picking the "
    "nest that enqueue takes."
  )


@pytest.mark.parametrize("cache_rows", [32, ROWS])
def test_a_prefetch_reads_ahead_the_rows_not_cached(cache_rows, tmp_path):
  """The rows of past steps, prefetched, then trained on again: the rows
  the cache (32 rows) lacks come from RAM, read ahead, none when it holds
  every row; the numbers stay the in-memory table's."""
  data = batches("dense", np.random.default_rng(5))
  want = make_embedding(tpe.Adagrad(0.3))
  emb = make_embedding(tpe.Adagrad(0.3), tmp_path, cache_rows)
  train(want, data, "dense")
  train(emb, data, "dense")
  store = emb.table_stores["big"]
  for batch in data[:1]:
    store.prefetch_rows(batch["a"])
    train(want, [batch], "dense")
    train(emb, [batch], "dense")
  taken = store.cache.staging.taken
  assert (taken > 0) == (cache_rows < ROWS), taken
  assert emb.disk_tier_counts()["big"].rows_read_ahead == taken
  assert_same(values(emb), values(want))
