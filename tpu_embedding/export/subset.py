"""Table selection and live lookups in a subset of an embedding's tables.

``TableSubset`` selects some of a feature config's tables, by name or by
the user's ``TableConfig`` object, and the features looked up in them.
``ServingLookup`` looks those features up on CPU in the embedding's
current tables (any one-worker layout), or in copies of them taken once:
the copies are what ``export_for_serving`` saves.

Example:
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.export import TableSubset
  >>> users = tpe.TableConfig(10, 2, name="users")
  >>> items = tpe.TableConfig(20, 2, name="items")
  >>> subset = TableSubset({"user": tpe.FeatureConfig(users),
  ...                       "item": tpe.FeatureConfig(items)}, "users")
  >>> subset.names, list(subset.features)
  (('users',), ['user'])
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any
from typing import Union

import tensorflow as tf
from absl import logging
from tensorflow.python.distribute import sharded_variable
from tensorflow.python.ops import resource_variable_ops

from tpu_embedding.config import FeatureConfig
from tpu_embedding.config import TableConfig
from tpu_embedding.resolved import ResolvedConfig
from tpu_embedding.resolved import resolve
from tpu_embedding.serving import serving_embedding_lookup
from tpu_embedding.structure import flatten_with_paths

#: A selection of tables: names or the user's ``TableConfig`` objects.
TableSelection = Union[
  None, str, TableConfig, Sequence[Union[str, TableConfig]]
]


def feature_config_of(embedding: Any) -> Any:
  """The feature config an embedding object was created with."""
  config = getattr(embedding, "feature_config", None)
  if config is None:
    raise ValueError(
      f"Cannot read the feature config of {type(embedding).__name__}; pass "
      "feature_config= explicitly."
    )
  return config


def _select(resolved: ResolvedConfig, tables: TableSelection) -> list[int]:
  """Indices into ``resolved.tables`` of the selected tables."""
  if tables is None:
    return list(range(len(resolved.tables)))
  if isinstance(tables, (str, TableConfig)):
    tables = [tables]
  names = [t.name for t in resolved.tables]
  chosen = set()
  for table in tables:
    if isinstance(table, str):
      if table not in names:
        raise ValueError(
          f"Unknown table {table!r}: the feature config has the tables {names}."
        )
      chosen.add(names.index(table))
    elif isinstance(table, TableConfig):
      index = [i for i, u in enumerate(resolved.user_tables) if u is table]
      if not index:
        raise ValueError(
          f"{table!r} is not a table of this embedding's feature config "
          f"(tables are matched by identity); its tables are {names}."
        )
      chosen.add(index[0])
    else:
      raise TypeError(
        f"tables entries must be table names or TableConfig objects, got "
        f"{type(table).__name__}."
      )
  if not chosen:
    raise ValueError("tables is empty: select at least one table.")
  return sorted(chosen)


class TableSubset:
  """Some of a feature config's tables, and the features looked up in them.

  Tables are selected by name (given, or ``table_<i>`` for unnamed ones)
  or by the user's ``TableConfig`` object (identity), as the embedding
  objects key them.

  Example:
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.export import TableSubset
    >>> users = tpe.TableConfig(10, 2, name="users")
    >>> items = tpe.TableConfig(20, 2)  # unnamed: table_<i>, i in nest order
    >>> subset = TableSubset({"user": tpe.FeatureConfig(users),
    ...                       "item": tpe.FeatureConfig(items)}, [items])
    >>> subset.names, list(subset.features)
    (('table_0',), ['item'])
  """

  def __init__(self, feature_config: Any, tables: TableSelection = None):
    """Selects the tables.

    Args:
      feature_config: a nest of ``FeatureConfig``.
      tables: None for all tables, or names / ``TableConfig`` objects.

    Raises:
      ValueError: for an unknown name, a ``TableConfig`` of another
        config, or an empty selection.
    """
    self.feature_config = feature_config
    self._resolved = resolve(feature_config, None)
    self._selected = _select(self._resolved, tables)
    self._all_features = dict(flatten_with_paths(feature_config))

  @property
  def names(self) -> tuple[str, ...]:
    """The selected tables' names, in feature-config order."""
    return tuple(self._resolved.tables[i].name for i in self._selected)

  @property
  def tables(self) -> tuple[TableConfig, ...]:
    """Named clones of the selected tables (never the user's objects)."""
    return tuple(self._resolved.tables[i] for i in self._selected)

  @property
  def user_tables(self) -> tuple[TableConfig, ...]:
    """The user's ``TableConfig`` objects of the selected tables."""
    return tuple(self._resolved.user_tables[i] for i in self._selected)

  @property
  def features(self) -> dict[str, FeatureConfig]:
    """``{feature path: FeatureConfig}`` of the selected tables' features."""
    return {
      path: feature
      for path, feature in self._all_features.items()
      if any(feature.table is t for t in self.user_tables)
    }

  def feature(self, path: str) -> FeatureConfig:
    """The ``FeatureConfig`` at ``path``, whose table must be selected.

    Raises:
      ValueError: if ``path`` is not a feature, or its table is not
        selected.
    """
    if path not in self._all_features:
      raise ValueError(
        f"Unknown feature {path!r}: the feature config has the features "
        f"{sorted(self._all_features)}."
      )
    feature = self._all_features[path]
    if not any(feature.table is t for t in self.user_tables):
      index = [
        i
        for i, u in enumerate(self._resolved.user_tables)
        if u is feature.table
      ][0]
      raise ValueError(
        f"Feature {path!r} is looked up in table "
        f"{self._resolved.tables[index].name!r}, which is not among the "
        f"selected tables {list(self.names)}: add it to `tables` or drop "
        "the feature."
      )
    return feature


def _gatherable(source: Any, name: str) -> Any:
  """``source`` if this host can read its rows (any one-worker layout)."""
  if isinstance(
    source, (sharded_variable.ShardedVariable, tf.Variable, tf.Tensor)
  ) or getattr(source, "copies", None):
    return source  # serving_embedding_lookup reads every such layout
  raise ValueError(
    f"Table {name!r} is held as {type(source).__name__}, which cannot be "
    "read on this host (e.g. sharded over several workers). Save a "
    "checkpoint and export with tools/export.py."
  )


def _whole_value(source: Any) -> tf.Tensor:
  """The full ``[vocabulary_size, dim]`` value of a table, any layout."""
  if isinstance(source, sharded_variable.ShardedVariable):
    return tf.convert_to_tensor(source)
  if hasattr(source, "read_value"):
    return source.read_value()
  return tf.convert_to_tensor(source)


class ServingLookup:
  """Serving lookups in a subset of an embedding's tables, on CPU.

  It reads the embedding's current tables (one device, row-sharded or
  replicated under ``MirroredStrategy``, parameter servers) at each call,
  with ``tpu_embedding.serving_embedding_lookup``'s semantics, and
  refuses features of tables outside the subset: e.g. the query tower of
  a two-tower model for evaluation while the tables train. Only the rows
  looked up are read. Call it outside ``strategy.run``, eagerly or in a
  ``tf.function``.

  With ``copy=True`` it holds plain ``tf.Variable`` copies of the
  selected tables taken at construction instead (what
  ``export_for_serving`` saves).

  Example:
    >>> import tensorflow as tf
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.export import ServingLookup
    >>> users = tpe.TableConfig(10, 2, name="users", combiner="sum",
    ...                         initializer=tpe.RowIdInitializer())
    >>> items = tpe.TableConfig(20, 2, name="items")
    >>> emb = tpe.TPUEmbedding({"user": tpe.FeatureConfig(users),
    ...                         "item": tpe.FeatureConfig(items)})
    >>> query = ServingLookup(emb, tables=["users"])
    >>> query({"user": tf.ragged.constant([[1, 2], [4]])})["user"].numpy()
    array([[3., 3.],
           [4., 4.]], dtype=float32)
  """

  def __init__(
    self,
    embedding: Any,
    tables: TableSelection = None,
    *,
    feature_config: Any = None,
    copy: bool = False,
  ):
    """Selects the tables.

    Args:
      embedding: a ``TPUEmbedding`` (built or not) or
        ``TPUEmbeddingForServing``; its ``variables[name]["parameters"]``
        are read.
      tables: None for all tables, or names / ``TableConfig`` objects.
      feature_config: the embedding's feature config; read from the
        embedding by default.
      copy: hold copies of the tables taken now instead of reading them
        at each call.

    Raises:
      ValueError: for an unknown table, or a table whose variable is
        missing or has the wrong shape.
    """
    if feature_config is None:
      feature_config = feature_config_of(embedding)
    self.subset = TableSubset(feature_config, tables)
    variables = embedding.variables
    self._sources = {}
    for table in self.subset.tables:
      source = variables.get(table.name, {}).get("parameters")
      expected = (table.vocabulary_size, table.dim)
      if source is None or tuple(source.shape) != expected:
        raise ValueError(
          f"Table {table.name!r} ({expected[0]} x {expected[1]}) not found in "
          f"{type(embedding).__name__}.variables (got "
          f"{None if source is None else tuple(source.shape)}). Under "
          "TPUStrategy, save a checkpoint and export with tools/export.py."
        )
      self._sources[table.name] = source
    self._copies: dict[str, tf.Variable] | None = None
    if copy:
      self._copies = {
        name: _copy_to_cpu(source, name)
        for name, source in self._sources.items()
      }

  @property
  def table_names(self) -> tuple[str, ...]:
    """The selected tables' names, in feature-config order."""
    return self.subset.names

  @property
  def copies(self) -> dict[str, tf.Variable]:
    """``{table name: plain variable}`` (empty unless ``copy=True``)."""
    return dict(self._copies or {})

  def __call__(self, features: Any, weights: Any = None) -> Any:
    """Activations of ``features`` with the selected tables.

    Args:
      features: a nest whose paths are feature paths of the selected
        tables (e.g. ``{"user": ids}``), of dense, sparse or ragged ids.
      weights: None, or a nest like ``features`` (entries may be None).

    Returns:
      A nest like ``features`` of activations.

    Raises:
      ValueError: for an unknown feature or one of a table not selected,
        and the input errors of ``serving_embedding_lookup``.
    """
    for path, _ in flatten_with_paths(features):
      self.subset.feature(path)
    tables = {}
    for user, name in zip(
      self.subset.user_tables, self.subset.names, strict=True
    ):
      if self._copies is not None:
        tables[user] = self._copies[name]
      else:
        tables[user] = _gatherable(self._sources[name], name)
    return serving_embedding_lookup(
      features, weights, tables, self.subset.feature_config
    )


def _copy_to_cpu(source: Any, name: str) -> tf.Variable:
  """A plain, non-trainable CPU variable holding ``source``'s value."""
  start = time.time()
  with tf.init_scope(), tf.device("/CPU:0"):
    value = _whole_value(source)
    # A plain variable even inside a strategy scope (no mirroring).
    variable = resource_variable_ops.ResourceVariable(
      value, name=name, trainable=False
    )
  logging.info(
    "Copied table %r (%d x %d, %.1f MB) in %.2fs.",
    name,
    variable.shape[0],
    variable.shape[1],
    variable.shape.num_elements() * 4 / 1e6,
    time.time() - start,
  )
  return variable
