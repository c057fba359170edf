"""``apply_gradients(skip=...)``: a skipped step changes no row and no slot.

Every optimizer, on one device, with pipelining, and on 2 mirrored
replicas (one row-sharded and one replicated table): a step whose
gradients hold a NaN (on one replica only) and whose ``skip`` is true
leaves every table and slot bit-identical, while ``skip=False`` is the
plain update (the same values as a step without ``skip``).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy

OPTIMIZERS = {
  "sgd": lambda: tpe.SGD(0.2),
  "adagrad": lambda: tpe.Adagrad(0.3),
  "adagrad_momentum": lambda: tpe.AdagradMomentum(0.2, momentum=0.8),
  "adam": lambda: tpe.Adam(0.1),
  "ftrl": lambda: tpe.FTRL(0.2, l1_regularization_strength=0.01),
}
ROWS, SMALL_ROWS, DIM, BATCH = 20, 5, 2, 4


def make_embedding(strategy, optimizer, pipeline=False):
  with strategy.scope():
    big = tpe.TableConfig(
      ROWS, DIM, name="big", initializer=tf.constant_initializer(0.5)
    )
    small = tpe.TableConfig(
      SMALL_ROWS, DIM, name="small", initializer=tf.constant_initializer(-1.0)
    )
    emb = tpe.TPUEmbedding(
      {"a": tpe.FeatureConfig(big), "b": tpe.FeatureConfig(small)},
      optimizer,
      row_sharding_threshold=10,
      pipeline_execution_with_tensor_core=pipeline,
    )
  emb.build()
  return emb


def values(emb):
  emb.flush_pipeline()
  return {
    (table, slot): np.asarray(tf.convert_to_tensor(variable)).copy()
    for table, slots in emb.variables.items()
    for slot, variable in slots.items()
  }


def features(step):
  return {
    "a": tf.constant([(3 * step + i) % ROWS for i in range(BATCH)], tf.int64),
    "b": tf.constant([(step + i) % SMALL_ROWS for i in range(BATCH)], tf.int64),
  }


def replica_step(emb, poison, use_skip):
  """One replica's step: gradient 1 + its activations (NaN if poisoned)."""
  replica = tf.distribute.get_replica_context()
  with tf.GradientTape() as tape:
    activations = emb.dequeue()
    tape.watch(activations)
    loss = sum(tf.reduce_sum(a * a) for a in activations.values())
  grads = tape.gradient(loss, activations)
  nan = tf.logical_and(poison, tf.equal(replica.replica_id_in_sync_group, 1))
  if replica.num_replicas_in_sync == 1:
    nan = poison
  grads["a"] = tf.where(nan, tf.fill(tf.shape(grads["a"]), np.nan), grads["a"])
  if not use_skip:
    emb.apply_gradients(grads)
    return
  finite = tf.reduce_all(
    [tf.reduce_all(tf.math.is_finite(g)) for g in tf.nest.flatten(grads)]
  )
  bad = replica.all_reduce(
    tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.int32)
  )
  emb.apply_gradients(grads, skip=bad > 0)


def train_fn(emb, strategy, use_skip):
  replicas = strategy.num_replicas_in_sync

  @tf.function
  def step(ids, poison):
    distributed = strategy.experimental_distribute_values_from_function(
      lambda ctx: {
        k: tf.reshape(v, [replicas, -1])[ctx.replica_id_in_sync_group]
        for k, v in ids.items()
      }
    )
    emb.enqueue(distributed if replicas > 1 else ids, training=True)
    strategy.run(replica_step, args=(emb, poison, use_skip))

  return step


CASES = {
  "one_device": (lambda: tf.distribute.get_strategy(), False),
  "pipelined": (lambda: tf.distribute.get_strategy(), True),
  "mirrored_2": (lambda: mirrored_strategy(2), False),
}


# Every optimizer on one device; each again on 2 replicas (Adagrad, FTRL,
# SGD) or pipelined (Adagrad with momentum, Adam): each path with
# optimizers with and without slots, FTRL (not linear) on 2 replicas.
@pytest.mark.parametrize(
  "optimizer, case",
  [(name, "one_device") for name in sorted(OPTIMIZERS)]
  + [(name, "mirrored_2") for name in ("adagrad", "ftrl", "sgd")]
  + [(name, "pipelined") for name in ("adagrad_momentum", "adam")],
)
def test_a_skipped_step_changes_nothing(optimizer, case):
  make_strategy, pipeline = CASES[case]
  strategy = make_strategy()
  emb = make_embedding(strategy, OPTIMIZERS[optimizer](), pipeline)
  plain = make_embedding(strategy, OPTIMIZERS[optimizer](), pipeline)
  step = train_fn(emb, strategy, use_skip=True)
  plain_step = train_fn(plain, strategy, use_skip=False)
  no = tf.constant(False)
  step(features(0), no)
  plain_step(features(0), no)
  before = values(emb)
  for key, value in values(plain).items():  # skip=False: the plain update
    np.testing.assert_array_equal(before[key], value, err_msg=str(key))
  assert not np.array_equal(before["big", "parameters"], 0.5)

  step(features(1), tf.constant(True))  # NaN gradients: skipped
  after = values(emb)
  assert set(after) == set(before)
  for key, value in before.items():
    assert np.all(np.isfinite(after[key])), key
    np.testing.assert_array_equal(after[key], value, err_msg=str(key))

  step(features(2), no)  # training goes on
  assert not np.array_equal(
    values(emb)["big", "parameters"], after["big", "parameters"]
  )


def test_skip_errors_name_the_problem():
  strategy = tf.distribute.get_strategy()
  emb = make_embedding(
    strategy, tpe.Adam(0.1, lazy_adam=False, use_gradient_accumulation=True)
  )
  emb.enqueue(features(0))
  activations = emb.dequeue()
  grads = tf.nest.map_structure(tf.ones_like, activations)
  with pytest.raises(ValueError, match="table 'big'.*lazy_adam=False"):
    emb.apply_gradients(grads, skip=tf.constant(True))
  emb = make_embedding(strategy, tpe.SGD(0.1))
  emb.enqueue(features(0))
  activations = emb.dequeue()
  with pytest.raises(ValueError, match="scalar bool, got shape \\(2,\\)"):
    emb.apply_gradients(
      tf.nest.map_structure(tf.ones_like, activations),
      skip=tf.constant([True, False]),
    )
  emb.apply_gradients(
    tf.nest.map_structure(tf.ones_like, activations), skip=True
  )
  np.testing.assert_array_equal(values(emb)["big", "parameters"], 0.5)
