"""Splitting ids by owning replica.

The all-to-all exchange (``backends/exchanges.py``) calls ``split_by_owner``
on each replica for each row-sharded table: a table is cut into contiguous
row blocks, one per replica in replica order, and every id must go to the
replica whose block holds its row, as a row of that block. A lookup splits
the distinct ids (and needs where each one's row will be among the owners'
replies: ``slots``); an update splits the id occurrences ``ids[index]``
(and needs each occurrence's position, to pick its gradient row). With the
kernel ops (``kernels/ops.py``) one ``TpeSplitByOwner`` kernel
(``split_by_owner.cc``) does this in one pass (``split_with_kernel``);
with TensorFlow's ops the same outputs come from ``searchsorted`` and
``dynamic_partition`` (``split_with_tensorflow``).

Example:
  >>> import tensorflow as tf
  >>> ids = tf.constant([4, 0, 3, 1], tf.int64)
  >>> split = split_with_tensorflow(ids, (0, 3), positions=True, slots=True)
  >>> [p.numpy().tolist() for p in split.ids]  # rows of each block
  [[0, 1], [1, 0]]
  >>> [p.numpy().tolist() for p in split.positions]
  [[1, 3], [0, 2]]
  >>> split.slots.numpy().tolist()  # in [0, 1] + [4, 3]
  [2, 0, 3, 1]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import tensorflow as tf


class OwnerSplit(NamedTuple):
  """The elements (ids, or occurrences ``ids[index]``) split by owner.

  Attributes:
    ids: per owner, the ids it owns as rows of its block (id minus the
      block's first row), in element order.
    positions: per owner, the positions of those elements (int32), or
      ``[]`` when not asked for.
    slots: ``[n]`` int32, the position of each element in the
      concatenation of ``ids``; None when not asked for.
  """

  ids: list[tf.Tensor]
  positions: list[tf.Tensor]
  slots: tf.Tensor | None


def split_with_kernel(
  module: Any,
  ids: tf.Tensor,
  block_starts: Sequence[int],
  index: tf.Tensor | None = None,
  positions: bool = False,
  slots: bool = False,
) -> OwnerSplit:
  """``split_with_tensorflow`` by the ``TpeSplitByOwner`` kernel of
  ``module``, in one pass."""
  num = len(block_starts)
  id_parts, position_parts, slot_list = module.tpe_split_by_owner(
    ids=ids,
    index=[] if index is None else [tf.cast(index, tf.int32)],
    block_starts=[int(start) for start in block_starts],
    num_parts=num,
    num_positions=num if positions else 0,
    num_slots=1 if slots else 0,
  )
  return OwnerSplit(
    list(id_parts), list(position_parts), slot_list[0] if slots else None
  )


def split_with_tensorflow(
  ids: tf.Tensor,
  block_starts: Sequence[int],
  index: tf.Tensor | None = None,
  positions: bool = False,
  slots: bool = False,
) -> OwnerSplit:
  """Each owner's share of ``ids`` (or of the occurrences ``ids[index]``).

  Args:
    ids: ``[u]`` int64 row ids of one table.
    block_starts: the first row of each replica's block, ascending (the
      placement's ``shard_offsets``; an empty block starts where the next
      one does and owns nothing).
    index: None (the elements are ``ids``), or ``[n]`` int32 positions in
      ``ids``: the elements are the occurrences ``ids[index]``.
    positions: also return each owner's element positions.
    slots: also return each element's position among all owners' ids.
  """
  num = len(block_starts)
  if index is not None:
    ids = tf.gather(ids, index)
  if num == 1:
    owner = tf.zeros_like(ids, dtype=tf.int32)
  else:
    boundaries = tf.constant(block_starts[1:], dtype=tf.int64)
    owner = tf.searchsorted(boundaries, ids, side="right", out_type=tf.int32)
  id_parts = [
    part - start if start else part
    for part, start in zip(
      tf.dynamic_partition(ids, owner, num), block_starts, strict=True
    )
  ]
  elements = tf.range(tf.size(ids, out_type=tf.int32))
  position_parts = tf.dynamic_partition(elements, owner, num)
  slot_of = None
  if slots:
    starts = tf.cumsum([tf.size(p) for p in position_parts], exclusive=True)
    slot_of = tf.dynamic_stitch(
      position_parts,
      [tf.range(tf.size(p)) + starts[r] for r, p in enumerate(position_parts)],
    )
    slot_of = tf.ensure_shape(slot_of, ids.shape)
  return OwnerSplit(id_parts, position_parts if positions else [], slot_of)
