"""Splitting ids by owner: the kernel equals the TensorFlow path.

``kernels/split_by_owner.py`` routes every row-sharded table's ids (and
the gradients that go with them) in the all-to-all exchange. The kernel's
outputs must be exactly ``dynamic_partition``'s (ids, positions, rows, in
input order) for any cut of the rows, empty blocks included.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import kernels
from tpu_embedding.kernels.split_by_owner import split_by_owner
from tpu_embedding.kernels.split_by_owner import split_with_kernel
from tpu_embedding.kernels.split_by_owner import split_with_tensorflow

pytestmark = pytest.mark.skipif(
  kernels.load() is None, reason="the kernel library did not build"
)

CUTS = {
  "one block": (0,),
  "two blocks": (0, 50),
  "an empty block inside": (0, 30, 30, 80),
  "an empty first block": (0, 0, 40),
  "an empty last block": (0, 60, 100),
}


@pytest.mark.parametrize("cut", sorted(CUTS))
@pytest.mark.parametrize("size", [0, 1, 300])
@pytest.mark.parametrize("dims", [(), (8,), (3, 5)], ids=["ids", "one", "two"])
def test_kernel_equals_dynamic_partition(cut, size, dims, rng):
  starts = CUTS[cut]
  ids = tf.constant(rng.integers(0, 100, size), tf.int64)
  values = [
    tf.constant(rng.normal(size=(size, d)).astype(np.float32)) for d in dims
  ]
  got = split_with_kernel(ids, starts, values, positions=True)
  want = split_with_tensorflow(ids, starts, values, positions=True)
  for got_part, want_part in zip(
    got[0] + got[1], want[0] + want[1], strict=True
  ):
    assert got_part.dtype == want_part.dtype
    np.testing.assert_array_equal(got_part.numpy(), want_part.numpy())
  for got_rows, want_rows in zip(got[2], want[2], strict=True):
    assert len(got_rows) == len(starts)
    for g, w in zip(got_rows, want_rows, strict=True):
      assert g.shape == w.shape
      np.testing.assert_array_equal(g.numpy(), w.numpy())
  # Every id lands with its owner.
  for owner, part in enumerate(got[0]):
    end = starts[owner + 1] if owner + 1 < len(starts) else 100
    assert ((part.numpy() >= starts[owner]) & (part.numpy() < end)).all()


def test_traced_without_positions(rng):
  ids = tf.constant(rng.integers(0, 100, 64), tf.int64)
  grads = tf.constant(rng.normal(size=(64, 4)).astype(np.float32))

  @tf.function
  def split(ids, grads):
    parts, positions, (rows,) = split_by_owner(ids, (0, 50), [grads])
    assert positions == []
    return parts, rows

  parts, rows = split(ids, grads)
  owner = (ids.numpy() >= 50).astype(int)
  for r in range(2):
    np.testing.assert_array_equal(parts[r], ids.numpy()[owner == r])
    np.testing.assert_array_equal(rows[r], grads.numpy()[owner == r])


@pytest.mark.parametrize(
  "ids, values, match",
  [
    (tf.zeros([2, 2], tf.int64), [], "ids must be a vector"),
    (tf.zeros([3], tf.int64), [tf.zeros([2, 4])], r"values\[0\] must be \[3"),
  ],
)
def test_bad_inputs_fail_clearly(ids, values, match):
  with pytest.raises(tf.errors.InvalidArgumentError, match=match):
    split_with_kernel(ids, (0, 1), values)
