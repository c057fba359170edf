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
  >>> store.update(tf.constant([3], tf.int64), tf.ones([1, 4]))
  >>> store.read().numpy()[[3, 4], 0].tolist()
  [2.5, 4.0]
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import PickedRows
from tpu_embedding.gradients import RowGradients
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.lookup import RowRequest
from tpu_embedding.resolved import table_name
from tpu_embedding.tables.base import Block
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.base import WholeValueVariable
from tpu_embedding.tables.base import checkpoint_name
from tpu_embedding.tables.base import variable_specs
from tpu_embedding.tables.initial_values import grid_rows
from tpu_embedding.tables.initial_values import row_values
from tpu_embedding.tables.row_cache import RowCache
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
    rows: RowCache,
    guard: UpdateGuard = UNGUARDED,
  ):
    self.table = table
    self._rows = rows
    self._last: weakref.WeakKeyDictionary[tf.Graph, tf.Tensor] = (
      weakref.WeakKeyDictionary()
    )
    shape = (table.vocabulary_size, table.dim)
    self._initial = {
      key: row_values(initializer, shape, checkpoint_name(table.name, key))
      for key, initializer, _ in variable_specs(table)
    }
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
    specs = variable_specs(table)
    cache: Block = {}
    for key, _, trainable in specs:
      cache[key] = compat.ResourceVariable(
        tf.zeros([cache_rows, table.dim]),
        name=f"{checkpoint_name(name, key)}/cache",
        trainable=trainable,
      )
    files = os.path.join(directory, name)
    os.makedirs(files, exist_ok=True)
    rows = RowCache(
      files,
      table.vocabulary_size,
      table.dim,
      cache_rows,
      [key for key, _, _ in specs],
    )
    store = cls(table, cache, rows, guard)
    store.track(tracker)
    return store

  # --- the cache ------------------------------------------------------------

  @property
  def cache(self) -> RowCache:
    """The host's map of cached rows (hit and miss counts)."""
    return self._rows

  def block_rows(self, block: int) -> tuple[int, int]:
    return 0, self._rows.size  # The cache's slots.

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
    evicted = [tf.gather(cache[key], evicted_slots) for key in keys]
    written = tf.numpy_function(
      self._write_back,
      [evicted_rows, *evicted],
      tf.bool,
      stateful=True,
      name="write_back_rows",
    )
    with tf.control_dependencies([written]):
      loaded = tf.py_function(
        self._load, [load_rows], [tf.float32] * len(keys), name="read_rows"
      )
    writes = []
    for key, value in zip(keys, loaded, strict=True):
      value.set_shape([None, self.table.dim])
      writes.append(
        tf.raw_ops.ResourceScatterUpdate(
          resource=cache[key].handle, indices=load_slots, updates=value
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

  def _write_back(self, rows: np.ndarray, *values: np.ndarray) -> np.bool_:
    self._rows.write_back(rows, values)
    return np.bool_(True)

  def _load(self, load_rows: tf.Tensor) -> list[np.ndarray]:
    """Values of the rows ``_plan`` admitted, one array per key."""
    rows = load_rows.numpy()
    stored = self._rows.stored(rows)
    values = []
    for key in self._rows.keys:
      value = np.empty([rows.size, self.table.dim], np.float32)
      if stored.any():
        value[stored] = self._rows.read(key, rows[stored])
      if not stored.all():
        value[~stored] = self._initial_rows(key, rows[~stored])
      values.append(value)
    return values

  def _initial_rows(self, key: str, rows: np.ndarray) -> np.ndarray:
    """Initial values of ``rows``, from the grid blocks holding them."""
    size = grid_rows(self.table.dim)
    out = np.empty([rows.size, self.table.dim], np.float32)
    blocks = rows // size
    for block in np.unique(blocks):
      first = int(block) * size
      count = min(size, self.table.vocabulary_size - first)
      mine = blocks == block
      value = self._initial[key].rows(first, count, tf.float32).numpy()
      out[mine] = value[rows[mine] - first]
    return out

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
    """Writes the cached rows that changed to the files."""
    slots, rows = self._rows.changed_slots()
    if slots.size:
      values = [
        tf.gather(variable, slots).numpy()
        for variable in self._blocks[0].values()
      ]
      self._rows.write_back(rows, values)
      self._rows.mark_written(slots)

  def read(self, key: str = "parameters") -> tf.Tensor:
    """The whole value of ``key`` (the files, the cache's changed rows and
    the initial values of rows never written)."""
    return tf.py_function(lambda: self._whole(key), [], tf.float32)

  def _whole(self, key: str) -> np.ndarray:
    self.flush()
    value = np.empty([self.table.vocabulary_size, self.table.dim], np.float32)
    size = grid_rows(self.table.dim)
    for first in range(0, self.table.vocabulary_size, size):
      count = min(size, self.table.vocabulary_size - first)
      rows = np.arange(first, first + count)
      stored = self._rows.stored(rows)
      if not stored.all():
        value[first : first + count] = (
          self._initial[key].rows(first, count, tf.float32).numpy()
        )
      if stored.any():
        value[rows[stored]] = self._rows.read(key, rows[stored])
    return value

  def assign(self, value: Any, key: str = "parameters") -> Any:
    """Writes a whole value of ``key`` to the files, grid block by grid
    block (the cache is emptied: its changed rows are written first; the
    other keys' rows never written get their initial values on disk)."""
    self.flush()
    self._rows.forget()
    value = tf.convert_to_tensor(value, tf.float32)
    size = grid_rows(self.table.dim)
    for first in range(0, self.table.vocabulary_size, size):
      count = min(size, self.table.vocabulary_size - first)
      rows = np.arange(first, first + count)
      fresh = rows[~self._rows.stored(rows)]
      for other in self._rows.keys:
        if other != key and fresh.size:
          self._rows.write(other, fresh, self._initial_rows(other, fresh))
      self._rows.write(key, rows, value[first : first + count].numpy())
    return None

  def clear_changes(self) -> None:
    pass  # (delta checkpoints: see changed_rows)

  def changed_rows(self) -> tf.Tensor:
    raise NotImplementedError(
      f"Table '{self.table.name}' is disk-tiered: delta checkpoints do not "
      "cover it yet; save full checkpoints."
    )

  def bytes_per_device(self) -> dict[str, int]:
    """The cache's bytes (the rest is on disk)."""
    return super().bytes_per_device()


class _TieredVariable(WholeValueVariable):
  """What users and checkpoints see of a tiered table's variable."""

  def __init__(self, store: TieredTable, key: str):
    self._store = store
    self._key = key
    self.name = checkpoint_name(store.table.name, key)

  @property
  def shape(self) -> tf.TensorShape:
    return tf.TensorShape(
      [self._store.table.vocabulary_size, self._store.table.dim]
    )

  @property
  def dtype(self) -> tf.DType:
    return tf.float32

  def read_value(self) -> tf.Tensor:
    value = self._store.read(self._key)
    value.set_shape(self.shape)
    return value

  def assign(self, value: Any) -> Any:
    return self._store.assign(value, self._key)
