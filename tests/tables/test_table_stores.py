"""Every table layout behind the one ``TableStore`` interface.

Each layout is checked the same way against plain numpy: rows gathered in
id order, whole reads and writes, a row update by global ids (SGD with
lr 1, so ``w -= g``), bytes per device, and checkpoint keys holding the
full ``[vocabulary_size, dim]`` value.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy
from tpu_embedding.gradients import RowGradients

ROWS, DIM = 11, 3

#: ``layout name: (replicas, row_sharding_threshold)``.
LAYOUTS = {
  "whole": (1, 0),
  "row_sharded": (2, 0),
  "replicated": (2, 1000),
}


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request):
  """``(layout name, store, embedding, initial values)``."""
  replicas, threshold = LAYOUTS[request.param]
  values = np.random.default_rng(3).normal(size=(ROWS, DIM))
  values = values.astype(np.float32)
  table = tpe.TableConfig(
    ROWS, DIM, name="t", initializer=tf.constant_initializer(values)
  )
  strategy = (
    tf.distribute.get_strategy() if replicas == 1 else mirrored_strategy(2)
  )
  with strategy.scope():
    emb = tpe.TPUEmbedding(
      tpe.FeatureConfig(table),
      tpe.Adagrad(1.0),
      row_sharding_threshold=threshold,
    )
  emb.build()
  return request.param, emb.table_stores["t"], emb, values


def test_layout_is_the_planned_one(layout):
  name, store, _, _ = layout
  assert store.layout == name
  assert store.keys == ("parameters", "accumulators")


def test_rows_sharded_follows_the_plan(layout):
  name, store, emb, _ = layout
  assert store.rows_sharded == (name == "row_sharded")
  plan = emb.sharding_plan
  assert plan is None or plan.placements["t"].sharded == store.rows_sharded


@pytest.mark.parametrize("threshold", [0, 1000], ids=["sharded", "replicated"])
def test_stacked_members_answer_rows_sharded_for_their_stack(threshold):
  tables = [tpe.TableConfig(ROWS, DIM, name=n) for n in ("a", "b")]
  with mirrored_strategy(2).scope():
    emb = tpe.TPUEmbedding(
      [tpe.FeatureConfig(t) for t in tables],
      tpe.Adagrad(1.0),
      row_sharding_threshold=threshold,
      table_stacking=[["a", "b"]],
    )
  emb.build()
  members = [emb.table_stores[n] for n in ("a", "b")]
  assert all(m.stack is members[0].stack for m in members)
  assert [m.rows_sharded for m in members] == [threshold == 0] * 2


def test_gather_reads_rows_in_id_order(layout):
  _, store, _, values = layout
  ids = tf.constant([10, 0, 6, 5, 6], tf.int64)
  np.testing.assert_array_equal(store.gather(ids).numpy(), values[ids])
  dense = tf.constant([[1, 10], [0, 0]], tf.int64)
  np.testing.assert_array_equal(store.gather(dense).numpy(), values[dense])


def test_read_and_assign_whole_values(layout):
  _, store, _, values = layout
  np.testing.assert_array_equal(store.read().numpy(), values)
  np.testing.assert_array_equal(
    store.read("accumulators").numpy(), np.full((ROWS, DIM), 0.1, np.float32)
  )
  new = values * 2 + 1
  store.assign(new)
  np.testing.assert_array_equal(store.read().numpy(), new)
  for block in range(len(store.blocks)):
    first, rows = store.block_rows(block)
    np.testing.assert_array_equal(
      store.blocks[block]["parameters"].numpy(), new[first : first + rows]
    )


def test_update_by_global_ids_matches_numpy_adagrad(layout):
  _, store, _, values = layout
  ids = np.array([10, 0, 5], np.int64)
  grads = np.arange(9, dtype=np.float32).reshape(3, 3) - 4
  store.update(tf.constant(ids), RowGradients.dense(tf.constant(grads)))
  accumulators = np.full((ROWS, DIM), 0.1, np.float32)
  accumulators[ids] += grads**2
  expected = values.copy()
  expected[ids] -= grads / np.sqrt(accumulators[ids])
  np.testing.assert_allclose(store.read().numpy(), expected, rtol=1e-6)
  np.testing.assert_allclose(
    store.read("accumulators").numpy(), accumulators, rtol=1e-6
  )
  for i, block in enumerate(store.blocks):  # every copy or block agrees
    first, rows = store.block_rows(i)
    np.testing.assert_allclose(
      block["parameters"].numpy(), expected[first : first + rows], rtol=1e-6
    )


def test_bytes_per_device(layout):
  name, store, _, _ = layout
  per_device = store.bytes_per_device()
  full = ROWS * DIM * 4 * 2  # parameters and accumulators
  if name == "row_sharded":
    assert sorted(per_device.values()) == [5 * DIM * 8, 6 * DIM * 8]
  elif name == "replicated":
    assert list(per_device.values()) == [full, full]
  else:
    assert list(per_device.values()) == [full]


def test_checkpoint_keys_hold_full_values(layout, tmp_path):
  _, _, emb, values = layout
  path = tf.train.Checkpoint(embedding=emb).save(str(tmp_path / "ckpt"))
  shapes = dict(tf.train.list_variables(path))
  assert shapes["embedding/t/.ATTRIBUTES/VARIABLE_VALUE"] == [ROWS, DIM]
  assert shapes["embedding/t.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE"] == [
    ROWS,
    DIM,
  ]
  saved = tf.train.load_variable(path, "embedding/t/.ATTRIBUTES/VARIABLE_VALUE")
  np.testing.assert_array_equal(saved, values)


def test_replicated_copies_start_equal_with_a_random_initializer():
  table = tpe.TableConfig(ROWS, DIM, name="t")  # truncated normal, no seed
  with mirrored_strategy(2).scope():
    emb = tpe.TPUEmbedding(
      tpe.FeatureConfig(table), tpe.Adagrad(0.1), row_sharding_threshold=1000
    )
  emb.build()
  first, second = (
    b["parameters"].numpy() for b in emb.table_stores["t"].blocks
  )
  assert np.std(first) > 0
  np.testing.assert_array_equal(first, second)
