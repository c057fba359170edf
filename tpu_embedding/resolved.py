"""Resolves a feature config into named tables, without mutating it.

Tables are keyed by object identity: features sharing a ``TableConfig``
share a table. Unnamed tables are named ``table_<i>`` in first-appearance
order of ``tf.nest.flatten(feature_config)``; a table without an optimizer
takes the global one. The user's objects are cloned, never changed.

A resolved table (``ResolvedTable``) carries the ``KeyMapping`` of its
inputs (``keys``) instead of their declaration: ids are rows, or a
``DynamicVocabulary`` maps keys to rows ``[0, capacity)`` and the default
row ``capacity``, so it holds ``capacity + 1`` rows. Its fields are valid
``TableConfig`` arguments (it is built by that constructor), and resolving
it again changes nothing: ``key_mapping`` returns the mapping it carries.

Example:
  >>> import tpu_embedding as tpe
  >>> t = tpe.TableConfig(vocabulary_size=10, dim=2)
  >>> r = resolve({"a": tpe.FeatureConfig(t), "b": tpe.FeatureConfig(t)},
  ...             tpe.SGD(0.1))
  >>> [table.name for table in r.tables], t.name
  (['table_0'], None)
  >>> users = tpe.TableConfig(4, 2, vocabulary=tpe.DynamicVocabulary())
  >>> (table,) = resolve(tpe.FeatureConfig(users), None).tables
  >>> table.vocabulary_size, table.vocabulary, table.key_mapping.default_row
  (5, None, 4)
"""

from __future__ import annotations

import dataclasses

from tpu_embedding import errors
from tpu_embedding import row_storage
from tpu_embedding.config import FeatureConfig
from tpu_embedding.config import TableConfig
from tpu_embedding.keys import IdentityMapping
from tpu_embedding.keys import KeyMapping
from tpu_embedding.keys.dynamic import declared_mapping
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.structure import flatten_with_paths
from tpu_embedding.types import FeatureConfigNest


class ResolvedTable(TableConfig):
  """A table of a ``ResolvedConfig``: named, its optimizer set, holding
  the rows of its inputs' ``KeyMapping``.

  Made by ``TableConfig``'s constructor (its validation holds), from
  ``table``'s fields but its declaration of inputs: ``vocabulary_size`` is
  the mapping's ``rows``, ``vocabulary`` is None (a dynamic table's
  vocabulary is its mapping's).

  Args:
    table: the table.
    name: its name.
    optimizer: its optimizer.
    key_mapping: how its inputs become rows.

  Attributes:
    key_mapping: how its inputs become rows (``keys``).
  """

  def __init__(
    self,
    table: TableConfig,
    name: str | None,
    optimizer: Optimizer | None,
    key_mapping: KeyMapping,
  ):
    super().__init__(
      vocabulary_size=key_mapping.rows,
      dim=table.dim,
      initializer=table.initializer,
      optimizer=optimizer,
      combiner=table.combiner,
      name=name,
      quantization_config=table.quantization_config,
      layout=table.layout,
      dtype=table.dtype,
      vocabulary=None,
      storage=table.storage,
    )
    self.key_mapping = key_mapping


def key_mapping(table: TableConfig) -> KeyMapping:
  """How ``table``'s inputs become rows: the mapping a resolved table
  carries, or the one a user's table declares (``resolve`` gives it).

  Example:
    >>> import tpu_embedding as tpe
    >>> key_mapping(tpe.TableConfig(10, 2)).rows
    10
  """
  if isinstance(table, ResolvedTable):
    return table.key_mapping
  return declared_mapping(table.vocabulary, table.vocabulary_size)


def rows_table(table: TableConfig) -> ResolvedTable:
  """The table of ``table``'s rows, as a lookup reads them once keys are
  rows (a serving lookup's): ids are rows, the default row included."""
  rows = IdentityMapping(key_mapping(table).rows)
  return ResolvedTable(table, table.name, table.optimizer, rows)


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
  """Named, optimizer-resolved clones of a feature config.

  Attributes:
    structure: the user's feature config nest.
    paths: flattened feature paths.
    features: flattened ``FeatureConfig`` clones pointing at ``tables``.
    tables: named ``ResolvedTable`` clones with their optimizer set.
    user_tables: the user's ``TableConfig`` objects, parallel to
      ``tables``.
  """

  structure: FeatureConfigNest
  paths: tuple[str, ...]
  features: tuple[FeatureConfig, ...]
  tables: tuple[ResolvedTable, ...]
  user_tables: tuple[TableConfig, ...]

  def features_of(self, table: TableConfig) -> list[int]:
    """Flat indices of the features looked up in ``table``."""
    return [i for i, f in enumerate(self.features) if f.table is table]


def table_name(table: TableConfig) -> str:
  """The name of a resolved table, typed ``str`` (``resolve`` names all).

  Raises:
    ValueError: for an unnamed table (one not from a ``ResolvedConfig``).

  Example:
    >>> import tpu_embedding as tpe
    >>> table_name(tpe.TableConfig(10, 2, name="users"))
    'users'
  """
  if table.name is None:
    raise ValueError(
      f"{table!r} has no name; use the named tables of the embedding's "
      "resolved config (tpu_embedding.resolved.resolve)."
    )
  return table.name


def resolve(
  feature_config: FeatureConfigNest, optimizer: Optimizer | None
) -> ResolvedConfig:
  """Validates and clones ``feature_config``.

  Args:
    feature_config: a nest of ``FeatureConfig``.
    optimizer: the global optimizer, or None.

  Returns:
    The ``ResolvedConfig``.

  Raises:
    ValueError: if a leaf is not a ``FeatureConfig``, an optimizer is not
      one of this package's, or two tables share a name.
  """
  if optimizer is not None and not isinstance(optimizer, Optimizer):
    raise ValueError(errors.UNSUPPORTED_OPTIMIZER.format(type=type(optimizer)))
  flat = flatten_with_paths(feature_config)
  if not flat:
    raise ValueError(
      "feature_config is empty; pass at least one FeatureConfig."
    )
  user_tables: list[TableConfig] = []
  for path, feature in flat:
    if not isinstance(feature, FeatureConfig):
      raise ValueError(
        f"feature_config entry {path!r} is a {type(feature)}; expected a "
        "tpu_embedding.FeatureConfig."
      )
    if not any(feature.table is t for t in user_tables):
      user_tables.append(feature.table)
  tables, names = [], set()
  for i, user_table in enumerate(user_tables):
    name = user_table.name if user_table.name is not None else f"table_{i}"
    if name in names:
      raise ValueError(errors.UNIQUE_TABLE_NAMES.format(name=name))
    names.add(name)
    table_optimizer = user_table.optimizer or optimizer
    if table_optimizer is not None and not isinstance(
      table_optimizer, Optimizer
    ):
      raise ValueError(
        errors.UNSUPPORTED_OPTIMIZER.format(type=type(table_optimizer))
      )
    row_storage.check_table(name, user_table.storage, table_optimizer)
    tables.append(
      ResolvedTable(user_table, name, table_optimizer, key_mapping(user_table))
    )
  clone_of = {id(u): t for u, t in zip(user_tables, tables, strict=True)}
  features = tuple(f.replace(table=clone_of[id(f.table)]) for _, f in flat)
  return ResolvedConfig(
    feature_config,
    tuple(p for p, _ in flat),
    features,
    tuple(tables),
    tuple(user_tables),
  )
