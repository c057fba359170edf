"""A backend's plan of its tables: stacks and placements, decided together.

Each backend says what its layouts allow in a ``Planner`` (its
``planner(strategy)``): the row shards a row-sharded table is split into
(none: every table whole), whether it holds stacks, whether
``table_stacking="auto"`` stacks there. ``Planner.plan`` decides in one
pass, from a ``sharding.PlacementPolicy``:

* the placement each table gets alone (``sharding.make_plan``);
* the stacks (``stacking.plan_stacks``): tables of different placements
  never stack, nor tables a ``DiskTier`` keeps on disk with tables in
  memory (a stack of tables all on disk is kept on disk);
* each store's placement (a stack takes its members' placement, not the
  one its total size would give): what the backend creates;
* each table's placement (a stacked table's rows' share of its stack's
  row blocks): what ``TPUEmbedding.sharding_plan`` shows and the memory
  check counts.

Example:
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.resolved import resolve
  >>> from tpu_embedding.sharding import PlacementPolicy
  >>> tables = resolve([tpe.FeatureConfig(tpe.TableConfig(100, 4, name=n))
  ...                   for n in "ab"], tpe.SGD(0.1)).tables
  >>> planned = Planner(2).plan(tables, PlacementPolicy(10), [["a", "b"]])
  >>> [s.names for s in planned.stacks]
  [('a', 'b')]
  >>> planned.stores.placements["stack_a_b"].shard_sizes
  (100, 100)
  >>> planned.tables.placements["b"].shard_sizes
  (0, 100)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

from tpu_embedding.config import TableConfig
from tpu_embedding.resolved import table_name
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.sharding import ShardingPlan
from tpu_embedding.sharding import TablePlacement
from tpu_embedding.sharding import make_plan
from tpu_embedding.sharding import member_placement
from tpu_embedding.sharding import placement
from tpu_embedding.stacking import TableStack
from tpu_embedding.stacking import TableStacking
from tpu_embedding.stacking import plan_stacks

#: The kind of every table where there is no plan: whole, on one device.
WHOLE = "whole"

#: What tables a ``DiskTier`` keeps stack as (only with one another).
ON_DISK = "on disk (DiskTier)"


@dataclasses.dataclass(frozen=True)
class TablePlan:
  """Where a backend's tables live.

  Attributes:
    stacks: the stacks (``stacking.py``; a table alone is a stack of
      one), in the config order of their earliest table.
    stores: ``{stack or table name: TablePlacement}`` of the stores the
      backend creates; None when every table is whole.
    tables: ``{table name: TablePlacement}``, a stacked table's marked
      with its stack (``TablePlacement.stack``); None when every table is
      whole.
  """

  stacks: tuple[TableStack, ...]
  stores: ShardingPlan | None
  tables: ShardingPlan | None


@dataclasses.dataclass(frozen=True)
class Planner:
  """What a backend's layouts allow: all that planning asks of a backend.

  Attributes:
    num_shards: the row shards a row-sharded table is split into (the
      replicas, or the parameter servers); None: every table is whole
      and there is no plan.
    can_stack: whether the layouts hold stacks; if not, ``"auto"`` stacks
      nothing and explicit stacks are an error.
    auto_stacks: whether ``table_stacking="auto"`` stacks
      (``stacking.auto_stacks``).
    where: the strategy, for the error refusing explicit stacks.
  """

  num_shards: int | None = None
  can_stack: bool = True
  auto_stacks: bool = False
  where: str = ""

  def plan(
    self,
    tables: Sequence[TableConfig],
    policy: PlacementPolicy,
    table_stacking: TableStacking = "auto",
  ) -> TablePlan:
    """The stacks of ``tables`` and the placements of stores and tables.

    Args:
      tables: the resolved tables, in config order.
      policy: which tables are row-sharded.
      table_stacking: ``"auto"``, None, or explicit lists of table names.

    Raises:
      ValueError: for invalid ``table_stacking`` (``stacking.plan_stacks``)
        or a policy fixing the placement of a table not in ``tables``.
    """
    num_shards = self.num_shards
    # Each table's placement alone (checks the names the policy fixes).
    alone: dict[str, TablePlacement] | None = None
    if num_shards is not None:
      alone = make_plan(tables, num_shards, policy).placements

    def kind(table: TableConfig) -> str:
      return WHOLE if alone is None else alone[table_name(table)].kind

    def stacks_as(table: TableConfig) -> str:
      if not self.can_stack:
        return WHOLE
      return ON_DISK if policy.disk.holds(table_name(table)) else kind(table)

    stacks = tuple(
      plan_stacks(
        tables,
        table_stacking,
        stacks_as,
        self.can_stack,
        self.where,
        self.auto_stacks,
      )
    )
    if alone is None or num_shards is None:
      return TablePlan(stacks, None, None)
    stores: dict[str, TablePlacement] = {}
    placements: dict[str, TablePlacement] = {}
    for stack in stacks:
      if not stack.stacked:
        stores[stack.name] = placements[stack.name] = alone[stack.name]
        continue
      store = placement(stack.config, kind(stack.tables[0]), num_shards)
      stores[stack.name] = store
      for table, offset in zip(stack.tables, stack.offsets, strict=True):
        name = table_name(table)
        placements[name] = member_placement(
          store, name, offset, table.vocabulary_size
        )
    return TablePlan(
      stacks,
      ShardingPlan(num_shards, policy, stores),
      ShardingPlan(num_shards, policy, placements),
    )


def on_accelerators(devices: Iterable[Any]) -> bool:
  """Whether any of ``devices`` is a GPU (``"auto"`` stacks there).

  Example:
    >>> on_accelerators(["/gpu:0"]), on_accelerators(["/cpu:0"])
    (True, False)
  """
  return any("GPU" in str(device).upper() for device in devices)
