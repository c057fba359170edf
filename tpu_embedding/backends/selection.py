"""Which backend holds the tables under the strategy of the moment.

Example:
  >>> import tensorflow as tf
  >>> type(select_backend(tf.distribute.get_strategy(), (), 0)).__name__
  'LocalBackend'
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding.backends.base import Backend
from tpu_embedding.backends.local import LocalBackend
from tpu_embedding.backends.parameter_server import ParameterServerBackend
from tpu_embedding.backends.sharded import ShardedBackend
from tpu_embedding.config import TableConfig
from tpu_embedding.replicas import strategy_name


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
