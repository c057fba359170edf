"""The interface every off-TPU backend implements.

A backend decides where each table's store lives (see ``tables/``) and
runs the two batched row operations of a step, for all tables at once:
``gather_tables`` (rows by id) and ``apply_updates`` (each table's
optimizer applied to rows by id), with the row ops the caller passes
(``kernels/ops.py``: the engine decides them from the devices holding its
tables). Everything else (input preparation, combiners, shapes, step
bookkeeping) is shared and lives outside the backends.

``HostBackend`` is the backend whose host reads and writes every row
through the stores directly (one device, parameter servers);
``ShardedBackend`` exchanges ids and rows between replicas.

Example:
  >>> from tpu_embedding.backends.base import Backend
  >>> sorted(Backend.__abstractmethods__)
  ['apply_updates', 'create_tables', 'gather_tables']
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from collections.abc import Sequence
from typing import NamedTuple

import tensorflow as tf

from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import PickedRows
from tpu_embedding.gradients import RowGradients
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.lookup import RowRequest
from tpu_embedding.resolved import table_name
from tpu_embedding.sharding import ShardingPlan
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.update_guards import UNGUARDED
from tpu_embedding.tables.update_guards import UpdateGuard
from tpu_embedding.tracking import VariableTracker

#: Per table (or stack) the distinct ids to gather and the position in
#: them of each occurrence (``lookup.RowRequest``, ``activations.RowSource``).
GatherRequests = Sequence[RowRequest]


class TableUpdate(NamedTuple):
  """One table's (or stack's) update: distinct ids and their gradients.

  Attributes:
    table: the table, or a stack as one table (``stacking.TableStack``).
    ids: ``[n]`` distinct int64 ids.
    gradients: ``[n, dim]`` summed per id (``id_index`` None), or the
      ``[m, dim]`` gradients of single occurrences; where they are
      either way (``gradients.RowGradients``).
    id_index: None, or ``[m]`` int32, the position in ``ids`` of each
      occurrence.
  """

  table: TableConfig
  ids: tf.Tensor
  gradients: RowGradients
  id_index: tf.Tensor | None


#: Each table's update (``Backend.apply_updates``).
Updates = Sequence[TableUpdate]


class Backend(metaclass=abc.ABCMeta):
  """Holds the table stores; gathers and updates rows of many tables."""

  #: Whether its updates may be held a step (``pipelining.py``).
  supports_pipelining = True

  #: None where the replicas of a step run it together (in this process,
  #: or with the other workers' through collectives); else the strategy
  #: under which each worker runs its steps alone, on its own batch.
  steps_alone_under: str | None = None

  #: How its stores' block updates run (``tables/update_guards.py``),
  #: given to each store it makes: as they come where the replicas step
  #: together; one at a time where workers update concurrently.
  update_guard: UpdateGuard = UNGUARDED

  def __init__(self) -> None:
    self._stores: dict[str, TableStore] = {}

  @property
  def stores(self) -> dict[str, TableStore]:
    """``{table name: TableStore}`` (empty before ``create_tables``)."""
    return self._stores

  @property
  def plan(self) -> ShardingPlan | None:
    """Where each table's rows live; None when every table is whole."""
    return None

  @property
  def local_devices(self) -> list[str | None]:
    """One device per local replica (None: the default device)."""
    return [None]

  @property
  def held_replicas(self) -> dict[int, str | None]:
    """``{replica of the plan: device}`` of the rows this process holds
    (``memory.py`` counts their bytes); one device by default."""
    return {0: self.local_devices[0]}

  def resident_bytes(
    self, needed: Mapping[str, int], tables: Sequence[TableConfig]
  ) -> dict[str, int]:
    """``needed`` (``{table: bytes}`` of the rows and slots of
    ``tables``) as this backend holds them in memory (``memory.py``
    checks them)."""
    del tables
    return dict(needed)

  def shards(
    self, table_name: str, slot: str = "parameters"
  ) -> list[tf.Variable]:
    """This process's variables of a table (or slot), one per row block.

    ``table_name`` names a store: a table alone, or a stack
    (``sharding_plan.placements[table].stack`` names a stacked table's).

    Raises:
      KeyError: for a stacked table or an unknown name (the message lists
        the stores).
    """
    if table_name not in self._stores:
      raise KeyError(
        f"No store named {table_name!r}; this backend's stores are "
        f"{sorted(self._stores)}. A stacked table's rows live in its "
        "stack's store (sharding_plan.placements[table].stack names it; "
        "table_stacking=None keeps every table in its own)."
      )
    return [block[slot] for block in self._stores[table_name].blocks]

  @abc.abstractmethod
  def create_tables(
    self, tables: Sequence[TableConfig], tracker: VariableTracker
  ) -> dict[str, TableStore]:
    """Creates (and tracks for checkpoints) each table's store."""

  @abc.abstractmethod
  def gather_tables(
    self, requests: GatherRequests, ops: StepOps
  ) -> list[PickedRows]:
    """``[m_t, dim_t]`` rows of each table's id occurrences: the rows of
    its distinct ids ``[n_t]`` at ``index`` ``[m_t]``, by ``ops`` (the
    step's row ops, ``kernels/ops.py``)."""

  @abc.abstractmethod
  def apply_updates(
    self, updates: Updates, ops: StepOps, step_id: tf.Tensor | None = None
  ) -> None:
    """Applies each table's optimizer to its rows.

    Args:
      updates: each table's ``TableUpdate``: distinct int64 ``ids``
        ``[n]`` and ``gradients`` ``[n, dim]`` summed over duplicates
        (``id_index`` None), or the gradients of single occurrences and
        their ``id_index``.
      ops: the step's row ops (``kernels/ops.py``).
      step_id: None, or the step's scalar int64 id: under parameter
        servers, where a step may be run again, a re-run with the same id
        does not update a table again; the other backends never re-run a
        step and ignore it.
    """

  def gather_from_stores(
    self, requests: GatherRequests, ops: StepOps
  ) -> list[PickedRows]:
    """Rows read by the calling host from each table's store."""
    return [
      self._stores[table_name(request.table)].gather_occurrences(request, ops)
      for request in requests
    ]


class HostBackend(Backend):
  """Rows read and written through the stores by the calling host."""

  def gather_tables(
    self, requests: GatherRequests, ops: StepOps
  ) -> list[PickedRows]:
    return self.gather_from_stores(requests, ops)

  def apply_updates(
    self, updates: Updates, ops: StepOps, step_id: tf.Tensor | None = None
  ) -> None:
    for update in updates:
      self._stores[table_name(update.table)].update(
        update.ids, update.gradients, update.id_index, ops, step_id
      )
