"""Independent numpy oracle of 16-bit row storage's rounding.

Written from the specification of ``RowStorage``'s rounding (the hash
``mix32`` and the draw, "the neighbour above ``x`` with probability
``p = (x - lo) / (hi - lo)``"), independently of the package's
TensorFlow code, so that tests can compare the two bit for bit.

The two neighbours of a value come from a sorted table of every finite
value of the 16-bit type (built from the type's bit patterns), not from
bit tricks on float32 words: the oracle takes the definition literally.
All its arithmetic is exact (float64, Python or 64-bit integers).
"""

from __future__ import annotations

import functools

import numpy as np

_MASK32 = 0xFFFFFFFF

#: The largest finite float16.
FLOAT16_MAX = 65504.0


def mix32(x) -> np.ndarray:
  """The 32-bit finaliser on uint32 values (wrapping), as ``uint32``."""
  x = np.asarray(x, dtype=np.uint64) & _MASK32
  x = x ^ (x >> np.uint64(16))
  x = (x * np.uint64(0x7FEB352D)) & np.uint64(_MASK32)
  x = x ^ (x >> np.uint64(15))
  x = (x * np.uint64(0x846CA68B)) & np.uint64(_MASK32)
  x = x ^ (x >> np.uint64(16))
  return x.astype(np.uint32)


def random_bits(
  seed: int, stream: int, step: int, rows, dim: int
) -> np.ndarray:
  """``[n, dim]`` uint32 draws of global rows ``rows`` (ints >= 0).

  ``h = mix32(seed ^ mix32(stream)); h = mix32(h ^ step);
  h = mix32(h ^ (row mod 2**32)); h = mix32(h ^ (row >> 32));
  bits = mix32(h ^ column)``, ``seed`` and ``step`` taken mod 2**32.
  """
  rows = [int(r) for r in np.asarray(rows).reshape(-1)]
  if any(r < 0 for r in rows):
    raise ValueError("rows must be >= 0")
  u64 = np.uint64
  h = mix32(u64(int(seed) % 2**32) ^ u64(mix32(int(stream))))
  h = mix32(u64(h) ^ u64(int(step) % 2**32))
  low = np.array([r % 2**32 for r in rows], dtype=np.uint64)
  high = np.array([r >> 32 for r in rows], dtype=np.uint64)
  h = mix32(np.full(len(rows), h, dtype=np.uint64) ^ low)
  h = mix32(h.astype(np.uint64) ^ high)
  columns = np.arange(dim, dtype=np.uint64)
  return mix32(h.astype(np.uint64)[:, None] ^ columns[None, :])


@functools.cache
def _grid(dtype_name: str) -> tuple[np.ndarray, np.ndarray]:
  """Every finite value of the 16-bit type, ascending (one zero, +0.0),
  as float64, and each value's 16-bit pattern."""
  patterns = np.arange(2**16, dtype=np.uint32)
  if dtype_name == "bfloat16":
    # bfloat16 is by definition float32's upper 16 bits.
    words = patterns << np.uint32(16)
    with np.errstate(invalid="ignore"):  # the NaN patterns
      values = words.view(np.float32).astype(np.float64)
  elif dtype_name == "float16":
    values = patterns.astype(np.uint16).view(np.float16).astype(np.float64)
  else:
    raise ValueError(f"not a 16-bit type: {dtype_name!r}")
  keep = np.isfinite(values) & ~((values == 0) & np.signbit(values))
  values, patterns = values[keep], patterns[keep]
  order = np.argsort(values, kind="stable")
  values, patterns = values[order], patterns[order]
  assert np.all(np.diff(values) > 0)
  return values, patterns


def type_values(dtype_name: str) -> np.ndarray:
  """Every finite value of ``dtype_name`` (one zero), ascending, float64."""
  return _grid(dtype_name)[0].copy()


def _check(x: np.ndarray, dtype_name: str) -> np.ndarray:
  x = np.asarray(x, dtype=np.float32)
  if not np.all(np.isfinite(x)):
    raise ValueError("the oracle takes finite values only")
  if dtype_name == "float16" and np.any(np.abs(x) > FLOAT16_MAX):
    raise ValueError("a float16 value beyond +-65504")
  return x


def neighbours(x, dtype_name: str):
  """``(exact, lo, hi)`` of float32 ``x``: whether ``x`` is a value of the
  type, else the type's values ``lo < x < hi`` around it (float64)."""
  x = _check(x, dtype_name)
  values, _ = _grid(dtype_name)
  x64 = x.astype(np.float64)
  index = np.searchsorted(values, x64, side="left")
  inside = index < len(values)
  exact = np.zeros(x.shape, dtype=bool)
  exact[inside] = values[index[inside]] == x64[inside]
  if np.any(~exact & ((index == 0) | ~inside)):
    raise ValueError("a value beyond the type's finite range")
  lo = np.where(exact, x64, values[np.maximum(index - 1, 0)])
  hi = np.where(exact, x64, values[np.minimum(index, len(values) - 1)])
  return exact, lo, hi


def _signed(result: np.ndarray, x: np.ndarray) -> np.ndarray:
  # Rounding never crosses zero; a zero result keeps x's sign (-0.0 stays
  # -0.0, a tiny negative value rounded to zero is -0.0).
  return np.copysign(result, x.astype(np.float64))


def stochastic_round(x, bits, dtype_name: str) -> np.ndarray:
  """float32 ``x`` ``[n, dim]`` rounded stochastically to ``dtype_name``
  with uint32 ``bits`` ``[n, dim]``, as float64 values.

  ``x`` itself where it is a value of the type; else ``hi`` where
  ``(bits >> 8) * 2**-24 < (x - lo) / (hi - lo)``, else ``lo``.
  """
  x = _check(x, dtype_name)
  bits = np.asarray(bits, dtype=np.uint32)
  if bits.shape != x.shape:
    raise ValueError(f"bits {bits.shape} and values {x.shape} differ")
  exact, lo, hi = neighbours(x, dtype_name)
  x64 = x.astype(np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    p = np.where(exact, 0.0, (x64 - lo) / (hi - lo))  # exact in float64
  u = (bits >> np.uint32(8)).astype(np.float64) * 2.0**-24
  result = np.where(exact, x64, np.where(u < p, hi, lo))
  return _signed(result, x)


def nearest_round(x, dtype_name: str) -> np.ndarray:
  """float32 ``x`` rounded to the nearest value of ``dtype_name``, ties to
  the even bit pattern (IEEE round to nearest even), as float64."""
  x = _check(x, dtype_name)
  exact, lo, hi = neighbours(x, dtype_name)
  values, patterns = _grid(dtype_name)
  x64 = x.astype(np.float64)
  below, above = x64 - lo, hi - x64
  lo_even = patterns[np.searchsorted(values, lo)] % 2 == 0
  choose_hi = (above < below) | ((above == below) & ~lo_even)
  result = np.where(exact, x64, np.where(choose_hi, hi, lo))
  return _signed(result, x)


def rounded_table(values, storage, stream: int, step: int) -> np.ndarray:
  """A whole ``[rows, dim]`` table of float32 ``values`` (its row ids
  0..rows-1) rounded as ``storage`` (a ``RowStorage``: its ``dtype`` for
  stream 0, the parameters; ``slots`` for the others) stores variable
  ``stream`` at update ``step``; float64 values."""
  dtype = storage.dtype if stream == 0 else storage.slots
  values = np.asarray(values).astype(np.float32)
  if dtype == "float32":
    return values.astype(np.float64)
  if storage.rounding == "nearest":
    return nearest_round(values, dtype)
  rows = np.arange(values.shape[0], dtype=np.int64)
  bits = random_bits(storage.seed, stream, step, rows, values.shape[1])
  return stochastic_round(values, bits, dtype)
