"""``EmbeddingLayer``: what every layer here is, whatever holds its tables.

A Keras layer over a resolved feature config (``_config``), bound to the
strategy it is created under (which readies Keras' ``fit`` for it, see
``distributed_fit``). It checks each call's features, including Keras 3's
calls to infer the output (``compute_output_spec``), brings Keras' inputs to
the lookup's terms (``keras_inputs``), and serves lookups from its
``table_stores``. ``TPUEmbedding``, ``PartialTPUEmbedding`` and
``ReplicatedEmbedding`` differ only in where their tables live and how
they train.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.layers import ReplicatedEmbedding
  >>> table = tpe.TableConfig(10, 2, initializer=tpe.RowIdInitializer())
  >>> layer = ReplicatedEmbedding({"a": tpe.FeatureConfig(table)}, name="e")
  >>> layer.serving_lookup({"a": tf.constant([3])})["a"].numpy().tolist()
  [[3.0, 3.0]]
  >>> check_structure({"a": 0}, {"b": 0}, "e", "features")
  Traceback (most recent call last):
  ...
  ValueError: Layer 'e': ... missing feature(s) ['a']; unexpected feature(s) ...
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tpu_embedding.layers import distributed_fit
from tpu_embedding.layers import keras_inputs
from tpu_embedding.layers import tf_configs
from tpu_embedding.layers.keras_compat import Layer
from tpu_embedding.layers.keras_compat import in_symbolic_call
from tpu_embedding.replicas import compiles_with_xla
from tpu_embedding.resolved import ResolvedConfig
from tpu_embedding.resolved import table_name
from tpu_embedding.serving import lookup_with_readers
from tpu_embedding.structure import flatten_with_paths
from tpu_embedding.structure import structure_difference
from tpu_embedding.tables.base import TableStore
from tpu_embedding.types import FeatureNest
from tpu_embedding.types import WeightsNest


@distributed_fit.fixes_models_holding
class EmbeddingLayer(Layer):
  """The base of the layers: a strategy, checked calls, serving lookups.

  Subclasses set ``_config`` and define ``table_stores``. ``call`` takes the
  features first and ``weights`` (and ``serving_config``) by those names.
  """

  _config: ResolvedConfig

  def __init__(self, **kwargs: Any):
    super().__init__(**kwargs)
    # Under a mirrored strategy, installs the hook that fixes Keras 3's
    # ``model.fit`` for the models holding our layers (``distributed_fit``).
    self._strategy = tf.distribute.get_strategy()
    distributed_fit.install_for_layers(self._strategy)
    # Keras compiles with XLA where our steps do (replicas.py).
    self.supports_jit = compiles_with_xla(self._strategy)
    self._tf_configs = tf_configs.FromTFConfigs()
    self._input_kinds = keras_inputs.InputKinds()

  @property
  def table_stores(self) -> dict[str, TableStore]:
    """``{table name: TableStore}``: the tables in one interface."""
    raise NotImplementedError

  def compute_output_spec(self, *args: Any, **kwargs: Any) -> Any:
    """Keras 3's output inference, after the features' structure is checked.

    Keras 3 puts any error of the call it infers the output with under
    "Could not automatically infer the output shape", which reads as a
    fault of the layer: checked here first, a missing or unexpected
    feature is one line.
    """
    try:
      given = inspect.signature(self.call).bind(*args, **kwargs)
    except TypeError:
      given = None  # Keras reports a wrong call itself.
    if given is not None and given.arguments.get("serving_config") is None:
      features, *_ = given.arguments.values()
      self._check_inputs(features, given.arguments.get("weights"))
    return super().compute_output_spec(*args, **kwargs)

  def _check_inputs(self, features: Any, weights: Any) -> None:
    """Checks a call's ``features`` (and ``weights``, if given) structure."""
    check_structure(self._config.structure, features, self.name, "features")
    if weights is not None:
      check_structure(self._config.structure, weights, self.name, "weights")

  def _check_strategy(self) -> None:
    """Raises a RuntimeError if called under another strategy's scope."""
    current = tf.distribute.get_strategy()
    if tf.distribute.has_strategy() and current is not self._strategy:
      raise RuntimeError(
        f"Layer '{self.name}' was created under "
        f"{type(self._strategy).__name__} but is called under "
        f"{type(current).__name__}. Create the model (and so this layer) "
        "inside the `strategy.scope()` it is trained and run with."
      )

  def _look_up(
    self, features: Any, weights: Any, look_up: Callable[[Any, Any], Any]
  ) -> Any:
    """``look_up(features, weights)``, checked, on ids the lookup takes.

    Lone ids are batched and their activations unbatched; a Keras symbolic
    call gets zeros of the right shapes, without looking up
    (``keras_inputs``).
    """
    self._check_inputs(features, weights)
    features, weights, scalar = keras_inputs.batch_lone_ids(features, weights)
    if in_symbolic_call():
      activations = keras_inputs.symbolic_activations(
        features, self._config, self._input_kinds
      )
    else:
      self._input_kinds.record(features, self._config, symbolic=False)
      self._check_strategy()
      activations = look_up(features, weights)
    return keras_inputs.unbatch_scalars(activations, scalar)

  def serving_lookup(
    self,
    features: FeatureNest,
    weights: WeightsNest | None = None,
    serving_config: Any = None,
  ) -> Any:
    """Serving lookups of any subset of the features, current tables.

    ``tpu_embedding.serving_embedding_lookup`` on this layer's tables:
    TensorFlow's serving semantics, no gradient hook, no collectives.

    Args:
      features: a nest of ids whose paths are a subset of
        ``serving_config``'s.
      weights: None, or per-id weights like ``features``.
      serving_config: a nest of ``FeatureConfig`` using this layer's
        ``TableConfig`` objects; defaults to the layer's feature config.

    Returns:
      A nest like ``features`` of activations.

    Raises:
      ValueError: for unknown features, or tables not the layer's.
    """
    serving_config = self._tf_configs.feature_config(serving_config)
    if serving_config is None:
      serving_config = self._config.structure
    stores = self.table_stores
    readers = {
      user: stores[table_name(table)].peek
      for user, table in zip(
        self._config.user_tables, self._config.tables, strict=True
      )
    }
    for path, feature in flatten_with_paths(serving_config):
      if feature.table not in readers:
        raise ValueError(
          f"Layer '{self.name}': serving_config feature {path!r} uses a "
          f"TableConfig ({feature.table!r}) that is not one of the layer's; "
          "build serving configs from the same TableConfig objects."
        )
    return lookup_with_readers(features, weights, readers, serving_config)


def check_structure(expected: Any, given: Any, layer: str, what: str) -> None:
  """Raises a ValueError naming the missing and unexpected features.

  Args:
    expected: the feature config nest.
    given: the nest passed to the layer.
    layer: the layer's name.
    what: ``"features"`` or ``"weights"``.

  Raises:
    ValueError: if the nests differ.
  """
  try:
    tf.nest.assert_same_structure(expected, given, expand_composites=False)
  except (ValueError, TypeError) as e:
    want = [p for p, _ in flatten_with_paths(expected)]
    raise ValueError(
      f"Layer '{layer}': the {what} passed do not match its feature config: "
      f"{structure_difference(expected, given, e)}. Expected the features "
      f"{want}."
    ) from None
