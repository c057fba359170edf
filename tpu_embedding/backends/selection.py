"""Which backend holds the tables under the strategy of the moment.

The one place a strategy's class is asked: it picks the backend, whose
``planner`` plans the tables (``planning.py``), then creates the backend
of that plan.

Example:
  >>> import tensorflow as tf
  >>> from tpu_embedding.sharding import PlacementPolicy
  >>> backend, planned = select_backend(
  ...     tf.distribute.get_strategy(), (), PlacementPolicy())
  >>> type(backend).__name__, planned.tables
  ('LocalBackend', None)
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding.backends.base import Backend
from tpu_embedding.backends.local import LocalBackend
from tpu_embedding.backends.parameter_server import ParameterServerBackend
from tpu_embedding.backends.sharded import ShardedBackend
from tpu_embedding.config import TableConfig
from tpu_embedding.planning import TablePlan
from tpu_embedding.replicas import strategy_name
from tpu_embedding.resolved import key_mapping
from tpu_embedding.resolved import table_name
from tpu_embedding.sharding import DiskTier
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.sharding import ShardingPlan
from tpu_embedding.stacking import TableStacking


def select_backend(
  strategy: tf.distribute.Strategy,
  tables: Sequence[TableConfig],
  policy: PlacementPolicy,
  table_stacking: TableStacking = "auto",
) -> tuple[Backend, TablePlan]:
  """The off-TPU backend for ``strategy`` and its plan of ``tables``.

  Args:
    strategy: the strategy the tables are created under.
    tables: the resolved tables, in config order.
    policy: which tables are row-sharded.
    table_stacking: ``"auto"``, None, or explicit lists of table names.

  Returns:
    ``(backend, plan)``: the backend, created for the plan's stores, and
    the plan (stacks, stores' and tables' placements).

  Raises:
    ValueError: for a strategy without a backend, or invalid
      ``table_stacking`` (``Planner.plan``).
  """
  if isinstance(strategy, tf.distribute.OneDeviceStrategy) or (
    not tf.distribute.has_strategy()
  ):
    planner = LocalBackend.planner(strategy)
    planned = planner.plan(tables, policy, table_stacking)
    check_disk_tables(policy.disk, tables)
    return LocalBackend(policy.disk, planned.stacks), planned
  if isinstance(
    strategy,
    (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy),
  ):
    planner = ShardedBackend.planner(strategy)
    planned = planner.plan(tables, policy, table_stacking)
    check_disk_tables(policy.disk, tables)
    _check_disk_tables_alone(policy.disk, planned, strategy)
    return ShardedBackend(strategy, _stores(planned), policy.disk), planned
  if policy.disk.tables:
    raise ValueError(
      f"Tables {list(policy.disk.tables)} are kept on disk (DiskTier), "
      "which this version trains on one device, MirroredStrategy and "
      "MultiWorkerMirroredStrategy (each replica's rows in its own files), "
      f"not under {strategy_name(strategy)}: its rows live on the parameter "
      "servers, whose disks the coordinator's cache cannot read or write; "
      "keep them in memory (row-sharded) there."
    )
  if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
    planner = ParameterServerBackend.planner(strategy)
    planned = planner.plan(tables, policy, table_stacking)
    return ParameterServerBackend(_stores(planned)), planned
  raise ValueError(
    f"TPUEmbedding created under {strategy_name(strategy)}: this version "
    "of tpu_embedding trains on the default strategy, OneDeviceStrategy, "
    "MirroredStrategy, MultiWorkerMirroredStrategy, ParameterServerStrategy "
    "and TPUStrategy. Create it outside any strategy scope or under one of "
    "those."
  )


def check_disk_tables(disk: DiskTier, tables: Sequence[TableConfig]) -> None:
  """Refuses disk-tier names that are not tables, and tables whose rows a
  dynamic vocabulary manages (a stack of tables on disk is on disk: the
  planner never stacks them with tables in memory)."""
  names = [table_name(table) for table in tables]
  for table in tables:
    if disk.holds(table_name(table)) and not key_mapping(table).inputs_are_rows:
      raise ValueError(
        f"Table {table_name(table)!r} has a DynamicVocabulary, whose rows "
        "this version does not keep on disk (DiskTier): keep it in memory."
      )
  for name in disk.tables:
    if name not in names:
      raise ValueError(
        f"DiskTier names table {name!r}, which is not a table (tables: "
        f"{sorted(names)})."
      )


def _check_disk_tables_alone(
  disk: DiskTier, planned: TablePlan, strategy: tf.distribute.Strategy
) -> None:
  """Refuses a stack of tables on disk where replicas share the rows
  (each replica's block is one table's rows: stacks stay on one device)."""
  for stack in planned.stacks:
    if stack.stacked and any(disk.holds(name) for name in stack.names):
      raise ValueError(
        f"Tables {list(stack.names)} are stacked and kept on disk "
        f"(DiskTier): under {strategy_name(strategy)} a table on disk is "
        "held alone (stacks on disk train on one device); leave them out "
        "of table_stacking."
      )


def _stores(planned: TablePlan) -> ShardingPlan:
  """The stores' placements of a planner with row shards (never None)."""
  assert planned.stores is not None, "a planner with shards plans stores"
  return planned.stores
