"""A disk-tiered table row-sharded over replicas: each block its own files.

Replica ``r`` holds rows ``[offsets[r], offsets[r] + sizes[r])`` of the
table, as a ``RowShardedTable``'s block does (the same placement, so the
same ``split_ids`` and ``owned_rows``), but on a local disk behind its
own RAM cache: each block is a ``TieredTable`` of those rows, its files
under ``directory/<table>/block<r>``, its cache on the replica's device.
The reads a row exchange makes of a block in one step are cached
together (``gather_block_lists``); updates apply the optimizer to the
cached rows, so tables and slots are bit-identical to the in-memory
row-sharded layout after the same steps.

Users and checkpoints see each key as a ``WorkerShardedVariable`` of the
blocks: ``tpu_embedding.checkpoints`` writes and restores each block's
rows in chunks, as slices of the full ``[vocabulary_size, dim]`` tensor,
straight from and to its files (under ``MultiWorkerMirroredStrategy``
every worker its own blocks).

Example:
  >>> import tempfile
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.resolved import resolve
  >>> from tpu_embedding.sharding import ROW_SHARDED, placement
  >>> from tpu_embedding.tracking import VariableTracker
  >>> table = resolve(tpe.FeatureConfig(tpe.TableConfig(1000, 4, name="t",
  ...     initializer=tpe.RowIdInitializer())), tpe.SGD(0.5)).tables[0]
  >>> store = TieredShardedTable.create(
  ...     table, placement(table, ROW_SHARDED, 2), ["/cpu:0", "/cpu:0"], 0,
  ...     tempfile.mkdtemp(), 8, VariableTracker(tf.Module()),
  ...     tf.distribute.get_strategy())
  >>> store.gather(tf.constant([999, 3], tf.int64)).numpy()[:, 0].tolist()
  [999.0, 3.0]
  >>> store.update(tf.constant([3, 999], tf.int64),
  ...              RowGradients.dense(tf.ones([2, 4])))
  >>> store.read().numpy()[[3, 4, 999], 0].tolist()
  [2.5, 4.0, 998.5]
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tpu_embedding.checkpointing import rows as saved_rows
from tpu_embedding.checkpointing import slicing
from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import RowGradients
from tpu_embedding.gradients import concat_pieces
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.resolved import table_name
from tpu_embedding.sharding import TablePlacement
from tpu_embedding.tables.multi_worker import WorkerShardedVariable
from tpu_embedding.tables.rounding import BlockRounding
from tpu_embedding.tables.row_cache import CacheCounts
from tpu_embedding.tables.row_sharded import RowShardedTable
from tpu_embedding.tables.tiered import TieredTable
from tpu_embedding.tables.tiered import _own_directory
from tpu_embedding.tables.tiered import _release
from tpu_embedding.tables.tiered import cache_variables
from tpu_embedding.tables.update_guards import UNGUARDED
from tpu_embedding.tables.update_guards import UpdateGuard
from tpu_embedding.tracking import VariableTracker


class TieredShardedTable(RowShardedTable):
  """Row blocks over the replicas, each a ``TieredTable`` of its rows."""

  layout = "tiered_row_sharded"

  def __init__(
    self,
    table: TableConfig,
    placement: TablePlacement,
    blocks: list[TieredTable],
    first: int,
    strategy: tf.distribute.Strategy,
    guard: UpdateGuard = UNGUARDED,
  ):
    """Wraps ``blocks``, this process's, the first of global replica
    ``first``; ``strategy``: the one the replicas run under."""
    self._tiers = blocks
    self._strategy = strategy
    caches = [block.blocks[0] for block in blocks]
    super().__init__(table, placement, caches, first, guard)

  def _block_rounding(self, block: int, device: str | None) -> BlockRounding:
    # Each block's own tiered table rounds and counts its updates.
    return self._tiers[block].block_rounding

  @classmethod
  def create(  # type: ignore[override]  # (a directory and a cache)
    cls,
    table: TableConfig,
    placement: TablePlacement,
    devices: Sequence[str],
    first: int,
    directory: str,
    cache_rows: int,
    tracker: VariableTracker,
    strategy: tf.distribute.Strategy,
    guard: UpdateGuard = UNGUARDED,
  ) -> TieredShardedTable:
    """A block per device, its files in ``directory/<table>/block<r>``
    and a cache of ``cache_rows`` rows on the device.

    Raises:
      ValueError: as ``TieredTable.create``.
    """
    caches = []
    for local, device in enumerate(devices):
      with tf.device(device):
        caches.append(
          cache_variables(table, cache_rows, f"part_{first + local}")
        )
    files, lock = _own_directory(directory, table_name(table))
    blocks = []
    for local, cache in enumerate(caches):
      replica = first + local
      path = os.path.join(files, f"block{replica}")
      os.makedirs(path, exist_ok=True)
      rows = (placement.shard_offsets[replica], placement.shard_sizes[replica])
      blocks.append(
        TieredTable(table, cache, path, guard, rows, os.path.dirname(files))
      )
    store = cls(table, placement, blocks, first, strategy, guard)
    weakref.finalize(store, _release, files, lock)
    store.track(tracker)
    return store

  def _user_variable(self, key: str, shards: list[Any]) -> Any:
    return TieredBlocksVariable(
      self._strategy,
      [_BlockRows(self, block, key) for block in range(len(self._tiers))],
      self.placement,
      self._first,
    )

  def tier(self, block: int) -> TieredTable:
    """Local block ``block``: its rows' cache (hits, misses) and files."""
    return self._tiers[block]

  def cache_counts(self) -> list[CacheCounts]:
    return [count for tier in self._tiers for count in tier.cache_counts()]

  @property
  def reads_ahead(self) -> bool:
    return True

  def prefetch_rows(self, ids: Any) -> None:
    """Reads ahead, block by block, the rows of ``ids`` (global) that this
    process's blocks hold and do not cache (``TieredTable.prefetch_rows``
    of each block's own rows)."""
    ids = np.asarray(ids, np.int64).reshape([-1])
    for block, tier in enumerate(self._tiers):
      first, count = self.rows_of(block)
      mine = ids[(ids >= first) & (ids < first + count)]
      tier.prefetch_rows(mine - first)

  def rows_of(self, block: int) -> tuple[int, int]:
    """``(first global row, rows)`` of local block ``block``."""
    replica = self._first + block
    return (
      self.placement.shard_offsets[replica],
      self.placement.shard_sizes[replica],
    )

  def block_rows(self, block: int) -> tuple[int, int]:
    return self._tiers[block].block_rows(0)  # Its cache's slots.

  # --- the step ---------------------------------------------------------------

  def gather_block(
    self, block: int, rows: tf.Tensor, ops: StepOps = TENSORFLOW_OPS
  ) -> tf.Tensor:
    return self._tiers[block].gather(rows, ops=ops)

  def gather_block_lists(
    self,
    block: int,
    row_lists: Sequence[tf.Tensor],
    ops: StepOps = TENSORFLOW_OPS,
  ) -> list[tf.Tensor]:
    """One admission of every sender's rows (the cache keeps those of
    this step and the one before)."""
    sizes = [tf.size(rows) for rows in row_lists]
    found = self.gather_block(block, tf.concat(list(row_lists), 0), ops)
    return list(tf.split(found, sizes, num=len(row_lists)))

  def update_block(
    self,
    block: int,
    rows: tf.Tensor,
    grads: RowGradients,
    index: tf.Tensor | None = None,
    ops: StepOps = TENSORFLOW_OPS,
    step_id: tf.Tensor | None = None,
  ) -> None:
    self._tiers[block].update(rows, grads, index, ops, step_id)

  def gather(
    self,
    ids: tf.Tensor,
    key: str = "parameters",
    ops: StepOps = TENSORFLOW_OPS,
  ) -> tf.Tensor:
    return self._by_block(ids, lambda tier, rows: tier.gather(rows, key, ops))

  def peek(self, ids: tf.Tensor, key: str = "parameters") -> tf.Tensor:
    """Rows ``ids`` read without admitting them (``TieredTable.peek``)."""
    return self._by_block(ids, lambda tier, rows: tier.peek(rows, key))

  def _by_block(self, ids: tf.Tensor, read: Any) -> tf.Tensor:
    """Rows ``ids``, each block's read by ``read(its tier, its rows)``."""
    self._all_here()
    ids = tf.convert_to_tensor(ids, tf.int64)
    flat = tf.reshape(ids, [-1])
    positions, found = [], []
    for block, tier in enumerate(self._tiers):
      mine, rows = self._local(flat, block)
      positions.append(tf.cast(tf.where(mine)[:, 0], tf.int32))
      found.append(read(tier, rows))
    rows = tf.dynamic_stitch(positions, found)
    return tf.reshape(rows, tf.concat([tf.shape(ids), [self.table.dim]], 0))

  def update(
    self,
    ids: tf.Tensor,
    grads: RowGradients,
    index: tf.Tensor | None = None,
    ops: StepOps = TENSORFLOW_OPS,
    step_id: tf.Tensor | None = None,
  ) -> None:
    """Applies the optimizer to rows ``ids`` (global, distinct), each
    block to those it holds (cached by a lookup first)."""
    self._all_here()
    summed = concat_pieces(grads)
    if index is not None:
      summed = tf.math.unsorted_segment_sum(summed, index, tf.size(ids))
    for block in range(len(self._tiers)):
      mine, rows = self._local(ids, block)
      self.update_block(
        block,
        rows,
        RowGradients.dense(tf.boolean_mask(summed, mine)),
        ops=ops,
        step_id=step_id,
      )

  def _all_here(self) -> None:
    """Raises a RuntimeError where other workers hold some blocks."""
    if len(self._tiers) < len(self.placement.shard_sizes):
      raise RuntimeError(
        f"Table '{self.table.name}' is sharded over several workers: no "
        "process can read or update its rows alone. Use it inside "
        "strategy.run (every worker together)."
      )

  # --- whole values -----------------------------------------------------------

  def flush(self) -> None:
    """Writes every block's cached rows that changed to its files."""
    for tier in self._tiers:
      tier.flush()

  def clear_changes(self) -> None:
    for tier in self._tiers:
      tier.clear_changes()

  def changed_rows(self) -> tf.Tensor:
    return tf.concat(
      [
        tier.changed_rows() + self.rows_of(block)[0]
        for block, tier in enumerate(self._tiers)
      ],
      0,
    )

  def _local(self, ids: tf.Tensor, block: int) -> tuple[tf.Tensor, tf.Tensor]:
    """``(mine, rows)``: which of global ``ids`` local block ``block``
    holds, and those ids as its rows."""
    first, count = self.rows_of(block)
    mine = tf.logical_and(ids >= first, ids < first + count)
    return mine, tf.boolean_mask(ids, mine) - first

  def read_rows(self, ids: tf.Tensor, key: str = "parameters") -> tf.Tensor:
    """Rows ``ids`` (global, held by this process's blocks) of ``key``,
    block by block, each from its files (a delta's values)."""
    ids = tf.convert_to_tensor(ids, tf.int64)
    return tf.concat(
      [
        tier.read_rows(self._local(ids, block)[1], key)
        for block, tier in enumerate(self._tiers)
      ],
      0,
    )

  def write_rows_at(
    self, ids: tf.Tensor, value: Any, key: str = "parameters"
  ) -> Any:
    """Writes rows ``value`` at global ``ids`` of ``key`` into the files of
    the local blocks holding them (other ids: other processes')."""
    ids = tf.convert_to_tensor(ids, tf.int64)
    value = tf.convert_to_tensor(value, tf.float32)
    writes = []
    for block, tier in enumerate(self._tiers):
      mine, rows = self._local(ids, block)
      writes.append(tier.write_rows_at(rows, tf.boolean_mask(value, mine), key))
    return tf.group(writes)


class _BlockRows:
  """One block's rows of one key, as ``WorkerShardedVariable`` reads and
  writes its shards."""

  def __init__(self, store: TieredShardedTable, block: int, key: str):
    self.tier = store.tier(block)
    self.key = key
    self.shape = tf.TensorShape([store.rows_of(block)[1], store.table.dim])
    self.dtype = tf.float32
    self.device = self.tier.blocks[0][key].device

  def read_value(self) -> tf.Tensor:
    value = self.tier.read(self.key)
    value.set_shape(self.shape)
    return value


class TieredBlocksVariable(WorkerShardedVariable):
  """A row-sharded disk-tiered table's variable: its blocks' rows, read
  from and written to their files (saved and restored by parts)."""

  _shards: list[_BlockRows]

  @property
  def written_in_parts(self) -> bool:
    return True  # Too large to hold whole, on one worker or several.

  def read_value(self) -> tf.Tensor:
    """The whole value (across workers a collective every worker joins)."""
    if self.worker_count > 1:
      return super().read_value()
    return tf.concat([shard.read_value() for shard in self._shards], 0)

  def assign(self, value: Any) -> Any:
    """Writes this worker's rows of a whole ``value`` to the files."""
    for local, shard in enumerate(self._shards):
      start, count = self._rows(local)
      shard.tier.assign(value[start : start + count], shard.key)

  def saved_parts(
    self, keys: list[str], chunk_bytes: int | None = None
  ) -> Iterator[tuple[str, list[slicing.Entry]]]:
    for shard in self._shards:
      shard.tier.flush()
    return super().saved_parts(keys, chunk_bytes)

  def _chunk(self, local: int, first: int, count: int) -> Any:
    shard = self._shards[local]
    return shard.tier.window(shard.key, first, count)

  def row_blocks(self) -> list[tuple[tf.Variable, int]]:
    return []  # No variables: ``restore_rows`` writes the files.

  def restore_rows(
    self, saved: saved_rows.SavedRows, key: str, chunk_bytes: int | None = None
  ) -> None:
    full = self.shape.as_list()
    for local, shard in enumerate(self._shards):
      start, count = self._rows(local)
      pieces = saved.read_float32_rows(
        key, full, start, count, tf.float32, chunk_bytes
      )
      shard.tier.assign_by_parts(
        shard.key, ((first - start, value) for first, value in pieces)
      )
