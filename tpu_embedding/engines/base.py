"""The interface of an engine: what runs the embedding on one platform.

``TPUEmbeddingV3`` picks one engine when it is created and forwards every
call to it, unconditionally:

================  ==========================================================
``OffTPUEngine``  default, OneDevice, Mirrored, MultiWorkerMirrored and
                  ParameterServer strategies: this package's backends
``TPUEngine``     TPUStrategy on the embedding engine (TPU v2-v4):
                  TensorFlow's ``TPUEmbedding``
``SparseCoreEngine``  TPUStrategy on SparseCore (v5p, v6e): TensorFlow's
                  ``TPUEmbeddingV2``
================  ==========================================================

Every property means the same thing on every engine, or raises an error
that says why it does not apply there.

Example:
  >>> from tpu_embedding.engines.base import Engine
  >>> "dequeue" in Engine.__abstractmethods__
  True
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from tpu_embedding.backends.base import Backend
from tpu_embedding.compat import Trackable
from tpu_embedding.config import TableConfig
from tpu_embedding.resolved import ResolvedConfig
from tpu_embedding.resolved import table_name
from tpu_embedding.sharding import ShardingPlan
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.row_cache import CacheCounts


class Engine(metaclass=abc.ABCMeta):
  """Runs the embedding's training loop and holds its tables."""

  def __init__(self, config: ResolvedConfig):
    self.config = config

  # --- checkpoints ---------------------------------------------------------

  @property
  @abc.abstractmethod
  def checkpoint_target(self) -> Trackable:
    """The trackable whose children are the tables and slots to save."""

  #: Whether saves and restores must copy tables off / onto a device
  #: (TensorFlow's TPU embedding engine keeps them in TPU memory).
  copies_tables_around_checkpoints = False

  def before_save(self) -> None:
    """Makes the host variables current before a checkpoint save."""
    return None

  def after_restore(self) -> None:
    """Moves restored host variables to where the tables live."""
    return None

  # --- tables --------------------------------------------------------------

  @property
  @abc.abstractmethod
  def embedding_tables(self) -> dict[Any, Any]:
    """``{TableConfig: table}``, keyed by the user's configs."""

  @property
  @abc.abstractmethod
  def variables(self) -> dict[str, dict[str, Any]]:
    """``{table name: {"parameters": v, <slot>: v}}``."""

  @property
  def table_names(self) -> dict[TableConfig, str]:
    """The name of each user ``TableConfig`` (given or ``table_<i>``)."""
    return {
      user: table_name(table)
      for user, table in zip(
        self.config.user_tables, self.config.tables, strict=True
      )
    }

  @property
  @abc.abstractmethod
  def table_stores(self) -> dict[str, TableStore]:
    """``{table name: TableStore}``: every table in one interface."""

  def disk_tier_counts(self) -> dict[str, CacheCounts]:
    """``{table name: CacheCounts}`` of the tables on disk (none on a
    TPU, where TensorFlow holds the tables)."""
    return {}

  @property
  @abc.abstractmethod
  def backend(self) -> Backend:
    """The off-TPU backend holding the tables."""

  @property
  def sharding_plan(self) -> ShardingPlan | None:
    """Where each table's rows live; None when every table is whole."""
    return None

  @property
  def vocabulary_states(self) -> dict[str, Any]:
    """``{table name: VocabularyState}`` of the dynamic tables."""
    return {}

  # --- the training loop ---------------------------------------------------

  @abc.abstractmethod
  def build(
    self, per_replica_input_shapes: Any, per_replica_batch_size: int | None
  ) -> None:
    """Creates the tables and slots."""

  @abc.abstractmethod
  def enqueue(
    self,
    features: Any,
    weights: Any,
    training: bool,
    name: str | None,
    device: str | None,
  ) -> None:
    """Hands a batch of ids to the next ``dequeue``."""

  @abc.abstractmethod
  def dequeue(self, name: str | None) -> Any:
    """The activations of the last enqueued batch."""

  @abc.abstractmethod
  def apply_gradients(
    self,
    gradients: Any,
    name: str | None,
    skip: Any = None,
    step_id: Any = None,
  ) -> None:
    """Updates the tables with the gradients of the last activations
    (none of them when the scalar bool ``skip`` is true; once per
    ``step_id`` where a step may be re-run)."""

  @abc.abstractmethod
  def embedding_lookup(self, features: Any, weights: Any) -> Any:
    """Activations with the current tables, without a training step."""

  @abc.abstractmethod
  def lookup_for_training(
    self, features: Any, weights: Any
  ) -> tuple[Any, Callable[[Any], None]]:
    """Activations and a function applying their gradients."""

  @abc.abstractmethod
  def flush_pipeline(self) -> None:
    """Applies an update held back by pipelining."""

  @abc.abstractmethod
  def discard_held_update(self) -> None:
    """Drops an update held back by pipelining, unapplied."""


class EngineCheckpointOwner(Trackable):
  """A trackable whose checkpoint content is its engine's.

  Subclasses set ``self._engine`` before any restore. The object's
  checkpoint children are those of ``engine.checkpoint_target`` (the
  off-TPU engine itself, or TensorFlow's TPU object), restorations that
  arrive before the variables exist wait there (restore-before-build), and
  the keys are TensorFlow's (``<table>``, ``<table>/<slot>``) on every
  engine.
  """

  _engine: Engine

  @property
  def engine(self) -> Engine:
    """The engine chosen at construction."""
    return self._engine

  def _target(self) -> Trackable:
    return self._engine.checkpoint_target

  def _trackable_children(self, save_type="checkpoint", **kwargs):
    return self._target()._trackable_children(save_type, **kwargs)

  def _lookup_dependency(self, name, cached_dependencies=None):
    return self._target()._lookup_dependency(name, cached_dependencies)

  @property
  def _deferred_dependencies(self):
    return self._target()._deferred_dependencies

  def _checkpoint_adapter(self, path):
    return self._target()._checkpoint_adapter(path)
