"""Stacks of tables kept on disk (``DiskTier``), shared tables and
sequence features on disk.

A stack whose tables a ``DiskTier`` all names is one ``TieredTable`` (its
cache the members' caches together); the planner never stacks a table on
disk with one in memory. The oracle is the in-memory layout, stacked and
not: the same steps, tables and slots compared bit for bit. A disk
stack's checkpoints hold each member under its own key, streamed by parts
(never read whole), and move to and from the in-memory layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tpu_embedding.checkpointing import deltas as checkpoint_deltas
from tpu_embedding.planning import Planner
from tpu_embedding.resolved import resolve
from tpu_embedding.sharding import DiskTier
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.tables import tiered

OPTIMIZERS = {
  "sgd": lambda: tpe.SGD(0.2),
  "adagrad": lambda: tpe.Adagrad(0.3),
  "lazy_adam": lambda: tpe.Adam(0.1),
  "ftrl": lambda: tpe.FTRL(0.2, l1_regularization_strength=0.01),
}
ROWS = {"a": 300, "b": 200, "c": 7}
DIM, BATCH, STEPS, SEQUENCE = 4, 8, 10, 3
#: Rows of each disk table's cache (a stack of two: twice as many).
CACHE_ROWS = 64
STACK = [["a", "b"]]


def make_embedding(optimizer, directory=None, stacking=None):
  """Tables "a" (features "a1", "a2": shared), "b" (feature "b" and the
  sequence feature "s") and "c" (in memory); with ``directory``, "a" and
  "b" kept on disk."""
  tables = {
    name: tpe.TableConfig(
      rows,
      DIM,
      name=name,
      initializer=tf.random_uniform_initializer(seed=rows),
    )
    for name, rows in ROWS.items()
  }
  features = {
    "a1": tpe.FeatureConfig(tables["a"], name="a1"),
    "a2": tpe.FeatureConfig(tables["a"], name="a2"),
    "b": tpe.FeatureConfig(tables["b"], name="b"),
    "s": tpe.FeatureConfig(tables["b"], name="s", max_sequence_length=SEQUENCE),
    "c": tpe.FeatureConfig(tables["c"], name="c"),
  }
  policy = PlacementPolicy()
  if directory is not None:
    variables = 1 + len(optimizer.SLOT_NAMES)
    cache_bytes = CACHE_ROWS * DIM * 4 * variables
    policy = PlacementPolicy(
      disk=DiskTier(str(directory), cache_bytes, ("a", "b"))
    )
  emb = tpe.TPUEmbedding(
    features,
    optimizer,
    row_sharding_threshold=policy,
    table_stacking=stacking,
  )
  emb.build(per_replica_batch_size=BATCH)
  return emb


def batches(kind, seed=3, steps=STEPS):
  """``steps`` batches: "a1", "a2", "b" as ``kind`` says; "s" ragged ids
  up to one longer than the sequence; "c" one id a row."""
  rng = np.random.default_rng(seed)

  def ids(table, shape):
    return rng.zipf(1.3, size=shape) % ROWS[table]

  out = []
  for _ in range(steps):
    if kind == "dense":
      one = {f: tf.constant(ids(f[0], BATCH), tf.int64) for f in ("a1", "b")}
      one["a2"] = tf.constant(ids("a", BATCH), tf.int64)
    elif kind == "sparse":
      one = {}
      for name in ("a1", "a2", "b"):
        dense = ids(name[0], (BATCH, 2)) * (rng.random((BATCH, 2)) < 0.7)
        one[name] = tf.sparse.from_dense(tf.constant(dense, tf.int64))
    else:  # ragged, weighted
      one = {
        name: tf.ragged.constant(
          [list(ids(name[0], rng.integers(0, 4))) for _ in range(BATCH)],
          tf.int64,
          ragged_rank=1,
        )
        for name in ("a1", "a2", "b")
      }
    one["s"] = tf.ragged.constant(
      [list(ids("b", rng.integers(0, SEQUENCE + 2))) for _ in range(BATCH)],
      tf.int64,
      ragged_rank=1,
    )
    one["c"] = tf.constant(rng.integers(0, ROWS["c"], BATCH), tf.int64)
    out.append(one)
  return out


def weights_of(kind, batch):
  if kind != "weighted":
    return None
  return {
    name: (
      None
      if name in ("s", "c")
      else tf.ones_like(batch[name], tf.float32) * (0.5 + len(name))
    )
    for name in batch
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


def disk_stack(emb):
  """The disk stack's store, checked to be one tiered store of "a", "b"."""
  assert sorted(emb.backend.stores) == ["c", "stack_a_b"]
  store = emb.backend.stores["stack_a_b"]
  assert store.layout == "tiered"
  assert [emb.table_stores[n].layout for n in "abc"] == [
    "tiered",
    "tiered",
    "whole",
  ]
  assert store.cache.size == 2 * CACHE_ROWS  # the members' caches
  return store


CASES = [(optimizer, "ragged") for optimizer in sorted(OPTIMIZERS)] + [
  ("adagrad", kind) for kind in ("dense", "sparse", "weighted")
]


#: Optimizers whose in-memory stack equals the unstacked tables bit for
#: bit (lazy Adam's stacked and unstacked rows differ in the last bit, in
#: memory as on disk: the disk stack is held to the in-memory stack).
STACKS_EXACTLY = ("sgd", "adagrad", "ftrl")


@pytest.mark.parametrize("optimizer, kind", CASES)
def test_a_stack_on_disk_trains_as_the_stack_in_memory(
  optimizer, kind, tmp_path
):
  """Rows evicted, written back and read back; the tables and slots equal
  the in-memory stack's (and the unstacked tables')."""
  data = batches(kind)
  made = {}
  for name, directory, stacking in [
    ("memory", None, None),
    ("memory stack", None, STACK),
    ("disk stack", tmp_path, STACK),
  ]:
    if name == "memory" and optimizer not in STACKS_EXACTLY:
      continue
    made[name] = make_embedding(OPTIMIZERS[optimizer](), directory, stacking)
    train(made[name], data, kind)
  store = disk_stack(made["disk stack"])
  assert store.cache.writes > 0 and store.cache.reads > 0
  want = values(made["memory stack"])
  assert_same(values(made["disk stack"]), want)
  if "memory" in made:
    assert_same(values(made["memory"]), want)


@pytest.mark.parametrize("stacking", [None, STACK], ids=["alone", "stacked"])
def test_shared_tables_and_sequence_features_on_disk(stacking, tmp_path):
  """Two features of table "a" and a sequence feature of "b" (and the
  in-memory stack too): each table on disk alone, or stacked."""
  data = batches("ragged", seed=5)
  made = {}
  for name, directory, stacks in [
    ("memory", None, None),
    ("memory stack", None, STACK),
    ("disk", tmp_path, stacking),
  ]:
    made[name] = make_embedding(tpe.Adagrad(0.3), directory, stacks)
    train(made[name], data, "ragged")
  layouts = {n: made["disk"].table_stores[n].layout for n in "abc"}
  assert layouts == {"a": "tiered", "b": "tiered", "c": "whole"}
  stores = ["a", "b", "c"] if stacking is None else ["c", "stack_a_b"]
  assert sorted(made["disk"].backend.stores) == stores
  want = values(made["memory"])
  assert_same(values(made["memory stack"]), want)
  assert_same(values(made["disk"]), want)


def never_whole(monkeypatch):
  """A disk table's variables can no longer be read whole."""

  def read_value(self):
    raise AssertionError(f"{self.name} read whole")

  monkeypatch.setattr(tiered._TieredVariable, "read_value", read_value)


def test_a_disk_stack_checkpoints_each_table_by_parts(tmp_path, monkeypatch):
  """``tpe.checkpoints.write`` / ``restore`` stream each member of the
  disk stack under its own key, in chunks of 3 rows, never whole; the
  values move to the unstacked in-memory tables and back to a fresh disk
  stack, and all go on training alike."""
  data = batches("ragged", seed=4)
  stacked = make_embedding(tpe.Adagrad(0.3), tmp_path / "disk", STACK)
  train(stacked, data[:5], "ragged")
  saved = values(stacked)
  chunk = 3 * DIM * 4
  prefix = str(tmp_path / "ckpt")
  with monkeypatch.context() as patch:
    never_whole(patch)
    tpe.checkpoints.write(
      tf.train.Checkpoint(embedding=stacked), prefix, chunk_bytes=chunk
    )
  listed = dict(tf.train.list_variables(prefix))
  for name in "ab":
    for key in ("/", ".Saccumulators/"):  # (TensorFlow's "/": ".S")
      shape = listed[f"embedding/{name}{key}.ATTRIBUTES/VARIABLE_VALUE"]
      assert shape == [ROWS[name], DIM]
  assert not [name for name in listed if "stack" in name]
  memory = make_embedding(tpe.Adagrad(0.3))
  tpe.checkpoints.restore(tf.train.Checkpoint(embedding=memory), prefix)
  assert_same(values(memory), saved)
  again = make_embedding(tpe.Adagrad(0.3), tmp_path / "disk2", STACK)
  with monkeypatch.context() as patch:
    never_whole(patch)
    tpe.checkpoints.restore(
      tf.train.Checkpoint(embedding=again), prefix, chunk_bytes=chunk
    )
  assert_same(values(again), saved)
  train(again, data[5:], "ragged")
  train(memory, data[5:], "ragged")
  train(stacked, data[5:], "ragged")
  assert_same(values(again), values(memory))
  assert_same(values(stacked), values(memory))


def test_plain_checkpoints_move_between_a_disk_stack_and_memory(tmp_path):
  """``tf.train.Checkpoint`` reads and writes the members whole, from the
  disk stack to the in-memory stack and from unstacked tables to the disk
  stack."""
  data = batches("dense", seed=6)
  stacked = make_embedding(tpe.SGD(0.2), tmp_path / "disk", STACK)
  train(stacked, data, "dense")
  path = tf.train.Checkpoint(embedding=stacked).save(str(tmp_path / "a"))
  memory = make_embedding(tpe.SGD(0.2), stacking=STACK)
  tf.train.Checkpoint(embedding=memory).restore(path).assert_consumed()
  assert_same(values(memory), values(stacked))
  alone = make_embedding(tpe.SGD(0.2))
  train(alone, batches("dense", seed=7), "dense")
  path = tf.train.Checkpoint(embedding=alone).save(str(tmp_path / "b"))
  again = make_embedding(tpe.SGD(0.2), tmp_path / "disk2", STACK)
  tf.train.Checkpoint(embedding=again).restore(path).assert_consumed()
  assert_same(values(again), values(alone))


def test_deltas_of_a_disk_stack_restore_into_either_layout(tmp_path):
  """A full save, then deltas: each member's rows, read from the stack's
  files; the chain restores the live state into the unstacked tables in
  memory and into a fresh disk stack."""
  data = batches("ragged", seed=8, steps=6)
  stacked = make_embedding(tpe.Adagrad(0.3), tmp_path / "disk", STACK)
  checkpoint = tf.train.Checkpoint(embedding=stacked)
  saves = [tpe.checkpoints.write(checkpoint, str(tmp_path / "ckpt-0"))]
  for number in (1, 2, 3):
    train(stacked, data[2 * number - 2 : 2 * number], "ragged")
    delta = str(tmp_path / f"delta-{number}")
    saves.append(tpe.checkpoints.write_delta(checkpoint, delta))
  assert disk_stack(stacked).cache.writes > 0
  b = "embedding/b/.ATTRIBUTES/VARIABLE_VALUE"
  ids, _ = checkpoint_deltas.read_rows(saves[-1], b)
  assert 0 < ids.size < ROWS["b"] and ids.max() < ROWS["b"]
  live = values(stacked)
  for directory, stacking in [(None, None), (tmp_path / "again", STACK)]:
    emb = make_embedding(tpe.Adagrad(0.3), directory, stacking)
    tpe.checkpoints.restore(
      tf.train.Checkpoint(embedding=emb), saves[0], deltas=saves[1:]
    )
    assert_same(values(emb), live)


def resolved_tables():
  """Tables "a" to "d", alike (they stack)."""
  features = [
    tpe.FeatureConfig(tpe.TableConfig(10, DIM, name=n)) for n in "abcd"
  ]
  return resolve(features, tpe.SGD(0.1)).tables


def test_auto_stacking_keeps_tables_on_disk_with_tables_on_disk(tmp_path):
  policy = PlacementPolicy(disk=DiskTier(str(tmp_path), 2**16, ("a", "c")))
  planned = Planner(auto_stacks=True).plan(resolved_tables(), policy, "auto")
  assert [s.names for s in planned.stacks] == [("a", "c"), ("b", "d")]


def test_a_stack_of_disk_and_memory_tables_is_refused(tmp_path):
  """One line naming both tables; a DiskTier naming no table too."""
  policy = PlacementPolicy(disk=DiskTier(str(tmp_path), 2**16, ("a",)))
  with pytest.raises(ValueError) as raised:
    Planner().plan(resolved_tables(), policy, [["a", "b"]])
  assert str(raised.value) == (
    "table_stacking: table 'b' cannot be stacked with 'a': it is whole, "
    "not on disk (DiskTier)."
  )
  features = [tpe.FeatureConfig(tpe.TableConfig(10, DIM, name="a"))]
  with pytest.raises(ValueError, match="^DiskTier names table 'z', which"):
    tpe.TPUEmbedding(
      features,
      tpe.SGD(0.1),
      row_sharding_threshold=PlacementPolicy(
        disk=DiskTier(str(tmp_path), 2**16, ("z",))
      ),
    )
