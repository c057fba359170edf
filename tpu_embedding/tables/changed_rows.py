"""Which rows of a row block were written since the last save: one bit each.

A ``ChangedRows`` is a bitmap of ``ceil(rows / 32)`` int32 words on the
block's device (an eighth of a byte per row: 250 KiB for 2,000,000 rows).
Every write of the block's rows sets their bits in the same step
(``TableStore.update_block``, ``write_rows``, ``write_rows_at``; a dynamic
vocabulary's row resets through ``TableStore.mark_rows``); a delta
checkpoint (``tpu_embedding.delta_checkpoints``) reads the set bits and
clears them once its save is committed. Marking reads and writes only the
words of the given rows.

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

#: Rows per bitmap word.
WORD_BITS = 32


class ChangedRows:
  """One bit per row of a block: set when the row is written.

  Args:
    device: the block's device (the bitmap lives beside it).
    rows: the block's rows.
  """

  def __init__(self, device: str | None, rows: int):
    self.size = int(rows)
    words = -(-self.size // WORD_BITS)
    with tf.init_scope(), tf.device(device):
      self.words = compat.ResourceVariable(
        tf.zeros([words], tf.int32), trainable=False, name="changed_rows"
      )

  def mark(self, rows: tf.Tensor) -> Any:
    """Sets the bits of ``rows`` (int, local to the block; repeats and any
    order allowed). Returns the write (None when eager)."""
    rows, _ = tf.unique(tf.cast(tf.reshape(rows, [-1]), tf.int64))
    words = rows // WORD_BITS
    bits = tf.bitwise.left_shift(tf.ones_like(rows), rows % WORD_BITS)
    unique_words, index = tf.unique(words)
    # Distinct rows set distinct bits: their sum is their bitwise or.
    summed = tf.math.unsorted_segment_sum(bits, index, tf.size(unique_words))
    added = tf.bitcast(tf.cast(summed, tf.uint32), tf.int32)
    with tf.device(self.words.device):
      old = tf.raw_ops.ResourceGather(
        resource=self.words.handle, indices=unique_words, dtype=tf.int32
      )
      return tf.raw_ops.ResourceScatterUpdate(
        resource=self.words.handle,
        indices=unique_words,
        updates=tf.bitwise.bitwise_or(old, added),
      )

  def mark_all(self) -> Any:
    """Sets every row's bit (an update that changes every row)."""
    return self.words.assign(
      tf.fill(tf.shape(self.words), tf.constant(-1, tf.int32)),
      read_value=False,
    )

  def rows(self) -> tf.Tensor:
    """Sorted int64 local ids of the rows marked since ``clear()``."""
    words = self.words.read_value()
    nonzero = tf.reshape(tf.where(tf.not_equal(words, 0)), [-1])
    values = tf.gather(words, nonzero)
    shifts = tf.range(WORD_BITS, dtype=tf.int32)
    set_bits = tf.not_equal(
      tf.bitwise.bitwise_and(
        values[:, None], tf.bitwise.left_shift(tf.ones_like(shifts), shifts)
      ),
      0,
    )
    ids = nonzero[:, None] * WORD_BITS + tf.cast(shifts, tf.int64)[None, :]
    ids = tf.boolean_mask(ids, set_bits)
    return tf.boolean_mask(ids, ids < self.size)

  def clear(self) -> None:
    """Forgets every mark."""
    self.words.assign(tf.zeros_like(self.words))
