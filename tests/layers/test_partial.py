"""``PartialTPUEmbedding`` splits tables by size, never changing lookups.

For thresholds 0 (every table via the mid-level API), None (every table a
Keras weight) and one in between, with dense, sparse and ragged ids,
weights, two combiners and a sequence feature: the activations equal the
mid-level API's, and one training step moves each table by its own
optimizer (mid-level half) or by Keras' optimizer (replicated half).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.layers import builders
from tpu_embedding.layers import PartialTPUEmbedding
from tpu_embedding.layers.keras_compat import keras

#: size_threshold -> the tables the mid-level API holds.
SPLITS = {0: {"big", "small"}, None: set(), 20: {"big"}}
TABLE_LR, KERAS_LR = 0.3, 0.05


def make_layer(threshold, seed=0):
  big, small = builders.tables(seed=seed)
  features = builders.mixed_features(big, small)
  layer = PartialTPUEmbedding(
    features, tpe.SGD(TABLE_LR), size_threshold=threshold
  )
  return layer, features


def reference(seed=0):
  big, small = builders.tables(seed=seed)
  # Unstacked: its variables are plain tf.Variables (gradients flow to them).
  return tpe.TPUEmbedding(
    builders.mixed_features(big, small), tpe.SGD(0.1), table_stacking=None
  )


@pytest.mark.parametrize("threshold", list(SPLITS), ids=str)
def test_split_and_lookups(threshold):
  layer, features = make_layer(threshold)
  expected = {
    path: "tpu_embedding" if f.table.name in SPLITS[threshold] else "replicated"
    for path, f in features.items()
  }
  assert layer.placements == expected
  assert (layer.tpu_embedding is None) == (not SPLITS[threshold])
  assert (layer.replicated_embedding is None) == (
    SPLITS[threshold] == {"big", "small"}
  )
  keras_tables = {tuple(w.shape) for w in layer.trainable_weights}
  assert ((builders.V_SMALL, builders.DIM) in keras_tables) == (
    "small" not in SPLITS[threshold]
  )
  ids, weights = builders.mixed_batch()
  want = reference()(ids, weights)
  for training in (False, True):
    got = layer(ids, weights, training=training)
    for key in want:
      np.testing.assert_allclose(got[key], want[key], atol=1e-6, err_msg=key)


@pytest.mark.parametrize("threshold", list(SPLITS), ids=str)
def test_one_step_trains_each_half_with_its_optimizer(threshold):
  layer, features = make_layer(threshold)
  kernel = builders.kernel_for(features)
  model = builders.LinearModel(layer, kernel)
  model.compile(optimizer=keras.optimizers.SGD(KERAS_LR), loss="mse")
  ids, weights = builders.mixed_batch()
  y = builders.labels()
  model.train_on_batch(builders.model_inputs(ids, weights), y)

  # Whole-table gradients through the mid-level API's direct lookup (SGD is
  # linear: the sparse per-table step is the same rows minus lr * gradient).
  emb = reference()
  emb.build()
  variables = [emb.variables[t]["parameters"] for t in ("big", "small")]
  kernel_tensor = tf.constant(kernel)
  with tf.GradientTape() as tape:
    tape.watch(kernel_tensor)
    activations = emb(ids, weights)
    loss = builders.mse(
      builders.flat_activations(activations) @ kernel_tensor, y
    )
  *table_grads, kernel_grad = tape.gradient(loss, [*variables, kernel_tensor])
  for name, initial, grad in zip(
    ("big", "small"), builders.table_values(), table_grads, strict=True
  ):
    lr = TABLE_LR if name in SPLITS[threshold] else KERAS_LR
    table = next(t for t in layer.embedding_tables if t.name == name)
    np.testing.assert_allclose(
      np.asarray(tf.convert_to_tensor(layer.embedding_tables[table])),
      initial - lr * tf.convert_to_tensor(grad).numpy(),
      atol=1e-6,
      err_msg=name,
    )
  np.testing.assert_allclose(
    model.dense.kernel.numpy(), kernel - KERAS_LR * kernel_grad, atol=1e-6
  )


def test_serving_lookup_of_a_subset_across_both_halves():
  layer, features = make_layer(20)
  ids, weights = builders.mixed_batch()
  subset = {
    "big_sparse": ids["big_sparse"],
    "small_ragged": ids["small_ragged"],
  }
  subset_weights = {k: weights[k] for k in subset}
  tables = {
    t: tf.convert_to_tensor(v) for t, v in layer.embedding_tables.items()
  }
  want = tpe.serving_embedding_lookup(
    subset, subset_weights, tables, {k: features[k] for k in subset}
  )
  got = layer.serving_lookup(subset, subset_weights)
  got_too = layer(subset, subset_weights, serving_config=features)
  training_lookup = layer(ids, weights, training=False)
  for key in subset:
    np.testing.assert_allclose(got[key], want[key], atol=1e-6)
    np.testing.assert_allclose(got_too[key], want[key], atol=1e-6)
    np.testing.assert_allclose(got[key], training_lookup[key], atol=1e-6)


def test_unnamed_tables_keep_their_whole_config_names():
  first = tpe.TableConfig(5, 2)
  second = tpe.TableConfig(50, 2)
  layer = PartialTPUEmbedding(
    {"a": tpe.FeatureConfig(first), "b": tpe.FeatureConfig(second)},
    "sgd",
    size_threshold=10,
  )
  assert list(layer.tpu_embedding.mid_level_api.variables) == ["table_1"]
  assert [w.name for w in layer.replicated_embedding.weights] == ["table_0"]
  assert first.name is None and second.name is None
  assert set(layer.embedding_tables) == {first, second}


def test_a_16_bit_table_kept_by_keras_is_refused():
  """A small table goes to a float32 Keras Embedding: a 16-bit storage
  there would silently be float32, so it is refused, naming the table;
  a large one trains as 16 bits."""
  storage = tpe.RowStorage("bfloat16")
  small = tpe.TableConfig(5, 2, name="small", storage=storage)
  big = tpe.TableConfig(50, 2, name="big", storage=storage)
  with pytest.raises(
    ValueError,
    match=r"^Table 'small' is stored as bfloat16 .* with 5 rows "
    r"\(size_threshold=20\) PartialTPUEmbedding trains it in a float32",
  ):
    PartialTPUEmbedding(
      {"s": tpe.FeatureConfig(small), "b": tpe.FeatureConfig(big)},
      "sgd",
      size_threshold=20,
    )
  layer = PartialTPUEmbedding(
    {"b": tpe.FeatureConfig(big)}, "sgd", size_threshold=20
  )
  layer({"b": tf.constant([1, 2])})
  stored = layer.tpu_embedding.mid_level_api.variables["big"]["parameters"]
  assert stored.dtype == tf.bfloat16
