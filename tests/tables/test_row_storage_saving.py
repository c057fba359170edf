"""16-bit tables (``RowStorage``): their configs, checkpoints, exports and
refusals, as a user meets them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy
from tpu_embedding.engines.tpu_conversion import to_tf_table
from tpu_embedding.export.saved_model import export_for_serving

ROWS, DIM = 30, 4
BFLOAT16 = tpe.RowStorage("bfloat16", slots="bfloat16", seed=3)


def storage_of(dtype: str) -> tpe.RowStorage:
  """Parameters in ``dtype``; slots in bfloat16 where 16 bits (Adagrad's
  take no float16)."""
  return tpe.RowStorage(dtype, "float32" if dtype == "float32" else "bfloat16")


def make(storage=BFLOAT16, strategy=None, optimizer=None, threshold=0):
  strategy = strategy or tf.distribute.get_strategy()
  with strategy.scope():
    table = tpe.TableConfig(
      ROWS,
      DIM,
      name="t",
      initializer=tf.random_uniform_initializer(-1, 1, seed=2),
      storage=storage,
    )
    return tpe.TPUEmbedding(
      {"f": tpe.FeatureConfig(table)},
      optimizer or tpe.Adagrad(0.5),
      row_sharding_threshold=threshold,
    )


def train(emb, steps=3, strategy=None):
  strategy = strategy or tf.distribute.get_strategy()
  replicas = strategy.num_replicas_in_sync

  @tf.function
  def step(ids):
    emb.enqueue({"f": ids}, training=True)

    def fn():
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        loss = tf.reduce_sum(activations["f"] ** 2)
      emb.apply_gradients(tape.gradient(loss, activations))

    strategy.run(fn)

  for i in range(steps):
    ids = (np.arange(8 * replicas) * 7 + i) % ROWS
    if replicas == 1:
      step(tf.constant(ids, tf.int64))
    else:
      step(
        strategy.experimental_distribute_values_from_function(
          lambda ctx, ids=ids: tf.constant(
            ids[ctx.replica_id_in_sync_group * 8 :][:8], tf.int64
          )
        )
      )


def values(emb):
  return {
    key: np.asarray(tf.convert_to_tensor(v))
    for key, v in emb.variables["t"].items()
  }


def restore(emb, path, when, after_build="tensorflow"):
  """Restores ``path`` into ``emb`` before its build, or after it with
  TensorFlow's ``Checkpoint.restore`` or ``tpe.checkpoints.restore``."""
  checkpoint = tf.train.Checkpoint(embedding=emb)
  if when == "before_build":
    checkpoint.restore(path).expect_partial()
    emb.build()
  elif after_build == "tensorflow":
    emb.build()
    checkpoint.restore(path).expect_partial()
  else:
    emb.build()
    tpe.checkpoints.restore(checkpoint, path)


def test_storage_is_part_of_the_table_config():
  table = tpe.TableConfig(ROWS, DIM, name="t", storage=BFLOAT16)
  data = json.loads(json.dumps(table.get_config()))
  again = tpe.TableConfig.from_config(data)
  assert again.storage == BFLOAT16
  assert "storage=RowStorage(dtype='bfloat16'" in repr(again)
  assert "storage" not in repr(tpe.TableConfig(ROWS, DIM))
  # A config saved before storage existed loads as float32.
  del data["storage"]
  assert tpe.TableConfig.from_config(data).storage == tpe.RowStorage()
  with pytest.raises(ValueError, match="must be a tpu_embedding.RowStorage"):
    tpe.TableConfig(ROWS, DIM, storage="bfloat16")


@pytest.mark.parametrize("when", ["before_build", "after_build"])
def test_a_checkpoint_holds_the_stored_types_and_restores_them(when, tmp_path):
  emb = make()
  train(emb)
  want = values(emb)
  path = tf.train.Checkpoint(embedding=emb).save(str(tmp_path / "c"))
  dtypes = tf.train.load_checkpoint(path).get_variable_to_dtype_map()
  assert dtypes["embedding/t/.ATTRIBUTES/VARIABLE_VALUE"] == tf.bfloat16
  restored = make()
  restore(restored, path, when)
  got = values(restored)
  for key, value in want.items():
    assert got[key].dtype == value.dtype, key
    np.testing.assert_array_equal(got[key], value, err_msg=key)


@pytest.mark.parametrize(
  "layout,when",
  [
    ("one_device", "before_build"),
    ("one_device", "after_build"),
    ("row_sharded", "after_build"),
    ("stacked", "before_build"),
  ],
)
def test_a_resumed_run_draws_as_the_uninterrupted_run(layout, when, tmp_path):
  """The update count (the draws' step) is saved with the table: a run
  restored from step 3's checkpoint continues bit for bit as the run that
  went on."""
  strategy = mirrored_strategy(2) if layout == "row_sharded" else None

  def embedding():
    if layout != "stacked":
      return make(strategy=strategy)
    inits = {"t": tf.ones_initializer(), "u": tf.zeros_initializer()}
    tables = [
      tpe.TableConfig(ROWS, DIM, name=name, initializer=init, storage=BFLOAT16)
      for name, init in inits.items()
    ]
    return tpe.TPUEmbedding(
      {"f": tpe.FeatureConfig(tables[0]), "g": tpe.FeatureConfig(tables[1])},
      tpe.Adagrad(0.5),
      table_stacking=[["t", "u"]],
    )

  def train_both(emb):
    if layout != "stacked":
      return train(emb, strategy=strategy)
    for i in range(3):
      ids = tf.constant((np.arange(8) * 7 + i) % ROWS, tf.int64)
      emb.enqueue({"f": ids, "g": ids}, training=True)
      activations = emb.dequeue()
      emb.apply_gradients(tf.nest.map_structure(lambda a: a - 0.3, activations))

  went_on = embedding()
  train_both(went_on)
  path = tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=went_on), str(tmp_path / "c")
  )
  saved = dict(tf.train.list_variables(path))
  assert saved["embedding/t.Supdate_count/.ATTRIBUTES/VARIABLE_VALUE"] == []
  assert (
    tf.train.load_variable(
      path, "embedding/t.Supdate_count/.ATTRIBUTES/VARIABLE_VALUE"
    )
    == 3
  )
  train_both(went_on)

  resumed = embedding()
  restore(resumed, path, when, "tpe")
  train_both(resumed)
  for key, value in values(went_on).items():
    np.testing.assert_array_equal(values(resumed)[key], value, err_msg=key)


@pytest.mark.parametrize("replicas", [1, 2])
def test_delta_checkpoints_restore_and_resume_bit_for_bit(replicas, tmp_path):
  """A full checkpoint and a delta restore the 16-bit values in their
  types, and the update count: training on continues as the run did."""
  strategy = mirrored_strategy(2) if replicas == 2 else None
  emb = make(strategy=strategy)
  train(emb, strategy=strategy)
  checkpoint = tf.train.Checkpoint(embedding=emb)
  base = tpe.checkpoints.write(checkpoint, str(tmp_path / "full"))
  train(emb, 2, strategy=strategy)
  delta = tpe.checkpoints.write_delta(checkpoint, str(tmp_path / "delta-2"))
  train(emb, 1, strategy=strategy)
  went_on = values(emb)
  again = make(strategy=strategy)
  again.build()
  tpe.checkpoints.restore(
    tf.train.Checkpoint(embedding=again), base, deltas=[delta]
  )
  assert again.variables["t"]["parameters"].dtype == tf.bfloat16
  train(again, 1, strategy=strategy)
  for key, value in values(again).items():
    np.testing.assert_array_equal(value, went_on[key], err_msg=key)


def make_pair(stacked: bool, storage=BFLOAT16):
  """Tables t and u (bfloat16), stacked or apart."""
  tables = [
    tpe.TableConfig(
      rows,
      DIM,
      name=name,
      initializer=tf.random_uniform_initializer(-1, 1, seed=seed),
      storage=storage,
    )
    for name, rows, seed in (("t", ROWS, 1), ("u", ROWS + 7, 2))
  ]
  return tpe.TPUEmbedding(
    {"f": tpe.FeatureConfig(tables[0]), "g": tpe.FeatureConfig(tables[1])},
    tpe.Adagrad(0.3),
    table_stacking=[["t", "u"]] if stacked else None,
  )


@pytest.mark.parametrize("saved_stacked", [True, False])
@pytest.mark.parametrize("when", ["before_build", "after_build"])
def test_stacked_tables_save_their_stored_type(saved_stacked, when, tmp_path):
  """A stack's members save as 16 bits under their own keys, as unstacked
  tables do: checkpoints move between stacked and unstacked layouts."""
  emb = make_pair(saved_stacked)
  for i in range(3):
    ids = tf.constant((np.arange(8) * 7 + i) % ROWS, tf.int64)
    emb.enqueue({"f": ids, "g": ids}, training=True)
    activations = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(lambda a: a - 0.3, activations))
  want = {
    (t, k): np.asarray(tf.convert_to_tensor(v))
    for t, keys in emb.variables.items()
    for k, v in keys.items()
  }
  assert {str(v.dtype) for v in want.values()} == {"bfloat16"}
  path = tf.train.Checkpoint(embedding=emb).save(str(tmp_path / "c"))
  types = tf.train.load_checkpoint(path).get_variable_to_dtype_map()
  assert types["embedding/u.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE"] == (
    tf.bfloat16
  )
  other = make_pair(not saved_stacked)
  restore(other, path, when)
  for (table, key), value in want.items():
    got = tf.convert_to_tensor(other.variables[table][key])
    assert got.dtype == tf.bfloat16
    np.testing.assert_array_equal(got.numpy(), value, err_msg=f"{table}/{key}")


@pytest.mark.parametrize("file", ["model.weights.h5", "model.keras"])
def test_keras_files_keep_the_update_count(file, tmp_path):
  """The Keras layer's weights files hold a 16-bit table's update count:
  a loaded model trains on as the saved one does."""
  from tpu_embedding.layers import TPUEmbedding
  from tpu_embedding.layers.keras_compat import keras

  def model():
    table = tpe.TableConfig(
      ROWS,
      DIM,
      name="t",
      initializer=tf.random_uniform_initializer(-1, 1, seed=1),
      storage=BFLOAT16,
    )
    inputs = {"f": keras.Input(shape=(), dtype="int64", name="f")}
    layer = TPUEmbedding(
      {"f": tpe.FeatureConfig(table)}, tpe.Adagrad(0.2), name="embedding"
    )
    made = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)["f"]))
    made.compile(optimizer="sgd", loss="mse")
    return made

  x, y = {"f": np.arange(8) * 5 % ROWS}, np.ones((8, 1), np.float32)

  def fit(made):
    made.fit(x, y, epochs=1, batch_size=4, verbose=0, shuffle=False)

  def table(made):
    api = made.get_layer("embedding").mid_level_api
    return tf.convert_to_tensor(api.variables["t"]["parameters"]).numpy()

  went_on = model()
  fit(went_on)
  path = str(tmp_path / file)
  if file.endswith(".keras"):
    went_on.save(path)
    loaded = keras.models.load_model(path)
  else:
    went_on.save_weights(path)
    loaded = model()
    loaded.load_weights(path)
  assert (
    loaded.get_layer("embedding").mid_level_api.table_stores["t"].update_count()
    == 2
  )
  fit(went_on)
  fit(loaded)
  np.testing.assert_array_equal(table(loaded), table(went_on))


@pytest.mark.parametrize("threshold", [0, 100])  # row-sharded, replicated
def test_serving_lookups_of_mirrored_tables_read_float32(threshold):
  """A serving lookup outside ``strategy.run`` reads a replica's rows (a
  row block's, or a copy's): float32, the stored values."""
  strategy = mirrored_strategy(2)
  emb = make(strategy=strategy, threshold=threshold)
  train(emb, strategy=strategy)
  want = values(emb)["parameters"].astype(np.float32)
  ids = tf.constant([3, 29, 0, 3], tf.int64)
  got = tpe.serving_embedding_lookup(
    {"f": ids}, None, emb.embedding_tables, emb.feature_config
  )["f"]
  assert got.dtype == tf.float32
  np.testing.assert_array_equal(got.numpy(), want[ids.numpy()])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_sharded_checkpoint_restores_on_one_device(dtype, tmp_path):
  """Slices of the stored type (TensorFlow reads no float16 slice: read
  by bytes), restored before and after build."""
  storage = tpe.RowStorage(dtype, slots="bfloat16", seed=3)
  strategy = mirrored_strategy(2)
  emb = make(storage, strategy=strategy)
  train(emb, strategy=strategy)
  assert emb.sharding_plan.placements["t"].kind == "row_sharded"
  want = values(emb)
  path = tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=emb), str(tmp_path / "c")
  )
  one = make(storage)
  tf.train.Checkpoint(embedding=one).restore(path).expect_partial()
  one.build()
  for key, value in values(one).items():
    np.testing.assert_array_equal(value, want[key], err_msg=key)
  built = make(storage)
  built.build()
  tpe.checkpoints.restore(tf.train.Checkpoint(embedding=built), path)
  for key, value in values(built).items():
    np.testing.assert_array_equal(value, want[key], err_msg=key)
  # And back into two replicas' blocks, built first.
  again = make(storage, strategy=strategy)
  again.build()
  tpe.checkpoints.restore(tf.train.Checkpoint(embedding=again), path)
  for key, value in values(again).items():
    np.testing.assert_array_equal(value, want[key], err_msg=key)


@pytest.mark.parametrize("when", ["before_build", "after_build"])
@pytest.mark.parametrize(
  "saved, restored, replicas",
  [
    ("float32", "bfloat16", 1),
    ("bfloat16", "float32", 1),
    ("float16", "bfloat16", 1),
    ("float32", "float16", 2),
    ("bfloat16", "float32", 2),
    ("bfloat16", "float16", "2_replicated"),
  ],
)
def test_a_checkpoint_restores_into_another_stored_type(
  saved, restored, replicas, when, tmp_path
):
  """Values cast to the new type (round to nearest: exact to float32),
  on one device and into two replicas' blocks and copies; before build
  (restore-on-create) or after (``tpe.checkpoints.restore``)."""
  emb = make(storage_of(saved))
  train(emb)
  path = tf.train.Checkpoint(embedding=emb).save(str(tmp_path / "c"))
  want = values(emb)
  copies = replicas == "2_replicated"
  strategy = mirrored_strategy(2) if replicas != 1 else None
  threshold = 1000 if copies else 20
  other = make(storage_of(restored), strategy, threshold=threshold)
  restore(other, path, when, "tpe")
  if replicas != 1:
    kind = other.sharding_plan.placements["t"].kind
    assert kind == ("replicated" if copies else "row_sharded"), kind
  got = values(other)
  for key, value in want.items():
    stored = getattr(
      storage_of(restored), "dtype" if key == "parameters" else "slots"
    )
    assert got[key].dtype == tf.as_dtype(stored).as_numpy_dtype, key
    expected = tf.cast(tf.cast(value, tf.float32), stored).numpy()
    np.testing.assert_array_equal(got[key], expected, err_msg=key)


@pytest.mark.parametrize("when", ["before_build", "after_build"])
def test_a_float32_checkpoint_restores_into_a_16_bit_stack(when, tmp_path):
  """Stack members read another type part by part (to nearest)."""
  emb = make_pair(False, tpe.RowStorage())
  emb.build()
  want = {
    (t, k): np.asarray(tf.convert_to_tensor(v))
    for t, keys in emb.variables.items()
    for k, v in keys.items()
  }
  path = tf.train.Checkpoint(embedding=emb).save(str(tmp_path / "c"))
  stacked = make_pair(True)
  restore(stacked, path, when, "tpe")
  for (table, key), value in want.items():
    got = tf.convert_to_tensor(stacked.variables[table][key])
    assert got.dtype == tf.bfloat16, (table, key)
    expected = tf.cast(value, tf.bfloat16).numpy()
    np.testing.assert_array_equal(got.numpy(), expected, err_msg=table)


@pytest.mark.parametrize("table_dtype", ["float32", "bfloat16"])
def test_an_export_serves_the_trained_values_exactly(table_dtype, tmp_path):
  emb = make()
  train(emb)
  export_for_serving(
    str(tmp_path / "model"),
    emb,
    None,
    {"f": tf.TensorSpec([None], tf.int64)},
    table_dtype=table_dtype,
  )
  served = tf.saved_model.load(str(tmp_path / "model"))
  ids = tf.constant(np.arange(ROWS), tf.int64)
  got = served.signatures["serving_default"](f=ids)
  (activations,) = got.values()
  want = tf.cast(values(emb)["parameters"], tf.float32).numpy()
  np.testing.assert_array_equal(activations.numpy(), want)


def test_bad_combinations_are_refused_naming_the_table():
  cases = [
    (
      lambda: make(tpe.RowStorage("float16", slots="float16")).build(),
      "Table 't': Adagrad slots cannot be stored as float16",
    ),
    (
      lambda: make(
        tpe.RowStorage("bfloat16", slots="bfloat16"), optimizer=tpe.Adam(0.1)
      ).build(),
      "Table 't': Adam slots cannot be stored as bfloat16",
    ),
    (
      lambda: to_tf_table(tpe.TableConfig(4, 2, name="t", storage=BFLOAT16)),
      "Table 't' is stored as bfloat16 .RowStorage.: TensorFlow's TPU",
    ),
  ]
  for call, message in cases:
    with pytest.raises(ValueError, match=message):
      call()


@pytest.mark.parametrize("optimizer", ["sgd", "ftrl"])
def test_a_float16_value_past_65504_stops_the_step_naming_the_table(
  optimizer,
):
  """SGD's fused kernel and FTRL's TensorFlow path alike; the table is
  left as it was."""
  rule = tpe.SGD(1e5) if optimizer == "sgd" else tpe.FTRL(1e5)
  emb = make(tpe.RowStorage("float16"), optimizer=rule)
  emb.build()
  before = values(emb)
  with pytest.raises(
    tf.errors.InvalidArgumentError,
    match=r"Table \W*t\W*: a float16 parameters (or slot )?value exceeds "
    r"65504, the largest float16 \(or is NaN\); store it as bfloat16",
  ) as raised:
    train(emb, steps=1)
  assert "Condition" not in raised.value.message  # (no operand dump)
  for key, value in values(emb).items():
    np.testing.assert_array_equal(value, before[key], err_msg=key)
  # Nor did it count as an update: the stochastic draws are not shifted.
  store = emb.table_stores["t"]
  assert [int(r.step()) for r in store._rounding] == [0]  # noqa: SLF001
