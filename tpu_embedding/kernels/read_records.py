"""Reads runs of a file into one buffer, many reads in flight.

A disk-tiered table's step misses rows scattered over its file
(``tables/row_files.py``): hundreds of small random reads, each worth
little on its own, that the disk serves best with many in flight. With
the kernel library, ``read_runs`` hands them all to ``TpeReadRecordsDirect``
(``read_records.cc``) in one call: a pool of threads issues them while
Python's GIL is released, so the step's other host work runs meanwhile.
Given a second descriptor of the file opened with ``O_DIRECT``
(``open_direct``), the kernel reads each run's pages past the page cache
into a bounce buffer (``TpeReadRecordsDirect``): the disk does the same
reads, and the page cache holds none of them. Those reads go through the
calling thread's io_uring (``read_ring.cc``: many reads one system call,
no thread switch per read; about 5 us of CPU a read here against 10-14
from the pool), through the pool where the kernel refuses io_uring.
Without it (``TPU_EMBEDDING_KERNELS=0``, no compiler at install), the
pages of every run are asked of the kernel at once
(``POSIX_FADV_WILLNEED``, which returns before the disk answers), then
read in order from this thread. Both read the same bytes.

Example:
  >>> import os, tempfile
  >>> import numpy as np
  >>> path = os.path.join(tempfile.mkdtemp(), "f")
  >>> with open(path, "wb") as f:
  ...   _ = f.write(bytes(range(16)))
  >>> fd = os.open(path, os.O_RDONLY)
  >>> dest = np.zeros(5, np.uint8)
  >>> read_runs(fd, [12, 2], [2, 3], dest)  # bytes 12-13, then 2-4
  >>> dest.tolist()
  [12, 13, 2, 3, 4]
  >>> os.close(fd)
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from collections.abc import Callable
from collections.abc import Sequence

import numpy as np

from tpu_embedding import kernels
from tpu_embedding.kernels import library

#: Direct reads through the calling thread's io_uring where the kernel
#: allows it (False: the pool of threads reads them; tests try both).
USE_RING = True


@functools.cache
def _library() -> ctypes.CDLL | None:
  """The loaded kernel library, or None."""
  if kernels.load() is None:
    return None
  return ctypes.CDLL(library.choose().path)


@functools.cache
def _kernel() -> Callable[..., int] | None:
  """``TpeReadRecordsDirect`` of the loaded kernel library, or None."""
  loaded = _library()
  function = getattr(loaded, "TpeReadRecordsDirect", None)
  if function is None:  # (a library built before it: the fallback)
    return None
  pointer = ctypes.c_void_p
  integer = ctypes.c_int
  function.argtypes = [integer] * 3 + [ctypes.c_int64, *[pointer] * 4]
  function.restype = ctypes.c_int
  result: Callable[..., int] = function
  return result


def ring_ready() -> bool:
  """Whether the calling thread reads through an io_uring (the kernel
  library loaded, and the kernel allows io_uring: containers often do
  not); the pool of threads reads otherwise."""
  if _kernel() is None:
    return False
  ready = getattr(_library(), "TpeReadRingReady", None)
  return ready is not None and bool(ready())


def open_direct(path: str) -> int:
  """A read-only descriptor of ``path`` that reads past the page cache
  (``O_DIRECT``), for ``read_runs``; -1 where the kernel library or the
  file system has none (the reads then go through the page cache)."""
  if _kernel() is None or not hasattr(os, "O_DIRECT"):
    return -1
  try:
    return os.open(path, os.O_RDONLY | os.O_DIRECT)
  except OSError:  # (tmpfs and some others refuse it)
    return -1


def read_runs(
  fd: int,
  offsets: Sequence[int],
  sizes: Sequence[int],
  dest: np.ndarray,
  direct_fd: int = -1,
) -> None:
  """Reads ``sizes[i]`` bytes at ``offsets[i]`` of ``fd`` into ``dest``
  (contiguous, writable), one run after another (through ``direct_fd``,
  the same file's ``open_direct``, where it is not -1).

  Raises:
    OSError: the first read's failure (``EIO`` past the end of the file).
  """
  if not len(offsets):
    return
  at = np.ascontiguousarray(offsets, np.int64)
  lengths = np.ascontiguousarray(sizes, np.int64)
  starts = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64)
  if int(lengths.sum()) > dest.nbytes:
    raise ValueError(f"{int(lengths.sum())} bytes do not fit {dest.nbytes}")
  kernel = _kernel()
  if kernel is None:
    _read_in_python(fd, at, lengths, starts, dest)
    return
  arrays = (at, lengths, starts, dest)
  failed = kernel(
    fd, direct_fd, int(USE_RING), at.size, *(_address(a) for a in arrays)
  )
  if failed:
    raise OSError(failed, f"reading a table's file: {os.strerror(failed)}")


def _address(array: np.ndarray) -> int:
  return array.ctypes.data  # (an int: half the cost of a c_void_p)


def _read_in_python(
  fd: int,
  offsets: np.ndarray,
  sizes: np.ndarray,
  starts: np.ndarray,
  dest: np.ndarray,
) -> None:
  """The same reads, every page asked for first, then in order."""
  columns = (offsets.tolist(), sizes.tolist(), starts.tolist())
  runs = list(zip(*columns, strict=True))
  for offset, size, _ in runs:
    os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)
  view = dest.reshape(-1).view(np.uint8).data
  for offset, size, start in runs:
    done = 0
    while done < size:
      n = os.preadv(fd, [view[start + done : start + size]], offset + done)
      if n == 0:
        raise OSError(errno.EIO, "reading a table's file: past its end")
      done += n
