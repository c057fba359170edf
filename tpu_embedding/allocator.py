"""Large buffers go straight back to the operating system when freed.

Embedding tables, their checkpoint slices and the chunks a restore reads
are tens to hundreds of MiB each. With glibc's default *dynamic* mmap
threshold, freeing one large mmapped buffer raises the threshold (up to 32
MiB), so later buffers of that size come from the heap, where freed memory
stays resident: measured here, a worker restoring its half of a 3,000,000 x
64 Adagrad table peaked at 0.70-0.77x of the whole table's state instead of
0.52x (``tests/test_memory.py``). Fixing the threshold at
``THRESHOLD_BYTES`` keeps every buffer of that size or more in its own
mapping, returned on free, so peak memory follows what is live.

Importing the package changes nothing: the setting is applied where
tables are built (``backends/stacks.create_stacked_tables``, before the
first table buffer is allocated), once per process, glibc only, unless
the user set ``MALLOC_MMAP_THRESHOLD_`` (then glibc uses theirs) or
``TPU_EMBEDDING_MALLOC_TUNING=0`` (glibc's default dynamic threshold).
A parameter-server task holds tables the coordinator builds, so no
build applies it there: ``servers.serve`` does, before it starts the
task's ``tf.distribute.Server``.

Example:
  >>> from tpu_embedding import allocator
  >>> allocator.THRESHOLD_BYTES // 2**20
  8
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: Buffers this large or larger are mapped (and unmapped when freed).
THRESHOLD_BYTES = 8 * 2**20

#: glibc's ``mallopt`` parameter for the mmap threshold (malloc.h).
_M_MMAP_THRESHOLD = -3


_applied: bool | None = None


def applied() -> bool:
  """Whether this process's mmap threshold was fixed by this module."""
  return bool(_applied)


def return_large_buffers() -> bool:
  """Fixes glibc's mmap threshold at ``THRESHOLD_BYTES`` (once a process).

  Returns:
    True if applied; False where it does not apply (not glibc, set by the
    user, or turned off with ``TPU_EMBEDDING_MALLOC_TUNING=0``).
  """
  global _applied
  if _applied is None:
    _applied = _set_threshold()
  return _applied


def _set_threshold() -> bool:
  if os.environ.get("TPU_EMBEDDING_MALLOC_TUNING", "1") == "0":
    return False
  if "MALLOC_MMAP_THRESHOLD_" in os.environ:
    return False
  name = ctypes.util.find_library("c")
  if name is None or "libc.so" not in name:
    return False
  try:
    libc = ctypes.CDLL(name)
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  mallopt.restype = ctypes.c_int
  return mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1
