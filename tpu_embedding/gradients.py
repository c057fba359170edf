"""Rows where they are: what lookups read and what updates receive.

An update's gradients (``RowGradients``) are ``PickedRows``: one tensor
(``dense``), pieces whose concatenation they are (``of_pieces``, one per
feature: never concatenated), rows picked out of pieces, each times a
scale (``at``: the gradients of the ids of multi-id features, an id's
gradient being its output row's gradient times its combiner weight, never
expanded to one row per id), or an owner's share of the gradients other
replicas handed over whole (``grouped``: never split or gathered). The
fused kernel reads all of them where they are; the TensorFlow path makes
one tensor of them with ``concat_pieces``.

Example:
  >>> import tensorflow as tf
  >>> picked = PickedRows.at(
  ...     [tf.constant([[1.0], [2.0]]), tf.constant([[3.0]])],
  ...     tf.constant([2, 0]))
  >>> concat_pieces(picked).numpy().ravel().tolist()
  [3.0, 1.0]
  >>> scaled = PickedRows.at([tf.constant([[1.0], [2.0]])],
  ...     tf.constant([1, 1, 0]), tf.constant([0.5, 1.0, 2.0]))
  >>> concat_pieces(scaled).numpy().ravel().tolist()
  [1.0, 2.0, 2.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeAlias

import tensorflow as tf


@dataclasses.dataclass(frozen=True, kw_only=True)
class PickedRows:
  """Rows picked out of pieces, each times a scale.

  Row ``i`` is ``scales[i] * rows[positions[i]]`` for ``rows`` the
  concatenation of ``pieces`` (one float32 product: what multiplying the
  gathered rows by the scales gives). Positions may also come in groups,
  one per equal group of pieces (an owner's rows out of each sender's
  gradients): then the rows are each group's picks, groups in order, and
  the scales (if any) come in the same groups.

  Attributes:
    pieces: ``[rows_k, dim]`` float tensors.
    positions: none (row ``i`` is row ``i`` of the pieces' concatenation),
      one ``[m]`` int32 tensor of positions in it, or one per group.
    scales: none (every factor is 1), or ``[m]`` float32 factors: one
      tensor, or one per group.
  """

  pieces: list[tf.Tensor]
  positions: tuple[tf.Tensor, ...] = ()
  scales: tuple[tf.Tensor, ...] = ()

  @classmethod
  def dense(cls, rows: tf.Tensor) -> PickedRows:
    """``[m, dim]`` rows as they are."""
    return cls(pieces=[rows])

  @classmethod
  def of_pieces(cls, pieces: Sequence[tf.Tensor]) -> PickedRows:
    """The concatenation of ``pieces``, left in place."""
    return cls(pieces=list(pieces))

  @classmethod
  def at(
    cls,
    pieces: Sequence[tf.Tensor],
    positions: tf.Tensor | None,
    scales: tf.Tensor | None = None,
  ) -> PickedRows:
    """The rows of ``pieces`` at ``positions`` (None: all, in order), times
    ``scales`` (None: 1)."""
    return cls(
      pieces=list(pieces),
      positions=() if positions is None else (positions,),
      scales=() if scales is None else (scales,),
    )

  @classmethod
  def grouped(
    cls,
    pieces: Sequence[tf.Tensor],
    positions: Sequence[tf.Tensor],
    scales: Sequence[tf.Tensor] = (),
  ) -> PickedRows:
    """Per equal group of ``pieces``, its rows at that group's
    ``positions`` (times its ``scales``), groups in order."""
    return cls(pieces=list(pieces), positions=(*positions,), scales=(*scales,))

  @property
  def picks(self) -> tf.Tensor | None:
    """The positions of ungrouped rows; None: all rows, in order."""
    return _only(self.positions)

  @property
  def factors(self) -> tf.Tensor | None:
    """The scales of ungrouped rows; None: every factor is 1."""
    return _only(self.scales)

  def picked(self, at: tf.Tensor) -> PickedRows:
    """These (ungrouped) rows at ``at``, still in place."""
    picks, factors = self.picks, self.factors
    positions = at if picks is None else tf.gather(picks, at)
    scales = None if factors is None else tf.gather(factors, at)
    return PickedRows.at(self.pieces, positions, scales)

  def groups(self) -> list[PickedRows]:
    """One ungrouped ``PickedRows`` per group (itself if not grouped)."""
    if len(self.positions) < 2:
      return [self]
    size = len(self.pieces) // len(self.positions)
    scales = self.scales or (None,) * len(self.positions)
    return [
      PickedRows.at(self.pieces[k * size : (k + 1) * size], at, scale)
      for k, (at, scale) in enumerate(zip(self.positions, scales, strict=True))
    ]


#: An update's gradient rows, where they are.
RowGradients: TypeAlias = PickedRows


def _only(values: tuple[tf.Tensor, ...]) -> tf.Tensor | None:
  if len(values) > 1:
    raise ValueError("Grouped rows have one tensor per group.")
  return values[0] if values else None


def concat(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
  """``tensors`` concatenated (the one tensor itself when alone)."""
  return tensors[0] if len(tensors) == 1 else tf.concat(list(tensors), axis=0)


def concat_pieces(rows: PickedRows) -> tf.Tensor:
  """``rows`` as one tensor (pieces concatenated, picked rows gathered)."""
  if len(rows.positions) > 1:
    return concat([concat_pieces(group) for group in rows.groups()])
  out = concat(rows.pieces)
  if rows.picks is not None:
    out = tf.gather(out, rows.picks)
  if rows.factors is None:
    return out
  return out * tf.expand_dims(rows.factors, 1)


def summed_gradients(
  ids: tf.Tensor, grads: RowGradients, index: tf.Tensor | None
) -> tf.Tensor:
  """``[n, dim]`` gradients of ``ids`` (occurrences summed, in order)."""
  rows = concat_pieces(grads)
  if index is None:
    return rows
  return tf.math.unsorted_segment_sum(rows, index, tf.size(ids))


def keep_rows(
  ids: tf.Tensor, grads: RowGradients, index: tf.Tensor, keep: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
  """An update ``(ids, grads, index)`` without the rows where ``keep`` is
  false: their occurrences go too, the others are re-indexed (the
  gradients as one tensor).

  Example:
    >>> import tensorflow as tf
    >>> ids, grads, index = keep_rows(
    ...   tf.constant([4, 9]),
    ...   PickedRows.dense(tf.constant([[1.0], [2.0], [3.0]])),
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
