"""Feature configs of any kind as TensorFlow's, the configs FDO measures.

The statistics follow TensorFlow's stacking, which takes TensorFlow's
``FeatureConfig``; ``to_tf_feature_config`` accepts this package's,
TensorFlow's or keras-rs' configs and returns fresh TensorFlow ones, each
table with an optimizer (tables stack only with the same optimizer).

Example:
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.fdo import configs
  >>> table = tpe.TableConfig(64, 8, name="items")
  >>> tf_config = configs.to_tf_feature_config(
  ...     {"item": tpe.FeatureConfig(table)}, tpe.SGD(0.1))
  >>> type(tf_config["item"]).__name__, tf_config["item"].table.name
  ('FeatureConfig', 'items')
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding import compat

TFE = tf.tpu.experimental.embedding


def _is_keras_rs_nest(feature_config: Any) -> bool:
  from tpu_embedding.layers import keras_rs_configs

  return any(
    keras_rs_configs.is_keras_rs_feature(leaf)
    for leaf in tf.nest.flatten(feature_config)
  )


def to_tf_feature_config(feature_config: Any, optimizer: Any = None) -> Any:
  """A nest of TensorFlow ``FeatureConfig`` for any supported config.

  Args:
    feature_config: a nest of this package's, TensorFlow's or keras-rs'
      ``FeatureConfig``.
    optimizer: the optimizer of tables without one (this package's,
      TensorFlow's, or for keras-rs configs a Keras optimizer). Tables
      stack only with the same optimizer, so it matters.

  Returns:
    Fresh TensorFlow configs (the caller's are never modified).
  """
  from tpu_embedding.engines import tpu_conversion

  leaves = tf.nest.flatten(feature_config)
  if leaves and all(isinstance(leaf, TFE.FeatureConfig) for leaf in leaves):
    clone = compat.clone_tf_feature_config(feature_config)
    if optimizer is not None and not _is_tf_optimizer(optimizer):
      optimizer = tpu_conversion.to_tf_optimizer(optimizer)
    for leaf in tf.nest.flatten(clone):
      if leaf.table.optimizer is None:
        leaf.table.optimizer = optimizer
    return clone
  if _is_keras_rs_nest(feature_config):
    from tpu_embedding.layers import keras_rs_configs

    feature_config = keras_rs_configs.translate(feature_config).feature_config
  if _is_tf_optimizer(optimizer):
    from tpu_embedding.layers import tf_configs

    optimizer = tf_configs.from_tf_optimizer(optimizer)
  elif optimizer is not None and not _is_tpe_optimizer(optimizer):
    from tpu_embedding.layers import keras_optimizers

    optimizer = keras_optimizers.embedding_optimizer(optimizer)
  return tpu_conversion.to_tf_feature_config(feature_config, optimizer)


def _is_tf_optimizer(optimizer: Any) -> bool:
  from tpu_embedding.layers import tf_configs

  return optimizer is not None and tf_configs.is_tf_optimizer(optimizer)


def _is_tpe_optimizer(optimizer: Any) -> bool:
  from tpu_embedding.optimizers.base import Optimizer

  return isinstance(optimizer, Optimizer)
