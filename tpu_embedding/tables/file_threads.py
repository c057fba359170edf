"""The threads that do disk-tiered tables' file work in the background.

Every table of a process shares them: one thread writes back evicted
rows and drops pages from the page cache, in the order asked (so each
table's writes land in order), and a few start read-aheads
(``row_staging``). Fewer threads than two per table means fewer of them
contending for Python's GIL and fewer context switches a step. They start
on first use, never on import, and a forked child starts its own (a
parent's threads do not survive ``fork``).

Example:
  >>> pool("doc-example", 1).submit(sum, [1, 2]).result()
  3
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

_pools: dict[tuple[str, int, int], concurrent.futures.ThreadPoolExecutor] = {}
_lock = threading.Lock()


def pool(name: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
  """The process's pool ``name`` of ``threads`` threads, started on first
  use (its threads are named ``tpe-<name>``)."""
  key = (name, threads, os.getpid())
  with _lock:
    if key not in _pools:
      _pools[key] = concurrent.futures.ThreadPoolExecutor(
        threads, thread_name_prefix=f"tpe-{name}"
      )
    return _pools[key]
