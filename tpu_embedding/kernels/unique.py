"""Distinct ids and each id's position among them (``tf.unique``, faster).

Every step deduplicates the ids of each table (``lookup.group_table``) and,
on sharded tables, each owner the ids it receives (``backends/
exchanges.py``), through the step's ops (``kernels/ops.py``).
``unique_with_kernel`` returns exactly what
``unique_with_tensorflow`` (``tf.unique(ids, out_idx=tf.int32)``) returns:
distinct ids in order of first occurrence, and each id's position among
them, from the ``TpeUnique`` kernel (``unique.cc``: an open-addressing
table sized for the input, a few nanoseconds per id); ids other than
int64 go to ``tf.unique``.

Example:
  >>> import tensorflow as tf
  >>> ids = tf.constant([7, 3, 7, 9, 3], tf.int64)
  >>> unique, index = unique_with_tensorflow(ids)
  >>> unique.numpy().tolist(), index.numpy().tolist()
  ([7, 3, 9], [0, 1, 0, 2, 1])
  >>> parts = [tf.constant([1, 2], tf.int64), tf.constant([0, 1], tf.int64)]
  >>> unique, index = unique_with_tensorflow(parts, offsets=[0, 1])
  >>> unique.numpy().tolist(), index.numpy().tolist()  # [1, 2] + [1, 2]
  ([1, 2], [0, 1, 0, 1])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import TypeAlias

import tensorflow as tf

#: Ids to deduplicate: a vector, or parts whose concatenation it is.
Ids: TypeAlias = "tf.Tensor | Sequence[tf.Tensor]"


def _parts(ids: Ids) -> list[tf.Tensor]:
  return [
    tf.convert_to_tensor(p)
    for p in (ids if isinstance(ids, (list, tuple)) else [ids])
  ]


def concatenated(ids: Ids, offsets: Sequence[int] | None = None) -> tf.Tensor:
  """The ids as one vector, each part's offset added."""
  parts = _parts(ids)
  if offsets is not None:
    parts = [p + o if o else p for p, o in zip(parts, offsets, strict=True)]
  return parts[0] if len(parts) == 1 else tf.concat(parts, 0)


def unique_with_tensorflow(
  ids: Ids, offsets: Sequence[int] | None = None
) -> tuple[tf.Tensor, tf.Tensor]:
  """``tf.unique(ids, out_idx=tf.int32)``: ``(distinct ids, int32 index)``.

  Args:
    ids: a vector of ids, or parts whose concatenation it is.
    offsets: None, or per part a number added to its ids (a stack's row
      offset of each member table).
  """
  return tf.unique(concatenated(ids, offsets), out_idx=tf.int32)


def unique_with_kernel(
  module: Any, ids: Ids, offsets: Sequence[int] | None = None
) -> tuple[tf.Tensor, tf.Tensor]:
  """``unique_with_tensorflow`` by the ``TpeUnique`` kernel of ``module``
  (parts read in place, never concatenated); not int64: TensorFlow's."""
  parts = _parts(ids)
  if any(p.dtype != tf.int64 for p in parts):
    return unique_with_tensorflow(parts, offsets)
  unique, index = module.tpe_unique(
    parts, offsets=[] if offsets is None else [int(o) for o in offsets]
  )
  return unique, index
