"""``DistributedEmbedding``: keras-rs' embedding layer on every strategy.

A drop-in for ``keras_rs.layers.DistributedEmbedding``: the same
constructor (a nest of keras-rs ``FeatureConfig``), the same call
(``layer(inputs, weights=None, training=None)`` returning the nest of
activations), trained inside ``model.fit`` like keras-rs' layer on TPU:
each table by its own optimizer, the rest of the model by the optimizer of
``model.compile``. Off TPU, keras-rs refuses the ``"sparsecore"`` placement
and trains its ``"default_device"`` tables as ordinary Keras weights; here
every placement trains, on the default strategy, ``OneDeviceStrategy``,
``MirroredStrategy`` and ``MultiWorkerMirroredStrategy``:

===================  ===============================================
keras-rs placement   table off TPU (several replicas)
===================  ===============================================
``"sparsecore"``     row-sharded over the replicas, whatever its size
``"default_device"`` replicated on every replica
``"auto"``           row-sharded above ``row_sharding_threshold`` rows
===================  ===============================================

(one device holds every table whole). It is a ``TPUEmbedding`` layer: one
mid-level API object holds all the tables (``mid_level_api``,
``table_stores``), trained through the same gradient hook, saved and
served the same way. The keras-rs configs are translated once at
construction (``keras_rs_configs``); ``tpu_embedding.FeatureConfig``
leaves are accepted too. keras-rs need not be installed.

Under ``TPUStrategy``, constructing this class returns keras-rs' own
``DistributedEmbedding`` (SparseCore), built from the same configs (this
package's are first translated to TensorFlow's, which keras-rs places on
SparseCore); keras-rs must then be installed. That branch only hands over;
this package does not test it on TPU.

Example:
  >>> import numpy as np
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.layers import DistributedEmbedding
  >>> table = tpe.TableConfig(100, 4, name="items", optimizer=tpe.SGD(0.5),
  ...                         initializer=tf.zeros_initializer())
  >>> layer = DistributedEmbedding({"item": tpe.FeatureConfig(table)},
  ...                              placements={"items": "sparsecore"})
  >>> ids = tf.keras.Input(shape=(), dtype="int64", name="item")
  >>> score = tf.keras.layers.Dense(1)(layer({"item": ids})["item"])
  >>> model = tf.keras.Model({"item": ids}, score)
  >>> model.compile(optimizer="adam", loss="mse")
  >>> _ = model.fit({"item": np.array([3, 5])}, np.ones((2, 1)), verbose=0)
  >>> rows = layer.get_embedding_tables()["items"].numpy()
  >>> bool(np.any(rows[3] != 0)), bool(np.all(rows[4] == 0))
  (True, True)
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding.config import FeatureConfig
from tpu_embedding.config import serialize_feature_config
from tpu_embedding.engines.tpu import is_tpu_strategy
from tpu_embedding.engines.tpu_conversion import to_tf_feature_config
from tpu_embedding.layers import keras_rs_configs
from tpu_embedding.layers import serialization
from tpu_embedding.layers.keras_compat import register_serializable
from tpu_embedding.layers.keras_optimizers import embedding_optimizer
from tpu_embedding.layers.tpu_embedding import TPUEmbedding
from tpu_embedding.resolved import resolve
from tpu_embedding.sharding import DEFAULT_ROW_THRESHOLD
from tpu_embedding.structure import flatten_with_paths

#: The optimizer of tables of this package that have none (keras-rs'
#: ``TableConfig`` default).
DEFAULT_TABLE_OPTIMIZER = "adam"


@register_serializable
class DistributedEmbedding(TPUEmbedding):
  """keras-rs' ``DistributedEmbedding``, trained on any strategy.

  Replace ``keras_rs.layers.DistributedEmbedding`` by
  ``tpu_embedding.layers.DistributedEmbedding`` and keep the keras-rs
  configs, model, ``compile`` and ``fit``. Create the layer (the model)
  under the strategy's scope.

  Inputs: a nest like ``feature_configs`` of ids, dense ``(B,)`` or
  ``(B, N)`` (``N`` ids per example, all of them used, as keras-rs does),
  ``tf.RaggedTensor`` or ``tf.SparseTensor``; ``weights`` an optional nest
  of per-id weights of the same kinds and shapes. Outputs: dense
  ``(B, dim)`` activations, each example's ids reduced by the table's
  combiner, or ``(B, L, dim)`` for a feature whose ``output_shape`` is
  ``(B, L, dim)``.

  Tables: ``get_embedding_tables()`` (keras-rs' method), and everything
  ``TPUEmbedding`` has (``embedding_tables``, ``table_stores``,
  ``mid_level_api``, ``serving_lookup``). The tables are not Keras weights.

  Example:
    >>> import tensorflow as tf
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.layers import DistributedEmbedding
    >>> table = tpe.TableConfig(10, 2, name="t", combiner="sum",
    ...                         initializer=tpe.RowIdInitializer())
    >>> layer = DistributedEmbedding({"f": tpe.FeatureConfig(table)})
    >>> layer({"f": tf.constant([[1, 2], [3, 4]])})["f"].numpy().tolist()
    [[3.0, 3.0], [7.0, 7.0]]
    >>> layer.table_stores["t"].layout  # one device: the whole table
    'whole'
  """

  def __new__(cls, *args: Any, **kwargs: Any) -> Any:
    """keras-rs' own layer under ``TPUStrategy``; this class elsewhere."""
    if is_tpu_strategy(tf.distribute.get_strategy()):
      return keras_rs_layer(*args, **kwargs)
    return super().__new__(cls, *args, **kwargs)

  def __init__(
    self,
    feature_configs: Any,
    *,
    table_stacking: str | Sequence[str] | Sequence[Sequence[str]] | None = (
      "auto"
    ),
    row_sharding_threshold: int = DEFAULT_ROW_THRESHOLD,
    placements: Mapping[str, str] | None = None,
    **kwargs: Any,
  ):
    """Creates the layer and its tables (under the current strategy).

    Args:
      feature_configs: a nest (dicts, lists, tuples) of
        ``keras_rs.layers.FeatureConfig`` and/or
        ``tpu_embedding.FeatureConfig``. A table's optimizer is a name
        (``"sgd"``, ``"adagrad"``, ``"adam"``, ``"ftrl"``), a
        ``tpu_embedding`` optimizer or whatever
        ``tpu_embedding.layers.keras_optimizers.embedding_optimizer``
        translates;
        this package's tables without one use ``"adam"``, as keras-rs.
      table_stacking: as keras-rs: ``"auto"`` stacks tables of the same
        width, optimizer and placement into one variable each; None stacks
        nothing; lists of table names give the stacks
        (``tpu_embedding.stacking``).
      row_sharding_threshold: with several replicas, ``"auto"`` tables with
        more rows are row-sharded, smaller ones replicated.
      placements: ``{table name: "sparsecore" | "default_device" |
        "auto"}`` for this package's tables (keras-rs tables carry their
        ``placement``; unnamed tables are ``table_<i>``); unlisted tables
        are ``"auto"``.
      **kwargs: Keras layer arguments (``name``, ...).

    Raises:
      ValueError: for an invalid config, placement or optimizer, or
        ``placements`` naming a table the layer does not have.
    """
    translated = keras_rs_configs.translate(feature_configs, placements)
    names = [t.name for t in resolve(translated.feature_config, None).tables]
    unknown = sorted(set(translated.placements) - set(names))
    if unknown:
      raise ValueError(
        f"`placements` names tables {unknown}, which are not among the "
        f"layer's tables {names}."
      )
    super().__init__(
      translated.feature_config,
      DEFAULT_TABLE_OPTIMIZER,
      row_sharding_threshold=keras_rs_configs.placement_policy(
        translated.placements, row_sharding_threshold
      ),
      table_stacking=table_stacking,
      **kwargs,
    )
    self._placements = dict(translated.placements)
    self._threshold = int(row_sharding_threshold)

  @property
  def placements(self) -> dict[str, str]:
    """``{table name: keras-rs placement}``; tables not listed are auto."""
    return dict(self._placements)

  def get_embedding_tables(self) -> dict[str, tf.Tensor]:
    """``{table name: whole [vocabulary_size, dim] value}`` (keras-rs').

    Copies, whatever the layout; use ``embedding_tables`` or
    ``table_stores`` to reach the variables.
    """
    return {
      name: tf.convert_to_tensor(store.read())
      for name, store in self.table_stores.items()
    }

  @tf.autograph.experimental.do_not_convert
  def call(self, inputs: Any, weights: Any = None, training: Any = None) -> Any:
    """Looks up ``inputs``; trains the tables when differentiated.

    Args:
      inputs: a nest of ids with the structure of ``feature_configs``.
      weights: None, or a nest like ``inputs`` of per-id weights.
      training: False to look up without ever updating the tables.

    Returns:
      A nest like ``inputs`` of dense activations.

    Raises:
      ValueError: naming missing or unexpected features.
    """
    self._check_inputs(inputs, weights)
    flat_weights = (
      [None] * len(self._config.features)
      if weights is None
      else tf.nest.flatten(weights)
    )
    pairs = [
      lookup_input(ids, weight, feature)
      for ids, weight, feature in zip(
        tf.nest.flatten(inputs),
        flat_weights,
        self._config.features,
        strict=True,
      )
    ]
    structure = self._config.structure
    ids = tf.nest.pack_sequence_as(structure, [i for i, _ in pairs])
    if weights is not None or any(w is not None for _, w in pairs):
      weights = tf.nest.pack_sequence_as(structure, [w for _, w in pairs])
    return super().call(ids, weights, training=training)

  # --- saving --------------------------------------------------------------

  def get_config(self) -> dict[str, Any]:
    """The constructor arguments, configs as this package's, plain data.

    keras-rs configs are saved translated (with their placements), so a
    model saved with keras-rs configs loads without keras-rs.
    """
    config = super(TPUEmbedding, self).get_config()
    config.update(
      feature_configs=serialize_feature_config(self._config.structure),
      table_stacking=self._table_stacking,
      row_sharding_threshold=self._threshold,
      placements=self.placements,
    )
    return config

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> DistributedEmbedding:
    """Rebuilds the layer from ``get_config``'s output."""
    return cls(
      **serialization.decode_feature_config_argument(config, "feature_configs")
    )


def lookup_input(ids: Any, weight: Any, feature: FeatureConfig) -> Any:
  """``(ids, weight)`` of one feature in the kinds the lookup takes.

  keras-rs uses every entry of a dense ``(B, N)`` input, and weights with
  dense ids; the lookup takes dense ids of one id per example only. Dense
  ids with several ids per example, with weights, or of a sequence
  feature become ``tf.RaggedTensor`` rows of the same values.

  Example:
    >>> import tensorflow as tf
    >>> import tpu_embedding as tpe
    >>> feature = tpe.FeatureConfig(tpe.TableConfig(10, 2))
    >>> ids, weight = lookup_input(tf.constant([[0, 3]]), None, feature)
    >>> ids.to_list(), weight
    ([[0, 3]], None)
  """
  if isinstance(ids, (tf.SparseTensor, tf.RaggedTensor)):
    return ids, weight
  ids = tf.convert_to_tensor(ids)
  rank = ids.shape.rank
  one_id = rank == 1 or (
    rank == 2 and ids.shape[-1] == 1 and not feature.max_sequence_length
  )
  if (weight is None and one_id) or rank not in (1, 2):
    return ids, weight  # Taken as they are (bad ranks raise there).
  if rank == 1:
    ids = ids[:, tf.newaxis]
  ids = tf.RaggedTensor.from_tensor(ids)
  if weight is not None and not isinstance(
    weight, (tf.SparseTensor, tf.RaggedTensor)
  ):
    weight = tf.cast(tf.convert_to_tensor(weight), tf.float32)
    if weight.shape.rank == 1:
      weight = weight[:, tf.newaxis]
    weight = tf.RaggedTensor.from_tensor(weight)
  return ids, weight


def keras_rs_layer(
  feature_configs: Any,
  *,
  table_stacking: Any = "auto",
  row_sharding_threshold: int = DEFAULT_ROW_THRESHOLD,
  placements: Mapping[str, str] | None = None,
  **kwargs: Any,
) -> Any:
  """keras-rs' ``DistributedEmbedding`` for the same arguments (on TPU).

  keras-rs places the tables itself; ``row_sharding_threshold`` and
  ``placements`` concern this package's layouts and are not passed on.
  This package's feature configs become TensorFlow's
  (``to_tf_feature_config``), which keras-rs puts on SparseCore.

  Raises:
    ImportError: if keras-rs is not installed.
    ValueError: for a nest mixing keras-rs configs and this package's.
  """
  del row_sharding_threshold, placements  # Off-TPU layouts only.
  try:
    keras_rs = importlib.import_module("keras_rs")  # Optional: no stubs.
  except ImportError as e:
    raise ImportError(
      "Under TPUStrategy, tpu_embedding.layers.DistributedEmbedding is "
      "keras-rs' own layer (SparseCore tables): install keras-rs "
      "(`pip install keras-rs`), or use tpu_embedding.layers.TPUEmbedding, "
      "which runs TensorFlow's TPU embedding directly."
    ) from e
  return keras_rs.layers.DistributedEmbedding(
    for_keras_rs(feature_configs), table_stacking=table_stacking, **kwargs
  )


def for_keras_rs(feature_configs: Any) -> Any:
  """The nest with this package's ``FeatureConfig`` as TensorFlow's.

  keras-rs takes a nest of its own configs or one of TensorFlow's;
  features sharing one of our tables share one TensorFlow table.

  Example:
    >>> import tpu_embedding as tpe
    >>> t = tpe.TableConfig(10, 2, name="t")
    >>> tf_features = for_keras_rs([tpe.FeatureConfig(t), tpe.FeatureConfig(t)])
    >>> tf_features[0].table is tf_features[1].table, tf_features[0].table.name
    (True, 't')
  """
  flat = [leaf for _, leaf in flatten_with_paths(feature_configs)]
  ours = [i for i, leaf in enumerate(flat) if isinstance(leaf, FeatureConfig)]
  if 0 < len(ours) < len(flat):
    raise ValueError(
      "Under TPUStrategy, DistributedEmbedding is keras-rs' layer, which "
      "takes keras-rs configs or TensorFlow's, not a mix: pass only "
      "keras_rs.layers.FeatureConfig or only tpu_embedding.FeatureConfig."
    )
  if ours:
    optimizer = embedding_optimizer(DEFAULT_TABLE_OPTIMIZER)
    translated = to_tf_feature_config([flat[i] for i in ours], optimizer)
    for i, tf_feature in zip(ours, translated, strict=True):
      flat[i] = tf_feature
  return tf.nest.pack_sequence_as(feature_configs, flat)
