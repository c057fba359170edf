"""Row blocks of a table on several devices of this process.

Replica (or parameter-server task) ``r`` holds rows
``[offsets[r], offsets[r] + sizes[r])`` of the table and of each slot, in
a plain variable on its device ("div" sharding, see ``sharding.py``).
Users and checkpoints see a ``ShardedVariable``: it converts to the whole
table, reads rows in id order through ``tf.nn.embedding_lookup`` and
saves as one ``[vocabulary_size, dim]`` value made of slices, so a
checkpoint restores into any other layout.

This is the layout of row-sharded tables under ``MirroredStrategy`` (one
block per replica) and ``ParameterServerStrategy`` (one per PS task).

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.resolved import resolve
  >>> from tpu_embedding.sharding import ROW_SHARDED, placement
  >>> from tpu_embedding.tables.row_sharded import RowShardedTable
  >>> from tpu_embedding.tracking import VariableTracker
  >>> table = resolve(tpe.FeatureConfig(tpe.TableConfig(
  ...     5, 1, name="t", initializer=tpe.RowIdInitializer())), None).tables[0]
  >>> rows = placement(table, ROW_SHARDED, 2)
  >>> owner = tf.__internal__.tracking.Trackable()
  >>> store = RowShardedTable.create(table, rows, ["/cpu:0", "/cpu:0"],
  ...                                0, VariableTracker(owner))
  >>> [b["parameters"].shape[0] for b in store.blocks]
  [3, 2]
  >>> store.gather(tf.constant([4, 0], tf.int64)).numpy().ravel().tolist()
  [4.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.checkpointing import rows as saved_rows
from tpu_embedding.config import TableConfig
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.kernels.split_by_owner import OwnerSplit
from tpu_embedding.resolved import table_name
from tpu_embedding.row_storage import decode
from tpu_embedding.sharding import TablePlacement
from tpu_embedding.tables.base import Block
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.base import checkpoint_name
from tpu_embedding.tables.base import user_slots
from tpu_embedding.tables.base import variable_specs
from tpu_embedding.tables.initial_values import create_variable
from tpu_embedding.tables.initial_values import row_values
from tpu_embedding.tables.update_guards import UNGUARDED
from tpu_embedding.tables.update_guards import UpdateGuard
from tpu_embedding.tracking import VariableTracker


def create_blocks(
  table: TableConfig,
  placement: TablePlacement,
  devices: Sequence[str],
  first: int,
  tracker: VariableTracker,
) -> tuple[list[Block], dict[str, Any]]:
  """Creates this process's row blocks of a table and its slots.

  Each block holds only its own rows from the start: from a checkpoint
  restored before the table existed (reading just those rows, part by
  part: ``saved_rows``), or filled grid block by grid block
  (``initial_values``), never from a whole table.

  Args:
    table: the resolved table.
    placement: where its rows live.
    devices: one device per local block.
    first: the global replica (or task) index of the first local block.
    tracker: the checkpoint tracker (for a pending restore).

  Returns:
    ``(blocks, restored)``: one ``{"parameters": var, <slot>: var}`` per
    device, and ``{key: restore}`` for the keys read from a checkpoint.
  """
  full_shape = (table.vocabulary_size, table.dim)
  blocks: list[Block] = [{} for _ in devices]
  restored: dict[str, Any] = {}
  for index, (key, initializer, trainable) in enumerate(variable_specs(table)):
    name = checkpoint_name(table_name(table), key)
    dtype = table.storage.stored_dtype(index)
    restore = tracker.checked_restore(name, full_shape)
    values = row_values(initializer, full_shape, name)
    made = []
    for local, device in enumerate(devices):
      replica = first + local
      start, rows = placement.rows_of(replica)
      part = f"{name}/part_{replica}"
      # A plain per-device variable, even inside a strategy scope.
      with tf.device(device):
        if restore is None:
          variable = create_variable(
            values, start, rows, part, trainable, dtype
          )
        else:  # Zeros, for the checkpoint's rows read below.
          variable = compat.ResourceVariable(
            tf.zeros([rows, table.dim], dtype), name=part, trainable=trainable
          )
      blocks[local][key] = variable
      made.append((variable, start))
    if restore is not None:
      save_path, checkpoint_key = compat.restore_source(restore)
      saved = saved_rows.SavedRows(save_path)
      saved_rows.restore_blocks(made, saved, checkpoint_key, full_shape)
      restored[key] = restore
  for block in blocks:
    user_slots(table, block)
  return blocks, restored


class BlockVariable(compat.ShardedVariable, saved_rows.RowBlocks):  # type: ignore[misc]  # TF is untyped
  """TensorFlow's ``ShardedVariable`` of a table's row blocks, which
  ``tpu_embedding.checkpoints.restore`` fills part by part."""

  def __init__(self, blocks: list[Any], first_rows: list[int], name: str):
    super().__init__(blocks, name=name)
    self._first_rows = first_rows

  def row_blocks(self) -> list[tuple[tf.Variable, int]]:
    return list(zip(self.variables, self._first_rows, strict=True))


class RowShardedTable(TableStore):
  """Contiguous row blocks on this process's devices, one per replica."""

  layout = "row_sharded"
  rows_sharded = True

  def __init__(
    self,
    table: TableConfig,
    placement: TablePlacement,
    blocks: list[Block],
    first: int,
    guard: UpdateGuard = UNGUARDED,
  ):
    self.table = table  # named before the user variables are made
    self.placement = placement
    self._first = first
    variables = {
      key: self._user_variable(key, [b[key] for b in blocks])
      for key in blocks[0]
    }
    super().__init__(table, variables, blocks, guard)

  @classmethod
  def create(
    cls,
    table: TableConfig,
    placement: TablePlacement,
    devices: Sequence[str],
    first: int,
    tracker: VariableTracker,
    **layout_args: Any,
  ) -> RowShardedTable:
    """Creates the blocks on ``devices`` and tracks them for checkpoints.

    Args:
      table: the resolved table.
      placement: where its rows live.
      devices: one device per local block.
      first: the global replica (or task) index of the first local block.
      tracker: tracks the variables for checkpoints.
      **layout_args: further constructor arguments of a subclass.
    """
    blocks, restored = create_blocks(table, placement, devices, first, tracker)
    store = cls(table, placement, blocks, first, **layout_args)
    for key, restore in restored.items():
      tracker.mark_restored(store.variables[key], restore)
    store.track(tracker)
    return store

  def _user_variable(self, key: str, shards: list[Any]) -> Any:
    return BlockVariable(
      shards,
      [self.block_rows(block)[0] for block in range(len(shards))],
      name=checkpoint_name(table_name(self.table), key),
    )

  def block_rows(self, block: int) -> tuple[int, int]:
    return self.placement.rows_of(self._first + block)

  def split_ids(
    self,
    ids: tf.Tensor,
    ops: StepOps,
    index: tf.Tensor | None = None,
    positions: bool = False,
    slots: bool = False,
  ) -> OwnerSplit:
    return ops.split_by_owner(
      ids, self.placement.shard_offsets, index, positions, slots
    )

  def owned_rows(
    self, ids: tf.Tensor, replica: int
  ) -> tuple[tf.Tensor, tf.Tensor]:
    offset, size = self.placement.rows_of(replica)
    mine = tf.logical_and(ids >= offset, ids < offset + size)
    return tf.where(mine, ids - offset, tf.zeros_like(ids)), mine

  def gather(
    self,
    ids: tf.Tensor,
    key: str = "parameters",
    ops: StepOps = TENSORFLOW_OPS,
  ) -> tf.Tensor:
    del ops  # Outside strategy.run: TensorFlow's lookup over the blocks.
    # "div" row blocks: embedding_lookup returns the rows in id order.
    return decode(tf.nn.embedding_lookup(self._variables[key], ids))
