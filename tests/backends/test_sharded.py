"""Sharded tables on MirroredStrategy equal one device, step for step.

The oracle is this package on one device (itself checked against numpy and
TensorFlow elsewhere), trained on the same global batches: activations per
replica must be that replica's slice of the single-device activations, and
tables and slots must match after every step.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy

V_BIG, V_SMALL, DIM, BATCH = 41, 7, 3, 8

OPTIMIZERS = {
  "sgd": lambda: tpe.SGD(0.2),
  "adagrad": lambda: tpe.Adagrad(0.3),
  "adagrad_momentum": lambda: tpe.AdagradMomentum(0.2, momentum=0.8),
  "adam": lambda: tpe.Adam(0.1),
  "ftrl": lambda: tpe.FTRL(0.2, l1_regularization_strength=0.01),
}


def mirrored(replicas: int) -> tf.distribute.MirroredStrategy:
  return mirrored_strategy(replicas)


def make_embedding(strategy, optimizer, big_init, small_init, storage=None):
  """ "big" (row-sharded) and "small" (replicated), stored as ``storage``
  (a ``RowStorage``; None: float32); ragged, dense, multi-hot, sequence
  features."""
  storage = storage or tpe.RowStorage()
  with strategy.scope():
    big = tpe.TableConfig(
      V_BIG,
      DIM,
      name="big",
      combiner="sum",
      initializer=tf.constant_initializer(big_init),
      storage=storage,
    )
    small = tpe.TableConfig(
      V_SMALL,
      DIM,
      name="small",
      initializer=tf.constant_initializer(small_init),
      storage=storage,
    )
    features = {
      "ragged": tpe.FeatureConfig(big),
      "dense": tpe.FeatureConfig(big),
      "multi_hot": tpe.FeatureConfig(big),  # dense [batch, 3]
      "sequence": tpe.FeatureConfig(big, max_sequence_length=2),
      "small": tpe.FeatureConfig(small),
    }
    return tpe.TPUEmbedding(features, optimizer, row_sharding_threshold=10)


def make_batches(rng, steps=3):
  """Global batches with duplicates within and across replicas, empty rows."""
  batches = []
  for _ in range(steps):
    hot = rng.integers(0, V_BIG, 3)  # ids that recur across replicas
    ragged = [list(rng.choice(hot, rng.integers(0, 3))) for _ in range(BATCH)]
    ragged[1] = []
    batches.append(
      {
        "ragged": tf.ragged.constant(ragged, dtype=tf.int64, ragged_rank=1),
        "dense": tf.constant(rng.choice(hot, BATCH)),
        "multi_hot": tf.constant(rng.choice(hot, (BATCH, 3))),
        "sequence": tf.ragged.constant(
          [
            list(rng.integers(0, V_BIG, rng.integers(0, 4)))
            for _ in range(BATCH)
          ],
          dtype=tf.int64,
        ),
        "small": tf.ragged.constant(
          [
            list(rng.integers(0, V_SMALL, rng.integers(1, 3)))
            for _ in range(BATCH)
          ],
          dtype=tf.int64,
        ),
      }
    )
  return batches


def projections(rng):
  shapes = {
    "ragged": [BATCH, DIM],
    "dense": [BATCH, DIM],
    "multi_hot": [BATCH, 3, DIM],
    "sequence": [BATCH, 2, DIM],
    "small": [BATCH, DIM],
  }
  return {
    k: tf.constant(rng.normal(size=s).astype(np.float32))
    for k, s in shapes.items()
  }


def loss_fn(activations, projection):
  return sum(
    tf.reduce_sum(activations[k] * projection[k]) for k in sorted(activations)
  )


def single_device_step(emb, projection):
  """``emb``'s training step, traced once: ``step(batch)``, its
  activations."""

  @tf.function
  def step(features):
    emb.enqueue(features)
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = loss_fn(activations, projection)
    emb.apply_gradients(tape.gradient(loss, activations))
    return activations

  return step


def train_single_device(emb, batches, projection):
  step = single_device_step(emb, projection)
  return [step(b) for b in batches]


def replica_slice(structure, replica, replicas):
  per = BATCH // replicas
  return tf.nest.map_structure(
    lambda t: t[replica * per : (replica + 1) * per], structure
  )


def sharded_step(emb, strategy, projection):
  """``emb``'s training step under ``strategy``, traced once:
  ``step(batch)``, the batch's activations (each replica's slice)."""
  replicas = strategy.num_replicas_in_sync

  @tf.function
  def step(features):
    distributed = strategy.experimental_distribute_values_from_function(
      lambda ctx: replica_slice(
        features, ctx.replica_id_in_sync_group, replicas
      )
    )
    emb.enqueue(distributed, training=True)

    def replica_fn():
      replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        loss = loss_fn(
          activations, replica_slice(projection, replica, replicas)
        )
      emb.apply_gradients(tape.gradient(loss, activations))
      return activations

    return strategy.run(replica_fn)

  def whole_batch(batch):
    return {
      k: tf.concat(strategy.experimental_local_results(v), axis=0)
      for k, v in step(batch).items()
    }

  return whole_batch


def train_sharded(emb, strategy, batches, projection):
  step = sharded_step(emb, strategy, projection)
  return [step(b) for b in batches]


def full_values(emb):
  """{(table, slot): full numpy value} whatever the layout."""
  return {
    (table, slot): np.asarray(tf.convert_to_tensor(variable))
    for table, slots in emb.variables.items()
    for slot, variable in slots.items()
  }


# Every optimizer once, each replica count with three of them (FTRL, not
# linear in its slots, on both).
@pytest.mark.parametrize(
  "optimizer, replicas",
  [
    ("adagrad", 4),
    ("adagrad_momentum", 2),
    ("adam", 2),
    ("ftrl", 2),
    ("ftrl", 4),
    ("sgd", 4),
  ],
)
def test_sharded_training_equals_one_device(optimizer, replicas, rng):
  big_init = rng.normal(size=(V_BIG, DIM)).astype(np.float32)
  small_init = rng.normal(size=(V_SMALL, DIM)).astype(np.float32)
  batches, projection = make_batches(rng), projections(rng)
  single = make_embedding(
    tf.distribute.get_strategy(), OPTIMIZERS[optimizer](), big_init, small_init
  )
  want = train_single_device(single, batches, projection)
  strategy = mirrored(replicas)
  sharded = make_embedding(
    strategy, OPTIMIZERS[optimizer](), big_init, small_init
  )
  got = train_sharded(sharded, strategy, batches, projection)
  for step, (g, w) in enumerate(zip(got, want, strict=True)):
    for key in w:
      np.testing.assert_allclose(
        g[key], w[key], atol=1e-5, err_msg=f"step {step} {key}"
      )
  want_tables, got_tables = full_values(single), full_values(sharded)
  assert set(got_tables) == set(want_tables)
  for key, value in want_tables.items():
    np.testing.assert_allclose(got_tables[key], value, atol=1e-5, err_msg=key)


def test_sharded_tables_hold_a_slice_of_the_rows_per_replica():
  strategy = mirrored(4)
  emb = make_embedding(
    strategy, tpe.Adam(0.1), np.zeros((V_BIG, DIM)), np.zeros((V_SMALL, DIM))
  )
  emb.build()
  plan = emb.sharding_plan
  assert plan.placements["big"].sharded
  assert not plan.placements["small"].sharded
  for slot in ("parameters", "momenta", "velocities"):
    shards = emb.backend.shards("big", slot)
    assert [s.shape[0] for s in shards] == [11, 10, 10, 10]
    assert [s.device.split("/")[-1] for s in shards] == [
      f"device:CPU:{i}" for i in range(4)
    ]
    replicated = emb.backend.shards("small", slot)
    assert [s.shape[0] for s in replicated] == [V_SMALL] * 4
  per_replica = plan.bytes_per_replica()
  full_big = V_BIG * DIM * 4 * 3  # parameters + 2 Adam slots
  assert per_replica[0] == 11 * DIM * 4 * 3 + V_SMALL * DIM * 4 * 3
  assert per_replica[0] - V_SMALL * DIM * 4 * 3 <= full_big / 4 + DIM * 12


def test_direct_lookups_inside_and_outside_strategy_run(rng):
  big_init = rng.normal(size=(V_BIG, DIM)).astype(np.float32)
  small_init = rng.normal(size=(V_SMALL, DIM)).astype(np.float32)
  strategy = mirrored(2)
  emb = make_embedding(strategy, tpe.SGD(0.1), big_init, small_init)
  batch = make_batches(rng, steps=1)[0]
  single = make_embedding(
    tf.distribute.get_strategy(), tpe.SGD(0.1), big_init, small_init
  )
  want = single(batch)
  outside = emb(batch)
  for key in want:
    np.testing.assert_allclose(outside[key], want[key], atol=1e-6)

  @tf.function
  def lookup():
    return strategy.run(
      lambda: emb(
        replica_slice(
          batch, tf.distribute.get_replica_context().replica_id_in_sync_group, 2
        )
      )
    )

  inside = lookup()
  for key in want:
    merged = tf.concat(strategy.experimental_local_results(inside[key]), 0)
    np.testing.assert_allclose(merged, want[key], atol=1e-6)


def test_distributed_dataset_with_host_inputs(rng):
  strategy = mirrored(2)
  emb = make_embedding(
    strategy,
    tpe.Adagrad(0.1),
    rng.normal(size=(V_BIG, DIM)),
    rng.normal(size=(V_SMALL, DIM)),
  )
  batch = make_batches(rng, steps=1)[0]
  dataset = tf.data.Dataset.from_tensors(batch).repeat(2)
  iterator = iter(
    strategy.experimental_distribute_dataset(
      dataset,
      options=tf.distribute.InputOptions(experimental_fetch_to_device=False),
    )
  )

  @tf.function
  def step():
    emb.enqueue(next(iterator), training=True)

    def replica_fn():
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        loss = sum(tf.reduce_sum(a) for a in activations.values())
      emb.apply_gradients(tape.gradient(loss, activations))
      return activations["dense"]

    return strategy.run(replica_fn)

  result = step()
  assert [t.shape[0] for t in strategy.experimental_local_results(result)] == [
    4,
    4,
  ]


@pytest.mark.parametrize(
  "save_replicas, restore_replicas", [(4, 2), (4, 1), (1, 4)]
)
def test_checkpoints_move_between_layouts(
  save_replicas, restore_replicas, rng, tmp_path
):
  def strategy_for(n):
    return mirrored(n) if n > 1 else tf.distribute.get_strategy()

  saved = make_embedding(
    strategy_for(save_replicas),
    tpe.Adagrad(0.1),
    rng.normal(size=(V_BIG, DIM)),
    rng.normal(size=(V_SMALL, DIM)),
  )
  saved.build()
  path = tf.train.Checkpoint(embedding=saved).save(str(tmp_path / "ckpt"))
  shapes = dict(tf.train.list_variables(path))
  assert shapes["embedding/big/.ATTRIBUTES/VARIABLE_VALUE"] == [V_BIG, DIM]
  assert shapes["embedding/big.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE"] == [
    V_BIG,
    DIM,
  ]
  restored = make_embedding(
    strategy_for(restore_replicas),
    tpe.Adagrad(0.1),
    np.zeros((V_BIG, DIM)),
    np.zeros((V_SMALL, DIM)),
  )
  # Restore before build: values arrive when the variables are created.
  status = tf.train.Checkpoint(embedding=restored).restore(path)
  want, got = full_values(saved), full_values(restored)
  status.assert_consumed()
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_sharded_checkpoint_restores_into_tensorflow_serving(rng, tmp_path):
  strategy = mirrored(4)
  emb = make_embedding(
    strategy,
    tpe.Adagrad(0.1),
    rng.normal(size=(V_BIG, DIM)),
    rng.normal(size=(V_SMALL, DIM)),
  )
  batch = make_batches(rng, steps=1)[0]
  emb.build()
  path = tf.train.Checkpoint(embedding=emb).save(str(tmp_path / "ckpt"))
  tf_emb = tf.tpu.experimental.embedding
  big = tf_emb.TableConfig(V_BIG, DIM, name="big", combiner="sum")
  small = tf_emb.TableConfig(V_SMALL, DIM, name="small")
  serving = tf_emb.TPUEmbeddingForServing(
    {"ragged": tf_emb.FeatureConfig(big), "small": tf_emb.FeatureConfig(small)},
    tf_emb.Adagrad(0.1),
  )
  tf.train.Checkpoint(embedding=serving).restore(path).expect_partial()
  theirs = serving({"ragged": batch["ragged"], "small": batch["small"]})
  ours = emb(batch)
  for key in theirs:
    np.testing.assert_allclose(ours[key], theirs[key], atol=1e-6)


def test_bad_ids_in_a_sharded_step_fail_clearly_and_change_nothing(rng):
  strategy = mirrored(2)
  emb = make_embedding(
    strategy,
    tpe.Adagrad(0.1),
    rng.normal(size=(V_BIG, DIM)),
    rng.normal(size=(V_SMALL, DIM)),
  )
  batches = make_batches(rng, steps=2)
  projection = projections(rng)
  train_sharded(emb, strategy, batches[:1], projection)
  before = full_values(emb)
  bad = dict(batches[1])
  bad["dense"] = tf.constant([0, 1, 2, 3, 4, 5, 6, V_BIG + 5], tf.int64)
  with pytest.raises(
    tf.errors.InvalidArgumentError, match="dense has ids outside \\[0, 41\\)"
  ):
    train_sharded(emb, strategy, [bad], projection)
  after = full_values(emb)
  for key, value in before.items():
    np.testing.assert_array_equal(after[key], value, err_msg=key)
