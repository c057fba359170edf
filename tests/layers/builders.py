"""Small configs, batches and models shared by the Keras layer tests.

Tables are tiny and start from known values; the models are linear in the
activations (one bias-free ``Dense(1)`` over their concatenation, in sorted
feature order), so a reference step is easy to compute by hand.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

import tpu_embedding as tpe
from tpu_embedding.layers.keras_compat import keras

V_BIG, V_SMALL, DIM, BATCH = 40, 7, 3, 6


def table_values(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  return (
    rng.normal(size=(V_BIG, DIM)).astype(np.float32),
    rng.normal(size=(V_SMALL, DIM)).astype(np.float32),
  )


def tables(big_optimizer=None, small_optimizer=None, seed: int = 0):
  """``(big, small)`` table configs with constant initial values."""
  big_init, small_init = table_values(seed)
  big = tpe.TableConfig(
    V_BIG,
    DIM,
    name="big",
    combiner="sum",
    optimizer=big_optimizer,
    initializer=tf.constant_initializer(big_init),
  )
  small = tpe.TableConfig(
    V_SMALL,
    DIM,
    name="small",
    combiner="sqrtn",
    optimizer=small_optimizer,
    initializer=tf.constant_initializer(small_init),
  )
  return big, small


def mixed_features(big, small) -> dict[str, tpe.FeatureConfig]:
  """Dense, sparse and ragged features on both tables, one sequence."""
  return {
    "big_dense": tpe.FeatureConfig(big),
    "big_ragged": tpe.FeatureConfig(big),
    "big_sparse": tpe.FeatureConfig(big),
    "small_dense": tpe.FeatureConfig(small),
    "small_ragged": tpe.FeatureConfig(small),
    "small_sequence": tpe.FeatureConfig(small, max_sequence_length=2),
  }


#: Features of ``mixed_features`` that get weights in ``mixed_batch``.
WEIGHTED = ("big_ragged", "big_sparse", "small_ragged")


#: Ids ``mixed_batch`` draws for the small table (its last rows stay unused).
SMALL_IDS = V_SMALL - 2


def mixed_batch(seed: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
  """``(ids, weights)`` for ``mixed_features``; empty rows, duplicates."""
  rng = np.random.default_rng(seed)

  def ragged(vocab, max_len):
    rows = [list(rng.integers(0, vocab, rng.integers(0, max_len + 1)))]
    rows += [list(rng.integers(0, vocab, rng.integers(1, max_len + 1)))]
    rows += [
      list(rng.integers(0, vocab, rng.integers(0, max_len + 1)))
      for _ in range(BATCH - 2)
    ]
    rows[0] = []
    return tf.ragged.constant(rows, dtype=tf.int64, ragged_rank=1)

  def weights_like(ids):
    if isinstance(ids, tf.SparseTensor):
      values = rng.uniform(0.5, 2.0, ids.values.shape).astype(np.float32)
      return tf.SparseTensor(ids.indices, values, ids.dense_shape)
    values = rng.uniform(0.5, 2.0, ids.values.shape).astype(np.float32)
    return ids.with_values(tf.constant(values))

  ids = {
    "big_dense": tf.constant(rng.integers(0, 4, BATCH), tf.int64),
    "big_ragged": ragged(V_BIG, 3),
    "big_sparse": tf.sparse.from_dense(
      tf.constant(
        rng.integers(0, V_BIG, (BATCH, 2)) * (rng.random((BATCH, 2)) < 0.7),
        tf.int64,
      )
    ),
    "small_dense": tf.constant(
      rng.integers(0, SMALL_IDS, (BATCH, 1)), tf.int64
    ),
    "small_ragged": ragged(SMALL_IDS, 3),
    "small_sequence": ragged(SMALL_IDS, 3),
  }
  weights = {k: (weights_like(ids[k]) if k in WEIGHTED else None) for k in ids}
  return ids, weights


def labels(seed: int = 2) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=(BATCH, 1)).astype(np.float32)


def kernel_for(features: dict[str, Any], seed: int = 3) -> np.ndarray:
  """A fixed ``Dense(1)`` kernel for the concatenated activations."""
  width = sum(
    f.table.dim * max(f.max_sequence_length, 1) for f in features.values()
  )
  rng = np.random.default_rng(seed)
  return rng.normal(size=(width, 1)).astype(np.float32)


def flat_activations(activations: dict[str, tf.Tensor]) -> tf.Tensor:
  """The activations side by side, sorted by feature name.

  The width of each comes from its static shape, so a ``Dense`` layer on top
  builds even when the batch size is unknown (as under tf-keras with
  MultiWorkerMirroredStrategy, where partial batches are possible).
  """
  return tf.concat(
    [
      tf.reshape(activations[k], [-1, activations[k].shape[1:].num_elements()])
      for k in sorted(activations)
    ],
    axis=1,
  )


class LinearModel(keras.Model):
  """``Dense(1, use_bias=False)`` over an embedding layer's activations.

  Inputs are ``{"ids": ..., "weights": ...}`` with weights for the
  ``WEIGHTED`` features present, or just the ids.
  """

  def __init__(self, embedding, kernel: np.ndarray):
    super().__init__()
    self.embedding = embedding
    self.dense = keras.layers.Dense(
      1, use_bias=False, kernel_initializer=keras.initializers.Constant(kernel)
    )

  def call(self, inputs, training=None):
    if "ids" in inputs:
      ids = inputs["ids"]
      weights = {k: inputs["weights"].get(k) for k in ids}
    else:
      ids, weights = inputs, None
    activations = self.embedding(ids, weights, training=training)
    return self.dense(flat_activations(activations))


def model_inputs(ids, weights) -> dict[str, Any]:
  return {"ids": ids, "weights": {k: weights[k] for k in WEIGHTED}}


def mse(predictions, targets):
  return tf.reduce_mean(tf.square(predictions - targets))


def full_values(variables: dict[str, dict[str, Any]]) -> dict:
  """``{(table, slot): numpy value}`` whatever the layout (every layout's
  variable converts to its whole value, see ``tpu_embedding.tables``)."""
  return {
    (table, slot): np.asarray(tf.convert_to_tensor(variable))
    for table, slots in variables.items()
    for slot, variable in slots.items()
  }
