"""What state spread over the workers saves: its parts, slices or whole values.

No process holds a table sharded over several workers whole (nor a
sharded vocabulary's state): they declare their parts (``WorkerParts``),
which ``parts.PartWriter`` writes. Inside ``sliced()`` (which
``tpu_embedding.checkpoints`` enters for every save and restore) they save
and restore only this worker's rows, as slices of the full
``[vocabulary_size, dim]`` tensor; outside (a plain ``tf.train.Checkpoint``
save, which each worker writes on its own) they gather the whole value on
every worker so that the chief's file is complete, and warn once for a
large table that this costs a whole table of memory per worker.

Example:
  >>> with sliced():
  ...   active(), apart()
  (True, False)
  >>> active()
  False
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from tpu_embedding import compat

#: One tensor of a part: ``(checkpoint key, slice spec or "", value)``.
Entry = tuple[str, str, Any]

#: Tables at least this large warn when saved whole on every worker.
LARGE_TABLE_BYTES = 64 * 2**20

#: None, "slices", "apart" or "rows" on each thread (replicas trace in
#: threads of their own): ``_mode.value``.
_mode = threading.local()
_warned: set[str] = set()


@contextlib.contextmanager
def _set_mode(mode: str) -> Iterator[None]:
  """``mode`` on this thread inside the block; the previous one after."""
  previous = _get_mode()
  _mode.value = mode
  try:
    yield
  finally:
    _mode.value = previous


def _get_mode() -> str | None:
  return getattr(_mode, "value", None)


def sliced() -> contextlib.AbstractContextManager[None]:
  """Multi-worker tables restore (and save) each worker's own rows."""
  return _set_mode("slices")


def written_apart() -> contextlib.AbstractContextManager[None]:
  """Multi-worker tables are recorded in a save but write no data.

  ``tpu_embedding.checkpoints.write`` writes their rows itself, in chunks,
  so that no process copies a whole block at once.
  """
  return _set_mode("apart")


def rows_apart() -> contextlib.AbstractContextManager[None]:
  """Tables are written by their changed rows (a delta checkpoint,
  ``checkpointing/deltas.py``): their whole values are never read,
  and multi-worker state gives this worker's slices."""
  return _set_mode("rows")


def rows() -> bool:
  """Whether ``rows_apart()`` is in effect on this thread."""
  return _get_mode() == "rows"


def active() -> bool:
  """Whether ``sliced()`` or ``written_apart()`` is in effect here."""
  return _get_mode() is not None


def apart() -> bool:
  """Whether ``written_apart()`` is in effect on this thread."""
  return _get_mode() == "apart"


def recorded_only(dtype: tf.DType, device: str) -> Any:
  """A save entry that records a key and writes no data (``apart()``:
  ``checkpoints.write`` writes the parts itself). ``device``: where the
  state lives (a device no other entry has would make an empty save)."""
  return compat.SaveSpec(lambda: None, "", "", dtype=dtype, device=device)


class WorkerParts(abc.ABC):
  """State spread over the workers that ``tpu_embedding.checkpoints.write``
  saves as parts: every worker writes its own (``saved_parts``) while the
  chief's part only records the keys (``written_apart()``)."""

  @property
  @abc.abstractmethod
  def strategy(self) -> tf.distribute.Strategy:
    """The ``MultiWorkerMirroredStrategy`` the state lives under."""

  @property
  @abc.abstractmethod
  def worker_index(self) -> int:
    """This worker's index (0 is the chief)."""

  @property
  @abc.abstractmethod
  def worker_count(self) -> int:
    """Workers holding parts of the state."""

  @property
  def written_in_parts(self) -> bool:
    """Whether a save writes it by parts: state spread over workers, or
    too large to hold whole (a disk-tiered table)."""
    return self.worker_count > 1

  @abc.abstractmethod
  def saved_parts(
    self, keys: list[str], chunk_bytes: int | None = None
  ) -> Iterable[tuple[str, list[Entry]]]:
    """``(name, entries)`` of each part this worker writes of the
    checkpoint keys ``keys`` (this object's keys, in serialization
    order), read as they are written; every worker iterates at once
    (collectives allowed). ``chunk_bytes``: the most bytes of rows copied
    at once, where the state is written in chunks (None: the state's
    default)."""


def warn_whole(table: str, shape: tf.TensorShape) -> None:
  """Warns once that a large multi-worker table is gathered whole."""
  size = shape.num_elements() * 4
  if size < LARGE_TABLE_BYTES or table in _warned:
    return
  _warned.add(table)
  logging.getLogger("tpu_embedding").warning(
    "Table '%s' (%.0f MiB) is sharded over several workers, but a plain "
    "tf.train.Checkpoint save or restore gathers it whole on every worker. "
    "Use tpu_embedding.checkpoints.save/restore (or its CheckpointManager) "
    "on every worker with the same path: each worker then writes and reads "
    "only its own rows.",
    table,
    size / 2**20,
  )
