"""Splitting ids (and the rows that go with them) by owning replica.

The all-to-all exchange (``backends/exchanges.py``) calls ``split_by_owner``
on each replica for each row-sharded table: a table is cut into contiguous
row blocks, one per replica in replica order, and every id must go to the
replica whose block holds its row. In a training step
(``kernels.training_step()``) one ``TpeSplitByOwner`` kernel
(``split_by_owner.cc``) finds every id's owner and writes each owner's ids,
their positions and their rows in one pass; elsewhere, without the kernel
library or with GPUs (where it has no kernel) the same outputs come from
``searchsorted`` and ``dynamic_partition``.

Example:
  >>> import tensorflow as tf
  >>> ids = tf.constant([4, 0, 3, 1], tf.int64)
  >>> parts, where, _ = split_by_owner(ids, (0, 3), positions=True)
  >>> [p.numpy().tolist() for p in parts]
  [[0, 1], [4, 3]]
  >>> [p.numpy().tolist() for p in where]
  [[1, 3], [0, 2]]
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding.kernels import load
from tpu_embedding.kernels import step_kernels

#: ``(ids per owner, positions per owner or [], [rows per owner] per value)``
Split = tuple[list[tf.Tensor], list[tf.Tensor], list[list[tf.Tensor]]]


def split_by_owner(
  ids: tf.Tensor,
  block_starts: Sequence[int],
  values: Sequence[tf.Tensor] = (),
  positions: bool = False,
) -> Split:
  """Each owner's ids, their positions in ``ids`` and their rows.

  Args:
    ids: ``[n]`` int64 row ids of one table.
    block_starts: the first row of each replica's block, ascending (the
      placement's ``shard_offsets``; an empty block starts where the next
      one does and owns nothing).
    values: ``[n, dim]`` float32 tensors whose rows go with the ids.
    positions: also return each owner's positions in ``ids`` (int32).

  Returns:
    Per owner, in input order (as ``tf.dynamic_partition``): the ids, the
    positions (or ``[]``), and per value its rows.
  """
  if step_kernels() is not None and all(
    value.dtype == tf.float32 for value in values
  ):
    return split_with_kernel(ids, block_starts, values, positions)
  return split_with_tensorflow(ids, block_starts, values, positions)


def split_with_kernel(
  ids: tf.Tensor,
  block_starts: Sequence[int],
  values: Sequence[tf.Tensor] = (),
  positions: bool = False,
) -> Split:
  """``split_by_owner`` with the ``TpeSplitByOwner`` kernel."""
  num = len(block_starts)
  id_parts, position_parts, value_parts = load().tpe_split_by_owner(
    ids=ids,
    values=list(values),
    block_starts=[int(start) for start in block_starts],
    num_parts=num,
    num_positions=num if positions else 0,
    num_value_parts=num * len(values),
  )
  return (
    list(id_parts),
    list(position_parts),
    [list(value_parts[k * num : (k + 1) * num]) for k in range(len(values))],
  )


def split_with_tensorflow(
  ids: tf.Tensor,
  block_starts: Sequence[int],
  values: Sequence[tf.Tensor] = (),
  positions: bool = False,
) -> Split:
  """``split_by_owner`` with TensorFlow ops (the same outputs)."""
  num = len(block_starts)
  if num == 1:
    owner = tf.zeros_like(ids, dtype=tf.int32)
  else:
    boundaries = tf.constant(block_starts[1:], dtype=tf.int64)
    owner = tf.searchsorted(boundaries, ids, side="right", out_type=tf.int32)
  return (
    tf.dynamic_partition(ids, owner, num),
    tf.dynamic_partition(tf.range(tf.size(ids)), owner, num)
    if positions
    else [],
    [tf.dynamic_partition(value, owner, num) for value in values],
  )
