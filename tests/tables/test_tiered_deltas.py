"""Delta checkpoints of tables kept on disk (``DiskTier``).

A tiered table keeps one bit per row on the host, set by every update
(``RowCache.slots_of``) and by every write of rows (a restore, a
delta's rows), cleared by a save. The oracle is the in-memory layout:
the same steps give the same deltas (ids and values) and the same
restored state, whichever layout the chain is restored into; a row
changed, evicted and changed again is in the next delta, a row evicted
unchanged is not.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tpu_embedding as tpe
from tests.tables.test_tiered import DIM
from tests.tables.test_tiered import ROWS
from tests.tables.test_tiered import assert_same
from tests.tables.test_tiered import batches
from tests.tables.test_tiered import make_embedding
from tests.tables.test_tiered import train
from tests.tables.test_tiered import values
from tpu_embedding.checkpointing import deltas as checkpoint_deltas

BIG = "embedding/big/.ATTRIBUTES/VARIABLE_VALUE"


def _chain(emb, directory, data):
  """A full save, then a delta after each two batches of ``data``."""
  checkpoint = tf.train.Checkpoint(embedding=emb)
  saves = [tpe.checkpoints.write(checkpoint, str(directory / "ckpt-0"))]
  for number, first in enumerate(range(0, len(data), 2), 1):
    train(emb, data[first : first + 2], "ragged")
    saves.append(
      tpe.checkpoints.write_delta(
        checkpoint, str(directory / f"delta-{number}")
      )
    )
  return saves


def _restored(saves, directory=None):
  emb = make_embedding(tpe.Adagrad(0.3), directory)
  tpe.checkpoints.restore(
    tf.train.Checkpoint(embedding=emb), saves[0], deltas=saves[1:]
  )
  return values(emb)


def test_deltas_of_a_disk_table_equal_the_in_memory_ones(tmp_path):
  """A 32-row cache over 300 rows (steps evict and read back): the
  deltas hold the rows and values the in-memory run's hold, and restore
  into either layout the live state, bit for bit."""
  data = batches("ragged", np.random.default_rng(11))[:6]
  tiered = make_embedding(tpe.Adagrad(0.3), tmp_path / "disk", cache_rows=32)
  memory = make_embedding(tpe.Adagrad(0.3))
  got = _chain(tiered, tmp_path / "tiered", data)
  want = _chain(memory, tmp_path / "memory", data)
  assert tiered.table_stores["big"].cache.writes > 0  # rows were evicted
  live = values(tiered)
  assert_same(live, values(memory))
  for delta, oracle in zip(got[1:], want[1:], strict=True):
    ids, rows = checkpoint_deltas.read_rows(delta, BIG)
    want_ids, want_rows = checkpoint_deltas.read_rows(oracle, BIG)
    assert 0 < ids.size < ROWS
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(rows, want_rows)
  assert_same(_restored(got), live)
  assert_same(_restored(got, tmp_path / "again"), live)


def _step(emb, ids):
  ids = tf.constant(ids, tf.int64)
  small = tf.zeros_like(ids)
  train(emb, [{"a": ids, "b": ids, "c": small}], "dense")


def test_a_row_changed_evicted_and_changed_again_is_in_the_delta(tmp_path):
  emb = make_embedding(tpe.SGD(0.1), tmp_path / "disk", cache_rows=32)
  store = emb.table_stores["big"]
  checkpoint = tf.train.Checkpoint(embedding=emb)
  saves = [tpe.checkpoints.write(checkpoint, str(tmp_path / "ckpt-0"))]
  assert store.changed_rows().numpy().tolist() == []
  _step(emb, [5, 6] * 4)
  assert store.changed_rows().numpy().tolist() == [5, 6]
  saves.append(tpe.checkpoints.write_delta(checkpoint, str(tmp_path / "d1")))
  assert store.changed_rows().numpy().tolist() == []  # cleared by the save
  for first in range(100, 164, 8):  # fresh rows evict 5 and 6
    _step(emb, np.arange(first, first + 8))
  assert not {5, 6} & set(store.cache.row_of_slot.tolist())
  _step(emb, [5] * 8)  # read back from the files, changed again
  changed = store.changed_rows().numpy().tolist()
  assert changed == [5, *range(100, 164)]  # not 6: evicted unchanged
  saves.append(tpe.checkpoints.write_delta(checkpoint, str(tmp_path / "d2")))
  ids, _ = checkpoint_deltas.read_rows(saves[-1], BIG)
  assert ids.tolist() == changed
  empty = tpe.checkpoints.write_delta(checkpoint, str(tmp_path / "d3"))
  assert checkpoint_deltas.read_meta(empty)["rows"] == 0
  memory = make_embedding(tpe.SGD(0.1))
  tpe.checkpoints.restore(
    tf.train.Checkpoint(embedding=memory), saves[0], deltas=saves[1:]
  )
  assert_same(values(memory), values(emb))


def test_written_rows_count_as_changed(tmp_path):
  """A delta's rows written into a disk table, and a whole value, are
  changes of their own (the next delta holds them)."""
  emb = make_embedding(tpe.SGD(0.1), tmp_path / "disk")
  store = emb.table_stores["big"]
  _step(emb, [7] * 8)  # row 7 cached and changed
  store.clear_changes()
  store.write_rows_at(tf.constant([7, 250], tf.int64), tf.ones([2, DIM]))
  assert store.changed_rows().numpy().tolist() == [7, 250]
  np.testing.assert_array_equal(
    store.read_rows(tf.constant([250, 7], tf.int64)), np.ones([2, DIM])
  )
  _step(emb, [7] * 8)  # the cache reads the written row back
  assert store.read().numpy()[7, 0] != 1.0
  store.clear_changes()
  store.assign(tf.zeros([ROWS, DIM]))
  assert store.changed_rows().numpy().tolist() == list(range(ROWS))
