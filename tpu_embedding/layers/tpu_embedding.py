"""``TPUEmbedding``: the mid-level API as a Keras layer that trains in ``fit``.

The tensorflow-recommenders layer (``tfrs.layers.embedding.TPUEmbedding``)
on every strategy this package supports. The tables are updated by their
own per-table optimizers, sparsely and with TPU semantics; the rest of the
model by the Keras optimizer given to ``model.compile``.

How the tables train inside ``model.fit``: the layer owns one scalar
trainable weight (``tpu_embedding_helper_dummy``, always 0) and returns its
activations through a ``tf.custom_gradient`` op whose only input is that
weight. Keras differentiates the loss with respect to its trainable weights,
so backpropagation reaches the op; its gradient function hands the
gradients of the activations to the mid-level object, which applies each
table's optimizer to the looked-up rows, and returns a zero gradient for the
dummy weight. The table variables are not Keras weights at all, so Keras'
optimizer never sees them. Nothing differentiates in ``predict`` or
``evaluate`` (Keras calls the layer with ``training=False``, which looks up
without the gradient hook), so inference never changes a table.

Example:
  >>> import numpy as np
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.layers import TPUEmbedding
  >>> keras = tf.keras
  >>> table = tpe.TableConfig(100, 4, name="items",
  ...                         initializer=tf.zeros_initializer())
  >>> layer = TPUEmbedding({"item": tpe.FeatureConfig(table)}, "sgd")
  >>> ids = keras.Input(shape=(), dtype="int64", name="item")
  >>> score = keras.layers.Dense(1)(layer({"item": ids})["item"])
  >>> model = keras.Model({"item": ids}, score)
  >>> model.compile(optimizer="adam", loss="mse")
  >>> _ = model.fit({"item": np.array([3, 5])}, np.ones((2, 1)), verbose=0)
  >>> rows = layer.embedding_tables[table].numpy()
  >>> bool(np.any(rows[3] != 0)), bool(np.all(rows[4] == 0))
  (True, True)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from tpu_embedding.checkpointing.parts import escaped
from tpu_embedding.embedding import TPUEmbeddingV3
from tpu_embedding.layers import serialization
from tpu_embedding.layers.base import EmbeddingLayer
from tpu_embedding.layers.keras_compat import register_serializable
from tpu_embedding.layers.keras_optimizers import embedding_optimizer
from tpu_embedding.resolved import resolve
from tpu_embedding.sharding import DEFAULT_ROW_THRESHOLD
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.stacking import TableStacking
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.base import checkpoint_name
from tpu_embedding.types import FeatureConfigNest
from tpu_embedding.types import FeatureNest
from tpu_embedding.types import WeightsNest

#: The dummy weight's name (tensorflow-recommenders' name for it).
DUMMY_NAME = "tpu_embedding_helper_dummy"


@register_serializable
class TPUEmbedding(EmbeddingLayer):
  """A Keras layer looking up, and training, ``tpu_embedding`` tables.

  A drop-in for ``tfrs.layers.embedding.TPUEmbedding`` that trains on the
  default strategy, ``OneDeviceStrategy``, ``MirroredStrategy`` and
  ``MultiWorkerMirroredStrategy`` (tables row-sharded over the replicas)
  inside ``model.fit``/``evaluate``/``predict`` and custom loops. Call it on
  a nest of ids (dense, sparse or ragged) matching ``feature_config``; it
  returns the activations in the same nest, with TPU shapes and combiners.

  Training: the loss' gradients with respect to the activations update the
  looked-up rows with each table's optimizer (the table's own, else the
  layer's), whenever Keras differentiates with respect to the layer's
  trainable weights: ``model.fit``, or a custom loop's
  ``tape.gradient(loss, model.trainable_variables)`` (call the model with
  ``training=True``, or leave ``training`` unset). ``training=False``
  (``predict``, ``evaluate``) never updates. Freezing the layer
  (``layer.trainable = False``) freezes the tables. The tables are not Keras
  weights: ``layer.weights`` holds only the dummy scalar the gradient hook
  needs; reach the tables with ``embedding_tables`` or ``mid_level_api``.

  Strategies: create the model under the strategy's scope. Under
  ``MirroredStrategy``, training lookups must run in replica context
  (``model.fit`` does so); lookups outside ``strategy.run`` work for
  inference. Keras 3's own ``fit`` fails for every model on a
  multi-worker ``MultiWorkerMirroredStrategy``, and on ragged or sparse
  inputs under any mirrored strategy; creating this layer under one
  installs a hook that fixes the models holding it
  (``tpu_embedding.layers.distributed_fit``).

  Saving: ``tf.train.Checkpoint(model=model)`` saves the tables under
  TensorFlow's keys (``.../_tpu_embedding/<table>``, as the
  tensorflow-recommenders layer); ``model.save("m.keras")`` stores every
  table and slot whole, restored by ``keras.models.load_model`` into any
  strategy. ``get_config`` describes the feature config as plain data (see
  ``tpu_embedding.layers.serialization`` for what can be saved).

  Serving: ``serving_lookup`` (or ``call(..., serving_config=...)``) looks up
  any subset of the features with the current tables, with TensorFlow's
  serving semantics, outside any training step.

  Example:
    >>> import tensorflow as tf
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.layers import TPUEmbedding
    >>> users = tpe.TableConfig(10, 2, name="users", combiner="sum",
    ...                         initializer=tpe.RowIdInitializer())
    >>> layer = TPUEmbedding({"user": tpe.FeatureConfig(users)},
    ...                      tpe.Adagrad(0.1))
    >>> out = layer({"user": tf.ragged.constant([[1, 2], [3]])})
    >>> out["user"].numpy().tolist()
    [[3.0, 3.0], [3.0, 3.0]]
  """

  def __init__(
    self,
    feature_config: FeatureConfigNest,
    optimizer: Any,
    pipeline_execution_with_tensor_core: bool = False,
    batch_size: int | None = None,
    embedding_feature: Any = None,
    *,
    row_sharding_threshold: int | PlacementPolicy = DEFAULT_ROW_THRESHOLD,
    table_stacking: TableStacking = "auto",
    **kwargs: Any,
  ):
    """Creates the layer and its tables (under the current strategy).

    Args:
      feature_config: a nest of ``tpu_embedding.FeatureConfig`` (or of
        TensorFlow's ``tf.tpu.experimental.embedding.FeatureConfig``, see
        ``tf_configs``).
      optimizer: the optimizer of tables without one of their own:
        ``"sgd"``, ``"adagrad"``, ``"adam"`` or ``"ftrl"`` (default
        hyper-parameters, Keras' learning rates); a Keras ``SGD``,
        ``Adagrad``, ``Adam`` or ``Ftrl`` (Keras 3, tf-keras or tf-keras
        legacy), translated with its hyper-parameters (see
        ``keras_optimizers``; a learning rate schedule follows the Keras
        optimizer's ``iterations``); an instance of ``tpu_embedding.SGD``,
        ``Adagrad``, ``AdagradMomentum``, ``Adam`` or ``FTRL`` (or
        TensorFlow's); or None (lookups only).
      pipeline_execution_with_tensor_core: passed to the mid-level object
        (see ``TPUEmbeddingV3``).
      batch_size: accepted for compatibility; output shapes follow each
        batch, so it is not needed.
      embedding_feature: TPU hardware selection of the tensorflow-
        recommenders layer; accepted and ignored.
      row_sharding_threshold: under ``MirroredStrategy``, tables with more
        rows are row-sharded over the replicas, smaller ones replicated (a
        ``tpu_embedding.sharding.PlacementPolicy``, or ``RowThreshold``,
        also fixes the placement of the tables it names).
      table_stacking: off TPU, which tables are held and updated as one
        (``"auto"``, None or lists of table names; see
        ``tpu_embedding.stacking``).
      **kwargs: Keras layer arguments (``name``, ...).

    Raises:
      ValueError: for an invalid feature config or optimizer.
    """
    del embedding_feature
    super().__init__(**kwargs)
    self._optimizer = embedding_optimizer(optimizer)
    feature_config = self._tf_configs.feature_config(feature_config)
    # A frozen dataclass: Keras does not wrap (and track) the user's nest.
    self._config = resolve(feature_config, self._optimizer)
    self._pipeline_execution_with_tensor_core = (
      pipeline_execution_with_tensor_core
    )
    self._batch_size = batch_size
    self._row_sharding_threshold = row_sharding_threshold
    self._table_stacking = table_stacking
    self._single_device = not tf.distribute.has_strategy() or isinstance(
      self._strategy, tf.distribute.OneDeviceStrategy
    )
    # Tracked as "_tpu_embedding": checkpoint keys as in tensorflow-
    # recommenders' layer.
    self._tpu_embedding = TPUEmbeddingV3(
      feature_config,
      self._optimizer,
      pipeline_execution_with_tensor_core,
      row_sharding_threshold=row_sharding_threshold,
      table_stacking=table_stacking,
    )
    self._tpu_embedding.build()
    self._dummy = self.add_weight(
      name=DUMMY_NAME,
      shape=(),
      dtype="float32",
      initializer="zeros",
      trainable=True,
    )
    self.built = True

  # --- properties ----------------------------------------------------------

  @property
  def mid_level_api(self) -> TPUEmbeddingV3:
    """The ``tpu_embedding.TPUEmbedding`` object holding the tables."""
    return self._tpu_embedding

  @property
  def embedding_tables(self) -> dict[Any, Any]:
    """``{TableConfig: table variable}``, keyed by the user's configs."""
    return {
      self._tf_configs.user_table(table): variable
      for table, variable in self._tpu_embedding.embedding_tables.items()
    }

  @property
  def table_stores(self) -> dict[str, TableStore]:
    """``{table name: TableStore}``: the tables in one interface."""
    return self._tpu_embedding.table_stores

  @property
  def vocabulary_states(self) -> dict[str, Any]:
    """``{table name: VocabularyState}`` of the dynamic tables."""
    return self._tpu_embedding.vocabulary_states

  # --- calls ---------------------------------------------------------------

  @tf.autograph.experimental.do_not_convert
  def call(
    self,
    features: FeatureNest,
    weights: WeightsNest | None = None,
    serving_config: Any = None,
    training: Any = None,
  ) -> Any:
    """Looks up ``features``; trains the tables when differentiated.

    Args:
      features: a nest of id tensors (``tf.Tensor``, ``tf.SparseTensor``,
        ``tf.RaggedTensor``) with the structure of ``feature_config``. A
        scalar id gives its row (``[dim]``); a rank-1 ``SparseTensor`` is
        one id (or none) per example (see ``keras_inputs.batch_lone_ids``).
      weights: None, or a nest like ``features`` of per-id weights.
      serving_config: if given, a serving lookup instead (see
        ``serving_lookup``).
      training: False to look up without ever updating the tables.

    Returns:
      A nest like ``features`` of activations.

    Raises:
      ValueError: naming missing or unexpected features.
      RuntimeError: when called under another strategy than the layer was
        created under, or training under ``MirroredStrategy`` outside
        ``strategy.run``.
    """
    if serving_config is not None:
      return self.serving_lookup(features, weights, serving_config)

    def look_up(features: Any, weights: Any) -> Any:
      if self._updates_tables(training):
        return self._lookup_with_gradient_hook(features, weights)
      return self._tpu_embedding(features, weights)

    return self._look_up(features, weights, look_up)

  def _updates_tables(self, training: Any) -> bool:
    """Whether this call installs the gradient hook that updates tables."""
    if not self.trainable:
      return False
    if tf.is_tensor(training):
      training = tf.get_static_value(training)
    context = tf.distribute.get_replica_context()
    in_replica = context is not None and context.strategy is self._strategy
    can_update = self._single_device or in_replica
    if training is None:
      return can_update
    if training and not can_update:
      raise RuntimeError(
        f"Layer '{self.name}' holds tables sharded by "
        f"{type(self._strategy).__name__}: training lookups must run inside "
        "`strategy.run` (model.fit does this). Call it with training=False "
        "for lookups outside."
      )
    return bool(training)

  def _lookup_with_gradient_hook(self, features: Any, weights: Any) -> Any:
    activations, apply_gradients = self._tpu_embedding.lookup_for_training(
      features, weights
    )
    structure = self._config.structure

    @tf.custom_gradient
    def gradient_hook(dummy):
      def grad(*activation_grads, variables=None):
        apply_gradients(
          tf.nest.pack_sequence_as(structure, list(activation_grads))
        )
        return tf.zeros_like(dummy), [None] * len(variables or ())

      return tf.nest.flatten(activations), grad

    flat = gradient_hook(tf.convert_to_tensor(self._dummy))
    return tf.nest.pack_sequence_as(structure, flat)

  # --- saving --------------------------------------------------------------

  def get_config(self) -> dict[str, Any]:
    """The constructor arguments, feature configs as plain data.

    Raises:
      ValueError: for configs that cannot be saved (see
        ``tpu_embedding.layers.serialization``).
    """
    config = super().get_config()
    config.update(
      serialization.encode_layer_arguments(
        self._config.structure, self._optimizer, self.name
      ),
      pipeline_execution_with_tensor_core=(
        self._pipeline_execution_with_tensor_core
      ),
      batch_size=self._batch_size,
      row_sharding_threshold=serialization.serialize_row_threshold(
        self._row_sharding_threshold
      ),
      table_stacking=self._table_stacking,
    )
    return config

  @classmethod
  def from_config(cls, config: dict[str, Any]) -> TPUEmbedding:
    """Rebuilds the layer from ``get_config``'s output."""
    return cls(**serialization.decode_layer_arguments(config))

  def save_own_variables(self, store: Any) -> None:
    """Saves every table and slot whole (Keras ``model.save``), and a
    16-bit table's update count (``<table>.Supdate_count``: the step of
    its stochastic rounding, so a loaded model trains on as the saved
    one would have)."""
    for key, (table_store, slot) in self._weights_file_keys().items():
      store[key] = np.asarray(table_store.read(slot))
    for key, table_store in self._update_count_keys().items():
      store[key] = np.asarray(table_store.update_count(), np.int64)

  def load_own_variables(self, store: Any) -> None:
    """Restores every table and slot (Keras ``load_model``).

    Raises:
      ValueError: naming the tables or slots ``store`` lacks (nothing is
        written then).
    """
    wanted = self._weights_file_keys()
    missing = sorted(key for key in wanted if key not in store)
    if missing:
      raise ValueError(
        f"Layer '{self.name}': the saved weights lack the tables or slots "
        f"{missing}; they hold {sorted(store.keys())}. Was the model "
        "saved with the same feature config and optimizers?"
      )
    for key, (table_store, slot) in wanted.items():
      table_store.assign(np.asarray(store[key]), slot)
    for key, table_store in self._update_count_keys().items():
      # (a file saved before counts were: from 0)
      table_store.set_update_count(
        int(np.asarray(store[key])) if key in store else 0
      )
    self.mid_level_api.discard_held_update()

  def _update_count_keys(self) -> dict[str, TableStore]:
    """``{Keras weights-file key: store}`` of the tables that count
    their updates (``<table>.Supdate_count``)."""
    return {
      escaped(checkpoint_name(name, "update_count")): table
      for name, table in self.table_stores.items()
      if table.counts_updates
    }

  def _weights_file_keys(self) -> dict[str, tuple[TableStore, str]]:
    """``{Keras weights-file key: (store, slot)}`` of every table and slot.

    TensorFlow's checkpoint escaping: ``t`` and ``t.Saccumulators``.
    """
    return {
      escaped(checkpoint_name(name, slot)): (table_store, slot)
      for name, table_store in self.table_stores.items()
      for slot in table_store.keys
    }
