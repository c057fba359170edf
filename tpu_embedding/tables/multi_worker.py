"""Row blocks of a table spread over the workers of a cluster.

Under ``MultiWorkerMirroredStrategy`` each worker holds the row blocks of
its own replicas (``row_sharded.create_blocks``); no process can read the
whole table alone. Users and checkpoints see a ``WorkerShardedVariable``:
reading it (``tf.convert_to_tensor``, ``numpy()``, a checkpoint save) is
a collective that every worker must join; a restore writes each worker's
own rows.

Example:
  >>> from tpu_embedding.tables.multi_worker import MultiWorkerShardedTable
  >>> MultiWorkerShardedTable.layout
  'row_sharded_multi_worker'
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding.config import TableConfig
from tpu_embedding.sharding import TablePlacement
from tpu_embedding.tables.base import Block
from tpu_embedding.tables.base import WholeValueVariable
from tpu_embedding.tables.row_sharded import RowShardedTable


class WorkerShardedVariable(WholeValueVariable):
  """A row-sharded variable whose blocks live on several workers."""

  def __init__(
    self,
    strategy: tf.distribute.Strategy,
    shards: list[tf.Variable],
    placement: TablePlacement,
    first: int,
  ):
    self._strategy = strategy
    self._shards = shards
    self._placement = placement
    self._first = first

  @property
  def shape(self) -> tf.TensorShape:
    rows = sum(self._placement.shard_sizes)
    return tf.TensorShape([rows, self._shards[0].shape[1]])

  @property
  def dtype(self) -> tf.DType:
    return self._shards[0].dtype

  def read_value(self) -> tf.Tensor:
    """The whole value (a collective: every worker must call it)."""
    width = max(self._placement.shard_sizes)

    def padded(context):
      local = context.replica_id_in_sync_group - self._first
      value = self._shards[local].read_value()
      return tf.pad(value, [[0, width - tf.shape(value)[0]], [0, 0]])

    stacked = self._strategy.gather(
      self._strategy.experimental_distribute_values_from_function(padded),
      axis=0,
    )
    blocks = [
      stacked[r * width : r * width + size]
      for r, size in enumerate(self._placement.shard_sizes)
    ]
    return tf.concat(blocks, axis=0)

  def assign(self, value: Any) -> Any:
    """Writes this worker's rows of a whole ``value``."""
    assigns = []
    for local, shard in enumerate(self._shards):
      replica = self._first + local
      start = self._placement.shard_offsets[replica]
      rows = self._placement.shard_sizes[replica]
      assigns.append(shard.assign(value[start : start + rows]))
    return tf.group(assigns)



class MultiWorkerShardedTable(RowShardedTable):
  """Row blocks over all workers' replicas; this process holds its own."""

  layout = "row_sharded_multi_worker"

  def __init__(
    self,
    table: TableConfig,
    placement: TablePlacement,
    blocks: list[Block],
    first: int,
    strategy: tf.distribute.Strategy,
  ):
    self._strategy = strategy
    super().__init__(table, placement, blocks, first)

  def _user_variable(self, key: str, shards: list[Any]) -> Any:
    return WorkerShardedVariable(
      self._strategy, shards, self.placement, self._first
    )

  def gather(self, ids: tf.Tensor, key: str = "parameters") -> tf.Tensor:
    raise RuntimeError(
      f"Table '{self.table.name}' is sharded over several workers: no "
      "process can read its rows alone. Look it up inside strategy.run "
      "(every worker together), or save a checkpoint and serve from it "
      "(tools/export.py)."
    )

  def update(self, ids: tf.Tensor, grads: tf.Tensor) -> None:
    raise RuntimeError(
      f"Table '{self.table.name}' is sharded over several workers: update "
      "it inside strategy.run (apply_gradients), every worker together."
    )
