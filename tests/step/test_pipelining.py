"""Pipelining: lookups one step stale, checked against an explicit schedule.

The reference applies the same one-step-stale schedule by hand with an
unpipelined object: at step ``n`` it looks up (``lookup_for_training``),
then applies step ``n - 1``'s update, then computes step ``n``'s gradients.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy

V, DIM, BATCH, STEPS = 13, 3, 4, 4


# 16-bit tables: the held update rounds with the same draws (the block's
# update count advances once per applied update, held or not).
STORAGES = {
  "float32": tpe.RowStorage(),
  "bfloat16": tpe.RowStorage("bfloat16", slots="bfloat16", seed=3),
  "float16": tpe.RowStorage("float16", seed=4),
}


def make_embedding(
  pipelined,
  init,
  strategy=None,
  combiner="sum",
  storage=STORAGES["float32"],
  optimizer=None,
):
  strategy = strategy or tf.distribute.get_strategy()
  with strategy.scope():
    table = tpe.TableConfig(
      V,
      DIM,
      name="t",
      combiner=combiner,
      initializer=tf.constant_initializer(init),
      storage=storage,
    )
    features = {"a": tpe.FeatureConfig(table), "b": tpe.FeatureConfig(table)}
    return tpe.TPUEmbedding(
      features,
      optimizer or tpe.Adagrad(0.5),
      pipeline_execution_with_tensor_core=pipelined,
      row_sharding_threshold=5,
    )


def batches(rng):
  return [
    {
      "a": tf.constant(rng.integers(0, 4, BATCH)),  # heavy reuse of rows
      "b": tf.ragged.constant(
        [list(rng.integers(0, V, rng.integers(0, 3))) for _ in range(BATCH)],
        dtype=tf.int64,
        ragged_rank=1,
      ),
    }
    for _ in range(STEPS)
  ]


def loss_fn(activations, projection):
  return tf.reduce_sum(activations["a"] * projection) + tf.reduce_sum(
    tf.square(activations["b"])
  )


def reference(
  init,
  data,
  projection,
  combiner="sum",
  flush_after=None,
  storage=STORAGES["float32"],
  optimizer=None,
):
  """The stale schedule, spelled out with an unpipelined object.

  ``flush_after``: the step after which ``flush_pipeline`` is called (its
  held update applied then, once; the next step holds none). Returns each
  step's activations, the table before the last flush, and the variables
  after it.
  """
  emb = make_embedding(
    False, init, combiner=combiner, storage=storage, optimizer=optimizer
  )
  seen, pending = [], None
  for n, features in enumerate(data):
    with tf.GradientTape() as tape:
      activations, apply = emb.lookup_for_training(features)
      tape.watch(activations)
      loss = loss_fn(activations, projection)
    grads = tape.gradient(loss, activations)
    if pending is not None:
      pending[0](pending[1])  # step n-1's update, after step n's lookup
    pending = (apply, grads)
    seen.append(activations)
    if n == flush_after:
      pending[0](pending[1])
      pending = None
  before_flush = emb.embedding_tables[emb_table(emb)].numpy()
  if pending is not None:
    pending[0](pending[1])
  return seen, before_flush, emb.variables["t"]


def emb_table(emb):
  return next(iter(emb.embedding_tables))


def one_device_step(emb, projection):
  """A training step on one device: ``loss_fn`` of the activations."""

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


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_pipelined_steps_follow_the_one_step_stale_schedule(combiner, rng):
  # "mean": a held update of scaled rows (each id's output row's gradient
  # times its combiner scale, held as they are).
  init = rng.normal(size=(V, DIM)).astype(np.float32)
  data, projection = batches(rng), tf.constant(rng.normal(size=(BATCH, DIM)))
  projection = tf.cast(projection, tf.float32)
  want_activations, want_before_flush, want_vars = reference(
    init, data, projection, combiner
  )
  emb = make_embedding(True, init, combiner=combiner)

  step = one_device_step(emb, projection)

  for features, want in zip(data, want_activations, strict=True):
    got = step(features)
    for key in want:
      np.testing.assert_allclose(got[key], want[key], atol=1e-6)
  # The last update is still held back ...
  np.testing.assert_allclose(
    emb.embedding_tables[emb_table(emb)].numpy(), want_before_flush, atol=1e-6
  )
  # ... until flushed.
  emb.flush_pipeline()
  for slot, variable in emb.variables["t"].items():
    np.testing.assert_allclose(
      variable.numpy(), want_vars[slot].numpy(), rtol=1e-5, err_msg=slot
    )


@pytest.mark.parametrize("storage", STORAGES)
def test_flush_then_train_applies_the_held_update_exactly_once(storage, rng):
  """Train 2 steps, flush_pipeline, train 2 more, flush: each step's
  activations and the tables are the schedule's (flushed after step 1),
  exactly; 16-bit tables too, with the same rounding draws."""
  init = rng.normal(size=(V, DIM)).astype(np.float32)
  data = batches(rng)
  projection = tf.constant(rng.normal(size=(BATCH, DIM)), tf.float32)
  want_activations, want_before_flush, want_vars = reference(
    init, data, projection, flush_after=1, storage=STORAGES[storage]
  )
  emb = make_embedding(True, init, storage=STORAGES[storage])

  step = one_device_step(emb, projection)

  for n, (features, want) in enumerate(
    zip(data, want_activations, strict=True)
  ):
    got = step(features)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key], err_msg=f"{n} {key}")
    if n == 1:
      emb.flush_pipeline()
  np.testing.assert_array_equal(
    emb.embedding_tables[emb_table(emb)].numpy(), want_before_flush
  )
  emb.flush_pipeline()
  emb.flush_pipeline()  # Nothing held: no-op.
  for slot, variable in emb.variables["t"].items():
    assert variable.dtype == want_vars[slot].dtype
    np.testing.assert_array_equal(
      variable.numpy(), want_vars[slot].numpy(), err_msg=slot
    )


def test_nothing_held_applies_nothing_for_rules_that_change_every_row(rng):
  """Non-lazy Adam changes every row each step, even one without ids: the
  steps that hold nothing (the first, the one after a flush) must not
  apply an empty update (one extra step of decayed moments each)."""
  init = rng.normal(size=(V, DIM)).astype(np.float32)
  data = batches(rng)
  projection = tf.constant(rng.normal(size=(BATCH, DIM)), tf.float32)

  def adam():
    return tpe.Adam(0.1, lazy_adam=False)

  want_activations, _, want_vars = reference(
    init, data, projection, flush_after=1, optimizer=adam()
  )
  emb = make_embedding(True, init, optimizer=adam())
  step = one_device_step(emb, projection)
  for n, (features, want) in enumerate(
    zip(data, want_activations, strict=True)
  ):
    got = step(features)
    for key in want:  # (eager and traced Adam may differ in the last bit)
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)
    if n == 1:
      emb.flush_pipeline()
      emb.flush_pipeline()  # Nothing held.
  emb.flush_pipeline()
  for slot, variable in emb.variables["t"].items():
    np.testing.assert_allclose(
      variable.numpy(), want_vars[slot].numpy(), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("restore", ["tensorflow", "tpe"])
def test_a_restore_drops_the_held_update(restore, rng, tmp_path):
  """A checkpoint holds no held update: restored while one is held, the
  tables are the checkpoint's, and the update computed before the
  restore never lands on them (nor on the next step)."""
  init = rng.normal(size=(V, DIM)).astype(np.float32)
  data = batches(rng)
  emb = make_embedding(True, init)
  for features in data[:2]:
    emb.enqueue(features)
    activations = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))
  checkpoint = tf.train.Checkpoint(embedding=emb)
  path = tpe.checkpoints.write(checkpoint, str(tmp_path / "c"))
  saved = {k: v.numpy() for k, v in emb.variables["t"].items()}
  emb.enqueue(data[2])
  activations = emb.dequeue()
  emb.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))
  if restore == "tensorflow":
    checkpoint.restore(path)
  else:
    tpe.checkpoints.restore(checkpoint, path)
  emb.flush_pipeline()
  for key, value in emb.variables["t"].items():
    np.testing.assert_array_equal(value.numpy(), saved[key], err_msg=key)
  # A fresh object restored from the checkpoint trains on alike.
  fresh = make_embedding(True, np.zeros_like(init))
  tf.train.Checkpoint(embedding=fresh).restore(path)
  for run in (emb, fresh):
    run.enqueue(data[3])
    activations = run.dequeue()
    run.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))
    run.flush_pipeline()
  for key, value in emb.variables["t"].items():
    np.testing.assert_array_equal(
      value.numpy(), fresh.variables["t"][key].numpy(), err_msg=key
    )


def test_tpe_restore_drops_the_held_update_whoever_saved(rng, tmp_path):
  """A checkpoint an unpipelined object wrote (no
  ``_pipeline/held_update`` entry): ``tpe.checkpoints.restore`` drops the
  held update all the same."""
  init = rng.normal(size=(V, DIM)).astype(np.float32)
  data = batches(rng)
  unpipelined = make_embedding(False, init)
  unpipelined.build()
  path = tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=unpipelined), str(tmp_path / "c")
  )
  emb = make_embedding(True, init)
  emb.enqueue(data[0])
  activations = emb.dequeue()
  emb.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))
  tpe.checkpoints.restore(tf.train.Checkpoint(embedding=emb), path)
  emb.flush_pipeline()
  np.testing.assert_array_equal(emb.variables["t"]["parameters"].numpy(), init)


def test_loading_keras_weights_drops_the_held_update(rng, tmp_path):
  """The Keras layer's weights loaded while ``fit`` left an update held:
  the flush applies nothing on the loaded tables."""
  from tpu_embedding.layers import TPUEmbedding
  from tpu_embedding.layers.keras_compat import keras

  table = tpe.TableConfig(V, DIM, name="t")
  inputs = {"a": keras.Input(shape=(), dtype="int64", name="a")}
  layer = TPUEmbedding(
    {"a": tpe.FeatureConfig(table)}, tpe.SGD(0.5), True, name="embedding"
  )
  model = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)["a"]))
  model.compile(optimizer="sgd", loss="mse")
  x, y = {"a": rng.integers(0, V, 8)}, np.ones((8, 1), np.float32)
  model.fit(x, y, batch_size=4, verbose=0)
  layer.mid_level_api.flush_pipeline()
  path = str(tmp_path / "model.weights.h5")
  model.save_weights(path)
  saved = layer.embedding_tables[table].numpy()
  model.fit(x, y, batch_size=4, verbose=0)  # holds its last update
  model.load_weights(path)
  layer.mid_level_api.flush_pipeline()
  np.testing.assert_array_equal(layer.embedding_tables[table].numpy(), saved)


def test_pipelining_changes_results_compared_to_unpipelined(rng):
  init = rng.normal(size=(V, DIM)).astype(np.float32)
  data = batches(rng)
  outputs = {}
  for pipelined in (False, True):
    emb = make_embedding(pipelined, init)
    for features in data:
      emb.enqueue(features)
      activations = emb.dequeue()
      emb.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))
    outputs[pipelined] = activations["a"].numpy()
  assert not np.allclose(outputs[True], outputs[False])


@pytest.mark.parametrize("storage", ["float32", "bfloat16"])
def test_pipelined_sharded_equals_pipelined_single_device(storage, rng):
  init = rng.normal(size=(V, DIM)).astype(np.float32)
  data = batches(rng)
  single = make_embedding(True, init, storage=STORAGES[storage])
  for features in data:
    single.enqueue(features)
    activations = single.dequeue()
    single.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))
  single.flush_pipeline()

  strategy = mirrored_strategy(2)
  sharded = make_embedding(True, init, strategy, storage=STORAGES[storage])
  assert sharded.sharding_plan.placements["t"].sharded

  @tf.function
  def step(features):
    sharded.enqueue(
      strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.nest.map_structure(
          lambda t: t[ctx.replica_id_in_sync_group * 2 :][:2], features
        )
      )
    )

    def replica_fn():
      activations = sharded.dequeue()
      sharded.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))

    strategy.run(replica_fn)

  for features in data:
    step(features)
  held = tf.convert_to_tensor(sharded.variables["t"]["parameters"]).numpy()
  # Outside strategy.run: one line naming the call, and nothing applied.
  with pytest.raises(
    RuntimeError,
    match=r"^flush_pipeline under MirroredStrategy with 2 replicas must run "
    r"inside strategy.run: .*\(strategy.run\(embedding.flush_pipeline\)\)\.$",
  ):
    sharded.flush_pipeline()
  np.testing.assert_array_equal(
    tf.convert_to_tensor(sharded.variables["t"]["parameters"]).numpy(), held
  )
  strategy.run(tf.function(sharded.flush_pipeline))
  np.testing.assert_allclose(
    tf.convert_to_tensor(sharded.variables["t"]["parameters"]).numpy(),
    single.variables["t"]["parameters"].numpy(),
    atol=1e-5,
  )


def test_inference_lookups_do_not_apply_the_held_update(rng):
  init = rng.normal(size=(V, DIM)).astype(np.float32)
  emb = make_embedding(True, init)
  features = batches(rng)[0]
  emb.enqueue(features)
  activations = emb.dequeue()
  emb.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))
  emb.enqueue(features, training=False)
  emb.dequeue()
  emb(features)
  np.testing.assert_array_equal(emb.variables["t"]["parameters"].numpy(), init)
  emb.flush_pipeline()
  assert not np.array_equal(emb.variables["t"]["parameters"].numpy(), init)


@pytest.mark.parametrize("pipelined", [True])
def test_flush_without_pending_update_is_a_no_op(pipelined, rng):
  init = rng.normal(size=(V, DIM)).astype(np.float32)
  emb = make_embedding(pipelined, init)
  emb.build()
  emb.flush_pipeline()
  np.testing.assert_array_equal(emb.variables["t"]["parameters"].numpy(), init)


def make_mixed(pipelined, optimizer, strategy=None, sharded=True):
  """Replicated tables fed by dense inputs only ("s": ids [batch], "m":
  [batch, 2] with "mean"), and with ``sharded`` a row-sharded one ("big",
  ragged inputs); one feature per table (the sharded sums equal one
  device's bit for bit)."""
  rng = np.random.default_rng(5)
  tables = {
    name: tpe.TableConfig(
      rows,
      DIM,
      name=name,
      combiner=combiner,
      initializer=tf.constant_initializer(rng.normal(size=(rows, DIM))),
    )
    for name, rows, combiner in [
      ("s", 7, "sum"),
      ("m", 9, "mean"),
      ("big", 40, "sum"),
    ]
  }
  names = {"c": "s", "d": "m", "a": "big"}
  if not sharded:
    del names["a"]
  with (strategy or tf.distribute.get_strategy()).scope():
    return tpe.TPUEmbedding(
      {f: tpe.FeatureConfig(tables[t], name=f) for f, t in names.items()},
      optimizer(),
      pipeline_execution_with_tensor_core=pipelined,
      row_sharding_threshold=20,
    )


def mixed_batches(rng, size, sharded):
  out = []
  for _ in range(STEPS):
    batch = {
      "c": tf.constant(rng.integers(0, 7, size)),
      "d": tf.constant(rng.integers(0, 9, (size, 2))),
    }
    if sharded:
      batch["a"] = tf.ragged.constant(
        [list(rng.integers(0, 40, rng.integers(0, 3))) for _ in range(size)],
        dtype=tf.int64,
        ragged_rank=1,
      )
    out.append(batch)
  return out


def square_loss(activations):
  return sum(tf.reduce_sum(x * x) for x in tf.nest.flatten(activations))


@pytest.mark.parametrize(
  "replicas, optimizer, sharded",
  [
    (2, tpe.SGD, False),
    (2, tpe.Adagrad, True),
    (2, tpe.SGD, True),
    (1, tpe.Adagrad, True),  # One replica: every table replicated.
  ],
)
def test_pipelined_replicated_tables_of_dense_inputs_under_mirrored(
  replicas, optimizer, sharded, rng
):
  """Replicated tables (under the threshold, or all tables on one replica)
  whose inputs are dense: their held update's lengths are static, and
  once failed (``indices[0] = 0 is not in [0, 0)``) at the first step and
  the step after a flush, which take an empty held update. Each step's
  activations and the variables equal the one-step-stale schedule on one
  device, flushed after step 1, bit for bit."""
  data = mixed_batches(rng, replicas * BATCH, sharded)
  reference = make_mixed(False, optimizer, sharded=sharded)
  want, pending = [], None
  for n, features in enumerate(data):
    with tf.GradientTape() as tape:
      activations, apply = reference.lookup_for_training(features)
      tape.watch(activations)
      loss = square_loss(activations)
    grads = tape.gradient(loss, activations)
    if pending is not None:
      pending[0](pending[1])
    pending = (apply, grads)
    want.append(activations)
    if n == 1:
      pending[0](pending[1])
      pending = None
  pending[0](pending[1])

  strategy = mirrored_strategy(replicas)
  emb = make_mixed(True, optimizer, strategy, sharded)

  @tf.function
  def step(features):
    emb.enqueue(
      strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.nest.map_structure(
          lambda t: t[ctx.replica_id_in_sync_group * BATCH :][:BATCH],
          features,
        )
      )
    )

    def replica_fn():
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        loss = square_loss(activations)
      emb.apply_gradients(tape.gradient(loss, activations))
      return activations

    return strategy.run(replica_fn)

  flush = tf.function(emb.flush_pipeline)
  for n, features in enumerate(data):
    got = step(features)
    for key in want[n]:
      np.testing.assert_array_equal(
        np.concatenate(
          [np.asarray(t) for t in strategy.experimental_local_results(got[key])]
        ),
        want[n][key],
        err_msg=f"{n} {key}",
      )
    if n == 1:
      strategy.run(flush)
  strategy.run(flush)
  layouts = {name: store.layout for name, store in emb.table_stores.items()}
  assert layouts["s"] == layouts["m"] == "replicated"
  if sharded:
    assert layouts["big"] == ("row_sharded" if replicas > 1 else "replicated")
  for table, slots in reference.variables.items():
    for slot, variable in slots.items():
      np.testing.assert_array_equal(
        tf.convert_to_tensor(emb.variables[table][slot]).numpy(),
        variable.numpy(),
        err_msg=f"{table}/{slot}",
      )
