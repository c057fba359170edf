"""Where a call runs: this replica's id, this worker's first replica.

Example:
  >>> import tensorflow as tf
  >>> current_replica(tf.distribute.get_strategy())  # the default replica
  0
  >>> first_local_replica(tf.distribute.get_strategy())
  0
"""

from __future__ import annotations

import tensorflow as tf

from tpu_embedding import compat


def current_replica(strategy: tf.distribute.Strategy) -> int | None:
  """This replica's global id inside ``strategy.run``; None outside it."""
  context = tf.distribute.get_replica_context()
  if context is None or context.strategy is not strategy:
    return None
  return int(tf.get_static_value(context.replica_id_in_sync_group))


def first_local_replica(strategy: tf.distribute.Strategy) -> int:
  """Global id of this worker's first replica (0 on a single worker)."""
  if strategy.num_replicas_in_sync == 1:
    return 0
  local = len(strategy.extended.worker_devices)
  if strategy.num_replicas_in_sync == local:
    return 0
  resolver = strategy.cluster_resolver
  worker = compat.id_in_cluster(
    resolver.cluster_spec(), resolver.task_type, resolver.task_id
  )
  return worker * local


def local_devices(strategy: tf.distribute.Strategy) -> tuple[str, ...]:
  """This worker's replica devices; ``()`` for the default strategy (it
  has none of its own: ops go to the default device).

  Example:
    >>> local_devices(tf.distribute.get_strategy())
    ()
  """
  try:
    return tuple(strategy.extended.worker_devices)
  except (RuntimeError, NotImplementedError):  # The default strategy.
    return ()


def compiles_with_xla(strategy: tf.distribute.Strategy) -> bool:
  """Whether embedding steps under ``strategy`` compile with XLA.

  One replica whose tables are its own: the default strategy, a
  ``OneDeviceStrategy`` or a one-replica ``MirroredStrategy``. Not several
  replicas (XLA compiles each replica's step alone, and their steps write
  each other's table copies and shards) nor parameter servers (rows on
  other tasks).

  Example:
    >>> compiles_with_xla(tf.distribute.get_strategy())
    True
  """
  if strategy.num_replicas_in_sync != 1:
    return False
  return "ParameterServer" not in type(strategy).__name__


def local_replica(strategy: tf.distribute.Strategy) -> int:
  """This replica's index among this worker's replicas (0 outside run)."""
  replica = current_replica(strategy)
  return 0 if replica is None else replica - first_local_replica(strategy)


def strategy_name(strategy: tf.distribute.Strategy) -> str:
  """The strategy's class name, for messages ("the default strategy ..."
  for TensorFlow's default one)."""
  name = type(strategy).__name__
  if name == "_DefaultDistributionStrategy":
    return "the default strategy (outside any `strategy.scope()`)"
  return name
