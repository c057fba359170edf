"""Which rows of a disk-tiered table sit in its RAM cache, and the rest.

A ``RowCache`` keeps, on the host, the map from a table's rows to the
slots of a fixed number of cached rows (``TieredTable`` holds the slots'
values in ordinary variables, where the optimizers update them) and the
table's file (``row_files.RowFiles``), which holds every row that left
the cache. A step asks for its distinct rows (``admit``): the rows
already cached keep their slots; each other row takes a slot that neither
this step nor the one before asked for: of a window of slots ahead of a
hand sweeping the cache (``WINDOW`` times the slots needed, at least
``MIN_WINDOW``), those whose rows were asked for least often (ties: least
recently). Each row's count of steps that asked for it (one byte a row,
halved once the counts grew by ``AGING`` times the slots) outlives its
stay in the cache, so a hot row evicted by chance comes back with its
count, and rows asked for once leave first: with ids drawn from a fixed
distribution the cache comes to hold the most probable rows, as an ideal
cache of its size would (``kernels/admit_rows.py`` decides, in one call
a step). An evicted row whose values changed since they were read is
written back to the file, in the background (on one thread every
table shares, ``file_threads``).
Every update marks its rows changed, one bit per row of the table, until
a save clears them (``changed_rows``: what a delta checkpoint holds).

The files start sparse. A row's initial value comes from the same grid of
row blocks every layout fills from (``initial_values.py``): when a row of
a grid block is first read, the block's initial values are written to
the file (all variables), so grid blocks no step asked for are never
written.

A coming step's rows can be read early (``prefetch``, from any thread,
any time): those not cached are read from the file in the background
into RAM (``row_staging.RowStaging``) while the current step runs, so
that the step's ``load`` takes them from there. The map, the file and
every number stay as they are: a row written to the file after it was
read ahead is read again.

Example:
  >>> import tempfile
  >>> import numpy as np
  >>> zeros = lambda key, first, count: np.zeros([count, 2], "f4")
  >>> cache = RowCache(tempfile.mkdtemp(), rows=100, dim=2, slots=4,
  ...                  keys=("parameters",), grid=10, initial=zeros)
  >>> admitted = cache.admit(np.array([7, 9]))
  >>> admitted.slots.tolist(), admitted.load_rows.tolist()
  ([0, 1], [7, 9])
  >>> cache.admit(np.array([9])).load_rows.tolist()  # cached: nothing to load
  []
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import operator
from collections.abc import Callable
from collections.abc import Sequence

import numpy as np

from tpu_embedding.kernels import admit_rows
from tpu_embedding.kernels.admit_rows import Admitted
from tpu_embedding.tables import file_threads
from tpu_embedding.tables.row_files import RowFiles
from tpu_embedding.tables.row_staging import RowStaging

#: Steps between requests to drop the file's clean pages from the page
#: cache (the cache of rows is the table's memory, not the kernel's; the
#: pages read and written are dropped as they go, this drops the rest).
DROP_EVERY = 8

#: Slots an eviction chooses from, per slot it needs (and at least
#: ``MIN_WINDOW``): the least often asked rows of the window leave.
WINDOW = 16
MIN_WINDOW = 4096

#: The rows' counts are halved once they grew by this many times the
#: slots (recent steps weigh more than old ones).
AGING = 128

#: Write-backs of a table in flight at once (a step waits beyond).
IN_FLIGHT = 4

#: A write-back: its number in ``RowStaging``, its end.
_WriteBack = tuple[int, concurrent.futures.Future[None]]

#: ``initial(key, first, count)``: rows ``[first, first + count)`` of a
#: variable's initial value (within one grid block).
InitialRows = Callable[[str, int, int], np.ndarray]


@dataclasses.dataclass(frozen=True)
class CacheCounts:
  """What disk-tier caches counted: rows asked for that were cached
  (``hits``) or not (``misses``), rows read from and written to the files,
  and of the rows read those a step took from RAM, read ahead while the
  step before ran (``rows_read_ahead``: ``data.prefetch_rows``).

  Counts add up (``a + b``), and subtract (the counts of an interval).

  Example:
    >>> counts = CacheCounts(hits=90, misses=10, rows_read=10)
    >>> round((counts + counts).hit_rate, 2), (counts - counts).misses
    (0.9, 0)
  """

  hits: int = 0
  misses: int = 0
  rows_read: int = 0
  rows_written: int = 0
  rows_read_ahead: int = 0

  @property
  def hit_rate(self) -> float:
    """Hits over lookups of distinct rows per step (0 without lookups)."""
    return self.hits / max(self.hits + self.misses, 1)

  @property
  def read_ahead_rate(self) -> float:
    """Rows read ahead over rows read (0 without reads)."""
    return self.rows_read_ahead / max(self.rows_read, 1)

  def __add__(self, other: CacheCounts) -> CacheCounts:
    return CacheCounts(
      *map(operator.add, dataclasses.astuple(self), dataclasses.astuple(other))
    )

  def __sub__(self, other: CacheCounts) -> CacheCounts:
    return CacheCounts(
      *map(operator.sub, dataclasses.astuple(self), dataclasses.astuple(other))
    )


def _writer() -> concurrent.futures.ThreadPoolExecutor:
  """The thread that writes every table's rows back, in order."""
  return file_threads.pool("row-writes", 1)


class CacheTooSmallError(ValueError):
  """A step asks for more distinct rows than the cache may hold at once."""


class RowCache:
  """The host's map of cached rows, and the table's files.

  Args:
    directory: where the files go.
    rows: the table's rows.
    dim: its width.
    slots: rows the cache holds.
    keys: the variables (``parameters`` and the slots' names).
    grid: rows of a grid block of initial values.
    initial: a grid block's initial values (``InitialRows``).
    owner: ``(table, DiskTier directory)`` its errors name
      (``RowFiles``).
  """

  def __init__(
    self,
    directory: str,
    rows: int,
    dim: int,
    slots: int,
    keys: Sequence[str],
    grid: int,
    initial: InitialRows,
    owner: tuple[str, str] | None = None,
  ):
    self.rows, self.dim, self.size = rows, dim, slots
    self.keys = tuple(keys)
    self.files = RowFiles(directory, rows, dim, self.keys, owner)
    # Write-backs run beside the steps (those in flight), page cache drops
    # with them, on the thread every table shares (in the order asked).
    self._dropped: concurrent.futures.Future[None] | None = None
    self._in_flight: list[_WriteBack] = []
    self._grid, self._initial = grid, initial
    # Rows of coming steps read ahead (prefetch).
    self.staging = RowStaging(self.files)
    self._written = np.zeros(-(-rows // grid), bool)  # grid blocks on disk
    # Which row each slot holds, and what the policy counts.
    self.slot_map = admit_rows.CacheMap.empty(rows, slots)
    # One bit per row: updated since the last save (delta checkpoints).
    self._changed = np.zeros(-(-rows // 8), np.uint8)
    self.reads = self.writes = 0

  @property
  def _slot_of_row(self) -> np.ndarray:
    return self.slot_map.slot_of_row

  @property
  def row_of_slot(self) -> np.ndarray:
    return self.slot_map.row_of_slot

  @property
  def last_use(self) -> np.ndarray:
    return self.slot_map.last_use

  @property
  def dirty(self) -> np.ndarray:
    return self.slot_map.dirty

  @property
  def frequency(self) -> np.ndarray:
    return self.slot_map.frequency

  @property
  def step(self) -> int:
    return int(self.slot_map.counters[admit_rows.STEP])

  @property
  def hits(self) -> int:
    return int(self.slot_map.counters[admit_rows.HITS])

  @property
  def misses(self) -> int:
    return int(self.slot_map.counters[admit_rows.MISSES])

  @property
  def _hand(self) -> int:
    return int(self.slot_map.counters[admit_rows.HAND])

  def counts(self) -> CacheCounts:
    """Its lookups' hits and misses, rows read and written, so far."""
    return CacheCounts(
      self.hits, self.misses, self.reads, self.writes, self.staging.taken
    )

  # --- a step ---------------------------------------------------------------

  def admit(self, rows: np.ndarray) -> Admitted:
    """Gives every row of ``rows`` (distinct, in ``[0, rows)``) a slot
    (``kernels/admit_rows.py``: the policy).

    Raises:
      CacheTooSmallError: if the rows, with those of the step before,
        outnumber the slots (nothing changed).
    """
    rows = np.asarray(rows, np.int64)
    admitted = admit_rows.admit(self.slot_map, rows, WINDOW, MIN_WINDOW, AGING)
    if admitted is None:
      need = int((self._slot_of_row[rows] == 0).sum())
      raise CacheTooSmallError(
        f"Table '{self.files.table}' (DiskTier directory "
        f"{self.files.tier}): a step asks for "
        f"{rows.size} distinct rows, {need} of them not cached, but fewer of "
        f"the cache's {self.size} slots are free of this step's and the "
        "previous step's rows: give the cache at least twice the "
        "distinct rows of a step (DiskTier.cache_bytes)."
      )
    return admitted

  def slots_of(self, rows: np.ndarray) -> np.ndarray:
    """The slots of cached ``rows``, now marked changed (an update)."""
    slots = admit_rows.mark_updated(self.slot_map, self._changed, rows)
    if slots is None:
      raise AssertionError("an update of rows its step did not look up")
    return slots

  def mark_changed(self, rows: np.ndarray | None = None) -> None:
    """Marks ``rows`` (None: every row) changed since the last save."""
    if rows is None:
      self._changed[:] = 0xFF
    else:
      bits = np.left_shift(1, rows & 7).astype(np.uint8)
      np.bitwise_or.at(self._changed, rows >> 3, bits)

  def changed_rows(self) -> np.ndarray:
    """Sorted rows marked changed since ``clear_changed``."""
    at = np.flatnonzero(self._changed)
    bits = np.unpackbits(self._changed[at], bitorder="little").astype(bool)
    rows: np.ndarray = (at[:, None] * 8 + np.arange(8)).reshape(-1)[bits]
    return rows[rows < self.rows]

  def clear_changed(self) -> None:
    """Forgets the rows marked changed (a save holds them now)."""
    self._changed = np.zeros_like(self._changed)  # (pages untouched)

  def load(self, rows: np.ndarray) -> list[np.ndarray]:
    """The stored values of ``rows``, one array per key (those of rows
    whose write-back is in flight taken from it, the latest if several;
    those read ahead and not written since, from RAM)."""
    self._wait([])
    blocks = rows // self._grid
    self._write_initial(np.unique(blocks[~self._written[blocks]]))
    self.reads += rows.size
    held, values = self.staging.take(rows)
    if not held.all():
      read = self.files.read(rows[~held])
      for value, piece in zip(values, read, strict=True):
        value[~held] = piece
    if self.step % DROP_EVERY == 0 and self._drop_done():
      self._dropped = _writer().submit(self.files.drop_cache)
    return values

  def prefetch(self, rows: np.ndarray) -> None:
    """Reads ahead the stored values of the rows of ``rows`` (a coming
    step's ids) not cached now, in the background. Changes nothing else
    (any thread may call it); ids out of range, grid blocks never written,
    rows whose write-back is in flight (``load`` takes them from it) and
    rows a current read ahead holds already are skipped."""
    rows = np.asarray(rows, np.int64).reshape([-1])
    rows = rows[(rows >= 0) & (rows < self.rows)]
    rows = rows[self._slot_of_row[rows] == 0]  # (before sorting: fewer)
    rows = np.unique(rows)
    self.staging.read_ahead(rows[self._written[rows // self._grid]])

  def _drop_done(self) -> bool:
    """Whether no drop runs (raising the last one's failure)."""
    if self._dropped is not None and not self._dropped.done():
      return False
    if self._dropped is not None:
      self._dropped.result()
    return True

  def write_back(self, rows: np.ndarray, values: Sequence[np.ndarray]) -> None:
    """Writes ``values`` (one array per key) of ``rows`` (distinct) to
    the file, in the background (``load`` takes the rows from them
    meanwhile; at most ``IN_FLIGHT`` at once; a failure, such as a full
    disk, is raised by a later ``load`` or ``wait``)."""
    if rows.size == 0:
      return
    rows = np.array(rows, np.int64)  # (copies: held until written)
    values = [np.array(value, np.float32) for value in values]
    with self.staging.lock:  # (a read ahead starting now skips them)
      done = _writer().submit(self.files.write, rows, values)
      self._in_flight.append((self.staging.writing(rows, values), done))
    self.writes += rows.size
    self._wait(self._in_flight[:-IN_FLIGHT])

  def wait(self) -> None:
    """Waits for every write-back in flight (raising its failure)."""
    self._wait(self._in_flight)

  def _wait(self, these: list[_WriteBack]) -> None:
    """Waits for the write-backs ``these``; forgets every finished one,
    raising the first failure."""
    kept: list[_WriteBack] = []
    for at, write_back in enumerate(self._in_flight):
      number, done = write_back
      if not (done.done() or any(write_back is other for other in these)):
        kept.append(write_back)
        continue
      try:
        done.result()
      except BaseException:
        self._in_flight = kept + self._in_flight[at:]  # (it, and those after)
        raise
      self.staging.written(number)
    self._in_flight = kept

  # --- whole values -----------------------------------------------------------

  def changed_slots(self) -> tuple[np.ndarray, np.ndarray]:
    """``(slots, rows)`` whose values changed since they were read."""
    slots = np.flatnonzero(self.dirty)
    return slots, self.row_of_slot[slots]

  def mark_written(self, slots: np.ndarray) -> None:
    """Slots whose values the files now hold (a flush)."""
    self.dirty[slots] = False

  def window(self, key: str, first: int, count: int) -> np.ndarray:
    """Rows ``[first, first + count)`` of ``key`` as stored (the initial
    values of grid blocks never written, which stay unwritten)."""
    self.wait()
    value = np.empty([count, self.dim], np.float32)
    end = first + count
    for block in range(first // self._grid, -(-end // self._grid)):
      lo = max(first, block * self._grid)
      hi = min(end, (block + 1) * self._grid)
      if self._written[block]:
        value[lo - first : hi - first] = self.files.read_range(key, lo, hi - lo)
      else:
        start = block * self._grid
        rows = self._initial(key, start, min(self._grid, self.rows - start))
        value[lo - first : hi - first] = rows[lo - start : hi - start]
    return value

  def write_window(self, key: str, first: int, value: np.ndarray) -> None:
    """Writes rows from ``first`` of ``key`` (their grid blocks' other
    rows and variables first get their initial values). A grid block not
    on disk yet that ``value`` covers whole is written once: ``value``'s
    rows with the other variables' initial values (a restore writes each
    row once, not its initial value first)."""
    self.wait()
    self.staging.invalidate()
    end = first + value.shape[0]
    for block in range(first // self._grid, -(-end // self._grid)):
      start = block * self._grid
      stop = min(start + self._grid, self.rows)
      lo, hi = max(first, start), min(end, stop)
      piece = value[lo - first : hi - first]
      if not self._written[block] and (lo, hi) == (start, stop):
        records = {
          other: self._initial(other, start, stop - start)
          for other in self.keys
          if other != key
        }
        self.files.write_range(start, {key: piece, **records})
        self._written[block] = True
      else:
        self._write_initial(np.array([block]))
        self.files.write_range(lo, {key: piece})
    self.staging.invalidate()  # (and those read ahead while it wrote)

  def write_rows(self, key: str, rows: np.ndarray, value: np.ndarray) -> None:
    """Writes rows ``rows`` of ``key`` (not cached; their grid blocks'
    other rows and variables first get their initial values)."""
    records = self.stored(rows)  # (the other keys' values are kept)
    records[self.keys.index(key)] = value
    self.staging.invalidate(rows)
    self.files.write(rows, records)
    self.staging.invalidate(rows)  # (and those read ahead while it wrote)
    self.mark_changed(rows)

  def forget(self) -> None:
    """Empties the cache (after a flush: the files hold every change)."""
    self.slot_map.slot_of_row[:] = 0
    self.slot_map.row_of_slot[:] = -1
    self.slot_map.last_use[:] = -1
    self.slot_map.dirty[:] = False

  def _write_initial(self, blocks: np.ndarray) -> None:
    """Writes the initial values of the grid blocks not on disk yet."""
    for block in blocks[~self._written[blocks]]:
      start = int(block) * self._grid
      count = min(self._grid, self.rows - start)
      self.files.write_range(
        start, {key: self._initial(key, start, count) for key in self.keys}
      )
      self._written[block] = True

  def peek(self, key: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(slots, values)`` of ``rows`` of ``key``, none admitted: each
    row's slot (-1: not cached) and the stored values of the rows not
    cached (zeros for the cached). The map, counts and changed rows stay
    as they are; grid blocks first read get their initial values on disk,
    as for ``load``."""
    rows = np.asarray(rows, np.int64)
    slots = self._slot_of_row[rows].astype(np.int64) - 1
    values = np.zeros([rows.size, self.dim], np.float32)
    missing = slots < 0
    if missing.any():
      stored, at = np.unique(rows[missing], return_inverse=True)
      values[missing] = self.stored(stored)[self.keys.index(key)][at]
    return slots, values

  def stored(self, rows: np.ndarray) -> list[np.ndarray]:
    """The values the files hold of ``rows`` (distinct), one array per
    key (once every write-back is done; grid blocks first read get their
    initial values on disk, as for ``load``)."""
    self.wait()
    self._write_initial(np.unique(rows // self._grid))
    return self.files.read(rows)
