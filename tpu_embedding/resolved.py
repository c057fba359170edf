"""Resolves a feature config into named tables, without mutating it.

Tables are keyed by object identity: features sharing a ``TableConfig``
share a table. Unnamed tables are named ``table_<i>`` in first-appearance
order of ``tf.nest.flatten(feature_config)``; a table without an optimizer
takes the global one. The user's objects are cloned, never changed.

Example:
  >>> import tpu_embedding as tpe
  >>> t = tpe.TableConfig(vocabulary_size=10, dim=2)
  >>> r = resolve({"a": tpe.FeatureConfig(t), "b": tpe.FeatureConfig(t)},
  ...             tpe.SGD(0.1))
  >>> [table.name for table in r.tables], t.name
  (['table_0'], None)
"""

from __future__ import annotations

import dataclasses

from tpu_embedding import errors
from tpu_embedding.config import FeatureConfig
from tpu_embedding.config import TableConfig
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.structure import flatten_with_paths
from tpu_embedding.types import FeatureConfigNest


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
  """Named, optimizer-resolved clones of a feature config.

  Attributes:
    structure: the user's feature config nest.
    paths: flattened feature paths.
    features: flattened ``FeatureConfig`` clones pointing at ``tables``.
    tables: named ``TableConfig`` clones with their optimizer set.
    user_tables: the user's ``TableConfig`` objects, parallel to
      ``tables``.
  """

  structure: FeatureConfigNest
  paths: tuple[str, ...]
  features: tuple[FeatureConfig, ...]
  tables: tuple[TableConfig, ...]
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
    table = user_table.replace(name=name, optimizer=table_optimizer)
    resolved_already = (
      table.vocabulary is not None
      and table.vocabulary.capacity == table.vocabulary_size - 1
    )  # (a user's capacity must equal its vocabulary_size)
    if table.vocabulary is not None and not resolved_already:
      # Rows [0, vocabulary_size) for keys, then the default row
      # (vocabularies/dynamic_tables.py).
      size = table.vocabulary_size
      table = table.replace(
        vocabulary_size=size + 1,
        vocabulary=table.vocabulary.replace(capacity=size),
      )
    tables.append(table)
  clone_of = {id(u): t for u, t in zip(user_tables, tables, strict=True)}
  features = tuple(f.replace(table=clone_of[id(f.table)]) for _, f in flat)
  return ResolvedConfig(
    feature_config,
    tuple(p for p, _ in flat),
    features,
    tuple(tables),
    tuple(user_tables),
  )
