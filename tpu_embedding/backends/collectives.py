"""Batched collectives: every table's ids and rows in a handful of ops.

A step moves, for every table, each replica's distinct ids to all replicas
and rows (or gradients) back. Doing it table by table costs several
collectives per table; ``Exchange`` pads each table's list to the longest
one across replicas and sends all tables together, so a step needs one
all-gather for the lengths, one for the ids, and one all-gather or
all-reduce per embedding width — however many tables there are.

Layout: table ``t``'s list from replica ``r`` sits at
``gathered[r, offsets[t] : offsets[t] + widths[t]]``, padded with
``pad_value``.

Example:
  >>> import tensorflow as tf
  >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
  >>> def fn():
  ...   context = tf.distribute.get_replica_context()
  ...   exchange = Exchange(context, [tf.constant([3, 1], tf.int64)])
  ...   return exchange.all_gather([tf.constant([3, 1], tf.int64)], -1)[0]
  >>> strategy.run(fn).numpy().tolist()
  [[3, 1]]
"""

from __future__ import annotations

import itertools

import tensorflow as tf


class Exchange:
  """Sizes of several tables' per-replica lists, agreed by all replicas."""

  def __init__(
    self, context: tf.distribute.ReplicaContext, lists: list[tf.Tensor]
  ):
    """Agrees on each table's padded width (one all-gather).

    Args:
      context: the replica context (inside ``strategy.run``).
      lists: per table, this replica's ``[n_t, ...]`` tensor.
    """
    self._context = context
    self.num_replicas = context.num_replicas_in_sync
    self.lengths = [tf.shape(t)[0] for t in lists]
    #: ``[num_replicas, num_tables]``: every replica's list lengths.
    self.all_lengths = context.all_gather(
      tf.stack(self.lengths)[None, :], axis=0
    )
    # At least 1: collectives on empty tensors are not safe (padding ids
    # are -1 and never owned).
    self.widths = tf.unstack(
      tf.maximum(tf.reduce_max(self.all_lengths, axis=0), 1), num=len(lists)
    )

  def all_gather(
    self,
    tensors: list[tf.Tensor],
    pad_value: float,
    tables: list[int] | None = None,
  ) -> list[tf.Tensor]:
    """All replicas' lists of the given tables, in one all-gather.

    Args:
      tensors: per table (in ``tables`` order), this replica's list; all
        with the same trailing shape and dtype.
      pad_value: the value padding each list to its width.
      tables: indices of the tables ``tensors`` belong to (default: all).

    Returns:
      Per table, ``[num_replicas, width, ...]``.
    """
    tables = list(range(len(tensors))) if tables is None else tables
    padded = [
      _pad_to(tensor, self.widths[t], pad_value)
      for tensor, t in zip(tensors, tables, strict=True)
    ]
    gathered = self._context.all_gather(tf.concat(padded, axis=0), axis=0)
    widths = [self.widths[t] for t in tables]
    total = tf.add_n(widths) if len(widths) > 1 else widths[0]
    trailing = tensors[0].shape[1:]
    gathered = tf.reshape(
      gathered,
      tf.concat([[self.num_replicas, total], tf.shape(tensors[0])[1:]], 0),
    )
    gathered.set_shape(
      tf.TensorShape([self.num_replicas, None]).concatenate(trailing)
    )
    parts: list[tf.Tensor] = tf.split(
      gathered, tf.stack(widths), num=len(widths), axis=1
    )
    return parts

  def all_reduce_rows(
    self, rows: list[tf.Tensor], tables: list[int]
  ) -> list[tf.Tensor]:
    """Sums ``[num_replicas * width, dim]`` rows of same-width tables.

    Returns:
      Per table, this replica's ``[n_t, dim]`` rows of the sum.
    """
    summed = self._context.all_reduce(
      tf.distribute.ReduceOp.SUM, tf.concat(rows, axis=0)
    )
    sizes = [self.num_replicas * self.widths[t] for t in tables]
    parts = tf.split(summed, tf.stack(sizes), num=len(sizes), axis=0)
    replica = self._context.replica_id_in_sync_group
    mine = []
    for part, t in zip(parts, tables, strict=True):
      start = replica * self.widths[t]
      mine.append(part[start : start + self.lengths[t]])
    return mine


def group_by_width(dims: list[int]) -> list[list[int]]:
  """Indices of the tables grouped by embedding width, in first order."""
  order = sorted(range(len(dims)), key=lambda i: dims[i])
  return [
    list(group) for _, group in itertools.groupby(order, key=lambda i: dims[i])
  ]


def _pad_to(tensor: tf.Tensor, width: tf.Tensor, value: float) -> tf.Tensor:
  paddings = [[0, width - tf.shape(tensor)[0]]] + [[0, 0]] * (
    tensor.shape.rank - 1
  )
  return tf.pad(tensor, paddings, constant_values=value)
