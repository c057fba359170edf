"""Row blocks of a table spread over the workers of a cluster.

Under ``MultiWorkerMirroredStrategy`` each worker holds the row blocks of
its own replicas (``row_sharded.create_blocks``); no process can read the
whole table alone. Users and checkpoints see a ``WorkerShardedVariable``:
reading it (``tf.convert_to_tensor``, ``numpy()``) is a collective that
every worker must join. Checkpoints written and read through
``tpu_embedding.checkpoints`` hold and read each worker's own rows only
(slices of the full ``[vocabulary_size, dim]`` tensor); a plain
``tf.train.Checkpoint`` save gathers the whole table on every worker.

Example:
  >>> from tpu_embedding.tables.multi_worker import MultiWorkerShardedTable
  >>> MultiWorkerShardedTable.layout
  'row_sharded_multi_worker'
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.checkpointing import parts
from tpu_embedding.checkpointing import rows
from tpu_embedding.checkpointing import slicing
from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import RowGradients
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.sharding import TablePlacement
from tpu_embedding.tables.base import VALUE_KEY
from tpu_embedding.tables.base import Block
from tpu_embedding.tables.base import WholeValueVariable
from tpu_embedding.tables.row_sharded import RowShardedTable
from tpu_embedding.tables.update_guards import UNGUARDED
from tpu_embedding.tables.update_guards import UpdateGuard


class WorkerShardedVariable(
  WholeValueVariable, slicing.WorkerParts, rows.RowBlocks
):
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
  def strategy(self) -> tf.distribute.Strategy:
    """The ``MultiWorkerMirroredStrategy`` the table lives under."""
    return self._strategy

  @property
  def worker_count(self) -> int:
    """Workers holding rows of the table."""
    return len(self._placement.shard_sizes) // len(self._shards)

  @property
  def worker_index(self) -> int:
    """This worker's index (0 is the chief)."""
    return self._first // len(self._shards)

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

    def padded(context: tf.distribute.ReplicaContext) -> tf.Tensor:
      local = context.replica_id_in_sync_group - self._first
      # Gathered as float32 (exact for a 16-bit table: RowStorage).
      value = tf.cast(self._shards[local].read_value(), tf.float32)
      return tf.pad(value, [[0, width - tf.shape(value)[0]], [0, 0]])

    stacked = self._strategy.gather(
      self._strategy.experimental_distribute_values_from_function(padded),
      axis=0,
    )
    blocks = [
      stacked[r * width : r * width + size]
      for r, size in enumerate(self._placement.shard_sizes)
    ]
    return tf.cast(tf.concat(blocks, axis=0), self.dtype)

  def assign(self, value: Any) -> Any:
    """Writes this worker's rows of a whole ``value``."""
    assigns = []
    for local, shard in enumerate(self._shards):
      start, rows = self._rows(local)
      assigns.append(
        shard.assign(tf.cast(value[start : start + rows], shard.dtype))
      )
    return tf.group(assigns)

  def _rows(self, local: int) -> tuple[int, int]:
    return self._placement.rows_of(self._first + local)

  def _rows_spec(self, start: int, count: int) -> str:
    """The checkpoint slice spec of rows ``[start, start + count)``."""
    full_shape = self.shape.as_list()
    return parts.slice_spec(full_shape, [(start, count), (0, full_shape[1])])

  def _serialize_to_tensors(self) -> dict[str, Any]:
    if slicing.apart():  # Recorded; checkpoints.write writes the rows.
      device = self._shards[0].device
      return {VALUE_KEY: slicing.recorded_only(self.dtype, device)}
    if not slicing.active():
      slicing.warn_whole(self._placement.table, self.shape)
      return super()._serialize_to_tensors()
    # Only this worker's rows, as slices of the full logical tensor (read
    # only if saved: a restore needs just the slices' names).
    specs = [self._rows_spec(*self._rows(i)) for i in range(len(self._shards))]
    return {
      VALUE_KEY: {
        spec: compat.SaveSpec(
          shard.read_value, spec, "", dtype=self.dtype, device=shard.device
        )
        for spec, shard in zip(specs, self._shards, strict=True)
      }
    }

  def row_blocks(self) -> list[tuple[tf.Variable, int]]:
    return [
      (shard, self._rows(local)[0]) for local, shard in enumerate(self._shards)
    ]

  def saved_parts(
    self, keys: list[str], chunk_bytes: int | None = None
  ) -> Iterator[tuple[str, list[slicing.Entry]]]:
    """This worker's rows under its checkpoint key, in chunks.

    Each chunk of rows is read (``ResourceGather``: only those rows; a
    dense read of a sparsely updated variable would copy it whole) as a
    slice of the full tensor, a part ``<shard>-<chunk>`` of its own.
    ``chunk_bytes``: see ``parts.chunk_rows``.
    """
    (key,) = keys
    chunk = parts.chunk_rows(self._rows(0)[1], self.shape[1], chunk_bytes)
    for local in range(len(self._shards)):
      start, rows = self._rows(local)
      for first in range(0, rows, chunk):
        count = min(chunk, rows - first)
        value = self._chunk(local, first, count)
        spec = self._rows_spec(start + first, count)
        yield f"{local:03d}-{first:012d}", [(key, spec, value)]
        del value

  def _chunk(self, local: int, first: int, count: int) -> Any:
    """Rows ``[first, first + count)`` of local block ``local``."""
    shard = self._shards[local]
    with tf.device(shard.device):
      return tf.raw_ops.ResourceGather(
        resource=shard.handle,
        indices=tf.range(first, first + count, dtype=tf.int64),
        dtype=self.dtype,
      )


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
    guard: UpdateGuard = UNGUARDED,
  ):
    self._strategy = strategy
    super().__init__(table, placement, blocks, first, guard)

  def _user_variable(self, key: str, shards: list[Any]) -> Any:
    return WorkerShardedVariable(
      self._strategy, shards, self.placement, self._first
    )

  def gather(
    self,
    ids: tf.Tensor,
    key: str = "parameters",
    ops: StepOps = TENSORFLOW_OPS,
  ) -> tf.Tensor:
    raise RuntimeError(
      f"Table '{self.table.name}' is sharded over several workers: no "
      "process can read its rows alone. Look it up inside strategy.run "
      "(every worker together), or save a checkpoint and serve from it "
      "(tools/export.py)."
    )

  def update(
    self,
    ids: tf.Tensor,
    grads: RowGradients,
    index: tf.Tensor | None = None,
    ops: StepOps = TENSORFLOW_OPS,
    step_id: tf.Tensor | None = None,
  ) -> None:
    raise RuntimeError(
      f"Table '{self.table.name}' is sharded over several workers: update "
      "it inside strategy.run (apply_gradients), every worker together."
    )
