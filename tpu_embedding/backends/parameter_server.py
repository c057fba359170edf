"""Parameter-server backend: table rows split over the PS tasks.

Under ``tf.distribute.ParameterServerStrategy`` every worker runs whole
training steps (scheduled by a ``ClusterCoordinator``) against variables that
live on the parameter servers. A table larger than the row threshold is a
``RowShardedTable`` with one contiguous row block per PS task; a smaller
table is a ``WholeTable`` on one PS task (round robin). A step gathers only
the looked-up rows from the PS tasks that own them and scatters only their
new values back, so no worker ever holds a table.

Workers update asynchronously, as parameter-server training does: each step
applies its own batch's row gradients. Each update runs on the parameter
server holding the rows, inside that block's ``tf.CriticalSection``, so steps
from several workers at once never interleave their read-modify-writes: no
update is lost or doubled (an Adagrad accumulator gets every squared
gradient). Steps run one after another give exactly the single-device
result. The coordinator runs a failed worker's step again, even if its
update had landed; with ``apply_gradients(step_id=...)`` each block
applies a step's update once (``tables/step_record.py``).

Example:
  >>> from tpu_embedding.backends.parameter_server import ps_devices
  >>> ps_devices(2)
  ['/job:ps/task:0/device:CPU:0', '/job:ps/task:1/device:CPU:0']
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.backends.base import HostBackend
from tpu_embedding.config import TableConfig
from tpu_embedding.planning import Planner
from tpu_embedding.replicas import strategy_name
from tpu_embedding.resolved import table_name
from tpu_embedding.sharding import ShardingPlan
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.row_sharded import RowShardedTable
from tpu_embedding.tables.update_guards import LockedUpdates
from tpu_embedding.tables.whole import WholeTable
from tpu_embedding.tracking import VariableTracker


def ps_devices(num_ps: int) -> list[str]:
  """The CPU device of each parameter-server task."""
  return [f"/job:ps/task:{i}/device:CPU:0" for i in range(num_ps)]


class ParameterServerBackend(HostBackend):
  """Tables on the parameter servers; gathers and scatters by row."""

  #: Workers update asynchronously already: nothing to pipeline.
  supports_pipelining = False
  steps_alone_under = "ParameterServerStrategy"

  def __init__(self, plan: ShardingPlan):
    """Creates the backend of the stores ``plan`` places (its
    ``planner``'s ``TablePlan.stores``)."""
    super().__init__()
    self._devices = ps_devices(plan.num_replicas)
    self._plan = plan
    # Workers update concurrently: each block's updates one at a time.
    self.update_guard = LockedUpdates()

  @staticmethod
  def planner(strategy: tf.distribute.Strategy) -> Planner:
    """Tables over the PS tasks (the plan's "replicas"; a "replicated"
    table is kept once, on one PS task); never stacked."""
    resolver = compat.parameter_server_resolver(strategy)
    num_ps = resolver.cluster_spec().num_tasks("ps")
    where = f"under {strategy_name(strategy)}"
    return Planner(num_ps, can_stack=False, where=where)

  @property
  def plan(self) -> ShardingPlan:
    """Which tables are split over the PS tasks."""
    return self._plan

  @property
  def held_replicas(self) -> dict[int, str | None]:
    return {}  # The rows live on the PS tasks, other processes.

  def create_tables(
    self, tables: Sequence[TableConfig], tracker: VariableTracker
  ) -> dict[str, TableStore]:
    for index, table in enumerate(tables):
      placement = self._plan.placements[table_name(table)]
      store: TableStore
      if placement.sharded:
        store = RowShardedTable.create(
          table, placement, self._devices, 0, tracker, guard=self.update_guard
        )
      else:
        device = self._devices[index % len(self._devices)]
        store = WholeTable.create(table, tracker, device, self.update_guard)
      self._stores[table_name(table)] = store
    return self._stores
