"""Rows of coming steps, read ahead from a disk table's file into RAM.

A disk-tiered table's step must read the rows its cache misses. When the
ids of a coming step are known early (``data.prefetch_rows``), those of
its rows the cache lacks are read ahead, in the background, into a small
staging area: the step that admits them takes their values from RAM
instead of waiting on the disk, as FBGEMM's SSD tables prefetch batch
i + 1 during batch i.

A staged value is only as good as the file it came from: each write of a
row to the file (a write-back, a restore) marks the row's staged copies
stale, under the same lock under which a read ahead is started, so that a
copy is either read after the write or marked stale by it. A stale copy,
a failed read ahead and a row never staged are read from the file by the
step, which reports any failure itself.

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
import dataclasses
import threading

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


@dataclasses.dataclass
class _Staged:
  """Rows read ahead (sorted, distinct), which of them were written to
  the file since (``stale``), and their values (one array per key)."""

  rows: np.ndarray
  stale: np.ndarray
  values: concurrent.futures.Future[list[np.ndarray]]


class RowStaging:
  """Rows of coming steps read ahead from ``files`` into RAM.

  Args:
    files: the table's file.

  Attributes:
    lock: held while a read ahead starts and while a row is marked
      written; a caller that must decide what to read ahead and start it
      atomically with respect to its writes holds it around both.
    taken: rows served from RAM so far.
  """

  def __init__(self, files: RowFiles):
    self._files = files
    self.lock = threading.RLock()
    self._sets: collections.deque[_Staged] = collections.deque(maxlen=SETS)
    self.taken = 0

  def read_ahead(self, rows: np.ndarray) -> None:
    """Starts reading the records of ``rows`` (distinct, sorted, all
    written to the file) in the background."""
    rows = np.asarray(rows, np.int64)
    if not rows.size:
      return
    with self.lock:
      values = _stagers().submit(self._files.read, rows)
      self._sets.append(_Staged(rows, np.zeros(rows.size, bool), values))

  def held(self, rows: np.ndarray) -> np.ndarray:
    """Which of ``rows`` a set read ahead (or being read) holds current:
    a step may take them from there (hold ``lock`` until the next read
    ahead starts, so that none turns stale in between unseen)."""
    rows = np.asarray(rows, np.int64)
    found = np.zeros(rows.size, bool)
    with self.lock:
      sets = list(self._sets)
      if len(sets) == SETS:  # (the oldest leaves at the next read ahead)
        sets = sets[1:]
      for staged in sets:
        at, mine = _positions(staged.rows, rows)
        found[mine[~staged.stale[at]]] = True
    return found

  def invalidate(self, rows: np.ndarray | None = None) -> None:
    """Marks the staged copies of ``rows`` (None: every row) stale: the
    file holds other values of them now."""
    with self.lock:
      if rows is None:
        self._sets.clear()
        return
      for staged in self._sets:
        staged.stale[_positions(staged.rows, rows)[0]] = True

  def take(self, rows: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """``(found, values)``: which of ``rows`` have a current staged copy,
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
      sets = list(reversed(self._sets))  # the newest first
    for staged in sets:
      missing = np.flatnonzero(~found)
      at, mine = _positions(staged.rows, rows[missing])
      if not at.size:
        continue
      try:
        read = staged.values.result()
      except Exception:  # noqa: BLE001 (the step reads them and reports)
        continue
      current = ~staged.stale[at]
      at, wanted = at[current], missing[mine[current]]
      for value, piece in zip(values, read, strict=True):
        value[wanted] = piece[at]
      found[wanted] = True
    self.taken += int(found.sum())
    return found, values


def _positions(
  staged: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """``(at, mine)``: where in ``staged`` (sorted) the entries ``mine``
  of ``rows`` are (those of ``rows`` it holds)."""
  if not staged.size or not rows.size:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  place = np.minimum(np.searchsorted(staged, rows), staged.size - 1)
  mine = np.flatnonzero(staged[place] == rows)
  return place[mine], mine
