"""A disk-tiered table's file: each row's variables in one record.

A ``TieredTable``'s rows live in one file of ``rows`` records, row ``r``'s
record holding its values of every variable (parameters, then each
optimizer slot) one after another, so a row missed by the cache is one
random read, and its write-back one write. The file is made sparse (no
row written). Rows are read and written with ``pread`` / ``pwrite``
(never mapped: the file's pages are not this process's memory),
consecutive rows in one call. Before a batch of reads or writes, every
page they touch is asked of the kernel at once (``POSIX_FADV_WILLNEED``,
which returns before the disk answers), so that the disk serves them
with many in flight from one thread, and a write never waits for the
read of its page; ``will_need`` does the same for a coming step's rows.
Pages the reads brought in are dropped once read (the rows are in the
RAM cache then), and those of written rows once on disk, so the page
cache holds little of the file.
A full disk is a one-line ``DiskFullError`` naming the directory.

Example:
  >>> import tempfile
  >>> import numpy as np
  >>> files = RowFiles(tempfile.mkdtemp(), rows=10, dim=2, keys=["p", "s"])
  >>> files.write(np.array([7, 3]), [np.array([[7, 7], [3, 3]], "f4"),
  ...                                np.array([[1, 1], [2, 2]], "f4")])
  >>> [v.tolist() for v in files.read(np.array([3, 7]))]
  [[[3.0, 3.0], [7.0, 7.0]], [[2.0, 2.0], [1.0, 1.0]]]
  >>> files.read_range("s", 3, 1).tolist()
  [[2.0, 2.0]]
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
from collections.abc import Mapping
from collections.abc import Sequence

import numpy as np

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
    self._row_bytes = dim * 4 * len(self.keys)
    path = os.path.join(directory, "rows.records")
    self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(self._fd, rows * self._row_bytes)
    self._last_written: tuple[list[int], list[int]] = ([], [])

  def close(self) -> None:
    """Closes the file (it stays on disk)."""
    os.close(self._fd)

  def read(self, rows: np.ndarray) -> list[np.ndarray]:
    """Per key, ``[len(rows), dim]`` values of ``rows``, in their order."""
    records = self._records(np.size(rows))
    self._each_run(rows, records, reading=True)
    return [np.ascontiguousarray(records[:, k]) for k in range(len(self.keys))]

  def write(self, rows: np.ndarray, values: Sequence[np.ndarray]) -> None:
    """Writes per key ``values`` (one row per entry of ``rows``)."""
    self._each_run(rows, np.stack(values, axis=1).astype(np.float32), False)

  def read_range(self, key: str, first: int, count: int) -> np.ndarray:
    """Rows ``[first, first + count)`` of ``key``."""
    records = self._records(count)
    self._io(first, records, reading=True)
    self._advise([first], [first + count], os.POSIX_FADV_DONTNEED)
    return np.ascontiguousarray(records[:, self.keys.index(key)])

  def write_range(self, first: int, values: Mapping[str, np.ndarray]) -> None:
    """Writes consecutive rows from ``first`` of the keys of ``values``
    (the other keys' values of those rows are kept)."""
    records = self._records(len(next(iter(values.values()))))
    if len(values) < len(self.keys):
      self._io(first, records, reading=True)
    for key, value in values.items():
      records[:, self.keys.index(key)] = value
    self._io(first, records, reading=False)
    self._advise([first], [first + len(records)], os.POSIX_FADV_DONTNEED)

  def will_need(self, rows: np.ndarray) -> None:
    """Asks the kernel to bring the pages of ``rows`` into its page cache
    (in the background: it returns before the disk answers)."""
    _, ordered, starts, ends = _runs(rows)
    self._warm(ordered[starts].tolist(), (ordered[ends - 1] + 1).tolist())

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

  def _advise(self, firsts: list[int], ends: list[int], advice: int) -> None:
    """``posix_fadvise(advice)`` of rows ``[firsts[i], ends[i])``."""
    size = self._row_bytes
    for first, end in zip(firsts, ends, strict=True):
      os.posix_fadvise(self._fd, first * size, (end - first) * size, advice)

  def _warm(self, firsts: list[int], ends: list[int]) -> None:
    self._advise(firsts, ends, os.POSIX_FADV_WILLNEED)

  def _each_run(
    self, rows: np.ndarray, records: np.ndarray, reading: bool
  ) -> None:
    """Reads into (or writes from) ``records[i]`` row ``rows[i]``: every
    page asked for first, then runs of consecutive rows one call each."""
    order, ordered, starts, ends = _runs(rows)
    if not order.size:
      return
    firsts, lasts = ordered[starts].tolist(), (ordered[ends - 1] + 1).tolist()
    self._warm(firsts, lasts)
    staged = np.empty_like(records) if reading else records[order]
    for first, start, end in zip(
      firsts, starts.tolist(), ends.tolist(), strict=True
    ):
      self._io(first, staged[start:end], reading)
    # Dropped: pages read (now in the RAM cache), pages written the time
    # before (on disk by now); pages written now start to go to disk.
    self._advise(firsts, lasts, os.POSIX_FADV_DONTNEED)
    if reading:
      records[order] = staged
    else:
      self._advise(*self._last_written, os.POSIX_FADV_DONTNEED)
      self._last_written = (firsts, lasts)

  def _io(self, first: int, values: np.ndarray, reading: bool) -> None:
    offset = first * self._row_bytes
    view = memoryview(values.data).cast("B")
    done = 0
    try:
      while done < view.nbytes:
        if reading:
          n = os.preadv(self._fd, [view[done:]], offset + done)
        else:
          n = os.pwritev(self._fd, [view[done:]], offset + done)
        if n == 0:
          raise OSError(errno.EIO, "short read")
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


def _runs(rows: np.ndarray) -> tuple[np.ndarray, ...]:
  """``(order, rows[order], starts, ends)``: ``rows`` sorted and cut into
  runs of consecutive rows ``[starts[i], ends[i])``."""
  rows = np.asarray(rows, np.int64).reshape([-1])
  order = np.argsort(rows, kind="stable")
  ordered = rows[order]
  if not rows.size:
    return order, ordered, order, order
  breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
  starts = np.concatenate([[0], breaks])
  ends = np.concatenate([breaks, [rows.size]])
  return order, ordered, starts, ends
