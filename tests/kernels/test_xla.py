"""Steps and lookups compiled by XLA equal the same ones without it.

The oracle is this package without XLA (itself checked against numpy and
TensorFlow elsewhere), on the same batches: every input kind (dense,
multi-hot, ragged with weights, sparse, sequences truncated), several
optimizers, the mid-level API and the Keras layers' ``fit``. XLA fuses
the optimizers' element-wise math, so numbers agree to float32 rounding
(1e-5), not bit for bit. ``unique_static`` has its own numpy oracle.
Where XLA cannot compile a step (several replicas, dynamic vocabularies),
the answer is one line, or Keras' own fallback for the layers.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.backends import test_sharded as sharded
from tests.conftest import mirrored_strategy
from tests.layers import test_distributed_embedding as keras_rs_tests
from tpu_embedding.kernels.static_unique import PADDING_ID
from tpu_embedding.kernels.static_unique import unique_static
from tpu_embedding.layers.keras_compat import keras


@pytest.mark.parametrize("size", [0, 1, 9, 64])
def test_unique_static_equals_numpy(size, rng):
  parts = [rng.integers(0, 12, size), rng.integers(0, 5, size // 2)]
  offsets = [0, 20]
  unique, index = unique_static(
    [tf.constant(p, tf.int64) for p in parts], offsets
  )
  whole = np.concatenate([parts[0], parts[1] + 20])
  distinct = np.unique(whole)
  unique, index = unique.numpy(), index.numpy()
  assert unique.shape == whole.shape and index.shape == whole.shape
  np.testing.assert_array_equal(unique[: len(distinct)], distinct)
  assert (unique[len(distinct) :] == PADDING_ID).all()
  np.testing.assert_array_equal(unique[index], whole)


def train(emb, batches, projection, jit_compile):
  """``test_sharded``'s one-device step, compiled by XLA or not."""

  @tf.function(jit_compile=jit_compile)
  def step(features):
    emb.enqueue(features)
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = sharded.loss_fn(activations, projection)
    emb.apply_gradients(tape.gradient(loss, activations))
    return activations

  return [step(b) for b in batches]


@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "ftrl"])
def test_mid_level_step_under_xla_equals_without(optimizer, rng):
  """Dense, multi-hot, ragged and truncated sequence features of two
  tables; Adam and FTRL would move a row given a zero gradient, so a
  padding slot reaching a real row would show."""
  big = rng.normal(size=(sharded.V_BIG, sharded.DIM)).astype(np.float32)
  small = rng.normal(size=(sharded.V_SMALL, sharded.DIM)).astype(np.float32)
  batches, projection = sharded.make_batches(rng), sharded.projections(rng)
  results = []
  for jit_compile in (False, True):
    emb = sharded.make_embedding(
      tf.distribute.get_strategy(),
      sharded.OPTIMIZERS[optimizer](),
      big,
      small,
    )
    activations = train(emb, batches, projection, jit_compile)
    results.append((activations, sharded.full_values(emb)))
  (want_acts, want), (got_acts, got) = results
  for step, (w, g) in enumerate(zip(want_acts, got_acts, strict=True)):
    for key in w:
      np.testing.assert_allclose(
        g[key], w[key], atol=1e-5, err_msg=f"step {step} {key}"
      )
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, atol=1e-5, err_msg=key)


def test_sparse_and_serving_lookups_under_xla():
  """A sparse feature and a dense one sharing a table (sqrtn), trained a
  step without XLA, then a step with it (or without): same rows; then
  TensorFlow's serving lookup compiled and not."""
  table = tpe.TableConfig(
    9,
    2,
    name="t",
    combiner="sqrtn",
    initializer=tf.constant_initializer(np.arange(18.0).reshape(9, 2)),
  )
  features = {"s": tpe.FeatureConfig(table), "d": tpe.FeatureConfig(table)}
  ids = {
    "s": tf.sparse.from_dense(tf.constant([[3, 0], [8, 3]], tf.int64)),
    "d": tf.constant([[1, 1], [2, 7]], tf.int64),
  }
  results = []
  for jit_compile in (False, True):
    emb = tpe.TPUEmbedding(features, tpe.Adagrad(0.5))

    def step(ids, emb=emb):
      emb.enqueue(ids, training=True)
      activations = emb.dequeue()
      emb.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))
      return activations

    tf.function(step)(ids)
    activations = tf.function(step, jit_compile=jit_compile)(ids)
    results.append((activations, emb.variables["t"]))
  (want, want_tables), (got, got_tables) = results
  for key in want:
    np.testing.assert_allclose(got[key], want[key], atol=1e-6, err_msg=key)
  for slot, variable in want_tables.items():
    np.testing.assert_allclose(
      got_tables[slot].numpy(), variable.numpy(), atol=1e-6, err_msg=slot
    )

  dense = {"d": ids["d"], "s": tf.constant([[4, 4], [0, 8]], tf.int64)}

  def serve(ids):
    return tpe.serving_embedding_lookup(
      ids, None, {table: got_tables["parameters"]}, features
    )

  compiled = tf.function(serve, jit_compile=True)(dense)
  for key, value in tf.function(serve)(dense).items():
    np.testing.assert_array_equal(compiled[key], value)


def test_dynamic_vocabularies_refuse_xla_in_one_line():
  table = tpe.TableConfig(
    16, 2, name="users", vocabulary=tpe.DynamicVocabulary(bucket_size=4)
  )
  emb = tpe.TPUEmbedding({"u": tpe.FeatureConfig(table)}, tpe.SGD(0.1))

  @tf.function(jit_compile=True)
  def step(keys):
    emb.enqueue({"u": keys}, training=True)
    return emb.dequeue()

  with pytest.raises(ValueError) as raised:
    step(tf.constant([5, 7], tf.int64))
  message = str(raised.value)
  assert "XLA (jit_compile=True)" in message
  assert "with dynamic vocabularies (users)" in message


def _fit(strategy, jit_compile):
  original = keras.Model.compile

  def compile_with(self, *args, **kwargs):
    return original(self, *args, **{**kwargs, "jit_compile": jit_compile})

  keras.Model.compile = compile_with
  try:
    model, x = keras_rs_tests.train_tutorial_like(strategy)
  finally:
    keras.Model.compile = original
  return model, x


def test_keras_fit_with_jit_compile_equals_without():
  """keras-rs' layer (every placement) in a model compiled with XLA."""
  want, x = _fit(tf.distribute.get_strategy(), False)
  got, _ = _fit(tf.distribute.get_strategy(), True)
  assert got.jit_compile is True  # Keras kept XLA: the layers support it.
  tables = got.embedding_layer.get_embedding_tables()
  for name, table in want.embedding_layer.get_embedding_tables().items():
    np.testing.assert_allclose(tables[name], table, atol=1e-6, err_msg=name)
  np.testing.assert_allclose(
    got.predict(x, verbose=0), want.predict(x, verbose=0), atol=1e-6
  )


def test_keras_under_two_replicas_proceeds_without_xla():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model, _ = _fit(mirrored_strategy(2), True)
  assert model.jit_compile is False
  assert any("jit_compile=True" in str(w.message) for w in caught)


def test_truncated_sequence_on_a_later_stack_member_moves_no_other_row():
  """Tables ``a`` and ``b`` stacked (``b`` after ``a``: its ids offset by
  ``a``'s rows); ``b``'s sequence feature keeps 2 of up to 4 ids. Under
  XLA the truncated ids stay as padding, which must reach no row: FTRL
  moves any row it updates, even with a zero gradient, so a padding id
  landing on a real row would show. Rows nobody looked up keep their
  initial values; the rest equal the same steps without XLA."""
  rng = np.random.default_rng(5)
  rows = {"a": 7, "b": 11}
  init = {
    n: rng.uniform(-1, 1, (r, 2)).astype(np.float32) for n, r in rows.items()
  }
  batches = [
    {
      "a": tf.constant([0, 2, 2, 4], tf.int64),
      "b": tf.ragged.constant([[1, 3, 9, 10], [3], [5, 1, 8], []], tf.int64),
    },
    {
      "a": tf.constant([1, 1, 3, 0], tf.int64),
      "b": tf.ragged.constant([[2, 5, 6, 7], [9, 10], [], [1]], tf.int64),
    },
  ]
  kept = {"a": {0, 1, 2, 3, 4}, "b": {1, 3, 5, 2, 9, 10}}
  results = []
  for jit_compile in (False, True):
    tables = {
      n: tpe.TableConfig(
        r, 2, name=n, initializer=tf.constant_initializer(init[n])
      )
      for n, r in rows.items()
    }
    emb = tpe.TPUEmbedding(
      {
        "a": tpe.FeatureConfig(tables["a"]),
        "b": tpe.FeatureConfig(tables["b"], max_sequence_length=2),
      },
      tpe.FTRL(0.5, l1_regularization_strength=0.01),
      table_stacking=[["a", "b"]],
    )

    @tf.function(jit_compile=jit_compile)
    def step(features, emb=emb):
      emb.enqueue(features, training=True)
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        loss = tf.reduce_sum(activations["a"]) + tf.reduce_sum(
          activations["b"] * tf.constant([1.0, -2.0])
        )
      emb.apply_gradients(tape.gradient(loss, activations))

    for batch in batches:
      step(batch)
    stores = emb.table_stores
    assert stores["b"].stack is stores["a"].stack  # b after a in one store
    assert (stores["a"].offset, stores["b"].offset) == (0, rows["a"])
    results.append(sharded.full_values(emb))
  want, got = results
  for name, count in rows.items():
    untouched = sorted(set(range(count)) - kept[name])
    np.testing.assert_array_equal(
      got[(name, "parameters")][untouched], init[name][untouched], err_msg=name
    )
    assert not np.array_equal(
      got[(name, "parameters")][sorted(kept[name])],
      init[name][sorted(kept[name])],
    )
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, atol=1e-5, err_msg=str(key))
