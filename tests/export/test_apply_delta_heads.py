"""Versions made from deltas serve a fresh export's predictions, for every
kind of dense head.

A head's weights reach the SavedModel by another road per kind: Keras 3
keeps a ``tf.Variable`` inside each ``keras.Variable`` (the checkpoint
names the wrapper, the signature captures the inner one); tf-keras and
``tf.Module`` variables are ``tf.Variable``s; and a dense optimizer in the
training checkpoint saves the weights under its own path
(``dense_optimizer/_trainable_variables/0``), not the model's. For each
head, float32 and int8: train with a ``CheckpointManager`` writing a full
checkpoint then two deltas, export version 1 from the full checkpoint,
make versions 2 and 3 with ``apply_delta``, and compare version 3's served
predictions with a fresh export of the run's latest save (bit for bit),
whose model weights must be the trained ones.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tpu_embedding import export

SHAPES = {"users": (30, 4), "items": (20, 3)}
WIDTH = sum(dim for _, dim in SHAPES.values())
BATCH = 8
HEADS = ["keras_sequential", "keras_functional", "tf_keras", "tf_module"]


def feature_config():
  init = tf.random_uniform_initializer(-1.0, 1.0, seed=1)
  tables = {
    name: tpe.TableConfig(rows, dim, name=name, initializer=init)
    for name, (rows, dim) in SHAPES.items()
  }
  return {
    "user": tpe.FeatureConfig(tables["users"]),
    "item": tpe.FeatureConfig(tables["items"]),
  }


class ModuleHead(tf.Module):
  def __init__(self):
    super().__init__()
    rng = np.random.default_rng(0)
    self.kernel = tf.Variable(rng.normal(size=[WIDTH, 1]).astype(np.float32))
    self.bias = tf.Variable(tf.zeros([1]))

  def __call__(self, x):
    return x @ self.kernel + self.bias


def make_head(kind):
  """``(head, dense optimizer or None)``: a head of ``kind``, built."""
  if kind == "keras_sequential":
    head = keras.Sequential(
      [keras.layers.Dense(5, activation="relu"), keras.layers.Dense(1)]
    )
    head.build((None, WIDTH))
    return head, keras.optimizers.SGD(0.1)
  if kind == "keras_functional":
    inputs = keras.Input((WIDTH,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    head = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    return head, keras.optimizers.Adam(0.05)
  if kind == "tf_keras":
    tf_keras = pytest.importorskip("tf_keras")
    head = tf_keras.Sequential(
      [tf_keras.layers.Dense(5, activation="relu"), tf_keras.layers.Dense(1)]
    )
    head.build((None, WIDTH))
    return head, tf_keras.optimizers.SGD(0.1)
  return ModuleHead(), None


def _score(head, activations):
  return head(tf.concat([activations["user"], activations["item"]], axis=1))


def _train(directory, kind, steps=3):
  """Trains; saves ckpt-1, delta-2, delta-3. Returns the live head."""
  emb = tpe.TPUEmbedding(feature_config(), tpe.Adagrad(0.1))
  head, optimizer = make_head(kind)
  objects = {"embedding": emb, "model": head}
  if optimizer is not None:
    optimizer.build(head.trainable_variables)
    objects["dense_optimizer"] = optimizer  # saved first: its paths win
  manager = tpe.checkpoints.CheckpointManager(
    tf.train.Checkpoint(**objects),
    directory,
    max_to_keep=5,
    delta_interval=2,
  )
  rng = np.random.default_rng(7)
  for step in range(1, steps + 1):
    batch = {
      name: tf.constant(rng.integers(0, SHAPES[table][0], BATCH), tf.int64)
      for name, table in (("user", "users"), ("item", "items"))
    }
    emb.enqueue(batch, training=True)
    with tf.GradientTape() as tape:
      acts = emb.dequeue()
      tape.watch(acts)
      loss = tf.reduce_sum(_score(head, acts) ** 2)
    variables = head.trainable_variables
    grads = tape.gradient(loss, {"acts": acts, "dense": variables})
    emb.apply_gradients(grads["acts"])
    if optimizer is None:
      for variable, grad in zip(variables, grads["dense"], strict=True):
        variable.assign_sub(0.1 * grad)
    else:
      optimizer.apply_gradients(zip(grads["dense"], variables, strict=True))
    manager.save(checkpoint_number=step)
  return head


def _export(export_dir, kind, path, table_dtype):
  """Exports the save ``path`` with a fresh head; returns its source."""
  served, _ = export.serving_embedding_for(feature_config())
  head, _ = make_head(kind)
  checkpoint = tf.train.Checkpoint(embedding=served, model=head)
  source = export.restore_for_export(checkpoint, path, served)
  export.export_for_serving(
    export_dir,
    served,
    lambda inputs: {"score": _score(head, inputs)},
    {"user": export.FeatureSpec(), "item": export.FeatureSpec()},
    feature_config=feature_config(),
    table_dtype=table_dtype,
    source=export.ExportSource(source, checkpoint),
  )
  return source


def _serve(export_dir):
  rng = np.random.default_rng(11)
  request = {
    name: tf.constant(rng.integers(0, SHAPES[table][0], 16), tf.int64)
    for name, table in (("user", "users"), ("item", "items"))
  }
  serve = tf.saved_model.load(export_dir).signatures["serving_default"]
  return serve(**request)["score"].numpy()


def _saved_values(export_dir):
  reader = tf.train.load_checkpoint(
    os.path.join(export_dir, "variables/variables")
  )
  return [
    reader.get_tensor(key)
    for key in reader.get_variable_to_shape_map()
    if key.startswith("model_variables/")
  ]


@pytest.mark.parametrize("table_dtype", ["float32", "int8"])
@pytest.mark.parametrize("kind", HEADS)
def test_versions_from_deltas_serve_a_fresh_exports_predictions(
  tmp_path, kind, table_dtype
):
  run = str(tmp_path / "run")
  live = _train(run, kind)
  versions = str(tmp_path / "serving")
  _export(f"{versions}/1", kind, f"{run}/ckpt-1", table_dtype)
  for step in (2, 3):
    made = export.apply_delta(
      f"{versions}/{step - 1}", f"{run}/delta-{step}", f"{versions}/{step}"
    )
    assert made.model_variables == len(live.trainable_variables)
  assert (
    _export(f"{tmp_path}/fresh", kind, run, table_dtype) == f"{run}/delta-3"
  )
  got, want = _serve(f"{versions}/3"), _serve(f"{tmp_path}/fresh")
  np.testing.assert_array_equal(got, want)
  assert np.abs(got - _serve(f"{versions}/1")).max() > 1e-4
  # The fresh export serves the trained weights (not a head's initial ones).
  saved = _saved_values(f"{tmp_path}/fresh")
  for variable in live.trainable_variables:
    value = np.asarray(variable.numpy())
    assert any(
      s.shape == value.shape and np.array_equal(s, value) for s in saved
    ), variable.name
  with open(f"{versions}/3/assets.extra/tpu_embedding_source.json") as f:
    record = json.load(f)
  assert record["unmapped_model_variables"] == 0
  assert record["history"] == ["ckpt-1", "delta-2", "delta-3"]


def test_a_model_variable_the_source_lacks_is_refused_before_writing(tmp_path):
  run = str(tmp_path / "run")
  _train(run, "keras_sequential", steps=1)
  served, _ = export.serving_embedding_for(feature_config())
  head, _ = make_head("keras_sequential")
  checkpoint = tf.train.Checkpoint(embedding=served, model=head)
  source = export.restore_for_export(checkpoint, run, served)
  stray = tf.Variable(2.0, name="stray_scale")  # in no checkpoint
  with pytest.raises(ValueError, match=r"1 variable\(s\).*stray_scale") as e:
    export.export_for_serving(
      str(tmp_path / "1"),
      served,
      lambda inputs: {"score": _score(head, inputs) * stray},
      {"user": export.FeatureSpec(), "item": export.FeatureSpec()},
      feature_config=feature_config(),
      source=export.ExportSource(source, checkpoint),
    )
  assert "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "1")
