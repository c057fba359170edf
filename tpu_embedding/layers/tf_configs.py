"""TensorFlow's TPU embedding configs and optimizers, taken by the layers.

tensorflow-recommenders code builds its layers from
``tf.tpu.experimental.embedding`` objects; so that the layers are drop-ins,
they take them too. Each ``FeatureConfig``, ``TableConfig``,
``QuantizationConfig`` and optimizer is rebuilt as this package's class of
the same name with the same arguments: the inverse of the tables of
``tpu_embedding/engines/tpu_conversion.py``, which name, for each of our
classes, TensorFlow's class and the arguments both share. A rebuilt
optimizer must translate back to one equal to the original (TensorFlow's
optimizers compare by value), so an attribute without a translation is an
error, never dropped.

One TensorFlow table becomes one of ours, so features sharing a table
still share it; ``FromTFConfigs`` remembers which is which, and the layers key
``embedding_tables`` by the user's objects and accept them in serving
configs.

Example:
  >>> import tensorflow as tf
  >>> TFE = tf.tpu.experimental.embedding
  >>> table = TFE.TableConfig(10, 4, name="t", optimizer=TFE.SGD(0.1))
  >>> configs = FromTFConfigs()
  >>> ours = configs.feature_config({"a": TFE.FeatureConfig(table),
  ...                                "b": TFE.FeatureConfig(table)})
  >>> ours["a"].table is ours["b"].table, ours["a"].table.optimizer
  (True, SGD(learning_rate=0.1))
  >>> configs.user_table(ours["a"].table) is table
  True
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding.config import FeatureConfig
from tpu_embedding.config import QuantizationConfig
from tpu_embedding.config import TableConfig
from tpu_embedding.engines.tpu_conversion import FEATURE_ARGS
from tpu_embedding.engines.tpu_conversion import OPTIMIZER_MAPPINGS
from tpu_embedding.engines.tpu_conversion import TABLE_ARGS
from tpu_embedding.engines.tpu_conversion import to_tf_optimizer
from tpu_embedding.optimizers.base import Optimizer

TFE = tf.tpu.experimental.embedding

#: TensorFlow's optimizer class -> ours (the inverse of OPTIMIZER_MAPPINGS).
TF_OPTIMIZERS: dict[type, type[Optimizer]] = {
  mapping.tf_class: ours for ours, mapping in OPTIMIZER_MAPPINGS.items()
}


def is_tf_optimizer(optimizer: Any) -> bool:
  """Whether ``optimizer`` is one of TensorFlow's TPU embedding optimizers.

  Example:
    >>> import tensorflow as tf
    >>> is_tf_optimizer(tf.tpu.experimental.embedding.Adam())
    True
  """
  return type(optimizer) in TF_OPTIMIZERS


def from_tf_optimizer(optimizer: Any) -> Optimizer:
  """Our optimizer with the hyper-parameters of TensorFlow's ``optimizer``.

  Args:
    optimizer: an instance of exactly ``tf.tpu.experimental.embedding``'s
      ``SGD``, ``Adagrad``, ``AdagradMomentum``, ``Adam`` or ``FTRL``.

  Returns:
    Our optimizer of the same name; the same learning rate (callables
    too) and ``slot_variable_creation_fn`` objects.

  Raises:
    ValueError: for another class, or an attribute with no translation.

  Example:
    >>> import tensorflow as tf
    >>> from_tf_optimizer(tf.tpu.experimental.embedding.FTRL(
    ...     0.1, beta=0.5, clipvalue=2.0))
    FTRL(learning_rate=0.1, beta=0.5, clipvalue=(-2.0, 2.0))
  """
  ours = TF_OPTIMIZERS.get(type(optimizer))
  if ours is None:
    raise ValueError(
      f"{type(optimizer)} is not one of TensorFlow's TPU embedding "
      "optimizers (SGD, Adagrad, AdagradMomentum, Adam, FTRL)."
    )
  kwargs: dict[str, Any] = {}
  for arg in OPTIMIZER_MAPPINGS[ours].supported_kwargs:
    if arg == "clipvalue":  # TensorFlow keeps the (min, max) bounds.
      clip = (optimizer.clip_gradient_min, optimizer.clip_gradient_max)
      kwargs[arg] = None if clip == (None, None) else clip
    else:
      kwargs[arg] = getattr(optimizer, arg)
  result = ours(**kwargs)
  if to_tf_optimizer(result) != optimizer:
    raise ValueError(
      f"TensorFlow's {type(optimizer).__name__} has attributes without a "
      f"translation to tpu_embedding.{ours.__name__}: {vars(optimizer)}."
    )
  return result


def _check_attributes(config: Any, translated: tuple[str, ...]) -> None:
  unknown = sorted(set(vars(config)) - set(translated))
  if unknown:
    raise ValueError(
      f"TensorFlow's {type(config).__name__} attributes {unknown} have no "
      "translation to tpu_embedding's configs."
    )


class FromTFConfigs:
  """Rebuilds TensorFlow's configs as ours, remembering which is which.

  ``feature_config`` leaves this package's configs as they are.
  """

  def __init__(self):
    # id(TensorFlow table) -> (its table, ours); holding theirs keeps ids.
    self._tables: dict[int, tuple[Any, TableConfig]] = {}

  def feature_config(self, nest: Any) -> Any:
    """``nest`` with TensorFlow's ``FeatureConfig`` leaves rebuilt as ours.

    Args:
      nest: a nest of ``FeatureConfig`` (ours, TensorFlow's or both), or
        None.

    Returns:
      The same structure; other leaves unchanged.

    Raises:
      ValueError: for a TensorFlow attribute without a translation.
    """
    if nest is None:
      return None
    leaves = [
      self._feature(leaf) if isinstance(leaf, TFE.FeatureConfig) else leaf
      for leaf in tf.nest.flatten(nest)
    ]
    return tf.nest.pack_sequence_as(nest, leaves)

  def user_table(self, table: Any) -> Any:
    """The TensorFlow table ``table`` was built from, else ``table``."""
    for theirs, ours in self._tables.values():
      if ours is table:
        return theirs
    return table

  def _feature(self, feature: Any) -> FeatureConfig:
    _check_attributes(feature, FEATURE_ARGS)
    kwargs = {arg: getattr(feature, arg) for arg in FEATURE_ARGS}
    kwargs["table"] = self._table(feature.table)
    return FeatureConfig(**kwargs)

  def _table(self, table: Any) -> TableConfig:
    if id(table) not in self._tables:
      _check_attributes(table, TABLE_ARGS)
      kwargs = {arg: getattr(table, arg) for arg in TABLE_ARGS}
      if table.optimizer is not None:
        kwargs["optimizer"] = from_tf_optimizer(table.optimizer)
      quantization = table.quantization_config
      if quantization is not None:
        kwargs["quantization_config"] = QuantizationConfig(
          quantization.num_buckets, quantization.lower, quantization.upper
        )
      self._tables[id(table)] = (table, TableConfig(**kwargs))
    return self._tables[id(table)][1]
