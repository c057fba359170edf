"""Table initializers: the default truncated normal and row-id values.

``get_config`` describes an initializer as plain (JSON-able) data and
``from_config`` rebuilds it, for ``TableConfig.get_config``: this package's
initializers (``TruncatedNormal``, ``RowIdInitializer``), Keras
initializers, and ``tf.zeros_initializer``, ``tf.ones_initializer``,
``tf.constant_initializer``, ``tf.random_normal_initializer``,
``tf.random_uniform_initializer``. Any other initializer is described as
``"unserializable"`` and comes back as zeros, with a warning: loading saved
table values restores them, but a table rebuilt from the config alone starts
from zeros.

Example:
  >>> import tensorflow as tf
  >>> from tpu_embedding.initializers import RowIdInitializer
  >>> RowIdInitializer(offset=1)((3, 2), tf.float32).numpy().tolist()
  [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
  >>> get_config(RowIdInitializer(offset=1))["config"]
  {'offset': 1}
  >>> from_config(get_config(RowIdInitializer(offset=1)), table="t")
  RowIdInitializer(offset=1)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import TypeAlias
from typing import TypedDict
from typing import Union

import numpy as np
import tensorflow as tf
from absl import logging

#: A table shape: ``(rows, dim)`` as a sequence or a ``TensorShape``.
Shape: TypeAlias = Union[Sequence[int], tf.TensorShape]

#: An initializer: ``initializer(shape, dtype=...)`` returns the initial
#: value (TensorFlow's and Keras' initializers are such callables).
Initializer: TypeAlias = Callable[..., Any]


class TruncatedNormal:
  """Truncated normal values (the default table initializer).

  The default for a table of width ``dim`` is ``mean=0``,
  ``stddev=1/sqrt(dim)``, as in TensorFlow.

  Example:
    >>> init = TruncatedNormal(stddev=0.5)
    >>> init((2, 3), tf.float32).shape
    TensorShape([2, 3])
  """

  def __init__(
    self, mean: float = 0.0, stddev: float = 1.0, seed: int | None = None
  ):
    self.mean = mean
    self.stddev = stddev
    self.seed = seed

  def __call__(
    self, shape: Shape, dtype: tf.DType = tf.float32, **kwargs: Any
  ) -> tf.Tensor:
    del kwargs  # partition info is irrelevant for i.i.d. values.
    return tf.random.truncated_normal(
      shape, mean=self.mean, stddev=self.stddev, dtype=dtype, seed=self.seed
    )

  @classmethod
  def default_for(cls, dim: int) -> TruncatedNormal:
    """The default initializer of a table of width ``dim``."""
    return cls(mean=0.0, stddev=1 / math.sqrt(dim))

  def is_default_for(self, dim: int) -> bool:
    return (
      self.mean == 0.0
      and self.seed is None
      and math.isclose(self.stddev, 1 / math.sqrt(dim))
    )

  def get_config(self) -> dict[str, float | int | None]:
    """The constructor's arguments."""
    return {"mean": self.mean, "stddev": self.stddev, "seed": self.seed}

  def __repr__(self) -> str:
    return f"TruncatedNormal(mean={self.mean!r}, stddev={self.stddev!r})"


class RowIdInitializer:
  """Initializes every element of row ``i`` to ``offset + i``.

  Handy in tests: a looked-up row tells which id was gathered.

  Example:
    >>> RowIdInitializer()((2, 2), tf.int32).numpy().tolist()
    [[0, 0], [1, 1]]
  """

  def __init__(self, offset: int = 0):
    self.offset = offset

  def __call__(
    self, shape: Shape, dtype: tf.DType = tf.float32, **kwargs: Any
  ) -> tf.Tensor:
    del kwargs
    rows = tf.range(self.offset, self.offset + shape[0], dtype=dtype)
    return rows[:, None] * tf.ones(shape, dtype=dtype)

  def get_config(self) -> dict[str, int]:
    """The constructor's arguments."""
    return {"offset": self.offset}

  def __repr__(self) -> str:
    return f"RowIdInitializer(offset={self.offset!r})"


class _InitializerKind(TypedDict):
  kind: str


class InitializerDict(_InitializerKind, total=False):
  """An initializer as plain data (``get_config``).

  ``kind`` is ``"tpu_embedding"``, ``"keras"`` or ``"tensorflow"`` (with
  ``config``, and ``class_name`` but for Keras), or ``"unserializable"``
  (with ``repr``).
  """

  class_name: str
  config: dict[str, Any]
  repr: str


#: This package's initializers, by class name.
_OWN = {cls.__name__: cls for cls in (TruncatedNormal, RowIdInitializer)}

#: TensorFlow's v2 initializer classes that round-trip through get_config.
_TENSORFLOW: dict[str, Any] = {
  type(make()).__name__: type(make())
  for make in (
    tf.zeros_initializer,
    tf.ones_initializer,
    lambda: tf.constant_initializer(0.0),
    tf.random_normal_initializer,
    tf.random_uniform_initializer,
  )
}


def _json_value(value: object) -> object:
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, np.generic):
    return value.item()
  return value


def get_config(initializer: Initializer) -> InitializerDict:
  """Plain data describing ``initializer`` (see the module docstring).

  Args:
    initializer: a table's initializer.

  Returns:
    ``{"kind": ..., ...}``: ``"tpu_embedding"``, ``"keras"`` or
    ``"tensorflow"`` with the class and its config, or
    ``"unserializable"`` with the initializer's repr.
  """
  name = type(initializer).__name__
  if isinstance(initializer, (TruncatedNormal, RowIdInitializer)):
    config = initializer.get_config()
    return {"kind": "tpu_embedding", "class_name": name, "config": config}
  # tf.keras is the Keras the layers use (layers/keras_compat.py); it is
  # loaded here, when an initializer is saved, not at import.
  if isinstance(initializer, tf.keras.initializers.Initializer):
    return {
      "kind": "keras",
      "config": tf.keras.initializers.serialize(initializer),
    }
  if _TENSORFLOW.get(name) is type(initializer):
    tf_config = _TENSORFLOW[name].get_config(initializer)
    values = {k: _json_value(v) for k, v in tf_config.items()}
    return {"kind": "tensorflow", "class_name": name, "config": values}
  return {"kind": "unserializable", "repr": repr(initializer)}


def from_config(config: InitializerDict, table: str) -> Initializer:
  """The initializer ``get_config`` described (or zeros, with a warning).

  Args:
    config: what ``get_config`` returned.
    table: the table's name, for the warning.
  """
  kind = config["kind"]
  if kind == "tpu_embedding":
    return _OWN[config["class_name"]](**config["config"])
  if kind == "keras":
    return tf.keras.initializers.deserialize(config["config"])
  if kind == "tensorflow":
    return _TENSORFLOW[config["class_name"]].from_config(config["config"])
  logging.warning(
    "Table %s: its initializer %s was not serializable; it is rebuilt with "
    "zeros. Loading saved weights (keras.models.load_model) restores the "
    "table values.",
    table,
    config.get("repr"),
  )
  return tf.zeros_initializer()
