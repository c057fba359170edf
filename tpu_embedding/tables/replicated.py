"""A small table copied on every replica.

Each replica holds a full copy of the table and its slots and applies the
same globally summed update to it, so the copies stay equal. Users see a
``ReplicatedVariable``: it converts to the table (copy 0), has ``numpy()``,
and saves once under TensorFlow's key; a restore writes every copy.

Example:
  >>> import tensorflow as tf
  >>> v = ReplicatedVariable([tf.Variable([[1.0]]), tf.Variable([[1.0]])])
  >>> tf.convert_to_tensor(v).numpy().tolist(), v.shape
  ([[1.0]], TensorShape([1, 1]))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding.checkpointing import rows as saved_rows
from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import RowGradients
from tpu_embedding.gradients import summed_gradients
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.kernels.split_by_owner import OwnerSplit
from tpu_embedding.resolved import table_name
from tpu_embedding.row_storage import decode
from tpu_embedding.tables.base import Block
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.base import WholeValueVariable
from tpu_embedding.tables.base import checkpoint_name
from tpu_embedding.tables.base import user_slots
from tpu_embedding.tables.base import variable_specs
from tpu_embedding.tables.initial_values import create_variable
from tpu_embedding.tables.initial_values import row_values
from tpu_embedding.tables.update_guards import UNGUARDED
from tpu_embedding.tables.update_guards import UpdateGuard
from tpu_embedding.tracking import VariableTracker


class ReplicatedVariable(WholeValueVariable, saved_rows.RowBlocks):
  """Identical copies of one variable, one per replica, saved once.

  A restore reads each copy's rows part by part (``rows.RowBlocks``: each
  copy a block of every row), in the copies' type whatever the saved one
  (``RowStorage``).
  """

  def __init__(self, copies: list[tf.Variable]):
    self.copies = copies

  @property
  def shape(self) -> tf.TensorShape:
    return self.copies[0].shape

  @property
  def dtype(self) -> tf.DType:
    return self.copies[0].dtype

  def read_value(self) -> tf.Tensor:
    return self.copies[0].read_value()

  def assign(self, value: Any) -> Any:
    """Writes the whole value into every copy."""
    value = tf.cast(value, self.dtype)
    return tf.group([copy.assign(value) for copy in self.copies])

  def row_blocks(self) -> list[tuple[tf.Variable, int]]:
    return [(copy, 0) for copy in self.copies]


class ReplicatedTable(TableStore):
  """A full copy of the table and its slots on each local device."""

  layout = "replicated"

  def __init__(
    self,
    table: TableConfig,
    blocks: list[Block],
    guard: UpdateGuard = UNGUARDED,
  ):
    variables = {
      key: ReplicatedVariable([b[key] for b in blocks]) for key in blocks[0]
    }
    super().__init__(table, variables, blocks, guard)

  @classmethod
  def create(
    cls,
    table: TableConfig,
    devices: Sequence[str],
    tracker: VariableTracker,
    guard: UpdateGuard = UNGUARDED,
  ) -> ReplicatedTable:
    """Creates one copy per device and tracks them for checkpoints; its
    updates run as ``guard`` says."""
    shape = (table.vocabulary_size, table.dim)
    blocks: list[Block] = [{} for _ in devices]
    for index, (key, initializer, trainable) in enumerate(
      variable_specs(table)
    ):
      name = checkpoint_name(table_name(table), key)
      values = row_values(initializer, shape, name)
      for local, device in enumerate(devices):
        # Each copy filled in place, block by block (the values are
        # deterministic: the copies are equal).
        with tf.device(device):
          blocks[local][key] = create_variable(
            values,
            0,
            table.vocabulary_size,
            f"{name}/replica_{local}",
            trainable,
            table.storage.stored_dtype(index),
          )
    for block in blocks:
      user_slots(table, block)
    store = cls(table, blocks, guard)
    store.track(tracker)
    return store

  def block_rows(self, block: int) -> tuple[int, int]:
    return 0, self.table.vocabulary_size

  def _distinct_blocks(self) -> list[int]:
    return [0]  # The copies are equal.

  def split_ids(
    self,
    ids: tf.Tensor,
    ops: StepOps,
    index: tf.Tensor | None = None,
    positions: bool = False,
    slots: bool = False,
  ) -> OwnerSplit:
    """Every copy gets every id (or occurrence): each applies every
    gradient. The parts are one tensor, given to each copy (a consumer
    may do its work on them once)."""
    del ops, positions, slots
    occurrences = ids if index is None else tf.gather(ids, index)
    where = tf.range(tf.size(occurrences, out_type=tf.int32))
    copies = len(self._blocks)
    return OwnerSplit([occurrences] * copies, [where] * copies, None)

  def owned_rows(
    self, ids: tf.Tensor, replica: int
  ) -> tuple[tf.Tensor, tf.Tensor]:
    del replica  # Every copy holds every row.
    valid = ids >= 0
    return tf.where(valid, ids, tf.zeros_like(ids)), valid

  def gather(
    self,
    ids: tf.Tensor,
    key: str = "parameters",
    ops: StepOps = TENSORFLOW_OPS,
  ) -> tf.Tensor:
    del ops  # Copy 0's rows, by TensorFlow's gather.
    return decode(tf.gather(self._blocks[0][key], ids))

  def update(
    self,
    ids: tf.Tensor,
    grads: RowGradients,
    index: tf.Tensor | None = None,
    ops: StepOps = TENSORFLOW_OPS,
    step_id: tf.Tensor | None = None,
  ) -> None:
    """Applies the same update to every copy."""
    if index is not None and len(self._blocks) > 1:
      grads = RowGradients.dense(summed_gradients(ids, grads, index))
      index = None
    for block in range(len(self._blocks)):
      self.update_block(block, ids, grads, index, ops, step_id)
