"""How one row block writes float32 update results into its stored types.

A block of a table stored in 16 bits (``RowStorage``) counts the updates
it has applied; the count is the ``step`` of its stochastic rounding, so
each update draws afresh and a run repeats bit for bit. Rows are numbered
globally (the block's first row plus the row within it): a row gets the
same draw in every layout. A float32 table's block rounds nothing and
keeps no count.

Every block of a table applies each step's update (with or without rows
of its own), so all blocks hold one count: ``UpdateCount`` saves it as
the scalar ``<table>/update_count`` and restores it into every block, and
a run resumed from a checkpoint draws as the uninterrupted run does.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> table = tpe.TableConfig(8, 2, name="t",
  ...                         storage=tpe.RowStorage("bfloat16"))
  >>> rounding = BlockRounding(table, first_row=4, device=None)
  >>> rounding.encode("parameters", tf.ones([1, 2]), tf.constant([0])).dtype
  tf.bfloat16
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.config import TableConfig
from tpu_embedding.resolved import table_name
from tpu_embedding.row_storage import RowStorage


class BlockRounding:
  """The rounding of one row block's writes, and its update count.

  Args:
    table: the (resolved) table; its ``storage`` says the stored types.
    first_row: the block's first global row.
    device: the block's device (where its count lives); None: the
      current one.
  """

  def __init__(self, table: TableConfig, first_row: int, device: str | None):
    self._storage = table.storage
    self._table = table_name(table) if table.name else "<unnamed>"
    optimizer = table.optimizer
    slots = () if optimizer is None else tuple(optimizer.SLOT_NAMES)
    self._streams = {"parameters": 0} | {
      name: i + 1 for i, name in enumerate(slots)
    }
    self._first_row = first_row
    self._count: Any = None
    if not self._storage.is_float32:
      with tf.device(device):
        self._count = compat.ResourceVariable(
          tf.constant(0, tf.int64), trainable=False, name="update_count"
        )

  def encode(self, key: str, values: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
    """Float32 ``values`` of block rows ``rows``, in ``key``'s stored type
    (rounded as the storage says; the count read here is this update's)."""
    if self._count is None:
      return values
    stream = self._streams.get(key, len(self._streams))
    return self._storage.encode(
      values,
      key=stream,
      rows=self._global_rows(tf.cast(rows, tf.int64)),
      step=self._count.read_value(),
      table=self._table,
    )

  def _global_rows(self, rows: tf.Tensor) -> tf.Tensor:
    """The global rows of block rows ``rows`` (what the draws take)."""
    return rows + self._first_row

  @property
  def storage(self) -> RowStorage:
    """The table's ``RowStorage``."""
    return self._storage

  @property
  def first_row(self) -> int:
    """The block's first global row: its row ``i`` is global row
    ``first_row + i`` (its draws' row; the fused kernel's too)."""
    return self._first_row

  @property
  def fused(self) -> bool:
    """Whether the fused kernel may write the block: its rows draw by
    ``first_row + row``, as the kernel numbers them."""
    return True

  def cached(self, slots: tf.Tensor, rows: tf.Tensor) -> list[Any]:
    """Records that block rows ``slots`` now hold ``rows`` (a cache's);
    the writes. A block of consecutive rows maps nothing."""
    del slots, rows
    return []

  @property
  def table(self) -> str:
    """The table's name (what a float16 overflow names)."""
    return self._table

  def step(self) -> tf.Tensor:
    """This update's count (scalar int64): the draws' step."""
    if self._count is None:
      return tf.constant(0, tf.int64)
    return self._count.read_value()

  def counts(self) -> bool:
    """Whether the block counts its updates (a 16-bit table's)."""
    return self._count is not None

  def restore(self, count: tf.Tensor) -> Any:
    """Sets the count (a checkpoint's); None where nothing rounds."""
    if self._count is None:
      return None
    return self._count.assign(count, read_value=False)

  def advance(self) -> Any:
    """Counts one update (after its writes); None where nothing rounds."""
    if self._count is None:
      return None
    return self._count.assign_add(1, read_value=False)


class CachedRowsRounding(BlockRounding):
  """The rounding of a cache of rows (a disk-tiered table's): its block
  rows are slots, each holding some global row, which the draws take.

  Args:
    table: the (resolved) table.
    first_row: the global row of the cache's row ``0`` of its rows (a row
      block of a tiered sharded table starts past ``0``).
    slots: the cache's slots.
    device: the cache's device.

  Example:
    >>> import tensorflow as tf
    >>> import tpu_embedding as tpe
    >>> table = tpe.TableConfig(100, 2, name="t",
    ...                         storage=tpe.RowStorage("bfloat16"))
    >>> rounding = CachedRowsRounding(table, first_row=50, slots=4,
    ...                               device=None)
    >>> _ = rounding.cached(tf.constant([0, 3], tf.int64),
    ...                     tf.constant([7, 2], tf.int64))
    >>> rounding._global_rows(tf.constant([3, 0], tf.int64)).numpy().tolist()
    [52, 57]
    >>> rounding.fused  # (the kernel numbers rows from a first row)
    False
  """

  def __init__(
    self, table: TableConfig, first_row: int, slots: int, device: str | None
  ):
    super().__init__(table, first_row, device)
    self._slot_rows: Any = None
    if self.counts():
      with tf.device(device):
        self._slot_rows = compat.ResourceVariable(
          tf.zeros([slots], tf.int64), trainable=False, name="slot_rows"
        )

  @property
  def fused(self) -> bool:
    # Slots hold rows by the cache's map, which the kernel does not read
    # (a float32 cache draws nothing: the kernel writes it).
    return not self.counts()

  def cached(self, slots: tf.Tensor, rows: tf.Tensor) -> list[Any]:
    """Records that ``slots`` now hold the cache's rows ``rows`` (rows of
    its own numbering); the writes (none where nothing rounds)."""
    if not self.counts():
      return []
    return [
      tf.raw_ops.ResourceScatterUpdate(
        resource=self._slot_rows.handle,
        indices=slots,
        updates=tf.cast(rows, tf.int64) + self._first_row,
      )
    ]

  def _global_rows(self, rows: tf.Tensor) -> tf.Tensor:
    return tf.gather(self._slot_rows, rows)


# Trackable is TensorFlow's (untyped: ``Any`` to mypy).
class UpdateCount(compat.Trackable):  # type: ignore[misc]
  """The update count of a store's blocks, as one checkpoint value.

  Saved from the first block (every block of a table counts the same
  updates); restored into every block.

  Args:
    roundings: the store's blocks' roundings (of a 16-bit table).

  Example:
    >>> import tensorflow as tf
    >>> import tpu_embedding as tpe
    >>> table = tpe.TableConfig(4, 1, name="t",
    ...                         storage=tpe.RowStorage("float16"))
    >>> import tempfile
    >>> blocks = [BlockRounding(table, 0, None) for _ in range(2)]
    >>> _ = [block.advance() for block in blocks]
    >>> path = tf.train.Checkpoint(count=UpdateCount(blocks)).write(
    ...     tempfile.mkdtemp() + "/c")
    >>> again = [BlockRounding(table, 0, None) for _ in range(2)]
    >>> _ = tf.train.Checkpoint(count=UpdateCount(again)).read(path)
    >>> [int(block.step()) for block in again]
    [1, 1]
  """

  def __init__(self, roundings: Sequence[BlockRounding]):
    self._roundings = tuple(roundings)

  def _serialize_to_tensors(self) -> dict[str, Any]:
    return {"VARIABLE_VALUE": self._roundings[0].step()}

  def _restore_from_tensors(
    self, restored_tensors: Mapping[str, tf.Tensor]
  ) -> Any:
    value = tf.cast(restored_tensors["VARIABLE_VALUE"], tf.int64)
    return tf.group([r.restore(value) for r in self._roundings])
