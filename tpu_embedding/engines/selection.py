"""Which engine runs the embedding under the strategy it is created in.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.resolved import resolve
  >>> from tpu_embedding.sharding import PlacementPolicy
  >>> config = resolve(tpe.FeatureConfig(tpe.TableConfig(4, 2)), None)
  >>> type(select_engine(config, None, tf.distribute.get_strategy(),
  ...                    placement=PlacementPolicy(0))).__name__
  'OffTPUEngine'
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding.engines.base import Engine
from tpu_embedding.engines.off_tpu import OffTPUEngine
from tpu_embedding.engines.tpu import is_tpu_strategy
from tpu_embedding.engines.tpu import tpu_engine
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.resolved import ResolvedConfig
from tpu_embedding.resolved import key_mapping
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.stacking import TableStacking


def select_engine(
  config: ResolvedConfig,
  optimizer: Optimizer | None,
  strategy: tf.distribute.Strategy,
  pipeline_execution_with_tensor_core: bool = False,
  sparse_core_embedding_config: Any = None,
  *,
  placement: PlacementPolicy,
  table_stacking: TableStacking = "auto",
) -> Engine:
  """TensorFlow's TPU classes under ``TPUStrategy``; ours elsewhere.

  Raises:
    ValueError: for an unsupported strategy or invalid options.
  """
  if is_tpu_strategy(strategy):
    for table in config.tables:
      key_mapping(table).check_on_tpu(table.name)
    return tpu_engine(
      config,
      optimizer,
      strategy,
      pipeline_execution_with_tensor_core,
      sparse_core_embedding_config,
    )
  return OffTPUEngine(
    config,
    strategy,
    placement,
    pipeline_execution_with_tensor_core,
    table_stacking,
  )
