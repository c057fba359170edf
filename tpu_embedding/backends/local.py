"""One-device backend: the default strategy and ``OneDeviceStrategy``.

Each table is a ``WholeTable``: one ``[vocabulary_size, dim]`` variable
(and one per optimizer slot) on the strategy's device. A step gathers only
the looked-up rows and scatters only their new values back: the cost of a
step grows with the number of distinct ids, never with the table size
(except non-lazy Adam, which by definition updates every row).

Example:
  >>> import tpu_embedding as tpe
  >>> emb = tpe.TPUEmbedding(
  ...     tpe.FeatureConfig(tpe.TableConfig(5, 2, name="t")), tpe.SGD(0.1))
  >>> type(emb.backend).__name__, emb.table_stores["t"].layout
  ('LocalBackend', 'whole')
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding.backends.base import HostBackend
from tpu_embedding.config import TableConfig
from tpu_embedding.planning import Planner
from tpu_embedding.planning import on_accelerators
from tpu_embedding.resolved import table_name
from tpu_embedding.sharding import IN_MEMORY
from tpu_embedding.sharding import DiskTier
from tpu_embedding.stacking import TableStack
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.tiered import TieredTable
from tpu_embedding.tables.tiered import cached_row_bytes
from tpu_embedding.tables.whole import WholeTable
from tpu_embedding.tracking import VariableTracker


class LocalBackend(HostBackend):
  """Tables as whole variables on one device, or on a local disk behind a
  RAM cache (the tables ``disk`` names: ``tables/tiered.py``; a stack of
  them is on disk, its cache their caches together)."""

  def __init__(
    self, disk: DiskTier = IN_MEMORY, stacks: Sequence[TableStack] = ()
  ):
    super().__init__()
    self._disk = disk
    self._members = {stack.name: stack.names for stack in stacks}

  @staticmethod
  def planner(strategy: tf.distribute.Strategy) -> Planner:
    """Every table whole; ``"auto"`` stacks on a GPU."""
    if tf.distribute.has_strategy():
      devices = list(strategy.extended.worker_devices)
    else:  # The default strategy: the default device (a GPU if any).
      devices = [d.name for d in tf.config.list_logical_devices("GPU")[:1]]
    return Planner(auto_stacks=on_accelerators(devices))

  def create_tables(
    self, tables: Sequence[TableConfig], tracker: VariableTracker
  ) -> dict[str, TableStore]:
    self._stores = {table_name(t): self._create(t, tracker) for t in tables}
    return self._stores

  def _create(self, table: TableConfig, tracker: VariableTracker) -> TableStore:
    members = self._members.get(table_name(table), (table_name(table),))
    if all(self._disk.holds(name) for name in members):
      rows = self._disk.cache_rows(cached_row_bytes(table))
      return TieredTable.create(
        table,
        self._disk.directory,
        rows * len(members),
        tracker,
        self.update_guard,
      )
    return WholeTable.create(table, tracker, guard=self.update_guard)

  def resident_bytes(
    self, needed: Mapping[str, int], tables: Sequence[TableConfig]
  ) -> dict[str, int]:
    """A table kept on disk holds its cache and its map of cached rows."""
    on_disk = {
      table_name(t): self._disk.memory_bytes(t.vocabulary_size)
      for t in tables
      if self._disk.holds(table_name(t))
    }
    return {name: on_disk.get(name, size) for name, size in needed.items()}
