"""Serving tables in a smaller type: float16, bfloat16 and row-wise int8.

``export_for_serving(..., table_dtype=...)`` stores each exported table in
one of ``TABLE_DTYPES`` and dequantizes, with TensorFlow ops only, the rows
a request looks up (gather first, then cast or ``q * scale + offset``):
the combiners then act on float32 rows exactly as in a float32 export.

==============  ==================================  =======================
``table_dtype`` stored per row of ``dim`` values     error per element
==============  ==================================  =======================
``float32``     ``dim`` float32 (4 bytes each)       none
``float16``     ``dim`` float16 (2 bytes)            ``|x| * 2**-11`` (and
                                                     ``2**-25`` below
                                                     ``2**-14``)
``bfloat16``    ``dim`` bfloat16 (2 bytes)           ``|x| * 2**-8``
``int8``        ``dim`` int8, float32 ``scale``     ``(max - min) / 510``
                and ``offset`` (``dim + 8`` bytes)  (of the row)
==============  ==================================  =======================

The 16-bit types round to nearest (float16 holds ``|x| <= 65504``; a
table with larger values is refused). ``int8`` quantizes each row affinely
on its own range, as a fused table-batched embedding stores its rows:
``scale = (max - min) / 255``, ``q = round((x - min) / scale) - 128`` and
``offset = min + 128 * scale``, so that ``x ~ q * scale + offset`` within
half a step (a constant row is exact). A looked-up activation is then
within the combiner-weighted sum of its rows' bounds: ``sum_i |w_i| b_i``
for ``sum``, divided by ``|sum_i w_i|`` for ``mean`` and by
``sqrt(sum_i w_i**2)`` for ``sqrtn`` (float32 arithmetic adds its own
rounding, ~1e-7 relative). The bytes of the tables are 1/2 (16-bit) and
``(dim + 8) / (4 * dim)`` (int8: 0.375 at dim 16, 0.28 at 64) of float32.

``quantize_rows`` is row-wise, so any subset of rows (e.g. the rows a
delta changes) is quantized exactly as the whole table would be (called
eagerly; in a ``tf.function`` the scale may differ by a float32 ulp).

Example:
  >>> import numpy as np
  >>> import tensorflow as tf
  >>> from tpu_embedding.export import quantize
  >>> table = quantize.QuantizedTable(
  ...     tf.constant([[0.0, 1.0, 2.0], [5.0, 5.0, 5.0]]), "int8", "t")
  >>> table.values.dtype.name, table.scale.shape.as_list()
  ('int8', [2, 1])
  >>> np.round(table.gather(tf.constant([1, 0])).numpy(), 2)
  array([[5., 5., 5.],
         [0., 1., 2.]], dtype=float32)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tpu_embedding import compat

#: The types a serving table may be stored in (``float32``: as trained).
TABLE_DTYPES = ("float32", "float16", "bfloat16", "int8")

#: The largest finite float16.
FLOAT16_MAX = 65504.0

_STORAGE = {
  "float16": tf.float16,
  "bfloat16": tf.bfloat16,
  "int8": tf.int8,
}


def check_table_dtype(table_dtype: object) -> str:
  """``table_dtype`` as one of ``TABLE_DTYPES`` (a ``tf.DType`` is named).

  Raises:
    ValueError: for any other value (one line: given and allowed).

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding.export.quantize import check_table_dtype
    >>> check_table_dtype(tf.bfloat16)
    'bfloat16'
    >>> check_table_dtype("int4")
    Traceback (most recent call last):
    ...
    ValueError: Unknown table_dtype 'int4': expected one of 'float32', \
'float16', 'bfloat16', 'int8'.
  """
  name = table_dtype.name if isinstance(table_dtype, tf.DType) else table_dtype
  if not isinstance(name, str) or name not in TABLE_DTYPES:
    allowed = ", ".join(repr(t) for t in TABLE_DTYPES)
    raise ValueError(
      f"Unknown table_dtype {table_dtype!r}: expected one of {allowed}."
    )
  return name


class QuantizedRows(NamedTuple):
  """Rows in a storage type, with int8's per-row affine parameters.

  Attributes:
    values: ``[n, dim]`` in the storage type.
    scale: ``[n, 1]`` float32 (int8), else None.
    offset: ``[n, 1]`` float32 (int8), else None.

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding.export.quantize import QuantizedRows
    >>> QuantizedRows(tf.constant([[1.0]], tf.float16)).scale is None
    True
  """

  values: tf.Tensor
  scale: tf.Tensor | None = None
  offset: tf.Tensor | None = None


def quantize_rows(
  rows: tf.Tensor, table_dtype: str, table: str = "table"
) -> QuantizedRows:
  """Quantizes float32 ``rows`` ``[n, dim]``, each row on its own.

  Args:
    rows: ``[n, dim]`` float32 rows (a whole table or some of its rows).
    table_dtype: ``float16``, ``bfloat16`` or ``int8``.
    table: the table's name, for errors.

  Returns:
    ``QuantizedRows`` (see the module docstring for the formulas).

  Raises:
    ValueError: for another ``table_dtype``, rows that are not finite, or
      float16 rows beyond ``FLOAT16_MAX`` (values checked when called
      eagerly; inside a ``tf.function`` they are not).

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding.export.quantize import quantize_rows
    >>> q = quantize_rows(tf.constant([[-1.0, 0.5, 1.0]]), "int8")
    >>> q.values.numpy().tolist(), f"{float(q.scale[0, 0]) * 255:.4f}"
    ([[-128, 63, 127]], '2.0000')
  """
  dtype = check_table_dtype(table_dtype)
  if dtype == "float32":
    raise ValueError("quantize_rows: float32 rows are stored as they are.")
  rows = tf.convert_to_tensor(rows, tf.float32)
  if tf.executing_eagerly():  # in a tf.function: unchecked
    _check_values(rows, dtype, table)
  if dtype != "int8":
    return QuantizedRows(tf.cast(rows, _STORAGE[dtype]))
  low = tf.reduce_min(rows, axis=1, keepdims=True)
  high = tf.reduce_max(rows, axis=1, keepdims=True)
  scale = (high - low) / 255.0
  inverse = tf.math.divide_no_nan(tf.ones_like(scale), scale)
  steps = tf.clip_by_value(tf.round((rows - low) * inverse), 0.0, 255.0)
  values = tf.cast(steps - 128.0, tf.int8)
  return QuantizedRows(values, scale, low + 128.0 * scale)


def _check_values(rows: tf.Tensor, dtype: str, table: str) -> None:
  """Refuses rows the type cannot hold (eagerly)."""
  largest = float(tf.reduce_max(tf.abs(rows))) if tf.size(rows) else 0.0
  if not np.isfinite(largest):
    raise ValueError(
      f"Table {table!r} holds non-finite values (inf or nan): it cannot be "
      f"exported as {dtype}."
    )
  if dtype == "float16" and largest > FLOAT16_MAX:
    raise ValueError(
      f"Table {table!r} has values up to {largest:g}, beyond float16's "
      f"range ({FLOAT16_MAX:g}): export it as bfloat16 or int8."
    )


def dequantize_rows(rows: QuantizedRows) -> tf.Tensor:
  """float32 rows of ``QuantizedRows`` (cast, or ``q * scale + offset``).

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding.export import quantize
    >>> rows = quantize.quantize_rows(tf.constant([[1.5, -2.0]]), "bfloat16")
    >>> quantize.dequantize_rows(rows).numpy().tolist()
    [[1.5, -2.0]]
  """
  values = tf.cast(rows.values, tf.float32)
  if rows.scale is None:
    return values
  return values * rows.scale + rows.offset


class QuantizedTable(tf.Module):
  """A serving table stored in a smaller type, dequantized per lookup.

  Its variables (``values``, and for int8 ``scale`` and ``offset``) are
  what the SavedModel holds; ``gather`` reads the requested rows only,
  then dequantizes them.

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding.export.quantize import QuantizedTable
    >>> table = QuantizedTable(tf.fill([4, 2], 0.1), "float16", "t")
    >>> table.values.dtype.name, table.gather(tf.constant([3])).shape
    ('float16', TensorShape([1, 2]))
  """

  def __init__(
    self, table: tf.Tensor | QuantizedRows, table_dtype: str, name: str
  ):
    """Quantizes ``table`` into new non-trainable CPU variables.

    Args:
      table: the ``[rows, dim]`` float32 table, or ``QuantizedRows`` of
        the variables to hold (kept as they are: ``export/streamed.py``
        writes their values into the SavedModel later).
      table_dtype: ``float16``, ``bfloat16`` or ``int8``.
      name: the table's name (its variables are ``<name>/values`` ...).

    Raises:
      ValueError: as ``quantize_rows``.
    """
    super().__init__(name=None)
    self.table_dtype = check_table_dtype(table_dtype)
    if isinstance(table, QuantizedRows):
      self.values, self.scale, self.offset = table
      return
    with tf.init_scope(), tf.device("/CPU:0"):
      rows = quantize_rows(table, self.table_dtype, name)

      def variable(value: tf.Tensor, part: str) -> tf.Variable:
        return compat.ResourceVariable(
          value, name=f"{name}/{part}", trainable=False
        )

      self.values = variable(rows.values, "values")
      self.scale = None if rows.scale is None else variable(rows.scale, "scale")
      self.offset = (
        None if rows.offset is None else variable(rows.offset, "offset")
      )

  @property
  def shape(self) -> tf.TensorShape:
    """``[rows, dim]``."""
    return self.values.shape

  def gather(self, ids: tf.Tensor) -> tf.Tensor:
    """The float32 rows ``ids`` (any shape): gathered, then dequantized."""
    values = tf.gather(self.values, ids)
    if self.scale is None:
      return tf.cast(values, tf.float32)
    return dequantize_rows(
      QuantizedRows(
        values, tf.gather(self.scale, ids), tf.gather(self.offset, ids)
      )
    )


def serving_table(
  table: tf.Tensor, table_dtype: str, name: str
) -> tf.Variable | QuantizedTable:
  """The table as a SavedModel holds it: a plain float32 variable, or a
  ``QuantizedTable``.

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding.export.quantize import serving_table
    >>> type(serving_table(tf.zeros([3, 2]), "int8", "t")).__name__
    'QuantizedTable'
  """
  if check_table_dtype(table_dtype) != "float32":
    return QuantizedTable(table, table_dtype, name)
  with tf.init_scope(), tf.device("/CPU:0"):
    return compat.ResourceVariable(table, name=name, trainable=False)


def table_variables(table: tf.Variable | QuantizedTable) -> list[tf.Variable]:
  """The variables a ``serving_table`` is held in."""
  if isinstance(table, QuantizedTable):
    return list(table.variables)
  return [table]
