"""A per-thread value set for the duration of a ``with`` block.

Some behaviour depends on what the calling code is doing, not on an
argument that could be passed down through TensorFlow: whether a
checkpoint is written in slices (``checkpointing/slicing.py``). Replicas trace
in threads of their own, so the value is per thread.

Example:
  >>> mode = ThreadSetting(default="whole")
  >>> with mode.set("slices"):
  ...   inside = mode.get()
  >>> inside, mode.get()
  ('slices', 'whole')
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class ThreadSetting:
  """A value per thread, ``default`` until a ``set()`` block changes it.

  Args:
    default: the value outside every ``set()`` block.
  """

  def __init__(self, default: Any = None):
    self._local = threading.local()
    self._default = default

  def get(self) -> Any:
    """The value on this thread."""
    return getattr(self._local, "value", self._default)

  @contextlib.contextmanager
  def set(self, value: Any) -> Iterator[None]:
    """``value`` on this thread inside the block; the previous one after."""
    previous = self.get()
    self._local.value = value
    try:
      yield
    finally:
      self._local.value = previous
