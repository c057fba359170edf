"""How the replicas of a step share what dynamic tables need.

Every replica runs the same vocabulary step on the global batch's keys,
so each needs every replica's keys, in replica order; and the rows given
to new keys must start from the same values in every copy of a table,
even where the initializer is random. Two ways, picked once from the
strategy (``for_strategy``):

* ``LocalReplicas``: every replica runs in this process (the default
  strategy, ``MirroredStrategy``): a ``merge_call`` hands each replica
  the others' tensors, no collective;
* ``AllWorkers``: the replicas span several processes
  (``MultiWorkerMirroredStrategy``): the keys are all-gathered (padded to
  the longest list) and replica 0's values are all-reduced to everyone.

Example:
  >>> import tensorflow as tf
  >>> sharing = for_strategy(tf.distribute.get_strategy())
  >>> parts, mine = sharing.every_replica([tf.constant([7, 8], tf.int64)])
  >>> [p.numpy().tolist() for p in parts[0]], mine
  ([[7, 8]], 0)
"""

from __future__ import annotations

import abc

import tensorflow as tf

from tpu_embedding.backends.collectives import Exchange


class ReplicaSharing(abc.ABC):
  """What dynamic tables exchange between the replicas of a step."""

  @abc.abstractmethod
  def every_replica(
    self, values: list[tf.Tensor]
  ) -> tuple[list[list[tf.Tensor]], int | tf.Tensor]:
    """Per 1-D int64 tensor of ``values``, every replica's, in replica
    order; and this replica's place in that order. In replica context
    (outside, or with a single replica: its own, place 0)."""

  @abc.abstractmethod
  def combine_owned(self, rows: tf.Tensor) -> tf.Tensor:
    """Each element from the one replica that knows it: ``rows`` (int64,
    the same shape on every replica) hold -1 where another replica's
    shard of the state owns the key."""

  @abc.abstractmethod
  def first_replica(self, values: list[tf.Tensor]) -> list[tf.Tensor]:
    """Replica 0's ``values`` (``[n, d_i]`` float32, the same ``n`` on
    every replica), on every replica."""


class LocalReplicas(ReplicaSharing):
  """Every replica in this process: tensors handed over by merge_call."""

  def every_replica(self, values):
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
      return [[value] for value in values], 0

    def merge(strategy, values):
      return [list(strategy.experimental_local_results(v)) for v in values]

    parts = context.merge_call(merge, args=(values,))
    return [list(p) for p in parts], context.replica_id_in_sync_group

  def first_replica(self, values):
    parts, _ = self.every_replica(values)
    return [part[0] for part in parts]

  def combine_owned(self, rows):
    parts, _ = self.every_replica([rows])
    return tf.reduce_max(tf.stack(parts[0]), axis=0)


class AllWorkers(ReplicaSharing):
  """Replicas in several processes: collectives across all of them."""

  def every_replica(self, values):
    context = tf.distribute.get_replica_context()
    if context is None:
      return [[value] for value in values], 0
    exchange = Exchange(context, values)
    gathered = exchange.all_gather(values, pad_value=0)
    parts = [
      [
        gathered[t][r, : exchange.all_lengths[r, t]]
        for r in range(exchange.num_replicas)
      ]
      for t in range(len(values))
    ]
    return parts, context.replica_id_in_sync_group

  def combine_owned(self, rows):
    context = tf.distribute.get_replica_context()
    # -1 elsewhere: the sum of (row + 1) over replicas is the owner's.
    return context.all_reduce(tf.distribute.ReduceOp.SUM, rows + 1) - 1

  def first_replica(self, values):
    context = tf.distribute.get_replica_context()
    is_first = tf.equal(context.replica_id_in_sync_group, 0)
    # One padding row: collectives on empty tensors are not safe.
    padded = tf.pad(tf.concat(values, axis=1), [[0, 1], [0, 0]])
    summed = context.all_reduce(
      tf.distribute.ReduceOp.SUM,
      tf.where(is_first, padded, tf.zeros_like(padded)),
    )
    widths = [int(v.shape[1]) for v in values]
    return tf.split(summed[:-1], widths, axis=1)


def flat(parts: list[list[tf.Tensor]]) -> list[tf.Tensor]:
  """``every_replica``'s parts feature by feature, replica after replica:
  the global batch's order."""
  return [p for feature in parts for p in feature]


def slices_of(
  values: tf.Tensor, parts: list[list[tf.Tensor]], mine: int | tf.Tensor
) -> list[tf.Tensor]:
  """Per feature, this replica's slice of ``values`` (one element per
  element of ``flat(parts)``, in that order); ``mine``: this replica's
  place.

  One gather and one split for all features: a few ops per step, not a
  few per feature and replica (they are traced with every step).
  """
  replicas = len(parts[0])
  sizes = tf.stack([tf.size(p, out_type=tf.int64) for p in flat(parts)])
  starts = tf.cumsum(sizes, exclusive=True)
  picked = tf.range(len(parts), dtype=tf.int64) * replicas + tf.cast(
    mine, tf.int64
  )
  lengths = tf.gather(sizes, picked)
  first = tf.gather(starts, picked)
  at = tf.ragged.range(first, first + lengths).flat_values
  return tf.split(tf.gather(values, at), lengths, num=len(parts))


def for_strategy(strategy: tf.distribute.Strategy) -> ReplicaSharing:
  """``AllWorkers`` where the strategy's replicas span several
  processes, else ``LocalReplicas``."""
  replicas = strategy.num_replicas_in_sync
  if replicas > 1 and replicas > len(strategy.extended.worker_devices):
    return AllWorkers()
  return LocalReplicas()
