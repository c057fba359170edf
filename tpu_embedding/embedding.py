"""``TPUEmbeddingV3``: the mid-level embedding object users build.

It validates and resolves the configs, picks one engine from the strategy
it is created under (``engines/``: TensorFlow's TPU classes on TPU, this
package's backends elsewhere) and forwards every call to it: TensorFlow's
TPU training loop — ``enqueue`` → ``dequeue`` → ``apply_gradients`` — with
TPU semantics on any device.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> table = tpe.TableConfig(vocabulary_size=100, dim=4, name="items",
  ...                         initializer=tf.zeros_initializer())
  >>> emb = tpe.TPUEmbedding({"item": tpe.FeatureConfig(table)},
  ...                        optimizer=tpe.Adagrad(learning_rate=0.1))
  >>> @tf.function
  ... def step(ids):
  ...   emb.enqueue({"item": ids})
  ...   with tf.GradientTape() as tape:
  ...     activations = emb.dequeue()
  ...     tape.watch(activations)
  ...     loss = tf.reduce_sum(activations["item"])
  ...   emb.apply_gradients(tape.gradient(loss, activations))
  ...   return loss
  >>> _ = step(tf.constant([3, 5, 3]))
  >>> # Row 3 was looked up twice: g = 2, a = 0.1 + 2**2, w = -0.1 * 2 / sqrt(a)
  >>> [round(float(x), 4) for x in emb.embedding_tables[table][3]]
  [-0.0988, -0.0988, -0.0988, -0.0988]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tpu_embedding.backends.base import Backend
from tpu_embedding.config import TableConfig
from tpu_embedding.engines.base import Engine
from tpu_embedding.engines.base import EngineCheckpointOwner
from tpu_embedding.engines.selection import select_engine
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.resolved import resolve
from tpu_embedding.sharding import DEFAULT_ROW_THRESHOLD
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.sharding import ShardingPlan
from tpu_embedding.stacking import TableStacking
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.row_cache import CacheCounts
from tpu_embedding.types import ActivationsNest
from tpu_embedding.types import FeatureConfigNest
from tpu_embedding.types import FeatureNest
from tpu_embedding.types import GradientsNest
from tpu_embedding.types import InputShapes
from tpu_embedding.types import WeightsNest

#: Library methods run as written inside the user's ``tf.function``:
#: AutoGraph need not (and should not) rewrite their Python control flow.
_library_code = tf.autograph.experimental.do_not_convert


class TPUEmbeddingV3(EngineCheckpointOwner):
  """The TPUEmbedding mid-level API, on any ``tf.distribute`` strategy.

  A drop-in for ``tf.tpu.experimental.embedding.TPUEmbedding``: the same
  configs and the same TPU-style loop. Features sharing a ``TableConfig``
  share a table; each table is updated by its own optimizer, lazily (only
  looked-up rows change, a row's gradient summed over its duplicates).

  Checkpoints (``tf.train.Checkpoint(embedding=emb)``) save each table as
  ``<name>`` and each slot as ``<name>/<slot>``, with full
  ``[vocabulary_size, dim]`` values: they restore into TensorFlow's own
  ``TPUEmbeddingForServing`` and back. Restoring before ``build`` works.

  The user's ``TableConfig`` objects are never modified; table names given
  automatically (``table_<i>``) show in ``variables`` and checkpoints.

  Example:
    >>> import tensorflow as tf
    >>> import tpu_embedding as tpe
    >>> table = tpe.TableConfig(vocabulary_size=10, dim=2, combiner="sum",
    ...                         initializer=tpe.RowIdInitializer())
    >>> emb = tpe.TPUEmbedding(tpe.FeatureConfig(table), tpe.SGD(0.1))
    >>> emb(tf.sparse.from_dense([[1, 2]])).numpy().tolist()
    [[3.0, 3.0]]
  """

  def __init__(
    self,
    feature_config: FeatureConfigNest,
    optimizer: Optimizer | None = None,
    pipeline_execution_with_tensor_core: bool = False,
    sparse_core_embedding_config: Any = None,
    *,
    row_sharding_threshold: int | PlacementPolicy = DEFAULT_ROW_THRESHOLD,
    table_stacking: TableStacking = "auto",
  ):
    """Creates the embedding object (variables are created by ``build``).

    Args:
      feature_config: a nest of ``tpu_embedding.FeatureConfig``.
      optimizer: the optimizer of tables that have none of their own: an
        ``SGD``, ``Adagrad``, ``AdagradMomentum``, ``Adam`` or ``FTRL``.
        May be None for lookups only.
      pipeline_execution_with_tensor_core: run the lookup of step ``n+1``
        before the update of step ``n`` so that the update overlaps the
        dense computation; activations are then one step stale, as on TPU
        (see ``pipelining.py`` and ``flush_pipeline``). Not available
        under ParameterServerStrategy.
      sparse_core_embedding_config: TPU SparseCore options, passed on to
        TensorFlow under ``TPUStrategy``: a ``SparseCoreEmbeddingConfig``
        or the path of an FDO file with measured limits
        (``tpu_embedding.fdo``).
      row_sharding_threshold: off TPU with several replicas, tables with
        more rows than this are row-sharded across the replicas; smaller
        ones are replicated (0 shards every table). A
        ``sharding.PlacementPolicy`` (or ``sharding.RowThreshold``) also
        fixes the placement of the tables it names, whatever their size.
        See ``sharding.py``.
      table_stacking: off TPU, which tables are held and updated as one
        (``stacking.py``): ``"auto"`` (default) stacks tables with the same
        width, optimizer and placement; None stacks nothing; a list of
        table-name lists gives the stacks. Checkpoints, ``embedding_tables``
        and serving are per table either way. Under ``TPUStrategy``,
        TensorFlow stacks on its own.

    Raises:
      ValueError: for an invalid feature config (a leaf that is not a
        ``FeatureConfig``, an unsupported optimizer, duplicate table names),
        a negative ``row_sharding_threshold`` or an unsupported strategy.
    """
    self._config = resolve(feature_config, optimizer)
    self._engine: Engine = select_engine(
      self._config,
      optimizer,
      tf.distribute.get_strategy(),
      pipeline_execution_with_tensor_core,
      sparse_core_embedding_config,
      placement=PlacementPolicy.of(row_sharding_threshold),
      table_stacking=table_stacking,
    )

  # --- properties ----------------------------------------------------------

  @property
  def feature_config(self) -> FeatureConfigNest:
    """The feature config nest this object was created with (unmodified)."""
    return self._config.structure

  @property
  def embedding_tables(self) -> dict[TableConfig, Any]:
    """``{TableConfig: table}``, keyed by the user's configs.

    Off TPU each value converts with ``tf.convert_to_tensor`` to the whole
    ``[vocabulary_size, dim]`` table and has ``numpy()``, whatever the
    layout (a ``tf.Variable``, a row-sharded ``ShardedVariable``, a
    replicated or a multi-worker variable; reading the last is a collective
    every worker joins). Under TPUStrategy these are TensorFlow's (on
    SparseCore keyed by stacked table name, as TensorFlow does).
    """
    return self._engine.embedding_tables

  @property
  def variables(self) -> dict[str, dict[str, Any]]:
    """``{table_name: {"parameters": var, <slot name>: var, ...}}``."""
    return self._engine.variables

  @property
  def table_names(self) -> dict[TableConfig, str]:
    """The name of each user ``TableConfig`` (given or ``table_<i>``)."""
    return self._engine.table_names

  @property
  def table_stores(self) -> dict[str, TableStore]:
    """``{table name: TableStore}``: every table behind one interface.

    Raises:
      RuntimeError: under TPUStrategy (TensorFlow holds the tables).
    """
    return self._engine.table_stores

  def disk_tier_counts(self) -> dict[str, CacheCounts]:
    """``{table name: CacheCounts}`` of the tables on disk (``DiskTier``):
    what this process's caches of each counted since it was built (its
    blocks' together): hits and misses among each step's distinct rows,
    rows read from and written to the files. Empty without disk tables.

    Example:
      >>> emb = TPUEmbedding(...)  # doctest: +SKIP
      >>> before = emb.disk_tier_counts()  # doctest: +SKIP
      >>> # ... train ...
      >>> {name: f"{(counts - before[name]).hit_rate:.1%}"
      ...  for name, counts in emb.disk_tier_counts().items()}  # doctest: +SKIP
      {'items': '91.3%'}

    Under TPUStrategy TensorFlow holds the tables: none is on disk.
    """
    return self._engine.disk_tier_counts()

  @property
  def vocabulary_states(self) -> dict[str, Any]:
    """``{table name: VocabularyState}``: the dynamic tables' vocabularies
    (``vocabularies/state.py``); empty without dynamic tables."""
    return self._engine.vocabulary_states

  @property
  def backend(self) -> Backend:
    """The backend holding the tables (off TPU).

    Raises:
      RuntimeError: under TPUStrategy (TensorFlow holds the tables).
    """
    return self._engine.backend

  @property
  def sharding_plan(self) -> ShardingPlan | None:
    """Where each table's rows live; None when every table is whole."""
    return self._engine.sharding_plan

  # --- the training loop ---------------------------------------------------

  @_library_code
  def build(
    self,
    per_replica_input_shapes: InputShapes | int | None = None,
    per_replica_batch_size: int | None = None,
  ) -> None:
    """Creates the tables and slots; optionally fixes the output shapes.

    Called automatically by the first ``enqueue`` or lookup.

    Args:
      per_replica_input_shapes: a nest of input shapes matching the feature
        config (or an int batch size, deprecated).
      per_replica_batch_size: deprecated; the per-replica batch size.

    Raises:
      ValueError: if the shapes contradict ``FeatureConfig.output_shape``.
    """
    self._engine.build(per_replica_input_shapes, per_replica_batch_size)

  @_library_code
  def enqueue(
    self,
    features: FeatureNest,
    weights: WeightsNest | None = None,
    training: bool = True,
    name: str | None = None,
    device: str | None = None,
  ) -> None:
    """Hands a batch of ids to the next ``dequeue``.

    Args:
      features: a nest of id tensors (``tf.Tensor``, ``tf.SparseTensor``,
        ``tf.RaggedTensor``) matching the feature config.
      weights: None, or a nest of the same structure with per-id weights of
        the same kind as the ids (None entries allowed).
      training: False for lookups that will not be followed by
        ``apply_gradients``.
      name: op names (TPU only).
      device: the host to enqueue on (TPU only).

    Raises:
      ValueError: if the structure, a kind, dtype, rank or shape is wrong;
        the message names the feature. Ids out of range and mismatched
        weights raise ``tf.errors.InvalidArgumentError`` when the step runs.
    """
    self._engine.enqueue(features, weights, training, name, device)

  @_library_code
  def dequeue(self, name: str | None = None) -> ActivationsNest:
    """The activations of the last enqueued batch.

    Returns:
      A nest like the feature config of ``[*output_shape, dim]`` tensors.

    Raises:
      RuntimeError: if nothing was enqueued in this function or eagerly.
    """
    return self._engine.dequeue(name)

  @_library_code
  def apply_gradients(
    self,
    gradients: GradientsNest,
    name: str | None = None,
    *,
    skip: bool | tf.Tensor | None = None,
    step_id: int | tf.Tensor | None = None,
  ) -> None:
    """Updates the tables with the gradients of the last activations.

    A None gradient is a zero gradient for that feature (for lazy Adam or
    FTRL this still moves the looked-up rows, as on TPU).

    ``skip`` (ours, off TPU) makes the update conditional: when it is true
    no row and no slot of any table changes, as if the step had no
    ids. A zero gradient is not the same thing: Adam and FTRL still move
    their slots. Pass the same value on every replica (reduce it over the
    replicas first), e.g. to skip a step whose gradients are not finite:

    .. code-block:: python

      finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g))
                              for g in tf.nest.flatten(grads)])
      bad = tf.distribute.get_replica_context().all_reduce(
          "SUM", tf.cast(tf.logical_not(finite), tf.int32))
      embedding.apply_gradients(grads, skip=bad > 0)

    ``step_id`` (ours) makes each step's update land once under
    ``ParameterServerStrategy``: TensorFlow's ``ClusterCoordinator`` runs a
    step again when its worker fails, even if its update had reached the
    parameter servers; with the id, each table's update is applied only
    if that step has not updated it yet. Pass an id that is distinct for
    every step of this object's life, as an argument of the scheduled
    function (the re-run gets the same arguments):

    .. code-block:: python

      @tf.function
      def train_step(iterator, step_id):
        def replica_fn(batch):
          ...
          embedding.apply_gradients(grads, step_id=step_id)
        strategy.run(replica_fn, args=(next(iterator),))

      for n in range(steps):
        coordinator.schedule(
            train_step, args=(iterator, tf.constant(first + n, tf.int64)))

    The record is bounded (``tables/step_record.py``): a re-run is
    recognised while fewer than 8192 later ids have updated the table,
    i.e. with fewer than 8192 steps scheduled ahead of it. Other
    strategies never re-run a step: there ``step_id`` is only checked.

    Args:
      gradients: a nest like the feature config, each the gradient of the
        loss with respect to that feature's activations.
      name: unused off TPU.
      skip: None (always update), or a scalar bool (tensor): update
        nothing when true.
      step_id: None, or a scalar integer (tensor) naming the step: an
        update is applied once per id (see above).

    Raises:
      RuntimeError: if not built or not preceded by a training ``dequeue``.
      ValueError: for a wrong structure, a non-tensor or a wrongly shaped
        gradient, or a table without an optimizer; for ``skip``: a
        non-scalar value, a table whose optimizer changes every row
        (``Adam(lazy_adam=False)``), or TPUStrategy; for ``step_id``: a
        variable, or a value that is not a scalar integer.
    """
    self._engine.apply_gradients(gradients, name, skip, step_id)

  @_library_code
  def flush_pipeline(self) -> None:
    """Applies the update held back by pipelining (no-op otherwise).

    With ``pipeline_execution_with_tensor_core=True`` the last step's update
    waits for the next lookup; call this before evaluating, exporting or
    checkpointing tables that must include it. With several replicas, call
    it inside ``strategy.run``.
    """
    self._engine.flush_pipeline()

  def discard_held_update(self) -> None:
    """Drops the update held back by pipelining, unapplied (no-op
    otherwise): call it after writing the tables from elsewhere, so that
    an update computed before never lands on them (a checkpoint restore
    drops it itself; the Keras layer's weight loading too)."""
    self._engine.discard_held_update()

  # --- direct lookups ------------------------------------------------------

  @_library_code
  def __call__(
    self, features: FeatureNest, weights: WeightsNest | None = None
  ) -> ActivationsNest:
    """Looks up ``features`` directly; see ``embedding_lookup``."""
    return self.embedding_lookup(features, weights)

  @_library_code
  def embedding_lookup(
    self, features: FeatureNest, weights: WeightsNest | None = None
  ) -> ActivationsNest:
    """Activations for ``features`` with the current tables.

    Same semantics as ``enqueue`` + ``dequeue`` but without fixing output
    shapes; differentiable with respect to the table variables.

    Args:
      features: a nest of id tensors matching the feature config.
      weights: None or a nest of per-id weights.

    Returns:
      A nest like the feature config of activations.

    Raises:
      RuntimeError: under ``TPUStrategy`` (TensorFlow has no direct
        lookups there).
    """
    return self._engine.embedding_lookup(features, weights)

  @_library_code
  def lookup_for_training(
    self, features: FeatureNest, weights: WeightsNest | None = None
  ) -> tuple[ActivationsNest, Callable[[GradientsNest], None]]:
    """Activations for ``features``, and a function applying their gradients.

    ``enqueue`` + ``dequeue`` + ``apply_gradients`` for one batch, without
    state kept between calls: several lookups may be in flight at once
    (e.g. inside a ``tf.custom_gradient``, as the Keras layers do), and
    output shapes are not fixed. Lookups and updates of sharded tables
    must run inside ``strategy.run``.

    Args:
      features: a nest of id tensors matching the feature config.
      weights: None or a nest of per-id weights.

    Returns:
      ``(activations, apply_gradients)``: a nest like the feature config,
      and a function taking the gradients of those activations (a nest of
      the same structure; None entries are zero gradients) that updates
      the looked-up rows with each table's optimizer.

    Raises:
      RuntimeError: under ``TPUStrategy`` (use ``enqueue``/``dequeue``).

    Example:
      >>> import tensorflow as tf
      >>> import tpu_embedding as tpe
      >>> table = tpe.TableConfig(4, 1, initializer=tf.zeros_initializer())
      >>> emb = tpe.TPUEmbedding(tpe.FeatureConfig(table), tpe.SGD(0.5))
      >>> activations, apply = emb.lookup_for_training(tf.constant([1, 1]))
      >>> apply(tf.ones_like(activations))
      >>> emb.embedding_tables[table].numpy().ravel().tolist()
      [0.0, -1.0, 0.0, 0.0]
    """
    return self._engine.lookup_for_training(features, weights)


TPUEmbedding = TPUEmbeddingV3
