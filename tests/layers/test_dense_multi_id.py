"""Dense multi-id inputs ``[batch, n]`` train as the serving lookup reads them.

Fixed-length multi-hot ids (as MLPerf DLRM-DCNv2 pipelines produce) come as
a dense ``[batch, n]`` tensor. Training lookups return ``[batch, n, dim]``,
one activation per id, exactly what ``serving_embedding_lookup`` returns
for the same input; ``model.fit`` on 2 replicas (the table row-sharded)
equals one device.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy
from tpu_embedding.layers import TPUEmbedding
from tpu_embedding.layers.keras_compat import keras

ROWS, DIM, HOTS, SAMPLES = 30, 4, 3, 16


def _table():
  values = np.random.default_rng(0).normal(size=(ROWS, DIM)).astype(np.float32)
  return tpe.TableConfig(
    ROWS,
    DIM,
    name="items",
    initializer=tf.constant_initializer(values),
    optimizer=tpe.Adagrad(0.3),
  )


class MultiHotModel(keras.Model):
  def __init__(self, layer):
    super().__init__()
    self.embedding = layer
    kernel = np.random.default_rng(1).normal(size=(HOTS * DIM, 1))
    self.dense = keras.layers.Dense(
      1, use_bias=False, kernel_initializer=keras.initializers.Constant(kernel)
    )

  def call(self, ids, training=None):
    activations = self.embedding({"items": ids}, training=training)["items"]
    return self.dense(tf.reshape(activations, [-1, HOTS * DIM]))


def _data():
  rng = np.random.default_rng(2)
  x = rng.integers(0, ROWS, (SAMPLES, HOTS))
  y = rng.normal(size=(SAMPLES, 1)).astype(np.float32)
  return x, y


def _train(strategy):
  with strategy.scope():
    layer = TPUEmbedding(
      {"items": tpe.FeatureConfig(_table())},
      tpe.SGD(0.1),  # for tables without their own (this one has Adagrad)
      row_sharding_threshold=0,
    )
    model = MultiHotModel(layer)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = _data()
    # Built by a call on real ids: Keras' own build from a batch of data
    # passes a dense stand-in that sparse ids also produce (see
    # ``tpu_embedding.layers.keras_inputs.InputKinds``).
    model(tf.constant(x[:2]), training=False)
  model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  return model, layer


@pytest.fixture(scope="module")
def trained():
  return {
    "default": _train(tf.distribute.get_strategy()),
    "mirrored": _train(mirrored_strategy(2)),
  }


def test_activations_equal_the_serving_lookup(trained):
  _, layer = trained["default"]
  x, _ = _data()
  ids = tf.constant(x)
  activations = layer({"items": ids}, training=False)["items"]
  assert activations.shape == (SAMPLES, HOTS, DIM)
  serving = layer.serving_lookup({"items": ids})["items"]
  np.testing.assert_array_equal(activations.numpy(), serving.numpy())
  (table,) = layer.embedding_tables
  tf_table = tf.tpu.experimental.embedding.TableConfig(ROWS, DIM)
  theirs = tf.tpu.experimental.embedding.serving_embedding_lookup(
    ids,
    None,
    {tf_table: tf.convert_to_tensor(layer.embedding_tables[table])},
    tf.tpu.experimental.embedding.FeatureConfig(tf_table),
  )
  np.testing.assert_array_equal(activations.numpy(), theirs.numpy())


def test_mirrored_fit_equals_one_device(trained):
  one_model, one_layer = trained["default"]
  two_model, two_layer = trained["mirrored"]
  assert two_layer.mid_level_api.sharding_plan.placements["items"].sharded
  for key in ("parameters", "accumulators"):
    want = tf.convert_to_tensor(one_layer.mid_level_api.variables["items"][key])
    got = tf.convert_to_tensor(two_layer.mid_level_api.variables["items"][key])
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)
  x, _ = _data()
  initial = _table().initializer(shape=(ROWS, DIM)).numpy()
  trained_rows = tf.convert_to_tensor(
    one_layer.mid_level_api.variables["items"]["parameters"]
  ).numpy()
  changed = np.flatnonzero(np.any(trained_rows != initial, axis=1))
  assert set(changed) == set(np.unique(x))
  np.testing.assert_allclose(
    two_model.predict(x, batch_size=8, verbose=0),
    one_model.predict(x, batch_size=8, verbose=0),
    atol=1e-5,
  )
