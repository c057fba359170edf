"""How a table's rows are stored: float32, or 16 bits with float32 math.

A ``RowStorage`` (``TableConfig(..., storage=...)``) says the type a
table's parameters are kept in, and separately its optimizer slots':
``float32`` (TensorFlow's, the default), ``bfloat16`` or ``float16``.
Lookups, activations and gradients stay float32. Every update reads the
stored rows as float32, applies the optimizer's rule unchanged in float32,
and writes each value ``x`` back rounded to the stored type:

* ``rounding="nearest"``: round to nearest, ties to even (a cast);
* ``rounding="stochastic"``: to the neighbour ``hi`` above ``x`` with
  probability ``p = (x - lo) / (hi - lo)``, else to ``lo`` below it, so
  ``E[round(x)] = x`` and small updates are not lost. The draw is a
  function of ``(seed, variable, update count, row, column)``: runs repeat
  bit for bit, and a row gets the same draw whichever layout (one device,
  row blocks, a copy per replica) holds it.

The draw: ``u = bits >> 8`` of the 32-bit hash below, ``hi`` taken when
``u * 2**-24 < p``; for bfloat16 (float32's upper half) this is an
integer add to the float32's low 16 bits and a truncation.
``mix32`` is a 32-bit integer finaliser (xor-shift-multiply); with
``stream`` 0 for the parameters and ``i + 1`` for slot ``i``::

  h = mix32(seed ^ mix32(stream)); h = mix32(h ^ step)
  h = mix32(h ^ (row mod 2**32)); h = mix32(h ^ (row >> 32))
  bits = mix32(h ^ column)

A float16 value outside +-65504 is refused at the step that makes it,
naming the table (float16 has no larger finite value).

Example:
  >>> import tensorflow as tf
  >>> storage = RowStorage("bfloat16", rounding="nearest")
  >>> storage.parameter_dtype, storage.slot_dtype
  (tf.bfloat16, tf.float32)
  >>> x = tf.constant([[1.0 + 2**-10]])
  >>> storage.encode(x, key=0, rows=tf.constant([0], tf.int64),
  ...                step=tf.constant(0, tf.int64)).numpy().tolist()
  [[1.0]]
  >>> RowStorage("float64")
  Traceback (most recent call last):
  ...
  ValueError: RowStorage: dtype must be one of ['float32', 'bfloat16', ...
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

#: Stored types a table's parameters or slots may have.
DTYPES = ("float32", "bfloat16", "float16")

#: How a float32 result is rounded to a 16-bit stored type.
ROUNDINGS = ("stochastic", "nearest")

#: The largest finite float16.
FLOAT16_MAX = 65504.0

_MASK = 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class RowStorage:
  """The stored types of a table's parameters and slots, and the rounding.

  Attributes:
    dtype: the parameters' stored type: ``"float32"``, ``"bfloat16"`` or
      ``"float16"``.
    slots: the optimizer slots' stored type (the same choices); float32
      unless asked.
    rounding: ``"stochastic"`` (unbiased, the default) or ``"nearest"``.
    seed: the stochastic rounding's seed (an int).

  Raises:
    ValueError: for another type, rounding or a seed that is not an int.

  Example:
    >>> storage = RowStorage("float16", rounding="nearest")
    >>> storage.stored_dtype(0).size, storage.stored_dtype(1).size
    (2, 4)
    >>> RowStorage().is_float32
    True
  """

  dtype: str = "float32"
  slots: str = "float32"
  rounding: str = "stochastic"
  seed: int = 0

  def __post_init__(self) -> None:
    for field in ("dtype", "slots"):
      value = getattr(self, field)
      name = value.name if isinstance(value, tf.DType) else value
      if name not in DTYPES:
        raise ValueError(
          f"RowStorage: {field} must be one of {list(DTYPES)}. "
          f"Received: {value!r}"
        )
      object.__setattr__(self, field, name)
    if self.rounding not in ROUNDINGS:
      raise ValueError(
        f"RowStorage: rounding must be one of {list(ROUNDINGS)}. "
        f"Received: {self.rounding!r}"
      )
    if not isinstance(self.seed, int) or isinstance(self.seed, bool):
      raise ValueError(
        f"RowStorage: seed must be an int. Received: {self.seed!r}"
      )

  @property
  def parameter_dtype(self) -> tf.DType:
    """The parameters' stored ``tf.DType``."""
    return tf.as_dtype(self.dtype)

  @property
  def slot_dtype(self) -> tf.DType:
    """The slots' stored ``tf.DType``."""
    return tf.as_dtype(self.slots)

  @property
  def is_float32(self) -> bool:
    """Whether parameters and slots are both float32 (nothing to round)."""
    return self.dtype == self.slots == "float32"

  def stored_dtype(self, key: int) -> tf.DType:
    """The stored type of variable ``key``: 0 the parameters, ``i + 1``
    slot ``i``."""
    return self.parameter_dtype if key == 0 else self.slot_dtype

  def encode(
    self,
    values: tf.Tensor,
    *,
    key: int,
    rows: tf.Tensor,
    step: tf.Tensor,
    table: str = "",
  ) -> tf.Tensor:
    """``[n, dim]`` float32 ``values`` of global rows ``rows``, rounded to
    variable ``key``'s stored type at update ``step``.

    Raises:
      tf.errors.InvalidArgumentError: (when run) a float16 value beyond
        +-65504, naming ``table``.
    """
    dtype = self.stored_dtype(key)
    values = tf.convert_to_tensor(values, tf.float32)
    if dtype == tf.float32:
      return values
    if dtype == tf.float16:
      values = _checked_float16_range(values, table, key)
    if self.rounding == "nearest":
      return tf.cast(values, dtype)
    bits = random_bits(self.seed, key, step, rows, tf.shape(values)[-1])
    if dtype == tf.bfloat16:
      return _stochastic_bfloat16(values, bits)
    return _stochastic_float16(values, bits)


#: Tables as TensorFlow keeps them.
FLOAT32 = RowStorage()


def check_table(name: str, storage: RowStorage, optimizer: Any) -> None:
  """Refuses a storage ``optimizer`` (None: none yet) cannot train with.

  Raises:
    ValueError: naming table ``name``, for 16-bit slots of a rule that
      needs float32 ones (``Optimizer.SLOTS_IN_16_BITS``), or of slots a
      ``slot_variable_creation_fn`` makes.
  """
  if storage.slots == "float32" or optimizer is None:
    return
  if not optimizer.SLOT_NAMES:
    return
  rule = type(optimizer).__name__
  if optimizer.slot_variable_creation_fn is not None:
    raise ValueError(
      f"Table {name!r}: its {rule} slots are made by a "
      "slot_variable_creation_fn, in the types it gives; leave "
      "RowStorage.slots at 'float32'."
    )
  if storage.slots not in optimizer.SLOTS_IN_16_BITS:
    allowed = ["float32", *optimizer.SLOTS_IN_16_BITS]
    raise ValueError(
      f"Table {name!r}: {rule} slots cannot be stored as {storage.slots} "
      f"({optimizer.SLOTS_IN_16_BITS_WHY}); give RowStorage(slots=...) one "
      f"of {allowed}."
    )


def decode(values: tf.Tensor) -> tf.Tensor:
  """Stored rows as float32 (exact: every 16-bit value is a float32)."""
  return tf.cast(values, tf.float32) if values.dtype != tf.float32 else values


def _mix32(x: tf.Tensor) -> tf.Tensor:
  """A 32-bit integer finaliser (uint32 in, uint32 out, wrapping)."""
  x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))
  x = x * tf.constant(0x7FEB352D, tf.uint32)
  x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 15))
  x = x * tf.constant(0x846CA68B, tf.uint32)
  return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))


def _low32(x: tf.Tensor) -> tf.Tensor:
  return tf.cast(tf.bitwise.bitwise_and(x, _MASK), tf.uint32)


def random_bits(
  seed: int, stream: int, step: tf.Tensor, rows: tf.Tensor, dim: tf.Tensor
) -> tf.Tensor:
  """``[n, dim]`` uint32 draws of rows ``rows`` (int64) at ``step``.

  Example:
    >>> bits = random_bits(0, 0, tf.constant(3, tf.int64),
    ...                    tf.constant([5, 5], tf.int64), 2)
    >>> bool(bits[0, 0] == bits[1, 0]), bool(bits[0, 0] == bits[0, 1])
    (True, False)
  """
  xor = tf.bitwise.bitwise_xor
  rows = tf.cast(rows, tf.int64)
  h = _mix32(
    xor(
      tf.constant(seed & _MASK, tf.uint32),
      _mix32(tf.constant(stream, tf.uint32)),
    )
  )
  h = _mix32(xor(h, _low32(tf.cast(step, tf.int64))))
  h = _mix32(xor(h, _low32(rows)))
  h = _mix32(xor(h, _low32(tf.bitwise.right_shift(rows, 32))))
  columns = tf.cast(tf.range(dim), tf.uint32)
  return _mix32(xor(h[:, tf.newaxis], columns[tf.newaxis, :]))


def _stochastic_bfloat16(values: tf.Tensor, bits: tf.Tensor) -> tf.Tensor:
  """float32 -> bfloat16: add 16 random bits below the kept ones, truncate.

  With ``r = bits >> 16`` and ``low`` the float32's low 16 bits, ``hi`` is
  taken when ``r < low`` (positive: ``hi`` is away from zero, a carry of
  ``low + 0xFFFF - r``) or ``r < 2**16 - low`` (negative: ``hi`` is
  towards zero, no carry of ``low + r``): the draw the spec above gives.
  """
  word = tf.bitcast(values, tf.uint32)
  draw = tf.bitwise.right_shift(bits, 16)
  positive = tf.equal(tf.bitwise.right_shift(word, 31), 0)
  word = word + tf.where(positive, 0xFFFF - draw, draw)
  word = tf.bitwise.bitwise_and(word, tf.constant(0xFFFF0000, tf.uint32))
  return tf.cast(tf.bitcast(word, tf.float32), tf.bfloat16)  # exact


def _stochastic_float16(values: tf.Tensor, bits: tf.Tensor) -> tf.Tensor:
  """float32 -> float16: the neighbour above ``x`` with probability
  ``(x - lo) / (hi - lo)`` (all exact in float32)."""
  nearest = tf.cast(values, tf.float16)
  near = tf.cast(nearest, tf.float32)
  # The other neighbour: one step of the magnitude away from zero where
  # |x| lies beyond the nearest value, towards zero where it lies inside.
  magnitude = tf.bitwise.bitwise_and(
    tf.cast(tf.bitcast(nearest, tf.uint16), tf.int32), 0x7FFF
  )
  outward = tf.abs(values) > tf.abs(near)
  other_magnitude = magnitude + tf.where(outward, 1, -1)
  sign = tf.cast(
    tf.bitwise.right_shift(tf.bitcast(values, tf.uint32), 16), tf.int32
  )
  sign = tf.bitwise.bitwise_and(sign, 0x8000)
  other = tf.bitcast(
    tf.cast(tf.bitwise.bitwise_or(other_magnitude, sign), tf.uint16),
    tf.float16,
  )
  other_f = tf.cast(other, tf.float32)
  lo = tf.minimum(near, other_f)
  hi = tf.maximum(near, other_f)
  p = (values - lo) / (hi - lo)
  u = tf.cast(tf.bitwise.right_shift(bits, 8), tf.float32) * 2.0**-24
  rounded = tf.where(u < p, hi, lo)
  exact = tf.equal(near, values)
  return tf.cast(tf.where(exact, near, rounded), tf.float16)


def _checked_float16_range(
  values: tf.Tensor, table: str, key: int
) -> tf.Tensor:
  what = "parameters" if key == 0 else f"slot {key - 1}"
  # (NaN fails the comparison too.) The message alone, as the kernel's: no
  # condition or operand dump after it.
  check = tf.debugging.Assert(
    tf.reduce_max(tf.abs(values)) <= FLOAT16_MAX,
    [
      f"Table '{table}': a float16 {what} value exceeds 65504, the largest "
      "float16 (or is NaN); store it as bfloat16 or float32 (RowStorage)."
    ],
  )
  with tf.control_dependencies([check]):
    return tf.identity(values)
