"""One table of a stack: a view of its rows in the stack's store.

A stack (``stacking.py``) is held by one store of any layout, made for
the stack's config; each member table is a ``StackMember`` over it. The
member's ``variables`` are ``base.StackSliceVariable`` views: they convert to
the member's ``[vocabulary_size, dim]`` value (gathered from the stack,
never a copy of the whole stack), save and restore under TensorFlow's key
of the member with that value, and write back in place (a layout may
give views of its own: ``TableStore.member_variable``; a stack on disk
streams its members' checkpoints). So checkpoints,
``embedding_tables``, serving and export see the tables as if unstacked.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> a = tpe.TableConfig(3, 2, name="a", initializer=tpe.RowIdInitializer())
  >>> b = tpe.TableConfig(2, 2, name="b", initializer=tf.ones_initializer())
  >>> emb = tpe.TPUEmbedding([tpe.FeatureConfig(a), tpe.FeatureConfig(b)],
  ...                        tpe.SGD(0.1), table_stacking=[["a", "b"]])
  >>> store = emb.table_stores["b"]
  >>> type(store).__name__, store.layout, store.offset
  ('StackMember', 'whole', 3)
  >>> tf.convert_to_tensor(store.variables["parameters"]).numpy().tolist()
  [[1.0, 1.0], [1.0, 1.0]]
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import RowGradients
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.base import checkpoint_name
from tpu_embedding.tables.base import restore_pending


class StackMember(TableStore):
  """A table held in a stack's store, at ``offset``.

  Attributes:
    stack: the stack's store (any layout).
    offset: the member's first row in the stack.
  """

  def __init__(self, table: TableConfig, stack: TableStore, offset: int):
    self.stack = stack
    self.offset = offset
    variables = {
      key: stack.member_variable(table, key, offset) for key in stack.keys
    }
    # The member has no blocks of its own: the stack's store holds them.
    super().__init__(table, variables, [])

  @property
  def layout(self) -> str:  # type: ignore[override]
    """The layout of the stack's store, where the rows live."""
    return self.stack.layout

  @property
  def rows_sharded(self) -> bool:  # type: ignore[override]
    """Whether the stack's store is sharded by rows over the replicas."""
    return self.stack.rows_sharded

  def block_rows(self, block: int) -> tuple[int, int]:
    raise IndexError(
      f"Table '{self.table.name}' is stacked: its rows live in the blocks "
      f"of its stack's store ({self.stack.table.name}), at row "
      f"{self.offset}."
    )

  def gather(
    self,
    ids: tf.Tensor,
    key: str = "parameters",
    ops: StepOps = TENSORFLOW_OPS,
  ) -> tf.Tensor:
    return self.stack.gather(ids + self.offset, key, ops)

  def peek(self, ids: tf.Tensor, key: str = "parameters") -> tf.Tensor:
    return self.stack.peek(ids + self.offset, key)

  def update(
    self,
    ids: tf.Tensor,
    grads: RowGradients,
    index: tf.Tensor | None = None,
    ops: StepOps = TENSORFLOW_OPS,
    step_id: tf.Tensor | None = None,
  ) -> None:
    self.stack.update(ids + self.offset, grads, index, ops, step_id)

  @property
  def counts_updates(self) -> bool:
    return self.stack.counts_updates

  def update_count(self) -> int:
    return self.stack.update_count()

  def set_update_count(self, count: int) -> None:
    self.stack.set_update_count(count)

  def write_rows(self, first: int, value: Any, key: str = "parameters") -> Any:
    return self.stack.write_rows(self.offset + first, value, key)

  def mark_rows(
    self, block: int, rows: tf.Tensor, ops: StepOps = TENSORFLOW_OPS
  ) -> Any:
    """Marks rows of the stack's block ``block`` (stack rows)."""
    return self.stack.mark_rows(block, rows, ops)

  def changed_rows(self) -> tf.Tensor:
    """The member's changed rows, from its stack's."""
    ids = self.stack.changed_rows()
    end = self.offset + self.table.vocabulary_size
    mine = tf.logical_and(ids >= self.offset, ids < end)
    return tf.boolean_mask(ids, mine) - self.offset

  def clear_changes(self) -> None:
    """Clears the stack's marks (every member's: save them all first)."""
    self.stack.clear_changes()

  def read_rows(self, ids: tf.Tensor, key: str = "parameters") -> tf.Tensor:
    ids = tf.convert_to_tensor(ids, tf.int64)
    return self.stack.read_rows(ids + self.offset, key)

  def write_rows_at(
    self, ids: tf.Tensor, value: Any, key: str = "parameters"
  ) -> Any:
    ids = tf.convert_to_tensor(ids, tf.int64)
    return self.stack.write_rows_at(ids + self.offset, value, key)

  def assign(self, value: Any, key: str = "parameters") -> Any:
    return self._variables[key].assign(value)

  def held_variables(self) -> list[Any]:
    return self.stack.held_variables()

  def bytes_per_device(self) -> dict[str, int]:
    """The member's share of the stack's bytes on each device."""
    start, end = self.offset, self.offset + self.table.vocabulary_size
    totals: dict[str, int] = {}
    for block, variables in enumerate(self.stack.blocks):
      first, rows = self.stack.block_rows(block)
      mine = max(0, min(end, first + rows) - max(start, first))
      for variable in variables.values():
        size = mine * self.table.dim * variable.dtype.size
        totals[variable.device] = totals.get(variable.device, 0) + size
    return totals

  def track(self, tracker: Any) -> None:
    """Tracks the views (a checkpoint restored earlier fills them now)."""
    for key, variable in self.variables.items():
      name = checkpoint_name(self.table.name or "", key)
      restore_pending(tracker, name, variable)
      tracker.register(name, variable, restore=True)
