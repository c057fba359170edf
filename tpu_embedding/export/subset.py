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

import functools
import time
from collections.abc import Sequence
from typing import Any
from typing import Union

import tensorflow as tf
from absl import logging

from tpu_embedding import errors
from tpu_embedding.config import FeatureConfig
from tpu_embedding.config import TableConfig
from tpu_embedding.export.quantize import QuantizedTable
from tpu_embedding.export.quantize import check_table_dtype
from tpu_embedding.export.quantize import serving_table
from tpu_embedding.export.quantize import table_variables
from tpu_embedding.export.streamed import unwritten_table
from tpu_embedding.export.streamed import written_in_parts
from tpu_embedding.resolved import ResolvedConfig
from tpu_embedding.resolved import resolve
from tpu_embedding.resolved import table_name
from tpu_embedding.serving import lookup_with_readers
from tpu_embedding.structure import flatten_with_paths
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.base import row_reader
from tpu_embedding.vocabularies.dynamic_tables import dynamic_mappings
from tpu_embedding.vocabularies.transition import VocabularyVariables
from tpu_embedding.vocabularies.transition import find

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
    return tuple(table_name(self._resolved.tables[i]) for i in self._selected)

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
  ``export_for_serving`` saves), or with ``table_dtype`` copies in a
  smaller type (``quantize.QuantizedTable``) whose looked-up rows are
  dequantized. A table kept on disk is not copied: its copy holds no
  value until ``export_for_serving`` writes it into the SavedModel from
  the table's files (``streamed.py``), so it is for exports only.

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
    table_dtype: str = "float32",
  ):
    """Selects the tables.

    Args:
      embedding: a ``TPUEmbedding`` (built or not) or
        ``TPUEmbeddingForServing``; its ``table_stores`` are read.
      tables: None for all tables, or names / ``TableConfig`` objects.
      feature_config: the embedding's feature config; read from the
        embedding by default.
      copy: hold copies of the tables taken now instead of reading them
        at each call.
      table_dtype: the copies' type, one of ``quantize.TABLE_DTYPES``
        (needs ``copy=True`` unless float32).

    Raises:
      ValueError: for an unknown table, or a table whose variable is
        missing or has the wrong shape; for an unknown ``table_dtype``, or
        one other than float32 without ``copy``.
    """
    table_dtype = check_table_dtype(table_dtype)
    if table_dtype != "float32" and not copy:
      raise ValueError(
        f"table_dtype={table_dtype!r} needs copy=True: the live tables are "
        "float32."
      )
    if feature_config is None:
      feature_config = feature_config_of(embedding)
    self.subset = TableSubset(feature_config, tables)
    stores = table_stores_of(embedding)
    self._sources: dict[str, TableStore] = {}
    for table in self.subset.tables:
      store = stores.get(table_name(table))
      expected = (table.vocabulary_size, table.dim)
      found = (
        None
        if store is None
        else (store.table.vocabulary_size, store.table.dim)
      )
      if store is None or found != expected:
        raise ValueError(
          f"Table {table.name!r} ({expected[0]} x {expected[1]}) not found in "
          f"{type(embedding).__name__}.table_stores (got {found})."
        )
      self._sources[table_name(table)] = store
    # Dynamic tables: their vocabulary maps keys to rows first (live, or
    # from a snapshot of the whole state with ``copy=True``).
    states = {
      table_name(t): _vocabulary_of(embedding, table_name(t))
      for t, _ in dynamic_mappings(self.subset.tables)
    }
    self._vocabularies: dict[str, VocabularyVariables] = {}
    self._translators: dict[str, Any] = {
      name: state.find_live for name, state in states.items()
    }
    self._copies: dict[str, tf.Variable | QuantizedTable] | None = None
    if copy:
      self._copies = {
        name: _copy_to_cpu(source, name, table_dtype)
        for name, source in self._sources.items()
      }
      self._vocabularies = {
        name: state.snapshot() for name, state in states.items()
      }
      self._translators = {
        name: functools.partial(find, variables)
        for name, variables in self._vocabularies.items()
      }

  @property
  def stores(self) -> dict[str, TableStore]:
    """``{table name: TableStore}`` of the selected tables (live)."""
    return dict(self._sources)

  @property
  def table_names(self) -> tuple[str, ...]:
    """The selected tables' names, in feature-config order."""
    return self.subset.names

  @property
  def copies(self) -> dict[str, tf.Variable | QuantizedTable]:
    """``{table name: plain variable}``, or ``QuantizedTable`` with a
    ``table_dtype`` other than float32 (empty unless ``copy=True``)."""
    return dict(self._copies or {})

  @property
  def vocabulary_variables(self) -> dict[str, dict[str, tf.Variable]]:
    """``{dynamic table name: {state name: variable}}``: the snapshot the
    lookups map keys with (empty unless ``copy=True``)."""
    return {
      name: dict(variables.variables)
      for name, variables in self._vocabularies.items()
    }

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
    readers = {}
    for user, name in zip(
      self.subset.user_tables, self.subset.names, strict=True
    ):
      if self._copies is not None:
        copied = self._copies[name]
        readers[user] = (
          copied.gather
          if isinstance(copied, QuantizedTable)
          else row_reader(copied)
        )
      else:
        readers[user] = self._sources[name].peek
    translators = {}
    for user, name in zip(
      self.subset.user_tables, self.subset.names, strict=True
    ):
      if name in self._translators:
        translators[user] = self._translators[name]
    return lookup_with_readers(
      features, weights, readers, self.subset.feature_config, translators
    )


def table_stores_of(embedding: Any) -> dict[str, TableStore]:
  """The embedding's table stores, or a clear error where it has none."""
  try:
    return embedding.table_stores
  except (AttributeError, RuntimeError) as e:
    raise ValueError(
      f"Cannot read the tables of {type(embedding).__name__} on this host "
      f"({e}). Save a checkpoint and export with tools/export.py."
    ) from e


def _vocabulary_of(embedding: Any, name: str) -> Any:
  """The ``VocabularyState`` of dynamic table ``name``."""
  try:
    states = embedding.vocabulary_states
  except AttributeError as e:
    raise ValueError(errors.DYNAMIC_EXPORT.format(tables=[name])) from e
  return states[name]


def _copy_to_cpu(
  source: TableStore, name: str, table_dtype: str
) -> tf.Variable | QuantizedTable:
  """A plain, non-trainable CPU variable holding ``source``'s value (in
  ``table_dtype``: a ``QuantizedTable``); of a table too large to hold
  whole, one holding no value (``streamed.unwritten_table``)."""
  if written_in_parts(source):  # Too large to copy: written by chunks.
    return unwritten_table(source, table_dtype, name)
  start = time.time()
  with tf.init_scope(), tf.device("/CPU:0"):
    value = source.read()
    # A plain variable even inside a strategy scope (no mirroring).
    copied = serving_table(value, table_dtype, name)
  logging.info(
    "Copied table %r (%d x %d, %s, %.1f MB) in %.2fs.",
    name,
    copied.shape[0],
    copied.shape[1],
    table_dtype,
    sum(_bytes(v) for v in table_variables(copied)) / 1e6,
    time.time() - start,
  )
  return copied


def _bytes(variable: tf.Variable) -> int:
  return variable.shape.num_elements() * variable.dtype.size
