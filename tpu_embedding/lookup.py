"""Combiners: activations from looked-up rows, and row gradients back.

All features looked up in one table in a step are handled together as a
``TableBatch``: their ids are concatenated and deduplicated, so each table
costs one gather and one scatter per step however many features use it.

With weights ``w_i`` for the ids ``i`` of one output row and rows ``e_i``:

.. math::

   \\text{sum: } \\sum_i w_i e_i \\qquad
   \\text{mean: } \\frac{\\sum_i w_i e_i}{\\sum_i w_i} \\qquad
   \\text{sqrtn: } \\frac{\\sum_i w_i e_i}{\\sqrt{\\sum_i w_i^2}}

An output row without ids is zero (as is one whose denominator is zero).
The gradient of row ``e`` is the sum over its occurrences of the output
gradient times the same per-occurrence scale.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.inputs import prepare_feature
  >>> from tpu_embedding.kernels.ops import TENSORFLOW_OPS as ops
  >>> from tpu_embedding.lookup import group_table, combine
  >>> table = tpe.TableConfig(4, 1, combiner="sum", name="t")
  >>> f = prepare_feature(tf.ragged.constant([[1, 1, 2]]), None,
  ...                     tpe.FeatureConfig(table), "f")
  >>> batch = group_table(table, [f], ops)
  >>> rows = tf.constant([[10.0], [20.0]])  # rows of ids 1 and 2
  >>> each_id = occurrence_rows(rows, batch.unique_index)
  >>> combine(each_id, batch, ops).numpy().tolist()
  [[40.0]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import tensorflow as tf

from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import PickedRows
from tpu_embedding.gradients import RowGradients
from tpu_embedding.gradients import concat
from tpu_embedding.inputs import PreparedFeature
from tpu_embedding.kernels.ops import StepOps


@dataclasses.dataclass(frozen=True)
class TableBatch:
  """Every id one table serves in a step, over all its features.

  Attributes:
    table: the (named) table config.
    features: the prepared features, in feature-config order.
    unique_ids: ``[u]`` int64, the distinct ids.
    unique_index: ``[n]`` int32, index into ``unique_ids`` of each id.
    segments: ``[n]`` int64, output row of each id in the concatenation of
      all features' output rows; None when id ``i`` is output row ``i``
      (all features dense).
    scales: ``[n]`` float32, each id's weight after the combiner; None
      when all are 1.
    num_segments: int64 scalar, total output rows.
  """

  table: TableConfig
  features: tuple[PreparedFeature, ...]
  unique_ids: tf.Tensor
  unique_index: tf.Tensor
  segments: tf.Tensor | None
  scales: tf.Tensor | None
  num_segments: tf.Tensor


def combiner_scales(
  segments: tf.Tensor,
  weights: tf.Tensor | None,
  num_segments: tf.Tensor,
  combiner: str,
) -> tf.Tensor | None:
  """Each id's weight divided by its output row's combiner denominator.

  Returns None when every scale is 1 (``sum`` without weights).
  """
  if combiner == "sum":
    return weights
  if weights is None:
    weights = tf.ones_like(segments, dtype=tf.float32)
  if combiner == "mean":
    denominators = tf.math.unsorted_segment_sum(weights, segments, num_segments)
  elif combiner == "sqrtn":
    denominators = tf.sqrt(
      tf.math.unsorted_segment_sum(tf.square(weights), segments, num_segments)
    )
  else:
    raise ValueError(
      f"Unknown combiner {combiner!r}; expected one of 'mean', 'sum', 'sqrtn'."
    )
  return tf.math.divide_no_nan(weights, tf.gather(denominators, segments))


def group_table(
  table: TableConfig,
  features: Sequence[PreparedFeature],
  ops: StepOps,
  members: Sequence[tuple[TableConfig, int, int]] | None = None,
) -> TableBatch:
  """Concatenates and deduplicates all ids one table serves in a step.

  Args:
    table: the table (or stack: ``stacking.py``) the ids are rows of.
    features: the prepared features looked up in it.
    ops: the step's row ops (``kernels/ops.py``): they deduplicate.
    members: for a stack, ``(member table, row offset, number of
      features)`` of each member, the features in member order: each
      member's ids are offset into the stack and combined with the
      member's combiner. None: every feature is ``table``'s own.
  """
  if members is None:
    members = [(table, 0, len(features))]
  # The features' ids, each member's offset into the stack added, are
  # deduplicated as one vector (read in place, never concatenated).
  unique_ids, unique_index = ops.unique(
    [f.ids for f in features],
    [offset for _, offset, count in members for _ in range(count)],
  )
  if len(features) == 1:
    num_segments = features[0].num_segments
  else:
    num_segments = tf.add_n([f.num_segments for f in features])
  if all(f.segments is None for f in features):
    # One id per output row, weight 1: every combiner is the identity.
    return TableBatch(
      table, tuple(features), unique_ids, unique_index, None, None, num_segments
    )
  member_segments, member_scales, start = [], [], 0
  offset = tf.constant(0, tf.int64)
  for member, _, count in members:
    mine = features[start : start + count]
    start += count
    own_segments, own_scales = _member_segments(member, mine)
    member_segments.append(
      own_segments + offset if start > count else own_segments
    )
    member_scales.append(own_scales)
    for f in mine:
      offset = offset + f.num_segments
  segments = concat(member_segments)
  scales: tf.Tensor | None = None
  if any(s is not None for s in member_scales):
    scales = concat(
      [
        tf.ones_like(seg, tf.float32) if s is None else s
        for seg, s in zip(member_segments, member_scales, strict=True)
      ]
    )
  return TableBatch(
    table,
    tuple(features),
    unique_ids,
    unique_index,
    segments,
    scales,
    num_segments,
  )


def _member_segments(
  table: TableConfig, features: Sequence[PreparedFeature]
) -> tuple[tf.Tensor, tf.Tensor | None]:
  """Output row of each id (from 0) and its combiner scale, one table."""
  feature_segments = []
  offset = tf.constant(0, tf.int64)
  for f in features:
    rows = f.segments
    if rows is None:
      rows = tf.range(f.num_segments, dtype=tf.int64)
    feature_segments.append(rows + offset if len(features) > 1 else rows)
    offset = offset + f.num_segments
  segments = concat(feature_segments)
  if len(features) == 1:
    num_segments = features[0].num_segments
  else:
    num_segments = tf.add_n([f.num_segments for f in features])
  weights: tf.Tensor | None = None
  if any(f.weights is not None for f in features):
    weights = concat(
      [
        tf.ones_like(f.ids, tf.float32) if f.weights is None else f.weights
        for f in features
      ]
    )
  if all(f.segments is None for f in features):
    return segments, None  # One id per output row: identity.
  return segments, combiner_scales(
    segments, weights, num_segments, table.combiner
  )


class RowRequest(NamedTuple):
  """What a row source (``activations.RowSource``) reads for one table or
  stack: the row of each id occurrence, ``rows(ids)[index]``.

  Attributes:
    table: the table, or a stack as one table.
    ids: ``[u]`` int64, the distinct ids.
    index: ``[n]`` int32, the position in ``ids`` of each occurrence.
    one_per_row: whether each occurrence is an output row of its own (the
      features are dense: one id per output row), so that its row is the
      activation itself. A source that reads rows in place may then read
      each occurrence's row straight from the table
      (``StepOps.gather_occurrences``), where picking it out of the
      distinct rows would copy every row twice.
  """

  table: TableConfig
  ids: tf.Tensor
  index: tf.Tensor
  one_per_row: bool = False


def occurrence_rows(unique_rows: tf.Tensor, index: tf.Tensor) -> PickedRows:
  """The row of each id occurrence, in place in the rows of the distinct ids.

  What a row source returns (``activations.RowSource``): ``unique_rows[i]``
  is the row of ``unique_ids[i]``, ``index`` the position in ``unique_ids``
  of each occurrence. Nothing is copied: ``combine`` reads each
  occurrence's row where it is.
  """
  return PickedRows.at([unique_rows], index)


def combine(rows: PickedRows, batch: TableBatch, ops: StepOps) -> tf.Tensor:
  """``[num_segments, dim]`` activations from the row of each id.

  Args:
    rows: the row of each id occurrence, in the order of
      ``batch.unique_index``, picked out of the rows a row source read
      (``occurrence_rows``; ungrouped, without scales), or read in that
      order (positions None: ``StepOps.gather_occurrences``).
    batch: the ids' ``TableBatch``.
    ops: the step's row ops (``kernels/ops.py``): they gather and sum.
  """
  pieces = rows.pieces
  quantization = batch.table.quantization_config
  if quantization is not None:
    pieces = [quantization.quantize(piece) for piece in pieces]
  if batch.segments is None:  # One id per output row.
    one_per_row = (
      concat(pieces)  # Read in occurrence order already.
      if rows.picks is None
      else ops.gather_pieces(pieces, rows.picks)
    )
    if batch.scales is None:
      return one_per_row
    return one_per_row * batch.scales[:, None]
  return ops.segment_sum(
    PickedRows.at(pieces, rows.picks, batch.scales),
    batch.segments,
    batch.num_segments,
  )


def split_activations(
  combined: tf.Tensor, batch: TableBatch
) -> list[tf.Tensor]:
  """Splits combined rows per feature, shaped ``output_shape + [dim]``."""
  dim = batch.table.dim
  if len(batch.features) == 1:
    parts = [combined]
  else:
    sizes = tf.stack([f.num_segments for f in batch.features])
    parts = tf.split(combined, sizes, num=len(batch.features), axis=0)
  outputs = []
  for part, feature in zip(parts, batch.features, strict=True):
    static = feature.static_shape.concatenate([dim])
    if static.is_fully_defined():
      part = tf.reshape(part, static)
    else:
      part = tf.reshape(part, tf.concat([feature.output_shape, [dim]], 0))
      part.set_shape(static)
    outputs.append(part)
  return outputs


def occurrence_gradients(
  activation_grads: Sequence[tf.Tensor], batch: TableBatch
) -> RowGradients:
  """The gradient of each id occurrence (``batch.unique_index``), in place.

  A row's gradient is the sum of its occurrences';
  fused updates (``tables/updates.py``) sum them as they apply them.

  Args:
    activation_grads: per feature, the gradient of its activations.
    batch: the ``TableBatch`` the activations were computed from.

  Returns:
    ``gradients.RowGradients`` whose concatenation is the ``[n, dim]``
    gradients: one piece per feature when each id is its own output row
    (read in place, never copied into one tensor); else rows picked out
    of them: each id's output row's gradient (``batch.segments``) times
    its combiner scale, never expanded to one row per id.
  """
  dim = batch.table.dim
  pieces = [
    tf.reshape(tf.cast(g, tf.float32), [-1, dim]) for g in activation_grads
  ]
  if batch.segments is None and batch.scales is None:
    return RowGradients.of_pieces(pieces)
  segments = batch.segments
  if segments is not None:
    segments = tf.cast(segments, tf.int32)
  return RowGradients.at(pieces, segments, batch.scales)
