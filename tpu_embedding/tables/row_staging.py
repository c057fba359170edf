"""Rows of a disk table held in RAM outside its cache: read ahead from
the table's file for coming steps, or on their way back to it.

A disk-tiered table's step must read the rows its cache misses. When the
ids of a coming step are known early (``data.prefetch_rows``), those of
its rows the cache lacks are read ahead, in the background, into a small
staging area: the step that admits them takes their values from RAM
instead of waiting on the disk, as FBGEMM's SSD tables prefetch batch
i + 1 during batch i. Rows evicted from the cache are written back in
the background; until their write is done, a step that admits them again
takes their values from the write-back (the file may not hold them yet).

One index maps each such row to where its values are: a read
ahead (a ``SETS``-bounded ring of them) or a write-back in flight, a
write-back being newer than any read ahead of the row. A staged value is
only as good as the file it came from: each write of a row to the file
(a write-back, a restore) drops the row's staged copy from the index,
under the same lock under which a read ahead is started, so that a copy
is either read after the write or dropped by it. A row not indexed, and
a row whose read ahead failed, are read from the file by the step, which
reports any failure itself.

Example:
  >>> import tempfile
  >>> import numpy as np
  >>> from tpu_embedding.tables.row_files import RowFiles
  >>> files = RowFiles(tempfile.mkdtemp(), rows=10, dim=2, keys=("p",))
  >>> files.write(np.array([3, 5]), [np.array([[3, 3], [5, 5]], "f4")])
  >>> staging = RowStaging(files)
  >>> staging.read_ahead(np.array([3, 5]))
  >>> staging.invalidate(np.array([5]))  # row 5 written again meanwhile
  >>> found, values = staging.take(np.array([5, 3, 7]))
  >>> found.tolist(), values[0][found].tolist()
  ([False, True, False], [[3.0, 3.0]])
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from collections.abc import Sequence

import numpy as np

from tpu_embedding.tables import file_threads
from tpu_embedding.tables.row_files import RowFiles

#: Read-ahead sets a table (or a block of one) keeps: one a batch (all its
#: features of the table: ``data.prefetch_rows``), for a step's batches and
#: those its input pipeline holds beyond them. Measured with two replicas'
#: batches through ``distribute_datasets_from_function`` (each block of a
#: row-sharded table gets every replica's): four steps' batches, 8 sets
#: (``prefetch_rows``' two and the distributed iterator's own).
SETS = 8

#: Threads that start read-aheads, shared by every table (each read
#: itself runs on ``row_files``' readers).
STAGERS = 4


def _stagers() -> concurrent.futures.ThreadPoolExecutor:
  """Started on the first read ahead (not on import)."""
  return file_threads.pool("row-staging", STAGERS)


class _Index:
  """Each held row's source (a number) and position there, as one code
  ``source << 32 | position`` (a dict: a step's few hundred rows cost
  microseconds, without letting go of the GIL between array calls)."""

  def __init__(self) -> None:
    self.code: dict[int, int] = {}

  def find(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(mine, source, at)``: the entries ``mine`` of ``rows`` indexed,
    their sources and positions."""
    get = self.code.get
    codes = np.fromiter((get(row, -1) for row in rows.tolist()), np.int64)
    mine = np.flatnonzero(codes >= 0)
    codes = codes[mine]
    return mine, codes >> 32, codes & 0xFFFFFFFF

  def put(self, rows: np.ndarray, source: int) -> None:
    """Indexes ``rows`` (distinct) at their positions in ``source``,
    replacing their entries."""
    first = source << 32
    self.code.update(
      zip(rows.tolist(), range(first, first + rows.size), strict=True)
    )

  def drop(self, rows: np.ndarray, leaving: Callable[[int], bool]) -> None:
    """Drops the entries of ``rows`` whose sources are ``leaving``."""
    code = self.code
    for row in rows.tolist():
      found = code.get(row, -1)
      if found >= 0 and leaving(found >> 32):
        del code[row]


#: A read ahead's values, once read.
_Reading = concurrent.futures.Future[list[np.ndarray]]


#: Source numbers wrap around (a code holds one in 31 bits); the few
#: live at once are never reused.
_NUMBERS = 2**30


def _is_read(source: int) -> bool:
  """Whether source number ``source`` is a read ahead's."""
  return source % 2 == 1


class RowStaging:
  """Rows of ``files`` held in RAM: read ahead, or being written back.

  Args:
    files: the table's file.

  Attributes:
    lock: held while a read ahead or a write-back starts and while a row
      is marked written; a caller that must decide what to read ahead
      and start it atomically with respect to its writes holds it around
      both.
    taken: rows served from read aheads so far.
  """

  def __init__(self, files: RowFiles):
    self._files = files
    self.lock = threading.RLock()
    self._index = _Index()  # (a write-back's number is even, a read's odd)
    # (each source's rows, and their values: to come, or held)
    self._reads: dict[int, tuple[np.ndarray, _Reading]] = {}
    self._writes: dict[int, tuple[np.ndarray, Sequence[np.ndarray]]] = {}
    self._sets: collections.deque[int] = collections.deque()  # oldest first
    self._next = 0
    self.taken = 0

  def read_ahead(self, rows: np.ndarray) -> None:
    """Starts reading the records of ``rows`` (distinct, all written to
    the file) in the background; rows held current (``held``) are
    skipped."""
    rows = np.asarray(rows, np.int64)
    with self.lock:
      rows = rows[~self.held(rows)]
      if not rows.size:
        return
      if len(self._sets) == SETS:
        self._forget(self._sets.popleft())
      number = self._number(odd=True)
      self._reads[number] = rows, _stagers().submit(self._files.read, rows)
      self._index.put(rows, number)
      self._sets.append(number)

  def writing(self, rows: np.ndarray, values: Sequence[np.ndarray]) -> int:
    """Holds ``values`` (one array per key, a row per entry of ``rows``,
    distinct) of rows being written to the file, newer than any copy
    held before: their number for ``written``."""
    with self.lock:
      number = self._number(odd=False)
      rows = np.asarray(rows, np.int64)
      self._writes[number] = rows, values
      self._index.put(rows, number)
      return number

  def written(self, number: int) -> None:
    """The write-back ``number`` is in the file: forgets it."""
    with self.lock:
      self._forget(number)

  def held(self, rows: np.ndarray) -> np.ndarray:
    """Which of ``rows`` a read ahead (or being read) or a write-back in
    flight holds current: a step may take them from there (hold ``lock``
    until the next read ahead starts, so that none turns stale in between
    unseen; the oldest read ahead leaves at the next)."""
    rows = np.asarray(rows, np.int64)
    found = np.zeros(rows.size, bool)
    with self.lock:
      mine, source, _ = self._index.find(rows)
      if len(self._sets) == SETS:
        mine = mine[source != self._sets[0]]
      found[mine] = True
    return found

  def invalidate(self, rows: np.ndarray | None = None) -> None:
    """Drops the read-ahead copies of ``rows`` (None: every row): the
    file holds other values of them now."""
    with self.lock:
      if rows is not None:
        self._index.drop(np.asarray(rows, np.int64), _is_read)
        return
      while self._sets:
        self._forget(self._sets.popleft())

  def take(self, rows: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(found, values)``: which of ``rows`` have a current copy held,
    and per key ``[len(rows), dim]`` values holding those copies (the
    other rows' values are undefined). Waits for the read aheads that
    hold them."""
    rows = np.asarray(rows, np.int64)
    found = np.zeros(rows.size, bool)
    values = [
      np.empty([rows.size, self._files.dim], np.float32)
      for _ in self._files.keys
    ]
    with self.lock:
      mine, source, at = self._index.find(rows)
      numbers = np.unique(source).tolist()
      writes = {n: self._writes[n][1] for n in numbers if not _is_read(n)}
      reads = {n: self._reads[n][1] for n in numbers if _is_read(n)}
    for number in numbers:
      these = source == number
      wanted, place = mine[these], at[these]
      held: Sequence[np.ndarray]
      if number in reads:
        try:
          held = reads[number].result()
        except Exception:  # noqa: BLE001 (the step reads them and reports)
          continue
        self.taken += wanted.size
      else:
        held = writes[number]
      for value, piece in zip(values, held, strict=True):
        value[wanted] = piece[place]
      found[wanted] = True
    return found, values

  def _forget(self, number: int) -> None:
    """Forgets the source ``number`` (the entries of its rows that are
    still its)."""
    sources = self._reads if _is_read(number) else self._writes
    rows, _ = sources.pop(number)
    self._index.drop(rows, lambda source: source == number)

  def _number(self, odd: bool) -> int:
    """A new source's number: odd for a read ahead, even for a
    write-back."""
    number = self._next + (self._next % 2 != odd)
    self._next = (number + 1) % _NUMBERS
    return number
