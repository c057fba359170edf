"""``apply_gradients(step_id=...)``: each step's update lands once.

Under parameter servers a step may run twice (TensorFlow's coordinator
re-runs the step of a failed worker); the blocks' locks check a record of
the step ids applied (``tables/step_record.py``). Here, in one process,
locked stores (as ``ParameterServerBackend`` locks them) take a step again
with the same id and keep their values bit for bit, one row-sharded table
over two devices included; unlocked stores (every other strategy, which
never re-runs a step) ignore the id. The real re-run, a killed worker's
step under a ``ClusterCoordinator``, is
tests/backends/test_parameter_server.py's.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy
from tpu_embedding.backends.base import Backend
from tpu_embedding.gradients import RowGradients
from tpu_embedding.tables.step_record import SLOTS
from tpu_embedding.tables.update_guards import LockedUpdates

ROWS, DIM = 12, 2


def make_embedding(strategy, locked):
  """Locked: every store made with the guard ``ParameterServerBackend``
  gives its stores (the backends' guard is patched only while the tables
  are made: the stores keep it, no later embedding sees it)."""
  guard = LockedUpdates() if locked else Backend.update_guard
  with strategy.scope():
    big = tpe.TableConfig(
      ROWS, DIM, name="big", initializer=tf.constant_initializer(0.5)
    )
    small = tpe.TableConfig(
      4, DIM, name="small", initializer=tf.constant_initializer(-1.0)
    )
    emb = tpe.TPUEmbedding(
      {"a": tpe.FeatureConfig(big), "b": tpe.FeatureConfig(small)},
      tpe.Adagrad(0.3),
      row_sharding_threshold=8,
      table_stacking=None,
    )
  with mock.patch.object(Backend, "update_guard", guard):
    emb.build()
  return emb


def values(emb):
  return {
    (table, slot): np.asarray(tf.convert_to_tensor(variable)).copy()
    for table, slots in emb.variables.items()
    for slot, variable in slots.items()
  }


def step_fn(emb):
  ids = {
    "a": tf.constant([0, 3, 3, 11], tf.int64),
    "b": tf.constant([1, 2, 1, 0], tf.int64),
  }

  @tf.function
  def step(step_id):
    emb.enqueue(ids)
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = sum(tf.reduce_sum(a) for a in activations.values())
    emb.apply_gradients(tape.gradient(loss, activations), step_id=step_id)

  return step


def changed(before, after):
  return {key for key in before if not np.array_equal(before[key], after[key])}


def test_a_locked_table_takes_each_step_id_once():
  emb = make_embedding(tf.distribute.get_strategy(), locked=True)
  step = step_fn(emb)
  start = values(emb)
  step(tf.constant(7, tf.int64))
  once = values(emb)
  assert changed(start, once) == set(start)
  step(tf.constant(7, tf.int64))  # a re-run of step 7
  for key, value in values(emb).items():
    np.testing.assert_array_equal(value, once[key], err_msg=str(key))
  step(tf.constant(8, tf.int64))  # the next step
  assert changed(once, values(emb)) == set(start)


def test_each_row_block_keeps_its_own_record():
  """A row-sharded table over 2 devices: both blocks skip the re-run."""
  strategy = mirrored_strategy(2)
  emb = make_embedding(strategy, locked=True)
  store = emb.table_stores["big"]
  assert len(store.blocks) == 2
  ids = tf.constant([0, 3, 11], tf.int64)  # rows of both blocks

  @tf.function
  def update(step_id):
    store.update(ids, RowGradients.dense(tf.ones([3, DIM])), step_id=step_id)

  update(tf.constant(0, tf.int64))
  once = store.read("accumulators").numpy()
  update(tf.constant(0, tf.int64))
  np.testing.assert_array_equal(store.read("accumulators").numpy(), once)
  update(tf.constant(1, tf.int64))
  twice = store.read("accumulators").numpy()
  np.testing.assert_array_equal(twice[[0, 3, 11]], once[[0, 3, 11]] + 1.0)


def test_an_id_older_than_the_record_applies_again():
  """The bounded record: a step id SLOTS ids behind the newest one applied
  in its slot is not recognised, and updates (at least once, as without an
  id)."""
  emb = make_embedding(tf.distribute.get_strategy(), locked=True)
  step = step_fn(emb)
  step(tf.constant(5, tf.int64))
  step(tf.constant(5 + SLOTS, tf.int64))
  before = values(emb)
  step(tf.constant(5, tf.int64))
  assert changed(before, values(emb)) == set(before)


def test_unlocked_tables_ignore_the_step_id():
  """Strategies that never re-run a step: every call updates, as without
  an id (the same values)."""
  emb = make_embedding(tf.distribute.get_strategy(), locked=False)
  plain = make_embedding(tf.distribute.get_strategy(), locked=False)
  step = step_fn(emb)
  plain_step = step_fn(plain)
  for _ in range(2):
    step(tf.constant(3, tf.int64))
    plain_step(None)
  for key, value in values(plain).items():
    np.testing.assert_array_equal(values(emb)[key], value, err_msg=str(key))


@pytest.mark.parametrize(
  ("step_id", "message"),
  [
    (tf.constant(1.5), "scalar integer"),
    (tf.constant([1, 2], tf.int64), "scalar integer"),
    ("seven", "scalar integer"),
    (tf.Variable(3, dtype=tf.int64), "not a variable"),
  ],
)
def test_step_id_errors_name_the_problem(step_id, message):
  emb = make_embedding(tf.distribute.get_strategy(), locked=False)
  emb.enqueue({"a": tf.constant([1], tf.int64), "b": tf.constant([1])})
  activations = emb.dequeue()
  with pytest.raises(ValueError, match=message):
    emb.apply_gradients(
      tf.nest.map_structure(tf.ones_like, activations), step_id=step_id
    )
