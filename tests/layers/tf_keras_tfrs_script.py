"""The layers under tf-keras, in a ``tfrs.Model`` with ``tfrs.tasks.Ranking``.

Run by ``test_tf_keras.py`` in a fresh interpreter with
``TF_USE_LEGACY_KERAS=1`` (which must be set before TensorFlow loads Keras);
prints ``OK`` when every check passed. Importing this module does nothing.
"""

from __future__ import annotations

import os


def _tables(tpe, tf, np):
  rng = np.random.default_rng(0)
  big = tpe.TableConfig(
    40,
    3,
    name="big",
    combiner="sum",
    optimizer=tpe.Adagrad(0.2),
    initializer=tf.constant_initializer(rng.normal(size=(40, 3))),
  )
  small = tpe.TableConfig(
    7,
    3,
    name="small",
    initializer=tf.constant_initializer(rng.normal(size=(7, 3))),
  )
  return {
    "user": tpe.FeatureConfig(small),
    "item": tpe.FeatureConfig(big),
    "history": tpe.FeatureConfig(big),
  }


def _data(tf, np, samples=16):
  rng = np.random.default_rng(1)
  history = [
    list(rng.integers(0, 30, rng.integers(0, 4))) for _ in range(samples)
  ]
  return {
    "user": tf.constant(rng.integers(0, 5, samples)),
    "item": tf.constant(rng.integers(0, 30, samples)),
    "history": tf.ragged.constant(history, dtype=tf.int64, ragged_rank=1),
    "rating": tf.constant(rng.normal(size=(samples, 1)).astype(np.float32)),
  }


def _values(layer):
  import numpy as np
  import tensorflow as tf

  def full_value(variable):  # Every layout's variable converts to its whole.
    return np.asarray(tf.convert_to_tensor(variable))

  if hasattr(layer, "mid_level_api"):
    variables = layer.mid_level_api.variables
    return {
      (t, s): full_value(v)
      for t, slots in variables.items()
      for s, v in slots.items()
    }
  return {
    (t.name, "keras"): full_value(v) for t, v in layer.embedding_tables.items()
  }


def main() -> None:
  assert os.environ.get("TF_USE_LEGACY_KERAS") == "1"
  import numpy as np
  import tensorflow as tf
  import tensorflow_recommenders as tfrs
  import tf_keras

  import tpu_embedding as tpe
  from tpu_embedding.layers import PartialTPUEmbedding
  from tpu_embedding.layers import TPUEmbedding
  from tpu_embedding.layers import keras_compat

  assert not keras_compat.IS_KERAS_3
  tf_keras.utils.set_random_seed(0)  # The dense layers' initial weights.
  assert issubclass(TPUEmbedding, tf_keras.layers.Layer)
  assert issubclass(PartialTPUEmbedding, tf.keras.layers.Layer)

  class RankingModel(tfrs.Model):
    def __init__(self, embedding):
      super().__init__()
      self.embedding = embedding
      self.score = tf_keras.layers.Dense(1)
      self.task = tfrs.tasks.Ranking(
        loss=tf_keras.losses.MeanSquaredError(),
        metrics=[tf_keras.metrics.RootMeanSquaredError()],
      )

    def call(self, features, training=None):
      ids = {k: features[k] for k in ("user", "item", "history")}
      activations = self.embedding(ids, training=training)
      return self.score(tf.concat([activations[k] for k in sorted(ids)], 1))

    def compute_loss(self, features, training=False):
      return self.task(
        labels=features["rating"], predictions=self(features, training)
      )

  data = _data(tf, np)
  dataset = tf.data.Dataset.from_tensor_slices(data).batch(4)
  used = {
    "big": set(data["item"].numpy()) | set(data["history"].values.numpy()),
    "small": set(data["user"].numpy()),
  }

  # 1. TPUEmbedding: per-table optimizers in fit, Keras' for the rest.
  model = RankingModel(TPUEmbedding(_tables(tpe, tf, np), tpe.SGD(0.1)))
  model.compile(optimizer=tf_keras.optimizers.Adagrad(0.1))
  before = _values(model.embedding)
  history = model.fit(dataset, epochs=3, verbose=0)
  assert history.history["loss"][-1] < history.history["loss"][0], history
  after = _values(model.embedding)
  for (table, slot), value in after.items():
    changed = np.flatnonzero(np.any(value != before[table, slot], axis=1))
    assert set(changed) == used[table], (table, slot, changed)
  names = [v.name for v in model.trainable_variables]
  assert any("tpu_embedding_helper_dummy" in n for n in names), names
  assert not any(tuple(v.shape) in {(40, 3), (7, 3)} for v in model.variables)
  model.predict(dataset, verbose=0)
  model.evaluate(dataset, verbose=0)
  for key, value in _values(model.embedding).items():
    np.testing.assert_array_equal(value, after[key], err_msg=str(key))

  # 2. A checkpoint restores the tables into a fresh model.
  path = tf.train.Checkpoint(model=model).save(os.environ["CKPT_DIR"] + "/c")
  fresh = RankingModel(TPUEmbedding(_tables(tpe, tf, np), tpe.SGD(0.1)))
  tf.train.Checkpoint(model=fresh).restore(path).expect_partial()
  for key, value in _values(fresh.embedding).items():
    np.testing.assert_array_equal(value, after[key], err_msg=str(key))

  # 3. PartialTPUEmbedding: the small table is a Keras weight trained by
  #    Keras' Adagrad, the large one by its own Adagrad.
  partial = PartialTPUEmbedding(_tables(tpe, tf, np), "sgd", size_threshold=10)
  model = RankingModel(partial)
  model.compile(optimizer=tf_keras.optimizers.Adagrad(0.1))
  before = _values(partial.tpu_embedding)
  small_before = _values(partial.replicated_embedding)
  model.fit(dataset, epochs=1, verbose=0)
  assert any(tuple(v.shape) == (7, 3) for v in model.trainable_variables)
  for key, value in _values(partial.tpu_embedding).items():
    assert not np.array_equal(value, before[key]), key
  for key, value in _values(partial.replicated_embedding).items():
    assert not np.array_equal(value, small_before[key]), key

  # 4. A functional tf-keras model (ragged Input) saves to and loads from
  #    a .keras file with every table and slot.
  inputs = {
    "history": tf_keras.Input((None,), dtype="int64", ragged=True, name="h"),
    "user": tf_keras.Input((), dtype="int64", name="user"),
  }
  features = _tables(tpe, tf, np)
  del features["item"]
  layer = TPUEmbedding(features, "adagrad", name="embedding")
  activations = layer(inputs)
  joined = tf_keras.layers.Concatenate()(
    [activations["history"], activations["user"]]
  )
  functional = tf_keras.Model(inputs, tf_keras.layers.Dense(1)(joined))
  functional.compile(optimizer="adam", loss="mse")
  x = {"history": data["history"], "user": data["user"]}
  functional.fit(x, data["rating"], epochs=1, verbose=0)
  functional.save(os.environ["CKPT_DIR"] + "/model.keras")
  loaded = tf_keras.models.load_model(os.environ["CKPT_DIR"] + "/model.keras")
  loaded_layer = loaded.get_layer("embedding")
  assert type(loaded_layer) is TPUEmbedding
  want = _values(layer)
  for key, value in _values(loaded_layer).items():
    np.testing.assert_array_equal(value, want[key], err_msg=str(key))
  print("OK")


if __name__ == "__main__":
  main()
