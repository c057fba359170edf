"""Gradient rows as an update receives them, in place where they are.

An update gets the gradients of single occurrences (``RowGradients``) as
one ``[m, dim]`` tensor, as ``Pieces`` whose concatenation it is (one per
feature: never concatenated), or as ``PickedRows``: rows picked out of
pieces, each times a scale. ``PickedRows`` are the gradients of the ids
of multi-id features (an id's gradient is its output row's gradient times
its combiner weight: never expanded to one row per id) and an owner's
share of the gradients other replicas handed over whole (never split or
gathered). The fused kernel reads all of them where they are; the
TensorFlow path makes one tensor of them with ``concat_pieces``.

Example:
  >>> import tensorflow as tf
  >>> picked = PickedRows(
  ...     [tf.constant([[1.0], [2.0]]), tf.constant([[3.0]])],
  ...     tf.constant([2, 0]))
  >>> concat_pieces(picked).numpy().ravel().tolist()
  [3.0, 1.0]
  >>> scaled = PickedRows([tf.constant([[1.0], [2.0]])],
  ...                     tf.constant([1, 1, 0]), tf.constant([0.5, 1.0, 2.0]))
  >>> concat_pieces(scaled).numpy().ravel().tolist()
  [1.0, 2.0, 2.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Union

import tensorflow as tf

#: ``[rows_k, dim]`` gradient rows whose concatenation is an update's.
Pieces = Sequence[tf.Tensor]


@dataclasses.dataclass(frozen=True)
class PickedRows:
  """Gradient rows picked out of larger pieces, each times a scale.

  Row ``i`` is ``scales[i] * rows[positions[i]]`` for ``rows`` the
  concatenation of ``pieces`` (one float32 product: what multiplying the
  gathered rows by the scales gives). Positions may also come in groups,
  one per equal group of pieces (an owner's rows out of each sender's
  gradients): then the rows are each group's picks, groups in order, and
  the scales (if any) come in the same groups.

  Attributes:
    pieces: ``[rows_k, dim]`` float tensors.
    positions: ``[m]`` int32 row positions in their concatenation, or a
      list of them (one per group of pieces); None: row ``i`` is row ``i``
      (then ``scales`` is given).
    scales: ``[m]`` float32 factors (a list with grouped positions); None:
      every factor is 1.
  """

  pieces: list[tf.Tensor]
  positions: tf.Tensor | list[tf.Tensor] | None
  scales: tf.Tensor | list[tf.Tensor] | None = None

  def picked(self, at: tf.Tensor) -> PickedRows:
    """These rows at ``at``: ``concat_pieces(self)[at]``, still in place.

    Not for grouped positions.
    """
    if isinstance(self.positions, list):
      raise ValueError("picked() needs ungrouped positions.")
    positions = at if self.positions is None else tf.gather(self.positions, at)
    scales = None if self.scales is None else tf.gather(self.scales, at)
    return PickedRows(self.pieces, positions, scales)

  def groups(self) -> list[PickedRows]:
    """One ungrouped ``PickedRows`` per group (itself if not grouped)."""
    if not isinstance(self.positions, list):
      return [self]
    size = len(self.pieces) // len(self.positions)
    scales = self.scales or [None] * len(self.positions)
    return [
      PickedRows(self.pieces[k * size : (k + 1) * size], at, scale)
      for k, (at, scale) in enumerate(zip(self.positions, scales, strict=True))
    ]


#: An update's gradient rows, where they are: one ``[m, dim]`` tensor,
#: ``Pieces`` or ``PickedRows``.
RowGradients = Union[tf.Tensor, Pieces, PickedRows]


def pieces(grads: tf.Tensor | Pieces) -> list[tf.Tensor]:
  """``grads`` (a tensor or pieces) as a list of ``[rows, dim]`` pieces."""
  return list(grads) if isinstance(grads, (list, tuple)) else [grads]


def concat_pieces(grads: RowGradients) -> tf.Tensor:
  """``grads`` as one tensor (pieces concatenated, picked rows gathered)."""
  if isinstance(grads, PickedRows) and isinstance(grads.positions, list):
    return concat_pieces([concat_pieces(group) for group in grads.groups()])
  if isinstance(grads, PickedRows):
    rows = concat_pieces(grads.pieces)
    if grads.positions is not None:
      rows = tf.gather(rows, grads.positions)
    if grads.scales is None:
      return rows
    return rows * tf.expand_dims(grads.scales, 1)
  parts = pieces(grads)
  return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def keep_rows(
  ids: tf.Tensor, grads: RowGradients, index: tf.Tensor, keep: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
  """An update ``(ids, grads, index)`` without the rows where ``keep`` is
  false: their occurrences go too, the others are re-indexed.

  Example:
    >>> import tensorflow as tf
    >>> ids, grads, index = keep_rows(
    ...   tf.constant([4, 9]), tf.constant([[1.0], [2.0], [3.0]]),
    ...   tf.constant([1, 0, 1]), tf.constant([False, True]))
    >>> ids.numpy().tolist(), grads.numpy().tolist(), index.numpy().tolist()
    ([9], [[1.0], [3.0]], [0, 0])
  """
  new_slot = tf.cumsum(tf.cast(keep, index.dtype)) - 1
  kept = tf.gather(keep, index)
  return (
    tf.boolean_mask(ids, keep),
    tf.boolean_mask(concat_pieces(grads), kept),
    tf.boolean_mask(tf.gather(new_slot, index), kept),
  )
