"""Distinct ids and each id's position among them (``tf.unique``, faster).

Every step deduplicates the ids of each table (``lookup.group_table``) and,
on sharded tables, each owner the ids it receives (``backends/
exchanges.py``). ``unique_ids`` returns exactly what
``tf.unique(ids, out_idx=tf.int32)`` returns (distinct ids in order of
first occurrence, and each id's position among them): in a training step
(``kernels.training_step()``) from the ``TpeUnique`` kernel (``unique.cc``:
an open-addressing table sized for the input, a few nanoseconds per id),
elsewhere (lookups for serving), without the kernel library, with GPUs
(where it has no kernel) or for ids other than int64 from ``tf.unique``.

Example:
  >>> import tensorflow as tf
  >>> unique, index = unique_ids(tf.constant([7, 3, 7, 9, 3], tf.int64))
  >>> unique.numpy().tolist(), index.numpy().tolist()
  ([7, 3, 9], [0, 1, 0, 2, 1])
  >>> parts = [tf.constant([1, 2], tf.int64), tf.constant([0, 1], tf.int64)]
  >>> unique, index = unique_ids(parts, offsets=[0, 1])  # [1, 2] + [1, 2]
  >>> unique.numpy().tolist(), index.numpy().tolist()
  ([1, 2], [0, 1, 0, 1])
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding.kernels import step_kernels


def unique_ids(
  ids: tf.Tensor | Sequence[tf.Tensor], offsets: Sequence[int] | None = None
) -> tuple[tf.Tensor, tf.Tensor]:
  """``tf.unique(ids, out_idx=tf.int32)``: ``(distinct ids, int32 index)``.

  Args:
    ids: a vector of ids, or parts whose concatenation it is (read in
      place by the kernel, never concatenated).
    offsets: None, or per part a number added to its ids (a stack's row
      offset of each member table).
  """
  parts = [
    tf.convert_to_tensor(p)
    for p in (ids if isinstance(ids, (list, tuple)) else [ids])
  ]
  module = step_kernels()
  if module is None or any(p.dtype != tf.int64 for p in parts):
    if offsets is not None:
      parts = [p + o if o else p for p, o in zip(parts, offsets, strict=True)]
    whole = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
    return tf.unique(whole, out_idx=tf.int32)
  unique, index = module.tpe_unique(
    parts, offsets=[] if offsets is None else [int(o) for o in offsets]
  )
  return unique, index
