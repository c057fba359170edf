"""The table store: one table's parameters and slots, in one layout.

Every layout a table can have (whole on one device, row blocks over
replicas or parameter servers, row blocks over workers, a copy per
replica) is one ``TableStore`` subclass with the same small interface:

========================  ===================================================
``variables``             ``{"parameters": v, <slot>: v}``: what users,
                          ``embedding_tables`` and checkpoints see
``blocks``                this process's row blocks, one dict of plain
                          variables per local device
``block_rows(i)``         ``(first row, rows)`` of local block ``i``
``gather(ids)``           rows by id, in id order (where this host can)
``peek(ids)``             the same, changing nothing (serving lookups)
``update_block(i, ...)``  the optimizer applied to rows of block ``i``
``update(ids, grads)``    the optimizer applied to rows by global id
``gather_block(i, rows)`` rows of local block ``i`` (a row exchange's read;
                          ``gather_block_lists``: a step's, per sender)
``split_ids(ids, ops)``   each replica's share of ids, as rows of its block
``owned_rows(ids, r)``    the ids replica ``r`` holds, as rows of its block
``read(key)``             the whole ``[vocabulary_size, dim]`` value
``assign(value, key)``    writes a whole value into every block
``bytes_per_device()``    bytes of parameters and slots on each device
``changed_rows()``        rows written since ``clear_changes()`` (deltas)
``write_rows_at(ids, v)`` writes rows by global id (a delta's restore)
========================  ===================================================

Checkpoints save each of ``variables`` under TensorFlow's keys
(``<table>`` and ``<table>/<slot>``) with its full logical value, whatever
the layout. Serving, export, the Keras layers and the backends use only
this interface; adding a layout means adding one subclass.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> table = tpe.TableConfig(4, 2, name="t",
  ...                         initializer=tpe.RowIdInitializer())
  >>> emb = tpe.TPUEmbedding(tpe.FeatureConfig(table), tpe.Adagrad(0.1))
  >>> store = emb.table_stores["t"]
  >>> store.keys
  ('parameters', 'accumulators')
  >>> store.gather(tf.constant([3, 1], tf.int64)).numpy().tolist()
  [[3.0, 3.0], [1.0, 1.0]]
  >>> store.bytes_per_device()  # 4 rows x 2 x 4 bytes, twice
  {'/job:localhost/replica:0/task:0/device:CPU:0': 64}
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.checkpointing import rows as saved_rows
from tpu_embedding.checkpointing import slicing
from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import PickedRows
from tpu_embedding.gradients import RowGradients
from tpu_embedding.gradients import summed_gradients
from tpu_embedding.initializers import Initializer
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.kernels.split_by_owner import OwnerSplit
from tpu_embedding.lookup import RowRequest
from tpu_embedding.lookup import occurrence_rows
from tpu_embedding.resolved import table_name
from tpu_embedding.row_storage import decode
from tpu_embedding.tables.changed_rows import ChangedRows
from tpu_embedding.tables.rounding import BlockRounding
from tpu_embedding.tables.rounding import UpdateCount
from tpu_embedding.tables.update_guards import UNGUARDED
from tpu_embedding.tables.update_guards import UpdateGuard
from tpu_embedding.tables.updates import apply_rows
from tpu_embedding.tracking import VariableTracker

if TYPE_CHECKING:
  from tpu_embedding.tables.row_cache import CacheCounts

#: The variables of one row block: ``{"parameters": var, <slot>: var}``.
Block = dict[str, Any]


def checkpoint_name(table: str, key: str) -> str:
  """TensorFlow's name of a table's variable: ``t`` or ``t/<slot>``."""
  return table if key == "parameters" else f"{table}/{key}"


def variable_specs(table: TableConfig) -> list[tuple[str, Initializer, bool]]:
  """``(key, initializer, trainable)`` of the variables a layout creates.

  The parameters first, then the optimizer's slots, in the optimizer's
  ``SLOT_NAMES`` order; no slots when the optimizer's
  ``slot_variable_creation_fn`` creates them (see ``user_slots``).

  Args:
    table: the (resolved) table.
  """
  optimizer = table.optimizer
  specs = [("parameters", table.initializer, True)]
  if optimizer is None or optimizer.slot_variable_creation_fn is not None:
    return specs
  return specs + [
    (slot, initializer, False)
    for slot, initializer in zip(
      optimizer.SLOT_NAMES, optimizer.slot_initializers(), strict=True
    )
  ]


def _no_default_slots(name: str, initializer: Any) -> Any:
  raise AssertionError("the slot_variable_creation_fn makes every slot")


def user_slots(table: TableConfig, block: Block) -> None:
  """Adds the slots a ``slot_variable_creation_fn`` makes for one block.

  The function is called with the block's parameters variable (its rows
  only), the slot names and the slot initializers, as TensorFlow calls
  it with a table; each slot must have the block's shape.

  Raises:
    ValueError: if a slot has another shape.
  """
  optimizer = table.optimizer
  if optimizer is None or optimizer.slot_variable_creation_fn is None:
    return
  parameters = block["parameters"]

  def plain_variable(
    next_creator: Callable[..., tf.Variable], **kwargs: Any
  ) -> tf.Variable:
    del next_creator  # A plain variable on this device, not a mirrored one.
    return compat.ResourceVariable(
      initial_value=kwargs.get("initial_value"),
      trainable=kwargs.get("trainable", False),
      name=kwargs.get("name"),
      dtype=kwargs.get("dtype"),
      shape=kwargs.get("shape"),
    )

  with tf.device(parameters.device), tf.variable_creator_scope(plain_variable):
    slots = optimizer.create_slots(parameters, _no_default_slots)
  for name, slot in slots.items():
    if tuple(slot.shape) != tuple(parameters.shape):
      raise ValueError(
        f"Table '{table.name}': slot_variable_creation_fn made slot "
        f"'{name}' of shape {list(slot.shape)}; each slot must have the "
        f"shape of the table variable it is given, "
        f"{list(parameters.shape)}."
      )
    block[name] = slot


class TableStore(metaclass=abc.ABCMeta):
  """One table's parameters and optimizer slots, in one layout.

  Attributes:
    table: the resolved (named) ``TableConfig``.
  """

  #: Whether every write of the rows goes through this store (and is
  #: marked for delta checkpoints); a store wrapping variables that others
  #: update (Keras weights) counts every row as changed.
  tracks_changes = True

  #: Short name of the layout, for reports ("whole", "row_sharded", ...).
  layout = ""

  #: Whether each replica holds its own range of the rows (a shard) rather
  #: than all of them. State kept per row beside the table (a dynamic
  #: vocabulary's, ``vocabularies/``) is laid out alike: its users ask the
  #: store, never the plan or the layout's class.
  rows_sharded = False

  def __init__(
    self,
    table: TableConfig,
    variables: Block,
    blocks: list[Block],
    guard: UpdateGuard = UNGUARDED,
  ):
    """Wraps existing variables (layouts' ``create`` methods make them).

    Args:
      table: the resolved table.
      variables: ``{"parameters": v, <slot>: v}`` as users see them.
      blocks: this process's row blocks.
      guard: how block updates run (``update_guards.py``: as they come,
        or one at a time and each step's once, for parameter servers).
    """
    self.table = table
    self._variables = dict(variables)
    self._blocks = blocks
    devices = [getattr(b["parameters"], "device", None) for b in blocks]
    self._guard = guard.for_blocks(table_name(table), devices)
    # One bit per row of each block: set by every write, cleared by a save
    # (``tpu_embedding.delta_checkpoints``).
    self._changes = [
      ChangedRows(
        getattr(block["parameters"], "device", None),
        self.block_rows(index)[1],
      )
      for index, block in enumerate(blocks)
    ]
    # How each block rounds its updates to the stored types.
    self._rounding = [
      self._block_rounding(index, getattr(block["parameters"], "device", None))
      for index, block in enumerate(blocks)
    ]
    for key, variable in self._variables.items():
      attach(variable, self, key)

  def _block_rounding(self, block: int, device: str | None) -> BlockRounding:
    """How local block ``block`` (on ``device``) rounds its updates: its
    rows are global rows from its first."""
    return BlockRounding(self.table, self.block_rows(block)[0], device)

  @property
  def keys(self) -> tuple[str, ...]:
    """``("parameters", <slot names>...)``."""
    return tuple(self.variables)

  @property
  def variables(self) -> dict[str, Any]:
    """``{"parameters": v, <slot>: v}`` as users and checkpoints see them.

    Each value converts with ``tf.convert_to_tensor`` (the whole table)
    and has ``shape`` ``[vocabulary_size, dim]``.
    """
    return self._variables

  @property
  def blocks(self) -> list[Block]:
    """This process's row blocks, one per local device (or PS task)."""
    return self._blocks

  @abc.abstractmethod
  def block_rows(self, block: int) -> tuple[int, int]:
    """``(first global row, number of rows)`` of local block ``block``."""

  @abc.abstractmethod
  def gather(
    self,
    ids: tf.Tensor,
    key: str = "parameters",
    ops: StepOps = TENSORFLOW_OPS,
  ) -> tf.Tensor:
    """Rows ``ids`` (any shape) of ``key``, in id order: ``ids.shape + [dim]``.

    ``ops``: the step's row ops (``kernels/ops.py``; a layout may gather
    with TensorFlow's whatever they are).

    Raises:
      RuntimeError: where this host cannot read every row (a table
        sharded over several workers: look it up inside ``strategy.run``).
    """

  def peek(self, ids: tf.Tensor, key: str = "parameters") -> tf.Tensor:
    """``gather(ids, key)`` leaving the store as it is: what serving and
    evaluation lookups read (a disk-tiered table admits no row)."""
    return self.gather(ids, key)

  def gather_occurrences(
    self, request: RowRequest, ops: StepOps = TENSORFLOW_OPS
  ) -> PickedRows:
    """The parameters' row of each id occurrence of ``request``
    (``lookup.RowRequest``): its distinct rows, gathered once and picked
    in place; a layout holding its rows in one variable lets ``ops``
    choose (``StepOps.gather_occurrences``)."""
    return occurrence_rows(self.gather(request.ids, ops=ops), request.index)

  def gather_block(
    self, block: int, rows: tf.Tensor, ops: StepOps = TENSORFLOW_OPS
  ) -> tf.Tensor:
    """The parameters' rows ``rows`` (within local block ``block``), in
    order: what this replica's block answers a row exchange."""
    return ops.gather_rows(self._blocks[block]["parameters"], rows)

  def gather_block_lists(
    self,
    block: int,
    row_lists: Sequence[tf.Tensor],
    ops: StepOps = TENSORFLOW_OPS,
  ) -> list[tf.Tensor]:
    """``gather_block`` of each of ``row_lists`` (rows within local block
    ``block``, one list per sender): a row exchange's reads of one step,
    which a layout may serve together (a disk-tiered block caches them
    at once)."""
    return [self.gather_block(block, rows, ops) for rows in row_lists]

  def gather_block_occurrences(
    self, block: int, request: RowRequest, ops: StepOps = TENSORFLOW_OPS
  ) -> PickedRows:
    """``gather_occurrences`` from local block ``block`` alone, where it
    holds every row (a replica's own copy)."""
    return ops.gather_occurrences(
      self._blocks[block]["parameters"],
      request.ids,
      request.index,
      request.one_per_row,
    )

  def split_ids(
    self,
    ids: tf.Tensor,
    ops: StepOps,
    index: tf.Tensor | None = None,
    positions: bool = False,
    slots: bool = False,
  ) -> OwnerSplit:
    """Each replica's share of ``ids`` (or of the occurrences
    ``ids[index]``) as rows of its block: what a row exchange
    (``backends/exchanges.py``) sends each (``StepOps.split_by_owner``).

    Raises:
      NotImplementedError: for a layout whose rows no replicas share.
    """
    del ids, ops, index, positions, slots
    raise NotImplementedError(f"A {self.layout} table is not exchanged.")

  def owned_rows(
    self, ids: tf.Tensor, replica: int
  ) -> tuple[tf.Tensor, tf.Tensor]:
    """``(row within the block, mask)`` of the ``ids`` global replica
    ``replica`` holds; padding ids (-1) are never held.

    Raises:
      NotImplementedError: for a layout whose rows no replicas share.
    """
    del ids, replica
    raise NotImplementedError(f"A {self.layout} table is not exchanged.")

  def write_block_rows(
    self, block: int, rows: tf.Tensor, values: Mapping[str, tf.Tensor]
  ) -> list[Any]:
    """Writes ``values[key]`` (one row per entry of ``rows``, within
    local block ``block``) into each key given; the rows count as
    written. Returns the writes."""
    writes = [
      tf.raw_ops.ResourceScatterUpdate(
        resource=self._blocks[block][key].handle,
        indices=rows,
        updates=tf.cast(value, self._blocks[block][key].dtype),
      )
      for key, value in values.items()
    ]
    return [*writes, self.mark_rows(block, rows)]

  def read(self, key: str = "parameters") -> tf.Tensor:
    """The whole ``[vocabulary_size, dim]`` value of ``key``.

    (Under MultiWorkerMirroredStrategy a collective every worker joins.)
    Float32, whatever the stored type (``RowStorage``).
    """
    return decode(tf.convert_to_tensor(self._variables[key]))

  def assign(self, value: Any, key: str = "parameters") -> Any:
    """Writes a whole ``[vocabulary_size, dim]`` value of ``key``.

    Each local block (or copy) takes its rows of ``value``.
    """
    assigns = []
    for block in range(len(self._blocks)):
      first, rows = self.block_rows(block)
      variable = self._blocks[block][key]
      assigns.append(
        variable.assign(tf.cast(value[first : first + rows], variable.dtype))
      )
      assigns.append(self._changes[block].mark_all())
    return tf.group([a for a in assigns if a is not None])

  def update_block(
    self,
    block: int,
    rows: tf.Tensor,
    grads: RowGradients,
    index: tf.Tensor | None = None,
    ops: StepOps = TENSORFLOW_OPS,
    step_id: tf.Tensor | None = None,
  ) -> None:
    """Applies the table's optimizer to rows of one local block.

    Under a locking guard (``update_guards.LockedUpdates``) the update
    runs on the block's device, one at a time: concurrent steps never
    interleave their reads and writes; with ``step_id`` it runs only if
    that step has not updated the block yet.

    Args:
      block: the local block index.
      rows: ``[n]`` distinct row indices *within the block*.
      grads: ``[n, dim]`` summed gradients of those rows, or with
        ``index`` the ``[m, dim]`` gradients of single occurrences (where
        they are: ``gradients.RowGradients``).
      index: None, or ``[m]`` int32 position in ``rows`` of each gradient
        (see ``updates.apply_rows``).
      ops: the step's row ops (``kernels/ops.py``).
      step_id: None, or the step's scalar int64 id: under a locking
        guard, a step re-run with the same id does not update the block
        again (``step_record.py``); ignored otherwise (such steps are
        never re-run).
    """
    variables = self.blocks[block]
    size = self.block_rows(block)[1]
    optimizer, changes = self.table.optimizer, self._changes[block]
    rounding = self._rounding[block]

    def write() -> list[Any]:
      writes = apply_rows(
        self.table, variables, rows, grads, size, index, ops, rounding
      )
      # The rows written: every row, for an optimizer changing all of them.
      if optimizer is not None and optimizer.updates_all_rows:
        return [*writes, changes.mark_all()]
      return [*writes, changes.mark(rows, ops)]

    self._guard.run(block, write, step_id)

  def mark_rows(
    self, block: int, rows: tf.Tensor, ops: StepOps = TENSORFLOW_OPS
  ) -> Any:
    """Records that rows ``rows`` (local to ``block``) were written.

    Every write of a layout's rows reports here (``update_block`` does;
    a writer of its own, such as a dynamic vocabulary resetting rows for
    new keys, calls it): a delta checkpoint holds exactly those rows.
    ``ops``: the step's row ops (``kernels/ops.py``), which write the
    flags.
    """
    return self._changes[block].mark(rows, ops)

  def changed_rows(self) -> tf.Tensor:
    """Sorted int64 global ids of this process's rows written since the
    last ``clear_changes()`` (a copy per replica counts once)."""
    parts = []
    for block in self._distinct_blocks():
      first, size = self.block_rows(block)
      if not self.tracks_changes:  # Written by others: every row may be.
        parts.append(tf.range(first, first + size, dtype=tf.int64))
        continue
      parts.append(self._changes[block].rows() + first)
    if not parts:
      return tf.zeros([0], tf.int64)
    return tf.concat(parts, 0)

  def _distinct_blocks(self) -> list[int]:
    """The local blocks holding distinct rows (one of equal copies)."""
    return list(range(len(self._blocks)))

  def clear_changes(self) -> None:
    """Forgets the rows written so far (a save holds them now)."""
    for changes in self._changes:
      changes.clear()

  @property
  def reads_ahead(self) -> bool:
    """Whether ``prefetch_rows`` reads anything (a disk tier's rows)."""
    return False

  def prefetch_rows(self, ids: Any) -> None:
    """Readies rows ``ids`` (host values) of a coming step: nothing for a
    layout in memory (a disk tier reads them ahead into RAM)."""
    del ids

  def cache_counts(self) -> list[CacheCounts]:
    """What each of this process's disk-tier caches of the table counted
    so far (hits, misses, rows read and written); none for a layout in
    memory."""
    return []

  def read_rows(self, ids: tf.Tensor, key: str = "parameters") -> tf.Tensor:
    """Rows ``ids`` (global, held by this process's blocks) of ``key``,
    read from the blocks holding them (only those rows)."""
    ids = tf.convert_to_tensor(ids, tf.int64)
    parts = []
    for block in self._distinct_blocks():
      first, size = self.block_rows(block)
      mine = tf.boolean_mask(
        ids - first, tf.logical_and(ids >= first, ids < first + size)
      )
      variable = self._blocks[block][key]
      with tf.device(variable.device):
        parts.append(
          decode(
            tf.raw_ops.ResourceGather(
              resource=variable.handle, indices=mine, dtype=variable.dtype
            )
          )
        )
    return tf.concat(parts, 0)

  def write_rows_at(
    self, ids: tf.Tensor, value: Any, key: str = "parameters"
  ) -> Any:
    """Writes rows ``value`` at global ids ``ids`` of ``key`` in place.

    Each local block (or copy) takes the rows it holds; other ids are
    left to the processes holding them. The rows count as written.
    """
    ids = tf.convert_to_tensor(ids, tf.int64)
    value = tf.convert_to_tensor(value, tf.float32)
    writes = []
    for block in range(len(self._blocks)):
      first, size = self.block_rows(block)
      mine = tf.logical_and(ids >= first, ids < first + size)
      writes += self.write_block_rows(
        block,
        tf.boolean_mask(ids - first, mine),
        {key: tf.boolean_mask(value, mine)},
      )
    return tf.group([w for w in writes if w is not None])

  def write_rows(self, first: int, value: Any, key: str = "parameters") -> Any:
    """Writes rows ``[first, first + len(value))`` of ``key`` in place
    (``write_rows_at`` those ids)."""
    value = tf.convert_to_tensor(value, tf.float32)
    ids = tf.range(first, first + int(value.shape[0]), dtype=tf.int64)
    return self.write_rows_at(ids, value, key)

  def update(
    self,
    ids: tf.Tensor,
    grads: RowGradients,
    index: tf.Tensor | None = None,
    ops: StepOps = TENSORFLOW_OPS,
    step_id: tf.Tensor | None = None,
  ) -> None:
    """Applies the table's optimizer to rows ``ids`` (distinct, global).

    Each local block updates the rows it owns.

    Args:
      ids: ``[n]`` distinct global row ids.
      grads: ``[n, dim]`` summed gradients, or with ``index`` the
        gradients of single occurrences (see ``update_block``).
      index: None, or the position in ``ids`` of each row of ``grads``.
      ops: the step's row ops (``kernels/ops.py``).
      step_id: None, or the step's id (see ``update_block``).
    """
    if self.block_rows(0) == (0, self.table.vocabulary_size):
      # One block holds every row.
      self.update_block(0, ids, grads, index, ops, step_id)
      return
    summed = summed_gradients(ids, grads, index)
    for block in range(len(self.blocks)):
      first, size = self.block_rows(block)
      mine = tf.logical_and(ids >= first, ids < first + size)
      self.update_block(
        block,
        tf.boolean_mask(ids - first, mine),
        RowGradients.dense(tf.boolean_mask(summed, mine)),
        ops=ops,
        step_id=step_id,
      )

  def held_variables(self) -> list[Any]:
    """This host's variables holding the table's rows (and slots).

    The blocks' variables; for a stacked table, its stack's.
    """
    return [v for block in self.blocks for v in block.values()]

  def bytes_per_device(self) -> dict[str, int]:
    """Bytes of parameters and slots held on each of this host's devices."""
    totals: dict[str, int] = {}
    for block in self.blocks:
      for variable in block.values():
        size = variable.shape.num_elements() * variable.dtype.size
        totals[variable.device] = totals.get(variable.device, 0) + size
    return totals

  def member_variable(self, table: TableConfig, key: str, offset: int) -> Any:
    """What users and checkpoints see of ``key`` of a stacked ``table``
    held from row ``offset`` of this (a stack's) store: its rows as a
    whole variable (``tables/stacked.py``)."""
    return StackSliceVariable(self, key, offset, table.vocabulary_size)

  @property
  def counts_updates(self) -> bool:
    """Whether its blocks count their updates (a 16-bit table's: the
    step of its stochastic rounding)."""
    return any(rounding.counts() for rounding in self._rounding)

  def update_count(self) -> int:
    """The blocks' update count (each applies every update: one count);
    0 where nothing counts."""
    return int(self._rounding[0].step()) if self.counts_updates else 0

  def set_update_count(self, count: int) -> None:
    """Sets every block's update count (a saved one)."""
    for rounding in self._rounding:
      rounding.restore(tf.constant(count, tf.int64))

  def track_update_count(
    self, tracker: VariableTracker, tables: Sequence[str]
  ) -> None:
    """Tracks the blocks' update count (a 16-bit table's: the step of
    its stochastic rounding) as ``<table>/update_count`` of each of
    ``tables`` (a stack's members share their stack's); a table that
    rounds nothing keeps no count."""
    if not self.counts_updates:
      return
    count = UpdateCount(self._rounding)
    for table in tables:
      tracker.register(
        checkpoint_name(table, "update_count"), count, restore=True
      )

  def track(self, tracker: VariableTracker) -> None:
    """Registers ``variables`` for checkpoints under TensorFlow's keys (a
    checkpoint restored before they existed: ``restore_pending``)."""
    for key, variable in self.variables.items():
      name = checkpoint_name(table_name(self.table), key)
      restore_pending(tracker, name, variable)
      tracker.register(name, variable)


def restore_pending(tracker: VariableTracker, name: str, variable: Any) -> None:
  """Reads a checkpoint restored before ``variable`` (tracked as ``name``)
  existed into it part by part where it restores by parts
  (``rows.RowBlocks``: a disk table's files), as ``checkpoints.restore``
  reads built tables; TensorFlow's restore on tracking would read it whole.

  Raises:
    ValueError: the checkpoint holds another shape.
  """
  shape = tuple(int(d) for d in variable.shape)
  restore = tracker.checked_restore(name, (shape[0], shape[1]))
  if (
    isinstance(variable, saved_rows.RowBlocks)
    and restore is not None
    and not tracker.restored(variable, restore)
  ):
    path, saved_key = compat.restore_source(restore)
    variable.restore_rows(saved_rows.SavedRows(path), saved_key)
    tracker.mark_restored(variable, restore)


#: TensorFlow's checkpoint key of a variable's value.
VALUE_KEY = "VARIABLE_VALUE"


# Trackable is TensorFlow's (untyped: ``Any`` to mypy).
class WholeValueVariable(compat.Trackable, metaclass=abc.ABCMeta):  # type: ignore[misc]
  """What users see of a layout held in several variables, as one.

  Subclasses give ``shape``, ``dtype``, ``read_value()`` (the whole
  ``[vocabulary_size, dim]`` value) and ``assign(value)`` (a whole value);
  this class makes it convert with ``tf.convert_to_tensor``, have
  ``numpy()``, and save and restore as one variable under TensorFlow's
  key, like a ``tf.Variable`` of the full shape.
  """

  @abc.abstractmethod
  def read_value(self) -> tf.Tensor:
    """The whole value."""

  @abc.abstractmethod
  def assign(self, value: Any) -> Any:
    """Writes a whole value."""

  def numpy(self) -> Any:
    return self.read_value().numpy()

  def value(self) -> tf.Tensor:
    return self.read_value()

  def __getitem__(self, key: Any) -> tf.Tensor:
    return self.read_value()[key]

  def _serialize_to_tensors(self) -> dict[str, Any]:
    if slicing.rows():  # A delta: the rows are written apart, never read.
      return {
        VALUE_KEY: compat.SaveSpec(
          self.read_value, "", "", dtype=self.dtype, device="CPU:0"
        )
      }
    return {VALUE_KEY: self.read_value()}

  def _restore_from_tensors(
    self, restored_tensors: Mapping[str, tf.Tensor]
  ) -> Any:
    return self.assign(restored_tensors[VALUE_KEY])


tf.register_tensor_conversion_function(
  WholeValueVariable,
  lambda value, dtype=None, name=None, as_ref=False: value.read_value(),
)


class StackSliceVariable(WholeValueVariable, saved_rows.RowBlocks):
  """One member's rows of one stack variable, as a whole variable (of the
  stack's stored type: a 16-bit stack's members save as 16 bits, as an
  unstacked table does). ``tpu_embedding.checkpoints.restore`` (and a
  restore before build) writes a checkpoint's value into the stack part
  by part, from any float type (TensorFlow's own restore reads only the
  stored one)."""

  def __init__(self, stack: TableStore, key: str, offset: int, rows: int):
    self.stack = stack
    self.key = key
    self.offset = offset
    self.rows = rows

  @property
  def shape(self) -> tf.TensorShape:
    return tf.TensorShape([self.rows, self.stack.table.dim])

  @property
  def dtype(self) -> tf.DType:
    return self.stack.table.storage.stored_dtype(
      self.stack.keys.index(self.key)
    )

  def read_value(self) -> tf.Tensor:
    ids = tf.range(self.offset, self.offset + self.rows, dtype=tf.int64)
    # (the stack reads float32; its values are exact in the stored type)
    return tf.cast(self.stack.gather(ids, self.key), self.dtype)

  def assign(self, value: Any) -> Any:
    value = tf.cast(tf.convert_to_tensor(value), tf.float32)
    if tuple(value.shape) != (self.rows, self.stack.table.dim):
      raise ValueError(
        f"Cannot assign a value of shape {list(value.shape)} to a table "
        f"variable of shape {[self.rows, self.stack.table.dim]}."
      )
    return self.stack.write_rows(self.offset, value, self.key)

  def row_blocks(self) -> list[tuple[tf.Variable, int]]:
    return []  # Rows of the stack's blocks: ``restore_rows`` writes them.

  def restore_rows(
    self, saved: saved_rows.SavedRows, key: str, chunk_bytes: int | None = None
  ) -> None:
    full = self.shape.as_list()
    pieces = saved.read_float32_rows(
      key, full, 0, full[0], self.dtype, chunk_bytes
    )
    for first, value in pieces:
      self.stack.write_rows(self.offset + first, value, self.key)


_STORE_ATTRIBUTE = "_tpu_embedding_store"


def attach(variable: Any, store: TableStore, key: str) -> None:
  """Remembers which store (and key) a user-facing variable belongs to."""
  setattr(variable, _STORE_ATTRIBUTE, (store, key))


def parameters_by_user_table(
  user_tables: Sequence[TableConfig],
  tables: Sequence[TableConfig],
  stores: Mapping[str, TableStore],
) -> dict[TableConfig, Any]:
  """``{user TableConfig: parameters variable}`` (``embedding_tables``)."""
  return {
    user: stores[table_name(table)].variables["parameters"]
    for user, table in zip(user_tables, tables, strict=True)
  }


def variables_by_name(
  stores: Mapping[str, TableStore],
) -> dict[str, dict[str, Any]]:
  """``{table: {"parameters": v, <slot>: v}}`` (``variables``)."""
  return {name: dict(store.variables) for name, store in stores.items()}


def row_reader(table: Any) -> Callable[[tf.Tensor], tf.Tensor]:
  """A function reading rows by id, in id order, from a table value.

  ``table`` may be a value from ``embedding_tables``/``variables`` of this
  package (read through its store, whatever the layout), or a foreign
  value as TensorFlow's serving lookup accepts it: a TensorFlow
  ``ShardedVariable`` (read with ``tf.nn.embedding_lookup``, which keeps
  id order for row blocks; ``tf.gather`` would not), or any variable or
  tensor.
  """
  attached = getattr(table, _STORE_ATTRIBUTE, None)
  if attached is not None:
    store, key = attached
    return lambda ids: store.peek(ids, key)
  if isinstance(table, compat.ShardedVariable):
    return lambda ids: tf.nn.embedding_lookup(table, ids)
  return lambda ids: tf.gather(table, ids)
