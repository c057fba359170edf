"""A disk-tiered table's files: one per variable, rows read in parallel.

Each variable (parameters, each optimizer slot) of a ``TieredTable`` has
one file of ``rows x dim`` float32 values, made sparse (no row written).
Rows are read and written with ``pread`` / ``pwrite`` (never mapped: the
files' pages are not this process's memory), consecutive rows in one
call, from a pool of threads so that many reads are in flight at once
(the disk's random-read rate needs tens). A full disk is a one-line
``DiskFullError`` naming the directory.

Example:
  >>> import tempfile
  >>> import numpy as np
  >>> files = RowFiles(tempfile.mkdtemp(), rows=10, dim=2, keys=["p"])
  >>> files.write("p", np.array([7, 3]), np.array([[7, 7], [3, 3]], "f4"))
  >>> files.read("p", np.array([3, 7])).tolist()
  [[3.0, 3.0], [7.0, 7.0]]
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
from collections.abc import Sequence

import numpy as np

#: Threads reading and writing rows (reads in flight at once).
THREADS = 32

#: Rows per task handed to a thread.
_TASK_ROWS = 256


class DiskFullError(OSError):
  """The disk of a tiered table's files is full."""


class RowFiles:
  """The files of one table's variables.

  Args:
    directory: where they go (``<key>.rows`` each; made empty).
    rows: the table's rows.
    dim: its width.
    keys: the variables.
  """

  def __init__(self, directory: str, rows: int, dim: int, keys: Sequence[str]):
    self.directory = directory
    self.rows, self.dim = rows, dim
    self._row_bytes = dim * 4
    self._fds = {}
    for key in keys:
      path = os.path.join(directory, f"{key.replace('/', '_')}.rows")
      fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
      os.ftruncate(fd, rows * self._row_bytes)
      self._fds[key] = fd
    self._pool = concurrent.futures.ThreadPoolExecutor(THREADS)

  def close(self) -> None:
    """Closes the files (they stay on disk)."""
    self._pool.shutdown()
    for fd in self._fds.values():
      os.close(fd)
    self._fds = {}

  def read(self, key: str, rows: np.ndarray) -> np.ndarray:
    """``[len(rows), dim]`` values of ``rows``, in their order."""
    out = np.empty([rows.size, self.dim], np.float32)
    self._each_run(key, rows, out, reading=True)
    return out

  def write(self, key: str, rows: np.ndarray, values: np.ndarray) -> None:
    """Writes ``values`` (one per entry of ``rows``) at ``rows``."""
    values = np.ascontiguousarray(values, np.float32)
    self._each_run(key, rows, values, reading=False)

  def read_range(self, key: str, first: int, count: int) -> np.ndarray:
    """Rows ``[first, first + count)``."""
    out = np.empty([count, self.dim], np.float32)
    self._io(key, first, out, reading=True)
    return out

  def write_range(self, key: str, first: int, values: np.ndarray) -> None:
    """Writes consecutive rows from ``first``."""
    self._io(key, first, np.ascontiguousarray(values, np.float32), False)

  def drop_cache(self) -> None:
    """Asks the kernel to drop the files' pages from its page cache."""
    for fd in self._fds.values():
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

  def _each_run(
    self, key: str, rows: np.ndarray, values: np.ndarray, reading: bool
  ) -> None:
    """Reads into (or writes from) ``values[i]`` row ``rows[i]``: runs of
    consecutive rows one call each, tasks of runs across the threads."""
    rows = np.asarray(rows, np.int64)
    if rows.size == 0:
      return
    order = np.argsort(rows, kind="stable")
    ordered = rows[order]
    breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [rows.size]])
    contiguous = bool((order == np.arange(rows.size)).all())
    staged = values if contiguous else np.empty_like(values)
    if not reading and not contiguous:
      staged[:] = values[order]

    def task(lo: int, hi: int) -> None:
      for start, end in zip(starts[lo:hi], ends[lo:hi], strict=True):
        self._io(key, int(ordered[start]), staged[start:end], reading)

    step = max(1, _TASK_ROWS)
    tasks = [
      self._pool.submit(task, lo, min(lo + step, starts.size))
      for lo in range(0, starts.size, step)
    ]
    for future in tasks:
      future.result()
    if reading and not contiguous:
      values[order] = staged

  def _io(
    self, key: str, first: int, values: np.ndarray, reading: bool
  ) -> None:
    offset = first * self._row_bytes
    view = memoryview(values).cast("B")
    done = 0
    try:
      while done < view.nbytes:
        if reading:
          n = os.preadv(self._fds[key], [view[done:]], offset + done)
        else:
          n = os.pwritev(self._fds[key], [view[done:]], offset + done)
        if n == 0:
          raise OSError(errno.EIO, "short read")
        done += n
    except OSError as error:
      if error.errno in (errno.ENOSPC, errno.EDQUOT):
        raise DiskFullError(
          error.errno,
          f"The disk of {self.directory} is full: a disk-tiered table "
          "could not write its rows back (free space there, or give its "
          "tables another DiskTier directory).",
        ) from None
      raise
