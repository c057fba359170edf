"""Deduplicating ids: the ``TpeUnique`` kernel equals ``tf.unique``.

Every step deduplicates each table's ids and, on sharded tables, each
owner the ids it receives (``kernels/unique.py``, through the step's
ops: ``kernels/ops.py``). The kernel must return
exactly ``tf.unique(ids, out_idx=tf.int32)``: distinct ids in order of
first occurrence and each id's position among them, for any ids (empty,
all equal, negative, at the ends of int64, colliding in its hash table).
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

INT64 = np.iinfo(np.int64)

IDS = {
  "empty": lambda rng: np.zeros([0], np.int64),
  "one": lambda rng: np.array([5], np.int64),
  "all equal": lambda rng: np.full(1000, 42, np.int64),
  "distinct": lambda rng: rng.permutation(5000).astype(np.int64),
  "few values": lambda rng: rng.integers(0, 7, 3000),
  "zipf": lambda rng: (rng.zipf(1.1, 20000) % 100_000).astype(np.int64),
  "wide range": lambda rng: rng.integers(0, 10**12, 4000),
  "negative and extremes": lambda rng: np.array(
    [-1, INT64.max, 0, INT64.min, -1, INT64.max, 3, INT64.min, 0],
    np.int64,
  ),
  # Multiples of a power of two: the same low bits, one probe chain.
  "strided": lambda rng: np.tile(np.arange(0, 1 << 30, 1 << 20), 3),
}


def _kernel(ids):
  return kernels.load().tpe_unique([ids])


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("name", sorted(IDS))
def test_kernel_equals_tf_unique(name, traced, rng):
  ids = tf.constant(IDS[name](rng), tf.int64)
  run = tf.function(_kernel) if traced else _kernel
  unique, index = run(ids)
  want_unique, want_index = tf.unique(ids, out_idx=tf.int32)
  assert unique.dtype == tf.int64 and index.dtype == tf.int32
  np.testing.assert_array_equal(unique.numpy(), want_unique.numpy())
  np.testing.assert_array_equal(index.numpy(), want_index.numpy())


@pytest.mark.parametrize(
  "ops", [KERNEL_OPS, TENSORFLOW_OPS], ids=["kernel", "tensorflow"]
)
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "function"])
def test_parts_with_offsets_equal_tf_unique_of_their_concatenation(
  traced, ops, rng
):
  sizes, offsets = [50, 0, 300, 7], [0, 1000, 40, 3]
  parts = [tf.constant(rng.integers(0, 60, n), tf.int64) for n in sizes]

  def ours(parts):
    return ops.unique(parts, offsets)

  run = tf.function(ours) if traced else ours
  unique, index = run(parts)
  whole = np.concatenate(
    [p.numpy() + o for p, o in zip(parts, offsets, strict=True)]
  )
  want_unique, want_index = tf.unique(tf.constant(whole), out_idx=tf.int32)
  np.testing.assert_array_equal(unique.numpy(), want_unique.numpy())
  np.testing.assert_array_equal(index.numpy(), want_index.numpy())


def _op_types(function, *args):
  graph = tf.function(function).get_concrete_function(*args).graph
  return {op.type for op in graph.get_operations()}


def test_kernel_ops_use_the_kernel_and_tensorflow_ops_never():
  ids64 = tf.constant([3, 1, 3], tf.int64)
  assert "TpeUnique" in _op_types(KERNEL_OPS.unique, ids64)
  # TensorFlow's ops (lookups for serving): TensorFlow's op only.
  assert "TpeUnique" not in _op_types(TENSORFLOW_OPS.unique, ids64)
  assert "Unique" in _op_types(TENSORFLOW_OPS.unique, ids64)


def test_kernel_ops_take_tf_unique_for_other_dtypes():
  ids32 = tf.constant([3, 1, 3], tf.int32)
  unique, index = KERNEL_OPS.unique(ids32)
  assert unique.numpy().tolist() == [3, 1]
  assert index.numpy().tolist() == [0, 1, 0]


def test_rank_is_checked():
  with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="1"):
    _kernel(tf.constant([[1, 2]], tf.int64))
