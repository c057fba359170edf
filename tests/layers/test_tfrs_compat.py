"""What tensorflow-recommenders code gives the layers, they take.

TensorFlow's ``tf.tpu.experimental.embedding`` configs and optimizers
(rebuilt as ours, embedding tables still keyed by the user's objects),
scalar ids and rank-1 sparse ids, and ``keras_embedding_layers``.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tpu_embedding.layers import PartialTPUEmbedding
from tpu_embedding.layers import TPUEmbedding
from tpu_embedding.layers.keras_optimizers import embedding_optimizer
from tpu_embedding.layers.tf_configs import from_tf_optimizer

TFE = tf.tpu.experimental.embedding

#: TensorFlow's optimizer and ours, with every argument off its default.
OPTIMIZERS = {
  "sgd": (
    TFE.SGD(0.2, clip_weight_min=-1.0, clipvalue=(-0.5, 2.0)),
    tpe.SGD(0.2, clip_weight_min=-1.0, clipvalue=(-0.5, 2.0)),
  ),
  "adagrad": (
    TFE.Adagrad(0.3, initial_accumulator_value=0.4, weight_decay_factor=0.1),
    tpe.Adagrad(0.3, initial_accumulator_value=0.4, weight_decay_factor=0.1),
  ),
  "adagrad_momentum": (
    TFE.AdagradMomentum(0.1, momentum=0.5, use_nesterov=True, beta2=0.9),
    tpe.AdagradMomentum(0.1, momentum=0.5, use_nesterov=True, beta2=0.9),
  ),
  "adam": (
    TFE.Adam(0.01, beta_1=0.5, lazy_adam=False, sum_inside_sqrt=False),
    tpe.Adam(0.01, beta_1=0.5, lazy_adam=False, sum_inside_sqrt=False),
  ),
  "ftrl": (
    TFE.FTRL(0.1, beta=0.5, multiply_linear_by_learning_rate=True),
    tpe.FTRL(0.1, beta=0.5, multiply_linear_by_learning_rate=True),
  ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_tensorflow_optimizers_become_ours(name):
  theirs, ours = OPTIMIZERS[name]
  assert from_tf_optimizer(theirs) == ours
  assert embedding_optimizer(theirs) == ours


def test_tensorflow_configs_in_tpu_embedding():
  init = np.arange(12, dtype=np.float32).reshape(4, 3)
  table = TFE.TableConfig(
    4,
    3,
    initializer=tf.constant_initializer(init),
    optimizer=TFE.SGD(0.5),
    combiner="sum",
    name="t",
  )
  features = {"a": TFE.FeatureConfig(table), "b": TFE.FeatureConfig(table)}
  layer = TPUEmbedding(features, "adagrad")
  [(key, variable)] = layer.embedding_tables.items()
  assert key is table  # the user's object, shared by both features
  np.testing.assert_array_equal(variable.numpy(), init)
  # The table's own optimizer (SGD 0.5), not the layer's.
  assert sorted(layer.mid_level_api.variables["t"]) == ["parameters"]

  ids = {"a": tf.constant([1, 2]), "b": tf.ragged.constant([[0, 3], [1]])}
  with tf.GradientTape() as tape:
    out = layer(ids, training=True)
    loss = tf.reduce_sum(out["a"]) + tf.reduce_sum(out["b"])
  np.testing.assert_array_equal(out["b"].numpy(), [init[0] + init[3], init[1]])
  tape.gradient(loss, layer.trainable_variables)
  # Rows 0, 2, 3 are looked up once, row 1 twice: w -= 0.5 * count.
  want = init - 0.5 * np.array([[1], [2], [1], [1]], np.float32)
  np.testing.assert_allclose(layer.embedding_tables[table].numpy(), want)

  serving = {"c": TFE.FeatureConfig(table)}
  served = layer.serving_lookup({"c": tf.constant([3])}, serving_config=serving)
  np.testing.assert_allclose(served["c"].numpy(), want[3:])


def test_tensorflow_configs_in_partial_tpu_embedding():
  big = TFE.TableConfig(20, 4, name="big")
  small = TFE.TableConfig(5, 2, name="small")
  features = {
    "a": TFE.FeatureConfig(big),
    "b": TFE.FeatureConfig(small),
    "c": TFE.FeatureConfig(small),
  }
  layer = PartialTPUEmbedding(features, "sgd", size_threshold=10)
  assert set(layer.embedding_tables) == {big, small}
  keras_tables = layer.keras_embedding_layers
  assert sorted(keras_tables) == ["b", "c"]
  assert keras_tables["b"] is keras_tables["c"]
  assert (keras_tables["b"].input_dim, keras_tables["b"].output_dim) == (5, 2)
  assert keras_tables["b"].embeddings is layer.embedding_tables[small]
  [tpu_table] = layer.tpu_embedding.embedding_tables
  assert (tpu_table.name, tpu_table.vocabulary_size) == ("big", 20)


@pytest.mark.parametrize("threshold", [0, None])
def test_scalar_and_rank_one_sparse_ids(threshold):
  table = tpe.TableConfig(
    6, 2, initializer=tpe.RowIdInitializer(), combiner="sum", name="t"
  )
  layer = PartialTPUEmbedding(
    {"a": tpe.FeatureConfig(table), "b": tpe.FeatureConfig(table)},
    "sgd",
    size_threshold=threshold,
  )
  sparse = tf.SparseTensor([[0], [2]], tf.constant([4, 5]), [3])
  # (Keras 3 takes tensors only; tf-keras Python ints too, as tfrs tests.)
  out = layer({"a": tf.constant(3), "b": sparse})
  assert out["a"].shape == (2,)
  np.testing.assert_array_equal(out["a"].numpy(), [3.0, 3.0])
  np.testing.assert_array_equal(out["b"].numpy(), [[4, 4], [0, 0], [5, 5]])
