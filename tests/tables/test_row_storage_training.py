"""16-bit tables (``RowStorage``) train as their float32 math, then rounded.

The oracle of one step: TensorFlow's float32 path, this package's float32
table given the 16-bit table's values (every 16-bit value is a float32),
then ``tests/low_precision_oracle.py``'s rounding (numpy, written from the
rounding's spec) of every row with the step's draws. A row the step does
not touch keeps a value its type holds, which every rounding keeps: so the
whole table is rounded, with no list of touched rows to get wrong.

Sharded and replicated tables under ``MirroredStrategy`` equal one device
bit for bit: rows draw by global row id and update count, whichever
replica holds them.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.backends import test_sharded
from tests.backends.test_sharded import DIM
from tests.backends.test_sharded import OPTIMIZERS
from tests.backends.test_sharded import V_BIG
from tests.backends.test_sharded import V_SMALL
from tests.backends.test_sharded import make_batches
from tests.backends.test_sharded import projections
from tests.backends.test_sharded import sharded_step
from tests.backends.test_sharded import single_device_step
from tests.backends.test_sharded import train_sharded
from tests.backends.test_sharded import train_single_device
from tests.conftest import mirrored_strategy
from tests.low_precision_oracle import rounded_table

STORAGES = {
  "bfloat16": tpe.RowStorage("bfloat16", slots="bfloat16", seed=5),
  "float16": tpe.RowStorage("float16", seed=7),
  "float16_nearest": tpe.RowStorage("float16", rounding="nearest"),
}


def make_embedding(strategy, optimizer, inits, storage):
  return test_sharded.make_embedding(
    strategy, optimizer, inits["big"], inits["small"], storage
  )


def state(emb) -> dict[tuple[str, str], np.ndarray]:
  """Every variable's stored values, as float64 (exact), and its type."""
  return {
    (table, key): np.asarray(tf.cast(tf.convert_to_tensor(v), tf.float64))
    for table, keys in emb.variables.items()
    for key, v in keys.items()
  }


def initial_values(rng):
  return {
    "big": rng.normal(size=(V_BIG, DIM)).astype(np.float32),
    "small": rng.normal(size=(V_SMALL, DIM)).astype(np.float32),
  }


def check_steps(strategy, optimizer, storage, rng, make_step):
  """Trains a 16-bit embedding under ``strategy`` and checks each step
  against its float32 twin's step (given the same values), rounded
  (``make_step(emb, projection)``: ``emb``'s traced step)."""
  if optimizer in ("adam", "ftrl") and storage.slots != "float32":
    storage = tpe.RowStorage(storage.dtype, seed=storage.seed)
  inits = initial_values(rng)
  batches, projection = make_batches(rng, steps=4), projections(rng)
  low = make_embedding(strategy, OPTIMIZERS[optimizer](), inits, storage)
  twin = make_embedding(
    strategy, OPTIMIZERS[optimizer](), inits, tpe.RowStorage()
  )
  low.build()
  twin.build()
  slot_names = OPTIMIZERS[optimizer]().SLOT_NAMES
  streams = {"parameters": 0} | {s: i + 1 for i, s in enumerate(slot_names)}
  for table, keys in low.variables.items():
    want_types = {"parameters": storage.dtype} | dict.fromkeys(
      slot_names, storage.slots
    )
    assert {k: v.dtype.name for k, v in keys.items()} == want_types, table
  # The initial values: the float32 ones rounded to nearest.
  nearest = tpe.RowStorage(storage.dtype, storage.slots, "nearest")
  for (table, key), value in state(low).items():
    want = rounded_table(state(twin)[table, key], nearest, streams[key], 0)
    np.testing.assert_array_equal(value, want, err_msg=f"{table}/{key}")
  low_step, twin_step = make_step(low, projection), make_step(twin, projection)
  for step, batch in enumerate(batches):
    before = state(low)
    for (table, key), value in before.items():
      twin.variables[table][key].assign(value.astype(np.float32))
    want_activations = twin_step(batch)
    got_activations = low_step(batch)
    for name, value in want_activations.items():
      np.testing.assert_array_equal(
        got_activations[name], value, err_msg=f"step {step} {name}"
      )
    after32, got = state(twin), state(low)
    for (table, key), value in after32.items():
      want = rounded_table(value, storage, streams[key], step)
      np.testing.assert_array_equal(
        got[table, key], want, err_msg=f"step {step} {table}/{key}"
      )
    changed = np.any(got["big", "parameters"] != before["big", "parameters"])
    assert changed, f"step {step} changed nothing"
  return low


# Every optimizer rule, type and rounding (Adagrad's slots in bfloat16
# too; Adam and FTRL keep float32 slots); the kernels take SGD and
# Adagrad, TensorFlow Adam and FTRL.
@pytest.mark.parametrize(
  "optimizer, storage",
  [
    ("sgd", "bfloat16"),
    ("sgd", "float16_nearest"),
    ("adagrad", "bfloat16"),
    ("adagrad", "float16"),
    ("adam", "float16_nearest"),
    ("ftrl", "float16"),
  ],
)
def test_each_step_is_the_float32_step_then_the_rounding(
  optimizer, storage, rng
):
  check_steps(
    tf.distribute.get_strategy(),
    optimizer,
    STORAGES[storage],
    rng,
    single_device_step,
  )


@pytest.mark.parametrize(
  "optimizer, storage, replicas",
  [
    ("sgd", "float16", 4),
    ("ftrl", "bfloat16", 2),
  ],
)
def test_mirrored_steps_round_rows_by_their_global_ids(
  optimizer, storage, replicas, rng
):
  """Row-sharded ("big") and replicated ("small") tables: each block
  numbers its rows globally and counts its updates as one device would."""
  strategy = mirrored_strategy(replicas)

  def make_step(emb, projection):
    return sharded_step(emb, strategy, projection)

  low = check_steps(strategy, optimizer, STORAGES[storage], rng, make_step)
  plan = low.sharding_plan.placements
  assert plan["big"].kind == "row_sharded", plan
  assert plan["small"].kind == "replicated", plan


def test_mirrored_equals_one_device_where_float32_does(rng):
  """SGD's float32 step is the same on one device and sharded, so the
  16-bit tables are too, bit for bit."""
  storage = STORAGES["bfloat16"]
  inits = initial_values(rng)
  batches, projection = make_batches(rng), projections(rng)
  single = make_embedding(
    tf.distribute.get_strategy(), OPTIMIZERS["sgd"](), inits, storage
  )
  train_single_device(single, batches, projection)
  strategy = mirrored_strategy(2)
  sharded = make_embedding(strategy, OPTIMIZERS["sgd"](), inits, storage)
  train_sharded(sharded, strategy, batches, projection)
  want, got = state(single), state(sharded)
  assert set(got) == set(want)
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=f"{key}")


def test_sixteen_bit_tables_hold_half_the_bytes():
  def bytes_held(storage):
    table = tpe.TableConfig(1000, 16, name="t", storage=storage)
    emb = tpe.TPUEmbedding(tpe.FeatureConfig(table), tpe.Adagrad(0.1))
    emb.build(4)
    return sum(emb.table_stores["t"].bytes_per_device().values())

  float32 = bytes_held(tpe.RowStorage())
  assert float32 == 2 * 1000 * 16 * 4
  assert bytes_held(tpe.RowStorage("bfloat16")) == 1000 * 16 * (2 + 4)
  assert bytes_held(tpe.RowStorage("float16", slots="bfloat16")) == float32 / 2
