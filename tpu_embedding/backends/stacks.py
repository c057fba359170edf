"""Backends holding table stacks: one store per stack, a view per table.

A backend is given each stack's config as one table (``stacking.py``):
it plans, creates, gathers and updates stacks exactly as tables. This
module makes the per-table side: the stack's own variables stay out of
checkpoints, each member table gets a ``StackMember`` view, tracked under
its own keys.

Example:
  >>> import tpu_embedding as tpe
  >>> tables = [tpe.TableConfig(10, 4, name=n) for n in "ab"]
  >>> emb = tpe.TPUEmbedding([tpe.FeatureConfig(t) for t in tables],
  ...                        tpe.Adagrad(0.1), table_stacking=[["a", "b"]])
  >>> sorted(emb.table_stores), sorted(emb.backend.stores)
  (['a', 'b'], ['stack_a_b'])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence

from tpu_embedding import allocator
from tpu_embedding.backends.base import Backend
from tpu_embedding.config import TableConfig
from tpu_embedding.resolved import table_name
from tpu_embedding.sharding import REPLICATED
from tpu_embedding.sharding import ROW_SHARDED
from tpu_embedding.sharding import RowThreshold
from tpu_embedding.sharding import ShardingPlan
from tpu_embedding.sharding import make_plan
from tpu_embedding.sharding import member_placement
from tpu_embedding.sharding import placement_kind
from tpu_embedding.stacking import TableStack
from tpu_embedding.stacking import TableStacking
from tpu_embedding.stacking import auto_stacks
from tpu_embedding.stacking import plan_stacks
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.stacked import StackMember
from tpu_embedding.tracking import PartlyTracked
from tpu_embedding.tracking import VariableTracker


def stack_threshold(
  stacks: Sequence[TableStack],
  row_threshold: int,
  placement: Callable[[TableConfig], str],
) -> int:
  """The row threshold planning stacks as their members are planned.

  A stack takes the placement its members have alone (not the one its
  total size would give); a table alone keeps any placement fixed for it.
  """
  if not any(stack.stacked for stack in stacks):
    return row_threshold
  forced = dict(getattr(row_threshold, "forced", {}))
  kept = {
    name: kind
    for name, kind in forced.items()
    if any(stack.names == (name,) for stack in stacks)
  }
  for stack in stacks:
    kind = placement(stack.tables[0])
    if stack.stacked and kind in (ROW_SHARDED, REPLICATED):
      kept[stack.name] = kind
  return RowThreshold(int(row_threshold), kept)


def table_plan(
  plan: ShardingPlan | None, stacks: Sequence[TableStack]
) -> ShardingPlan | None:
  """The backend's plan of stacks, told per table (stacked ones marked)."""
  if plan is None or not any(stack.stacked for stack in stacks):
    return plan
  placements = {}
  for stack in stacks:
    placement = plan.placements[stack.name]
    if not stack.stacked:
      placements[stack.name] = placement
      continue
    for table, offset in zip(stack.tables, stack.offsets, strict=True):
      placements[table_name(table)] = member_placement(
        placement, table_name(table), offset, table.vocabulary_size
      )
  return dataclasses.replace(plan, placements=placements)


def plan_with_stacks(
  tables: Sequence[TableConfig],
  num_replicas: int,
  row_threshold: int,
  table_stacking: TableStacking = "auto",
  auto: bool = False,
) -> tuple[ShardingPlan, list[TableStack]]:
  """The per-table plan and the stacks of single-worker replicas.

  What ``TPUEmbedding`` under a ``MirroredStrategy`` of ``num_replicas``
  would hold, known without creating anything (``tools/sharding_report.py``);
  ``auto``: whether the devices are accelerators (``stacking.auto_stacks``
  decides whether ``"auto"`` stacks).

  Example:
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.resolved import resolve
    >>> tables = resolve([tpe.FeatureConfig(tpe.TableConfig(100, 4, name=n))
    ...                   for n in "ab"], tpe.SGD(0.1)).tables
    >>> plan, stacks = plan_with_stacks(tables, 2, 10, [["a", "b"]])
    >>> [s.names for s in stacks], plan.placements["b"].shard_sizes
    ([('a', 'b')], (0, 100))
  """

  def placement(table: TableConfig) -> str:
    return placement_kind(
      table_name(table), table.vocabulary_size, num_replicas, row_threshold
    )

  stacks = plan_stacks(
    tables, table_stacking, placement, auto=auto_stacks(auto, num_replicas)
  )
  plan = make_plan(
    [stack.config for stack in stacks],
    num_replicas,
    stack_threshold(stacks, row_threshold, placement),
  )
  return table_plan(plan, stacks) or plan, stacks


def create_stacked_tables(
  backend: Backend, stacks: Sequence[TableStack], tracker: VariableTracker
) -> dict[str, TableStore]:
  """Creates every stack's store in ``backend``; returns the tables' stores.

  Args:
    backend: the backend, created for the stacks' configs.
    stacks: the stacks (a table alone is a stack of one).
    tracker: tracks the tables' variables for checkpoints.

  Returns:
    ``{table name: store}``: a table alone has its own store; a stacked
    table a ``StackMember`` view of its stack's store.
  """
  allocator.return_large_buffers()  # Before the first table buffer.
  stacked = {stack.name for stack in stacks if stack.stacked}
  stores = backend.create_tables(
    [stack.config for stack in stacks], PartlyTracked(tracker, stacked)
  )
  tables: dict[str, TableStore] = {}
  for stack in stacks:
    store = stores[stack.name]
    if not stack.stacked:
      tables[stack.name] = store
      continue
    for table, offset in zip(stack.tables, stack.offsets, strict=True):
      member = StackMember(table, store, offset)
      member.track(tracker)
      tables[table_name(table)] = member
  return tables
