"""``TPUStrategy`` engines: TensorFlow's own TPU embedding classes.

On a TPU the tables live in the TPU's embedding hardware, which only
TensorFlow's classes drive. A TPU engine translates the resolved configs
(``tpu_conversion.translate``), builds TensorFlow's object and forwards the
training loop to it; there is one engine per TensorFlow class:

| ``embedding_feature`` of the TPU | TPUs | engine | TensorFlow class |
|---|---|---|---|
| ``V1`` (embedding engine) | v2, v3, v4 | ``TPUEngine`` | ``TPUEmbedding`` |
| ``V2`` (SparseCore) | v5p, v6e | ``SparseCoreEngine`` | ``TPUEmbeddingV2`` |
| ``UNSUPPORTED`` | v5e, ... | none: ``ValueError`` | |

Both are driven through this package's API (``enqueue`` → ``dequeue`` →
``apply_gradients``). TensorFlow's SparseCore class passes tensors from
``enqueue`` to ``dequeue`` to ``apply_gradients``; the engine keeps them,
so on SparseCore the three calls must run in the same replica function
(inside ``strategy.run``), where ``enqueue`` moves the preprocessing to the
host itself.

Checkpoints are TensorFlow's: the engine's ``checkpoint_target`` is
TensorFlow's object, whose variables become the embedding's checkpoint
children (``embedding.EngineCheckpointOwner``), so keys stay ``<table>`` and
``<table>/<slot>``, restoring before ``build`` works, and on the embedding
engine tables are retrieved from the TPU before a save and loaded back
after a restore, as TensorFlow does for its own object.

None of this runs without a TPU; it is kept thin. The translation is tested
on CPU (``tests/engines/test_tpu_conversion.py``).

Example:
  >>> import types
  >>> import tensorflow as tf
  >>> v2 = tf.tpu.experimental.HardwareFeature.EmbeddingFeature.V2
  >>> hardware = types.SimpleNamespace(embedding_feature=v2)
  >>> strategy = types.SimpleNamespace(
  ...     extended=types.SimpleNamespace(tpu_hardware_feature=hardware))
  >>> tf_embedding_class(strategy).__name__
  'TPUEmbeddingV2'
"""

from __future__ import annotations

import abc
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding import errors
from tpu_embedding.backends.base import Backend
from tpu_embedding.engines import fdo_file
from tpu_embedding.engines.base import Engine
from tpu_embedding.engines.tpu_conversion import translate
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.resolved import ResolvedConfig
from tpu_embedding.step.steps import checked_step_id
from tpu_embedding.step.steps import current_graph
from tpu_embedding.tables.base import TableStore

TFE = tf.tpu.experimental.embedding
EmbeddingFeature = tf.tpu.experimental.HardwareFeature.EmbeddingFeature

#: TPU embedding hardware -> TensorFlow's mid-level class for it.
TF_CLASSES = {
  EmbeddingFeature.V1: TFE.TPUEmbedding,
  EmbeddingFeature.V2: TFE.TPUEmbeddingV2,
}


def is_tpu_strategy(strategy: tf.distribute.Strategy) -> bool:
  """Whether ``strategy`` is a ``TPUStrategy`` (either API version)."""
  return isinstance(
    strategy,
    (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy),
  )


def tf_embedding_class(strategy: Any) -> type:
  """TensorFlow's embedding class for the TPU ``strategy`` runs on.

  Args:
    strategy: a ``TPUStrategy``.

  Returns:
    ``tf.tpu.experimental.embedding.TPUEmbedding`` (embedding engine) or
    ``TPUEmbeddingV2`` (SparseCore).

  Raises:
    ValueError: if the TPU has no embedding hardware.
  """
  feature = strategy.extended.tpu_hardware_feature.embedding_feature
  tf_class = TF_CLASSES.get(feature)
  if tf_class is None:
    raise ValueError(
      f"This TPU has no embedding hardware (embedding_feature={feature}), so "
      "TPUEmbedding cannot run on it. Use a TPU with an embedding engine "
      "(v2-v4) or SparseCore (v5p, v6e), or train off TPU."
    )
  return tf_class


@dataclasses.dataclass
class _SparseCoreStep:
  """What one SparseCore ``enqueue`` hands to ``dequeue``/``apply``."""

  graph: Any
  partitioned: Any
  preserved: Any = None


class _TensorFlowEngine(Engine):
  """An engine that forwards to one of TensorFlow's TPU embedding classes.

  Attributes:
    tf_embedding: TensorFlow's object, built from translated clones of
      the configs.
  """

  #: TensorFlow's class this engine drives (tests may pass a stand-in).
  TF_CLASS: type = object

  def __init__(
    self,
    config: ResolvedConfig,
    optimizer: Optimizer | None,
    tf_class: type | None = None,
    pipeline_execution_with_tensor_core: bool = False,
    sparse_core_embedding_config: Any = None,
  ):
    """Translates the configs and creates TensorFlow's object.

    Create it inside the strategy's scope: TensorFlow's classes read the
    strategy when they are created.

    Args:
      config: the resolved feature config (never modified).
      optimizer: the global optimizer it was resolved with, or None.
      tf_class: TensorFlow's class (default ``TF_CLASS``).
      pipeline_execution_with_tensor_core: passed to TensorFlow.
      sparse_core_embedding_config: a
        ``tf.tpu.experimental.embedding.SparseCoreEmbeddingConfig`` for
        ``TPUEmbeddingV2``, or the path of an FDO file
        (``tpu_embedding.fdo``: ``FdoStats.save``) whose measured limits
        it is built from; must be None for ``TPUEmbedding``.

    Raises:
      ValueError: if a table has no optimizer, an optimizer cannot be
        translated, or ``sparse_core_embedding_config`` is given for the
        embedding engine.
    """
    super().__init__(config)
    for table in config.tables:
      if table.optimizer is None:
        raise ValueError(
          f"Table '{table.name}' has no optimizer. Under TPUStrategy every "
          "table needs one: pass optimizer= to TPUEmbedding or to the "
          "table's TableConfig."
        )
    self._tf_configs = translate(config, optimizer)
    self.tf_embedding = self._create(
      tf_class or self.TF_CLASS,
      pipeline_execution_with_tensor_core,
      sparse_core_embedding_config,
    )

  @abc.abstractmethod
  def _create(
    self, tf_class: type, pipelining: bool, sparse_core_config: Any
  ) -> Any:
    """TensorFlow's object, built from ``self._tf_configs``."""

  # --- checkpoints and tables ----------------------------------------------

  @property
  def checkpoint_target(self) -> compat.Trackable:
    return self.tf_embedding

  @property
  def variables(self) -> dict[str, dict[str, Any]]:
    """TensorFlow's ``{table: {"parameters": v, <slot>: v}}``."""
    return compat.tf_tpu_variables(self.tf_embedding)

  @property
  def table_names(self) -> dict[Any, str]:
    return {
      user: tf_table.name
      for user, tf_table in zip(
        self.config.user_tables, self._tf_configs.tables, strict=True
      )
    }

  @property
  def table_stores(self) -> dict[str, TableStore]:
    raise RuntimeError(errors.NOT_OFF_TPU.format(what="table_stores"))

  @property
  def backend(self) -> Backend:
    raise RuntimeError(errors.NOT_OFF_TPU.format(what="backend"))

  def embedding_lookup(self, features: Any, weights: Any = None) -> Any:
    raise RuntimeError(
      "Direct lookups are not available under TPUStrategy (TensorFlow's "
      "TPU embedding has none); use enqueue/dequeue, or "
      "TPUEmbeddingForServing on CPU."
    )

  def lookup_for_training(
    self, features: Any, weights: Any = None
  ) -> tuple[Any, Callable[[Any], None]]:
    raise RuntimeError(
      "lookup_for_training is not available under TPUStrategy; use "
      "enqueue/dequeue/apply_gradients."
    )

  def flush_pipeline(self) -> None:
    """A no-op: on TPU, TensorFlow runs the pipeline itself."""

  def discard_held_update(self) -> None:
    """A no-op: on TPU, TensorFlow holds any pipelined update."""

  @staticmethod
  def _check_no_skip(skip: Any) -> None:
    if skip is not None:
      raise ValueError(errors.SKIP_ON_TPU)


class TPUEngine(_TensorFlowEngine):
  """TensorFlow's ``TPUEmbedding`` on the TPU embedding engine (v2-v4).

  Example:
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.resolved import resolve
    >>> table = tpe.TableConfig(10, 4, name="t")
    >>> config = resolve(tpe.FeatureConfig(table), tpe.SGD(0.1))
    >>> # Off TPU, TensorFlow's TPUEmbedding runs in its CPU mode:
    >>> engine = TPUEngine(config, tpe.SGD(0.1))
    >>> engine.embedding_tables[table].shape
    TensorShape([10, 4])
  """

  TF_CLASS = TFE.TPUEmbedding
  copies_tables_around_checkpoints = True

  def _create(self, tf_class, pipelining, sparse_core_config):
    if sparse_core_config is not None:
      raise ValueError(
        "`sparse_core_embedding_config` is for SparseCore TPUs (v5p, v6e); "
        "this TPU uses the embedding engine (TensorFlow's TPUEmbedding). "
        "Leave it as None."
      )
    return tf_class(
      self._tf_configs.feature_config, self._tf_configs.optimizer, pipelining
    )

  def before_save(self) -> None:
    compat.retrieve_tpu_tables(self.tf_embedding)

  def after_restore(self) -> None:
    compat.load_tpu_tables(self.tf_embedding)

  @property
  def embedding_tables(self) -> dict[Any, Any]:
    """Keyed by the user's ``TableConfig`` objects (TensorFlow's keys are
    its translated configs; on a TPU it returns them only inside a
    SavedModel save)."""
    tables = self.tf_embedding.embedding_tables
    return {
      user: tables[tf_table]
      for user, tf_table in zip(
        self.config.user_tables, self._tf_configs.tables, strict=True
      )
    }

  def build(self, per_replica_input_shapes=None, per_replica_batch_size=None):
    self.tf_embedding.build(per_replica_input_shapes, per_replica_batch_size)

  def enqueue(
    self, features, weights=None, training=True, name=None, device=None
  ):
    self.tf_embedding.enqueue(features, weights, training, name, device)

  def dequeue(self, name=None):
    return self.tf_embedding.dequeue(name)

  def apply_gradients(self, gradients, name=None, skip=None, step_id=None):
    self._check_no_skip(skip)
    checked_step_id(step_id)  # TPU steps are never re-run.
    self.tf_embedding.apply_gradients(gradients, name)


class SparseCoreEngine(_TensorFlowEngine):
  """TensorFlow's ``TPUEmbeddingV2`` on SparseCore TPUs (v5p, v6e).

  TensorFlow's class returns the partitioned features from ``enqueue`` and
  the preserved outputs from ``dequeue``; this engine keeps them between
  the calls, which must therefore run in the same replica function.
  """

  TF_CLASS = TFE.TPUEmbeddingV2

  def _create(self, tf_class, pipelining, sparse_core_config):
    self._step: _SparseCoreStep | None = None
    if isinstance(sparse_core_config, (str, os.PathLike)):
      # An FDO file (``tpu_embedding.fdo``): the measured limits.
      sparse_core_config = fdo_file.load_sparse_core_config(sparse_core_config)
    self.sparse_core_embedding_config = sparse_core_config
    return tf_class(
      self._tf_configs.feature_config,
      self._tf_configs.optimizer,
      pipelining,
      sparse_core_config,
    )

  @property
  def embedding_tables(self) -> dict[Any, Any]:
    """TensorFlow's: keyed by *stacked* table name (SparseCore stacks
    tables of the same width and optimizer into one variable)."""
    return self.tf_embedding.embedding_tables

  def build(self, per_replica_input_shapes=None, per_replica_batch_size=None):
    """Builds TensorFlow's object (SparseCore ignores the shapes)."""
    del per_replica_input_shapes, per_replica_batch_size
    self.tf_embedding.build()

  def enqueue(
    self, features, weights=None, training=True, name=None, device=None
  ):
    """Forwards to TensorFlow's ``enqueue`` with the replica's features.

    ``training`` and ``name`` do not apply on SparseCore.

    Raises:
      ValueError: for distributed (per-replica) features.
    """
    del training, name
    if any(
      isinstance(x, tf.distribute.DistributedValues)
      for x in tf.nest.flatten(features)
    ):
      raise ValueError(
        "On SparseCore TPUs (TPUEmbeddingV2) enqueue must be called inside "
        "`strategy.run`, with the replica's own features, in the same "
        "function as dequeue and apply_gradients; it received distributed "
        "(per-replica) values."
      )
    partitioned = self.tf_embedding.enqueue(features, weights, device=device)
    self._step = _SparseCoreStep(current_graph(), partitioned)

  def dequeue(self, name=None):
    """Forwards to TensorFlow's ``dequeue``; returns the activations.

    Raises:
      RuntimeError: without an ``enqueue`` in this function.
    """
    step = self._step
    if step is None or step.graph is not current_graph():
      raise RuntimeError(errors.DEQUEUE_WITHOUT_ENQUEUE)
    activations, step.preserved = self.tf_embedding.dequeue(step.partitioned)
    return activations

  def apply_gradients(self, gradients, name=None, skip=None, step_id=None):
    """Forwards to TensorFlow's ``apply_gradients`` (``step_id`` is only
    checked: TPU steps are never re-run).

    Raises:
      RuntimeError: without a ``dequeue`` in this function.
      ValueError: for ``skip`` (TensorFlow's TPU embedding has none).
    """
    self._check_no_skip(skip)
    checked_step_id(step_id)
    step = self._step
    if (
      step is None
      or step.preserved is None
      or step.graph is not current_graph()
    ):
      raise RuntimeError(errors.APPLY_WITHOUT_DEQUEUE)
    self.tf_embedding.apply_gradients(gradients, step.preserved)
    self._step = None


#: TensorFlow's class -> the engine that drives it.
ENGINES: dict[type, type[_TensorFlowEngine]] = {
  TFE.TPUEmbedding: TPUEngine,
  TFE.TPUEmbeddingV2: SparseCoreEngine,
}


def tpu_engine(
  config: ResolvedConfig,
  optimizer: Optimizer | None,
  strategy: tf.distribute.Strategy,
  pipeline_execution_with_tensor_core: bool = False,
  sparse_core_embedding_config: Any = None,
) -> _TensorFlowEngine:
  """The engine for the TPU ``strategy`` runs on (see ``TPUEngine``)."""
  tf_class = tf_embedding_class(strategy)
  return ENGINES[tf_class](
    config,
    optimizer,
    tf_class,
    pipeline_execution_with_tensor_core,
    sparse_core_embedding_config,
  )


def _copies_tables(owner: Any) -> bool:
  # Only the embedding engine keeps its tables in TPU memory; TensorFlow's
  # SparseCore class checkpoints through its variables alone.
  engine = getattr(owner, "engine", None)
  return bool(getattr(engine, "copies_tables_around_checkpoints", False))


def _save_callback(trackables, **unused_kwargs):
  # As TensorFlow's own "TPUEmbeddingCallback" for its TPUEmbedding: copy
  # the tables from the TPU to their host variables before they are saved.
  for owner in trackables.values():
    owner.engine.before_save()
  return []


def _restore_callback(trackables, **unused_kwargs):
  # ... and load the restored host variables onto the TPU.
  for owner in trackables.values():
    owner.engine.after_restore()


CHECKPOINT_SAVER = "TPUDelegateCallback"
try:
  compat.register_checkpoint_saver(
    package="tpu_embedding",
    name=CHECKPOINT_SAVER,
    predicate=_copies_tables,
    save_fn=_save_callback,
    restore_fn=_restore_callback,
    # A checkpoint saved on TPU restores anywhere: elsewhere the callback
    # is skipped, as TensorFlow does for its own.
    strict_predicate_restore=False,
  )
except ValueError:  # Already registered: this module was imported twice.
  pass
