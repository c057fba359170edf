"""Table initializers: the default truncated normal and row-id values.

Example:
  >>> import tensorflow as tf
  >>> from tpu_embedding.initializers import RowIdInitializer
  >>> RowIdInitializer(offset=1)((3, 2), tf.float32).numpy().tolist()
  [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any
from typing import TypeAlias
from typing import Union

import tensorflow as tf

#: A table shape: ``(rows, dim)`` as a sequence or a ``TensorShape``.
Shape: TypeAlias = Union[Sequence[int], tf.TensorShape]


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

  def __repr__(self) -> str:
    return f"RowIdInitializer(offset={self.offset!r})"
