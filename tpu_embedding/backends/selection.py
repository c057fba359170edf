"""Which backend holds the tables under the strategy of the moment.

Example:
  >>> import tensorflow as tf
  >>> type(select_backend(tf.distribute.get_strategy(), (), 0)).__name__
  'LocalBackend'
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding.backends.base import Backend
from tpu_embedding.backends.local import LocalBackend
from tpu_embedding.backends.parameter_server import ParameterServerBackend
from tpu_embedding.backends.sharded import ShardedBackend
from tpu_embedding.config import TableConfig
from tpu_embedding.replicas import strategy_name
from tpu_embedding.resolved import table_name
from tpu_embedding.sharding import placement_kind
from tpu_embedding.stacking import auto_stacks


def select_backend(
  strategy: tf.distribute.Strategy,
  tables: Sequence[TableConfig],
  row_threshold: int,
) -> Backend:
  """The off-TPU backend for ``strategy``.

  Raises:
    ValueError: for a strategy without a backend.
  """
  if isinstance(strategy, tf.distribute.OneDeviceStrategy) or (
    not tf.distribute.has_strategy()
  ):
    return LocalBackend()
  if isinstance(
    strategy,
    (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy),
  ):
    return ShardedBackend(strategy, tables, row_threshold)
  if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    return ParameterServerBackend(strategy, tables, row_threshold)
  raise ValueError(
    f"TPUEmbedding created under {strategy_name(strategy)}: this version "
    "of tpu_embedding trains on the default strategy, OneDeviceStrategy, "
    "MirroredStrategy, MultiWorkerMirroredStrategy, ParameterServerStrategy "
    "and TPUStrategy. Create it outside any strategy scope or under one of "
    "those."
  )


def stacking_support(
  strategy: tf.distribute.Strategy, row_threshold: int
) -> tuple[bool, Callable[[TableConfig], str], str, bool]:
  """Whether the backend for ``strategy`` can hold table stacks.

  Returns:
    ``(can_stack, placement, where, auto)``: the layout kind each table
    gets alone (tables of different kinds never stack), a description of
    the strategy for errors, and whether ``table_stacking="auto"`` stacks
    (on accelerators, and on CPUs with several replicas in this process;
    see ``stacking.py`` for the CPU measurements).

  Example:
    >>> import tensorflow as tf
    >>> stacking_support(tf.distribute.get_strategy(), 0)[0]
    True
  """
  where = f"under {strategy_name(strategy)}"
  if tf.distribute.has_strategy():
    devices = list(strategy.extended.worker_devices)
  else:  # The default strategy: the default device (a GPU if any).
    devices = [d.name for d in tf.config.list_logical_devices("GPU")[:1]]
  auto = any("GPU" in str(device).upper() for device in devices)
  if isinstance(strategy, tf.distribute.OneDeviceStrategy) or (
    not tf.distribute.has_strategy()
  ):
    return True, lambda table: "whole", where, auto
  if isinstance(
    strategy,
    (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy),
  ):
    replicas = strategy.num_replicas_in_sync
    local = len(strategy.extended.worker_devices)
    auto = auto_stacks(auto, replicas)

    def placement(table: TableConfig) -> str:
      return placement_kind(
        table_name(table), table.vocabulary_size, replicas, row_threshold
      )

    # Tables over several workers save in slices per worker
    # (tables/multi_worker.py): not stacked.
    return (
      replicas == local,
      placement,
      where + " with several workers",
      auto,
    )
  return False, lambda table: "whole", where, False
