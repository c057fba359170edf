"""Rebuilding an embedding's tables from a checkpoint, for export.

``tools/export.py`` exports a SavedModel from a training checkpoint,
whatever layout it was written on (``TPUStrategy`` and multi-worker runs
included, whose tables cannot be copied live). A user function returns an
``ExportSpec`` (feature config, signature, model); ``serving_embedding_for``
creates a ``TPUEmbeddingForServing`` holding only the selected tables,
under their checkpoint keys, which the tool restores before calling
``export_for_serving``.

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
