"""Rows of a table variable at ids (``tf.gather``, with prefetching).

The lookup gathers each table's distinct rows every step
(``tables/whole.py``) and each owner the rows other replicas ask for
(``backends/exchanges.py``): random rows of a large table, one cache miss
each. ``gather_rows`` returns exactly ``tf.gather(variable, ids)``: in a
training step (``kernels.training_step()``) from the ``TpeGatherRows``
kernel (``gather_rows.cc``), which spreads the ids over the CPU threads and
prefetches rows a few ids ahead; from ``tf.gather`` itself elsewhere
(lookups for serving, parameter servers' steps) and where the kernel does
not apply (``kernels.step_kernels()`` is None, or a variable that is not a
plain float32 resource variable, e.g. a distributed or Keras 3 one).

Example:
  >>> import tensorflow as tf
  >>> table = tf.Variable([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])
  >>> gather_rows(table, tf.constant([2, 0], tf.int64)).numpy().tolist()
  [[4.0, 5.0], [0.0, 1.0]]
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.gradients import concat_pieces
from tpu_embedding.kernels import spread_rows
from tpu_embedding.kernels import step_kernels


def gather_rows(variable: Any, ids: tf.Tensor) -> tf.Tensor:
  """``tf.gather(variable, ids)`` for a ``[rows, dim]`` table variable.

  Args:
    variable: the table (or slot) variable.
    ids: ``[n]`` row ids.
  """
  ids = tf.convert_to_tensor(ids)
  module = step_kernels()
  if (
    module is None
    or ids.dtype != tf.int64
    or ids.shape.rank != 1
    or not isinstance(variable, compat.BaseResourceVariable)
    or variable.dtype != tf.float32
    or variable.shape.rank != 2
  ):
    return tf.gather(variable, ids)
  compat.variable_accessed(variable)  # Differentiable, as tf.gather.
  return module.tpe_gather_rows(variable.handle, ids, spread=spread_rows())


@tf.RegisterGradient("TpeGatherRows")
def _gather_rows_gradient(op: Any, grad: tf.Tensor) -> tuple:
  """The rows' gradient, as ``tf.gather``'s: slices of the variable."""
  shape = tf.raw_ops.VariableShape(input=op.inputs[0], out_type=tf.int64)
  return tf.IndexedSlices(grad, op.inputs[1], shape), None


def gather_pieces(
  pieces: list[tf.Tensor],
  index: tf.Tensor,
  through: tf.Tensor | None = None,
) -> tf.Tensor:
  """``tf.gather(tf.concat(pieces, 0), index)``, without the concat.

  The all-to-all lookup (``backends/exchanges.py``) expands the rows its
  owners sent back straight into each id occurrence's row: one copy of the
  rows instead of a concat (or stitch) and a gather.

  Args:
    pieces: ``[rows_k, dim]`` float32 tensors.
    index: ``[n]`` positions in their concatenation, or with ``through``
      positions in ``through``.
    through: None, or ``[m]`` positions in the pieces' concatenation: row
      ``i`` is then row ``through[index[i]]`` (one pass, no int gather).
  """
  module = step_kernels()
  if module is None or any(p.dtype != tf.float32 for p in pieces):
    if through is not None:
      index = tf.gather(through, index)
    return tf.gather(concat_pieces(pieces), index)
  extra = [] if through is None else [tf.cast(through, tf.int32)]
  return module.tpe_gather_pieces(
    pieces, tf.cast(index, tf.int32), extra, spread=spread_rows()
  )


@tf.RegisterGradient("TpeGatherPieces")
def _gather_pieces_gradient(op: Any, grad: tf.Tensor) -> list:
  """Per piece, as ``tf.gather``'s: slices at the positions in that piece."""
  num = op.get_attr("num_pieces")
  pieces, index, through = op.inputs[:num], op.inputs[num], op.inputs[num + 1 :]
  if through:
    index = tf.gather(through[0], index)
  sizes = tf.stack([tf.shape(p, out_type=tf.int32)[0] for p in pieces])
  starts = tf.cumsum(sizes, exclusive=True)
  owner = tf.searchsorted(starts[1:], index, side="right")
  parts = tf.dynamic_partition(tf.range(tf.size(index)), owner, len(pieces))
  grads = [
    tf.IndexedSlices(
      tf.gather(grad, at),
      tf.gather(index, at) - starts[k],
      tf.shape(piece, out_type=tf.int32),
    )
    for k, (piece, at) in enumerate(zip(pieces, parts, strict=True))
  ]
  return [*grads, None] + [None] * len(through)
