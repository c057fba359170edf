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
  >>> files.write(["p"], np.array([7, 3]), [np.array([[7, 7], [3, 3]], "f4")])
  >>> files.read(["p"], np.array([3, 7]))[0].tolist()
  [[3.0, 3.0], [7.0, 7.0]]
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import errno
import mmap
import os
from collections.abc import Sequence

import numpy as np

#: Threads reading and writing rows (reads in flight at once).
THREADS = 32

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

  def read(self, keys: Sequence[str], rows: np.ndarray) -> list[np.ndarray]:
    """Per key, ``[len(rows), dim]`` values of ``rows``, in their order
    (all keys' reads in flight together)."""
    out = [np.empty([rows.size, self.dim], np.float32) for _ in keys]
    self._each_run(keys, rows, out, reading=True)
    return out

  def write(
    self, keys: Sequence[str], rows: np.ndarray, values: Sequence[np.ndarray]
  ) -> None:
    """Writes per key ``values`` (one row per entry of ``rows``)."""
    values = [np.ascontiguousarray(v, np.float32) for v in values]
    self._each_run(keys, rows, values, reading=False)

  def read_range(self, key: str, first: int, count: int) -> np.ndarray:
    """Rows ``[first, first + count)``."""
    out = np.empty([count, self.dim], np.float32)
    self._io(key, first, out, reading=True)
    return out

  def write_range(self, key: str, first: int, values: np.ndarray) -> None:
    """Writes consecutive rows from ``first``."""
    self._io(key, first, np.ascontiguousarray(values, np.float32), False)

  def drop_cache(self) -> None:
    """Asks the kernel to drop the files' clean pages from its page cache
    (pages written but not yet on disk stay until they are)."""
    for fd in self._fds.values():
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

  def cached_bytes(self) -> int:
    """Bytes of the files in the page cache now (``mincore``)."""
    total = 0
    for fd in self._fds.values():
      size = os.fstat(fd).st_size
      if size == 0:
        continue
      address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
      if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
      try:
        pages = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
        if _libc.mincore(address, ctypes.c_size_t(size), pages.ctypes) == 0:
          total += int((pages & 1).sum()) * mmap.PAGESIZE
      finally:
        _libc.munmap(address, ctypes.c_size_t(size))
    return total

  def _each_run(
    self,
    keys: Sequence[str],
    rows: np.ndarray,
    values: list[np.ndarray],
    reading: bool,
  ) -> None:
    """Reads into (or writes from) ``values[k][i]`` row ``rows[i]`` of
    key ``keys[k]``: runs of consecutive rows one call each, spread over
    the threads (every key's at once)."""
    rows = np.asarray(rows, np.int64)
    if rows.size == 0:
      return
    order = np.argsort(rows, kind="stable")
    ordered = rows[order]
    breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [rows.size]])
    staged = [v[order] if not reading else np.empty_like(v) for v in values]

    def task(key: str, value: np.ndarray, runs: np.ndarray) -> None:
      for run in runs:
        start, end = starts[run], ends[run]
        self._io(key, int(ordered[start]), value[start:end], reading)

    groups = np.array_split(np.arange(starts.size), THREADS)
    tasks = [
      self._pool.submit(task, key, value, runs)
      for key, value in zip(keys, staged, strict=True)
      for runs in groups
      if runs.size
    ]
    for future in tasks:
      future.result()
    if reading:
      for value, read in zip(values, staged, strict=True):
        value[order] = read

  def _io(
    self, key: str, first: int, values: np.ndarray, reading: bool
  ) -> None:
    offset = first * self._row_bytes
    view = memoryview(values.data).cast("B")
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
        tier, table = os.path.split(self.directory)
        raise DiskFullError(
          error.errno,
          f"Table '{table}': the disk of its DiskTier directory {tier} is "
          "full, its rows could not be written (free space there, or give "
          "the tables on disk another directory).",
        ) from None
      raise
