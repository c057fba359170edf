"""A disk-tiered table's file: a log of row records.

A ``TieredTable``'s rows live in one file (``rows.records``), each row's
values of every variable (parameters, then each optimizer slot) in one
record, so a row missed by the cache is one random read. A record is
never rewritten in place: writes append records at the file's tail, in
one sequential write, and the row's entry in ``where`` (4 bytes a row)
moves to its new record. On this project's SSD a random write of a small
record costs three random reads' time (and makes the kernel read its page
first), while appending runs at gigabytes a second: so a miss costs the
disk one random read, and its write-back next to nothing.

The file is cut in segments of ``SEGMENT_RECORDS`` records, each its
records' row ids, then their values. A segment's records go stale as
their rows are written again; when the file's segments hold more than
``SPACE`` times the live records (plus two segments), the segment with
the fewest live records is read whole, they are appended again, and the
segment is reused (a log-structured store's cleaner: it reads and writes
in sequence). The file thus stays below ``SPACE`` times the rows written,
plus three segments and the largest write.

Reads: records consecutive in the file are read in one ``pread``, every
run of a read in flight at once (``kernels.read_records``: a pool of
threads in C++, past the page cache with ``O_DIRECT`` where the file
system allows it; or the kernel's own read-ahead where the kernel library
is not built); the file is read at random (``POSIX_FADV_RANDOM``: no
read-ahead around a record). Appended pages are dropped once on disk, and
the table drops the file's clean pages every few steps
(``drop_cache``), so the page cache holds little of the file. A full disk
is a one-line ``DiskFullError`` naming the directory. One thread may
write while another reads (a lock orders their use of ``where``).

Example:
  >>> import tempfile
  >>> import numpy as np
  >>> files = RowFiles(tempfile.mkdtemp(), rows=10, dim=2, keys=["p", "s"])
  >>> files.write(np.array([7, 3]), [np.array([[7, 7], [3, 3]], "f4"),
  ...                                np.array([[1, 1], [2, 2]], "f4")])
  >>> [v.tolist() for v in files.read(np.array([3, 7]))]
  [[[3.0, 3.0], [7.0, 7.0]], [[2.0, 2.0], [1.0, 1.0]]]
  >>> files.write(np.array([3]), [np.array([[4, 4]], "f4"),
  ...                             np.array([[5, 5]], "f4")])  # appended
  >>> files.read_range("s", 3, 1).tolist()
  [[5.0, 5.0]]
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import threading
import weakref
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpu_embedding.kernels import read_records

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
  ctypes.c_void_p,
  ctypes.c_size_t,
  ctypes.c_int,
  ctypes.c_int,
  ctypes.c_int,
  ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

#: Records of one segment of the file.
SEGMENT_RECORDS = 4096

#: The most segments the file holds, as a multiple of those its live
#: records fill (plus two): beyond, the cleaner reuses segments.
SPACE = 1.5

#: Bytes of records a whole-range read or write holds at once.
PASS_BYTES = 8 * 2**20

#: A row id's bytes in its segment's list of ids.
_ID_BYTES = 8


class DiskFullError(OSError):
  """The disk of a tiered table's files is full (``str``: one line)."""

  def __str__(self) -> str:
    return str(self.strerror)


class RowFiles:
  """The file of one table's records.

  Args:
    directory: where it goes (``rows.records``; made empty).
    rows: the table's rows.
    dim: its width.
    keys: the variables, in their order within a record.
    owner: ``(table, DiskTier directory)`` its errors name (default: the
      last part of ``directory`` and the rest).
  """

  def __init__(
    self,
    directory: str,
    rows: int,
    dim: int,
    keys: Sequence[str],
    owner: tuple[str, str] | None = None,
  ):
    self.directory = directory
    self.table, self.tier = owner or os.path.split(directory)[::-1]
    self.rows, self.dim = rows, dim
    self.keys = tuple(keys)
    self._value_bytes = dim * 4 * len(self.keys)
    self._segment_bytes = SEGMENT_RECORDS * (_ID_BYTES + self._value_bytes)
    path = os.path.join(directory, "rows.records")
    self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    # Rows are read at random: no read-ahead around them.
    os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
    self._direct_fd = read_records.open_direct(path)  # (-1: none)
    # (closed when the table is gone, or by ``close``)
    self._closer = weakref.finalize(self, _close, self._fd, self._direct_fd)
    # Each row's record + 1 (0: never written): zeros, whose pages take
    # no memory until rows are written; 4 bytes a row (the file's records
    # stay below 2**31 for tables below 2**29 rows).
    self._where = np.zeros(rows, np.int32 if rows < 2**29 else np.int64)
    self._live = np.zeros(0, np.int64)  # live records of each segment
    self._free: list[int] = []  # segments to reuse, lowest last
    self._tail, self._filled = -1, SEGMENT_RECORDS  # the segment appended
    self._lock = threading.RLock()
    self._last_written: list[tuple[int, int]] = []

  def close(self) -> None:
    """Closes the file (it stays on disk)."""
    self._closer()

  # --- reads ------------------------------------------------------------------

  def read(self, rows: np.ndarray) -> list[np.ndarray]:
    """Per key, ``[len(rows), dim]`` values of ``rows``, in their order.

    Raises:
      AssertionError: for a row never written.
    """
    rows = np.asarray(rows, np.int64).reshape([-1])
    records = self._records(rows.size)
    if rows.size:
      self._read_rows(rows, records)
    return [np.ascontiguousarray(records[:, k]) for k in range(len(self.keys))]

  def _read_rows(self, rows: np.ndarray, records: np.ndarray) -> None:
    """Reads the record of ``rows[i]`` into ``records[i]``."""
    with self._lock:
      at = self._where[rows].astype(np.int64) - 1
      if (at < 0).any():
        raise AssertionError(f"rows never written: {rows[at < 0][:5]}")
      self._read_records(at, records)

  def read_range(self, key: str, first: int, count: int) -> np.ndarray:
    """Rows ``[first, first + count)`` of ``key`` (all written), read
    ``PASS_BYTES`` of records at a time."""
    value = np.empty([count, self.dim], np.float32)
    k = self.keys.index(key)
    for start, end in self._passes(first, count):
      records = self._records(end - start)
      self._read_rows(np.arange(start, end), records)
      value[start - first : end - first] = records[:, k]
    return value

  def _passes(self, first: int, count: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of ``PASS_BYTES`` of records, covering
    rows ``[first, first + count)``."""
    step = max(1, PASS_BYTES // self._value_bytes)
    ends = range(first, first + count, step)
    return [(start, min(start + step, first + count)) for start in ends]

  def _read_records(self, at: np.ndarray, records: np.ndarray) -> None:
    """Reads record ``at[i]`` into ``records[i]``: runs of consecutive
    records one read each, all in flight at once (``read_records``; their
    pages leave the page cache with the table's periodic drop)."""
    order, offsets, sizes = self._runs(at)
    if not order.size:
      return
    in_order = bool((np.diff(order) == 1).all())  # (a window: no copy)
    staged = records if in_order else np.empty_like(records)
    read_records.read_runs(self._fd, offsets, sizes, staged, self._direct_fd)
    if not in_order:
      records[order] = staged

  def _runs(self, at: np.ndarray) -> tuple[np.ndarray, list[int], list[int]]:
    """``(order, offsets, sizes)``: records ``at`` sorted (``order``), as
    runs of records consecutive in the file (byte offsets and sizes)."""
    order = np.argsort(at, kind="stable")
    ordered = at[order]
    if not ordered.size:
      return order, [], []
    segment = ordered // SEGMENT_RECORDS
    breaks = np.flatnonzero((np.diff(ordered) != 1) | (np.diff(segment) != 0))
    starts = np.concatenate([[0], breaks + 1])
    counts = np.diff(np.concatenate([starts, [ordered.size]]))
    offsets = self._value_offset(*np.divmod(ordered[starts], SEGMENT_RECORDS))
    return order, offsets.tolist(), (counts * self._value_bytes).tolist()

  def _value_offset(self, segment: Any, index: Any) -> Any:
    """The byte offset of the values of record ``index`` of ``segment``
    (ints, or arrays of them)."""
    values_start = SEGMENT_RECORDS * _ID_BYTES
    return (
      segment * self._segment_bytes + values_start + index * self._value_bytes
    )

  # --- writes -----------------------------------------------------------------

  def write(self, rows: np.ndarray, values: Sequence[np.ndarray]) -> None:
    """Writes per key ``values`` (one row per entry of ``rows``, distinct),
    appended."""
    rows = np.asarray(rows, np.int64).reshape([-1])
    if rows.size:
      self._append(rows, np.stack(values, axis=1).astype(np.float32))

  def write_range(self, first: int, values: Mapping[str, np.ndarray]) -> None:
    """Writes consecutive rows from ``first`` of the keys of ``values``
    (the other keys' values of those rows are kept: all written)."""
    count = len(next(iter(values.values())))
    for start, end in self._passes(first, count):
      rows = np.arange(start, end)
      records = self._records(end - start)
      if len(values) < len(self.keys):
        self._read_rows(rows, records)
      for key, value in values.items():
        records[:, self.keys.index(key)] = value[start - first : end - first]
      self._append(rows, records)

  def _append(self, rows: np.ndarray, records: np.ndarray) -> None:
    """Appends ``records`` of ``rows``, then cleans segments where the
    file holds too many."""
    self._append_records(rows, records)
    with self._lock:
      self._clean()

  def _append_records(self, rows: np.ndarray, records: np.ndarray) -> None:
    """Appends ``records`` of ``rows`` at the tail, then points ``where``
    at them."""
    rows = np.ascontiguousarray(rows, np.int64)
    with self._lock:
      chunks = self._allocate(rows.size)
    done, written = 0, []
    for segment, index, count in chunks:
      base = segment * self._segment_bytes
      ids = rows[done : done + count]
      self._write(base + index * _ID_BYTES, memoryview(ids.data).cast("B"))
      values = np.ascontiguousarray(records[done : done + count])
      offset = self._value_offset(segment, index)
      self._write(offset, memoryview(values.data).cast("B"))
      written.append((base, self._segment_bytes))
      done += count
    at = np.concatenate(
      [segment * SEGMENT_RECORDS + index + np.arange(count)
       for segment, index, count in chunks]
    )  # fmt: skip
    with self._lock:
      self._point(rows, at)
      # Dropped: pages written the time before (on disk by now).
      for offset, size in self._last_written:
        os.posix_fadvise(self._fd, offset, size, os.POSIX_FADV_DONTNEED)
      self._last_written = written

  def _allocate(self, count: int) -> list[tuple[int, int, int]]:
    """``count`` records at the tail: ``(segment, first, count)`` each."""
    chunks = []
    while count:
      if self._filled == SEGMENT_RECORDS:
        if self._free:
          self._tail = self._free.pop()
        else:  # (the file grows by a whole segment, sparse)
          self._tail = self._live.size
          self._live = np.append(self._live, 0)
          os.ftruncate(self._fd, self._live.size * self._segment_bytes)
        self._filled = 0
      taken = min(count, SEGMENT_RECORDS - self._filled)
      chunks.append((self._tail, self._filled, taken))
      self._filled += taken
      count -= taken
    return chunks

  def _point(self, rows: np.ndarray, at: np.ndarray) -> None:
    """Rows ``rows`` are at records ``at`` now."""
    old = self._where[rows].astype(np.int64) - 1
    size = self._live.size
    self._live -= np.bincount(old[old >= 0] // SEGMENT_RECORDS, minlength=size)
    self._live += np.bincount(at // SEGMENT_RECORDS, minlength=size)
    self._where[rows] = at + 1

  def _clean(self) -> None:
    """Reuses segments while the file holds more than ``SPACE`` times the
    segments its live records fill (plus two)."""
    while self._tail >= 0:
      used = np.ones(self._live.size, bool)
      used[self._free] = False
      used[self._tail] = False  # (the tail is never cleaned)
      allowed = SPACE * self._live.sum() / SEGMENT_RECORDS + 2
      if used.sum() + 1 <= allowed:
        return
      candidates = np.flatnonzero(used)
      victim = int(candidates[np.argmin(self._live[candidates])])
      if self._live[victim]:
        self._move_live(victim)
      self._free.append(victim)
      self._free.sort(reverse=True)

  def _move_live(self, segment: int) -> None:
    """Appends the live records of ``segment`` again."""
    base = segment * self._segment_bytes
    ids = np.empty(SEGMENT_RECORDS, np.int64)
    read_records.read_runs(self._fd, [base], [ids.nbytes], ids, self._direct_fd)
    records = self._records(SEGMENT_RECORDS)
    offset = self._value_offset(segment, 0)
    read_records.read_runs(
      self._fd, [offset], [records.nbytes], records, self._direct_fd
    )
    os.posix_fadvise(
      self._fd, base, self._segment_bytes, os.POSIX_FADV_DONTNEED
    )
    at = segment * SEGMENT_RECORDS + np.arange(SEGMENT_RECORDS)
    valid = (ids >= 0) & (ids < self.rows)
    live = valid & (self._where[np.where(valid, ids, 0)] == at + 1)
    if live.any():
      self._append_records(ids[live], records[live])

  # --- the page cache ---------------------------------------------------------

  def drop_cache(self) -> None:
    """Asks the kernel to drop the file's clean pages from its page cache
    (pages written but not yet on disk stay until they are)."""
    os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

  def cached_bytes(self) -> int:
    """Bytes of the file in the page cache now (``mincore``)."""
    size = os.fstat(self._fd).st_size
    if size == 0:
      return 0
    address = _libc.mmap(
      None, size, mmap.PROT_READ, mmap.MAP_SHARED, self._fd, 0
    )
    if address in (None, ctypes.c_void_p(-1).value):
      raise OSError(ctypes.get_errno(), "mmap failed")
    try:
      pages = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
      if _libc.mincore(address, ctypes.c_size_t(size), pages.ctypes) != 0:
        return 0
      return int((pages & 1).sum()) * mmap.PAGESIZE
    finally:
      _libc.munmap(address, ctypes.c_size_t(size))

  def _records(self, count: int) -> np.ndarray:
    return np.empty([count, len(self.keys), self.dim], np.float32)

  def _write(self, offset: int, view: memoryview) -> None:
    """Writes ``view`` at ``offset`` (reads: ``read_records``)."""
    done = 0
    try:
      while done < view.nbytes:
        n = os.pwritev(self._fd, [view[done:]], offset + done)
        if n == 0:
          raise OSError(errno.EIO, "short write")
        done += n
    except OSError as error:
      if error.errno in (errno.ENOSPC, errno.EDQUOT):
        raise DiskFullError(
          error.errno,
          f"Table '{self.table}': the disk of its DiskTier directory "
          f"{self.tier} is "
          "full, its rows could not be written (free space there, or give "
          "the tables on disk another directory).",
        ) from None
      raise


def _close(*fds: int) -> None:
  for fd in fds:
    if fd >= 0:
      os.close(fd)
