"""Rows of a table variable at ids (``tf.gather``, with prefetching).

The lookup gathers each table's distinct rows every step
(``tables/whole.py``) and each owner the rows other replicas ask for
(``backends/exchanges.py``): random rows of a large table, one cache miss
each. With the kernel ops (``kernels/ops.py``) ``gather_rows_with_kernel``
returns exactly ``tf.gather(variable, ids)`` from the ``TpeGatherRows``
kernel (``gather_rows.cc``), which spreads the ids over the CPU threads and
prefetches rows a few ids ahead; a variable that is not a plain float32
resource variable (e.g. a distributed or Keras 3 one) goes to
``tf.gather`` itself.

Example:
  >>> import tensorflow as tf
  >>> pieces = [tf.constant([[0.0], [1.0]]), tf.constant([[2.0]])]
  >>> gather_pieces_with_tensorflow(pieces, tf.constant([2, 0])).numpy(
  ...     ).ravel().tolist()
  [2.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.gradients import concat


def gather_rows_with_kernel(
  module: Any, variable: Any, ids: tf.Tensor, spread: bool
) -> tf.Tensor:
  """``tf.gather(variable, ids)`` for a ``[rows, dim]`` table variable.

  Args:
    module: the loaded kernel module.
    variable: the table (or slot) variable.
    ids: ``[n]`` row ids.
    spread: spread the ids over the CPU threads.
  """
  ids = tf.convert_to_tensor(ids)
  if (
    ids.dtype != tf.int64
    or ids.shape.rank != 1
    or not isinstance(variable, compat.BaseResourceVariable)
    or variable.dtype not in (tf.float32, tf.bfloat16, tf.float16)
    or variable.shape.rank != 2
  ):
    return tf.gather(variable, ids)
  compat.variable_accessed(variable)  # Differentiable, as tf.gather.
  return module.tpe_gather_rows(variable.handle, ids, spread=spread)


@tf.RegisterGradient("TpeGatherRows")
def _gather_rows_gradient(op: Any, grad: tf.Tensor) -> tuple:
  """The rows' gradient, as ``tf.gather``'s: slices of the variable."""
  shape = tf.raw_ops.VariableShape(input=op.inputs[0], out_type=tf.int64)
  return tf.IndexedSlices(grad, op.inputs[1], shape), None


def gather_pieces_with_tensorflow(
  pieces: list[tf.Tensor], index: tf.Tensor
) -> tf.Tensor:
  """``tf.gather(tf.concat(pieces, 0), index)``.

  The combiner (``lookup.combine``) reads a one-id feature's rows this
  way straight out of what a row source returned (for the all-to-all
  lookup, the replies of the rows' owners).

  Args:
    pieces: ``[rows_k, dim]`` float32 tensors.
    index: ``[n]`` positions in their concatenation.
  """
  return tf.gather(concat(pieces), index)


def gather_pieces_with_kernel(
  module: Any, pieces: list[tf.Tensor], index: tf.Tensor, spread: bool
) -> tf.Tensor:
  """``gather_pieces_with_tensorflow`` without the concat (one copy of the
  rows) by the ``TpeGatherPieces`` kernel; pieces other than float32 go to
  TensorFlow's ops."""
  if any(p.dtype != tf.float32 for p in pieces):
    return gather_pieces_with_tensorflow(pieces, index)
  return module.tpe_gather_pieces(
    pieces, tf.cast(index, tf.int32), spread=spread
  )


def slices_per_piece(
  pieces: Sequence[tf.Tensor], positions: tf.Tensor, grads: tf.Tensor
) -> list[tf.IndexedSlices]:
  """The gradient of ``tf.gather(tf.concat(pieces, 0), positions)`` into
  each piece, as ``tf.gather``'s: ``grads`` rows at the positions in that
  piece, one ``IndexedSlices`` per piece."""
  sizes = tf.stack([tf.shape(p, out_type=tf.int32)[0] for p in pieces])
  starts = tf.cumsum(sizes, exclusive=True)
  owner = tf.searchsorted(starts[1:], positions, side="right")
  parts = tf.dynamic_partition(tf.range(tf.size(positions)), owner, len(pieces))
  return [
    tf.IndexedSlices(
      tf.gather(grads, at),
      tf.gather(positions, at) - starts[k],
      tf.shape(piece, out_type=tf.int32),
    )
    for k, (piece, at) in enumerate(zip(pieces, parts, strict=True))
  ]


@tf.RegisterGradient("TpeGatherPieces")
def _gather_pieces_gradient(op: Any, grad: tf.Tensor) -> list:
  """Per piece, as ``tf.gather``'s: slices at the positions in that piece."""
  num = op.get_attr("num_pieces")
  pieces, index = op.inputs[:num], op.inputs[num]
  return [*slices_per_piece(pieces, index, grad), None]
