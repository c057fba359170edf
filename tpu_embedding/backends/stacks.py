"""Backends holding table stacks: one store per stack, a view per table.

A backend is given each stack's config as one table (``stacking.py``),
placed by its plan (``planning.py``): it creates, gathers and updates
stacks exactly as tables. This module makes the per-table side: the
stack's own variables stay out of checkpoints, each member table gets a
``StackMember`` view, tracked under its own keys.

Example:
  >>> import tpu_embedding as tpe
  >>> tables = [tpe.TableConfig(10, 4, name=n) for n in "ab"]
  >>> emb = tpe.TPUEmbedding([tpe.FeatureConfig(t) for t in tables],
  ...                        tpe.Adagrad(0.1), table_stacking=[["a", "b"]])
  >>> sorted(emb.table_stores), sorted(emb.backend.stores)
  (['a', 'b'], ['stack_a_b'])
"""

from __future__ import annotations

from collections.abc import Sequence

from tpu_embedding import allocator
from tpu_embedding.backends.base import Backend
from tpu_embedding.resolved import table_name
from tpu_embedding.stacking import TableStack
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.stacked import StackMember
from tpu_embedding.tracking import PartlyTracked
from tpu_embedding.tracking import VariableTracker


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
    store.track_update_count(
      tracker,
      [table_name(t) for t in stack.tables] if stack.stacked else [stack.name],
    )
    if not stack.stacked:
      tables[stack.name] = store
      continue
    for table, offset in zip(stack.tables, stack.offsets, strict=True):
      member = StackMember(table, store, offset)
      member.track(tracker)
      tables[table_name(table)] = member
  return tables
