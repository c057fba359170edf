"""Checkpoints, ``.keras`` files and configs of the Keras layers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy
from tests.layers import builders
from tpu_embedding.layers import PartialTPUEmbedding
from tpu_embedding.layers import TPUEmbedding
from tpu_embedding.layers import serialization
from tpu_embedding.layers.keras_compat import keras


def functional_model(layer_cls, seed=0, **layer_kwargs):
  """A functional model over dense ids of both tables."""
  big, small = builders.tables(big_optimizer=tpe.Adagrad(0.2), seed=seed)
  features = {
    "item": tpe.FeatureConfig(big),
    "user": tpe.FeatureConfig(small),
  }
  inputs = {
    "item": keras.Input(shape=(), dtype="int64", name="item"),
    "user": keras.Input(shape=(1,), dtype="int64", name="user"),
  }
  layer = layer_cls(features, tpe.Adam(0.1), name="embedding", **layer_kwargs)
  activations = layer(inputs)
  joined = keras.layers.Concatenate()(
    [activations["item"], activations["user"]]
  )
  model = keras.Model(inputs, keras.layers.Dense(1, name="score")(joined))
  model.compile(optimizer="adam", loss="mse")
  return model, layer


def dense_batch():
  x = {"item": np.array([1, 5, 5, 39]), "user": np.array([[0], [1], [4], [4]])}
  return x, np.ones((4, 1), np.float32)


def variables_of(layer):
  if isinstance(layer, PartialTPUEmbedding):
    values = {}
    if layer.tpu_embedding is not None:
      values.update(
        builders.full_values(layer.tpu_embedding.mid_level_api.variables)
      )
    for table, weight in layer.embedding_tables.items():
      values[table.name, "keras"] = np.asarray(weight)
    return values
  return builders.full_values(layer.mid_level_api.variables)


def assert_same(got, want):
  assert set(got) == set(want)
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=str(key))


def test_checkpoint_restores_into_another_strategy(tmp_path):
  model, layer = functional_model(TPUEmbedding)
  x, y = dense_batch()
  model.fit(x, y, epochs=2, verbose=0)
  path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
  shapes = dict(tf.train.list_variables(path))
  # The tensorflow-recommenders layer's keys: <layer>/_tpu_embedding/<table>.
  keys = [k for k in shapes if "_tpu_embedding/big" in k]
  assert any(
    k.endswith("_tpu_embedding/big/.ATTRIBUTES/VARIABLE_VALUE") for k in keys
  ), keys
  assert any("big.Saccumulators" in k for k in keys), keys

  with mirrored_strategy(2).scope():
    restored, restored_layer = functional_model(
      TPUEmbedding, seed=7, row_sharding_threshold=0
    )
  tf.train.Checkpoint(model=restored).restore(path).expect_partial()
  placements = restored_layer.mid_level_api.sharding_plan.placements
  assert placements["big"].sharded and placements["small"].sharded
  assert_same(variables_of(restored_layer), variables_of(layer))


@pytest.mark.parametrize("layer_cls", [TPUEmbedding, PartialTPUEmbedding])
def test_keras_file_round_trip(layer_cls, tmp_path):
  kwargs = {"size_threshold": 10} if layer_cls is PartialTPUEmbedding else {}
  model, layer = functional_model(layer_cls, **kwargs)
  x, y = dense_batch()
  model.fit(x, y, epochs=2, verbose=0)
  path = str(tmp_path / "model.keras")
  model.save(path)

  loaded = keras.models.load_model(path)
  loaded_layer = loaded.get_layer("embedding")
  assert type(loaded_layer) is layer_cls
  assert_same(variables_of(loaded_layer), variables_of(layer))
  np.testing.assert_allclose(
    loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
  )
  # The loaded model trains on.
  loaded.fit(x, y, epochs=1, verbose=0)
  assert not np.array_equal(
    variables_of(loaded_layer)["big", "parameters"],
    variables_of(layer)["big", "parameters"],
  )


def test_keras_file_loads_under_mirrored_strategy(tmp_path):
  model, layer = functional_model(TPUEmbedding, row_sharding_threshold=0)
  x, y = dense_batch()
  model.fit(x, y, epochs=1, verbose=0)
  path = str(tmp_path / "model.keras")
  model.save(path)
  with mirrored_strategy(2).scope():
    loaded = keras.models.load_model(path)
  loaded_layer = loaded.get_layer("embedding")
  assert loaded_layer.mid_level_api.sharding_plan.placements["big"].sharded
  assert_same(variables_of(loaded_layer), variables_of(layer))


def test_get_config_is_json_and_rebuilds_the_same_layer():
  big, small = builders.tables(big_optimizer=tpe.FTRL(0.1, beta=0.5))
  features = {
    "nested": [tpe.FeatureConfig(big, output_shape=[4])],
    "pair": (
      tpe.FeatureConfig(small, max_sequence_length=3, name="seq"),
      tpe.FeatureConfig(big),
    ),
    "unnamed": tpe.FeatureConfig(
      tpe.TableConfig(
        5,
        2,
        initializer=tpe.RowIdInitializer(2),
        optimizer=tpe.SGD(0.1, clipvalue=(-1.0, 2.0)),
        quantization_config=tpe.QuantizationConfig(8, -1.0, 1.0),
      )
    ),
  }
  layer = TPUEmbedding(features, "adagrad", name="emb")
  config = json.loads(json.dumps(layer.get_config()))
  rebuilt = TPUEmbedding.from_config(config)
  assert rebuilt.name == "emb"
  assert rebuilt.get_config() == layer.get_config()
  tables = list(rebuilt.embedding_tables)
  assert [t.name for t in tables] == ["big", "small", None]
  assert tables[0].optimizer == tpe.FTRL(0.1, beta=0.5)
  assert tables[2].optimizer == tpe.SGD(0.1, clipvalue=(-1.0, 2.0))
  structure = serialization.deserialize_feature_config(config["feature_config"])
  assert isinstance(structure["nested"], list)
  assert isinstance(structure["pair"], tuple)
  assert structure["nested"][0].table is structure["pair"][1].table
  assert structure["nested"][0].output_shape == tf.TensorShape([4])
  sequence = structure["pair"][0]
  assert (sequence.name, sequence.max_sequence_length) == ("seq", 3)
  for got, want in zip(
    builders.full_values(rebuilt.mid_level_api.variables).items(),
    builders.full_values(layer.mid_level_api.variables).items(),
    strict=True,
  ):
    assert got[0] == want[0]
    if got[0][0] != "table_2" or got[0][1] == "parameters":
      np.testing.assert_array_equal(got[1], want[1], err_msg=str(got[0]))


def test_get_config_names_what_cannot_be_saved():
  table = tpe.TableConfig(5, 2, name="t", optimizer=tpe.SGD(lambda: 0.1))
  layer = TPUEmbedding(tpe.FeatureConfig(table), "sgd")
  with pytest.raises(ValueError, match="table 't' has a callable learning"):
    layer.get_config()
