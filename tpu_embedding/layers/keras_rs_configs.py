"""keras-rs ``TableConfig`` / ``FeatureConfig`` as this package's configs.

``DistributedEmbedding`` takes the configs of ``keras_rs.layers`` and turns
them into ``tpu_embedding`` configs here, once, at construction. keras-rs is
never imported: its configs are recognized by class when keras-rs is
already loaded, else by their attributes, so any object with the same
fields works.

==========================================  ===============================
keras-rs                                    tpu_embedding
==========================================  ===============================
``TableConfig.name``                        ``TableConfig.name``
``vocabulary_size``                         ``vocabulary_size``
``embedding_dim``                           ``dim``
``initializer`` (name or Keras object)      ``initializer`` (a callable;
                                            names via
                                            ``keras.initializers.get``)
``optimizer`` (name, ``tpe`` optimizer      ``optimizer``, through
or Keras optimizer)                         ``embedding_optimizer``
``combiner``                                ``combiner``
``placement``                               the table's layout (below)
``max_ids_per_partition``,                  SparseCore buffer sizes: unused
``max_unique_ids_per_partition``            off TPU
``FeatureConfig.name``                      ``FeatureConfig.name``
``input_shape``, ``output_shape``           ``max_sequence_length`` (below)
==========================================  ===============================

Placements, off TPU (``PLACEMENT_LAYOUTS``): ``"sparsecore"`` row-shards the
table over the replicas whatever its size; ``"default_device"`` replicates
it; ``"auto"`` leaves it to the row-sharding threshold. Every table is
trained by its own optimizer whatever its placement.

Shapes follow keras-rs: the first dimension of ``input_shape`` and
``output_shape`` is the batch (not enforced here, so a last, smaller batch
works); ``output_shape`` ends with ``embedding_dim``. An input of shape
``(B,)`` or ``(B, N)`` with an output ``(B, dim)`` is combined with the
table's combiner (``max_sequence_length=0``); an input ``(B, L)`` with an
output ``(B, L, dim)`` is a sequence (``max_sequence_length=L``).

Example:
  >>> import types
  >>> table = types.SimpleNamespace(
  ...     name="movies", vocabulary_size=100, embedding_dim=8,
  ...     initializer="zeros", optimizer="sgd", combiner="mean",
  ...     placement="sparsecore")
  >>> feature = types.SimpleNamespace(
  ...     name="movie", table=table, input_shape=(256, 5),
  ...     output_shape=(256, 8))
  >>> translated = translate({"movie": feature})
  >>> ours = translated.feature_config["movie"]
  >>> ours.table.dim, ours.table.optimizer, ours.max_sequence_length
  (8, SGD(learning_rate=0.01), 0)
  >>> translated.placements
  {'movies': 'sparsecore'}
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from tpu_embedding.config import FeatureConfig
from tpu_embedding.config import TableConfig
from tpu_embedding.layers.keras_compat import keras
from tpu_embedding.layers.keras_optimizers import embedding_optimizer
from tpu_embedding.sharding import REPLICATED
from tpu_embedding.sharding import ROW_SHARDED
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.structure import flatten_with_paths
from tpu_embedding.types import FeatureConfigNest
from tpu_embedding.types import Initializer

#: keras-rs placements and the layout each gets off TPU (None: by size).
PLACEMENT_LAYOUTS: dict[str, str | None] = {
  "auto": None,
  "sparsecore": ROW_SHARDED,
  "default_device": REPLICATED,
}

_TABLE_FIELDS = ("name", "vocabulary_size", "embedding_dim", "placement")
_FEATURE_FIELDS = ("name", "table", "input_shape", "output_shape")


@dataclasses.dataclass(frozen=True)
class Translated:
  """A feature config nest in this package's configs, with placements.

  Attributes:
    feature_config: the nest, keras-rs leaves replaced by
      ``tpu_embedding.FeatureConfig`` (features sharing a keras-rs table
      share one ``TableConfig``); this package's leaves kept as they are.
    placements: ``{table name: keras-rs placement}`` of the keras-rs
      tables.
  """

  feature_config: FeatureConfigNest
  placements: dict[str, str]


def _keras_rs_class(name: str) -> type | None:
  """``keras_rs.layers.<name>`` if keras-rs is loaded (never imports it)."""
  module = sys.modules.get("keras_rs")
  layers = getattr(module, "layers", None)
  cls = getattr(layers, name, None)
  return cls if isinstance(cls, type) else None


def is_keras_rs_table(obj: Any) -> bool:
  """Whether ``obj`` is (or looks like) a ``keras_rs.layers.TableConfig``.

  Example:
    >>> import tpu_embedding as tpe
    >>> is_keras_rs_table(tpe.TableConfig(10, 2))
    False
  """
  cls = _keras_rs_class("TableConfig")
  if cls is not None and isinstance(obj, cls):
    return True
  return all(hasattr(obj, field) for field in _TABLE_FIELDS)


def is_keras_rs_feature(obj: Any) -> bool:
  """Whether ``obj`` is (or looks like) a ``keras_rs.layers.FeatureConfig``.

  Example:
    >>> import tpu_embedding as tpe
    >>> is_keras_rs_feature(tpe.FeatureConfig(tpe.TableConfig(10, 2)))
    False
  """
  cls = _keras_rs_class("FeatureConfig")
  if cls is not None and isinstance(obj, cls):
    return True
  return all(hasattr(obj, field) for field in _FEATURE_FIELDS) and (
    is_keras_rs_table(obj.table)
  )


def check_placement(placement: Any, table: str) -> str:
  """Returns ``placement`` if keras-rs knows it.

  Raises:
    ValueError: naming the table and the placements allowed.
  """
  if placement not in PLACEMENT_LAYOUTS:
    raise ValueError(
      f"Table {table!r} has unsupported placement {placement!r}; use one of "
      f"{sorted(PLACEMENT_LAYOUTS)}."
    )
  return placement


def to_initializer(initializer: Any, table: str) -> Initializer | None:
  """A keras-rs initializer as a callable (None: our default).

  Example:
    >>> type(to_initializer("zeros", "t")).__name__
    'Zeros'
  """
  if initializer is None:
    return None
  if isinstance(initializer, str):
    return keras.initializers.get(initializer)
  if callable(initializer):
    return initializer
  raise ValueError(
    f"Table {table!r}: initializer {initializer!r} is neither a Keras "
    "initializer name nor a callable initializer."
  )


def to_table(table: Any) -> TableConfig:
  """This package's ``TableConfig`` for a keras-rs one (see the module).

  The optimizer goes through ``embedding_optimizer``, the one place that
  turns names and optimizer objects (Keras' included, as that function
  learns them) into this package's optimizers.

  Raises:
    ValueError: for an invalid field, naming the table.
  """
  name = table.name
  return TableConfig(
    vocabulary_size=table.vocabulary_size,
    dim=table.embedding_dim,
    initializer=to_initializer(getattr(table, "initializer", None), name),
    optimizer=embedding_optimizer(getattr(table, "optimizer", "adam")),
    combiner=getattr(table, "combiner", "mean"),
    name=name,
  )


def sequence_length(feature: Any, path: str) -> int:
  """``max_sequence_length`` from keras-rs' ``input_shape``/``output_shape``.

  Example:
    >>> import types
    >>> table = types.SimpleNamespace(embedding_dim=4)
    >>> def feature(input_shape, output_shape):
    ...   return types.SimpleNamespace(table=table, input_shape=input_shape,
    ...                                output_shape=output_shape)
    >>> sequence_length(feature((32,), (32, 4)), "f")
    0
    >>> sequence_length(feature((32, 5), (32, 4)), "f")
    0
    >>> sequence_length(feature((32, 5), (32, 5, 4)), "f")
    5

  Raises:
    ValueError: for shapes keras-rs does not describe this way.
  """
  input_shape = tuple(feature.input_shape)
  output_shape = tuple(feature.output_shape)
  where = (
    f"Feature {path!r} (input_shape {input_shape}, output_shape {output_shape})"
  )
  dim = feature.table.embedding_dim
  if len(output_shape) < 2 or output_shape[-1] not in (None, dim):
    raise ValueError(
      f"{where}: output_shape must be (batch, ..., embedding_dim) with "
      f"embedding_dim {dim}."
    )
  activation = output_shape[:-1]
  if len(input_shape) not in (1, 2):
    raise ValueError(
      f"{where}: inputs must have shape (batch,) or (batch, ids per example)."
    )
  if len(activation) == 1:  # (B,) or (B, N) combined into (B, dim).
    return 0
  if len(activation) == 2 and len(input_shape) == 2:
    length = activation[1] if activation[1] is not None else input_shape[1]
    if isinstance(length, int) and length > 0:
      return length
  raise ValueError(
    f"{where}: the output must be (batch, dim), combining each example's "
    "ids, or (batch, L, dim) for an input (batch, L), a sequence of L."
  )


def translate(
  feature_configs: Any, placements: Mapping[str, str] | None = None
) -> Translated:
  """This package's configs for a nest of keras-rs or our feature configs.

  Args:
    feature_configs: a nest (dicts, lists, tuples) whose leaves are
      keras-rs ``FeatureConfig`` objects or ``tpu_embedding.FeatureConfig``.
    placements: placements of this package's tables by name; keras-rs
      tables carry theirs.

  Returns:
    The ``Translated`` configs; ``placements`` holds every placement given
    (keras-rs tables' and ``placements``).

  Raises:
    ValueError: for a leaf of another type, an invalid field, a placement
      given twice for a keras-rs table, or two tables of one name.
  """
  tables: dict[int, TableConfig] = {}
  found: dict[str, str] = {}

  def table_for(table: Any) -> TableConfig:
    if id(table) not in tables:
      name = table.name
      if name in found:
        raise ValueError(
          f"Two keras-rs tables are named {name!r}; table names must be unique."
        )
      found[name] = check_placement(table.placement, name)
      tables[id(table)] = to_table(table)
    return tables[id(table)]

  leaves = []
  for path, leaf in flatten_with_paths(feature_configs):
    if isinstance(leaf, FeatureConfig):
      leaves.append(leaf)
    elif is_keras_rs_feature(leaf):
      leaves.append(
        FeatureConfig(
          table=table_for(leaf.table),
          max_sequence_length=sequence_length(leaf, path),
          name=leaf.name,
        )
      )
    else:
      raise ValueError(
        f"feature_configs entry {path!r} is a {type(leaf)}; expected a "
        "keras_rs.layers.FeatureConfig or a tpu_embedding.FeatureConfig."
      )
  for name, placement in (placements or {}).items():
    if name in found and found[name] != placement:
      raise ValueError(
        f"Table {name!r} is a keras-rs table with placement {found[name]!r}"
        f"; set its placement on its TableConfig, not in `placements` "
        f"({placement!r})."
      )
    found[name] = check_placement(placement, name)
  structure = tf.nest.pack_sequence_as(feature_configs, leaves)
  return Translated(structure, found)


def placement_policy(
  placements: Mapping[str, str], threshold: int
) -> PlacementPolicy:
  """The placement policy realizing keras-rs ``placements``.

  Example:
    >>> placement_policy({"a": "sparsecore", "b": "auto"}, 10_000)
    PlacementPolicy(row_threshold=10000, forced={'a': 'row_sharded'})
  """
  forced = {
    name: layout
    for name, placement in placements.items()
    if (layout := PLACEMENT_LAYOUTS[placement]) is not None
  }
  return PlacementPolicy(int(threshold), forced)
