"""Splitting ids by owner: the kernel equals the TensorFlow path.

``kernels/split_by_owner.py`` routes every row-sharded table's ids (a
lookup's distinct ids, an update's occurrences ``ids[index]``) in the
all-to-all exchange. The kernel's outputs must be exactly the TensorFlow
path's (``dynamic_partition``: each owner's rows, positions, and each
element's slot among them, in element order) for any cut of the rows,
empty blocks included, and agree with a plain numpy reading.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tpu_embedding import kernels
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import KernelOps

pytestmark = pytest.mark.skipif(
  kernels.load() is None, reason="the kernel library did not build"
)

KERNEL_OPS = KernelOps(kernels.load())

CUTS = {
  "one block": (0,),
  "two blocks": (0, 50),
  "an empty block inside": (0, 30, 30, 80),
  "an empty first block": (0, 0, 40),
  "an empty last block": (0, 60, 100),
}


def _split_outputs(split):
  return (
    split.ids + split.positions + ([] if split.slots is None else [split.slots])
  )


@pytest.mark.parametrize("cut", sorted(CUTS))
@pytest.mark.parametrize("size", [0, 1, 300])
@pytest.mark.parametrize("occurrences", [False, True], ids=["ids", "index"])
def test_kernel_equals_dynamic_partition(cut, size, occurrences, rng):
  starts = CUTS[cut]
  ids = tf.constant(rng.integers(0, 100, size), tf.int64)
  index = None
  if occurrences:
    index = tf.constant(rng.integers(0, max(size, 1), 2 * size), tf.int32)
  got = KERNEL_OPS.split_by_owner(
    ids, starts, index, positions=True, slots=True
  )
  want = TENSORFLOW_OPS.split_by_owner(
    ids, starts, index, positions=True, slots=True
  )
  for got_part, want_part in zip(
    _split_outputs(got), _split_outputs(want), strict=True
  ):
    assert got_part.dtype == want_part.dtype
    np.testing.assert_array_equal(got_part.numpy(), want_part.numpy())
  # An independent check: every element lands with its owner, as a row of
  # its block, in element order; its slot points at it.
  elements = ids.numpy() if index is None else ids.numpy()[index.numpy()]
  ends = list(starts[1:]) + [100]
  owners = [
    max(r for r in range(len(starts)) if starts[r] <= e) for e in elements
  ]
  concat = np.concatenate([p.numpy() for p in got.ids] + [np.zeros([0])])
  for owner, (part, where) in enumerate(
    zip(got.ids, got.positions, strict=True)
  ):
    mine = [e for e, o in enumerate(owners) if o == owner]
    np.testing.assert_array_equal(where.numpy(), mine)
    np.testing.assert_array_equal(part.numpy(), elements[mine] - starts[owner])
    assert (part.numpy() < ends[owner] - starts[owner]).all()
  for e, slot in enumerate(got.slots.numpy()):
    assert concat[slot] == elements[e] - starts[owners[e]]


@pytest.mark.parametrize(
  "ops", [KERNEL_OPS, TENSORFLOW_OPS], ids=["kernel", "tensorflow"]
)
def test_traced_without_positions_or_slots(ops, rng):
  ids = tf.constant(rng.integers(0, 100, 64), tf.int64)

  @tf.function
  def split(ids):
    split = ops.split_by_owner(ids, (0, 50))
    assert split.positions == [] and split.slots is None
    return split.ids

  parts = split(ids)
  owner = (ids.numpy() >= 50).astype(int)
  for r in range(2):
    np.testing.assert_array_equal(parts[r], ids.numpy()[owner == r] - 50 * r)


@pytest.mark.parametrize(
  "ids, index, match",
  [
    (tf.zeros([2, 2], tf.int64), None, "ids must be a vector"),
    (tf.zeros([3], tf.int64), tf.constant([0, 3]), r"index\[1\] = 3 is not"),
    (tf.zeros([3], tf.int64), tf.constant([-1]), r"index\[0\] = -1 is not"),
  ],
)
def test_bad_inputs_fail_clearly(ids, index, match):
  with pytest.raises(tf.errors.InvalidArgumentError, match=match):
    KERNEL_OPS.split_by_owner(ids, (0, 1), index)
