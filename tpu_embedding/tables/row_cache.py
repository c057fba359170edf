"""Which rows of a disk-backed table sit in its RAM cache, and their files.

A ``RowCache`` keeps, on the host, the map from a table's rows to the
slots of a fixed number of cached rows (``TieredTable`` holds the slots'
values in ordinary variables, where the optimizers update them), and one
file per variable (parameters, each slot) holding every row that left the
cache. A step asks for its distinct rows (``admit``): the rows already
cached keep their slots; each other row takes the slot of the least
recently used row that this step and the one before it did not ask for,
whose values, if they changed since they were read, are written back to
its files first; the admitted rows' values are read from the files, or,
for a row never written, taken from its initial value (the same grid of
row blocks every layout fills from, ``initial_values.py``). Rows never
asked for are never written: the files are sparse.

The files are working state: a checkpoint holds the table; after a crash
the files are rebuilt from it (``TieredTable`` starts them empty).

Example:
  >>> import tempfile
  >>> import numpy as np
  >>> cache = RowCache(tempfile.mkdtemp(), rows=100, dim=2, slots=4,
  ...                  keys=("parameters",))
  >>> admitted = cache.admit(np.array([7, 9]))
  >>> admitted.slots.tolist(), admitted.load_rows.tolist()
  ([0, 1], [7, 9])
  >>> cache.admit(np.array([9])).load_rows.tolist()  # cached: nothing to load
  []
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np


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


class CacheTooSmallError(ValueError):
  """A step asks for more distinct rows than the cache may hold at once."""


class RowCache:
  """The host's map of cached rows, and the table's files.

  Args:
    directory: where the files go (one per key: ``<key>.rows``).
    rows: the table's rows.
    dim: its width.
    slots: rows the cache holds.
    keys: the variables (``parameters`` and the slots' names).
  """

  def __init__(
    self,
    directory: str,
    rows: int,
    dim: int,
    slots: int,
    keys: Sequence[str],
  ):
    self.rows, self.dim, self.size = rows, dim, slots
    self.keys = tuple(keys)
    self.slot_of_row = np.full(rows, -1, np.int32)
    self.row_of_slot = np.full(slots, -1, np.int64)
    self.last_use = np.full(slots, -1, np.int64)
    self.dirty = np.zeros(slots, bool)
    self.on_disk = np.zeros(rows, bool)
    self.step = 0
    self.hits = self.misses = self.reads = self.writes = 0
    self.files = {}
    for key in self.keys:
      path = os.path.join(directory, f"{key.replace('/', '_')}.rows")
      with open(path, "wb") as f:  # Sparse: no row written yet.
        f.truncate(rows * dim * 4)
      self.files[key] = np.memmap(path, np.float32, "r+", shape=(rows, dim))

  def admit(self, rows: np.ndarray) -> Admitted:
    """Gives every row of ``rows`` (distinct, in ``[0, rows)``) a slot.

    Raises:
      CacheTooSmallError: if the rows, with those of the step before,
        outnumber the slots.
    """
    rows = np.asarray(rows, np.int64)
    self.step += 1
    slots = self.slot_of_row[rows].astype(np.int64)
    missing = slots < 0
    self.hits += int(rows.size - missing.sum())
    self.misses += int(missing.sum())
    # Rows this step or the one before asked for stay (a pipelined update
    # of the step before lands after this lookup).
    self.last_use[slots[~missing]] = self.step
    need = int(missing.sum())
    free = np.flatnonzero(self.last_use < self.step - 1)
    if need > free.size:
      raise CacheTooSmallError(
        f"A step asks for {rows.size} distinct rows, {need} of them not "
        f"cached, but only {free.size} of the cache's {self.size} slots are "
        "free of this step's and the previous step's rows: give the cache "
        "at least twice the distinct rows of a step."
      )
    # The least recently used free slots (never used ones first).
    chosen = free[np.argsort(self.last_use[free], kind="stable")[:need]]
    old = self.row_of_slot[chosen]
    held = old >= 0
    write_back = held & self.dirty[chosen]
    self.slot_of_row[old[held]] = -1
    new_rows = rows[missing]
    self.slot_of_row[new_rows] = chosen
    self.row_of_slot[chosen] = new_rows
    self.last_use[chosen] = self.step
    self.dirty[chosen] = False
    slots[missing] = chosen
    return Admitted(
      slots,
      chosen[write_back],
      old[write_back],
      chosen,
      new_rows,
    )

  def slots_of(self, rows: np.ndarray) -> np.ndarray:
    """The slots of cached ``rows``, now marked changed (an update)."""
    slots = self.slot_of_row[np.asarray(rows, np.int64)].astype(np.int64)
    if (slots < 0).any():
      raise AssertionError("an update of rows its step did not look up")
    self.dirty[slots] = True
    return slots

  def write_back(self, rows: np.ndarray, values: Sequence[np.ndarray]) -> None:
    """Writes ``values`` (one array per key) of ``rows`` to the files."""
    if rows.size == 0:
      return
    for key, value in zip(self.keys, values, strict=True):
      self.write(key, rows, value)
    self.writes += int(rows.size)

  def write(self, key: str, rows: np.ndarray, value: np.ndarray) -> None:
    """Writes rows of one key; the rows count as stored once every key
    holds them (callers write them all)."""
    self.files[key][rows] = value
    self.on_disk[rows] = True

  def stored(self, rows: np.ndarray) -> np.ndarray:
    """Which of ``rows`` have values in the files."""
    return self.on_disk[np.asarray(rows, np.int64)]

  def read(self, key: str, rows: np.ndarray) -> np.ndarray:
    """The stored values of ``rows`` (each ``stored``)."""
    self.reads += int(rows.size)
    return np.asarray(self.files[key][np.asarray(rows, np.int64)])

  def changed_slots(self) -> tuple[np.ndarray, np.ndarray]:
    """``(slots, rows)`` whose values changed since they were read."""
    slots = np.flatnonzero(self.dirty)
    return slots, self.row_of_slot[slots]

  def mark_written(self, slots: np.ndarray) -> None:
    """Slots whose values the files now hold (a flush)."""
    self.dirty[slots] = False

  def forget(self) -> None:
    """Empties the cache (after a flush: the files hold every change)."""
    self.slot_of_row[:] = -1
    self.row_of_slot[:] = -1
    self.last_use[:] = -1
    self.dirty[:] = False
