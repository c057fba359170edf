"""Initial values of one row block of a table or slot.

A block of rows ``[first, first + rows)`` gets the values the whole table
would have there. Independent (i.i.d.) initializers without a seed and
``RowIdInitializer`` produce each block on its own; any other initializer
produces the whole table once per table (cached in ``cache``) and each
block takes its slice.

Example:
  >>> import tensorflow as tf
  >>> from tpu_embedding.initializers import RowIdInitializer
  >>> block_initial_value(RowIdInitializer(), 2, 2, (5, 1), tf.float32,
  ...                     {}).numpy().ravel().tolist()
  [2.0, 3.0]
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding.initializers import RowIdInitializer
from tpu_embedding.initializers import TruncatedNormal


def block_initial_value(
  initializer: Any,
  first: int,
  rows: int,
  full_shape: tuple[int, int],
  dtype: Any,
  cache: dict,
) -> Any:
  """The initial value of rows ``[first, first + rows)`` of a table.

  Args:
    initializer: the table's (or slot's) initializer.
    first: the block's first row.
    rows: the block's number of rows.
    full_shape: ``(vocabulary_size, dim)``.
    dtype: the value's dtype.
    cache: a dict shared by the blocks of one variable.
  """
  shape = (rows, full_shape[1])
  if isinstance(initializer, TruncatedNormal) and initializer.seed is None:
    return initializer(shape, dtype)  # i.i.d.: each block on its own.
  if isinstance(initializer, RowIdInitializer):
    return RowIdInitializer(initializer.offset + first)(shape, dtype)
  if "full" not in cache:
    cache["full"] = tf.convert_to_tensor(initializer(full_shape, dtype=dtype))
  return cache["full"][first : first + rows]
