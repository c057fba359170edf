"""``ReplicatedEmbedding``: tables as ordinary Keras weights, TPU lookups.

The small-table half of ``PartialTPUEmbedding``: each table is one trainable
Keras weight (replicated on every replica, like ``keras.layers.Embedding``),
trained by the model's Keras optimizer: from ``IndexedSlices`` gradients on
one device, from dense whole-table gradients (all-reduced exactly) with
several replicas. Lookups follow the same rules as the
mid-level API, unlike ``keras.layers.Embedding``: dense, sparse and ragged
ids, per-id weights, the table's combiner, sequence features and output
shapes, and out-of-range ids are an error. A ``TableConfig``'s own
optimizer is ignored here.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.layers import ReplicatedEmbedding
  >>> table = tpe.TableConfig(5, 2, combiner="sum",
  ...                         initializer=tpe.RowIdInitializer())
  >>> layer = ReplicatedEmbedding({"f": tpe.FeatureConfig(table)})
  >>> ids = tf.sparse.from_dense([[1, 2], [4, 0]])
  >>> weights = tf.sparse.from_dense([[1.0, 0.5], [2.0, 0.0]])
  >>> layer({"f": ids}, {"f": weights})["f"].numpy().tolist()
  [[2.0, 2.0], [8.0, 8.0]]
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding.config import serialize_feature_config
from tpu_embedding.kernels.ops import lookup_ops
from tpu_embedding.layers import serialization
from tpu_embedding.layers.base import EmbeddingLayer
from tpu_embedding.layers.keras_compat import register_serializable
from tpu_embedding.lookup import occurrence_rows
from tpu_embedding.resolved import resolve
from tpu_embedding.resolved import table_name
from tpu_embedding.step.activations import look_up
from tpu_embedding.step.activations import prepare_features
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.whole import WholeTable
from tpu_embedding.types import FeatureNest
from tpu_embedding.types import WeightsNest


@tf.custom_gradient
def _with_dense_gradient(table: tf.Tensor) -> Any:
  """The identity, whose gradient is made dense (duplicates summed)."""
  return tf.identity(table), tf.convert_to_tensor


@register_serializable
class ReplicatedEmbedding(EmbeddingLayer):
  """Embedding tables as Keras weights, with the mid-level API's lookups.

  Each table is one ``[vocabulary_size, dim]`` trainable weight named after
  the table (``table_<i>`` when unnamed), initialized with the table's
  initializer; features sharing a ``TableConfig`` share the weight. Every
  strategy's replicas hold the whole table, as with
  ``keras.layers.Embedding``: use it for small tables.

  Example:
    >>> import tensorflow as tf
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.layers import ReplicatedEmbedding
    >>> table = tpe.TableConfig(10, 3, name="colors")
    >>> layer = ReplicatedEmbedding(tpe.FeatureConfig(table))
    >>> [tuple(w.shape) for w in layer.trainable_weights]
    [(10, 3)]
  """

  def __init__(self, feature_config: Any, **kwargs: Any):
    """Creates the layer and its table weights.

    Args:
      feature_config: a nest of ``tpu_embedding.FeatureConfig``.
      **kwargs: Keras layer arguments (``name``, ...).

    Raises:
      ValueError: for an invalid feature config.
    """
    super().__init__(**kwargs)
    self._config = resolve(feature_config, None)
    self._weights_by_table = tuple(
      self.add_weight(
        name=table.name,
        shape=(table.vocabulary_size, table.dim),
        dtype="float32",
        initializer=table.initializer,
        trainable=True,
      )
      for table in self._config.tables
    )
    self._stores = {
      table_name(table): WholeTable.wrap(table, {"parameters": weight})
      for table, weight in zip(
        self._config.tables, self._weights_by_table, strict=True
      )
    }
    self.built = True

  @property
  def embedding_tables(self) -> dict[Any, Any]:
    """``{TableConfig: Keras weight}``, keyed by the user's configs."""
    return dict(
      zip(self._config.user_tables, self._weights_by_table, strict=True)
    )

  @property
  def table_stores(self) -> dict[str, TableStore]:
    """``{table name: TableStore}`` over the Keras weights."""
    return dict(self._stores)

  @tf.autograph.experimental.do_not_convert
  def call(
    self,
    features: FeatureNest,
    weights: WeightsNest | None = None,
    training: Any = None,
  ) -> Any:
    """Looks up ``features`` (a nest like the feature config).

    Args:
      features: a nest of id tensors (dense, sparse or ragged; scalars and
        rank-1 sparse ids as ``TPUEmbedding`` takes them).
      weights: None, or a nest like ``features`` of per-id weights.
      training: unused (the weights train through Keras' optimizer).

    Returns:
      A nest like ``features`` of activations.

    Raises:
      ValueError: naming missing or unexpected features, or bad inputs.
      RuntimeError: when called under another strategy than the layer was
        created under.
    """
    del training
    return self._look_up(features, weights, self._look_up_in_weights)

  def _look_up_in_weights(self, features: Any, weights: Any) -> Any:
    """The activations of ids the lookup takes, gathered from the weights."""
    prepared = prepare_features(
      self._config, features, weights, "features passed to the layer", True
    )
    readable = {
      table.name: self._readable(variable)
      for table, variable in zip(
        self._config.tables, self._weights_by_table, strict=True
      )
    }

    ops = lookup_ops()  # Keras weights, maybe on a GPU: TensorFlow's ops.

    def rows(requests):
      return [
        occurrence_rows(tf.gather(readable[r.table.name], r.ids), r.index)
        for r in requests
      ]

    return look_up(self._config, prepared, rows, ops=ops)[0]

  def _readable(self, variable: Any) -> Any:
    """What to gather rows from: the weight, or its value (dense gradient).

    With several replicas, Keras sums the replicas' ``IndexedSlices`` by
    concatenating them, and its optimizers square their values before
    duplicate rows are added (Adagrad, Adam): a row looked up on two
    replicas would get ``g1² + g2²`` instead of ``(g1 + g2)²``. A dense
    gradient of the whole (small) table is all-reduced exactly, so training
    equals one device's. On one device the ids are distinct, and sparse
    gradients are exact.
    """
    if self._strategy.num_replicas_in_sync > 1:
      return _with_dense_gradient(tf.convert_to_tensor(variable))
    return variable

  def get_config(self) -> dict[str, Any]:
    """The constructor arguments, feature configs as plain data."""
    config = super().get_config()
    config["feature_config"] = serialize_feature_config(self._config.structure)
    return config

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> ReplicatedEmbedding:
    """Rebuilds the layer from ``get_config``'s output."""
    return cls(**serialization.decode_feature_config_argument(config))
