"""Which rows of a row block were written since the last save: a byte each.

A ``ChangedRows`` is a ``[rows]`` int8 flag per row on the block's device
(2 MB for 2,000,000 rows, next to the 64 bytes or more of each row it
flags). Every write of the block's rows sets their flags in the same step
(``TableStore.update_block``, ``write_rows``, ``write_rows_at``; a dynamic
vocabulary's row resets through ``TableStore.mark_rows``): one write of
ones at the written rows by the step's ops (``kernels/mark_rows.py``: a
kernel on this process's CPU, else TensorFlow's scatter), no
deduplication, so repeats, any order and rows past the block (which XLA's
scatter drops: ``kernels/static_unique.py``) all mark exactly the rows
written. A delta checkpoint
(``tpu_embedding.checkpointing.deltas``) reads the set flags and clears them
once its save is committed.

Example:
  >>> import tensorflow as tf
  >>> changes = ChangedRows("/cpu:0", 100)
  >>> _ = changes.mark(tf.constant([70, 3, 3, 64], tf.int64))
  >>> changes.rows().numpy().tolist()
  [3, 64, 70]
  >>> changes.clear()
  >>> changes.rows().numpy().tolist()
  []
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import StepOps


class ChangedRows:
  """One flag per row of a block: set when the row is written.

  Args:
    device: the block's device (the flags live beside it).
    rows: the block's rows.
  """

  def __init__(self, device: str | None, rows: int):
    self.size = int(rows)
    with tf.init_scope(), tf.device(device):
      self.flags = compat.ResourceVariable(
        tf.zeros([self.size], tf.int8), trainable=False, name="changed_rows"
      )

  def mark(self, rows: tf.Tensor, ops: StepOps = TENSORFLOW_OPS) -> Any:
    """Sets the flags of ``rows`` (int, local to the block; repeats and any
    order allowed) with ``ops`` (the step's row ops, ``kernels/ops.py``).
    Returns the write (None when eager)."""
    with tf.device(self.flags.device):
      return ops.mark_rows(self.flags, rows)

  def mark_all(self) -> Any:
    """Sets every row's flag (an update that changes every row)."""
    return self.flags.assign(
      tf.ones(tf.shape(self.flags), tf.int8), read_value=False
    )

  def rows(self) -> tf.Tensor:
    """Sorted int64 local ids of the rows marked since ``clear()``."""
    flags = self.flags.read_value()
    return tf.reshape(tf.where(tf.not_equal(flags, 0)), [-1])

  def clear(self) -> None:
    """Forgets every mark."""
    self.flags.assign(tf.zeros_like(self.flags))
