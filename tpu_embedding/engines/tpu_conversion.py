"""Translation of this package's configs to TensorFlow's TPU configs.

Under ``TPUStrategy`` the embedding object delegates to TensorFlow's own
``tf.tpu.experimental.embedding.TPUEmbedding`` / ``TPUEmbeddingV2``, which
only take TensorFlow's config classes. This module builds them from ours,
driven by tables:

- ``OPTIMIZER_MAPPINGS``: for each optimizer class, TensorFlow's class, the
  constructor arguments passed through from ``get_config()``, and the
  arguments that exist on one side only, with the one value that
  translates.
- ``ARGUMENT_CONVERSIONS``: the few values TensorFlow needs in another
  type.
- ``TABLE_ARGS`` / ``FEATURE_ARGS``: the ``TableConfig`` / ``FeatureConfig``
  attributes passed to TensorFlow's constructors (same names).

TensorFlow's TPU classes mutate their configs (``table.name``,
``table.optimizer``); ``translate`` builds fresh TensorFlow objects from the
resolved clones of ``resolved.resolve``, so neither the user's configs nor
the embedding object's own are ever touched. Tables are keyed by identity:
features sharing one of our ``TableConfig`` objects share one TensorFlow
``TableConfig``, and one optimizer object becomes one TensorFlow optimizer.

Example:
  >>> import tpu_embedding as tpe
  >>> table = tpe.TableConfig(vocabulary_size=10, dim=4)
  >>> tf_features = to_tf_feature_config(
  ...     {"a": tpe.FeatureConfig(table), "b": tpe.FeatureConfig(table)},
  ...     tpe.Adagrad(0.1))
  >>> tf_table = tf_features["a"].table
  >>> tf_table is tf_features["b"].table, tf_table.name, table.name
  (True, 'table_0', None)
  >>> type(tf_table.optimizer).__name__, tf_table.optimizer.learning_rate
  ('Adagrad', 0.1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import tensorflow as tf

from tpu_embedding.config import FeatureConfig
from tpu_embedding.config import QuantizationConfig
from tpu_embedding.config import TableConfig
from tpu_embedding.optimizers import FTRL
from tpu_embedding.optimizers import SGD
from tpu_embedding.optimizers import Adagrad
from tpu_embedding.optimizers import AdagradMomentum
from tpu_embedding.optimizers import Adam
from tpu_embedding.optimizers import Optimizer
from tpu_embedding.resolved import ResolvedConfig
from tpu_embedding.resolved import key_mapping
from tpu_embedding.resolved import resolve

TFE = tf.tpu.experimental.embedding


class OptimizerMapping(NamedTuple):
  """How one optimizer class translates to TensorFlow's.

  Attributes:
    tf_class: TensorFlow's optimizer class.
    supported_kwargs: constructor arguments with the same name and meaning
      on both sides, passed through from ``get_config()`` (unchanged except
      for ``ARGUMENT_CONVERSIONS``: callable learning rates and
      ``slot_variable_creation_fn`` are passed as the same objects,
      ``clipvalue`` as its ``(min, max)`` tuple).
    unsupported_kwargs: arguments that exist on one side only, each with
      the one value that translates: for a TensorFlow-only argument,
      TensorFlow's default (left unset); for one of ours, the value it must
      have (otherwise ``to_tf_optimizer`` raises).
  """

  tf_class: type
  supported_kwargs: tuple[str, ...]
  unsupported_kwargs: Mapping[str, Any]


#: The arguments every optimizer shares (``optimizers/base.py``).
_COMMON_KWARGS = (
  "learning_rate",
  "use_gradient_accumulation",
  "clip_weight_min",
  "clip_weight_max",
  "weight_decay_factor",
  "multiply_weight_decay_factor_by_learning_rate",
  "clipvalue",
  "low_dimensional_packing_status",
)
_SLOT_KWARGS = ("slot_variable_creation_fn",)

#: Our optimizer class -> how it translates. Keyed by exact class: a
#: subclass may change the update rule, which TensorFlow would not know.
OPTIMIZER_MAPPINGS: dict[type, OptimizerMapping] = {
  SGD: OptimizerMapping(
    tf_class=TFE.SGD,
    supported_kwargs=_COMMON_KWARGS,
    unsupported_kwargs={},
  ),
  Adagrad: OptimizerMapping(
    tf_class=TFE.Adagrad,
    supported_kwargs=(
      "initial_accumulator_value",
      *_SLOT_KWARGS,
      *_COMMON_KWARGS,
    ),
    unsupported_kwargs={},
  ),
  AdagradMomentum: OptimizerMapping(
    tf_class=TFE.AdagradMomentum,
    supported_kwargs=(
      "momentum",
      "use_nesterov",
      "exponent",
      "beta2",
      "epsilon",
      *_SLOT_KWARGS,
      *_COMMON_KWARGS,
    ),
    unsupported_kwargs={},
  ),
  Adam: OptimizerMapping(
    tf_class=TFE.Adam,
    supported_kwargs=(
      "beta_1",
      "beta_2",
      "epsilon",
      "lazy_adam",
      "sum_inside_sqrt",
      *_SLOT_KWARGS,
      *_COMMON_KWARGS,
    ),
    unsupported_kwargs={},
  ),
  FTRL: OptimizerMapping(
    tf_class=TFE.FTRL,
    supported_kwargs=(
      "learning_rate_power",
      "l1_regularization_strength",
      "l2_regularization_strength",
      "beta",
      "initial_accumulator_value",
      "multiply_linear_by_learning_rate",
      "allow_zero_accumulator",
      *_SLOT_KWARGS,
      *_COMMON_KWARGS,
    ),
    unsupported_kwargs={},
  ),
}

#: Optimizer arguments passed converted. TensorFlow 2.21 writes
#: ``low_dimensional_packing_status`` (a bool) into an enum field of its
#: ``OptimizationParameters`` proto, which recent protobuf (seen with 7.36,
#: upb; TensorFlow allows < 8) rejects with ``TypeError: ... Expected an
#: int, got a boolean`` when the embedding engine builds its config, for
#: True *and* False. As an int it is stored as
#: older protobuf stored the bool: False -> 0 (UNSPECIFIED), True -> 1
#: (ENABLED); Python compares the two equal, SparseCore ignores the field.
ARGUMENT_CONVERSIONS: dict[str, Any] = {"low_dimensional_packing_status": int}

#: ``TableConfig`` attributes passed to TensorFlow's ``TableConfig`` under
#: the same names (``optimizer`` and ``quantization_config`` translated).
TABLE_ARGS = (
  "vocabulary_size",
  "dim",
  "initializer",
  "optimizer",
  "combiner",
  "name",
  "quantization_config",
  "layout",
  "dtype",
)
#: ``FeatureConfig`` attributes passed to TensorFlow's ``FeatureConfig``
#: under the same names (``table`` translated, shared by identity).
FEATURE_ARGS = (
  "table",
  "max_sequence_length",
  "validate_weights_and_indices",
  "output_shape",
  "name",
)


@dataclasses.dataclass(frozen=True)
class ToTFConfigs:
  """TensorFlow's configs translated from one resolved feature config.

  Attributes:
    feature_config: a nest of ``tf.tpu.experimental.embedding.FeatureConfig``
      with the structure of the user's feature config.
    tables: TensorFlow ``TableConfig`` objects, parallel to the resolved
      ``tables`` (and so to ``user_tables``).
    optimizer: the translated global optimizer, or None.
  """

  feature_config: Any
  tables: tuple[Any, ...]
  optimizer: Any


def to_tf_optimizer(optimizer: Optimizer) -> Any:
  """TensorFlow's optimizer with the same hyper-parameters as ``optimizer``.

  Args:
    optimizer: an ``SGD``, ``Adagrad``, ``AdagradMomentum``, ``Adam`` or
      ``FTRL`` of this package.

  Returns:
    A new ``tf.tpu.experimental.embedding`` optimizer of the same name.

  Raises:
    ValueError: if the class or one of its arguments has no TensorFlow
      equivalent.

  Example:
    >>> import tpu_embedding as tpe
    >>> tf_adam = to_tf_optimizer(tpe.Adam(0.1, beta_1=0.5, clipvalue=2.0))
    >>> tf_adam.beta_1, tf_adam.clip_gradient_min, tf_adam.clip_gradient_max
    (0.5, -2.0, 2.0)
  """
  mapping = OPTIMIZER_MAPPINGS.get(type(optimizer))
  if mapping is None:
    known = ", ".join(f"tpu_embedding.{c.__name__}" for c in OPTIMIZER_MAPPINGS)
    raise ValueError(
      f"Cannot translate optimizer {type(optimizer)} to TensorFlow's TPU "
      f"embedding optimizers: only instances of exactly {known} are "
      "translated (a subclass may change the update rule)."
    )
  name = type(optimizer).__name__
  kwargs = {}
  for arg, value in optimizer.get_config().items():
    if arg in mapping.supported_kwargs:
      kwargs[arg] = ARGUMENT_CONVERSIONS.get(arg, _same)(value)
    elif arg in mapping.unsupported_kwargs:
      required = mapping.unsupported_kwargs[arg]
      if value != required:
        raise ValueError(
          f"{name}({arg}={value!r}) has no equivalent in TensorFlow's TPU "
          f"embedding {name}; only {arg}={required!r} can run on TPU."
        )
    else:
      raise ValueError(
        f"{name} argument {arg!r} is not in OPTIMIZER_MAPPINGS, so it cannot "
        f"be translated to TensorFlow's TPU embedding {name}."
      )
  return mapping.tf_class(**kwargs)


def _same(value: Any) -> Any:
  return value


def to_tf_quantization_config(config: QuantizationConfig) -> Any:
  """TensorFlow's ``QuantizationConfig`` with the same buckets and bounds.

  Example:
    >>> import tpu_embedding as tpe
    >>> to_tf_quantization_config(tpe.QuantizationConfig(4, -1.0, 1.0))
    QuantizationConfig(num_buckets=4, lower=-1.0, upper=1.0)
  """
  return TFE.QuantizationConfig(
    num_buckets=config.num_buckets, lower=config.lower, upper=config.upper
  )


class _Translator:
  """Translates configs, mapping one object of ours to one of TensorFlow's."""

  def __init__(self):
    # id(ours) -> (ours, theirs): keeps ``ours`` alive so ids stay unique.
    self._optimizers: dict[int, tuple[Any, Any]] = {}
    self._tables: dict[int, tuple[Any, Any]] = {}

  def optimizer(self, optimizer: Optimizer | None) -> Any:
    if optimizer is None:
      return None
    if id(optimizer) not in self._optimizers:
      self._optimizers[id(optimizer)] = (optimizer, to_tf_optimizer(optimizer))
    return self._optimizers[id(optimizer)][1]

  def table(self, table: TableConfig) -> Any:
    if id(table) not in self._tables:
      # ``vocabulary``, ``key_mapping`` (a resolved table's): TensorFlow's
      # tables have neither (ids are rows).
      # ``storage``: float32 only (TensorFlow's TPU tables are).
      _check_attributes(
        table, (*TABLE_ARGS, "vocabulary", "key_mapping", "storage")
      )
      key_mapping(table).check_on_tpu(table.name)
      if not table.storage.is_float32:
        raise ValueError(
          f"Table {table.name!r} is stored as {table.storage.dtype} "
          f"(RowStorage): TensorFlow's TPU embedding keeps float32 tables; "
          "drop the storage argument under TPUStrategy."
        )
      kwargs = {arg: getattr(table, arg) for arg in TABLE_ARGS}
      kwargs["optimizer"] = self.optimizer(table.optimizer)
      if table.quantization_config is not None:
        kwargs["quantization_config"] = to_tf_quantization_config(
          table.quantization_config
        )
      self._tables[id(table)] = (table, TFE.TableConfig(**kwargs))
    return self._tables[id(table)][1]

  def feature(self, feature: FeatureConfig) -> Any:
    _check_attributes(feature, FEATURE_ARGS)
    kwargs = {arg: getattr(feature, arg) for arg in FEATURE_ARGS}
    kwargs["table"] = self.table(feature.table)
    return TFE.FeatureConfig(**kwargs)


def _check_attributes(config: Any, translated: tuple[str, ...]) -> None:
  """Raises if ``config`` has an attribute no table says how to translate."""
  unknown = sorted(set(vars(config)) - set(translated))
  if unknown:
    raise ValueError(
      f"{type(config).__name__} attributes {unknown} have no translation to "
      "TensorFlow's TPU embedding configs; add them to "
      "tpu_embedding/engines/tpu_conversion.py."
    )


def to_tf_table(table: TableConfig) -> Any:
  """TensorFlow's ``TableConfig`` with the same attributes as ``table``.

  Translate the resolved clone (named, optimizer set) to get the name and
  optimizer the embedding object uses. The initializer and layout are passed
  as the same objects; the optimizer and quantization config are translated.

  Args:
    table: a ``TableConfig`` of this package (not modified).

  Returns:
    A new ``tf.tpu.experimental.embedding.TableConfig``.

  Raises:
    ValueError: if ``table`` is not a ``TableConfig`` of this package or its
      optimizer cannot be translated.

  Example:
    >>> import tpu_embedding as tpe
    >>> tf_table = to_tf_table(tpe.TableConfig(10, 4, name="t",
    ...                                        combiner="sum"))
    >>> tf_table.name, tf_table.vocabulary_size, tf_table.combiner
    ('t', 10, 'sum')
  """
  if not isinstance(table, TableConfig):
    raise ValueError(
      f"to_tf_table takes a tpu_embedding.TableConfig. Received: {type(table)}"
    )
  return _Translator().table(table)


def translate(
  config: ResolvedConfig, optimizer: Optimizer | None
) -> ToTFConfigs:
  """TensorFlow's configs for a resolved feature config.

  Args:
    config: ``resolve(feature_config, optimizer)``.
    optimizer: the global optimizer the config was resolved with, or None.

  Returns:
    The ``ToTFConfigs``: fresh TensorFlow objects, table sharing preserved.

  Raises:
    ValueError: if an optimizer cannot be translated.

  Example:
    >>> import tpu_embedding as tpe
    >>> sgd = tpe.SGD(0.1)
    >>> table = tpe.TableConfig(10, 4, name="t")
    >>> tf_configs = translate(resolve(tpe.FeatureConfig(table), sgd), sgd)
    >>> tf_configs.tables[0].optimizer is tf_configs.optimizer
    True
  """
  translator = _Translator()
  tf_optimizer = translator.optimizer(optimizer)
  features = [translator.feature(f) for f in config.features]
  return ToTFConfigs(
    feature_config=tf.nest.pack_sequence_as(config.structure, features),
    tables=tuple(translator.table(t) for t in config.tables),
    optimizer=tf_optimizer,
  )


def to_tf_feature_config(
  feature_config: Any, optimizer: Optimizer | None = None
) -> Any:
  """The same nest of TensorFlow ``FeatureConfig`` objects.

  Resolves ``feature_config`` first (tables named ``table_<i>`` as the
  embedding object names them; tables without an optimizer get
  ``optimizer``), then translates the clones.

  Args:
    feature_config: a nest of this package's ``FeatureConfig``.
    optimizer: the global optimizer, or None.

  Returns:
    A nest of ``tf.tpu.experimental.embedding.FeatureConfig`` of the same
    structure; features sharing a table share a TensorFlow table.

  Raises:
    ValueError: for an invalid feature config or an untranslatable
      optimizer.

  Example:
    >>> import tpu_embedding as tpe
    >>> t = tpe.TableConfig(10, 4, name="t")
    >>> [tf_feature] = to_tf_feature_config(
    ...     [tpe.FeatureConfig(t, max_sequence_length=3, output_shape=[8])])
    >>> tf_feature.max_sequence_length, tf_feature.output_shape
    (3, TensorShape([8]))
  """
  return translate(resolve(feature_config, optimizer), optimizer).feature_config
