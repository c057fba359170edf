"""A disk-tiered table's host map of cached rows, stepped in one call.

A table kept on disk (``tables/row_cache.py``) decides on the host, each
step, which of the step's rows its RAM cache holds and which slots the
others take. Done with numpy, that is dozens of small array calls per
table and step, all holding Python's GIL: with 26 tables they took most
of a step. With the kernel library, ``admit`` and ``mark_updated`` make
one call each (``admit_rows.cc``, through ctypes, which releases the GIL);
without it (``TPU_EMBEDDING_KERNELS=0``, no compiler at install) numpy
makes the same decisions, bit for bit.

The policy: the rows already cached keep their slots; each other row
takes a slot that neither this step nor the one before asked for, of a
window of slots ahead of a hand that sweeps the cache (``window`` times
the slots needed, at least ``min_window``; the whole cache if the window
holds too few): the empty slots first, then those whose rows were asked
for in fewest steps (before this one), then least recently (ties in the
window's order).
The counts of steps that asked for each row saturate at 255 and halve
once they grew by ``aging`` times the slots.

Example:
  >>> import numpy as np
  >>> cache = CacheMap.empty(rows=10, size=4)
  >>> admitted = admit(cache, np.array([7, 2]), 16, 4, 128)
  >>> admitted.slots.tolist(), admitted.load_rows.tolist()
  ([0, 1], [7, 2])
  >>> mark_updated(cache, np.zeros(2, np.uint8), np.array([2])).tolist()
  [1]
  >>> bool(cache.dirty[1]), int(cache.counters[STEP])
  (True, 1)
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from tpu_embedding import kernels
from tpu_embedding.kernels import library

#: ``CacheMap.counters``' entries.
STEP, HAND, COUNTED, HITS, MISSES = range(5)

#: The kernels' answer for a row outside the table.
OUT_OF_RANGE = -2


@dataclasses.dataclass(frozen=True)
class CacheMap:
  """Which rows of a table sit in which of its cache's slots.

  Attributes:
    slot_of_row: ``[rows]`` int32, each row's slot + 1 (0: not cached).
    row_of_slot: ``[size]`` int64, each slot's row (-1: empty).
    last_use: ``[size]`` int64, the last step that asked for its row.
    dirty: ``[size]`` bool, its row changed since it was read.
    frequency: ``[rows]`` uint8, steps that asked for each row.
    counters: ``[5]`` int64: the step, the hand, the counts added since
      the last halving, hits and misses (``STEP`` ... ``MISSES``).
  """

  slot_of_row: np.ndarray
  row_of_slot: np.ndarray
  last_use: np.ndarray
  dirty: np.ndarray
  frequency: np.ndarray
  counters: np.ndarray

  def __post_init__(self) -> None:
    """Checks the types and sizes ``admit_rows.cc`` reads them as."""
    rows, size = self.slot_of_row.size, self.row_of_slot.size
    want = {
      "slot_of_row": (np.int32, rows),
      "row_of_slot": (np.int64, size),
      "last_use": (np.int64, size),
      "dirty": (bool, size),
      "frequency": (np.uint8, rows),
      "counters": (np.int64, 5),
    }
    for name, (dtype, count) in want.items():
      array = getattr(self, name)
      if array.dtype != dtype or array.shape != (count,):
        raise ValueError(
          f"CacheMap.{name}: {array.dtype}{list(array.shape)}, expected "
          f"{np.dtype(dtype)}[{count}]"
        )

  @classmethod
  def empty(cls, rows: int, size: int) -> CacheMap:
    """No row cached (the per-row arrays are zeros: pages of rows never
    asked for take no memory)."""
    return cls(
      np.zeros(rows, np.int32),
      np.full(size, -1, np.int64),
      np.full(size, -1, np.int64),
      np.zeros(size, bool),
      np.zeros(rows, np.uint8),
      np.zeros(5, np.int64),
    )

  @property
  def size(self) -> int:
    return int(self.row_of_slot.size)


@dataclasses.dataclass(frozen=True)
class Admitted:
  """What one ``admit`` decided.

  Attributes:
    slots: ``[n]`` int64, the slot of each asked row, in order.
    evicted_slots: slots whose rows leave the cache and must be written
      back first (their values changed since they were read).
    evicted_rows: the rows those slots held.
    load_slots: slots given to rows not cached.
    load_rows: those rows, whose values are read into ``load_slots``.
  """

  slots: np.ndarray
  evicted_slots: np.ndarray
  evicted_rows: np.ndarray
  load_slots: np.ndarray
  load_rows: np.ndarray


def admit(
  cache: CacheMap, rows: np.ndarray, window: int, min_window: int, aging: int
) -> Admitted | None:
  """Gives every row of ``rows`` (distinct) a slot; None, with ``cache``
  unchanged, if fewer slots are free of this step's and the previous
  step's rows than the rows not cached.

  Raises:
    IndexError: a row outside the table (nothing changed).
  """
  rows = np.ascontiguousarray(rows, np.int64)
  kernel = _kernels()
  if kernel is None:
    _check_range(cache, rows)
    return _admit_with_numpy(cache, rows, window, min_window, aging)
  n = rows.size
  slots = np.empty(n, np.int64)
  chosen, old = np.empty(n, np.int64), np.empty(n, np.int64)
  write_back = np.zeros(n, bool)
  need = np.zeros(1, np.int64)
  failed = kernel[0](
    cache.slot_of_row.size,
    cache.size,
    *_pointers(cache.slot_of_row, cache.row_of_slot, cache.last_use),
    *_pointers(cache.dirty, cache.frequency, cache.counters),
    n,
    *_pointers(rows),
    window,
    min_window,
    aging,
    *_pointers(slots, chosen, old, write_back, need),
  )
  if failed == OUT_OF_RANGE:
    _check_range(cache, rows)
  if failed:
    return None
  k = int(need[0])
  chosen, old, write_back = chosen[:k], old[:k], write_back[:k]
  new_rows = cache.row_of_slot[chosen]  # (in the order of ``rows``)
  return Admitted(slots, chosen[write_back], old[write_back], chosen, new_rows)


def mark_updated(
  cache: CacheMap, changed: np.ndarray, rows: np.ndarray
) -> np.ndarray | None:
  """The slots of ``rows`` (cached; repeats allowed), now marked dirty,
  and the rows' bits of ``changed`` (``[ceil(rows / 8)]`` uint8) set;
  None, with nothing changed, if a row is not cached.

  Raises:
    IndexError: a row outside the table (nothing changed).
  """
  rows = np.ascontiguousarray(rows, np.int64)
  if changed.dtype != np.uint8 or changed.size * 8 < cache.slot_of_row.size:
    raise ValueError("admit_rows: changed must be uint8, a bit per row")
  kernel = _kernels()
  if kernel is None:
    _check_range(cache, rows)
    return _mark_with_numpy(cache, changed, rows)
  slots = np.empty(rows.size, np.int64)
  failed = kernel[1](
    cache.slot_of_row.size,
    *_pointers(cache.slot_of_row, cache.dirty, changed),
    rows.size,
    *_pointers(rows, slots),
  )
  if failed == OUT_OF_RANGE:
    _check_range(cache, rows)
  return None if failed else slots


def _check_range(cache: CacheMap, rows: np.ndarray) -> None:
  """Raises ``IndexError`` for a row outside the table."""
  outside = rows[(rows < 0) | (rows >= cache.slot_of_row.size)]
  if outside.size:
    raise IndexError(
      f"row {int(outside[0])} is outside the table's "
      f"{cache.slot_of_row.size} rows"
    )


# --- numpy: the same decisions ---------------------------------------------


def _admit_with_numpy(
  cache: CacheMap, rows: np.ndarray, window: int, min_window: int, aging: int
) -> Admitted | None:
  counters, last_use = cache.counters, cache.last_use
  step = int(counters[STEP]) + 1
  slots = cache.slot_of_row[rows].astype(np.int64) - 1
  missing = slots < 0
  need = int(missing.sum())
  used = slots[~missing]
  before = last_use[used]
  last_use[used] = step
  hand = int(counters[HAND])
  chosen = np.zeros(0, np.int64)
  if need:
    size = cache.size
    span = min(size, max(min_window, window * need))
    ahead = (hand + np.arange(span)) % size
    idle = ahead[last_use[ahead] < step - 1]
    if idle.size < need:
      idle = np.flatnonzero(last_use < step - 1)
    if idle.size < need:
      last_use[used] = before
      return None
    hand = (hand + span) % size
    held = cache.row_of_slot[idle]
    counts = cache.frequency[np.maximum(held, 0)].astype(np.int64)
    score = np.where(held >= 0, (counts << 40) | last_use[idle], -1)
    chosen = idle[np.argsort(score, kind="stable")[:need]].astype(np.int64)
  counts = cache.frequency[rows]
  cache.frequency[rows] = counts + (counts < 255)
  counted = int(counters[COUNTED]) + rows.size
  if counted >= aging * cache.size:
    asked = np.flatnonzero(cache.frequency)  # (zero pages untouched)
    cache.frequency[asked] >>= 1
    counted = 0
  old = cache.row_of_slot[chosen]
  held = old >= 0
  write_back = held & cache.dirty[chosen]
  cache.slot_of_row[old[held]] = 0
  new_rows = rows[missing]
  cache.slot_of_row[new_rows] = chosen + 1
  cache.row_of_slot[chosen] = new_rows
  last_use[chosen] = step
  cache.dirty[chosen] = False
  slots[missing] = chosen
  counters[:] = [step, hand, counted, counters[HITS] + rows.size - need,
                 counters[MISSES] + need]  # fmt: skip
  return Admitted(slots, chosen[write_back], old[write_back], chosen, new_rows)


def _mark_with_numpy(
  cache: CacheMap, changed: np.ndarray, rows: np.ndarray
) -> np.ndarray | None:
  slots: np.ndarray = cache.slot_of_row[rows].astype(np.int64) - 1
  if (slots < 0).any():
    return None
  cache.dirty[slots] = True
  bits = np.left_shift(1, rows & 7).astype(np.uint8)
  np.bitwise_or.at(changed, rows >> 3, bits)
  return slots


# --- the kernels -----------------------------------------------------------


@functools.cache
def _kernels() -> tuple[Callable[..., int], Callable[..., int]] | None:
  """``TpeAdmitRows`` and ``TpeMarkUpdated`` of the loaded kernel
  library, or None."""
  if kernels.load() is None:
    return None
  found = ctypes.CDLL(library.choose().path)
  admit_rows = getattr(found, "TpeAdmitRows", None)
  mark = getattr(found, "TpeMarkUpdated", None)
  if admit_rows is None or mark is None:  # (a library built before them)
    return None
  pointer, size = ctypes.c_void_p, ctypes.c_int64
  admit_rows.argtypes = [size, size, *[pointer] * 6, size, pointer,
                         size, size, size, *[pointer] * 5]  # fmt: skip
  admit_rows.restype = ctypes.c_int
  mark.argtypes = [size, *[pointer] * 3, size, pointer, pointer]
  mark.restype = ctypes.c_int
  return admit_rows, mark


def _pointers(*arrays: np.ndarray) -> list[int]:
  """Each array's data address (contiguous: ``CacheMap`` checked the
  types; an int costs half a ``c_void_p``, 26 tables a step)."""
  for array in arrays:
    if not array.flags.c_contiguous:
      raise ValueError("admit_rows: arrays must be contiguous")
  return [array.ctypes.data for array in arrays]
