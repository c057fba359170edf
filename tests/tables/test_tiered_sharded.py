"""Disk-tiered tables row-sharded over 2 replicas (``TieredShardedTable``).

The oracle is the in-memory layout under the same strategy (and on one
device): the same embedding, the same steps, tables and slots compared
bit for bit, one-hot and multi-hot inputs, pipelined or not, with caches
that evict every step. Each replica's rows live in files of their own;
checkpoints stream to and from the in-memory layouts.
"""

from __future__ import annotations

import os
import pathlib
import time

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy
from tests.distributed import cluster
from tpu_embedding import data as input_data
from tpu_embedding.sharding import DiskTier
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.tables import row_files
from tpu_embedding.tables.row_cache import CacheTooSmallError
from tpu_embedding.tables.row_cache import RowCache

OPTIMIZERS = {
  "sgd": lambda: tpe.SGD(0.2),
  "adagrad": lambda: tpe.Adagrad(0.3),
  "lazy_adam": lambda: tpe.Adam(0.1),
}
ROWS, DIM, BATCH, STEPS, REPLICAS = 300, 4, 8, 10, 2
FLOAT32 = tpe.RowStorage()
SPREAD = np.random.default_rng(0).permutation(ROWS)
MWMS_SCRIPT = (
  pathlib.Path(__file__).parents[1] / "distributed" / "mwms_tiered.py"
)


def make_embedding(
  optimizer,
  strategy=None,
  directory=None,
  cache_rows=30,
  pipeline=False,
  features="abc",
  storage=FLOAT32,
):
  """Table "big" (features "a" and "b": a shared table) and "small" ("c"),
  stored as ``storage`` says; with ``directory``, "big" kept on disk with
  ``cache_rows`` rows per replica."""
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
  tables = {"a": big, "b": big, "c": small}
  configs = {f: tpe.FeatureConfig(tables[f], name=f) for f in features}
  disk = DiskTier()
  if directory is not None:
    # A row and its slots as stored, and a 16-bit cache's slot map entry.
    row_bytes = DIM * (
      storage.parameter_dtype.size
      + len(optimizer.SLOT_NAMES) * storage.slot_dtype.size
    ) + (0 if storage.is_float32 else 8)
    disk = DiskTier(str(directory), cache_rows * row_bytes, ("big",))
  with (strategy or tf.distribute.get_strategy()).scope():
    emb = tpe.TPUEmbedding(
      configs,
      optimizer,
      row_sharding_threshold=PlacementPolicy(100, disk=disk),
      pipeline_execution_with_tensor_core=pipeline,
    )
  emb.build(per_replica_batch_size=BATCH if strategy else REPLICAS * BATCH)
  return emb


def batches(kind, rng, steps=STEPS):
  """Global batches (``REPLICAS * BATCH`` rows) of "a", "b", "c"."""
  out = []
  for _ in range(steps):
    # Hot ids spread over both replicas' rows.
    hot = SPREAD[rng.zipf(1.3, size=(REPLICAS * BATCH, 3)) % ROWS]
    if kind == "dense":
      a = tf.constant(hot[:, 0], tf.int64)
      b = tf.constant(hot[:, 1], tf.int64)
    else:  # ragged: multi-hot, empty rows included
      a = tf.ragged.constant(
        [list(r[: i % 4]) for i, r in enumerate(hot)], tf.int64
      )
      b = tf.ragged.constant([[x] for x in hot[:, 2]], tf.int64)
    c = tf.constant(rng.integers(0, 7, REPLICAS * BATCH), tf.int64)
    out.append({"a": a, "b": b, "c": c})
  return out


def loss(activations):
  return sum(tf.reduce_sum(x * x) for x in tf.nest.flatten(activations))


def train(emb, data, strategy=None):
  """Each batch a step: on one device whole, else a slice per replica."""
  if strategy is None:

    @tf.function
    def step(features):
      emb.enqueue(features)
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        value = loss(activations)
      emb.apply_gradients(tape.gradient(value, activations))

    for batch in data:
      step(batch)
    emb.flush_pipeline()
    return

  step = replica_step(emb, strategy)

  @tf.function
  def sharded_step(features):
    step(
      strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.nest.map_structure(
          lambda t: t[ctx.replica_id_in_sync_group * BATCH :][:BATCH],
          features,
        )
      )
    )

  for batch in data:
    sharded_step(batch)
  strategy.run(tf.function(emb.flush_pipeline))


def replica_step(emb, strategy):
  """A step on per-replica ``features``: each replica its slice's loss."""

  def step(features):
    emb.enqueue(features)

    def replica_fn():
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        value = loss(activations)
      emb.apply_gradients(tape.gradient(value, activations))

    strategy.run(replica_fn)

  return step


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


def check_tiers(emb, steps=STEPS):
  """Each replica's block evicted, wrote back and read back rows, and
  cached each step's rows at once (what every replica asked of it)."""
  store = emb.table_stores["big"]
  assert store.layout == "tiered_row_sharded"
  for block in range(REPLICAS):
    cache = store.tier(block).cache
    assert cache.writes > 0 and cache.reads > 0, block
    assert cache.step == steps, block


@pytest.mark.parametrize(
  "optimizer, kind, pipeline",
  [
    ("sgd", "dense", False),
    ("sgd", "ragged", True),
    ("adagrad", "dense", True),
    ("adagrad", "ragged", False),
    ("lazy_adam", "ragged", False),
  ],
)
def test_training_equals_the_in_memory_row_sharded_table(
  optimizer, kind, pipeline, tmp_path
):
  """30 cached rows per replica over 150: steps evict, write back and
  read back (the cache keeps this step's rows and the step before's)."""
  strategy = mirrored_strategy(REPLICAS)
  data = batches(kind, np.random.default_rng(3))
  made = {}
  for directory in (None, tmp_path):
    made[directory] = make_embedding(
      OPTIMIZERS[optimizer](), strategy, directory, 30, pipeline
    )
    train(made[directory], data, strategy)
  want, got = made[None], made[tmp_path]
  assert want.table_stores["big"].layout == "row_sharded"
  check_tiers(got)
  assert_same(values(got), values(want))


@pytest.mark.parametrize(
  "optimizer, storage, pipeline",
  [
    ("adagrad", tpe.RowStorage("bfloat16", "bfloat16", seed=3), True),
    ("lazy_adam", tpe.RowStorage("float16", seed=5), False),
  ],
)
def test_16_bit_blocks_on_disk_equal_the_in_memory_blocks(
  optimizer, storage, pipeline, tmp_path
):
  """Each replica's 16-bit block on disk rounds by global row (its cache's
  slots mapped), as the in-memory blocks do."""
  strategy = mirrored_strategy(REPLICAS)
  data = batches("ragged", np.random.default_rng(8))
  made = {}
  for directory in (None, tmp_path):
    made[directory] = make_embedding(
      OPTIMIZERS[optimizer](), strategy, directory, 30, pipeline, "abc", storage
    )
    train(made[directory], data, strategy)
  want, got = made[None], made[tmp_path]
  check_tiers(got)
  assert got.table_stores["big"].tier(1).cache.size == 30

  def f64(emb):
    return {k: v.astype(np.float64) for k, v in values(emb).items()}

  assert_same(f64(got), f64(want))
  # The in-memory blocks' checkpoint (16 bits) restored into new disk
  # blocks, with the update count: one more step alike.
  path = tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=want), str(tmp_path / "c")
  )
  resumed = make_embedding(
    OPTIMIZERS[optimizer](),
    strategy,
    tmp_path / "resumed",
    30,
    pipeline,
    "abc",
    storage,
  )
  tpe.checkpoints.restore(tf.train.Checkpoint(embedding=resumed), path)
  assert resumed.table_stores["big"].update_count() == STEPS
  assert_same(f64(resumed), f64(want))
  more = batches("ragged", np.random.default_rng(9), steps=2)
  train(want, more, strategy)
  train(resumed, more, strategy)
  assert_same(f64(resumed), f64(want))


def test_a_prefetch_reads_each_blocks_rows_ahead(tmp_path):
  """Global ids prefetched on a row-sharded disk table: each block reads
  ahead the rows it holds and does not cache (from RAM at the next step,
  on both replicas), and the numbers stay the in-memory blocks'."""
  strategy = mirrored_strategy(REPLICAS)
  data = batches("dense", np.random.default_rng(3))
  want = make_embedding(tpe.Adagrad(0.3), strategy)
  got = make_embedding(tpe.Adagrad(0.3), strategy, tmp_path, 30)
  store = got.table_stores["big"]
  assert store.reads_ahead and not want.table_stores["big"].reads_ahead
  for emb in (want, got):
    train(emb, data, strategy)
  batch = data[0]
  store.prefetch_rows(np.concatenate([batch["a"], batch["b"], [-1, ROWS]]))
  for emb in (want, got):
    train(emb, [batch], strategy)
  taken = [store.tier(b).cache.staging.taken for b in range(REPLICAS)]
  assert all(t > 0 for t in taken), taken
  assert_same(values(got), values(want))


def test_per_replica_batches_read_ahead_for_both_blocks(tmp_path):
  """Per-replica batches (``distribute_datasets_from_function``) through
  ``data.prefetch_rows``: each batch's rows go to the blocks holding
  them, one set a batch and table (its features' ids together), and each
  block keeps the sets of the batches the pipeline holds ahead: two
  replicas' batches a step, four steps (its prefetch and the distributed
  iterator's). Each step waits for the pipeline to fill, so that it runs
  with the most sets outstanding, on a busy machine too. With 4 sets, 13 %
  of the rows read came from RAM; with 8, 43-48 % (with 30 cached rows,
  many misses are rows cached when read ahead and evicted before their
  step, or whose write-back is in flight). The numbers are the in-memory
  blocks'."""
  strategy = mirrored_strategy(REPLICAS)
  data = batches("dense", np.random.default_rng(4))
  want = make_embedding(tpe.Adagrad(0.3), strategy)
  train(want, data, strategy)
  got = make_embedding(tpe.Adagrad(0.3), strategy, tmp_path, 30)
  slices = [
    {k: v[r * BATCH :][:BATCH] for k, v in batch.items()}
    for batch in data
    for r in range(REPLICAS)
  ]  # (the replicas take a step's batches in turn)
  spec = tf.nest.map_structure(tf.type_spec_from_value, slices[0])

  def dataset_fn(context):
    dataset = tf.data.Dataset.from_generator(
      lambda: iter(slices), output_signature=spec
    )
    return input_data.prefetch_rows(dataset, got)

  store = got.table_stores["big"]
  staged = []
  read_ahead = store.prefetch_rows

  def counted(ids):
    read_ahead(ids)
    staged.append(ids)

  store.prefetch_rows = counted  # (counts the batches staged)

  def when_full():
    """Waits until the input pipeline stages no more batches: every step
    then runs with as many batches read ahead as the pipeline holds (the
    most sets a block keeps at once), whatever the machine's load."""
    seen, deadline = -1, time.monotonic() + 20
    while len(staged) != seen and time.monotonic() < deadline:
      seen = len(staged)
      time.sleep(0.25)

  step = tf.function(replica_step(got, strategy))
  for features in strategy.distribute_datasets_from_function(dataset_fn):
    when_full()
    step(features)
  strategy.run(tf.function(got.flush_pipeline))
  assert_same(values(got), values(want))
  for block in range(REPLICAS):
    counts = store.tier(block).cache.counts()
    assert counts.read_ahead_rate > 0.3, (block, counts)


def test_one_feature_equals_one_device(tmp_path):
  """Each table's ids from one feature: the in-memory row-sharded layout
  equals one device bit for bit (``exchanges.py``), and so does the
  disk-tiered one."""
  strategy = mirrored_strategy(REPLICAS)
  data = [
    {"a": batch["a"], "c": batch["c"]}
    for batch in batches("ragged", np.random.default_rng(11))
  ]
  want = make_embedding(tpe.Adagrad(0.3), features="ac")
  train(want, data)
  got = make_embedding(tpe.Adagrad(0.3), strategy, tmp_path, 20, features="ac")
  train(got, data, strategy)
  check_tiers(got)
  assert_same(values(got), values(want))


def test_each_replica_has_its_own_files(tmp_path):
  """``directory/big/block<r>``: each replica's rows only."""
  strategy = mirrored_strategy(REPLICAS)
  emb = make_embedding(tpe.Adagrad(0.3), strategy, tmp_path)
  train(emb, batches("dense", np.random.default_rng(5), steps=2), strategy)
  placement = emb.sharding_plan.placements["big"]
  for replica in range(REPLICAS):
    block = tmp_path / "big" / f"block{replica}"
    # One record per row (parameters and accumulators, its row id) in
    # segments of SEGMENT_RECORDS records: the block's rows fill one.
    assert placement.shard_sizes[replica] < row_files.SEGMENT_RECORDS
    size = os.path.getsize(block / "rows.records")
    assert size == row_files.SEGMENT_RECORDS * (DIM * 4 * 2 + 8)
    assert (
      emb.table_stores["big"].tier(replica).cache.files.rows
      == (placement.shard_sizes[replica])
    )


def test_checkpoints_stream_between_layouts(tmp_path):
  """``tpe.checkpoints.write`` / ``restore`` stream the blocks in chunks
  (3 rows each), into the in-memory layouts (row-sharded and one device)
  and from them; all then train alike."""
  strategy = mirrored_strategy(REPLICAS)
  data = batches("ragged", np.random.default_rng(4))
  tiered = make_embedding(tpe.Adagrad(0.3), strategy, tmp_path / "disk")
  train(tiered, data[:5], strategy)
  saved = values(tiered)
  chunk = 3 * DIM * 4
  prefix = str(tmp_path / "ckpt")
  tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=tiered), prefix, chunk_bytes=chunk
  )
  keys = dict(tf.train.list_variables(prefix))
  assert keys["embedding/big/.ATTRIBUTES/VARIABLE_VALUE"] == [ROWS, DIM]
  memory = make_embedding(tpe.Adagrad(0.3), strategy)
  tpe.checkpoints.restore(tf.train.Checkpoint(embedding=memory), prefix)
  assert_same(values(memory), saved)
  single = make_embedding(tpe.Adagrad(0.3))
  tpe.checkpoints.restore(tf.train.Checkpoint(embedding=single), prefix)
  assert_same(values(single), saved)
  # ... and back: a fresh disk table from the in-memory one's checkpoint.
  back = str(tmp_path / "memory")
  tpe.checkpoints.write(tf.train.Checkpoint(embedding=memory), back)
  again = make_embedding(tpe.Adagrad(0.3), strategy, tmp_path / "disk2")
  tpe.checkpoints.restore(
    tf.train.Checkpoint(embedding=again), back, chunk_bytes=chunk
  )
  assert_same(values(again), saved)
  train(again, data[5:], strategy)
  train(memory, data[5:], strategy)
  assert_same(values(again), values(memory))
  # A plain tf.train.Checkpoint reads and writes it whole.
  path = tf.train.Checkpoint(embedding=again).save(str(tmp_path / "plain"))
  third = make_embedding(tpe.Adagrad(0.3), strategy, tmp_path / "disk3")
  tf.train.Checkpoint(embedding=third).restore(path).assert_consumed()
  assert_same(values(third), values(memory))


def test_a_cache_slot_is_never_given_twice(tmp_path):
  """A step needing more free slots than there are is refused, even when
  a second sweep of the clock would find the same free slots again."""
  cache = RowCache(
    str(tmp_path),
    rows=100,
    dim=2,
    slots=4,
    keys=("parameters",),
    grid=10,
    initial=lambda key, first, count: np.zeros([count, 2], np.float32),
  )
  cache.admit(np.array([0, 1]))
  with pytest.raises(CacheTooSmallError):
    cache.admit(np.array([2, 3, 4]))


def test_two_workers_train_and_checkpoint_like_memory(tmp_path):
  """2-process MultiWorkerMirroredStrategy (tests/distributed/
  mwms_tiered.py): each worker's block in its own files, the same tables
  and slots as in memory; checkpoints to memory, and 1 -> 2 workers."""
  one = make_embedding(tpe.Adagrad(0.3))
  train(one, batches("dense", np.random.default_rng(8), steps=2))
  tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=one), str(tmp_path / "one")
  )
  np.savez(
    tmp_path / "one.npz", **{":".join(key): v for key, v in values(one).items()}
  )
  workers = cluster.run_workers([MWMS_SCRIPT, tmp_path], timeout=240)
  assert all(
    w.returncode == 0 and w.stdout.strip().endswith("OK") for w in workers
  ), "\n=== next worker\n".join(
    w.stdout[-2000:] + w.stderr[-5000:] for w in workers
  )


def test_deltas_of_row_sharded_disk_tables_equal_the_in_memory_ones(tmp_path):
  """Delta checkpoints of a disk table's replica blocks: the same changed
  rows and values as the in-memory row-sharded table's (each block's rows
  read from its files at their global ids), and the chain restores into
  a fresh disk table and into memory, bit for bit."""
  from tpu_embedding.checkpointing import deltas

  strategy = mirrored_strategy(REPLICAS)
  data = batches("ragged", np.random.default_rng(5))[:6]
  chains = {}
  for name, directory in (("memory", None), ("disk", tmp_path / "disk")):
    emb = make_embedding(tpe.Adagrad(0.3), strategy, directory)
    checkpoint = tf.train.Checkpoint(embedding=emb)
    saves = [tpe.checkpoints.write(checkpoint, str(tmp_path / name / "c0"))]
    for number in (1, 2, 3):
      train(emb, data[2 * number - 2 : 2 * number], strategy)
      saves.append(
        tpe.checkpoints.write_delta(
          checkpoint, str(tmp_path / name / f"d{number}")
        )
      )
    chains[name] = (emb, saves)
  (disk, got), (memory, want) = chains["disk"], chains["memory"]
  check_tiers(disk, steps=6)
  live = values(memory)
  assert_same(values(disk), live)
  key = "embedding/big/.ATTRIBUTES/VARIABLE_VALUE"
  for delta, oracle in zip(got[1:], want[1:], strict=True):
    ids, rows = deltas.read_rows(delta, key)
    want_ids, want_rows = deltas.read_rows(oracle, key)
    assert 0 < ids.size < ROWS
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(rows, want_rows)
  for directory in (tmp_path / "disk2", None):
    fresh = make_embedding(tpe.Adagrad(0.3), strategy, directory)
    tpe.checkpoints.restore(
      tf.train.Checkpoint(embedding=fresh), got[0], deltas=got[1:]
    )
    assert_same(values(fresh), live)


def test_a_stack_on_disk_is_refused_where_replicas_share_rows(tmp_path):
  """Stacks of disk tables train on one device; under MirroredStrategy an
  explicit stack holding one is refused in one line naming the tables."""
  strategy = mirrored_strategy(REPLICAS)
  tables = [tpe.TableConfig(ROWS, DIM, name=name) for name in ("big", "other")]
  configs = {t.name: tpe.FeatureConfig(t, name=t.name) for t in tables}
  with strategy.scope(), pytest.raises(ValueError) as raised:
    tpe.TPUEmbedding(
      configs,
      tpe.SGD(0.1),
      row_sharding_threshold=PlacementPolicy(
        100, disk=DiskTier(str(tmp_path), 2**20, ("big", "other"))
      ),
      table_stacking=[["big", "other"]],
    )
  message = str(raised.value)
  assert "\n" not in message
  assert "['big', 'other'] are stacked and kept on disk" in message
  assert "MirroredStrategy" in message
  assert not os.listdir(tmp_path)


def test_a_block_cache_too_small_names_the_table_and_its_directory(tmp_path):
  """A replica block's cache too small for a step: one line naming the
  table (not the block's folder) and the DiskTier directory."""
  from tpu_embedding.tables import tiered

  strategy = mirrored_strategy(REPLICAS)
  emb = make_embedding(tpe.SGD(0.1), strategy, tmp_path, cache_rows=2)
  with pytest.raises(Exception) as raised:
    train(emb, batches("dense", np.random.default_rng(6), steps=1), strategy)
  error = tiered.own_error(raised.value)
  assert isinstance(error, CacheTooSmallError), raised.value
  message = str(error)
  assert "\n" not in message
  assert message.startswith(
    f"Table 'big' (DiskTier directory {os.path.realpath(tmp_path)}): "
  ), message
