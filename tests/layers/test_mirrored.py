"""``model.fit`` on MirroredStrategy equals the default strategy.

Two replicas over logical CPUs. ``TPUEmbedding``: the large table
row-sharded, the small one replicated by the mid-level API;
``PartialTPUEmbedding``: the large table sharded, the small one a Keras
weight trained by Keras' optimizer. After the same epochs every table, slot
and dense weight matches one device, and so does ``predict``.

Dense ids go through Keras' own model building; ragged and sparse ids need
``tpu_embedding.layers.distributed_fit`` (Keras 3 averages the first batch
over the replicas to build a model, which it cannot do for them), which the
layers install under MirroredStrategy.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests import sparse_access
from tests.conftest import mirrored_strategy
from tests.layers import builders
from tpu_embedding.layers import PartialTPUEmbedding
from tpu_embedding.layers import TPUEmbedding
from tpu_embedding.layers.keras_compat import keras

SAMPLES = 24


def dense_features(big, small):
  return {
    "item": tpe.FeatureConfig(big),
    "item_again": tpe.FeatureConfig(big),
    "user": tpe.FeatureConfig(small),
  }


def dense_data(seed=4):
  rng = np.random.default_rng(seed)
  x = {
    "item": rng.integers(0, 12, SAMPLES),
    "item_again": rng.integers(0, 30, (SAMPLES, 1)),
    "user": rng.integers(0, builders.SMALL_IDS, SAMPLES),
  }
  y = rng.normal(size=(SAMPLES, 1)).astype(np.float32)
  return x, y


LAYERS = {
  "tpu_embedding": lambda features: TPUEmbedding(
    features, tpe.Adam(0.05), row_sharding_threshold=10
  ),
  "partial": lambda features: PartialTPUEmbedding(
    features, tpe.Adam(0.05), size_threshold=10, row_sharding_threshold=10
  ),
}


def make_model(kind):
  """``(model, layer)``, compiled; call under the strategy's scope."""
  big, small = builders.tables(big_optimizer=tpe.Adagrad(0.2))
  features = dense_features(big, small)
  layer = LAYERS[kind](features)
  model = builders.LinearModel(layer, builders.kernel_for(features))
  model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
  return model, layer


def train(strategy, kind):
  with strategy.scope():
    model, layer = make_model(kind)
  x, y = dense_data()
  model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  return model, layer, x, y


def layer_values(layer):
  """``{(table, slot): value}``, Keras weights as ``(table, "keras")``."""
  if isinstance(layer, TPUEmbedding):
    return builders.full_values(layer.mid_level_api.variables)
  values = builders.full_values(layer.tpu_embedding.mid_level_api.variables)
  for table, weight in layer.replicated_embedding.embedding_tables.items():
    values[table.name, "keras"] = np.asarray(weight)
  return values


def mid_level(layer):
  if isinstance(layer, TPUEmbedding):
    return layer.mid_level_api
  return layer.tpu_embedding.mid_level_api


@pytest.fixture(scope="module", params=sorted(LAYERS))
def trained(request):
  return {
    "default": train(tf.distribute.get_strategy(), request.param),
    "mirrored": train(mirrored_strategy(2), request.param),
  }


def test_mirrored_fit_equals_one_device(trained):
  _, one_layer, _, _ = trained["default"]
  _, two_layer, _, _ = trained["mirrored"]
  placements = mid_level(two_layer).sharding_plan.placements
  assert placements["big"].sharded
  assert "small" not in placements or not placements["small"].sharded
  want = layer_values(one_layer)
  got = layer_values(two_layer)
  assert set(got) == set(want)
  for key, value in want.items():
    np.testing.assert_allclose(
      got[key], value, rtol=1e-5, atol=1e-5, err_msg=str(key)
    )
  initial_big, _ = builders.table_values()
  assert not np.allclose(want["big", "parameters"], initial_big)


def test_fit_steps_touch_only_looked_up_rows(trained):
  """``fit``'s traced steps (every graph of ``model.train_function`` and
  the functions it calls), on one device and on 2 replicas: the layer's
  tables and slots are gathered and updated by row only
  (tests/sparse_access.py)."""
  for name, (model, layer, _, _) in trained.items():
    functions = sparse_access.concrete_functions(model.train_function)
    assert functions, name
    sparse_access.check_row_only(functions, mid_level(layer))


def test_mirrored_dense_weights_and_predict_match(trained):
  one_model, _, x, _ = trained["default"]
  two_model, two_layer, _, _ = trained["mirrored"]
  np.testing.assert_allclose(
    two_model.dense.kernel.numpy(), one_model.dense.kernel.numpy(), atol=1e-5
  )
  before = layer_values(two_layer)
  np.testing.assert_allclose(
    two_model.predict(x, batch_size=8, verbose=0),
    one_model.predict(x, batch_size=8, verbose=0),
    atol=1e-5,
  )
  after = layer_values(two_layer)
  for key, value in before.items():
    np.testing.assert_array_equal(after[key], value, err_msg=str(key))


def test_mirrored_serving_lookup_of_a_subset(trained):
  _, one_layer, x, _ = trained["default"]
  _, two_layer, _, _ = trained["mirrored"]
  ids = {"item_again": tf.constant(x["item_again"])}
  want = one_layer.serving_lookup(ids)["item_again"]
  got = two_layer.serving_lookup(ids)["item_again"]
  np.testing.assert_allclose(got, want, atol=1e-5)
  # Outside strategy.run, an inference call works too. (Serving gathers a
  # dense (B, 1) input as is, giving (B, 1, dim); training drops the 1.)
  full = two_layer({k: tf.constant(v) for k, v in x.items()}, training=False)
  np.testing.assert_allclose(full["item_again"], want[:, 0], atol=1e-5)


def composite_dataset(kind, seed=6):
  """24 examples of ragged (or sparse) ids, some rows empty, batches of 8."""
  rng = np.random.default_rng(seed)

  def ids(vocab, min_len, max_len):
    rows = [
      list(rng.integers(0, vocab, rng.integers(min_len, max_len + 1)))
      for _ in range(SAMPLES)
    ]
    ragged = tf.ragged.constant(rows, dtype=tf.int64, ragged_rank=1)
    return ragged.to_sparse() if kind == "sparse" else ragged

  x = {
    "item": ids(builders.V_BIG, 0, 3),
    "item_again": ids(builders.V_BIG, 1, 2),
    "user": ids(builders.SMALL_IDS, 1, 3),
  }
  y = rng.normal(size=(SAMPLES, 1)).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)


# Each layer once, each kind of composite ids once (the dense-id fit of
# both layers: test_mirrored_fit_equals_one_device).
@pytest.mark.parametrize(
  "ids, layer_kind", [("ragged", "tpu_embedding"), ("sparse", "partial")]
)
def test_mirrored_fit_on_ragged_and_sparse_ids_equals_one_device(
  ids, layer_kind
):
  dataset = composite_dataset(ids)
  results = {}
  for name, strategy in (
    ("default", tf.distribute.get_strategy()),
    ("mirrored", mirrored_strategy(2)),
  ):
    with strategy.scope():
      model, layer = make_model(layer_kind)
    model.fit(dataset, epochs=2, shuffle=False, verbose=0)
    results[name] = (
      layer_values(layer),
      model.dense.kernel.numpy(),
      model.predict(dataset, verbose=0),
    )
  (want, want_kernel, want_predict) = results["default"]
  (got, got_kernel, got_predict) = results["mirrored"]
  assert set(got) == set(want)
  for key, value in want.items():
    np.testing.assert_allclose(
      got[key], value, rtol=1e-5, atol=1e-5, err_msg=str(key)
    )
  np.testing.assert_allclose(got_kernel, want_kernel, atol=1e-5)
  np.testing.assert_allclose(got_predict, want_predict, atol=1e-5)
  initial_big, _ = builders.table_values()
  assert not np.allclose(want["big", "parameters"], initial_big)
