"""Sharded backend: tables split over the replicas of a ``MirroredStrategy``.

A table with more rows than the threshold is row-sharded: one contiguous
block per replica, on that replica's device (``RowShardedTable``, or
``MultiWorkerShardedTable`` when the replicas span several workers); a
smaller table is replicated (``ReplicatedTable``); a table a ``DiskTier``
names is row-sharded, each replica's block on a local disk behind its own
cache (``TieredShardedTable``). Inside ``strategy.run``:

* **lookup**: each replica's distinct ids go to the replicas owning their
  rows, which send the rows back; a replicated table is read from the
  replica's own copy.
* **update**: each replica sends its gradients to the owners of their
  rows (to every copy of a replicated table); each owner sums what it
  received per row and applies the optimizer to its block. A row's
  gradient is therefore its sum over the global batch, as on TPU.

The exchange is an all-to-all when every replica runs in this process,
all-gathers and all-reduces across workers (``exchanges.py``).
Checkpoints save every table whole (``[vocabulary_size, dim]``), so they
restore into any replica count, a single device, or TensorFlow's
``TPUEmbeddingForServing``.

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

from collections.abc import Mapping
from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding.backends.base import Backend
from tpu_embedding.backends.base import GatherRequests
from tpu_embedding.backends.base import Updates
from tpu_embedding.backends.exchanges import AllGather
from tpu_embedding.backends.exchanges import AllToAll
from tpu_embedding.backends.exchanges import ExchangeRequest
from tpu_embedding.backends.exchanges import RowExchange
from tpu_embedding.backends.exchanges import StoreUpdate
from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import PickedRows
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.planning import Planner
from tpu_embedding.planning import on_accelerators
from tpu_embedding.replicas import current_replica
from tpu_embedding.replicas import first_local_replica
from tpu_embedding.replicas import strategy_name
from tpu_embedding.resolved import table_name
from tpu_embedding.sharding import IN_MEMORY
from tpu_embedding.sharding import DiskTier
from tpu_embedding.sharding import ShardingPlan
from tpu_embedding.stacking import auto_stacks
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.multi_worker import MultiWorkerShardedTable
from tpu_embedding.tables.replicated import ReplicatedTable
from tpu_embedding.tables.row_sharded import RowShardedTable
from tpu_embedding.tables.tiered import cached_row_bytes
from tpu_embedding.tables.tiered_sharded import TieredShardedTable
from tpu_embedding.tracking import VariableTracker


def replicas_planner(num_replicas: int, accelerators: bool = False) -> Planner:
  """How ``ShardedBackend`` plans for ``num_replicas`` replicas of one
  process: what ``TPUEmbedding`` under a ``MirroredStrategy`` of that many
  would hold, known without one (``tools/sharding_report.py``).

  Args:
    num_replicas: the replicas in sync.
    accelerators: whether they are GPUs (``stacking.auto_stacks``).
  """
  return Planner(
    num_replicas, auto_stacks=auto_stacks(accelerators, num_replicas)
  )


class ShardedBackend(Backend):
  """Row-sharded and replicated tables over all replicas in sync.

  Under ``MultiWorkerMirroredStrategy`` each worker holds the blocks of its
  own replicas; the collectives span all workers.
  """

  def __init__(
    self,
    strategy: tf.distribute.Strategy,
    plan: ShardingPlan,
    disk: DiskTier = IN_MEMORY,
  ):
    """Creates the backend of the stores ``plan`` places (its
    ``planner``'s ``TablePlan.stores``); the tables ``disk`` names are
    kept on disk."""
    super().__init__()
    self._disk = disk
    self._strategy = strategy
    self._devices = tuple(strategy.extended.worker_devices)
    self._first = first_local_replica(strategy)
    self._multi_worker = strategy.num_replicas_in_sync > len(self._devices)
    self._plan = plan
    self._exchange: RowExchange = (
      AllGather(self._first)
      if self._multi_worker
      else AllToAll(self._first, strategy.num_replicas_in_sync)
    )

  @staticmethod
  def planner(strategy: tf.distribute.Strategy) -> Planner:
    """Tables over the replicas in sync; stacks where they all run in
    this process."""
    replicas = strategy.num_replicas_in_sync
    devices = strategy.extended.worker_devices
    if replicas > len(devices):
      # Tables over several workers save in slices per worker
      # (tables/multi_worker.py): not stacked.
      where = f"under {strategy_name(strategy)} with several workers"
      return Planner(replicas, can_stack=False, where=where)
    return replicas_planner(replicas, on_accelerators(devices))

  @property
  def plan(self) -> ShardingPlan:
    """Where each store lives (known before any variable exists)."""
    return self._plan

  @property
  def local_devices(self) -> list[str | None]:
    return list(self._devices)

  @property
  def held_replicas(self) -> dict[int, str | None]:
    return {self._first + i: d for i, d in enumerate(self._devices)}

  def create_tables(
    self, tables: Sequence[TableConfig], tracker: VariableTracker
  ) -> dict[str, TableStore]:
    for table in tables:
      self._stores[table_name(table)] = self._create_store(table, tracker)
    return self._stores

  def _create_store(
    self, table: TableConfig, tracker: VariableTracker
  ) -> TableStore:
    placement = self._plan.placements[table_name(table)]
    if not placement.sharded:
      return ReplicatedTable.create(
        table, self._devices, tracker, self.update_guard
      )
    if self._disk.holds(table_name(table)):
      return TieredShardedTable.create(
        table,
        placement,
        self._devices,
        self._first,
        self._disk.directory,
        self._disk.cache_rows(cached_row_bytes(table)),
        tracker,
        self._strategy,
        self.update_guard,
      )
    if self._multi_worker:
      return MultiWorkerShardedTable.create(
        table,
        placement,
        self._devices,
        self._first,
        tracker,
        strategy=self._strategy,
        guard=self.update_guard,
      )
    return RowShardedTable.create(
      table,
      placement,
      self._devices,
      self._first,
      tracker,
      guard=self.update_guard,
    )

  def resident_bytes(
    self, needed: Mapping[str, int], tables: Sequence[TableConfig]
  ) -> dict[str, int]:
    """A table kept on disk holds, per replica here, its cache and its
    map of cached rows."""
    del tables
    on_disk = {}
    for name in filter(self._disk.holds, needed):  # (held alone)
      placement = self._plan.placements[name]
      if placement.sharded:
        on_disk[name] = sum(
          self._disk.memory_bytes(placement.shard_sizes[replica])
          for replica in self.held_replicas
        )
    return {name: on_disk.get(name, size) for name, size in needed.items()}

  # --- rows ----------------------------------------------------------------

  @property
  def exchange(self) -> RowExchange:
    """How replicas exchange ids, rows and gradients (``exchanges.py``)."""
    return self._exchange

  def gather_tables(
    self, requests: GatherRequests, ops: StepOps
  ) -> list[PickedRows]:
    replica = current_replica(self._strategy)
    if replica is None:  # A direct lookup outside strategy.run.
      return self.gather_from_stores(requests, ops)
    local = replica - self._first
    results: dict[int, PickedRows] = {}
    sharded, row_requests = [], []
    for i, request in enumerate(requests):
      store = self._stores[table_name(request.table)]
      if store.rows_sharded:
        sharded.append(i)
        row_requests.append(ExchangeRequest(store, request.ids, request.index))
      else:  # A replicated table: this replica's own copy.
        results[i] = store.gather_block_occurrences(local, request, ops)
    if sharded:
      rows = self._exchange.gather(replica, row_requests, ops)
      for i, value in zip(sharded, rows, strict=True):
        results[i] = value
    return [results[i] for i in range(len(requests))]

  def apply_updates(
    self, updates: Updates, ops: StepOps, step_id: tf.Tensor | None = None
  ) -> None:
    del step_id  # The replicas run each step together, once.
    replica = current_replica(self._strategy)
    if replica is None:
      raise RuntimeError(
        f"apply_gradients under {strategy_name(self._strategy)} with "
        f"{self._strategy.num_replicas_in_sync} replicas must run inside "
        "strategy.run (in replica context), like dequeue."
      )
    if not updates:
      return
    self._exchange.update(
      replica,
      [
        StoreUpdate(
          self._stores[table_name(update.table)],
          update.ids,
          update.gradients,
          update.id_index,
        )
        for update in updates
      ],
      ops,
    )
