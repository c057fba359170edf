"""The two optimizers of a ranking model: sparse tables, dense layers.

As Model Garden's ``RankingTask.build_model``: the tables train with
``embedding_optimizer`` at a ``WarmUpAndPolyDecay`` rate (here a
``tpu_embedding`` optimizer whose ``learning_rate`` is a zero-argument
callable reading the global step), the dense layers with a Keras
``dense_optimizer`` (``Adam``; ``SGD`` follows ``dense_sgd_config``).

Example:
  >>> import tensorflow as tf
  >>> from model_garden.ranking import optimizers
  >>> from model_garden.ranking.configs import definitions
  >>> step = tf.Variable(0, dtype=tf.int64)
  >>> opt = optimizers.embedding_optimizer(
  ...   definitions.OptimizationConfig(), batch_size=2048, step=step)
  >>> type(opt).__name__, round(float(opt.learning_rate()), 2)
  ('SGD', 0.01)
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

import tpu_embedding as tpe
from model_garden.ranking import lr_schedule
from model_garden.ranking.configs import definitions

_EMBEDDING = {
  "SGD": tpe.SGD,
  "Adagrad": tpe.Adagrad,
  "Adam": tpe.Adam,
  "FTRL": tpe.FTRL,
}


def embedding_optimizer_class(name: str) -> type:
  """The ``tpu_embedding`` optimizer class of ``embedding_optimizer``.

  Raises:
    ValueError: for an unknown name.

  Example:
    >>> from model_garden.ranking import optimizers
    >>> optimizers.embedding_optimizer_class("Adam").SLOT_NAMES
    ('momenta', 'velocities')
  """
  if name not in _EMBEDDING:
    raise ValueError(
      f"embedding_optimizer must be one of {sorted(_EMBEDDING)}, got {name!r}."
    )
  return _EMBEDDING[name]


def embedding_optimizer(
  config: definitions.OptimizationConfig, batch_size: int, step: tf.Variable
) -> Any:
  """The tables' optimizer, its rate ``lr_config``'s schedule at ``step``.

  Args:
    config: the optimization config.
    batch_size: the global batch size (the schedule scales by it).
    step: the global step variable, read at every update.

  Raises:
    ValueError: for an unknown ``embedding_optimizer``.
  """
  optimizer = embedding_optimizer_class(config.embedding_optimizer)
  schedule = lr_schedule.from_config(config.lr_config, batch_size)
  rate = lr_schedule.step_callable(schedule, step)
  return optimizer(learning_rate=rate)


def dense_optimizer(
  config: definitions.OptimizationConfig, batch_size: int
) -> keras.optimizers.Optimizer:
  """The dense layers' Keras optimizer.

  ``SGD`` follows ``dense_sgd_config``'s ``WarmUpAndPolyDecay`` (on the
  optimizer's own iteration count); ``Adam`` and ``Adagrad`` use
  ``dense_learning_rate``.

  Raises:
    ValueError: for an unknown ``dense_optimizer``.

  Example:
    >>> from model_garden.ranking import optimizers
    >>> from model_garden.ranking.configs import definitions
    >>> opt = optimizers.dense_optimizer(
    ...   definitions.OptimizationConfig(dense_optimizer="SGD"), 4096)
    >>> type(opt).__name__, type(opt._learning_rate).__name__
    ('SGD', 'WarmUpAndPolyDecay')
  """
  name = config.dense_optimizer
  if name == "SGD":
    schedule = lr_schedule.from_config(config.dense_sgd_config, batch_size)
    return keras.optimizers.SGD(learning_rate=schedule)
  if name == "Adam":
    return keras.optimizers.Adam(learning_rate=config.dense_learning_rate)
  if name == "Adagrad":
    return keras.optimizers.Adagrad(learning_rate=config.dense_learning_rate)
  raise ValueError(
    f"dense_optimizer must be one of {definitions.DENSE_OPTIMIZERS}, got "
    f"{name!r}."
  )
