"""A table larger than memory: rows on a local disk, a bounded RAM cache.

``TieredTable`` keeps a fixed number of rows (and their optimizer slots)
in ordinary variables, the cache; every other row lives in files on a
local disk (``row_cache.RowCache``: which row has which slot, least
recently used rows evicted, changed rows written back). A step's lookup
first admits its distinct ids (their rows read from the files, or from
their initial values on first touch), then gathers from the cache; the
update applies the optimizer to the cached rows with the same rule and
kernels as a whole table (``updates.apply_rows``), so tables and slots
are bit-identical to the in-memory layouts after the same steps.

Checkpoints see ``<table>`` and ``<table>/<slot>`` with their full
``[vocabulary_size, dim]`` values, like every layout.

A 16-bit table (``RowStorage``) keeps its cache in the stored types (twice
the rows for the bytes) and its files in float32 holding values exact in
those types (a miss costs one random read either way): rows are rounded
to their type where they enter the files (initial values and restores to
nearest, as the in-memory layouts' are), and updates round by global row
(``rounding.CachedRowsRounding``), so the numbers are the in-memory
layouts' bit for bit. Checkpoints hold such a table in float32.

Example:
  >>> import tempfile
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.resolved import resolve
  >>> from tpu_embedding.tracking import VariableTracker
  >>> table = resolve(tpe.FeatureConfig(tpe.TableConfig(1000, 4, name="t",
  ...     initializer=tpe.RowIdInitializer())), tpe.SGD(0.5)).tables[0]
  >>> store = TieredTable.create(
  ...     table, tempfile.mkdtemp(), 8, VariableTracker(tf.Module()))
  >>> store.gather(tf.constant([999, 3], tf.int64)).numpy()[:, 0].tolist()
  [999.0, 3.0]
  >>> from tpu_embedding.gradients import RowGradients
  >>> store.update(tf.constant([3], tf.int64),
  ...              RowGradients.dense(tf.ones([1, 4])))
  >>> store.read().numpy()[[3, 4], 0].tolist()
  [2.5, 4.0]
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import weakref
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding import run_lock
from tpu_embedding.checkpointing import parts
from tpu_embedding.checkpointing import rows
from tpu_embedding.checkpointing import slicing
from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import PickedRows
from tpu_embedding.gradients import RowGradients
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.lookup import RowRequest
from tpu_embedding.resolved import table_name
from tpu_embedding.row_storage import decode
from tpu_embedding.tables.base import VALUE_KEY
from tpu_embedding.tables.base import Block
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.base import WholeValueVariable
from tpu_embedding.tables.base import checkpoint_name
from tpu_embedding.tables.base import variable_specs
from tpu_embedding.tables.initial_values import grid_rows
from tpu_embedding.tables.initial_values import row_values
from tpu_embedding.tables.rounding import BlockRounding
from tpu_embedding.tables.rounding import CachedRowsRounding
from tpu_embedding.tables.row_cache import CacheCounts
from tpu_embedding.tables.row_cache import CacheTooSmallError
from tpu_embedding.tables.row_cache import RowCache
from tpu_embedding.tables.row_files import DiskFullError
from tpu_embedding.tables.update_guards import UNGUARDED
from tpu_embedding.tables.update_guards import UpdateGuard
from tpu_embedding.tracking import VariableTracker


class TieredTable(TableStore):
  """Rows on disk behind a cache of ``cache_rows`` rows in variables."""

  layout = "tiered"

  def __init__(
    self,
    table: TableConfig,
    cache: Block,
    directory: str,
    guard: UpdateGuard = UNGUARDED,
    rows: tuple[int, int] | None = None,
    tier: str | None = None,
  ):
    """Wraps ``cache`` (``{key: [cache rows, dim] variable}``); the files
    go to ``directory``, made empty. ``rows``: ``(first, count)``, the
    rows of ``table`` it holds as its rows ``[0, count)`` (None: all; a
    row block of ``tiered_sharded.TieredShardedTable``); ``tier``: the
    DiskTier directory its errors name (None: ``directory``'s parent)."""
    self.table = table
    self._first, self._count = rows or (0, table.vocabulary_size)
    self._last: weakref.WeakKeyDictionary[tf.Graph, tf.Tensor] = (
      weakref.WeakKeyDictionary()
    )
    shape = (table.vocabulary_size, table.dim)
    self._stored = {key: variable.dtype for key, variable in cache.items()}
    self._initial = {
      key: row_values(
        initializer, shape, checkpoint_name(table_name(table), key)
      )
      for key, initializer, _ in variable_specs(table)
    }
    self._rows = RowCache(
      directory,
      self._count,
      table.dim,
      int(cache["parameters"].shape[0]),
      list(cache),
      grid_rows(table.dim),
      self._initial_block,
      (table_name(table), tier or os.path.dirname(directory)),
    )
    variables = {key: _TieredVariable(self, key) for key in cache}
    super().__init__(table, variables, [cache], guard)

  @classmethod
  def create(
    cls,
    table: TableConfig,
    directory: str,
    cache_rows: int,
    tracker: VariableTracker,
    guard: UpdateGuard = UNGUARDED,
  ) -> TieredTable:
    """A tiered store of ``table``, its files in ``directory/<table>``.

    Raises:
      ValueError: for an optimizer that changes every row each step (the
        whole table would cross the disk every step) or slots the
        optimizer's function makes.
    """
    cache = cache_variables(table, cache_rows)
    files, lock = _own_directory(directory, table_name(table))
    store = cls(table, cache, files, guard)
    weakref.finalize(store, _release, files, lock)
    store.track(tracker)
    return store

  # --- the cache ------------------------------------------------------------

  @property
  def cache(self) -> RowCache:
    """The host's map of cached rows (hit and miss counts)."""
    return self._rows

  def block_rows(self, block: int) -> tuple[int, int]:
    return 0, self._rows.size  # The cache's slots.

  def _block_rounding(self, block: int, device: str | None) -> BlockRounding:
    return CachedRowsRounding(self.table, self._first, self._rows.size, device)

  @property
  def block_rounding(self) -> BlockRounding:
    """How the cache rounds and counts its updates (by global row)."""
    return self._rounding[0]

  def _as_stored(self, key: str, value: Any) -> np.ndarray:
    """Float32 rows ``value`` of ``key`` as its stored type holds them
    (rounded to nearest; float32 as they are): what the files take."""
    rows: np.ndarray = np.asarray(value, np.float32)
    if self._stored[key] == tf.float32:
      return rows
    stored = tf.cast(tf.cast(rows, self._stored[key]), tf.float32)
    return np.asarray(stored.numpy())

  @property
  def reads_ahead(self) -> bool:
    return True

  def prefetch_rows(self, ids: Any) -> None:
    """Reads rows ``ids`` not cached ahead into RAM, in the background (a
    coming step's ids: ``data.prefetch_rows``); changes no number."""
    self._rows.prefetch(np.asarray(ids))

  def cache_counts(self) -> list[CacheCounts]:
    return [self._rows.counts()]

  def _admit(self, ids: tf.Tensor) -> tf.Tensor:
    """Caches rows ``ids`` (distinct): their slots, once their values are
    in the cache (evicted changed rows written back first)."""
    cache = self._blocks[0]
    keys = list(cache)
    with self._after_last():
      planned = tf.numpy_function(
        self._plan, [ids], [tf.int64] * 5, stateful=True, name="admit_rows"
      )
    slots, evicted_slots, evicted_rows, load_slots, load_rows = planned
    evicted = [decode(tf.gather(cache[key], evicted_slots)) for key in keys]
    loaded = tf.nest.flatten(  # (eager, one key: a tensor, not a list)
      tf.numpy_function(
        self._swap,
        [evicted_rows, load_rows, *evicted],
        [tf.float32] * len(keys),
        stateful=True,
        name="swap_rows",
      )
    )
    # (the rounding's map of slots to rows: where rows draw by global id)
    writes = self._rounding[0].cached(load_slots, load_rows)
    for key, value in zip(keys, loaded, strict=True):
      value.set_shape([None, self.table.dim])
      writes.append(
        tf.raw_ops.ResourceScatterUpdate(
          resource=cache[key].handle,
          indices=load_slots,
          updates=tf.cast(value, cache[key].dtype),  # (exact: as stored)
        )
      )
    with tf.control_dependencies(writes):
      return self._last_is(tf.reshape(slots, tf.shape(ids)))

  @contextlib.contextmanager
  def _after_last(self) -> Iterator[None]:
    """Orders the host's cache work of one traced function: each call
    runs after the previous one's (the host map is one state)."""
    graph = tf.compat.v1.get_default_graph()
    last = None if tf.executing_eagerly() else self._last.get(graph)
    with tf.control_dependencies([] if last is None else [last]):
      yield

  def _last_is(self, value: tf.Tensor) -> tf.Tensor:
    value = tf.identity(value)
    if not tf.executing_eagerly():
      self._last[tf.compat.v1.get_default_graph()] = value
    return value

  def _plan(self, ids: np.ndarray) -> list[np.ndarray]:
    admitted = self._rows.admit(ids)
    return [
      admitted.slots,
      admitted.evicted_slots,
      admitted.evicted_rows,
      admitted.load_slots,
      admitted.load_rows,
    ]

  def _swap(
    self, evicted_rows: np.ndarray, load_rows: np.ndarray, *evicted: np.ndarray
  ) -> list[np.ndarray]:
    """Writes back the evicted rows (in the background), then reads the
    admitted ones: their values, one array per key."""
    self._rows.write_back(evicted_rows, evicted)
    return self._rows.load(load_rows)

  def _initial_block(self, key: str, first: int, count: int) -> np.ndarray:
    """Initial values of rows ``[first, first + count)`` (a grid block)."""
    return self._as_stored(
      key, self._initial[key].rows(self._first + first, count, tf.float32)
    )

  # --- the step ---------------------------------------------------------------

  def gather(
    self,
    ids: tf.Tensor,
    key: str = "parameters",
    ops: StepOps = TENSORFLOW_OPS,
  ) -> tf.Tensor:
    ids = tf.convert_to_tensor(ids, tf.int64)
    distinct, index = tf.unique(tf.reshape(ids, [-1]))
    slots = self._admit(distinct)
    rows = ops.gather_rows(self._blocks[0][key], tf.gather(slots, index))
    return tf.reshape(rows, tf.concat([tf.shape(ids), [self.table.dim]], 0))

  def gather_occurrences(
    self, request: RowRequest, ops: StepOps = TENSORFLOW_OPS
  ) -> PickedRows:
    slots = self._admit(request.ids)
    return ops.gather_occurrences(
      self._blocks[0]["parameters"], slots, request.index, request.one_per_row
    )

  def update(
    self,
    ids: tf.Tensor,
    grads: RowGradients,
    index: tf.Tensor | None = None,
    ops: StepOps = TENSORFLOW_OPS,
    step_id: tf.Tensor | None = None,
  ) -> None:
    """Applies the optimizer to the cached rows ``ids`` (those of the
    step's lookup: a row updated without one is admitted first)."""
    with self._after_last():
      slots = tf.numpy_function(
        self._rows.slots_of, [ids], tf.int64, stateful=True, name="row_slots"
      )
    slots = self._last_is(tf.reshape(slots, tf.shape(ids)))
    self.update_block(0, slots, grads, index, ops, step_id)

  # --- whole values -----------------------------------------------------------

  def flush(self) -> None:
    """Writes the cached rows that changed to the files, ``FLUSH_BYTES``
    of rows at a time (a whole cache's worth would be held twice)."""
    slots, rows = self._rows.changed_slots()
    variables = list(self._blocks[0].values())
    chunk = max(1, FLUSH_BYTES // (4 * self.table.dim * len(variables)))
    for at in range(0, slots.size, chunk):
      part = slots[at : at + chunk]
      values = [
        decode(tf.gather(variable, part)).numpy() for variable in variables
      ]
      self._rows.write_back(rows[at : at + chunk], values)
      self._rows.mark_written(part)
      del values
    self._rows.wait()

  def read(self, key: str = "parameters") -> tf.Tensor:
    """The whole value of ``key`` (the files, the cache's changed rows and
    the initial values of rows never written)."""
    return tf.py_function(lambda: self._whole(key), [], tf.float32)

  def _whole(self, key: str) -> np.ndarray:
    self.flush()
    return self.window(key, 0, self._count)

  def window(self, key: str, first: int, count: int) -> np.ndarray:
    """Rows ``[first, first + count)`` of ``key`` as the files hold them
    (after ``flush``)."""
    return self._rows.window(key, first, count)

  def assign(self, value: Any, key: str = "parameters", first: int = 0) -> Any:
    """Writes a whole value of ``key`` (or rows from ``first``: a stacked
    table's) to the files, grid block by grid block (the cache is
    emptied: its changed rows are written first; the other keys' rows
    never written get their initial values on disk)."""
    value = tf.convert_to_tensor(value, tf.float32)
    size = grid_rows(self.table.dim)
    self.assign_by_parts(
      key,
      (
        (first + start, value[start : start + size])
        for start in range(0, int(value.shape[0]), size)
      ),
    )
    return None

  def assign_by_parts(
    self, key: str, pieces: Iterable[tuple[int, Any]]
  ) -> None:
    """Writes ``(first row, rows)`` pieces of ``key`` to the files, one
    at a time (the cache is emptied first, its changed rows written)."""
    self.flush()
    self._rows.forget()
    self._rows.mark_changed()
    for first, value in _by_grid_blocks(pieces, grid_rows(self.table.dim)):
      self._rows.write_window(key, first, self._as_stored(key, value))
      del value

  def clear_changes(self) -> None:
    self._rows.clear_changed()

  def changed_rows(self) -> tf.Tensor:
    """Sorted ids of the rows updated or written since ``clear_changes()``
    (one bit per row on the host, set by every update)."""
    return _on_host(self._rows.changed_rows, [], tf.int64)

  def read_rows(self, ids: tf.Tensor, key: str = "parameters") -> tf.Tensor:
    """Rows ``ids`` of ``key`` as the files hold them after ``flush``
    (only those rows: a delta's values)."""

    def read(ids: tf.Tensor) -> np.ndarray:
      self.flush()
      return self._rows.stored(ids.numpy())[self._rows.keys.index(key)]

    return _on_host(read, [tf.cast(ids, tf.int64)], tf.float32)

  def write_rows_at(
    self, ids: tf.Tensor, value: Any, key: str = "parameters"
  ) -> Any:
    """Writes rows ``value`` at ``ids`` of ``key`` to the files (the cache
    is emptied first, its changed rows written); they count as written."""

    def write(ids: tf.Tensor, value: tf.Tensor) -> bool:
      self.flush()
      self._rows.forget()
      self._rows.write_rows(key, ids.numpy(), self._as_stored(key, value))
      return True

    ids = tf.convert_to_tensor(ids, tf.int64)
    return _on_host(write, [ids, tf.cast(value, tf.float32)], tf.bool)

  def bytes_per_device(self) -> dict[str, int]:
    """The cache's bytes (the rest is on disk)."""
    return super().bytes_per_device()

  def member_variable(self, table: TableConfig, key: str, offset: int) -> Any:
    """A stacked table's rows of ``key``, saved and restored by parts
    straight from and to the files, as a table's own."""
    return _TieredVariable(self, key, table, offset)

  def peek(self, ids: tf.Tensor, key: str = "parameters") -> tf.Tensor:
    """Rows ``ids`` of ``key``, in id order, without admitting them:
    cached rows from the cache, the others as the files hold them. The
    cache's map, counts and changed rows stay as they are (serving and
    evaluation lookups: ``base.row_reader``)."""
    ids = tf.convert_to_tensor(ids, tf.int64)
    with self._after_last():
      slots, stored = tf.numpy_function(
        lambda ids: self._rows.peek(key, ids),
        [tf.reshape(ids, [-1])],
        [tf.int64, tf.float32],
        stateful=True,
        name="peek_rows",
      )
    cached = decode(tf.gather(self._blocks[0][key], tf.maximum(slots, 0)))
    rows = self._last_is(tf.where((slots >= 0)[:, None], cached, stored))
    return tf.reshape(rows, tf.concat([tf.shape(ids), [self.table.dim]], 0))


#: The most bytes of changed rows a flush copies from the cache at once.
FLUSH_BYTES = 32 * 2**20


def _by_grid_blocks(
  pieces: Iterable[tuple[int, Any]], grid: int
) -> Iterator[tuple[int, np.ndarray]]:
  """``(first row, rows)`` pieces regrouped to end at grid block edges
  (a piece that does not continue the one before starts anew), so that
  the files get a block's rows in one write where the pieces cover it.

  Example:
    >>> rows = np.zeros([3, 1])
    >>> pieces = [(0, rows), (3, rows), (9, rows[:1])]
    >>> [(first, len(rows)) for first, rows in _by_grid_blocks(pieces, 4)]
    [(0, 4), (4, 2), (9, 1)]
  """
  start, pending = 0, list[np.ndarray]()
  for first, piece in pieces:
    value = np.asarray(piece, np.float32)
    held = sum(len(p) for p in pending)
    if pending and first != start + held:
      yield start, _joined(pending)
      pending, held = [], 0
    if not pending:
      start = first
    pending.append(value)
    edge = (first + len(value)) // grid * grid
    if edge > start:
      joined = _joined(pending)
      yield start, joined[: edge - start]
      rest = joined[edge - start :]
      start, pending = edge, [rest] if len(rest) else []
  if pending:
    yield start, _joined(pending)


def _joined(pieces: list[np.ndarray]) -> np.ndarray:
  """The rows of ``pieces`` in one array (a lone piece itself: no copy)."""
  return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def _on_host(function: Any, inputs: list[Any], dtype: tf.DType) -> Any:
  """``function(*inputs)`` (tensors to numpy): run now when eager (its
  errors raised as they are), else a ``tf.py_function`` of the graph."""
  if tf.executing_eagerly():
    return tf.constant(function(*inputs), dtype)
  return tf.py_function(function, inputs, dtype)


def own_error(
  error: BaseException,
) -> CacheTooSmallError | DiskFullError | None:
  """The error of a tiered table ``error`` is, or carries: inside a step,
  TensorFlow hands the error of a host function on within its own
  (``tf.numpy_function``), as a line ``<module>.<class>: <message>``.
  A cache too small or a full disk, alone: one line naming the table and
  its DiskTier directory; None for any other error.

  Example:
    >>> error = tf.errors.UnknownError(None, None, "Graph execution error:"
    ...   "\\ntpu_embedding.tables.row_cache.CacheTooSmallError: Table 't'")
    >>> str(own_error(error))
    "Table 't'"
    >>> own_error(ValueError("Table 't'")) is None
    True
  """
  if isinstance(error, (CacheTooSmallError, DiskFullError)):
    return error
  if not isinstance(error, tf.errors.OpError):
    return None
  for line in error.message.splitlines():
    for kind in (CacheTooSmallError, DiskFullError):
      name = f"{kind.__module__}.{kind.__qualname__}: "
      if line.startswith(name):
        text = line[len(name) :]
        if kind is DiskFullError:
          return DiskFullError(errno.ENOSPC, text)
        return CacheTooSmallError(text)
  return None


def cached_row_bytes(table: TableConfig) -> int:
  """Bytes a cache slot of ``table`` takes: its row and slots in their
  stored types (``RowStorage``), and a 16-bit cache's map entry (the
  slot's global row, 8 bytes: ``rounding.CachedRowsRounding``).

  Example:
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.resolved import resolve
    >>> def row_bytes(storage):
    ...   table = tpe.TableConfig(10, 8, name="t", storage=storage)
    ...   resolved = resolve(tpe.FeatureConfig(table), tpe.Adagrad(0.1))
    ...   return cached_row_bytes(resolved.tables[0])
    >>> row_bytes(tpe.RowStorage()), row_bytes(tpe.RowStorage("bfloat16"))
    (64, 56)
  """
  values: int = sum(
    table.dim * int(table.storage.stored_dtype(stream).size)
    for stream in range(len(variable_specs(table)))
  )
  return values + (0 if table.storage.is_float32 else 8)


def cache_variables(
  table: TableConfig, cache_rows: int, part: str = ""
) -> Block:
  """A cache of ``cache_rows`` rows of ``table``: ``{key: variable}`` of
  its parameters and slots, on the device in scope (``part``: the name
  of a row block's, ``part_<replica>``).

  Raises:
    ValueError: for an optimizer that changes every row each step (the
      whole table would cross the disk every step) or slots the
      optimizer's function makes.
  """
  optimizer = table.optimizer
  name = table_name(table)
  if optimizer is not None and optimizer.updates_all_rows:
    raise ValueError(
      f"Table '{name}': {type(optimizer).__name__} updates every row "
      "each step; a disk-tiered table needs an optimizer that updates "
      "only the looked-up rows (e.g. Adam(lazy_adam=True))."
    )
  if optimizer is not None and optimizer.slot_variable_creation_fn:
    raise ValueError(
      f"Table '{name}': a disk-tiered table makes its own slots; "
      "slot_variable_creation_fn is not supported."
    )
  cache: Block = {}
  for stream, (key, _, trainable) in enumerate(variable_specs(table)):
    cache[key] = compat.ResourceVariable(
      tf.zeros([cache_rows, table.dim], table.storage.stored_dtype(stream)),
      name="/".join(filter(None, [checkpoint_name(name, key), part, "cache"])),
      trainable=trainable,
    )
  return cache


#: The tiered tables' directories this process writes.
_IN_USE: set[str] = set()


def _own_directory(directory: str, table: str) -> tuple[str, Any]:
  """``directory/<table>``, made and locked for this store alone, and
  its lock.

  Raises:
    ValueError: for a remote, unwritable or already used directory.
  """
  if "://" in directory:
    raise ValueError(
      f"Table '{table}': DiskTier directory {directory!r} is not local; "
      "a disk-tiered table needs a local disk (an SSD)."
    )
  path = os.path.realpath(os.path.join(directory, table))
  if path in _IN_USE:
    raise ValueError(
      f"Table '{table}': {path} holds another disk-tiered table of this "
      "process; give each TPUEmbedding its own DiskTier directory."
    )
  try:
    lock = run_lock.RunLock(
      path, "give each process its own DiskTier directory"
    ).acquire()
  except OSError as error:
    raise ValueError(
      f"Table '{table}': cannot write DiskTier directory {path} "
      f"({error.strerror or error})."
    ) from None
  _IN_USE.add(path)
  return path, lock


def _release(path: str, lock: Any) -> None:
  """A tiered store's directory, free again (the store is gone)."""
  _IN_USE.discard(path)
  lock.release()


class _TieredVariable(WholeValueVariable, slicing.WorkerParts, rows.RowBlocks):
  """What users and checkpoints see of a tiered table's variable.

  ``tpu_embedding.checkpoints`` (and its ``CheckpointManager``) save it
  in chunks of rows and restore it part by part, straight to and from
  the files: never whole. A plain ``tf.train.Checkpoint`` reads it whole.
  """

  def __init__(
    self,
    store: TieredTable,
    key: str,
    table: TableConfig | None = None,
    offset: int = 0,
  ):
    """``key``'s rows of ``table`` (default: the store's own), held from
    row ``offset`` of the store (a stacked table's)."""
    self._store = store
    self._key = key
    self._table = table or store.table
    self._offset = offset
    self.name = checkpoint_name(table_name(self._table), key)

  @property
  def shape(self) -> tf.TensorShape:
    return tf.TensorShape([self._table.vocabulary_size, self._table.dim])

  @property
  def dtype(self) -> tf.DType:
    return tf.float32

  def read_value(self) -> tf.Tensor:
    value = tf.py_function(self._window, [], tf.float32)
    value.set_shape(self.shape)
    return value

  def _window(self) -> np.ndarray:
    self._store.flush()
    return self._store.window(self._key, self._offset, self.shape[0])

  def assign(self, value: Any) -> Any:
    return self._store.assign(value, self._key, self._offset)

  # Saved by parts (slicing.WorkerParts), one process.

  @property
  def strategy(self) -> tf.distribute.Strategy:
    return tf.distribute.get_strategy()

  @property
  def worker_index(self) -> int:
    return 0

  @property
  def worker_count(self) -> int:
    return 1

  @property
  def written_in_parts(self) -> bool:
    return True

  def _serialize_to_tensors(self) -> dict[str, Any]:
    if slicing.apart():  # Recorded; checkpoints.write writes the rows.
      device = self._store.blocks[0][self._key].device
      return {VALUE_KEY: slicing.recorded_only(self.dtype, device)}
    if not slicing.rows():  # (a delta reads only its rows)
      self._warn_whole()
    return super()._serialize_to_tensors()

  def saved_parts(
    self, keys: list[str], chunk_bytes: int | None = None
  ) -> Iterator[tuple[str, list[slicing.Entry]]]:
    """The rows in chunks, each a slice of the full tensor."""
    (key,) = keys
    full = self.shape.as_list()
    chunk = parts.chunk_rows(full[0], full[1], chunk_bytes)
    self._store.flush()
    for first in range(0, full[0], chunk):
      count = min(chunk, full[0] - first)
      value = self._store.window(self._key, self._offset + first, count)
      spec = parts.slice_spec(full, [(first, count), (0, full[1])])
      yield f"{first:012d}", [(key, spec, value)]
      del value

  # Restored by parts (rows.RowBlocks), into the files.

  def row_blocks(self) -> list[tuple[tf.Variable, int]]:
    return []  # No variables: ``restore_rows`` writes the files.

  def restore_rows(
    self, saved: rows.SavedRows, key: str, chunk_bytes: int | None = None
  ) -> None:
    full = self.shape.as_list()
    pieces = saved.read_float32_rows(
      key, full, 0, full[0], tf.float32, chunk_bytes
    )
    self._store.assign_by_parts(
      self._key, ((self._offset + first, value) for first, value in pieces)
    )

  def _restore_from_tensors(
    self, restored_tensors: Mapping[str, tf.Tensor]
  ) -> Any:
    self._warn_whole()  # (TensorFlow has read the value whole already)
    return super()._restore_from_tensors(restored_tensors)

  def _warn_whole(self) -> None:
    """Warns once that a plain ``tf.train.Checkpoint`` save or restore of
    this built table holds its value whole, where that is large."""
    size = self.shape.num_elements() * 4
    table = self.name.split("/")[0]
    if size < slicing.LARGE_TABLE_BYTES or table in _WARNED:
      return
    _WARNED.add(table)
    logging.getLogger("tpu_embedding").warning(
      "Table '%s' is kept on disk, but a plain tf.train.Checkpoint save or "
      "restore of the built table holds each of its values (%.0f MiB) whole "
      "in memory. Use tpu_embedding.checkpoints.write/restore (or its "
      "CheckpointManager), or restore before build(): they stream it.",
      table,
      size / 2**20,
    )


#: The disk tables' values warned of by ``_TieredVariable._warn_whole``.
_WARNED: set[str] = set()
