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
"""

from __future__ import annotations

import tensorflow as tf

from tpu_embedding.kernels import step_kernels


def unique_ids(ids: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  """``tf.unique(ids, out_idx=tf.int32)``: ``(distinct ids, int32 index)``.

  Args:
    ids: a vector of ids.
  """
  ids = tf.convert_to_tensor(ids)
  module = step_kernels()
  if module is None or ids.dtype != tf.int64:
    return tf.unique(ids, out_idx=tf.int32)
  unique, index = module.tpe_unique(ids)
  return unique, index
