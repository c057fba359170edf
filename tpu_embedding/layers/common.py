"""What the Keras layers share: optimizers, checks, tables, saving.

Example:
  >>> import tensorflow as tf
  >>> from tpu_embedding.layers.common import embedding_optimizer
  >>> embedding_optimizer("adagrad")
  Adagrad(learning_rate=0.001)
  >>> embedding_optimizer(tf.keras.optimizers.Adam(0.01, beta_1=0.8))
  Adam(learning_rate=0.01, beta_1=0.8)
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from tpu_embedding import optimizers
from tpu_embedding.inputs import prepare_feature
from tpu_embedding.layers import distributed_fit
from tpu_embedding.layers import keras_optimizers
from tpu_embedding.layers import tf_configs
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.resolved import ResolvedConfig
from tpu_embedding.resolved import table_name
from tpu_embedding.serving import lookup_with_readers
from tpu_embedding.structure import flatten_with_paths
from tpu_embedding.structure import structure_difference
from tpu_embedding.tables.base import TableStore

#: Optimizer names the layers accept, with Keras' default learning rates
#: (the defaults of these classes): sgd 0.01, the others 0.001.
OPTIMIZER_NAMES = {
  "sgd": optimizers.SGD,
  "adagrad": optimizers.Adagrad,
  "adam": optimizers.Adam,
  "ftrl": optimizers.FTRL,
}


def embedding_optimizer(optimizer: Any) -> Optimizer | None:
  """The embedding optimizer for whatever a layer's ``optimizer`` may be.

  Args:
    optimizer: ``"sgd"``, ``"adagrad"``, ``"adam"``, ``"ftrl"`` (default
      hyper-parameters); a Keras ``SGD``, ``Adagrad``, ``Adam`` or ``Ftrl``
      (Keras 3, tf-keras or tf-keras legacy; translated by
      ``keras_optimizers``); one of TensorFlow's TPU embedding optimizers
      (rebuilt by ``tf_configs``); an instance of this package's
      optimizers; or None (lookups only).

  Returns:
    The optimizer object (None for None).

  Raises:
    ValueError: for an unknown name, a Keras optimizer or argument with no
      embedding equivalent, or another type.
  """
  if optimizer is None or isinstance(optimizer, Optimizer):
    return optimizer
  if isinstance(optimizer, str):
    if optimizer.lower() not in OPTIMIZER_NAMES:
      raise ValueError(
        f"Unknown optimizer name '{optimizer}'. Please use one of "
        f"{sorted(OPTIMIZER_NAMES)}, a Keras SGD, Adagrad, Adam or Ftrl, or "
        "an optimizer object such as tpu_embedding.Adagrad(0.1)."
      )
    return OPTIMIZER_NAMES[optimizer.lower()]()
  if keras_optimizers.is_keras_optimizer(optimizer):
    return keras_optimizers.to_embedding_optimizer(optimizer)
  if tf_configs.is_tf_optimizer(optimizer):
    return tf_configs.from_tf_optimizer(optimizer)
  raise ValueError(
    f"{type(optimizer)} is not an embedding optimizer. Pass "
    f"{keras_optimizers.ACCEPTED}."
  )


# --- checks -----------------------------------------------------------------


class ChecksStructureFirst:
  """A layer mixin: a call's feature structure is checked before Keras 3
  infers the call's output.

  A functional model calls a layer on ``keras.Input``s to infer its
  output; Keras 3 puts any error of that call under "Could not
  automatically infer the output shape", which reads as a fault of the
  layer. Checked here first, a missing or unexpected feature is the one
  line ``check_inputs`` gives. The layer's ``call`` takes the features
  first and ``weights`` (and ``serving_config``) by those names.
  """

  _config: ResolvedConfig
  name: str

  def compute_output_spec(self, *args: Any, **kwargs: Any) -> Any:
    try:
      given = inspect.signature(self.call).bind(*args, **kwargs)  # type: ignore[attr-defined]
    except TypeError:
      given = None  # Keras reports a wrong call itself.
    if given is not None and given.arguments.get("serving_config") is None:
      features, *_ = given.arguments.values()
      weights = given.arguments.get("weights")
      check_inputs(self._config.structure, features, weights, self.name)
    return super().compute_output_spec(*args, **kwargs)  # type: ignore[misc]


def check_inputs(structure: Any, features: Any, weights: Any, layer: str):
  """Checks a call's ``features`` (and ``weights``, if given) structure."""
  check_structure(structure, features, layer, "features")
  if weights is not None:
    check_structure(structure, weights, layer, "weights")


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


def creation_strategy() -> tf.distribute.Strategy:
  """The strategy a layer is being created under; readies Keras for it.

  Under MirroredStrategy and MultiWorkerMirroredStrategy (Keras 3) this
  installs the hook that fixes ``model.fit`` across workers and on ragged or
  sparse ids for the models holding our layers, other models keeping Keras'
  own (see ``distributed_fit``; logged once, undone by
  ``disable_distributed_fit``).
  """
  strategy = tf.distribute.get_strategy()
  distributed_fit.install_for_layers(strategy)
  return strategy


def check_strategy(created: tf.distribute.Strategy, layer: str) -> None:
  """Raises a RuntimeError if called under another strategy's scope."""
  current = tf.distribute.get_strategy()
  if tf.distribute.has_strategy() and current is not created:
    raise RuntimeError(
      f"Layer '{layer}' was created under {type(created).__name__} but is "
      f"called under {type(current).__name__}. Create the model (and so "
      "this layer) inside the `strategy.scope()` it is trained and run "
      "with."
    )


# --- ids the mid-level API does not take -----------------------------------


def _is_scalar_id(inp: Any) -> bool:
  if isinstance(inp, (int, np.integer)) and not isinstance(inp, bool):
    return True
  return isinstance(inp, tf.Tensor) and inp.shape.rank == 0


def batch_lone_ids(features: Any, weights: Any) -> tuple[Any, Any, list[bool]]:
  """Scalar ids as a batch of one; rank-1 sparse ids as one id per example.

  tensorflow-recommenders' layers (off TPU) and ``keras.layers.Embedding``
  take both; the mid-level API needs a batch dimension, and for sparse ids
  an id dimension:

  - a scalar id ``i`` (a Python int or a rank-0 tensor) becomes ``[i]``;
    ``unbatch_scalars`` turns its ``[1, dim]`` activation back into
    ``[dim]``: row ``i`` of the table, as TensorFlow's serving lookup;
  - a rank-1 ``SparseTensor`` of dense shape ``[n]`` (tf-keras' placeholder
    for ``Input(shape=(), sparse=True)``) becomes ``[n, 1]``: example
    ``b`` has the id at position ``b``, or none (zeros).

  Args:
    features: a nest of ids (already checked against the feature config).
    weights: None or a nest like ``features``.

  Returns:
    ``(features, weights, scalar)``; ``scalar`` flags, in
    ``tf.nest.flatten`` order, the features that were scalars.

  Example:
    >>> import tensorflow as tf
    >>> ids, _, scalar = batch_lone_ids({"a": 3, "b": tf.constant([1, 2])},
    ...                                 None)
    >>> ids["a"].numpy().tolist(), scalar
    ([3], [True, False])
  """
  flat = tf.nest.flatten(features, expand_composites=False)
  flat_weights = (
    [None] * len(flat)
    if weights is None
    else tf.nest.flatten(weights, expand_composites=False)
  )
  scalar = [_is_scalar_id(inp) for inp in flat]
  new_ids, new_weights = [], []
  for inp, weight, is_scalar in zip(flat, flat_weights, scalar, strict=True):
    if is_scalar:
      inp = tf.reshape(inp, [1])
    elif isinstance(inp, tf.SparseTensor) and inp.shape.rank == 1:
      inp = tf.sparse.expand_dims(inp, -1)
      if isinstance(weight, tf.SparseTensor) and weight.shape.rank == 1:
        weight = tf.sparse.expand_dims(weight, -1)
    new_ids.append(inp)
    new_weights.append(weight)
  features = tf.nest.pack_sequence_as(features, new_ids)
  if weights is not None:
    weights = tf.nest.pack_sequence_as(weights, new_weights)
  return features, weights, scalar


def unbatch_scalars(activations: Any, scalar: list[bool]) -> Any:
  """``[1, ...]`` activations of scalar ids as ``[...]`` (see above)."""
  if not any(scalar):
    return activations
  flat = tf.nest.flatten(activations)
  flat = [
    tf.squeeze(out, 0) if is_scalar else out
    for out, is_scalar in zip(flat, scalar, strict=True)
  ]
  return tf.nest.pack_sequence_as(activations, flat)


# --- activations for Keras' shape inference -----------------------------------


class InputKinds:
  """What kind of ids a layer has been given, per feature.

  Keras 3 traces layers with stand-ins: dense placeholders for sparse and
  ragged inputs too (building a model from a batch of data), or the mean
  of the first batch over the replicas (float ids). A dense ``[batch, n]``
  stand-in (``n != 1``) is then ambiguous: ids combined per example
  (``[batch, dim]``) or dense multi-hot ids (``[batch, n, dim]``). The
  layer records what it is really given and resolves the ambiguity so:

  * a feature seen sparse or ragged: combined;
  * a feature seen as real dense multi-hot ids: multi-hot;
  * a mean (floats) or an unknown ``n``: combined;
  * a placeholder without a batch size
    (``keras.Input(shape=(n,), dtype="int64")``): multi-hot;
  * otherwise (Keras building a model from a batch before any call):
    combined, the TPU rule. A model whose first call would be such a build
    with dense multi-hot ids must be built by calling it on a batch first.
  """

  def __init__(self) -> None:
    self.combined: set[str] = set()
    self.multi_hot: set[str] = set()

  def record(
    self, features: Any, config: ResolvedConfig, symbolic: bool
  ) -> None:
    """Remembers the kinds of ids given (dense only from real calls)."""
    for inp, path in zip(
      tf.nest.flatten(features, expand_composites=False),
      config.paths,
      strict=True,
    ):
      if isinstance(inp, (tf.SparseTensor, tf.RaggedTensor)):
        self.combined.add(path)
      elif not symbolic and _several_ids(inp):
        self.multi_hot.add(path)

  def stands_for_combined(self, inp: Any, path: str) -> bool:
    """Whether a dense stand-in with several ids per row is combined."""
    if path in self.combined:
      return True
    if path in self.multi_hot:
      return False
    if not inp.dtype.is_integer or inp.shape[-1] is None:
      return True
    return inp.shape[0] is not None


def _several_ids(inp: Any) -> bool:
  """A dense tensor with a last dimension other than 1 (rank 2 or more)."""
  shape = inp.shape
  return isinstance(inp, tf.Tensor) and (shape.rank or 0) > 1 and shape[-1] != 1


def _symbolic_ids(inp: Any, path: str, kinds: InputKinds) -> Any:
  """What Keras' shape tracing passes, as ids of the kind it stands for."""
  combined = _several_ids(inp) and kinds.stands_for_combined(inp, path)
  if not inp.dtype.is_integer:
    inp = tf.cast(inp, tf.int64)
  return tf.sparse.from_dense(inp) if combined else inp


def symbolic_activations(
  features: Any, config: ResolvedConfig, kinds: InputKinds
) -> Any:
  """Zero activations of the right shapes, without looking anything up.

  Used while Keras traces a layer only for its output shapes (see
  ``InputKinds``).
  """
  kinds.record(features, config, symbolic=True)
  outputs = []
  for inp, feature, path in zip(
    tf.nest.flatten(features, expand_composites=False),
    config.features,
    config.paths,
    strict=True,
  ):
    prepared = prepare_feature(
      _symbolic_ids(inp, path, kinds),
      None,
      feature,
      path,
      check_ids=False,
    )
    zeros = tf.zeros(
      tf.concat([prepared.output_shape, [feature.table.dim]], axis=0)
    )
    zeros.set_shape(prepared.static_shape.concatenate([feature.table.dim]))
    outputs.append(zeros)
  return tf.nest.pack_sequence_as(config.structure, outputs)


# --- table values -------------------------------------------------------------


def full_value(variable: Any) -> np.ndarray:
  """The whole ``[vocabulary_size, dim]`` value of any table variable.

  Every layout's variable converts to its whole value (see
  ``tpu_embedding.tables``).
  """
  return np.asarray(tf.convert_to_tensor(variable))


def store_key(table: str, slot: str) -> str:
  """The Keras weights-file key of a table (``slot="parameters"``) or slot.

  TensorFlow's checkpoint escaping: ``t`` and ``t.Saccumulators``.
  """
  name = table.replace(".", "..").replace("/", ".S")
  return name if slot == "parameters" else f"{name}.S{slot}"


def save_tables(stores: Mapping[str, TableStore], weights_store: Any) -> None:
  """Writes every table and slot, whole, into a Keras weights store."""
  for name, table_store in stores.items():
    for key in table_store.keys:
      weights_store[store_key(name, key)] = np.asarray(table_store.read(key))


def load_tables(
  stores: Mapping[str, TableStore], weights_store: Any, layer: str
) -> None:
  """Restores every table and slot from a Keras weights store.

  Raises:
    ValueError: naming the tables or slots the store lacks (nothing is
      written then).
  """
  wanted = {
    store_key(name, key): (table_store, key)
    for name, table_store in stores.items()
    for key in table_store.keys
  }
  missing = sorted(k for k in wanted if k not in weights_store)
  if missing:
    raise ValueError(
      f"Layer '{layer}': the saved weights lack the tables or slots "
      f"{missing}; they hold {sorted(weights_store.keys())}. Was the model "
      "saved with the same feature config and optimizers?"
    )
  for weights_key, (table_store, key) in wanted.items():
    table_store.assign(np.asarray(weights_store[weights_key]), key)


def serving_lookup(
  stores: Mapping[str, TableStore],
  config: ResolvedConfig,
  layer: str,
  features: Any,
  weights: Any = None,
  serving_config: Any = None,
) -> Any:
  """A layer's serving lookup of ``features`` in its tables.

  Args:
    stores: the layer's ``{table name: TableStore}``.
    config: the layer's resolved feature config (its structure is the
      default ``serving_config``).
    layer: the layer's name, for errors.
    features, weights, serving_config: as ``serving_embedding_lookup``.

  Raises:
    ValueError: if ``serving_config`` uses a table the layer does not have.
  """
  if serving_config is None:
    serving_config = config.structure
  readers = {
    user: stores[table_name(table)].gather
    for user, table in zip(config.user_tables, config.tables, strict=True)
  }
  for path, feature in flatten_with_paths(serving_config):
    if feature.table not in readers:
      raise ValueError(
        f"Layer '{layer}': serving_config feature {path!r} uses a "
        f"TableConfig ({feature.table!r}) that is not one of the layer's; "
        "build serving configs from the same TableConfig objects."
      )
  return lookup_with_readers(features, weights, readers, serving_config)
