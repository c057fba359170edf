"""Every layout gets the same tables: initial values, tiny tables, 1 replica.

* A table's initial value depends only on its initializer (and seed), not
  on where its rows live: one device, 2 or 4 replicas (checked here), 2
  workers and parameter servers (tests/distributed/).
* The row-wise values follow their documented definition (grid block ``k``
  generated from seed ``[seed, k]``) and their initializer's distribution.
* Tables with fewer rows than replicas train like one device.
* A 1-replica MirroredStrategy takes per-replica values like N > 1.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.backends.test_sharded import full_values
from tests.backends.test_sharded import train_sharded
from tests.backends.test_sharded import train_single_device
from tests.conftest import mirrored_strategy
from tpu_embedding.initializers import TruncatedNormal
from tpu_embedding.tables import initial_values

ROWS, DIM = 70_001, 64  # 5 grid blocks of 4 MiB / (4 * DIM) rows


def whole_table(shape, dtype=tf.float32):
  """A user's callable: it can only make the whole table."""
  rows = tf.range(shape[0], dtype=dtype)[:, None]
  return tf.sin(rows * tf.ones(shape, dtype))


INITIALIZERS = {
  "default": lambda: None,
  "tf_uniform_seeded": lambda: tf.random_uniform_initializer(-1, 1, seed=3),
  "tf_normal_seeded": lambda: tf.random_normal_initializer(seed=4),
  "keras_glorot_seeded": lambda: keras.initializers.GlorotUniform(seed=5),
  "keras_truncated_seeded": lambda: keras.initializers.TruncatedNormal(
    stddev=0.2, seed=6
  ),
  "tpe_truncated_seeded": lambda: TruncatedNormal(stddev=0.3, seed=7),
  "constant": lambda: tf.constant_initializer(0.25),
  "constant_row": lambda: tf.constant_initializer(np.arange(DIM, dtype=float)),
  "keras_constant_row": lambda: keras.initializers.Constant(
    np.linspace(-1, 1, DIM).astype(np.float32)
  ),
  "row_ids": tpe.RowIdInitializer,
  "user_callable": lambda: whole_table,
}


def built(strategy, initializer, optimizer=None, threshold=0):
  with strategy.scope():
    table = tpe.TableConfig(ROWS, DIM, name="t", initializer=initializer)
    emb = tpe.TPUEmbedding(
      tpe.FeatureConfig(table),
      optimizer or tpe.FTRL(0.1, initial_accumulator_value=0.3),
      row_sharding_threshold=threshold,
    )
  emb.build()
  return full_values(emb)


@pytest.mark.parametrize("name", sorted(INITIALIZERS))
def test_initial_values_do_not_depend_on_the_layout(name):
  if name == "default":  # unseeded: the same under the same global seed
    tf.random.set_seed(11)
  want = built(tf.distribute.get_strategy(), INITIALIZERS[name]())
  for replicas in (2, 4):
    if name == "default":
      tf.random.set_seed(11)
    got = built(mirrored_strategy(replicas), INITIALIZERS[name]())
    assert set(got) == set(want)
    for key, value in want.items():
      np.testing.assert_array_equal(got[key], value, err_msg=f"{key}")
  # FTRL's slots: accumulators start at 0.3, linears at 0.
  np.testing.assert_array_equal(want["t", "accumulators"], np.float32(0.3))
  np.testing.assert_array_equal(want["t", "linears"], 0.0)


def test_row_values_follow_their_definition():
  """Grid block k is the stateless sample of seed [seed, k]."""
  initializer = tf.random_uniform_initializer(-2.0, 5.0, seed=9)
  values = initial_values.row_values(initializer, (ROWS, DIM))
  size = initial_values.grid_rows(DIM)
  assert size == 4 * 2**20 // (4 * DIM)
  whole = values.rows(0, ROWS, tf.float32).numpy()
  assert ROWS // size == 4
  for block in (0, 1, 4):
    rows = min(size, ROWS - block * size)
    want = tf.random.stateless_uniform(
      [rows, DIM], tf.constant([9, block], tf.int64), minval=-2.0, maxval=5.0
    ).numpy()
    np.testing.assert_array_equal(
      whole[block * size : block * size + rows], want
    )
  # Any row range is the same rows of the whole.
  np.testing.assert_array_equal(
    values.rows(size - 3, 10, tf.float32).numpy(), whole[size - 3 : size + 7]
  )


@pytest.mark.parametrize(
  "initializer, mean, std",
  [
    (tf.random_uniform_initializer(-1.0, 3.0, seed=1), 1.0, 4 / 12**0.5),
    (tf.random_normal_initializer(0.5, 2.0, seed=2), 0.5, 2.0),
    # Glorot (fan_in + fan_out) / 2 averaged: variance 2 / (rows + dim).
    (
      keras.initializers.GlorotNormal(seed=3),
      0.0,
      (2 / (ROWS + DIM)) ** 0.5,
    ),
    # Truncated at 2 stddev: the sample's std is 0.8796 of stddev.
    (TruncatedNormal(stddev=1.0, seed=4), 0.0, 0.87962566),
  ],
)
def test_row_values_have_their_initializers_distribution(
  initializer, mean, std
):
  sample = (
    initial_values.row_values(initializer, (ROWS, DIM))
    .rows(0, ROWS, tf.float32)
    .numpy()
  )
  assert abs(sample.mean() - mean) < 5 * std / sample.size**0.5
  assert abs(sample.std() / std - 1) < 0.01


def test_whole_table_initializers_warn_once_for_large_tables(
  monkeypatch, caplog
):
  monkeypatch.setattr(initial_values, "LARGE_TABLE_BYTES", 1024)
  monkeypatch.setattr(initial_values, "_warned", set())
  values = initial_values.row_values(whole_table, (ROWS, DIM), "big_table")
  with caplog.at_level(logging.WARNING, logger="tpu_embedding"):
    first = values.rows(0, 3, tf.float32)
    values.rows(5, 3, tf.float32)
  np.testing.assert_allclose(first.numpy(), whole_table((3, DIM)).numpy())
  warnings = [r for r in caplog.records if "big_table" in r.getMessage()]
  assert len(warnings) == 1
  assert "whole" in warnings[0].getMessage()


def test_a_constant_array_of_the_wrong_shape_is_refused():
  with pytest.raises(ValueError, match=r"shape \(3,\).*\[10, 4\]"):
    initial_values.row_values(tf.constant_initializer([1.0, 2, 3]), (10, 4))


TINY = {"one": 1, "three": 3, "five": 5}


def tiny_embedding(strategy, inits):
  with strategy.scope():
    features = {
      name: tpe.FeatureConfig(
        tpe.TableConfig(
          rows, 2, name=name, initializer=tf.constant_initializer(inits[name])
        )
      )
      for name, rows in TINY.items()
    }
    return tpe.TPUEmbedding(
      features, tpe.Adagrad(0.5), row_sharding_threshold=0
    )


@pytest.mark.parametrize("replicas", [2, 4])
def test_tables_with_fewer_rows_than_replicas(replicas, rng, tmp_path):
  inits = {
    n: rng.normal(size=(r, 2)).astype(np.float32) for n, r in TINY.items()
  }
  batches = [
    {n: tf.constant(rng.integers(0, r, 8)) for n, r in TINY.items()}
    for _ in range(3)
  ]
  projection = {
    n: tf.constant(rng.normal(size=(8, 2)), tf.float32) for n in TINY
  }
  single = tiny_embedding(tf.distribute.get_strategy(), inits)
  want = train_single_device(single, batches, projection)
  strategy = mirrored_strategy(replicas)
  sharded = tiny_embedding(strategy, inits)
  got = train_sharded(sharded, strategy, batches, projection)
  for g, w in zip(got, want, strict=True):
    for key in w:
      np.testing.assert_allclose(
        g[key], w[key], rtol=1e-5, atol=1e-6, err_msg=key
      )
  kinds = {n: p.kind for n, p in sharded.sharding_plan.placements.items()}
  assert kinds["one"] == "replicated"  # fewer rows than replicas
  assert kinds["five"] == "row_sharded"
  assert kinds["three"] == ("row_sharded" if replicas == 2 else "replicated")
  path = tf.train.Checkpoint(embedding=sharded).save(str(tmp_path / "ckpt"))
  restored = tiny_embedding(
    tf.distribute.get_strategy(),
    {n: np.zeros_like(v) for n, v in inits.items()},
  )
  tf.train.Checkpoint(embedding=restored).restore(path)
  for key, value in full_values(single).items():
    np.testing.assert_allclose(
      full_values(restored)[key], value, rtol=1e-5, atol=1e-6
    )


def test_one_replica_mirrored_takes_per_replica_values():
  strategy = mirrored_strategy(1)
  with strategy.scope():
    emb = tpe.TPUEmbedding(
      tpe.FeatureConfig(
        tpe.TableConfig(10, 2, name="t", initializer=tpe.RowIdInitializer())
      ),
      tpe.SGD(0.1),
    )
  ids = tf.constant([3, 7], tf.int64)

  @tf.function
  def inside_before_build():
    strategy.run(lambda: emb.enqueue(ids))

  with pytest.raises(RuntimeError, match="cannot build inside strategy.run"):
    inside_before_build()

  @tf.function
  def per_replica_values():
    emb.enqueue(
      strategy.experimental_distribute_values_from_function(lambda ctx: ids)
    )
    return strategy.run(emb.dequeue)

  got = strategy.experimental_local_results(per_replica_values())[0]
  np.testing.assert_array_equal(got.numpy(), [[3, 3], [7, 7]])


def test_slot_variable_creation_fn_makes_each_blocks_slots(rng):
  """Sharded tables call the user's function once per row block."""
  calls = []

  def slot_fn(table, slot_names, slot_initializers):
    calls.append((tuple(table.shape), list(slot_names)))
    return {
      name: tf.Variable(init(shape=table.shape, dtype=table.dtype))
      for name, init in zip(slot_names, slot_initializers, strict=True)
    }

  def embedding(strategy, fn):
    with strategy.scope():
      table = tpe.TableConfig(
        9, 2, name="t", initializer=tf.constant_initializer(init)
      )
      return tpe.TPUEmbedding(
        {"f": tpe.FeatureConfig(table)},
        tpe.Adagrad(0.3, slot_variable_creation_fn=fn),
        row_sharding_threshold=0,
      )

  init = rng.normal(size=(9, 2)).astype(np.float32)
  batches = [{"f": tf.constant(rng.integers(0, 9, 8))} for _ in range(3)]
  projection = {"f": tf.constant(rng.normal(size=(8, 2)), tf.float32)}
  single = embedding(tf.distribute.get_strategy(), None)
  train_single_device(single, batches, projection)
  strategy = mirrored_strategy(2)
  sharded = embedding(strategy, slot_fn)
  train_sharded(sharded, strategy, batches, projection)
  assert calls == [((5, 2), ["accumulators"]), ((4, 2), ["accumulators"])]
  for key, value in full_values(single).items():
    np.testing.assert_allclose(
      full_values(sharded)[key], value, rtol=1e-5, atol=1e-6, err_msg=str(key)
    )


def test_slot_variable_creation_fn_must_make_block_shaped_slots():
  def wrong(table, slot_names, slot_initializers):
    return {name: tf.Variable(tf.zeros([1, 2])) for name in slot_names}

  with mirrored_strategy(2).scope():
    emb = tpe.TPUEmbedding(
      tpe.FeatureConfig(tpe.TableConfig(9, 2, name="t")),
      tpe.Adagrad(0.3, slot_variable_creation_fn=wrong),
      row_sharding_threshold=0,
    )
  with pytest.raises(ValueError, match=r"'t'.*'accumulators'.*\[1, 2\]"):
    emb.build()
