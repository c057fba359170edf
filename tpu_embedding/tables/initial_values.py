"""Initial values of tables and slots that do not depend on the layout.

A table's initial value is defined on a fixed grid of row blocks of
``grid_rows(dim)`` rows (about 4 MiB each): block ``k`` holds rows
``[k * G, (k + 1) * G)`` and is generated on its own, statelessly, from
the initializer's seed and ``k``. A shard (any row range) is filled block
by block, so

* the same seed gives the same table on one device, on 2 or 4 replicas,
  on 2 workers or on parameter servers, and
* no process ever holds more than its own rows plus one grid block.

Initializers understood this way ("row-wise"): this package's
``TruncatedNormal`` and ``RowIdInitializer``; TensorFlow's and Keras'
``Zeros``, ``Ones``, ``Constant`` (a scalar, or an array whose rows are
sliced), ``RandomUniform``, ``RandomNormal``, ``TruncatedNormal`` and
``VarianceScaling`` (Glorot, He, LeCun; fans from the full table shape).
For ``RandomUniform(minval=a, maxval=b, seed=s)`` block ``k`` is
``tf.random.stateless_uniform([G, dim], seed=[s, k], minval=a, maxval=b)``
(normals alike). An unseeded initializer draws one seed per variable from
TensorFlow's global generator (so ``tf.random.set_seed`` makes it
repeatable too).

Any other initializer (a user's callable, ``Orthogonal``, ``Identity``) can
only produce the whole table: it is called once with the full shape and
each shard takes its rows; a warning says so once for a large table.

Example:
  >>> import tensorflow as tf
  >>> values = row_values(tf.random_uniform_initializer(seed=1), (10, 2))
  >>> whole = values.rows(0, 10, tf.float32)
  >>> part = values.rows(4, 3, tf.float32)
  >>> bool(tf.reduce_all(whole[4:7] == part))
  True
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.config import TableConfig
from tpu_embedding.initializers import Initializer
from tpu_embedding.initializers import RowIdInitializer
from tpu_embedding.initializers import Shape
from tpu_embedding.initializers import TruncatedNormal
from tpu_embedding.resolved import table_name

#: Bytes of one grid block (float32).
GRID_BYTES = 4 * 2**20

#: Tables at least this large warn when their initializer makes them whole.
LARGE_TABLE_BYTES = 128 * 2**20

_warned: set[str] = set()


def grid_rows(dim: int) -> int:
  """Rows of one grid block of a table of width ``dim`` (fixed by ``dim``)."""
  return max(1, GRID_BYTES // (4 * dim))


class RowValues(metaclass=abc.ABCMeta):
  """The initial value of a ``[vocabulary_size, dim]`` variable, by rows."""

  def __init__(self, full_shape: tuple[int, int]):
    self.full_shape = (int(full_shape[0]), int(full_shape[1]))

  def start(self, count: int, dtype: tf.DType) -> tf.Tensor:
    """The value a ``count``-row variable is created with.

    ``pieces`` then writes the rows that differ from it.
    """
    return tf.zeros([count, self.full_shape[1]], dtype)

  @abc.abstractmethod
  def pieces(
    self, first: int, count: int, dtype: tf.DType
  ) -> Iterator[tuple[int, tf.Tensor]]:
    """``(offset in the range, rows)`` pieces of ``[first, first+count)``."""

  def rows(self, first: int, count: int, dtype: tf.DType) -> tf.Tensor:
    """Rows ``[first, first + count)`` as one tensor."""
    parts = [part for _, part in self.pieces(first, count, dtype)]
    if not parts:  # ``start`` is the whole value (a fill).
      return self.start(count, dtype)
    return tf.concat(parts, axis=0)

  def fill(self, variable: tf.Variable, first: int) -> None:
    """Writes rows ``[first, first + rows)`` into ``variable`` in place."""
    count = int(variable.shape[0])
    # Generated in float32 and rounded to nearest: a 16-bit table starts
    # from its float32 twin's values.
    for offset, part in self.pieces(first, count, tf.float32):
      part = tf.cast(part, variable.dtype)
      # A scatter writes in place (a strided-slice assign copies the whole
      # variable once).
      tf.raw_ops.ResourceScatterUpdate(
        resource=variable.handle,
        indices=tf.range(offset, offset + int(part.shape[0]), dtype=tf.int64),
        updates=part,
      )


class _Fill(RowValues):
  """Every element ``value``."""

  def __init__(self, full_shape: tuple[int, int], value: float):
    super().__init__(full_shape)
    self.value = value

  def start(self, count: int, dtype: tf.DType) -> tf.Tensor:
    return tf.fill([count, self.full_shape[1]], tf.cast(self.value, dtype))

  def pieces(
    self, first: int, count: int, dtype: tf.DType
  ) -> Iterator[tuple[int, tf.Tensor]]:
    return iter(())


class _Grid(RowValues):
  """Values generated one grid block at a time."""

  def pieces(
    self, first: int, count: int, dtype: tf.DType
  ) -> Iterator[tuple[int, tf.Tensor]]:
    size = grid_rows(self.full_shape[1])
    end = first + count
    for block in range(first // size, (end - 1) // size + 1 if count else 0):
      lo = block * size
      rows = min(size, self.full_shape[0] - lo)
      value = self.block(block, lo, rows, dtype)
      a, b = max(first, lo), min(end, lo + rows)
      yield a - first, value[a - lo : b - lo]

  @abc.abstractmethod
  def block(
    self, index: int, first: int, rows: int, dtype: tf.DType
  ) -> tf.Tensor:
    """Grid block ``index`` (rows ``[first, first + rows)``)."""


class _RowIds(_Grid):
  def __init__(self, full_shape: tuple[int, int], offset: int):
    super().__init__(full_shape)
    self.offset = offset

  def block(
    self, index: int, first: int, rows: int, dtype: tf.DType
  ) -> tf.Tensor:
    shape = (rows, self.full_shape[1])
    return RowIdInitializer(self.offset + first)(shape, dtype)


class _ArrayRows(_Grid):
  """Rows sliced from an array the user gave (broadcast to the table)."""

  def __init__(self, full_shape: tuple[int, int], array: np.ndarray):
    super().__init__(full_shape)
    try:
      self.array = np.broadcast_to(array, self.full_shape)
    except ValueError:
      raise ValueError(
        f"A constant initializer of shape {array.shape} cannot initialize a "
        f"table or slot of shape {list(self.full_shape)}."
      ) from None

  def block(
    self, index: int, first: int, rows: int, dtype: tf.DType
  ) -> tf.Tensor:
    return tf.constant(self.array[first : first + rows], dtype=dtype)


class _Random(_Grid):
  """Stateless random blocks: block ``k`` from seed ``[seed, k]``."""

  def __init__(
    self,
    full_shape: tuple[int, int],
    kind: str,
    a: float,
    b: float,
    seed: int | None,
  ):
    super().__init__(full_shape)
    self.kind, self.a, self.b = kind, a, b
    if seed is None:  # One seed per variable from the global generator.
      seed = int(tf.random.uniform([], maxval=2**31 - 1, dtype=tf.int64))
    self.seed = int(seed)

  def block(
    self, index: int, first: int, rows: int, dtype: tf.DType
  ) -> tf.Tensor:
    shape = [rows, self.full_shape[1]]
    seed = tf.constant([self.seed, index], tf.int64)
    if self.kind == "uniform":
      return tf.random.stateless_uniform(
        shape, seed, minval=self.a, maxval=self.b, dtype=dtype
      )
    sample = (
      tf.random.stateless_normal
      if self.kind == "normal"
      else tf.random.stateless_truncated_normal
    )
    return sample(shape, seed, mean=self.a, stddev=self.b, dtype=dtype)


class _Whole(RowValues):
  """An initializer that only makes the whole table: called once."""

  def __init__(
    self, full_shape: tuple[int, int], initializer: Initializer, name: str
  ):
    super().__init__(full_shape)
    self.initializer = initializer
    self.name = name
    self._value: tf.Tensor | None = None

  def pieces(
    self, first: int, count: int, dtype: tf.DType
  ) -> Iterator[tuple[int, tf.Tensor]]:
    if self._value is None:
      bytes_ = self.full_shape[0] * self.full_shape[1] * 4
      if bytes_ >= LARGE_TABLE_BYTES and self.name not in _warned:
        _warned.add(self.name)
        logging.getLogger("tpu_embedding").warning(
          "%s: initializer %r can only produce the whole [%d, %d] table, so "
          "it is materialized once (%.0f MiB) before its rows are split. "
          "Use a row-wise initializer (see tpu_embedding.tables."
          "initial_values) to keep every process at its own rows.",
          self.name,
          self.initializer,
          *self.full_shape,
          bytes_ / 2**20,
        )
      self._value = tf.convert_to_tensor(
        self.initializer(self.full_shape, dtype=dtype)
      )
    yield 0, tf.identity(self._value[first : first + count])


_RANDOM = {
  "RandomUniform": "uniform",
  "RandomNormal": "normal",
  "TruncatedNormal": "truncated",
}


def _config(initializer: Initializer) -> dict[str, Any] | None:
  """``get_config()`` of a TensorFlow or Keras initializer, else None."""
  module = type(initializer).__module__
  if not module.startswith(("keras", "tensorflow", "tf_keras")):
    return None
  get_config = getattr(initializer, "get_config", None)
  config: dict[str, Any] | None = get_config() if get_config else None
  return config


def _seed(config: dict[str, Any]) -> int | None:
  seed = config.get("seed")
  return seed if isinstance(seed, int) or seed is None else None


def _variance_scaling(
  full_shape: tuple[int, int], config: dict[str, Any]
) -> RowValues:
  fan_in, fan_out = full_shape
  mode = config.get("mode", "fan_in")
  n = {"fan_in": fan_in, "fan_out": fan_out}.get(mode, (fan_in + fan_out) / 2)
  scale = config.get("scale", 1.0) / max(1.0, n)
  distribution = config.get("distribution", "truncated_normal")
  seed = _seed(config)
  if distribution == "uniform":
    limit = float(np.sqrt(3.0 * scale))
    return _Random(full_shape, "uniform", -limit, limit, seed)
  if distribution in ("untruncated_normal", "normal"):
    return _Random(full_shape, "normal", 0.0, float(np.sqrt(scale)), seed)
  # Truncated at 2 stddev: rescaled so the variance is ``scale``.
  stddev = float(np.sqrt(scale) / 0.87962566103423978)
  return _Random(full_shape, "truncated", 0.0, stddev, seed)


class _Stacked(RowValues):
  """A stack's value: each member table's own value at its offset."""

  def __init__(
    self, full_shape: tuple[int, int], members: list[tuple[int, RowValues]]
  ):
    super().__init__(full_shape)
    self.members = members

  def pieces(
    self, first: int, count: int, dtype: tf.DType
  ) -> Iterator[tuple[int, tf.Tensor]]:
    end = first + count
    for offset, values in self.members:
      rows = values.full_shape[0]
      a, b = max(first, offset), min(end, offset + rows)
      if a >= b:
        continue
      parts = values.pieces(a - offset, b - a, dtype)
      found = False
      for at, part in parts:
        found = True
        yield a - first + at, part
      if not found:  # A fill: its ``start`` is its whole value.
        size = grid_rows(self.full_shape[1])
        for lo in range(a, b, size):
          yield lo - first, values.start(min(size, b - lo), dtype)


class StackedInitializer:
  """The initial value of a stack: each member's own initializer, in order.

  A stack (``stacking.py``) is made with one. Layouts read it through
  ``row_values``, which gives each member's rows exactly the values the
  member would get alone.

  Attributes:
    members: ``(offset, table)`` of each member.
  """

  def __init__(self, members: Sequence[tuple[int, TableConfig]]):
    self.members = tuple(members)

  def __call__(
    self, shape: Shape, dtype: tf.DType | str | None = None, **kwargs: object
  ) -> tf.Tensor:
    del kwargs
    full = (int(shape[0]), int(shape[1]))
    return row_values(self, full).rows(0, full[0], dtype or "float32")

  def __repr__(self) -> str:
    names = [table_name(t) for _, t in self.members]
    return f"StackedInitializer({names})"


def row_values(
  initializer: Initializer, full_shape: tuple[int, int], name: str = "table"
) -> RowValues:
  """The row-wise initial value ``initializer`` gives a full table.

  Args:
    initializer: a table's or slot's initializer (or a stack's).
    full_shape: ``(vocabulary_size, dim)``.
    name: the variable's name, for the large-table warning.
  """
  if isinstance(initializer, StackedInitializer):
    return _Stacked(
      full_shape,
      [
        (
          offset,
          row_values(
            table.initializer,
            (table.vocabulary_size, full_shape[1]),
            table_name(table),
          ),
        )
        for offset, table in initializer.members
      ],
    )
  if isinstance(initializer, RowIdInitializer):
    return _RowIds(full_shape, initializer.offset)
  if isinstance(initializer, TruncatedNormal):
    return _Random(
      full_shape,
      "truncated",
      initializer.mean,
      initializer.stddev,
      initializer.seed,
    )
  config = _config(initializer)
  kind = type(initializer).__name__
  if config is not None:
    if kind in ("Zeros", "Ones"):
      return _Fill(full_shape, 0.0 if kind == "Zeros" else 1.0)
    if kind == "Constant":
      # The attribute (Keras' get_config serializes an array as a dict).
      value = getattr(initializer, "value", config.get("value", 0.0))
      value = np.asarray(value, dtype=np.float32)
      if value.ndim == 0:
        return _Fill(full_shape, float(value))
      if value.size == full_shape[0] * full_shape[1]:
        return _ArrayRows(full_shape, value.reshape(full_shape))
      return _ArrayRows(full_shape, value)  # broadcast, e.g. one row
    if kind in _RANDOM:
      low = config.get("minval", config.get("mean", 0.0))
      high = config.get("maxval", config.get("stddev", 1.0))
      return _Random(full_shape, _RANDOM[kind], low, high, _seed(config))
    if "mode" in config and "distribution" in config:
      return _variance_scaling(full_shape, config)
  return _Whole(full_shape, initializer, name)


def create_variable(
  values: RowValues,
  first: int,
  rows: int,
  name: str,
  trainable: bool,
  dtype: tf.DType = tf.float32,
) -> tf.Variable:
  """A plain variable holding rows ``[first, first + rows)`` of ``values``.

  Created on the current device; peak memory is the variable plus one
  grid block.
  """
  variable = compat.ResourceVariable(
    values.start(rows, dtype), name=name, trainable=trainable
  )
  values.fill(variable, first)
  return variable


class RowWiseInitializer:
  """An initializer ``(shape, dtype) -> value`` made of ``row_values``.

  For whole tables, so that one device gets the same values as any
  sharded layout. Called, it gives only ``values.start`` (a fill); the
  variable made from it must then be passed to ``fill_in_place``, which
  writes the other rows grid block by grid block. So no whole second copy
  of a table is ever made (a concatenation would leave its pieces in the
  allocator's heap: a table's size of resident memory for good).
  """

  def __init__(
    self, initializer: Initializer, full_shape: tuple[int, int], name: str
  ):
    self.initializer = initializer
    self.values = row_values(initializer, full_shape, name)
    self.called = False

  def __call__(
    self, shape: Shape, dtype: tf.DType = tf.float32, **kwargs: object
  ) -> tf.Tensor:
    del kwargs
    self.called = True
    return self.values.start(int(shape[0]), tf.as_dtype(dtype))

  def fill_in_place(self, variable: tf.Variable) -> None:
    """Writes the rows ``start`` left out (if this made the variable's
    value; a variable restored from a checkpoint is left alone)."""
    if self.called:
      self.values.fill(variable, 0)

  def __repr__(self) -> str:
    return f"RowWise({self.initializer!r})"
