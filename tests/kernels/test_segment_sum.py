"""The combiner's segment sum: the ``TpeSegmentSum`` kernel equals TF's ops.

``lookup.combine`` sums the (scaled) rows of each output row's ids through
``kernels/segment_sum.py``, each id's row picked out of the distinct rows
(``PickedRows``: never expanded into one row per id); the kernel ops'
(``kernels/ops.py``) must return exactly
``tf.math.unsorted_segment_sum(tf.gather(rows, positions) * scales[:, None],
segments, num)`` (bit for bit: each product rounded, then added in id
order from zero), refuse segments and positions out of range, and have
that expression's gradient (into the distinct rows and the scales).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import kernels
from tpu_embedding.gradients import PickedRows
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import KernelOps

pytestmark = pytest.mark.skipif(
  kernels.load() is None, reason="the kernel library did not build"
)

KERNEL_OPS = KernelOps(kernels.load())

SEGMENTS = {
  "ragged rows": lambda rng, n, num: np.sort(rng.integers(0, num, n)),
  "unsorted": lambda rng, n, num: rng.integers(0, num, n),
  "empty rows": lambda rng, n, num: np.sort(rng.integers(0, num // 3, n)),
  "no ids": lambda rng, n, num: np.zeros([0], np.int64),
}


def _reference(rows, positions, segments, scales, num):
  rows = tf.gather(tf.concat(rows, 0), positions)
  if scales is not None:
    rows = rows * scales[:, None]
  return tf.math.unsorted_segment_sum(rows, segments, num)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("scaled", [False, True], ids=["sum", "scaled"])
@pytest.mark.parametrize("pieces", [1, 3], ids=["one_piece", "three_pieces"])
@pytest.mark.parametrize("name", sorted(SEGMENTS))
def test_kernel_equals_tensorflow_bit_for_bit(
  name, pieces, scaled, traced, rng
):
  num = 37
  segments = tf.constant(SEGMENTS[name](rng, 400, num), tf.int64)
  n = int(segments.shape[0])
  distinct = rng.normal(size=(60, 16)).astype(np.float32)
  rows = [tf.constant(part) for part in np.array_split(distinct, pieces)]
  positions = tf.constant(rng.integers(0, 60, n).astype(np.int32))
  scales = None
  if scaled:
    scales = tf.constant(rng.uniform(0.1, 3.0, n).astype(np.float32))

  def ours(rows, segments):
    return KERNEL_OPS.segment_sum(
      PickedRows.at(rows, positions, scales),
      segments,
      tf.constant(num, tf.int64),
    )

  run = tf.function(ours) if traced else ours
  got = run(rows, segments).numpy()
  want = _reference(rows, positions, segments, scales, num).numpy()
  assert got.shape == (num, 16)
  np.testing.assert_array_equal(got, want)
  # And a plain numpy reading of the sum (independent of TensorFlow).
  expected = np.zeros((num, 16), np.float32)
  for i, s in enumerate(segments.numpy()):
    weight = np.float32(1.0) if scales is None else scales.numpy()[i]
    expected[s] += distinct[positions.numpy()[i]] * weight
  np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_rows_in_order_without_positions(rng):
  rows = tf.constant(rng.normal(size=(5, 4)).astype(np.float32))
  segments = tf.constant([1, 0, 1, 2, 0], tf.int64)
  got = KERNEL_OPS.segment_sum(
    PickedRows.dense(rows), segments, tf.constant(3, tf.int64)
  )
  want = tf.math.unsorted_segment_sum(rows, segments, 3)
  np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize("bad", [-1, 5])
def test_segments_out_of_range_are_refused(bad):
  with pytest.raises(
    tf.errors.InvalidArgumentError, match=r"segments\[1\] = .* \[0, 5\)"
  ):
    kernels.load().tpe_segment_sum(
      [tf.zeros([2, 3])],
      [],
      tf.constant([0, bad], tf.int64),
      [],
      tf.constant(5, tf.int64),
    )


@pytest.mark.parametrize("bad", [-1, 4])
def test_positions_out_of_range_are_refused(bad):
  with pytest.raises(
    tf.errors.InvalidArgumentError, match=r"positions\[1\] = .* \[0, 4\)"
  ):
    kernels.load().tpe_segment_sum(
      [tf.zeros([4, 3])],
      [tf.constant([0, bad], tf.int32)],
      tf.constant([0, 1], tf.int64),
      [],
      tf.constant(5, tf.int64),
    )


@pytest.mark.parametrize("pieces", [1, 2], ids=["one_piece", "two_pieces"])
@pytest.mark.parametrize("scaled", [False, True], ids=["sum", "scaled"])
def test_gradient_equals_tensorflow(scaled, pieces, rng):
  parts = [
    tf.Variable(rng.normal(size=(k, 3)).astype(np.float32))
    for k in ([4] if pieces == 1 else [3, 2])
  ]
  positions = tf.constant([3, 0, 1, 3, 2, 1], tf.int32)
  segments = tf.constant([0, 2, 2, 1, 0, 2], tf.int64)
  scales = tf.Variable(rng.uniform(0.5, 2.0, 6).astype(np.float32))
  weights = tf.constant(rng.normal(size=(3, 3)).astype(np.float32))
  num = tf.constant(3, tf.int64)
  given = scales if scaled else None

  def ours():
    return KERNEL_OPS.segment_sum(
      PickedRows.at(list(parts), positions, given), segments, num
    )

  def gradients(function):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(function() * weights)
    return tape.gradient(loss, [*parts, scales])

  got = gradients(ours)
  want = gradients(lambda: _reference(parts, positions, segments, given, num))
  for g, w in zip(got, want, strict=True):
    if w is None:
      assert g is None
    else:
      np.testing.assert_allclose(
        tf.convert_to_tensor(g).numpy(),
        tf.convert_to_tensor(w).numpy(),
        rtol=1e-6,
      )


@pytest.mark.parametrize(
  "ops", [KERNEL_OPS, TENSORFLOW_OPS], ids=["kernel", "tensorflow"]
)
def test_each_ops_object_uses_its_own_ops(ops):
  rows, segments = tf.ones([3, 2]), tf.constant([0, 1, 1], tf.int64)
  graph = (
    tf.function(
      lambda r, s: ops.segment_sum(
        PickedRows.dense(r), s, tf.constant(2, tf.int64)
      )
    )
    .get_concrete_function(rows, segments)
    .graph
  )
  types = {op.type for op in graph.get_operations()}
  assert ("TpeSegmentSum" in types) == ops.kernels
  assert ("UnsortedSegmentSum" in types) != ops.kernels
