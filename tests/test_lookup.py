"""Lookups and shapes of the training object, checked against TensorFlow.

The oracle is TensorFlow's autodiff over its own serving lookup: for SGD,
``table - lr * d loss / d table`` is exactly the TPU update (a row's gradient
summed over duplicates), so any input kind can be checked end to end.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe

TF_EMB = tf.tpu.experimental.embedding
VOCAB, DIM, LR = 12, 3, 0.25


def sparse(indices, values, shape):
  return tf.SparseTensor(
    tf.constant(indices, tf.int64), tf.constant(values, tf.int64), shape
  )


#: name -> (ids, weights, feature kwargs, expected activation shape).
INPUTS = {
  "dense_rank1": (tf.constant([1, 5, 1, 0]), None, {}, [4, DIM]),
  "dense_last_dim_1": (tf.constant([[1], [5], [1]]), None, {}, [3, DIM]),
  "dense_rank3": (tf.constant([[[1], [2]], [[2], [3]]]), None, {}, [2, 2, DIM]),
  # Fixed-length multi-hot: gathered as is, one activation per id (as the
  # serving lookup does; TensorFlow's TPU enqueue rejects it).
  "dense_multi_id": (
    tf.constant([[1, 5, 1], [0, 5, 7]]),
    None,
    {},
    [2, 3, DIM],
  ),
  "dense_rank3_multi_id": (
    tf.constant([[[1, 2], [2, 3]], [[9, 9], [0, 1]]]),
    None,
    {},
    [2, 2, 2, DIM],
  ),
  "sparse_weighted": (
    sparse([[0, 0], [0, 2], [2, 1]], [3, 3, 7], [4, 3]),
    tf.SparseTensor([[0, 0], [0, 2], [2, 1]], [0.5, 2.0, 1.5], [4, 3]),
    {},
    [4, DIM],
  ),
  "sparse_rank3": (
    sparse([[0, 0, 0], [0, 0, 1], [1, 1, 0]], [4, 9, 4], [2, 2, 2]),
    None,
    {},
    [2, 2, DIM],
  ),
  "ragged_weighted": (
    tf.ragged.constant([[1, 1, 2], [], [11]], dtype=tf.int64),
    tf.ragged.constant([[1.0, 2.0, 0.5], [], [3.0]]),
    {},
    [3, DIM],
  ),
  "ragged_sequence": (
    tf.ragged.constant([[1, 2, 3, 4], [5], []], dtype=tf.int64),
    None,
    {"max_sequence_length": 3},
    [3, 3, DIM],
  ),
  "sparse_sequence": (
    sparse([[0, 0], [0, 3], [1, 1]], [6, 7, 8], [2, 5]),
    None,
    {"max_sequence_length": 2},
    [2, 2, DIM],
  ),
  "ragged_output_shape_as_batch": (
    tf.ragged.constant([[1, 2], [3], [4, 4], [5]], dtype=tf.int64),
    None,
    {"output_shape": [2, 2]},
    [2, 2, DIM],
  ),
  "ragged_output_shape_multiple": (
    tf.ragged.constant([[1, 2, 3], [4]], dtype=tf.int64),
    None,
    {"output_shape": [4]},
    [4, DIM],
  ),
}


def reference(table_values, name, combiner):
  """Activations and SGD-updated table from TF's serving lookup + autodiff."""
  ids, weights, kwargs, _ = INPUTS[name]
  table = tf.Variable(table_values)
  tf_table = TF_EMB.TableConfig(VOCAB, DIM, combiner=combiner)
  feature = TF_EMB.FeatureConfig(tf_table, **kwargs)
  if name == "dense_last_dim_1":
    ids = ids[:, 0]  # TF's serving lookup keeps the last dim; TPU drops it.
  if name == "dense_rank3":
    ids = ids[..., 0]
  with tf.GradientTape() as tape:
    out = TF_EMB.serving_embedding_lookup(
      ids, weights, {tf_table: table}, feature
    )
    loss = tf.reduce_sum(out * projection(out.shape))
  grad = tf.convert_to_tensor(tape.gradient(loss, table))
  return out.numpy(), (table - LR * grad).numpy()


def projection(shape):
  values = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  return tf.constant(np.sin(values))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("name", sorted(INPUTS))
def test_training_step_matches_tensorflow_autodiff(name, combiner, rng):
  ids, weights, kwargs, expected_shape = INPUTS[name]
  table_values = rng.normal(size=(VOCAB, DIM)).astype(np.float32)
  table = tpe.TableConfig(
    VOCAB,
    DIM,
    combiner=combiner,
    initializer=tf.constant_initializer(table_values),
  )
  emb = tpe.TPUEmbedding(tpe.FeatureConfig(table, **kwargs), tpe.SGD(LR))

  @tf.function
  def step():
    emb.enqueue(ids, weights)
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = tf.reduce_sum(activations * projection(expected_shape))
    emb.apply_gradients(tape.gradient(loss, activations))
    return activations

  activations = step()
  want_activations, want_table = reference(table_values, name, combiner)
  assert activations.shape.as_list() == expected_shape
  np.testing.assert_allclose(
    activations.numpy(), want_activations.reshape(expected_shape), atol=1e-6
  )
  np.testing.assert_allclose(
    emb.embedding_tables[table].numpy(), want_table, atol=1e-6
  )


def test_features_of_every_kind_share_one_table(rng):
  values = rng.normal(size=(VOCAB, DIM)).astype(np.float32)
  table = tpe.TableConfig(
    VOCAB, DIM, combiner="sum", initializer=tf.constant_initializer(values)
  )
  features = {
    "dense": tpe.FeatureConfig(table),
    "ragged": tpe.FeatureConfig(table),
    "sequence": tpe.FeatureConfig(table, max_sequence_length=2),
  }
  emb = tpe.TPUEmbedding(features, tpe.SGD(LR))
  inputs = {
    "dense": tf.constant([1, 2]),
    "ragged": tf.ragged.constant([[1, 1], [3]]),
    "sequence": tf.ragged.constant([[2, 1, 9], []]),
  }
  emb.enqueue(inputs)
  activations = emb.dequeue()
  emb.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))
  np.testing.assert_allclose(activations["dense"], values[[1, 2]])
  np.testing.assert_allclose(
    activations["ragged"], [2 * values[1], values[3]], rtol=1e-6
  )
  np.testing.assert_allclose(
    activations["sequence"], [[values[2], values[1]], np.zeros((2, DIM))]
  )
  # Ones as gradients: each row moves by lr times its number of looked-up
  # occurrences (truncated sequence ids are not looked up).
  counts = np.zeros(VOCAB)
  for i in [1, 2, 1, 1, 3, 2, 1]:
    counts[i] += 1
  np.testing.assert_allclose(
    emb.embedding_tables[table].numpy(),
    values - LR * counts[:, None],
    rtol=1e-6,
  )


def test_quantization_applies_to_looked_up_rows():
  table = tpe.TableConfig(
    4,
    2,
    combiner="sum",
    initializer=tf.constant_initializer([[0.26, -3.0]] * 4),
    quantization_config=tpe.QuantizationConfig(5, lower=-1.0, upper=1.0),
  )
  emb = tpe.TPUEmbedding(tpe.FeatureConfig(table), tpe.SGD(0.1))
  out = emb(tf.ragged.constant([[0, 1]]))
  np.testing.assert_allclose(out.numpy(), [[1.0, -2.0]])


def test_output_shape_priority_config_then_build_then_first_batch():
  table = tpe.TableConfig(VOCAB, DIM)
  features = {
    "configured": tpe.FeatureConfig(table, output_shape=[2]),
    "built": tpe.FeatureConfig(table),
    "detected": tpe.FeatureConfig(table),
  }
  emb = tpe.TPUEmbedding(features, tpe.SGD(0.1))
  emb.build(
    {
      "configured": tf.TensorShape([2]),
      "built": tf.TensorShape([3, 1]),
      "detected": tf.TensorShape([None]),
    }
  )
  with pytest.raises(ValueError, match="built.*\\(3,\\).*\\(4,\\)"):
    emb.enqueue(
      {
        "configured": tf.constant([1, 2]),
        "built": tf.constant([1, 2, 3, 4]),
        "detected": tf.constant([1]),
      }
    )
  emb.enqueue(
    {
      "configured": tf.constant([1, 2]),
      "built": tf.constant([1, 2, 3]),
      "detected": tf.constant([1, 2, 3, 4, 5]),
    }
  )
  shapes = {k: v.shape.as_list() for k, v in emb.dequeue().items()}
  assert shapes == {
    "configured": [2, DIM],
    "built": [3, DIM],
    "detected": [5, DIM],
  }


def test_build_with_batch_size_gives_sequence_shapes():
  table = tpe.TableConfig(VOCAB, DIM)
  features = [
    tpe.FeatureConfig(table),
    tpe.FeatureConfig(table, max_sequence_length=4),
  ]
  emb = tpe.TPUEmbedding(features, tpe.SGD(0.1))
  emb.build(per_replica_batch_size=2)
  with pytest.raises(ValueError, match="Inconsistent shape"):
    emb.enqueue([tf.constant([1, 2, 3]), tf.ragged.constant([[1], [2], [3]])])


def test_one_device_strategy_training_loop(rng):
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  values = rng.normal(size=(VOCAB, DIM)).astype(np.float32)
  with strategy.scope():
    table = tpe.TableConfig(
      VOCAB, DIM, combiner="sum", initializer=tf.constant_initializer(values)
    )
    emb = tpe.TPUEmbedding(tpe.FeatureConfig(table), tpe.Adagrad(0.1))
  dataset = tf.data.Dataset.from_tensor_slices(
    tf.ragged.constant([[1, 2], [2], [3, 3]])
  ).batch(3)
  iterator = iter(
    strategy.experimental_distribute_dataset(
      dataset,
      options=tf.distribute.InputOptions(experimental_fetch_to_device=False),
    )
  )

  @tf.function
  def step():
    emb.enqueue(next(iterator), training=True)

    def replica_fn():
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        loss = tf.reduce_sum(activations)
      emb.apply_gradients(tape.gradient(loss, activations))

    strategy.run(replica_fn)

  step()
  # Gradient of each row: its number of occurrences; Adagrad from a = 0.1.
  counts = np.array([0, 1, 2, 2] + [0] * (VOCAB - 4), np.float32)
  want = values - 0.1 * counts[:, None] / np.sqrt(0.1 + counts[:, None] ** 2)
  np.testing.assert_allclose(emb.embedding_tables[table].numpy(), want, 1e-6)


def test_direct_lookup_is_differentiable_with_respect_to_tables():
  table = tpe.TableConfig(VOCAB, DIM, combiner="sum")
  emb = tpe.TPUEmbedding(tpe.FeatureConfig(table), tpe.SGD(0.1))
  variable = emb.embedding_tables[table]
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(emb(tf.ragged.constant([[1, 1], [4]])))
  grad = tf.convert_to_tensor(tape.gradient(loss, variable)).numpy()
  assert grad[1].tolist() == [2.0] * DIM and grad[4].tolist() == [1.0] * DIM
  assert np.count_nonzero(grad.sum(axis=1)) == 2


@pytest.mark.parametrize("run", ["eager", "function"])
def test_a_training_step_is_differentiated_at_its_activations_only(run):
  """As from TPU's dequeue: a tape over a training step differentiates
  the watched activations, not the gathers into the tables (the tables
  get their gradients from apply_gradients). Traced, the gathers'
  gradients were half of a 26-table step's ops, for nothing."""
  table = tpe.TableConfig(VOCAB, DIM, combiner="sum", name="t")
  emb = tpe.TPUEmbedding(tpe.FeatureConfig(table), tpe.SGD(0.1))
  emb.build()
  variable = emb.embedding_tables[table]

  def step():
    emb.enqueue(tf.ragged.constant([[1, 1], [4]]), training=True)
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = tf.reduce_sum(activations * 3.0)
    to_activations, to_table = tape.gradient(loss, [activations, variable])
    emb.apply_gradients(to_activations)
    return to_activations, to_table is None

  if run == "function":
    step = tf.function(step)
  to_activations, no_table_gradient = step()
  assert bool(no_table_gradient)
  np.testing.assert_array_equal(to_activations.numpy(), np.full([2, DIM], 3))


def test_none_gradient_is_a_zero_gradient():
  table = tpe.TableConfig(VOCAB, DIM, name="t")
  features = {"a": tpe.FeatureConfig(table), "b": tpe.FeatureConfig(table)}
  emb = tpe.TPUEmbedding(features, tpe.Adagrad(0.1))
  emb.build()
  before = emb.variables["t"]["accumulators"].numpy()
  emb.enqueue({"a": tf.constant([1]), "b": tf.constant([2])})
  activations = emb.dequeue()
  emb.apply_gradients({"a": tf.ones_like(activations["a"]), "b": None})
  after = emb.variables["t"]["accumulators"].numpy()
  np.testing.assert_allclose(after[1], before[1] + 1.0)
  np.testing.assert_array_equal(after[2], before[2])
