"""Deduplication with a static output shape, for steps compiled by XLA.

XLA compiles shapes known at compile time. ``tf.unique`` returns as many
ids as are distinct, a shape only the data knows; XLA pads it to a bound
and tracks the true size, which it loses again on the way to the update
(measured on TensorFlow 2.21: ids masked before ``tf.unique`` get their
gradient counted twice). ``unique_static`` returns a buffer as long as its
input instead:

* ``unique[:u]`` are the ``u`` distinct ids, ascending; ``unique[u:]`` are
  ``PADDING_ID``, a row far past every table.
* ``index[i]`` is the position of ``ids[i]`` in ``unique``.

No occurrence points at a padding slot, so nothing looked up reads one;
updates written at ``PADDING_ID`` are dropped, as XLA drops every scatter
and segment sum outside its operand (and clamps gathers), so a step
updates exactly the distinct rows, with the same numbers as
``tf.unique``'s order (each row's gradient is summed in occurrence order
either way).

Example:
  >>> import tensorflow as tf
  >>> unique, index = unique_static(tf.constant([7, 3, 7], tf.int64))
  >>> unique.numpy().tolist()[:2], index.numpy().tolist()
  ([3, 7], [1, 0, 1])
  >>> int(unique[2]) == PADDING_ID
  True
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding.kernels.unique import Ids
from tpu_embedding.kernels.unique import concatenated

#: The id of a padding slot: past every table (and still past it after a
#: stack's row offset is added or a block's first row subtracted).
PADDING_ID = 2**62


def unique_static(
  ids: Ids, offsets: Sequence[int] | None = None
) -> tuple[tf.Tensor, tf.Tensor]:
  """``(unique, index)``, both as long as the ids (module docstring).

  Args:
    ids: a vector of int64 ids, or parts whose concatenation it is.
    offsets: None, or per part a number added to its ids.
  """
  whole = tf.cast(concatenated(ids, offsets), tf.int64)
  size = tf.size(whole)
  order = tf.argsort(whole, stable=True)
  ascending = tf.gather(whole, order)
  # True at the first of each run of equal ids.
  first = tf.concat(
    [tf.ones([1], tf.bool), ascending[1:] != ascending[:-1]], 0
  )[:size]
  slot = tf.cumsum(tf.cast(first, tf.int32)) - 1
  index = tf.scatter_nd(order[:, None], slot, tf.shape(whole))
  # Each slot is written by every member of its run, with the same id.
  unique = tf.tensor_scatter_nd_update(
    tf.fill(tf.shape(whole), tf.constant(PADDING_ID, tf.int64)),
    slot[:, None],
    ascending,
  )
  return unique, index
