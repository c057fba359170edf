"""The combiner's sum of id rows into output rows (a faster segment sum).

Every lookup of a feature with several ids per output row (ragged or
sparse input, sequences aside) sums its ids' rows, each scaled by its
weight over the combiner's denominator (``lookup.combine``). The rows come
as ``gradients.PickedRows``: each id's row picked out of the distinct rows
a row source read, times its scale. ``segment_sum_with_kernel`` (the kernel
ops' sum, ``kernels/ops.py``) returns exactly what
``segment_sum_with_tensorflow`` returns,
``tf.math.unsorted_segment_sum(rows * scales[:, None], segments, num)``
for ``rows`` the picked rows, from the ``TpeSegmentSum`` kernel
(``segment_sum.cc``: each id's row read where it is, never copied into an
``[ids, dim]`` tensor; output rows spread over the CPU threads, each
summing its ids in order).

Example:
  >>> import tensorflow as tf
  >>> from tpu_embedding.gradients import PickedRows
  >>> distinct = tf.constant([[1.0], [2.0], [4.0]])
  >>> picked = PickedRows.at([distinct], tf.constant([0, 1, 2, 2]))
  >>> segment_sum_with_tensorflow(
  ...     picked, tf.constant([1, 0, 1, 1], tf.int64),
  ...     tf.constant(2, tf.int64)).numpy().ravel().tolist()
  [2.0, 9.0]
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding.gradients import PickedRows
from tpu_embedding.gradients import concat_pieces
from tpu_embedding.kernels.gather_rows import slices_per_piece


def segment_sum_with_tensorflow(
  rows: PickedRows,
  segments: tf.Tensor,
  num_segments: tf.Tensor,
) -> tf.Tensor:
  """``[num_segments, dim]`` sums of the picked rows by output row.

  Args:
    rows: the ``[n, dim]`` scaled rows of the ids (ungrouped positions):
      ``scales[i] * concat(pieces)[positions[i]]``.
    segments: ``[n]`` int64 output row of each id, in ``[0, num_segments)``.
    num_segments: int64 scalar, the number of output rows.
  """
  return tf.math.unsorted_segment_sum(
    concat_pieces(rows), segments, num_segments
  )


def segment_sum_with_kernel(
  module: Any,
  rows: PickedRows,
  segments: tf.Tensor,
  num_segments: tf.Tensor,
  spread: bool,
) -> tf.Tensor:
  """``segment_sum_with_tensorflow`` by the ``TpeSegmentSum`` kernel of
  ``module``; rows other than float32 matrices go to TensorFlow's ops."""
  if any(p.dtype != tf.float32 or p.shape.rank != 2 for p in rows.pieces):
    return segment_sum_with_tensorflow(rows, segments, num_segments)
  return module.tpe_segment_sum(
    rows.pieces,
    [tf.cast(p, tf.int32) for p in rows.positions],
    tf.cast(segments, tf.int64),
    list(rows.scales),
    tf.cast(num_segments, tf.int64),
    spread=spread,
  )


@tf.RegisterGradient("TpeSegmentSum")
def _segment_sum_gradient(op, grad: tf.Tensor) -> list:
  """As the TensorFlow ops': each id's output row's gradient, scaled, into
  its row (per piece, as ``tf.gather``'s gradient), and each scale's."""
  num_pieces = op.get_attr("num_pieces")
  num_positions = op.get_attr("num_positions")
  pieces = list(op.inputs[:num_pieces])
  positions = op.inputs[num_pieces] if num_positions else None
  segments = op.inputs[num_pieces + num_positions]
  scales = op.inputs[num_pieces + num_positions + 1 :][:-1]
  per_id = tf.gather(grad, segments)
  scaled = per_id * scales[0][:, None] if scales else per_id
  if positions is None and num_pieces == 1:
    piece_grads: list = [scaled]
  else:
    if positions is None:
      positions = tf.range(sum(tf.shape(p)[0] for p in pieces))
    piece_grads = slices_per_piece(pieces, positions, scaled)
  scale_grads = []
  if scales:
    rows = concat_pieces(PickedRows.at(pieces, positions))
    scale_grads = [tf.reduce_sum(per_id * rows, axis=1)]
  return [*piece_grads, *([None] * num_positions), None, *scale_grads, None]
