"""Rebuilding an embedding's tables from a checkpoint, for export.

``tools/export.py`` exports a SavedModel from a training checkpoint,
whatever layout it was written on (``TPUStrategy`` and multi-worker runs
included, whose tables cannot be copied live). A user function returns an
``ExportSpec`` (feature config, signature, model); ``serving_embedding_for``
creates a ``TPUEmbeddingForServing`` holding only the selected tables,
under their checkpoint keys, which the tool restores before calling
``export_for_serving``. ``restore_for_export`` restores them to the state
a path means: a run directory's latest save, a full checkpoint, or a delta
checkpoint applied after the saves it follows.

Example:
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.export import serving_embedding_for
  >>> users = tpe.TableConfig(10, 2, name="users")
  >>> items = tpe.TableConfig(20, 2, name="items")
  >>> emb, names = serving_embedding_for(
  ...     {"user": tpe.FeatureConfig(users), "item": tpe.FeatureConfig(items)},
  ...     ["users"])
  >>> names, sorted(emb.variables)
  (('users',), ['users'])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import tensorflow as tf

from tpu_embedding.checkpointing.deltas import apply_deltas
from tpu_embedding.checkpointing.manager import chain_end
from tpu_embedding.checkpointing.manager import saved_chain
from tpu_embedding.export.saved_model import ServedModel
from tpu_embedding.export.signature import FeatureSpec
from tpu_embedding.export.subset import TableSelection
from tpu_embedding.export.subset import TableSubset
from tpu_embedding.serving import TPUEmbeddingForServing
from tpu_embedding.types import FeatureConfigNest


@dataclasses.dataclass(frozen=True)
class ExportSpec:
  """How to rebuild an embedding's model for export from a checkpoint.

  ``tools/export.py --spec module:function`` calls ``function()`` (no
  arguments), which returns an ``ExportSpec``; the tool creates a
  ``TPUEmbeddingForServing`` over ``feature_config`` (the selected tables
  only), restores it and ``model`` from the checkpoint, and calls
  ``export_for_serving``.

  Attributes:
    feature_config: the feature config the embedding was trained with.
    input_signature: the signature inputs (see ``export_for_serving``).
    model: the model (built: its variables must exist to be restored), or
      None to serve activations.
    tables: the default selection (``--tables`` overrides it).
    embedding_key: the embedding's name in the ``tf.train.Checkpoint``
      (``tf.train.Checkpoint(embedding=emb, model=model)``).
    model_key: the model's name in the checkpoint; None when ``model``
      already holds its weights (e.g. loaded from a ``.keras`` file).

  Example:
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.export import ExportSpec, FeatureSpec
    >>> table = tpe.TableConfig(100, 4, name="users")
    >>> spec = ExportSpec({"user": tpe.FeatureConfig(table)},
    ...                   {"user": FeatureSpec([None])})
    >>> spec.embedding_key, spec.model_key
    ('embedding', 'model')
  """

  feature_config: FeatureConfigNest
  input_signature: Mapping[str, FeatureSpec | tf.TensorSpec]
  model: ServedModel | None = None
  tables: TableSelection = None
  embedding_key: str = "embedding"
  model_key: str | None = "model"


def serving_embedding_for(
  feature_config: FeatureConfigNest, tables: TableSelection = None
) -> tuple[TPUEmbeddingForServing, tuple[str, ...]]:
  """A ``TPUEmbeddingForServing`` holding only the selected tables.

  Its tables keep the names (and checkpoint keys) they have in the full
  feature config, so it restores them from a checkpoint of the full
  embedding without creating the others.

  Args:
    feature_config: the full feature config.
    tables: the selection (None: all).

  Returns:
    ``(serving embedding, selected table names)``.

  Example:
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.export import serving_embedding_for
    >>> a, b = tpe.TableConfig(10, 2), tpe.TableConfig(20, 2)
    >>> emb, names = serving_embedding_for(
    ...     {"a": tpe.FeatureConfig(a), "b": tpe.FeatureConfig(b)}, [b])
    >>> names, sorted(emb.variables)
    (('table_1',), ['table_1'])
  """
  subset = TableSubset(feature_config, tables)
  clones = {
    id(user): table
    for user, table in zip(subset.user_tables, subset.tables, strict=True)
  }
  features = {
    str(index): feature.replace(table=clones[id(feature.table)])
    for index, feature in enumerate(subset.features.values())
  }
  return TPUEmbeddingForServing(features, optimizer=None), subset.names


def restore_for_export(
  checkpoint: tf.train.Checkpoint,
  path: str,
  embedding: TPUEmbeddingForServing,
) -> str:
  """Restores an export's embedding and model to the save ``path`` means.

  ``path`` is a ``CheckpointManager`` directory (its latest save: the
  last full checkpoint and the deltas after it), a full checkpoint's
  prefix, or a delta's (the full checkpoint and the deltas up to it:
  ``checkpoints.saved_chain``). Only the objects ``checkpoint`` holds are
  read (no optimizer slot, no other table); every one of them must be in
  the checkpoint, and in each delta.

  Args:
    checkpoint: ``tf.train.Checkpoint(embedding=embedding, model=...)``
      under the keys they were trained under.
    path: the save to export.
    embedding: the serving embedding in ``checkpoint``, not yet built (it
      is built here, its tables read on creation).

  Returns:
    The prefix of the save whose values ``checkpoint`` now holds (the last
    delta applied, else the full checkpoint): the export's source.

  Raises:
    ValueError: no checkpoint at ``path``, a delta whose chain is not
      recorded, or a delta of another run or model.
    AssertionError: the checkpoint lacks an object ``checkpoint`` holds.

  Example:
    >>> import tempfile
    >>> import tensorflow as tf
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.export import restore_for_export
    >>> features = tpe.FeatureConfig(tpe.TableConfig(8, 2, name="t"))
    >>> trained = tpe.TPUEmbedding(features, tpe.SGD(0.1))
    >>> trained.build()
    >>> directory = tempfile.mkdtemp()
    >>> manager = tpe.checkpoints.CheckpointManager(
    ...     tf.train.Checkpoint(embedding=trained), directory, 2,
    ...     delta_interval=1)
    >>> _ = manager.save()
    >>> _ = trained.table_stores["t"].write_rows(3, tf.ones([1, 2]))
    >>> delta = manager.save()
    >>> served = tpe.TPUEmbeddingForServing(features, optimizer=None)
    >>> restore_for_export(
    ...     tf.train.Checkpoint(embedding=served), directory, served) == delta
    True
    >>> [table.numpy()[3] for table in served.embedding_tables.values()]
    [array([1., 1.], dtype=float32)]
  """
  base, deltas = saved_chain(path)
  # read, not restore: no save_counter is created (a checkpoint written by
  # Checkpoint.write or tpu_embedding.checkpoints has none to match it).
  status = checkpoint.read(base)
  embedding.build()  # creates the tables from the checkpoint's values
  status.expect_partial()  # slots, other tables, the training optimizer
  status.assert_existing_objects_matched()
  apply_deltas(checkpoint, base, deltas, partial=True)
  return chain_end(base, deltas)
