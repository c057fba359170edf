"""``PartialTPUEmbedding``: large tables via the mid-level API, small ones not.

Tables with more rows than ``size_threshold`` are looked up and trained by a
``TPUEmbedding`` layer (sparse per-table optimizers; row-sharded under
``MirroredStrategy``); the others become ``ReplicatedEmbedding`` weights,
replicated like ``keras.layers.Embedding`` and trained by the model's Keras
optimizer. Both halves take dense, sparse and ragged ids with weights and
apply the table's combiner, so the split changes where a table lives and
what trains it, never the activations.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.layers import PartialTPUEmbedding
  >>> big = tpe.TableConfig(50_000, 4, name="items")
  >>> small = tpe.TableConfig(10, 4, name="colors")
  >>> layer = PartialTPUEmbedding(
  ...     {"item": tpe.FeatureConfig(big), "color": tpe.FeatureConfig(small)},
  ...     optimizer="adagrad")
  >>> layer.placements
  {'color': 'replicated', 'item': 'tpu_embedding'}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from tpu_embedding.config import TableConfig
from tpu_embedding.layers import serialization
from tpu_embedding.layers.base import EmbeddingLayer
from tpu_embedding.layers.keras_compat import register_serializable
from tpu_embedding.layers.keras_optimizers import embedding_optimizer
from tpu_embedding.layers.replicated_embedding import ReplicatedEmbedding
from tpu_embedding.layers.tpu_embedding import TPUEmbedding
from tpu_embedding.resolved import resolve
from tpu_embedding.sharding import DEFAULT_ROW_THRESHOLD
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.tables.base import TableStore
from tpu_embedding.types import FeatureConfigNest
from tpu_embedding.types import FeatureNest
from tpu_embedding.types import WeightsNest

#: ``placements`` values.
TPU_EMBEDDING = "tpu_embedding"
REPLICATED = "replicated"


@dataclasses.dataclass(frozen=True)
class KerasEmbeddingTable:
  """A small table, with ``keras.layers.Embedding``'s attribute names.

  What tensorflow-recommenders' ``keras_embedding_layers`` gives for each
  feature, where every small table is its own ``keras.layers.Embedding``;
  here they all live in one ``ReplicatedEmbedding`` layer.

  Attributes:
    input_dim: the vocabulary size.
    output_dim: the embedding width.
    embeddings: the table's Keras weight.
  """

  input_dim: int
  output_dim: int
  embeddings: Any


def _uses_mid_level_api(table: TableConfig, size_threshold: int | None) -> bool:
  return size_threshold is not None and table.vocabulary_size > size_threshold


def _check_float32_storage(
  table: TableConfig, size_threshold: int | None
) -> None:
  """Refuses a 16-bit ``RowStorage`` on a table a Keras layer trains.

  Raises:
    ValueError: naming the table, its storage and the threshold.
  """
  storage = table.storage
  if storage.is_float32:
    return
  raise ValueError(
    f"Table '{table.name}' is stored as {storage.dtype} with "
    f"{storage.slots} slots (RowStorage), but with "
    f"{table.vocabulary_size} rows (size_threshold={size_threshold}) "
    "PartialTPUEmbedding trains it in a float32 Keras Embedding with the "
    "Keras optimizer: give it RowStorage() or a size_threshold below "
    "its rows."
  )


@register_serializable
class PartialTPUEmbedding(EmbeddingLayer):
  """The mid-level API for large tables, Keras weights for small ones.

  A drop-in for ``tfrs.experimental.layers.embedding.PartialTPUEmbedding``
  with any nest of features (not only dicts) and, for small tables too,
  sparse and ragged ids, weights and combiners.

  A table with more than ``size_threshold`` rows goes to the inner
  ``TPUEmbedding`` layer (``tpu_embedding``), trained by its own optimizer
  (the table's, else ``optimizer``); the others to the inner
  ``ReplicatedEmbedding`` layer (``replicated_embedding``), trained by the
  optimizer of ``model.compile`` (a table's own optimizer is then unused).
  ``size_threshold=0`` sends every table to the mid-level API,
  ``size_threshold=None`` none. Unnamed tables are named ``table_<i>`` in
  the order of the whole feature config, whichever side they land on.

  Example:
    >>> import tensorflow as tf
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.layers import PartialTPUEmbedding
    >>> table = tpe.TableConfig(8, 2, initializer=tpe.RowIdInitializer(),
    ...                         combiner="sum")
    >>> features = {"a": tpe.FeatureConfig(table)}
    >>> ids = {"a": tf.ragged.constant([[1, 2], [7]])}
    >>> for threshold in (0, None):
    ...   layer = PartialTPUEmbedding(features, "sgd", size_threshold=threshold)
    ...   print(layer.placements, layer(ids)["a"].numpy().tolist())
    {'a': 'tpu_embedding'} [[3.0, 3.0], [7.0, 7.0]]
    {'a': 'replicated'} [[3.0, 3.0], [7.0, 7.0]]
  """

  def __init__(
    self,
    feature_config: FeatureConfigNest,
    optimizer: Any,
    pipeline_execution_with_tensor_core: bool = False,
    batch_size: int | None = None,
    size_threshold: int | None = 10_000,
    *,
    row_sharding_threshold: int | PlacementPolicy = DEFAULT_ROW_THRESHOLD,
    **kwargs: Any,
  ):
    """Creates the layer, splitting the tables by size.

    Args:
      feature_config: a nest of ``tpu_embedding.FeatureConfig`` (or
        TensorFlow's).
      optimizer: the optimizer of large tables without their own: a name,
        a Keras optimizer, or an embedding optimizer (see
        ``TPUEmbedding``). The small tables are trained by the optimizer of
        ``model.compile``, as in tensorflow-recommenders.
      pipeline_execution_with_tensor_core: passed to ``TPUEmbedding``.
      batch_size: accepted for compatibility; not needed.
      size_threshold: tables with more rows use the mid-level API; 0 for
        all, None for none.
      row_sharding_threshold: passed to ``TPUEmbedding``.
      **kwargs: Keras layer arguments (``name``, ...).

    Raises:
      ValueError: for an invalid feature config, optimizer or threshold.
    """
    super().__init__(**kwargs)
    if size_threshold is not None and (
      not isinstance(size_threshold, int) or size_threshold < 0
    ):
      raise ValueError(
        "Argument `size_threshold` must be None or an int >= 0. "
        f"Received: {size_threshold!r}"
      )
    self._optimizer = embedding_optimizer(optimizer)
    self._config = resolve(
      self._tf_configs.feature_config(feature_config), None
    )
    self._size_threshold = size_threshold
    self._pipeline_execution_with_tensor_core = (
      pipeline_execution_with_tensor_core
    )
    self._batch_size = batch_size
    self._row_sharding_threshold = row_sharding_threshold
    # The resolved features point at named clones of the user's tables
    # (named as in the whole config); features sharing a table share one.
    sides: dict[str, dict[str, Any]] = {TPU_EMBEDDING: {}, REPLICATED: {}}
    for path, feature in zip(
      self._config.paths, self._config.features, strict=True
    ):
      side = (
        TPU_EMBEDDING
        if _uses_mid_level_api(feature.table, size_threshold)
        else REPLICATED
      )
      sides[side][path] = feature
    for feature in sides[REPLICATED].values():
      _check_float32_storage(feature.table, size_threshold)
    self._placements = {
      path: side for side, features in sides.items() for path in features
    }
    self._tpu_embedding_layer = None
    if sides[TPU_EMBEDDING]:
      self._tpu_embedding_layer = TPUEmbedding(
        sides[TPU_EMBEDDING],
        self._optimizer,
        pipeline_execution_with_tensor_core,
        row_sharding_threshold=row_sharding_threshold,
        name=f"{self.name}_tpu_embedding",
      )
    self._replicated_layer = None
    if sides[REPLICATED]:
      self._replicated_layer = ReplicatedEmbedding(
        sides[REPLICATED], name=f"{self.name}_replicated_embedding"
      )
    self.built = True

  # --- properties ----------------------------------------------------------

  @property
  def tpu_embedding(self) -> TPUEmbedding | None:
    """The inner ``TPUEmbedding`` layer; None if no table is that large."""
    return self._tpu_embedding_layer

  @property
  def replicated_embedding(self) -> ReplicatedEmbedding | None:
    """The inner ``ReplicatedEmbedding`` layer; None if no table is small."""
    return self._replicated_layer

  @property
  def keras_embedding_layers(self) -> dict[str, KerasEmbeddingTable]:
    """``{feature path: KerasEmbeddingTable}`` of the small tables.

    tensorflow-recommenders' property, where each value is a
    ``keras.layers.Embedding``; features sharing a table share the value.
    """
    if self._replicated_layer is None:
      return {}
    weights = self._replicated_layer.embedding_tables
    tables: dict[int, KerasEmbeddingTable] = {}
    for table in weights:
      tables[id(table)] = KerasEmbeddingTable(
        table.vocabulary_size, table.dim, weights[table]
      )
    return {
      path: tables[id(feature.table)]
      for path, feature in zip(
        self._config.paths, self._config.features, strict=True
      )
      if self._placements[path] == REPLICATED
    }

  @property
  def placements(self) -> dict[str, str]:
    """``{feature path: "tpu_embedding" or "replicated"}``."""
    return dict(sorted(self._placements.items()))

  @property
  def embedding_tables(self) -> dict[TableConfig, Any]:
    """``{TableConfig: variable}`` of both halves, keyed by user configs."""
    inner: dict[TableConfig, Any] = {}
    for layer in (self._tpu_embedding_layer, self._replicated_layer):
      if layer is not None:
        inner.update(layer.embedding_tables)
    return {
      self._tf_configs.user_table(user): inner[clone]
      for user, clone in zip(
        self._config.user_tables, self._config.tables, strict=True
      )
    }

  @property
  def table_stores(self) -> dict[str, TableStore]:
    """``{table name: TableStore}`` of both halves."""
    stores: dict[str, TableStore] = {}
    for layer in (self._tpu_embedding_layer, self._replicated_layer):
      if layer is not None:
        stores.update(layer.table_stores)
    return stores

  # --- calls ---------------------------------------------------------------

  @tf.autograph.experimental.do_not_convert
  def call(
    self,
    features: FeatureNest,
    weights: WeightsNest | None = None,
    serving_config: Any = None,
    training: Any = None,
  ) -> Any:
    """Looks up ``features`` in whichever half holds each table.

    Args:
      features: a nest of ids (dense, sparse or ragged) like the config.
      weights: None, or a nest like ``features`` of per-id weights.
      serving_config: if given, a serving lookup instead (see
        ``serving_lookup``).
      training: passed to the inner layers (False: no table updates).

    Returns:
      A nest like ``features`` of activations.

    Raises:
      ValueError: naming missing or unexpected features.
      RuntimeError: when called under another strategy than the layer was
        created under.
    """
    if serving_config is not None:
      return self.serving_lookup(features, weights, serving_config)
    self._check_inputs(features, weights)
    self._check_strategy()

    def by_path(nest: Any) -> dict[str, Any]:
      flat = tf.nest.flatten(nest, expand_composites=False)
      return dict(zip(self._config.paths, flat, strict=True))

    flat_ids = by_path(features)
    flat_weights = None if weights is None else by_path(weights)
    outputs: dict[str, Any] = {}
    for side, layer in (
      (TPU_EMBEDDING, self._tpu_embedding_layer),
      (REPLICATED, self._replicated_layer),
    ):
      if layer is None:
        continue
      paths = [p for p, s in self._placements.items() if s == side]
      side_weights = (
        None if flat_weights is None else {p: flat_weights[p] for p in paths}
      )
      outputs.update(
        layer({p: flat_ids[p] for p in paths}, side_weights, training=training)
      )
    return tf.nest.pack_sequence_as(
      self._config.structure, [outputs[p] for p in self._config.paths]
    )

  # --- saving --------------------------------------------------------------

  def get_config(self) -> dict[str, Any]:
    """The constructor arguments, feature configs as plain data."""
    config = super().get_config()
    config.update(
      serialization.encode_layer_arguments(
        self._config.structure, self._optimizer, self.name
      ),
      pipeline_execution_with_tensor_core=(
        self._pipeline_execution_with_tensor_core
      ),
      batch_size=self._batch_size,
      size_threshold=self._size_threshold,
      row_sharding_threshold=serialization.serialize_row_threshold(
        self._row_sharding_threshold
      ),
    )
    return config

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> PartialTPUEmbedding:
    """Rebuilds the layer from ``get_config``'s output."""
    return cls(**serialization.decode_layer_arguments(config))
