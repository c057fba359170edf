"""Sharded backend: tables split over the replicas of a ``MirroredStrategy``.

A table with more rows than the threshold is row-sharded: one contiguous
block per replica, on that replica's device (``RowShardedTable``, or
``MultiWorkerShardedTable`` when the replicas span several workers); a
smaller table is replicated (``ReplicatedTable``). Inside ``strategy.run``:

* **lookup**: every replica all-gathers the (padded) distinct ids of all
  replicas, gathers the rows it owns (zeros elsewhere), and an all-reduce
  sums the contributions; each replica keeps the rows of its own ids. The
  sum adds only zeros to each owned row, so the activations are exactly
  those of one device.
* **update**: every replica all-gathers all replicas' ``(id, gradient)``
  pairs, keeps those of the rows it owns (all of them for a replicated
  table), sums duplicates and applies the optimizer to its block. A row's
  gradient is therefore its sum over the global batch, as on TPU.

All communication uses ``tf.distribute.ReplicaContext`` collectives,
batched over tables (``collectives.py``). Checkpoints save every table
whole (``[vocabulary_size, dim]``), so they restore into any replica
count, a single device, or TensorFlow's ``TPUEmbeddingForServing``.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
  >>> with strategy.scope():
  ...   emb = tpe.TPUEmbedding(
  ...       tpe.FeatureConfig(tpe.TableConfig(50_000, 8, name="t")),
  ...       tpe.SGD(0.1), row_sharding_threshold=0)
  >>> emb.build()
  >>> [v.shape[0] for v in emb.backend.shards("t")]  # one replica here
  [50000]
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding.backends.base import Backend
from tpu_embedding.backends.base import GatherRequests
from tpu_embedding.backends.base import Updates
from tpu_embedding.backends.base import summed_gradients
from tpu_embedding.backends.collectives import Exchange
from tpu_embedding.backends.collectives import group_by_width
from tpu_embedding.config import TableConfig
from tpu_embedding.replicas import current_replica
from tpu_embedding.replicas import first_local_replica
from tpu_embedding.resolved import table_name
from tpu_embedding.sharding import DEFAULT_ROW_THRESHOLD
from tpu_embedding.sharding import ShardingPlan
from tpu_embedding.sharding import TablePlacement
from tpu_embedding.sharding import make_plan
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.multi_worker import MultiWorkerShardedTable
from tpu_embedding.tables.replicated import ReplicatedTable
from tpu_embedding.tables.row_sharded import RowShardedTable


class ShardedBackend(Backend):
  """Row-sharded and replicated tables over all replicas in sync.

  Under ``MultiWorkerMirroredStrategy`` each worker holds the blocks of its
  own replicas; the collectives span all workers.
  """

  def __init__(
    self,
    strategy: tf.distribute.Strategy,
    tables: Sequence[TableConfig],
    row_threshold: int = DEFAULT_ROW_THRESHOLD,
  ):
    super().__init__()
    self._strategy = strategy
    self._devices = tuple(strategy.extended.worker_devices)
    self._first = first_local_replica(strategy)
    self._multi_worker = strategy.num_replicas_in_sync > len(self._devices)
    self._plan = make_plan(tables, strategy.num_replicas_in_sync, row_threshold)

  @property
  def plan(self) -> ShardingPlan:
    """Where each table lives (known before any variable exists)."""
    return self._plan

  @property
  def local_devices(self) -> list[str | None]:
    return list(self._devices)

  def create_tables(self, tables, tracker):
    for table in tables:
      self._stores[table.name] = self._create_store(table, tracker)
    return self._stores

  def _create_store(self, table: TableConfig, tracker) -> TableStore:
    placement = self._plan.placements[table_name(table)]
    if not placement.sharded:
      return ReplicatedTable.create(table, self._devices, tracker)
    if self._multi_worker:
      return MultiWorkerShardedTable.create(
        table,
        placement,
        self._devices,
        self._first,
        tracker,
        strategy=self._strategy,
      )
    return RowShardedTable.create(
      table, placement, self._devices, self._first, tracker
    )

  # --- rows ----------------------------------------------------------------

  def gather_tables(self, requests: GatherRequests) -> list[tf.Tensor]:
    replica = current_replica(self._strategy)
    if replica is None:  # A direct lookup outside strategy.run.
      return self.gather_from_stores(requests)
    local = replica - self._first
    results: list = [None] * len(requests)
    sharded = []
    for i, (table, ids) in enumerate(requests):
      if self._plan.placements[table_name(table)].sharded:
        sharded.append(i)
      else:  # A replicated table: this replica's own copy.
        block = self._stores[table_name(table)].blocks[local]
        results[i] = tf.gather(block["parameters"], ids)
    if not sharded:
      return results
    context = tf.distribute.get_replica_context()
    id_lists = [requests[i][1] for i in sharded]
    exchange = Exchange(context, id_lists)
    rows = []
    for i, all_ids in zip(
      sharded, exchange.all_gather(id_lists, -1), strict=True
    ):
      table = requests[i][0]
      in_block, mine = owned_rows(
        tf.reshape(all_ids, [-1]),
        self._plan.placements[table_name(table)],
        replica,
      )
      block = self._stores[table_name(table)].blocks[local]
      found = tf.gather(block["parameters"], in_block)
      rows.append(tf.where(mine[:, None], found, tf.zeros_like(found)))
    # Each row is non-zero on its owner only: the sum is exact.
    for group in group_by_width([requests[i][0].dim for i in sharded]):
      summed = exchange.all_reduce_rows([rows[k] for k in group], group)
      for k, value in zip(group, summed, strict=True):
        results[sharded[k]] = value
    return results

  def apply_updates(self, updates: Updates) -> None:
    replica = current_replica(self._strategy)
    if replica is None:
      raise RuntimeError(
        "apply_gradients on sharded tables must run inside strategy.run "
        "(in replica context), like dequeue."
      )
    if not updates:
      return
    context = tf.distribute.get_replica_context()
    summed_updates = [
      (table, ids, summed_gradients(ids, grads, index))
      for table, ids, grads, index in updates
    ]
    id_lists = [ids for _, ids, _ in summed_updates]
    exchange = Exchange(context, id_lists)
    all_ids = exchange.all_gather(id_lists, -1)
    all_grads: list = [None] * len(summed_updates)
    for group in group_by_width([table.dim for table, _, _ in summed_updates]):
      gathered = exchange.all_gather(
        [summed_updates[k][2] for k in group], 0.0, tables=group
      )
      for k, grads in zip(group, gathered, strict=True):
        all_grads[k] = grads
    for (table, _, _), ids, grads in zip(
      summed_updates, all_ids, all_grads, strict=True
    ):
      placement = self._plan.placements[table_name(table)]
      in_block, mine = owned_rows(tf.reshape(ids, [-1]), placement, replica)
      rows, index = tf.unique(tf.boolean_mask(in_block, mine), out_idx=tf.int32)
      # Every replica's gradients of the rows this one owns, summed as they
      # are applied (the fused kernel where it applies).
      self._stores[table_name(table)].update_block(
        replica - self._first,
        rows,
        tf.boolean_mask(tf.reshape(grads, [-1, table.dim]), mine),
        index,
      )


def owned_rows(ids: tf.Tensor, placement: TablePlacement, replica: int):
  """``(row index within the block, mask)`` of the ``ids`` ``replica`` holds.

  Padding ids (-1) are never held.
  """
  valid = ids >= 0
  if not placement.sharded:
    return tf.where(valid, ids, tf.zeros_like(ids)), valid
  offset = placement.shard_offsets[replica]
  size = placement.shard_sizes[replica]
  mine = tf.logical_and(ids >= offset, ids < offset + size)
  return tf.where(mine, ids - offset, tf.zeros_like(ids)), mine
