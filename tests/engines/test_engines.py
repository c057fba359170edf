"""The facade means the same thing on every engine, or says why not.

``TPUEmbeddingV3`` forwards every call to the engine it picked at
construction. Without a TPU, the TPU engines run on stand-ins: TensorFlow's
own ``TPUEmbedding`` in its CPU mode (which builds real host variables) and
a recording ``TPUEmbeddingV2``. Each public property and method is checked
on every engine: it returns what its docstring promises, or raises an
error that names TPUStrategy and what to do instead (never an
``AttributeError``, never a silently empty value).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy
from tpu_embedding import embedding as embedding_module
from tpu_embedding.engines import off_tpu
from tpu_embedding.engines import tpu

TFE = tf.tpu.experimental.embedding


class _RecordingSparseCore(TFE.TPUEmbeddingV2):
  """A SparseCore stand-in (the real class needs a TPU)."""

  def __init__(self, feature_config, optimizer, pipelining, config):
    # Deliberately no super().__init__: it requires a TPUStrategy.
    self.__dict__["_variables"] = {}

  @property
  def embedding_tables(self):
    return {"stacked_table": tf.zeros([3, 2])}

  def build(self):
    self.__dict__["_variables"] = {
      "stacked_table": {"parameters": tf.Variable(tf.zeros([3, 2]))}
    }


def _features():
  items = tpe.TableConfig(12, 4, name="items", combiner="sum")
  users = tpe.TableConfig(7, 3)
  return {"item": tpe.FeatureConfig(items), "user": tpe.FeatureConfig(users)}


ENGINES = {
  "off_tpu": None,
  "tpu_embedding_engine": lambda config, opt: tpu.TPUEngine(config, opt),
  "sparse_core": lambda config, opt: tpu.SparseCoreEngine(
    config, opt, _RecordingSparseCore
  ),
}


@pytest.fixture(params=sorted(ENGINES))
def built(request, monkeypatch):
  """``(name, embedding, feature config)`` on each engine, built."""
  make = ENGINES[request.param]
  if make is not None:
    monkeypatch.setattr(
      embedding_module,
      "select_engine",
      lambda config, optimizer, *args, **kwargs: make(config, optimizer),
    )
  features = _features()
  emb = tpe.TPUEmbedding(features, tpe.Adagrad(0.1))
  emb.build()
  return request.param, emb, features


def test_engine_is_chosen_once_and_exposed(built):
  name, emb, _ = built
  expected = {
    "off_tpu": "OffTPUEngine",
    "tpu_embedding_engine": "TPUEngine",
    "sparse_core": "SparseCoreEngine",
  }
  assert type(emb.engine).__name__ == expected[name]


def test_feature_config_and_table_names_on_every_engine(built):
  _, emb, features = built
  assert emb.feature_config is features
  assert emb.table_names == {
    features["item"].table: "items",
    features["user"].table: "table_1",
  }


def test_tables_and_variables_on_every_engine(built):
  name, emb, features = built
  tables = emb.embedding_tables
  if name == "sparse_core":  # TensorFlow's: by stacked table name.
    assert list(tables) == ["stacked_table"]
  else:
    assert list(tables) == [features["item"].table, features["user"].table]
    assert tf.convert_to_tensor(tables[features["item"].table]).shape == (
      12,
      4,
    )
  variables = emb.variables
  assert variables, "variables must never be silently empty"
  for slots in variables.values():
    assert "parameters" in slots
  if name != "sparse_core":
    assert set(variables) == {"items", "table_1"}
    assert set(variables["items"]) == {"parameters", "accumulators"}


def test_off_tpu_only_members_raise_clearly_on_tpu(built):
  name, emb, _ = built
  off_tpu_only = {
    "backend": lambda: emb.backend,
    "table_stores": lambda: emb.table_stores,
    "embedding_lookup": lambda: emb(
      {"item": tf.constant([1]), "user": tf.constant([2])}
    ),
    "lookup_for_training": lambda: emb.lookup_for_training(
      {"item": tf.constant([1]), "user": tf.constant([2])}
    ),
  }
  for member, use in off_tpu_only.items():
    if name == "off_tpu":
      assert use() is not None, member
    else:
      with pytest.raises(RuntimeError, match="TPUStrategy"):
        use()


def test_sharding_plan_and_flush_on_every_engine(built):
  _, emb, _ = built
  assert emb.sharding_plan is None  # one device, or TensorFlow's TPU
  emb.flush_pipeline()  # a no-op without pipelining, everywhere


def test_tpu_checkpoints_copy_tables_only_on_the_embedding_engine(built):
  name, emb, _ = built
  assert emb.engine.copies_tables_around_checkpoints == (
    name == "tpu_embedding_engine"
  )


# --- embedding_tables under every off-TPU layout -----------------------------


@pytest.mark.parametrize(
  "replicas,threshold",
  [(1, 0), (2, 0), (2, 1000)],
  ids=["one_device", "row_sharded", "replicated"],
)
def test_embedding_tables_convert_like_tensorflow_variables(
  replicas, threshold
):
  values = np.arange(40, dtype=np.float32).reshape(10, 4)
  table = tpe.TableConfig(
    10, 4, name="t", initializer=tf.constant_initializer(values)
  )
  strategy = (
    tf.distribute.get_strategy() if replicas == 1 else mirrored_strategy(2)
  )
  with strategy.scope():
    emb = tpe.TPUEmbedding(
      tpe.FeatureConfig(table), tpe.SGD(0.1), row_sharding_threshold=threshold
    )
  value = emb.embedding_tables[table]
  np.testing.assert_array_equal(tf.convert_to_tensor(value).numpy(), values)
  np.testing.assert_array_equal(np.asarray(value.numpy()), values)
  assert tuple(value.shape) == (10, 4)
  local = strategy.experimental_local_results(value)
  assert len(local) >= 1
  np.testing.assert_array_equal(tf.convert_to_tensor(local[0]).numpy(), values)
  # The serving lookup reads every layout in id order.
  rows = tpe.serving_embedding_lookup(
    tf.constant([9, 0, 5]),
    None,
    {table: value},
    tpe.FeatureConfig(table),
  )
  np.testing.assert_array_equal(rows.numpy(), values[[9, 0, 5]])


# --- per-replica features enqueued outside strategy.run ----------------------


def test_each_replica_features_are_prepared_once_per_step(monkeypatch):
  """Enqueued outside ``strategy.run``, replica 0's features are prepared
  (and checked) by enqueue and used by its dequeue, not prepared again;
  every replica still looks up its own ids."""
  values = np.arange(40, dtype=np.float32).reshape(10, 4)
  table = tpe.TableConfig(
    10, 4, name="t", initializer=tf.constant_initializer(values)
  )
  strategy = mirrored_strategy(2)
  with strategy.scope():
    emb = tpe.TPUEmbedding(tpe.FeatureConfig(table), tpe.SGD(0.1))
  prepared = []
  prepare = off_tpu.prepare_features
  monkeypatch.setattr(
    off_tpu,
    "prepare_features",
    lambda *args, **kwargs: prepared.append(1) or prepare(*args, **kwargs),
  )
  dataset = tf.data.Dataset.from_tensor_slices(
    tf.constant([3, 1, 4, 1], tf.int64)
  ).batch(4, drop_remainder=True)
  ids = next(iter(strategy.experimental_distribute_dataset(dataset)))

  @tf.function
  def step(ids):
    emb.enqueue(ids, training=True)

    def replica_fn():
      activations = emb.dequeue()
      emb.apply_gradients(tf.zeros_like(activations))
      return activations

    return strategy.run(replica_fn)

  activations = strategy.experimental_local_results(step(ids))
  assert len(prepared) == 2  # One per replica.
  np.testing.assert_array_equal(activations[0].numpy(), values[[3, 1]])
  np.testing.assert_array_equal(activations[1].numpy(), values[[4, 1]])
