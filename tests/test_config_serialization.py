"""Configs describe themselves: ``get_config`` / ``from_config`` round trips.

Every config, rebuilt from its ``get_config()`` after a trip through JSON,
equals the original field by field: tables (optimizers, initializers,
quantization, dynamic vocabularies), features, and nests of features whose
shared tables stay shared.
"""

from __future__ import annotations

import copy
import inspect
import json
import pickle

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tpu_embedding import config as config_module
from tpu_embedding import initializers
from tpu_embedding import sharding
from tpu_embedding.optimizers import saving
from tpu_embedding.tables.initial_values import row_values

OPTIMIZERS = [
  tpe.SGD(0.1),
  tpe.SGD(0.5, clipvalue=(-1.0, None), clip_weight_min=-2.0),
  tpe.Adagrad(0.2, initial_accumulator_value=0.5, weight_decay_factor=0.01),
  tpe.AdagradMomentum(0.3, momentum=0.8, use_nesterov=True, clipvalue=2.0),
  tpe.Adam(0.01, beta_1=0.8, lazy_adam=False, sum_inside_sqrt=False),
  tpe.FTRL(
    0.05, learning_rate_power=-0.25, multiply_linear_by_learning_rate=True
  ),
  None,
]
OPTIMIZER_IDS = [
  "sgd",
  "sgd_clipped",
  "adagrad_decay",
  "adagrad_momentum",
  "adam_dense",
  "ftrl",
  "none",
]

INITIALIZERS = {
  "truncated_normal_seeded": initializers.TruncatedNormal(0.5, 0.2, seed=3),
  "row_id": initializers.RowIdInitializer(offset=2),
  "tf_zeros": tf.zeros_initializer(),
  "tf_ones": tf.ones_initializer(),
  "tf_constant": tf.constant_initializer(0.25),
  "tf_normal": tf.random_normal_initializer(stddev=0.3, seed=1),
  "tf_uniform": tf.random_uniform_initializer(-0.1, 0.1, seed=2),
  "keras_glorot": keras.initializers.GlorotUniform(seed=4),
  "keras_constant": keras.initializers.Constant(3.0),
}


def json_trip(data):
  return json.loads(json.dumps(data))


def assert_same_table(got: tpe.TableConfig, want: tpe.TableConfig) -> None:
  """Field by field (TableConfig compares by identity)."""
  assert type(got.initializer) is type(want.initializer)
  assert got.optimizer == want.optimizer
  for field in ("vocabulary_size", "dim", "combiner", "name", "dtype"):
    assert getattr(got, field) == getattr(want, field), field
  assert got.vocabulary == want.vocabulary
  assert repr(got.quantization_config) == repr(want.quantization_config)
  assert got.get_config() == want.get_config()


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=OPTIMIZER_IDS)
def test_table_config_round_trips_with_its_optimizer(optimizer):
  table = tpe.TableConfig(
    20,
    4,
    optimizer=optimizer,
    combiner="sqrtn",
    name="t",
    initializer=initializers.RowIdInitializer(1),
  )
  restored = tpe.TableConfig.from_config(json_trip(table.get_config()))
  assert_same_table(restored, table)
  if optimizer is not None:
    assert restored.optimizer is not optimizer


@pytest.mark.parametrize(
  "initializer", INITIALIZERS.values(), ids=INITIALIZERS.keys()
)
def test_table_config_round_trips_with_its_initializer(initializer):
  table = tpe.TableConfig(6, 3, initializer=initializer, name="t")
  restored = tpe.TableConfig.from_config(json_trip(table.get_config()))
  assert_same_table(restored, table)
  # The initial values, as the layouts make them: every initializer here is
  # seeded or constant, so they are made statelessly and must agree.
  np.testing.assert_array_equal(
    row_values(restored.initializer, (6, 3)).rows(0, 6, tf.float32),
    row_values(initializer, (6, 3)).rows(0, 6, tf.float32),
  )


def test_default_initializer_round_trips_as_the_default():
  table = tpe.TableConfig(6, 16)
  restored = tpe.TableConfig.from_config(json_trip(table.get_config()))
  assert restored.initializer.is_default_for(16)
  assert repr(restored) == repr(table)


@pytest.mark.parametrize(
  "vocabulary",
  [
    tpe.DynamicVocabulary(min_count=2, eviction="lfu", ttl_steps=5),
    tpe.DynamicVocabulary(key_dtype=tf.string, bucket_size=4),
    tpe.DynamicVocabulary(capacity=30, probation_size=2, default_value=0.5),
  ],
  ids=["lfu_ttl", "string_keys", "capacity_default_value"],
)
def test_table_config_round_trips_its_dynamic_vocabulary(vocabulary):
  table = tpe.TableConfig(30, 2, name="users", vocabulary=vocabulary)
  restored = tpe.TableConfig.from_config(json_trip(table.get_config()))
  assert restored.vocabulary == vocabulary
  assert restored.vocabulary.key_dtype == vocabulary.key_dtype
  assert_same_table(restored, table)


def test_quantization_config_round_trips():
  quantization = tpe.QuantizationConfig(num_buckets=16, lower=-2.0, upper=3.0)
  data = json_trip(quantization.get_config())
  assert data == {"num_buckets": 16, "lower": -2.0, "upper": 3.0}
  assert repr(tpe.QuantizationConfig.from_config(data)) == repr(quantization)
  table = tpe.TableConfig(5, 2, quantization_config=quantization)
  assert_same_table(
    tpe.TableConfig.from_config(json_trip(table.get_config())), table
  )


def _parameters(cls) -> set[str]:
  return set(inspect.signature(cls.__init__).parameters) - {"self"}


def test_table_get_config_has_every_constructor_argument_but_layout():
  table = tpe.TableConfig(5, 2)
  assert set(table.get_config()) == _parameters(tpe.TableConfig) - {"layout"}


def test_feature_get_config_has_every_constructor_argument():
  feature = tpe.FeatureConfig(tpe.TableConfig(5, 2))
  assert set(feature.get_config()) == _parameters(tpe.FeatureConfig)


@pytest.mark.parametrize(
  "kwargs",
  [
    {},
    dict(max_sequence_length=3, name="history"),
    dict(validate_weights_and_indices=False, output_shape=[8, 2]),
  ],
  ids=["defaults", "sequence", "output_shape"],
)
def test_feature_config_round_trips_with_its_table(kwargs):
  table = tpe.TableConfig(9, 2, optimizer=tpe.Adagrad(0.1), name="t")
  feature = tpe.FeatureConfig(table, **kwargs)
  restored = tpe.FeatureConfig.from_config(json_trip(feature.get_config()))
  assert repr(restored) == repr(feature)
  assert restored.output_shape == feature.output_shape
  assert_same_table(restored.table, table)


def test_nests_round_trip_and_shared_tables_stay_shared():
  shared = tpe.TableConfig(10, 4, name="shared", optimizer=tpe.SGD(0.1))
  other = tpe.TableConfig(7, 4, optimizer=tpe.Adam(0.2))
  nest = {
    "a": tpe.FeatureConfig(shared),
    "b": [tpe.FeatureConfig(shared, max_sequence_length=2)],
    "c": (tpe.FeatureConfig(other, name="c"),),
  }
  data = json_trip(config_module.serialize_feature_config(nest))
  assert len(data["tables"]) == 2
  restored = config_module.deserialize_feature_config(data)
  assert restored["a"].table is restored["b"][0].table
  assert isinstance(restored["b"], list) and isinstance(restored["c"], tuple)
  assert_same_table(restored["a"].table, shared)
  assert_same_table(restored["c"][0].table, other)
  assert repr(restored) == repr(nest)


@pytest.mark.parametrize(
  "table, match",
  [
    (tpe.TableConfig(5, 2, name="t", layout=object()), "layout of table 't'"),
    (
      tpe.TableConfig(5, 2, name="t", optimizer=tpe.SGD(lambda: 0.1)),
      "table 't' has a callable learning_rate",
    ),
    (
      tpe.TableConfig(
        5,
        2,
        optimizer=tpe.Adagrad(0.1, slot_variable_creation_fn=lambda *a: {}),
      ),
      "an unnamed table has a slot_variable_creation_fn",
    ),
  ],
  ids=["layout", "callable_learning_rate", "slot_creation_fn"],
)
def test_get_config_refuses_what_cannot_be_saved_naming_the_table(table, match):
  with pytest.raises(ValueError, match=match):
    table.get_config()
  with pytest.raises(ValueError, match=match):
    tpe.FeatureConfig(table).get_config()


def test_an_unserializable_initializer_comes_back_as_zeros():
  table = tpe.TableConfig(4, 2, name="t", initializer=lambda shape, dtype: 1)
  data = json_trip(table.get_config())
  assert data["initializer"]["kind"] == "unserializable"
  restored = tpe.TableConfig.from_config(data)
  np.testing.assert_array_equal(restored.initializer((4, 2)), np.zeros((4, 2)))


@pytest.mark.parametrize("optimizer", OPTIMIZERS[:-1], ids=OPTIMIZER_IDS[:-1])
def test_optimizers_round_trip_as_data(optimizer):
  data = json_trip(saving.to_config(optimizer, "here"))
  assert data["class_name"] == type(optimizer).__name__
  assert saving.from_config(data) == optimizer


def test_a_row_threshold_is_the_placement_policy_it_always_became():
  # RowThreshold (once an int carrying forced placements) is the policy.
  threshold = sharding.RowThreshold(5, {"t": "replicated"})
  policy = sharding.PlacementPolicy(5, {"t": "replicated"})
  assert threshold == policy == sharding.PlacementPolicy.of(threshold)
  assert int(threshold) == 5 and dict(threshold.forced) == {"t": "replicated"}
  assert copy.deepcopy(threshold) == pickle.loads(pickle.dumps(policy))
  # pickle.dumps(RowThreshold(5, {"t": "replicated"}), 0) of the int class:
  earlier = (
    b"ctpu_embedding.sharding\nRowThreshold\np0\n(I5\n(dp1\nVt\np2\n"
    b"Vreplicated\np3\nstp4\nRp5\n."
  )
  assert pickle.loads(earlier) == policy
  with pytest.raises(ValueError, match="neither"):
    sharding.RowThreshold(5, {"t": "sparsecore"})
