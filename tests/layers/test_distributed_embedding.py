"""``layers.DistributedEmbedding``: keras-rs' layer trained on any strategy.

keras-rs configs (the real classes) and ours translate field by field;
placements become layouts (checked on the table stores and the sharding
plan under two replicas); the activations equal keras-rs' own
(``"default_device"``, its Keras-weights path) for dense ids, several ids
per example and weights; one ``fit`` step updates each table with its own
optimizer exactly as the numpy oracle, and the dense layer with the
model's; two replicas train as one device.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests import oracle
from tests.conftest import mirrored_strategy
from tpu_embedding.layers import DistributedEmbedding
from tpu_embedding.layers import distributed_embedding
from tpu_embedding.layers import keras_rs_configs
from tpu_embedding.layers.keras_compat import keras
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.sharding import RowThreshold

if os.environ.get("CI") == "true":  # CI runs 3.11+: these must run there.
  import keras_rs
else:
  keras_rs = pytest.importorskip(
    "keras_rs",
    reason="keras-rs is not installed (it needs Python 3.11 or later)",
  )

B, DIM = 8, 3


def values(rows: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=(rows, DIM)).astype("f4")


def krs_table(name, rows, placement="auto", optimizer="adam", **kwargs):
  return keras_rs.layers.TableConfig(
    name=name,
    vocabulary_size=rows,
    embedding_dim=DIM,
    initializer=keras.initializers.Constant(values(rows, rows)),
    optimizer=optimizer,
    placement=placement,
    **kwargs,
  )


def krs_feature(name, table, input_shape=(B,), output_shape=(B, DIM)):
  return keras_rs.layers.FeatureConfig(
    name=name, table=table, input_shape=input_shape, output_shape=output_shape
  )


# --- translation --------------------------------------------------------------


def test_keras_rs_configs_translate_field_by_field():
  shared = keras_rs.layers.TableConfig(
    name="movies",
    vocabulary_size=50,
    embedding_dim=4,
    initializer="zeros",
    optimizer=tpe.Adagrad(0.3),
    combiner="sqrtn",
    placement="sparsecore",
  )
  default = keras_rs.layers.TableConfig(
    name="users", vocabulary_size=20, embedding_dim=2
  )
  nest = {
    "watched": [
      krs_feature("w", shared, (B, 5), (B, 4)),
      krs_feature("s", shared, (B, 5), (B, 5, 4)),
    ],
    "user": (krs_feature("u", default, (B,), (B, 2)),),
  }

  translated = keras_rs_configs.translate(nest)

  watched, history = translated.feature_config["watched"]
  (user,) = translated.feature_config["user"]
  assert isinstance(watched, tpe.FeatureConfig)
  assert watched.table is history.table  # one table, shared
  table = watched.table
  assert (table.name, table.vocabulary_size, table.dim) == ("movies", 50, 4)
  assert table.combiner == "sqrtn"
  assert table.optimizer == tpe.Adagrad(0.3)
  assert isinstance(table.initializer, keras.initializers.Zeros)
  assert (watched.name, watched.max_sequence_length) == ("w", 0)
  assert history.max_sequence_length == 5  # output (B, L, dim): a sequence
  assert not watched.output_shape.rank  # batch sizes are not enforced
  # keras-rs' defaults: "adam", VarianceScaling(fan_out), "mean", "auto".
  assert user.table.optimizer == tpe.Adam()
  assert isinstance(user.table.initializer, keras.initializers.VarianceScaling)
  assert user.table.combiner == "mean"
  assert translated.placements == {"movies": "sparsecore", "users": "auto"}


def test_keras_rs_and_our_configs_mix_in_one_layer():
  ours = tpe.TableConfig(10, DIM, name="ours", optimizer=tpe.SGD(0.1))
  unnamed = tpe.TableConfig(10, DIM)
  layer = DistributedEmbedding(
    {
      "a": krs_feature("a", krs_table("theirs", 12)),
      "b": tpe.FeatureConfig(ours),
      "c": tpe.FeatureConfig(unnamed),
    },
    placements={"ours": "default_device"},
  )
  assert sorted(layer.table_stores) == ["ours", "table_2", "theirs"]
  assert layer.placements == {"ours": "default_device", "theirs": "auto"}
  # Our table without an optimizer gets keras-rs' default, Adam.
  optimizers = {n: s.table.optimizer for n, s in layer.table_stores.items()}
  assert optimizers["table_2"] == tpe.Adam()
  assert optimizers["ours"] == tpe.SGD(0.1)
  out = layer(
    {
      "a": tf.constant([1, 2]),
      "b": tf.constant([3, 4]),
      "c": tf.constant([5, 6]),
    }
  )
  assert {k: v.shape.as_list() for k, v in out.items()} == {
    k: [2, DIM] for k in "abc"
  }


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"placements": {"nope": "sparsecore"}}, "not among the layer's tables"),
    ({"placements": {"ours": "tpu"}}, "unsupported placement 'tpu'"),
    ({"placements": {"theirs": "sparsecore"}}, "set its placement on its"),
  ],
)
def test_bad_placements_raise(kwargs, message):
  features = {
    "a": krs_feature("a", krs_table("theirs", 12, "default_device")),
    "b": tpe.FeatureConfig(tpe.TableConfig(10, DIM, name="ours")),
  }
  with pytest.raises(ValueError, match=message):
    DistributedEmbedding(features, **kwargs)


@pytest.mark.parametrize(
  ("feature", "message"),
  [
    (lambda t: krs_feature("f", t, (B,), (B,)), "output_shape must be"),
    (lambda t: krs_feature("f", t, (B,), (B, DIM + 1)), "embedding_dim 3"),
    (lambda t: krs_feature("f", t, (B, 2, 2), (B, DIM)), "inputs must have"),
    (lambda t: krs_feature("f", t, (B,), (B, 4, DIM)), "a sequence of L"),
    (lambda t: "not a config", "expected a keras_rs.layers.FeatureConfig"),
  ],
)
def test_bad_feature_configs_raise_naming_the_feature(feature, message):
  with pytest.raises(ValueError, match=message):
    DistributedEmbedding({"f": feature(krs_table("t", 10))})


def test_keras_optimizer_objects_go_through_embedding_optimizer(monkeypatch):
  table = krs_table("t", 10, optimizer=keras.optimizers.SGD(0.25))
  calls = []

  def embedding_optimizer(optimizer):
    calls.append(optimizer)
    return tpe.SGD(optimizer.learning_rate.numpy())

  monkeypatch.setattr(
    keras_rs_configs, "embedding_optimizer", embedding_optimizer
  )
  translated = keras_rs_configs.translate({"f": krs_feature("f", table)})
  assert calls == [table.optimizer]
  assert translated.feature_config["f"].table.optimizer == tpe.SGD(0.25)


# --- placements → layouts -----------------------------------------------------


def test_placements_map_to_layouts_under_two_replicas():
  features = {
    "sc": krs_feature("sc", krs_table("small_sparsecore", 6, "sparsecore")),
    "dd": krs_feature("dd", krs_table("big_default", 40, "default_device")),
    "big": krs_feature("big", krs_table("big_auto", 40)),
    "small": krs_feature("small", krs_table("small_auto", 6)),
  }
  with mirrored_strategy(2).scope():
    layer = DistributedEmbedding(
      features, row_sharding_threshold=20, table_stacking=None
    )
  layouts = {name: s.layout for name, s in layer.table_stores.items()}
  assert layouts == {
    "small_sparsecore": "row_sharded",  # whatever its size
    "big_default": "replicated",  # whatever its size
    "big_auto": "row_sharded",  # 40 > 20 rows
    "small_auto": "replicated",
  }
  plan = layer.mid_level_api.sharding_plan
  assert plan.placements["small_sparsecore"].shard_sizes == (3, 3)
  assert plan.placements["big_default"].kind == "replicated"
  assert "placement fixed: " in plan.report()
  # One device: every table whole, whatever its placement.
  single = DistributedEmbedding(features, row_sharding_threshold=20)
  assert {s.layout for s in single.table_stores.values()} == {"whole"}


# --- lookups: keras-rs' own activations ---------------------------------------


@pytest.mark.parametrize("combiner", ["mean", "sum", "sqrtn"])
def test_activations_equal_keras_rs_default_device(combiner):
  table = krs_table("t", 30, "default_device", combiner=combiner)
  other = krs_table("u", 12, "default_device", combiner=combiner)
  features = {
    "one": krs_feature("one", table),
    "several": krs_feature("several", table, (B, 4)),
    "weighted": krs_feature("weighted", other, (B, 3)),
  }
  rng = np.random.default_rng(7)
  inputs = {
    "one": rng.integers(0, 30, B).astype("int32"),
    "several": rng.integers(0, 30, (B, 4)).astype("int32"),
    "weighted": rng.integers(0, 12, (B, 3)).astype("int32"),
  }
  weights = {
    "one": rng.uniform(0.5, 2, B).astype("f4"),
    "several": rng.uniform(0.5, 2, (B, 4)).astype("f4"),
    "weighted": rng.uniform(0.5, 2, (B, 3)).astype("f4"),
  }
  theirs = keras_rs.layers.DistributedEmbedding(features)
  ours = DistributedEmbedding(features)
  for w in (None, weights):
    want = theirs(inputs, w)
    got = ours(inputs, w)
    for name in features:
      np.testing.assert_allclose(
        got[name].numpy(), want[name].numpy(), rtol=1e-5, err_msg=name
      )


def test_sequence_feature_follows_the_oracle():
  table = krs_table("t", 30, "sparsecore")
  layer = DistributedEmbedding(
    {"s": krs_feature("s", table, (B, 3), (B, 3, DIM))}
  )
  ids = np.random.default_rng(3).integers(0, 30, (B, 3))
  got = layer({"s": ids})["s"].numpy()
  want = oracle.lookup(values(30, 30), ids.tolist(), max_sequence_length=3)
  np.testing.assert_allclose(got, want, rtol=1e-6)


# --- training: per-table optimizers, the model's for the dense layer ----------


def oracle_step(x, y, kernel, lr, tables):
  """One step of the linear model in numpy: new tables and kernel.

  Args:
    x: ``{"a": [B] ids, "b": [B, 2] ids}``.
    y: ``[B, 1]`` labels.
    kernel: ``[2 * DIM, 1]``, rows of "a" then "b".
    lr: the dense layer's SGD learning rate.
    tables: ``{name: (values, oracle.Optimizer, combiner)}``.

  Returns:
    ``({name: (params, slots)}, new kernel)``.
  """
  features = {"a": x["a"], "b": x["b"].tolist()}
  acts = {
    f: oracle.lookup(tables[f][0], features[f], combiner=tables[f][2])
    for f in "ab"
  }
  flat = np.concatenate([acts["a"], acts["b"]], axis=1)
  d_pred = 2.0 * (flat @ kernel - y) / len(y)  # mean squared error
  new_kernel = kernel - lr * flat.T @ d_pred
  result = {}
  for i, f in enumerate("ab"):
    init, optimizer, combiner = tables[f]
    d_act = d_pred @ kernel[i * DIM : (i + 1) * DIM].T
    params = np.array(init, np.float64)
    slots = optimizer.init_slots(params.shape)
    grads = oracle.row_gradients(features[f], d_act, combiner=combiner)
    optimizer.apply(params, slots, grads)
    result[f] = (params, slots)
  return result, new_kernel


def linear_model(layer, kernel):
  inputs = {
    "a": keras.Input(shape=(), dtype="int32", name="a"),
    "b": keras.Input(shape=(2,), dtype="int32", name="b"),
  }
  acts = layer(inputs)
  dense = keras.layers.Dense(
    1, use_bias=False, kernel_initializer=keras.initializers.Constant(kernel)
  )
  model = keras.Model(
    inputs, dense(keras.ops.concatenate([acts["a"], acts["b"]], 1))
  )
  return model, dense


def test_each_table_trains_with_its_own_optimizer_the_dense_with_keras():
  table_a = krs_table("a", 30, "sparsecore", optimizer=tpe.Adagrad(0.3))
  table_b = krs_table("b", 20, "default_device", optimizer="sgd")
  layer = DistributedEmbedding(
    {"a": krs_feature("a", table_a), "b": krs_feature("b", table_b, (B, 2))}
  )
  kernel = np.random.default_rng(1).normal(size=(2 * DIM, 1)).astype("f4")
  model, dense = linear_model(layer, kernel)
  model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
  rng = np.random.default_rng(2)
  x = {"a": rng.integers(0, 30, B), "b": rng.integers(0, 20, (B, 2))}
  y = rng.normal(size=(B, 1)).astype("f4")

  model.train_on_batch(x, y)

  want, want_kernel = oracle_step(
    x,
    y,
    kernel.astype(np.float64),
    0.05,
    {
      "a": (
        values(30, 30),
        oracle.Optimizer.create("adagrad", learning_rate=0.3),
        "mean",
      ),
      "b": (values(20, 20), oracle.Optimizer.create("sgd"), "mean"),
    },
  )
  variables = layer.mid_level_api.variables
  np.testing.assert_allclose(
    variables["a"]["parameters"].numpy(), want["a"][0], atol=1e-6
  )
  np.testing.assert_allclose(
    variables["a"]["accumulators"].numpy(),
    want["a"][1]["accumulators"],
    atol=1e-6,
  )
  np.testing.assert_allclose(
    variables["b"]["parameters"].numpy(), want["b"][0], atol=1e-6
  )
  np.testing.assert_allclose(dense.kernel.numpy(), want_kernel, atol=1e-6)
  # The rows no example looked up did not move.
  unused = sorted(set(range(30)) - set(x["a"].tolist()))
  np.testing.assert_array_equal(
    variables["a"]["parameters"].numpy()[unused], values(30, 30)[unused]
  )
  # Keras' optimizer trains the dense kernel and the hook's dummy only.
  assert {tuple(w.shape) for w in model.trainable_weights} == {(), (6, 1)}


def train_tutorial_like(strategy):
  """A small model in the tutorial's form, every placement; after fit."""
  features = {
    "user_id": krs_feature("user", krs_table("users", 9, "sparsecore")),
    "movie_id": krs_feature(
      "movie", krs_table("movies", 40, "default_device", optimizer="adagrad")
    ),
    "tags": krs_feature(
      "tags", krs_table("tags", 25, optimizer=tpe.SGD(0.2)), (B, 3)
    ),
  }

  class Model(keras.Model):
    def __init__(self):
      super().__init__()
      self.embedding_layer = DistributedEmbedding(
        features, row_sharding_threshold=20
      )
      self.ratings = keras.layers.Dense(
        1, kernel_initializer=keras.initializers.Constant(0.1)
      )

    def call(self, x):
      e = self.embedding_layer(x)
      return self.ratings(keras.ops.concatenate([e[k] for k in sorted(e)], 1))

  with strategy.scope():
    model = Model()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
  rng = np.random.default_rng(5)
  n = 4 * B
  x = {
    "user_id": rng.integers(0, 9, n).astype("int32"),
    "movie_id": rng.integers(0, 40, n).astype("int32"),
    "tags": rng.integers(0, 25, (n, 3)).astype("int32"),
  }
  y = rng.normal(size=(n, 1)).astype("f4")
  ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
  with strategy.scope():
    model.fit(ds, epochs=2, verbose=0)
  return model, x


def test_two_replicas_train_as_one_device():
  one, x = train_tutorial_like(tf.distribute.get_strategy())
  two, _ = train_tutorial_like(mirrored_strategy(2))
  layouts = {n: s.layout for n, s in two.embedding_layer.table_stores.items()}
  assert layouts == {
    "users": "row_sharded",
    "movies": "replicated",
    "tags": "row_sharded",
  }
  want = one.embedding_layer.get_embedding_tables()
  got = two.embedding_layer.get_embedding_tables()
  for name, table in want.items():
    np.testing.assert_allclose(got[name], table, atol=1e-5, err_msg=name)
    rows = table.shape[0]
    assert not np.allclose(table, values(rows, rows)), f"{name} did not train"
  for a, b in zip(one.ratings.weights, two.ratings.weights, strict=True):
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)
  np.testing.assert_allclose(
    two.predict(x, verbose=0), one.predict(x, verbose=0), atol=1e-5
  )


# --- saving and the TPU hand-over ---------------------------------------------


def test_get_config_round_trips_without_keras_rs_classes():
  features = {
    "a": krs_feature(
      "a",
      keras_rs.layers.TableConfig(
        name="a",
        vocabulary_size=30,
        embedding_dim=DIM,
        placement="sparsecore",
        optimizer="adagrad",
      ),
    ),
    "b": krs_feature(
      "b",
      keras_rs.layers.TableConfig(
        name="b", vocabulary_size=20, embedding_dim=DIM
      ),
      (B, 3),
      (B, 3, DIM),
    ),
  }
  layer = DistributedEmbedding(features, row_sharding_threshold=5, name="emb")
  config = json.loads(json.dumps(layer.get_config()))
  with mirrored_strategy(2).scope():
    restored = DistributedEmbedding.from_config(config)
  assert restored.name == "emb"
  assert restored.placements == {"a": "sparsecore", "b": "auto"}
  assert {n: s.layout for n, s in restored.table_stores.items()} == {
    "a": "row_sharded",
    "b": "row_sharded",  # auto, 20 > 5 rows
  }
  assert restored.table_stores["a"].table.optimizer == tpe.Adagrad()
  features = restored.mid_level_api.feature_config
  assert features["b"].max_sequence_length == 3


def test_model_save_and_load_keep_tables_and_placements(tmp_path):
  table = keras_rs.layers.TableConfig(
    name="t", vocabulary_size=10, embedding_dim=DIM, placement="sparsecore"
  )
  layer = DistributedEmbedding({"f": krs_feature("f", table)})
  inputs = {"f": keras.Input(shape=(), dtype="int32", name="f")}
  model = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)["f"]))
  model.compile(optimizer="adam", loss="mse")
  x = {"f": np.arange(B) % 10}
  model.fit(x, np.ones((B, 1)), verbose=0)
  path = str(tmp_path / "model.keras")
  model.save(path)

  loaded = keras.models.load_model(path)

  (restored,) = [
    x for x in loaded.layers if isinstance(x, DistributedEmbedding)
  ]
  assert restored.placements == {"t": "sparsecore"}
  np.testing.assert_array_equal(
    restored.get_embedding_tables()["t"], layer.get_embedding_tables()["t"]
  )
  np.testing.assert_array_equal(
    restored.table_stores["t"].read("momenta"),
    layer.table_stores["t"].read("momenta"),
  )
  np.testing.assert_allclose(
    loaded.predict(x, verbose=0), model.predict(x, verbose=0)
  )


@pytest.mark.parametrize("kind", [RowThreshold, PlacementPolicy])
def test_tpu_embedding_layer_saves_a_row_threshold(kind):
  from tpu_embedding.layers import TPUEmbedding

  threshold = kind(5, {"t": "replicated"})
  layer = TPUEmbedding(
    {"f": tpe.FeatureConfig(tpe.TableConfig(30, 2, name="t"))},
    "sgd",
    row_sharding_threshold=threshold,
  )
  config = json.loads(json.dumps(layer.get_config()))
  assert config["row_sharding_threshold"] == {  # as a RowThreshold was
    "threshold": 5,
    "forced": {"t": "replicated"},
  }
  with mirrored_strategy(2).scope():
    restored = TPUEmbedding.from_config(config)
  assert restored.table_stores["t"].layout == "replicated"


def test_tpu_strategy_hands_over_to_keras_rs(monkeypatch):
  monkeypatch.setattr(distributed_embedding, "is_tpu_strategy", lambda s: True)
  features = {"f": krs_feature("f", krs_table("t", 10, "default_device"))}
  layer = DistributedEmbedding(features, name="handed_over")
  assert type(layer).__module__.startswith("keras_rs")
  assert isinstance(layer, keras_rs.layers.DistributedEmbedding)
  assert layer.name == "handed_over"
  ours = [tpe.FeatureConfig(tpe.TableConfig(10, 2, name="t"))]
  with pytest.raises(ValueError, match="not a mix"):
    distributed_embedding.for_keras_rs(ours + [features["f"]])
  monkeypatch.setitem(sys.modules, "keras_rs", None)  # not installed
  with pytest.raises(ImportError, match="pip install keras-rs"):
    DistributedEmbedding(features)


def test_weights_follow_the_tfrs_convention(tmp_path):
  """README "Differences from keras-rs": tables are not Keras weights."""
  table = krs_table("t", 10, "default_device", optimizer="adagrad")
  layer = DistributedEmbedding({"f": krs_feature("f", table)})
  inputs = {"f": keras.Input(shape=(), dtype="int32", name="f")}
  model = keras.Model(inputs, keras.layers.Dense(1)(layer(inputs)["f"]))
  model.compile(optimizer="adam", loss="mse")
  x, y = {"f": np.arange(B) % 10}, np.ones((B, 1))
  model.fit(x, y, verbose=0)
  # One scalar stands for the tables in Keras' lists (tfrs' dummy).
  assert [tuple(w.shape) for w in layer.trainable_variables] == [()]
  assert [a.shape for a in layer.get_weights()] == [()]
  saved = np.array(layer.get_embedding_tables()["t"])
  weights = model.get_weights()
  model.save_weights(str(tmp_path / "m.weights.h5"))
  model.fit(x, -y, verbose=0)
  moved = np.array(layer.get_embedding_tables()["t"])
  assert not np.allclose(moved, saved)
  model.set_weights(weights)  # Keras weights only: tables stay trained.
  np.testing.assert_array_equal(layer.get_embedding_tables()["t"], moved)
  model.load_weights(str(tmp_path / "m.weights.h5"))  # Tables too.
  np.testing.assert_array_equal(layer.get_embedding_tables()["t"], saved)
