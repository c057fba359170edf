"""The changed-row flags' kernel (``TpeMarkRows``) against TensorFlow's
scatter: the same flags, the same refusals, and no write into a buffer a
read still holds."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import kernels
from tpu_embedding.kernels.mark_rows import mark_rows_with_kernel
from tpu_embedding.kernels.mark_rows import mark_rows_with_tensorflow

pytestmark = pytest.mark.skipif(
  kernels.load() is None, reason="the kernels did not build here"
)

ROWS = 5000


def _flags(rng: np.random.Generator) -> tf.Variable:
  """Flags with some rows already set (a mark only ever adds)."""
  start = (rng.random(ROWS) < 0.1).astype(np.int8)
  return tf.Variable(start)


def _kernel(flags, rows):
  return mark_rows_with_kernel(kernels.load(), flags, rows)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("count", [0, 1, 37, 4096])
def test_the_kernel_sets_what_the_scatter_sets(traced, count):
  rng = np.random.default_rng(count)
  # Repeats, any order, both ends of the block.
  rows = np.concatenate(
    [rng.integers(0, ROWS, count), [0, ROWS - 1] if count else []]
  ).astype(np.int64)
  expected = _flags(np.random.default_rng(1))
  got = _flags(np.random.default_rng(1))
  mark_rows_with_tensorflow(expected, tf.constant(rows))

  def mark(flags, rows):
    _kernel(flags, rows)

  (tf.function(mark) if traced else mark)(got, tf.constant(rows))
  np.testing.assert_array_equal(got.numpy(), expected.numpy())
  oracle = _flags(np.random.default_rng(1)).numpy()
  oracle[rows] = 1
  np.testing.assert_array_equal(got.numpy(), oracle)


@pytest.mark.parametrize(
  "rows, match",
  [
    ([3, ROWS], rf"indices\[1\] = {ROWS} is not in \[0, {ROWS}\)"),
    ([-1, 3], r"indices\[0\] = -1 is not in"),
  ],
)
def test_a_row_outside_the_block_fails_and_changes_nothing(rows, match):
  flags = _flags(np.random.default_rng(2))
  before = flags.numpy().copy()
  with pytest.raises(tf.errors.InvalidArgumentError, match=match):
    _kernel(flags, tf.constant(rows, tf.int64))
  np.testing.assert_array_equal(flags.numpy(), before)


def test_a_held_read_is_not_written():
  flags = _flags(np.random.default_rng(3))
  held = flags.read_value()  # shares the buffer until a write
  before = held.numpy().copy()
  rows = np.flatnonzero(before == 0)[:50]
  _kernel(flags, tf.constant(rows, tf.int64))
  np.testing.assert_array_equal(held.numpy(), before)
  assert flags.numpy()[rows].tolist() == [1] * 50


def test_any_shape_of_int_rows_is_marked():
  flags = tf.Variable(tf.zeros([10], tf.int8))
  _kernel(flags, tf.constant([[7, 2], [2, 9]], tf.int32))
  assert np.flatnonzero(flags.numpy()).tolist() == [2, 7, 9]
