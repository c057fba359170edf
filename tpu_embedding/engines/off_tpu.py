"""The off-TPU engine: TensorFlow's TPU training loop on any other strategy.

It keeps the step bookkeeping of ``enqueue`` → ``dequeue`` →
``apply_gradients`` (``steps.py``), runs lookups through the one lookup
path (``activations.py``) with rows from its backend, and turns activation
gradients into row gradients for the backend's updates. The backend is
chosen from the strategy (``backends/selection.py``), with the plan of the
tables' stacks and placements it made (``planning.py``), its updates
held a step with ``pipeline_execution_with_tensor_core=True``
(``pipelining.py``). The row ops of its training steps are chosen by
``kernels/ops.select_ops`` alone, from the devices holding its tables, and
passed down explicitly; every other lookup gets TensorFlow's.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> emb = tpe.TPUEmbedding(
  ...     tpe.FeatureConfig(tpe.TableConfig(5, 2, name="t")), tpe.SGD(0.1))
  >>> type(emb.engine).__name__, type(emb.backend).__name__
  ('OffTPUEngine', 'LocalBackend')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tpu_embedding import errors
from tpu_embedding import memory
from tpu_embedding.backends.base import Backend
from tpu_embedding.backends.base import TableUpdate
from tpu_embedding.backends.selection import select_backend
from tpu_embedding.backends.stacks import create_stacked_tables
from tpu_embedding.compat import Trackable
from tpu_embedding.engines.base import Engine
from tpu_embedding.gradients import PickedRows
from tpu_embedding.gradients import RowGradients
from tpu_embedding.gradients import concat_pieces
from tpu_embedding.kernels.ops import XLA_OPS
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.kernels.ops import lookup_ops
from tpu_embedding.kernels.ops import select_ops
from tpu_embedding.lookup import TableBatch
from tpu_embedding.lookup import occurrence_gradients
from tpu_embedding.optimizers import learning_rates
from tpu_embedding.replicas import compiles_with_xla
from tpu_embedding.replicas import current_replica
from tpu_embedding.replicas import first_local_replica
from tpu_embedding.replicas import local_devices
from tpu_embedding.replicas import local_replica
from tpu_embedding.replicas import strategy_name
from tpu_embedding.resolved import ResolvedConfig
from tpu_embedding.resolved import key_mapping
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.sharding import ShardingPlan
from tpu_embedding.stacking import TableStack
from tpu_embedding.stacking import TableStacking
from tpu_embedding.step.activations import look_up
from tpu_embedding.step.activations import prepare_features
from tpu_embedding.step.activations import stack_features
from tpu_embedding.step.output_shapes import OutputShapes
from tpu_embedding.step.output_shapes import output_shapes_from_batch_size
from tpu_embedding.step.output_shapes import output_shapes_from_input_shapes
from tpu_embedding.step.pipelining import PipelinedUpdates
from tpu_embedding.step.pipelining import UpdateSchedule
from tpu_embedding.step.steps import Enqueued
from tpu_embedding.step.steps import Step
from tpu_embedding.step.steps import checked_gradients
from tpu_embedding.step.steps import checked_step_id
from tpu_embedding.step.steps import current_graph
from tpu_embedding.step.steps import select_replica
from tpu_embedding.structure import check_same_structure
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.base import parameters_by_user_table
from tpu_embedding.tables.base import variables_by_name
from tpu_embedding.tables.row_cache import CacheCounts
from tpu_embedding.tracking import VariableTracker
from tpu_embedding.vocabularies import sharing
from tpu_embedding.vocabularies.dynamic_tables import DynamicTables
from tpu_embedding.vocabularies.dynamic_tables import check_dynamic_support


class OffTPUEngine(Engine, Trackable):
  """Tables in this package's backends; the TPU loop's semantics."""

  def __init__(
    self,
    config: ResolvedConfig,
    strategy: tf.distribute.Strategy,
    placement: PlacementPolicy,
    pipeline_execution_with_tensor_core: bool = False,
    table_stacking: TableStacking = "auto",
  ):
    """Picks the backend for ``strategy``, which plans the table stacks
    and placements (``planning.py``).

    Raises:
      ValueError: for a strategy without a backend, pipelining under
        ParameterServerStrategy, or invalid ``table_stacking``.
    """
    Engine.__init__(self, config)
    self._strategy = strategy
    backend, planned = select_backend(
      strategy, config.tables, placement, table_stacking
    )
    self._stacks = list(planned.stacks)
    self._sharding_plan = planned.tables
    self._dynamic = DynamicTables(config, sharing.for_strategy(strategy))
    check_dynamic_support(config.tables, backend)
    self._schedule = (
      PipelinedUpdates(backend, strategy)
      if pipeline_execution_with_tensor_core
      else UpdateSchedule(backend)
    )
    self._backend: Backend = backend
    self._output_shapes = OutputShapes(
      [f.output_shape for f in config.features], list(config.paths)
    )
    self._built = False
    self._stores: dict[str, TableStore] = {}
    self._steps: dict[int, Step] = {}
    self._enqueued: Enqueued | None = None
    self._devices: list[str] | None = None  # Listed at the first step.

  # --- checkpoints and tables ----------------------------------------------

  @property
  def checkpoint_target(self) -> Trackable:
    return self

  @property
  def backend(self) -> Backend:
    return self._backend

  @property
  def sharding_plan(self) -> ShardingPlan | None:
    return self._sharding_plan

  @property
  def dynamic_tables(self) -> DynamicTables:
    """The dynamic tables' vocabularies (``vocabularies/``)."""
    return self._dynamic

  @property
  def vocabulary_states(self) -> dict[str, Any]:
    self._maybe_build()
    return self._dynamic.states

  @property
  def stacks(self) -> list[TableStack]:
    """How the tables are stacked (``stacking.py``); one table per stack
    when not stacked."""
    return list(self._stacks)

  @property
  def table_stores(self) -> dict[str, TableStore]:
    self._maybe_build()
    return self._stores

  def disk_tier_counts(self) -> dict[str, CacheCounts]:
    return {
      name: sum(counts, CacheCounts())
      for name, store in self.table_stores.items()
      if (counts := store.cache_counts())
    }

  @property
  def embedding_tables(self) -> dict[Any, Any]:
    return parameters_by_user_table(
      self.config.user_tables, self.config.tables, self.table_stores
    )

  @property
  def variables(self) -> dict[str, dict[str, Any]]:
    return variables_by_name(self.table_stores)

  # --- build ---------------------------------------------------------------

  def build(
    self,
    per_replica_input_shapes: Any = None,
    per_replica_batch_size: int | None = None,
  ) -> None:
    if self._built:
      return
    incoming = None
    features = list(self.config.features)
    if isinstance(per_replica_input_shapes, int):
      incoming = output_shapes_from_batch_size(
        per_replica_input_shapes, features
      )
    elif per_replica_input_shapes is not None:
      check_same_structure(
        self.config.structure,
        per_replica_input_shapes,
        "per_replica_input_shapes passed to build",
      )
      incoming = output_shapes_from_input_shapes(
        tf.nest.flatten(per_replica_input_shapes, expand_composites=False),
        features,
      )
    elif per_replica_batch_size:
      incoming = output_shapes_from_batch_size(per_replica_batch_size, features)
    if incoming is not None:
      self._output_shapes.check(incoming)
      self._output_shapes.update(incoming)
    memory.check_tables_fit(
      self._backend.resident_bytes(
        memory.tables_here(
          self.config.tables,
          self.sharding_plan,
          self._backend.held_replicas,
          self._strategy,
        ),
        self.config.tables,
      )
    )
    with tf.init_scope():
      with self._strategy.scope():
        self._stores = create_stacked_tables(
          self._backend, self._stacks, VariableTracker(self)
        )
        self._schedule.create(
          [stack.config for stack in self._stacks], VariableTracker(self)
        )
      self._dynamic.build(
        self._backend.local_devices,
        self._stores,
        VariableTracker(self),
        strategy=self._strategy,
      )
      self._dynamic.write_default_rows(self._stores)
    self._built = True

  def _maybe_build(self, incoming_shapes: list | None = None) -> None:
    if not self._built:
      in_run = tf.distribute.has_strategy() and (
        current_replica(self._strategy) is not None
      )
      if in_run:
        raise RuntimeError(
          "TPUEmbedding is not built yet and cannot build inside "
          "strategy.run (its variables are created once, in cross-replica "
          "context). Call embedding.build() first, or enqueue outside "
          "strategy.run."
        )
      with tf.init_scope():
        self.build()
    if incoming_shapes is not None:
      self._output_shapes.check(incoming_shapes)
      self._output_shapes.update(incoming_shapes)

  # --- the training loop ---------------------------------------------------

  def enqueue(
    self,
    features: Any,
    weights: Any = None,
    training: bool = True,
    name: str | None = None,
    device: str | None = None,
  ) -> None:
    del name, device
    self._check_strategy((features, weights))
    replica = current_replica(self._strategy)
    if replica is None and (
      self._strategy.num_replicas_in_sync > 1
      or _distributed(features)
      or _distributed(weights)
    ):
      # Per-replica values (e.g. from a distributed dataset): replica 0's
      # are prepared (checked) now, for its dequeue; each other replica
      # prepares its own in dequeue.
      first_features, first_weights = select_replica(
        self._strategy, (features, weights), 0
      )
      prepared = self._prepare(
        first_features, first_weights, "features passed to enqueue"
      )
      self._maybe_build([p.static_shape for p in prepared])
      first = first_local_replica(self._strategy)
      self._steps = {first: Step(prepared, training, current_graph())}
      self._enqueued = Enqueued(features, weights, training, current_graph())
      return
    prepared = self._prepare(features, weights, "features passed to enqueue")
    self._maybe_build([p.static_shape for p in prepared])
    self._steps[replica or 0] = Step(prepared, training, current_graph())

  def dequeue(self, name: str | None = None) -> Any:
    del name
    self._check_strategy()
    if not self._built:
      raise RuntimeError(errors.NOT_BUILT.format(method="dequeue"))
    step = self._current_step(for_dequeue=True)
    if step is None or step.graph is not current_graph():
      raise RuntimeError(errors.DEQUEUE_WITHOUT_ENQUEUE)
    activations, batches = self._lookup(step.prepared, training=step.training)
    step.batches = batches if step.training else None
    return activations

  def apply_gradients(
    self,
    gradients: Any,
    name: str | None = None,
    skip: Any = None,
    step_id: Any = None,
  ) -> None:
    del name
    self._check_strategy()
    if not self._built:
      raise RuntimeError(errors.NOT_BUILT.format(method="apply_gradients"))
    step = self._current_step(for_dequeue=False)
    # This function's enqueue (inside strategy.run, or outside it)...
    enqueued = step if step is not None else self._enqueued
    if (
      enqueued is not None
      and enqueued.graph is current_graph()
      and not enqueued.training
    ):  # ... was an evaluation's: the cause, not a missing dequeue.
      raise RuntimeError(errors.APPLY_AFTER_EVALUATION_ENQUEUE)
    if (
      step is None or step.batches is None or step.graph is not current_graph()
    ):
      raise RuntimeError(errors.APPLY_WITHOUT_DEQUEUE)
    self._apply(
      gradients,
      step,
      "gradients passed to apply_gradients",
      skip,
      checked_step_id(step_id),
    )
    self._steps.pop(current_replica(self._strategy) or 0, None)

  def embedding_lookup(self, features: Any, weights: Any = None) -> Any:
    self._check_strategy((features, weights))
    self._maybe_build()
    prepared = self._prepare(
      features, weights, "features passed to lookup", direct=True
    )
    activations, _ = self._lookup(prepared, training=False)
    return activations

  def lookup_for_training(
    self, features: Any, weights: Any = None
  ) -> tuple[Any, Callable[[Any], None]]:
    self._check_strategy((features, weights))
    self._maybe_build()
    prepared = self._prepare(
      features, weights, "features passed to lookup", direct=True
    )
    activations, batches = self._lookup(prepared, training=True)
    step = Step(prepared, True, current_graph(), batches)

    def apply_gradients(gradients: Any) -> None:
      self._apply(gradients, step, "gradients passed to apply")

    return activations, apply_gradients

  def flush_pipeline(self) -> None:
    if self._built:
      self._schedule.flush(self._step_ops())

  def discard_held_update(self) -> None:
    if self._built:
      self._schedule.discard()

  # --- internals -----------------------------------------------------------

  def _prepare(
    self, features: Any, weights: Any, what: str, direct: bool = False
  ) -> list:
    return prepare_features(self.config, features, weights, what, direct)

  def _lookup(
    self, prepared: list, training: bool
  ) -> tuple[Any, dict[str, TableBatch]]:
    replica = local_replica(self._strategy)
    if not training:  # TensorFlow's ops only: servable as it is.
      prepared = self._dynamic.rows(prepared, replica)

      ops = lookup_ops()

      def rows(requests: Any) -> list[PickedRows]:
        return self._backend.gather_tables(requests, ops)

      return look_up(self.config, prepared, rows, self._stacks, ops=ops)
    ops = self._step_ops()
    prepared, new_rows = self._dynamic.rows_for_training(
      prepared, replica, self._stores, ops
    )
    for name, given in new_rows.items():
      self._schedule.drop_held_rows(name, given)

    def training_rows(requests: Any) -> list[PickedRows]:
      # A training step's gradients reach the tables through
      # apply_gradients only, as from TPU's dequeue: a tape sees the
      # activations (tape.watch), not the tables. Left differentiable, a
      # tape would trace each gather's gradient into its table, for
      # nothing: half of the ops of a 26-table step.
      return [
        dataclasses.replace(
          rows, pieces=[tf.stop_gradient(p) for p in rows.pieces]
        )
        for rows in self._schedule.gather_for_training(requests, ops)
      ]

    return look_up(self.config, prepared, training_rows, self._stacks, ops=ops)

  def _apply(
    self,
    gradients: Any,
    step: Step,
    what: str,
    skip: Any = None,
    step_id: tf.Tensor | None = None,
  ) -> None:
    """Applies each table's optimizer to the rows ``step`` looked up.

    With ``skip`` (a scalar bool tensor) true, every table's update has no
    rows: nothing changes, yet every replica runs the same collectives.
    ``step_id`` (a scalar int64 tensor) goes to the backend.
    """
    check_same_structure(self.config.structure, gradients, what)
    flat = checked_gradients(gradients, step, self.config.features)
    if skip is not None:
      skip = _checked_skip(skip, self.config.tables)
    with learning_rates.once_per_update():  # as TPU: once per step
      self._schedule.apply_updates(
        self._updates(flat, step, skip), self._step_ops(), step_id
      )

  def _updates(self, flat: list, step: Step, skip: Any) -> list[TableUpdate]:
    """Each stack's (or table's) ids, occurrence gradients and index."""
    batches = step.batches or {}
    updates = []
    # Skipped: every update has no rows and no occurrences (kept == 0).
    kept = None if skip is None else tf.cast(tf.logical_not(skip), tf.int32)
    for stack in self._stacks:
      batch = batches.get(stack.name)
      if batch is None:
        continue
      if stack.config.optimizer is None:
        raise ValueError(
          f"Table '{stack.tables[0].name}' has no optimizer: pass one to "
          "TPUEmbedding(optimizer=...) or to its TableConfig."
        )
      grads = [flat[i] for i in stack_features(self.config, stack)]
      ids, index = batch.unique_ids, batch.unique_index
      occurrences = occurrence_gradients(grads, batch)
      ids, occurrences, index = key_mapping(stack.config).updated_rows(
        ids, occurrences, index
      )
      if kept is not None:
        count = tf.size(index) * kept
        ids = _leading(ids, tf.size(ids) * kept)
        index = _leading(index, count)
        occurrences = RowGradients.dense(
          _leading(concat_pieces(occurrences), count)
        )
      updates.append(TableUpdate(stack.config, ids, occurrences, index))
    return updates

  @property
  def step_ops(self) -> StepOps:
    """The row ops of this engine's training steps (``kernels/ops.py``):
    the kernels only where every table variable is in this process's CPU
    memory."""
    self._maybe_build()
    return self._step_ops()

  def _step_ops(self) -> StepOps:
    """``step_ops``: ``select_ops`` on the devices holding the tables
    (listed once), checked for XLA where it gives ``XLA_OPS``."""
    if self._devices is None:
      self._devices = [
        str(getattr(variable, "device", ""))
        for store in self._stores.values()
        for variable in store.held_variables()
      ]
    # Each local replica runs its own ops, one chain per table or stack,
    # all at once.
    replicas = len(self._backend.local_devices)
    ops = select_ops(self._devices, concurrent=replicas * len(self._stacks))
    if ops is XLA_OPS:
      self._check_xla()
    return ops

  def _check_xla(self) -> None:
    """Raises unless this engine's steps compile with XLA (one replica,
    its own tables, no dynamic vocabulary: its step has data-sized
    shapes)."""
    dynamic = sorted(self._dynamic.states)
    if compiles_with_xla(self._strategy) and not dynamic:
      return
    raise ValueError(
      errors.XLA_LAYOUT.format(
        strategy=strategy_name(self._strategy),
        dynamic=(
          f" with dynamic vocabularies ({', '.join(dynamic)})"
          if dynamic
          else ""
        ),
      )
    )

  def _current_step(self, for_dequeue: bool) -> Step | None:
    """This replica's enqueued step (prepared from per-replica values)."""
    replica = current_replica(self._strategy) or 0
    enqueued = self._enqueued
    if (
      for_dequeue
      and enqueued is not None
      and enqueued.graph is current_graph()
      and replica not in self._steps
    ):
      features, weights = select_replica(
        self._strategy,
        (enqueued.features, enqueued.weights),
        replica - first_local_replica(self._strategy),
      )
      prepared = self._prepare(features, weights, "features passed to enqueue")
      self._steps[replica] = Step(prepared, enqueued.training, enqueued.graph)
    return self._steps.get(replica)

  def _check_strategy(self, inputs: Any = None) -> None:
    """Refuses a call under another strategy than the embedding's.

    Outside any scope is fine (TF's loop enqueues outside the scope);
    inside the scope of another strategy is not, nor are ``inputs``
    holding another strategy's per-replica values (e.g. enqueued outside
    ``strategy.run`` from that strategy's distributed dataset).

    Raises:
      RuntimeError: naming both strategies.
    """
    current = tf.distribute.get_strategy()
    if tf.distribute.has_strategy() and current is not self._strategy:
      raise RuntimeError(
        errors.WRONG_STRATEGY.format(
          created=strategy_name(self._strategy),
          current=strategy_name(current),
        )
      )
    replicas = _foreign_replicas(self._strategy, inputs)
    if replicas is not None:
      raise RuntimeError(
        errors.WRONG_STRATEGY.format(
          created=strategy_name(self._strategy),
          current=f"a strategy of {replicas} replicas (the features are "
          "its per-replica values, e.g. from its distributed dataset)",
        )
      )


def _distributed(structure: Any) -> bool:
  """Whether ``structure`` holds per-replica values (any replica count)."""
  return any(
    isinstance(value, tf.distribute.DistributedValues)
    for value in tf.nest.flatten(structure)
  )


def _foreign_replicas(
  strategy: tf.distribute.Strategy, inputs: Any
) -> int | None:
  """The replica count of per-replica ``inputs`` that ``strategy`` cannot
  have made (it has another number of local replicas); None if none.

  The default strategy makes no per-replica values.
  """
  counts = {
    len(value.values)
    for value in tf.nest.flatten(inputs)
    if isinstance(value, tf.distribute.DistributedValues)
  }
  if not counts:
    return None
  foreign = sorted(counts - {len(local_devices(strategy))})
  return foreign[0] if foreign else None


def _checked_skip(skip: Any, tables: Any) -> tf.Tensor:
  """``skip`` as a scalar bool tensor, for tables whose updates can skip.

  Raises:
    ValueError: for a non-scalar ``skip``, or a table whose optimizer
      changes every row (an update without rows still changes them).
  """
  skip = tf.convert_to_tensor(skip, tf.bool)
  if skip.shape.rank not in (None, 0):
    raise ValueError(errors.SKIP_SHAPE.format(shape=skip.shape))
  for table in tables:
    if table.optimizer is not None and table.optimizer.updates_all_rows:
      raise ValueError(
        errors.SKIP_UPDATES_ALL_ROWS.format(
          table=table.name, optimizer=type(table.optimizer).__name__
        )
      )
  return skip


def _leading(tensor: tf.Tensor, count: tf.Tensor) -> tf.Tensor:
  """``tensor[:count]`` in one slice (half the ops of indexing)."""
  rank = tensor.shape.rank
  return tf.slice(tensor, [0] * rank, tf.stack([count] + [-1] * (rank - 1)))
