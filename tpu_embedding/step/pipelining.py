"""``pipeline_execution_with_tensor_core``: overlap updates with dense work.

On TPU, with pipelining on, the embedding lookup of step ``n + 1`` runs
before the embedding update of step ``n``, so the sparse update overlaps
the dense (TensorCore) computation. Activations are therefore **stale by one
step**: step ``n + 1`` sees the tables before step ``n``'s update::

  step n:     lookup(T_{n-1})  ...dense n...   hold update g_n
  step n+1:   lookup(T_{n-1})  apply g_n -> T_n   ...dense n+1...   hold g_{n+1}
                               \\______ runs alongside dense n+1 ______/

Off TPU, the engine's updates go through an ``UpdateSchedule`` chosen
once: at once, or ``PipelinedUpdates``, which keeps each replica's last
update (its distinct row ids and summed row gradients, per table) in
variables instead of applying it; the next training lookup first gathers,
then applies the held update, with no data dependency between that update
and the dense computation, so TensorFlow's executor can run them
concurrently. ``TPUEmbedding.flush_pipeline()``
applies a held update at once (call it before evaluating, exporting or
saving a checkpoint you want to be exact). A checkpoint holds no held
update, and a restore drops the one held (``HeldUpdates.restore_point``):
the restored tables never take an update computed before them.

Where nothing is held (the first step, the step after a flush, a second
flush) nothing is applied: the stores' block updates run behind a
``HeldGate``, which skips them. An empty update is not a no-op for every
table: non-lazy Adam changes every row each step, and a 16-bit table
counts its updates (the step of its stochastic rounding).

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> table = tpe.TableConfig(4, 1, initializer=tf.zeros_initializer())
  >>> emb = tpe.TPUEmbedding(tpe.FeatureConfig(table), tpe.SGD(1.0),
  ...                        pipeline_execution_with_tensor_core=True)
  >>> for _ in range(2):
  ...   emb.enqueue(tf.constant([1]))
  ...   activations = emb.dequeue()
  ...   emb.apply_gradients(tf.ones_like(activations))
  >>> float(activations[0, 0])  # step 2 saw the table before step 1's update
  0.0
  >>> emb.flush_pipeline()
  >>> float(emb.embedding_tables[table][1, 0])
  -2.0
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.backends.base import Backend
from tpu_embedding.backends.base import GatherRequests
from tpu_embedding.backends.base import TableUpdate
from tpu_embedding.backends.base import Updates
from tpu_embedding.checkpointing.full import DroppedOnRestore
from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import PickedRows
from tpu_embedding.gradients import RowGradients
from tpu_embedding.gradients import concat
from tpu_embedding.gradients import keep_rows
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.replicas import current_replica
from tpu_embedding.replicas import local_replica
from tpu_embedding.replicas import strategy_name
from tpu_embedding.resolved import table_name
from tpu_embedding.tables.update_guards import BlockGuard
from tpu_embedding.tables.update_guards import UpdateGuard
from tpu_embedding.tables.update_guards import Writes
from tpu_embedding.tracking import VariableTracker


class HeldUpdates:
  """Each local replica's last, not yet applied, update of every table.

  A table's held update is its distinct row ids, the gradient rows as the
  update got them (for multi-id features each output row's gradient, not
  one row per id), each occurrence's position among those rows and scale,
  and its index into the ids: ``PickedRows`` again when it is taken.
  """

  def __init__(
    self, tables: Sequence[TableConfig], devices: Sequence[str | None]
  ):
    """Creates empty holding variables.

    Args:
      tables: the resolved tables.
      devices: one device per local replica (None: the default device).
    """
    self._tables = tuple(tables)
    self._held: list[dict[str, tuple[tf.Variable, ...]]] = []
    # Per replica: whether an update is held (an empty one may be).
    self._pending: list[tf.Variable] = []
    for device in devices:
      with tf.init_scope(), tf.device(device):
        self._pending.append(
          compat.ResourceVariable(False, trainable=False, name="held")
        )
        self._held.append(
          {
            table_name(table): (
              _unshaped_variable(tf.zeros([0], tf.int64)),
              _unshaped_variable(tf.zeros([0, table.dim], tf.float32)),
              _unshaped_variable(tf.zeros([0], tf.int32)),
              _unshaped_variable(tf.zeros([0], tf.float32)),
              _unshaped_variable(tf.zeros([0], tf.int32)),
              # Held lengths (ids, rows, occurrences): see _read.
              compat.ResourceVariable(tf.zeros([3], tf.int32), trainable=False),
            )
            for table in self._tables
          }
        )

  def hold(self, replica: int, updates: Updates) -> None:
    """Keeps each table's ``TableUpdate`` for the next ``take``."""
    self._pending[replica].assign(True, read_value=False)
    for update in updates:
      index = update.id_index
      if index is None:  # Summed gradients: occurrence i is row i.
        index = tf.range(tf.size(update.ids, out_type=tf.int32))
      self._assign(
        replica, table_name(update.table), update.ids, update.gradients, index
      )

  def restore_point(self) -> compat.Trackable:
    """What checkpoints save of the holding: that no update is held
    (a constant). Restored, it drops every replica's held update."""
    return _NothingHeld(self)

  def clear(self) -> Any:
    """Drops every replica's held update (unapplied); the writes."""
    return tf.group(
      [write for r in range(len(self._held)) for write in self._emptied(r)]
    )

  def _emptied(self, replica: int) -> list[Any]:
    """Marks ``replica``'s holding empty (nothing held, no rows, the
    values left as they are); the writes."""
    return [
      self._pending[replica].assign(False, read_value=False),
      *(
        held[-1].assign(tf.zeros([3], tf.int32), read_value=False)
        for held in self._held[replica].values()
      ),
    ]

  def drop_rows(self, replica: int, table: str, rows: tf.Tensor) -> None:
    """Removes ``rows`` (and their occurrences) from ``table``'s held
    update."""
    ids, grads, index = _as_update(self._read(replica, table))
    keep = tf.logical_not(_is_in(ids, rows))
    ids, rows, index = keep_rows(ids, grads, index, keep)
    self._assign(replica, table, ids, RowGradients.dense(rows), index)

  def take(self, replica: int) -> tuple[list[TableUpdate], tf.Tensor]:
    """Each table's held ``TableUpdate``, and whether one was held (a
    scalar bool: False, the updates are empty and must not run); the
    holding empties."""
    pending = self._pending[replica].read_value()
    updates = []
    for table in self._tables:
      held = self._held[replica][table_name(table)]
      values = self._read(replica, table_name(table))
      for variable, value in zip(held[:-1], values, strict=True):
        variable.assign(value[:0])
      updates.append(TableUpdate(table, *_as_update(values)))
    # (after the reads above: automatic control dependencies keep each
    # variable's reads and writes in program order)
    self._emptied(replica)
    return updates, pending

  def _read(self, replica: int, table: str) -> list[tf.Tensor]:
    """``table``'s held values, each cut to its held length: a length
    read as data, never as the variable's shape, which Grappler's
    constant folding takes from the value the same step assigns it later
    (a static shape: the occurrences of dense inputs)."""
    *held, lengths = self._held[replica][table]
    n = tf.unstack(lengths.read_value())
    return [
      v.read_value()[: n[k]] for v, k in zip(held, (0, 1, 2, 2, 2), strict=True)
    ]

  def _assign(
    self,
    replica: int,
    table: str,
    ids: tf.Tensor,
    grads: RowGradients,
    index: tf.Tensor,
  ) -> None:
    rows = concat(grads.pieces)
    count = tf.size(index, out_type=tf.int32)
    positions = grads.picks
    if positions is None:
      positions = tf.range(count)
    scales = grads.factors
    if scales is None:  # 1 (exact: x * 1 is x).
      scales = tf.ones([count], tf.float32)
    lengths = tf.stack([tf.size(ids, tf.int32), tf.shape(rows)[0], count])
    values = (ids, rows, tf.cast(positions, tf.int32), scales, index, lengths)
    for variable, value in zip(self._held[replica][table], values, strict=True):
      variable.assign(value)


class _NothingHeld(DroppedOnRestore):
  """Saved as False; restored (by TensorFlow's restore of a checkpoint
  that holds it, or by any ``tpu_embedding.checkpoints.restore``), it
  empties every replica's holding."""

  def __init__(self, held: HeldUpdates):
    self._holding = held

  def _serialize_to_tensors(self) -> dict[str, Any]:
    return {"VARIABLE_VALUE": tf.constant(False)}

  def _restore_from_tensors(self, restored_tensors: Any) -> Any:
    del restored_tensors  # (always False)
    return self.drop()

  def drop(self) -> Any:
    return self._holding.clear()


def _as_update(
  values: list[tf.Tensor],
) -> tuple[tf.Tensor, RowGradients, tf.Tensor]:
  """``(ids, gradients, index)`` of a held update's values."""
  ids, rows, positions, scales, index = values
  return ids, RowGradients.at([rows], positions, scales), index


class HeldGate(UpdateGuard):
  """Runs a store's block updates only where the update was held.

  ``PipelinedUpdates`` gives its backend this guard before the stores are
  made, and applies each taken update inside ``applying``: the block
  updates a replica traces then run under ``tf.cond`` on whether that
  replica held an update. The exchanges around them (collectives) run
  either way, as every replica runs them together.

  Args:
    strategy: the strategy whose replicas trace the updates.
  """

  def __init__(self, strategy: tf.distribute.Strategy):
    self._strategy = strategy
    self._held: dict[int, tf.Tensor] = {}

  @contextlib.contextmanager
  def applying(self, replica: int, held: tf.Tensor) -> Iterator[None]:
    """Block updates ``replica`` traces in this block run where ``held``."""
    self._held[replica] = held
    try:
      yield
    finally:
      del self._held[replica]

  def for_blocks(self, name: str, devices: Sequence[str | None]) -> BlockGuard:
    del name, devices
    return _HeldBlocks(self)

  def held(self) -> tf.Tensor | None:
    """Whether the update the current replica applies was held; None
    outside ``applying`` (the update runs)."""
    return self._held.get(local_replica(self._strategy))


class _HeldBlocks(BlockGuard):
  """A store's blocks behind a ``HeldGate``."""

  def __init__(self, gate: HeldGate):
    self._gate = gate

  def run(self, block: int, update: Writes, step_id: tf.Tensor | None) -> None:
    del block, step_id  # Synchronous replicas: nothing to order.
    held = self._gate.held()
    if held is None:
      update()
      return

    def run_update() -> tf.Tensor:
      writes: list[Any] = [w for w in update() if w is not None]
      with tf.control_dependencies(writes):
        return tf.constant(True)

    tf.cond(held, run_update, lambda: tf.constant(False))


class UpdateSchedule:
  """When a training step's updates reach the backend: at once.

  The engine asks its schedule, chosen once, for a training lookup's rows
  and to apply a step's updates; ``PipelinedUpdates`` holds them a step.

  Args:
    backend: the backend that holds the tables.
  """

  def __init__(self, backend: Backend):
    self._backend = backend

  def create(
    self, tables: Sequence[TableConfig], tracker: VariableTracker
  ) -> None:
    """Called once the backend created the stores of ``tables``;
    ``tracker`` tracks what checkpoints save of the schedule."""
    del tables, tracker

  def gather_for_training(
    self, requests: GatherRequests, ops: StepOps
  ) -> list[PickedRows]:
    """``Backend.gather_tables`` for a lookup an update will follow."""
    return self._backend.gather_tables(requests, ops)

  def apply_updates(
    self, updates: Updates, ops: StepOps, step_id: tf.Tensor | None = None
  ) -> None:
    """``Backend.apply_updates``."""
    self._backend.apply_updates(updates, ops, step_id)

  def flush(self, ops: StepOps) -> None:
    """Applies any update held back with ``ops`` (none here)."""
    del ops

  def drop_held_rows(self, table: str, rows: tf.Tensor) -> None:
    """Removes ``rows`` of table ``table`` from any update held back (none
    here): a dynamic table gave them to new keys and reset them, so the
    previous key's update must not land."""
    del table, rows

  def discard(self) -> None:
    """Drops any update held back, unapplied (none here): the tables were
    written from elsewhere (a restore, loaded weights)."""


class PipelinedUpdates(UpdateSchedule):
  """Updates that wait for the next training lookup.

  ``apply_updates`` holds the update, and the next ``gather_for_training``
  applies it after gathering (one step stale). ``flush`` applies a held
  update at once.

  Raises:
    ValueError: for a backend that does not support pipelining.
  """

  def __init__(self, backend: Backend, strategy: tf.distribute.Strategy):
    if not backend.supports_pipelining:
      raise ValueError(
        "pipeline_execution_with_tensor_core=True is not available under "
        "ParameterServerStrategy (workers update asynchronously already)."
      )
    super().__init__(backend)
    self._strategy = strategy
    self._held: HeldUpdates | None = None
    # Given to the stores the backend makes next (build).
    self._gate = HeldGate(strategy)
    backend.update_guard = self._gate

  def create(
    self, tables: Sequence[TableConfig], tracker: VariableTracker
  ) -> None:
    self._held = HeldUpdates(tables, self._backend.local_devices)
    # (under the slot-like name of a table "_pipeline": no table's slot
    # is called that, so no table's key is taken)
    tracker.register(
      "_pipeline/held_update", self._held.restore_point(), restore=True
    )

  def gather_for_training(
    self, requests: GatherRequests, ops: StepOps
  ) -> list[PickedRows]:
    rows = self._backend.gather_tables(requests, ops)
    with tf.control_dependencies([p for r in rows for p in r.pieces]):
      self.flush(ops)
    return rows

  def apply_updates(
    self, updates: Updates, ops: StepOps, step_id: tf.Tensor | None = None
  ) -> None:
    # Applied by the next training lookup's (or flush's) ops; the steps of
    # the backends pipelining wraps are never re-run.
    del ops, step_id
    self._holding().hold(local_replica(self._strategy), updates)

  def flush(self, ops: StepOps) -> None:
    replicas = self._strategy.num_replicas_in_sync
    if replicas > 1 and current_replica(self._strategy) is None:
      raise RuntimeError(
        f"flush_pipeline under {strategy_name(self._strategy)} with "
        f"{replicas} replicas must run inside strategy.run: each replica "
        "applies its own held update "
        "(strategy.run(embedding.flush_pipeline))."
      )
    replica = local_replica(self._strategy)
    updates, held = self._holding().take(replica)
    with self._gate.applying(replica, held):
      self._backend.apply_updates(updates, ops)

  def drop_held_rows(self, table: str, rows: tf.Tensor) -> None:
    self._holding().drop_rows(local_replica(self._strategy), table, rows)

  def discard(self) -> None:
    self._holding().clear()

  def _holding(self) -> HeldUpdates:
    if self._held is None:
      raise RuntimeError("The pipelined updates have no tables yet (build).")
    return self._held


def _is_in(values: tf.Tensor, candidates: tf.Tensor) -> tf.Tensor:
  """Whether each of the (non-negative) ``values`` is among
  ``candidates``; sorts the candidates, no table-sized mask."""
  options = tf.sort(tf.concat([tf.constant([-1], tf.int64), candidates], 0))
  at = tf.searchsorted(options, values, side="left")
  at = tf.minimum(at, tf.size(options, out_type=at.dtype) - 1)
  return tf.equal(tf.gather(options, at), values)


def _unshaped_variable(initial: tf.Tensor) -> tf.Variable:
  """A plain variable whose first dimension may change at each assign."""
  shape = tf.TensorShape([None]).concatenate(initial.shape[1:])
  return compat.ResourceVariable(initial, shape=shape, trainable=False)
