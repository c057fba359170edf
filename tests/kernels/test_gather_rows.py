"""Gathering rows: the ``TpeGatherRows`` and ``TpeGatherPieces`` kernels.

Every lookup gathers each table's distinct rows (``tables/whole.py``) and
each owner the rows other replicas ask for (``backends/exchanges.py``)
through ``kernels/gather_rows.py``; its kernel must return exactly
``tf.gather(variable, ids)``, refuse ids out of range, and leave other
variables (distributed, other dtypes) to ``tf.gather``. The combiner reads
a one-id feature's rows out of what a row source returned (for the
all-to-all lookup, its owners' replies) with ``gather_pieces``, which must
return exactly ``tf.gather(tf.concat(pieces, 0), index)`` and its gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import mirrored_strategy
from tpu_embedding import kernels
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import KernelOps

pytestmark = pytest.mark.skipif(
  kernels.load() is None, reason="the kernel library did not build"
)

KERNEL_OPS = KernelOps(kernels.load())

IDS = {
  "none": lambda rng, rows: np.zeros([0], np.int64),
  "one": lambda rng, rows: np.array([rows - 1], np.int64),
  "duplicates": lambda rng, rows: rng.integers(0, 5, 200),
  "random": lambda rng, rows: rng.integers(0, rows, 3000),
}


def _kernel(variable, ids):
  return kernels.load().tpe_gather_rows(variable.handle, ids)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("dim", [1, 7, 64])
@pytest.mark.parametrize("name", sorted(IDS))
def test_kernel_equals_tf_gather(name, dim, traced, rng):
  rows = 500
  table = tf.Variable(rng.normal(size=(rows, dim)).astype(np.float32))
  ids = tf.constant(IDS[name](rng, rows), tf.int64)
  run = tf.function(_kernel) if traced else _kernel
  got = run(table, ids)
  assert got.shape == (ids.shape[0], dim)
  np.testing.assert_array_equal(got.numpy(), tf.gather(table, ids).numpy())


@pytest.mark.parametrize("bad", [-1, 500])
def test_ids_out_of_range_are_refused(bad):
  table = tf.Variable(tf.zeros([500, 4]))
  with pytest.raises(
    tf.errors.InvalidArgumentError, match=r"not in \[0, 500\)"
  ):
    _kernel(table, tf.constant([3, bad], tf.int64))


def test_rows_read_after_an_update_in_the_same_function():
  table = tf.Variable(tf.zeros([10, 2]))

  @tf.function
  def update_then_read():
    table.scatter_update(tf.IndexedSlices(tf.ones([1, 2]), [4]))
    return KERNEL_OPS.gather_rows(table, tf.constant([4], tf.int64))

  assert update_then_read().numpy().tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])
def test_gradient_with_respect_to_the_table_equals_tf_gather(traced, rng):
  table = tf.Variable(rng.normal(size=(20, 3)).astype(np.float32))
  ids = tf.constant([4, 0, 4, 19], tf.int64)
  weights = tf.constant(rng.normal(size=(4, 3)).astype(np.float32))

  def gradient(gather):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(gather(table, ids) * weights)
    return tf.convert_to_tensor(tape.gradient(loss, table))

  gather_rows = KERNEL_OPS.gather_rows
  ours = tf.function(lambda: gradient(gather_rows)) if traced else None
  got = ours() if traced else gradient(gather_rows)
  np.testing.assert_array_equal(got.numpy(), gradient(tf.gather).numpy())


def _op_types(ops, table, ids):
  graph = tf.function(ops.gather_rows).get_concrete_function(table, ids).graph
  return {op.type for op in graph.get_operations()}


def test_other_variables_and_ids_take_tf_gather():
  table = tf.Variable(tf.reshape(tf.range(12, dtype=tf.float32), [6, 2]))
  ids = tf.constant([5, 0], tf.int64)
  assert "TpeGatherRows" in _op_types(KERNEL_OPS, table, ids)
  # TensorFlow's ops (lookups for serving): TensorFlow's op only.
  assert "TpeGatherRows" not in _op_types(TENSORFLOW_OPS, table, ids)
  # int32 ids, float64 tables, mirrored variables: tf.gather, same rows.
  want = [[10.0, 11.0], [0.0, 1.0]]
  gather_rows = KERNEL_OPS.gather_rows
  assert gather_rows(table, tf.constant([5, 0])).numpy().tolist() == want
  doubles = tf.Variable(tf.cast(table, tf.float64))
  assert gather_rows(doubles, ids).numpy().tolist() == want
  strategy = mirrored_strategy(2)
  with strategy.scope():
    mirrored = tf.Variable(table.read_value())
  assert gather_rows(mirrored, ids).numpy().tolist() == want
  assert gather_rows(doubles, ids).numpy().tolist() == want


PIECES = {
  "one": [5],
  "several": [3, 7, 4],
  "with_empty": [0, 4, 0, 6],
}


def _pieces(rng, sizes, dim=5):
  return [
    tf.constant(rng.normal(size=(n, dim)).astype(np.float32)) for n in sizes
  ]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("name", sorted(PIECES))
def test_pieces_kernel_equals_gather_of_the_concat(name, traced, rng):
  pieces = _pieces(rng, PIECES[name])
  total = sum(PIECES[name])
  index = tf.constant(rng.integers(0, total, 40), tf.int32)

  def ours(pieces, index):
    return KERNEL_OPS.gather_pieces(pieces, index)

  run = tf.function(ours) if traced else ours
  want = tf.gather(tf.concat(pieces, 0), index).numpy()
  np.testing.assert_array_equal(run(pieces, index).numpy(), want)
  # TensorFlow's ops give the same rows.
  np.testing.assert_array_equal(
    TENSORFLOW_OPS.gather_pieces(pieces, index).numpy(), want
  )


@pytest.mark.parametrize("bad", [-1, 10])
def test_pieces_positions_out_of_range_are_refused(bad, rng):
  pieces = _pieces(rng, [4, 6])
  gather = kernels.load().tpe_gather_pieces
  with pytest.raises(
    tf.errors.InvalidArgumentError, match=r"index\[1\] = .* not in \[0, 10\)"
  ):
    gather(pieces, tf.constant([1, bad], tf.int32))


def test_pieces_gradient_equals_gather_of_the_concat(rng):
  pieces = [tf.Variable(p) for p in _pieces(rng, [3, 0, 4])]
  index = tf.constant([6, 0, 6, 3, 2, 2], tf.int32)
  weights = tf.constant(rng.normal(size=(6, 5)).astype(np.float32))

  def gradients(gather):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(gather(pieces, index) * weights)
    return [tf.convert_to_tensor(g) for g in tape.gradient(loss, pieces)]

  def reference(pieces, index):
    return tf.gather(tf.concat(pieces, 0), index)

  for got, want in zip(
    gradients(KERNEL_OPS.gather_pieces), gradients(reference), strict=True
  ):
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=0)
