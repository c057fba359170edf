"""The combiner's sum of id rows into output rows (a faster segment sum).

Every lookup of a feature with several ids per output row (ragged or
sparse input, sequences aside) sums its ids' rows, each scaled by its
weight over the combiner's denominator (``lookup.combine``).
``segment_sum_with_kernel`` (the kernel ops' sum, ``kernels/ops.py``)
returns exactly what ``segment_sum_with_tensorflow`` returns,
``tf.math.unsorted_segment_sum(rows * scales[:, None], segments, num)``,
from the ``TpeSegmentSum`` kernel (``segment_sum.cc``: output rows spread
over the CPU threads, each summing its ids in order).

Example:
  >>> import tensorflow as tf
  >>> rows = tf.constant([[1.0], [2.0], [4.0]])
  >>> segment_sum_with_tensorflow(
  ...     rows, tf.constant([1, 0, 1], tf.int64), None,
  ...     tf.constant(2, tf.int64)).numpy().ravel().tolist()
  [2.0, 5.0]
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def segment_sum_with_tensorflow(
  rows: tf.Tensor,
  segments: tf.Tensor,
  scales: tf.Tensor | None,
  num_segments: tf.Tensor,
) -> tf.Tensor:
  """``[num_segments, dim]`` sums of ``rows * scales`` by output row.

  Args:
    rows: ``[n, dim]`` float32 rows, one per id.
    segments: ``[n]`` int64 output row of each id, in ``[0, num_segments)``.
    scales: None (all 1), or ``[n]`` float32 per-id factors.
    num_segments: int64 scalar, the number of output rows.
  """
  if scales is not None:
    rows = rows * scales[:, None]
  return tf.math.unsorted_segment_sum(rows, segments, num_segments)


def segment_sum_with_kernel(
  module: Any,
  rows: tf.Tensor,
  segments: tf.Tensor,
  scales: tf.Tensor | None,
  num_segments: tf.Tensor,
  spread: bool,
) -> tf.Tensor:
  """``segment_sum_with_tensorflow`` by the ``TpeSegmentSum`` kernel of
  ``module``; rows other than float32 matrices go to TensorFlow's ops."""
  if rows.dtype != tf.float32 or rows.shape.rank != 2:
    return segment_sum_with_tensorflow(rows, segments, scales, num_segments)
  return module.tpe_segment_sum(
    rows,
    tf.cast(segments, tf.int64),
    [] if scales is None else [scales],
    tf.cast(num_segments, tf.int64),
    spread=spread,
  )


@tf.RegisterGradient("TpeSegmentSum")
def _segment_sum_gradient(op, grad: tf.Tensor) -> list:
  """As the TensorFlow ops': each id's output row's gradient, scaled."""
  rows, segments = op.inputs[0], op.inputs[1]
  per_id = tf.gather(grad, segments)
  if len(op.inputs) == 3:  # No scales.
    return [per_id, None, None]
  scales = op.inputs[2]
  return [
    per_id * scales[:, None],
    None,
    tf.reduce_sum(per_id * rows, axis=1),
    None,
  ]
