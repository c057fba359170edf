"""The Keras layers' errors say what is wrong and name it."""

from __future__ import annotations

import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy
from tpu_embedding.layers import PartialTPUEmbedding
from tpu_embedding.layers import TPUEmbedding
from tpu_embedding.layers.keras_compat import keras

LAYERS = {
  "tpu": lambda f, **kw: TPUEmbedding(f, "sgd", name="emb", **kw),
  "partial": lambda f, **kw: PartialTPUEmbedding(
    f, "sgd", size_threshold=10, name="emb", **kw
  ),
}


def features():
  big = tpe.TableConfig(50, 2, name="big")
  small = tpe.TableConfig(5, 2, name="small")
  return {"user": tpe.FeatureConfig(small), "item": tpe.FeatureConfig(big)}


IDS = {"user": tf.constant([1, 2]), "item": tf.constant([3, 4])}


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_a_missing_feature_is_named(kind):
  layer = LAYERS[kind](features())
  with pytest.raises(
    ValueError, match=r"emb'.*missing feature\(s\) \['item'\]"
  ):
    layer({"user": IDS["user"]})


@pytest.mark.parametrize("kind", sorted(LAYERS) + ["distributed"])
def test_a_functional_model_missing_a_feature_is_told_so_first(kind):
  # Keras 3 infers a functional model's output by calling the layer; the
  # structure is checked before, so the user reads our line, not Keras'
  # "could not automatically infer the output shape".
  if kind == "distributed":
    layer = tpe.layers.DistributedEmbedding(features(), name="emb")
  else:
    layer = LAYERS[kind](features())
  with pytest.raises(ValueError) as raised:
    layer({"user": keras.Input((), dtype="int64")})
  message = str(raised.value)
  # (Inside Keras' usual "Exception encountered when calling" wrapper.)
  assert (
    "Layer 'emb': the features passed do not match its feature config: "
    "missing feature(s) ['item']." in message
  ), message
  assert "infer the output" not in message, message


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_an_unexpected_feature_is_named(kind):
  layer = LAYERS[kind](features())
  with pytest.raises(ValueError, match=r"unexpected feature\(s\) \['extra'\]"):
    layer({**IDS, "extra": tf.constant([0, 0])})


def test_weights_of_the_wrong_structure_are_named():
  layer = LAYERS["tpu"](features())
  with pytest.raises(ValueError, match="weights passed.*missing.*'user'"):
    layer(IDS, {"item": None})


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_called_under_another_strategy(kind):
  layer = LAYERS[kind](features())
  with mirrored_strategy(2).scope():
    with pytest.raises(
      RuntimeError,
      match="'emb' was created under _DefaultDistributionStrategy but is "
      "called under MirroredStrategy",
    ):
      layer(IDS)


def test_training_a_mirrored_layer_outside_strategy_run():
  with mirrored_strategy(2).scope():
    layer = LAYERS["tpu"](features(), row_sharding_threshold=0)
  assert layer(IDS, training=False)["item"].shape == (2, 2)
  assert layer(IDS)["item"].shape == (2, 2)  # no training asked: a lookup
  with pytest.raises(RuntimeError, match="must run inside `strategy.run`"):
    layer(IDS, training=True)


@pytest.mark.parametrize(
  "optimizer, message",
  [
    ("rmsprop", "Unknown optimizer name 'rmsprop'"),
    (keras.optimizers.RMSprop(), "RMSprop .*has no embedding-table equiv"),
    (object(), "is not an embedding optimizer. Pass Keras"),
  ],
)
def test_optimizers_the_layers_cannot_use(optimizer, message):
  for make in (TPUEmbedding, PartialTPUEmbedding):
    with pytest.raises(ValueError, match=message):
      make(features(), optimizer)


def test_a_bad_size_threshold():
  with pytest.raises(ValueError, match="`size_threshold` must be None or"):
    PartialTPUEmbedding(features(), "sgd", size_threshold=-1)


def test_serving_config_with_a_foreign_table():
  layer = LAYERS["partial"](features())
  other = tpe.FeatureConfig(tpe.TableConfig(5, 2, name="small"))
  with pytest.raises(ValueError, match="feature 'user' uses a TableConfig"):
    layer.serving_lookup({"user": IDS["user"]}, serving_config={"user": other})


def test_out_of_range_ids_name_the_feature():
  layer = LAYERS["partial"](features())
  with pytest.raises(
    tf.errors.InvalidArgumentError, match="Input user has ids outside"
  ):
    layer({"user": tf.constant([1, 9]), "item": IDS["item"]})
