"""Table and feature configurations, as in ``tf.tpu.experimental.embedding``.

A ``TableConfig`` describes one embedding table; a ``FeatureConfig`` maps one
input feature to a table. Features that share a ``TableConfig`` *object*
share one table. Both validate in their constructor, with TensorFlow's error
texts, and are never mutated by this package: the embedding object works on
clones (see ``TableConfig.replace``).

Example:
  >>> import tpu_embedding as tpe
  >>> table = tpe.TableConfig(vocabulary_size=1000, dim=8, name="movies")
  >>> features = {
  ...     "watched": tpe.FeatureConfig(table=table),
  ...     "history": tpe.FeatureConfig(table=table, max_sequence_length=5),
  ... }
  >>> features["history"].max_sequence_length
  5
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import TypeAlias
from typing import TypedDict
from typing import Union

import tensorflow as tf

from tpu_embedding import initializers
from tpu_embedding.initializers import Initializer
from tpu_embedding.initializers import TruncatedNormal
from tpu_embedding.keys.vocabulary import DynamicVocabulary
from tpu_embedding.optimizers import saving as optimizer_saving
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.row_storage import FLOAT32
from tpu_embedding.row_storage import RowStorage

COMBINERS = ("mean", "sum", "sqrtn")


class QuantizationConfigDict(TypedDict):
  """``QuantizationConfig.get_config()``: its constructor's arguments."""

  num_buckets: int
  lower: float
  upper: float


class TableConfigDict(TypedDict):
  """``TableConfig.get_config()``: plain data, kept by JSON.

  ``initializer`` is ``initializers.get_config``'s, ``optimizer``
  ``optimizers.saving.to_config``'s; ``dtype`` and the vocabulary's
  ``key_dtype`` are dtype names.
  """

  vocabulary_size: int
  dim: int
  initializer: initializers.InitializerDict
  optimizer: optimizer_saving.OptimizerDict | None
  combiner: str
  name: str | None
  quantization_config: QuantizationConfigDict | None
  dtype: str
  vocabulary: dict[str, Any] | None
  storage: dict[str, Any]


class FeatureFieldsDict(TypedDict):
  """A ``FeatureConfig``'s fields but its table, as plain data."""

  max_sequence_length: int
  validate_weights_and_indices: bool
  output_shape: list[int | None] | None
  name: str | None


class FeatureConfigDict(FeatureFieldsDict):
  """``FeatureConfig.get_config()``: plain data, kept by JSON."""

  table: TableConfigDict


class QuantizationConfig:
  """Simulated quantization of looked-up rows, before the combiner.

  Each gathered value ``x`` becomes, with ``q = (upper - lower) /
  (num_buckets - 1)``:

  .. math:: \\mathrm{round}((\\mathrm{clip}(x, lower, upper) - lower) / q)
            \\cdot q + lower

  (rounding half up). The table itself stays float32; gradients pass
  straight through.

  Example:
    >>> import tpu_embedding as tpe
    >>> tpe.QuantizationConfig(num_buckets=256, lower=-1.0, upper=1.0)
    QuantizationConfig(num_buckets=256, lower=-1.0, upper=1.0)
  """

  def __init__(self, num_buckets: int, lower: float, upper: float):
    """Creates the quantization configuration.

    Args:
      num_buckets: number of quantization buckets, at least 2.
      lower: lower clipping bound.
      upper: upper clipping bound, greater than ``lower``.

    Raises:
      ValueError: if ``num_buckets < 2`` or ``lower >= upper``.
    """
    if num_buckets < 2:
      raise ValueError(
        f"num_buckets is {num_buckets}, must be at least 2 for "
        f"simulated quantization."
      )
    if not lower < upper:
      raise ValueError(
        f"QuantizationConfig needs lower < upper. Received: lower={lower}, "
        f"upper={upper}"
      )
    self.num_buckets = num_buckets
    self.lower = lower
    self.upper = upper

  def quantize(self, values: tf.Tensor) -> tf.Tensor:
    """Clips and quantizes ``values``; the gradient is the identity."""
    quantum = (self.upper - self.lower) / (self.num_buckets - 1)
    clipped = tf.clip_by_value(values, self.lower, self.upper)
    quantized = tf.floor((clipped - self.lower) / quantum + 0.5) * quantum + (
      self.lower
    )
    return values + tf.stop_gradient(quantized - values)

  def get_config(self) -> QuantizationConfigDict:
    """The constructor's arguments."""
    return {
      "num_buckets": self.num_buckets,
      "lower": self.lower,
      "upper": self.upper,
    }

  @classmethod
  def from_config(cls, config: QuantizationConfigDict) -> QuantizationConfig:
    """The configuration ``get_config`` described."""
    return cls(**config)

  def __repr__(self) -> str:
    return (
      f"QuantizationConfig(num_buckets={self.num_buckets!r}, "
      f"lower={self.lower!r}, upper={self.upper!r})"
    )


class TableConfig:
  """Configuration of one embedding table.

  Attributes:
    vocabulary_size: number of rows.
    dim: width of each row.
    initializer: ``initializer(shape, dtype=...)`` for the full table.
      Defaults to a truncated normal with mean 0 and stddev
      ``1/sqrt(dim)``.
    optimizer: this table's optimizer; None means the one passed to
      ``TPUEmbedding``.
    combiner: how several ids of one example are reduced: ``"mean"``,
      ``"sum"`` or ``"sqrtn"``.
    name: the table's name (checkpoint key). Unnamed tables get
      ``table_<i>`` in the embedding object, in first-appearance order.
    quantization_config: optional simulated quantization of lookups.
    layout: a precomputed TPU SparseCore layout (passed to TensorFlow's
      TPU classes only).
    dtype: the table's dtype; float32.

  Example:
    >>> import tpu_embedding as tpe
    >>> t = tpe.TableConfig(vocabulary_size=100, dim=4, combiner="sum")
    >>> t.replace(name="users").name
    'users'
    >>> t.name is None  # the original is unchanged
    True
  """

  def __init__(
    self,
    vocabulary_size: int,
    dim: int,
    initializer: Initializer | None = None,
    optimizer: Optimizer | None = None,
    combiner: str = "mean",
    name: str | None = None,
    quantization_config: QuantizationConfig | None = None,
    layout: Any | None = None,
    dtype: tf.DType = tf.float32,
    *,
    vocabulary: DynamicVocabulary | None = None,
    storage: RowStorage = FLOAT32,
  ):
    """Creates a table configuration.

    Args:
      vocabulary_size: number of rows, an int >= 1.
      dim: embedding width, an int >= 1.
      initializer: callable taking the shape (and ``dtype=``) of the
        table; None for the default truncated normal.
      optimizer: an instance of ``tpu_embedding.SGD``, ``Adagrad``,
        ``AdagradMomentum``, ``Adam`` or ``FTRL``; overrides the global one.
      combiner: ``"mean"`` (default), ``"sum"`` or ``"sqrtn"``.
      name: optional unique table name.
      quantization_config: optional ``QuantizationConfig``.
      layout: optional precomputed TPU layout (TPU only).
      dtype: float32 (int32 tables are TPU-serving only and not supported).
      vocabulary: (keyword only; not in TensorFlow's ``TableConfig``)
        None (ids are rows), or a ``DynamicVocabulary``: the
        table takes raw keys and gives them its ``vocabulary_size`` rows
        as they come (``tpu_embedding/keys/vocabulary.py``).
      storage: (keyword only; not in TensorFlow's ``TableConfig``) the
        stored types of the rows and of the optimizer slots, and the
        rounding of updates (``RowStorage``; float32 by default): e.g.
        ``RowStorage("bfloat16")`` keeps the rows in half the bytes, with
        float32 lookups and update math.

    Raises:
      ValueError: if an argument is invalid; the message names it, gives the
        value received and what is allowed.
    """
    if (
      not isinstance(vocabulary_size, int)
      or isinstance(vocabulary_size, bool)
      or vocabulary_size < 1
    ):
      raise ValueError(
        f"Argument `vocabulary_size` must be an int and must be >= 1. "
        f"Received: {vocabulary_size}"
      )
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
      raise ValueError(
        f"Argument `dim` (embedding dimension) "
        f"must be an int and must be >= 1. Received: {dim}"
      )
    if (initializer is not None) and (not callable(initializer)):
      raise ValueError(
        f"Argument `initializer` must be a callable (or None). "
        f"Received: {initializer}"
      )
    if optimizer is not None and not isinstance(optimizer, Optimizer):
      raise ValueError(
        f"Argument `optimizer` of TableConfig {name!r} must be None or an "
        "instance of tpu_embedding.SGD, Adagrad, AdagradMomentum, Adam or "
        f"FTRL. Received: {type(optimizer)}"
      )
    if not isinstance(combiner, str):
      raise ValueError(
        f"Argument `combiner` should either be a str or a CustomCombiner. "
        f"Received: {type(combiner)}"
      )
    if combiner not in COMBINERS:
      raise ValueError(
        f"String argument `combiner` must be in {COMBINERS}. "
        f"Received: {combiner}"
      )
    if name is not None and (not isinstance(name, str) or not name):
      raise ValueError(
        f"Argument `name` must be a non-empty str or None. Received: {name!r}"
      )
    if quantization_config is not None and not isinstance(
      quantization_config, QuantizationConfig
    ):
      raise ValueError(
        "Argument `quantization_config` must be a QuantizationConfig or "
        f"None. Received: {type(quantization_config)}"
      )
    if tf.as_dtype(dtype) not in (tf.float32, tf.int32):
      raise ValueError(
        f"Argument `dtype` must be either float32 or int32. Received: {dtype}"
      )
    if vocabulary is not None:
      if not isinstance(vocabulary, DynamicVocabulary):
        raise ValueError(
          f"Argument `vocabulary` of TableConfig {name!r} must be None or a "
          f"tpu_embedding.DynamicVocabulary. Received: {type(vocabulary)}"
        )
      if vocabulary.capacity not in (None, vocabulary_size):
        raise ValueError(
          f"TableConfig {name!r}: the DynamicVocabulary's capacity "
          f"({vocabulary.capacity}) differs from vocabulary_size "
          f"({vocabulary_size}); give one, or equal values."
        )
    if not isinstance(storage, RowStorage):
      raise ValueError(
        f"Argument `storage` of TableConfig {name!r} must be a "
        f"tpu_embedding.RowStorage. Received: {type(storage)}"
      )
    self.vocabulary_size = vocabulary_size
    self.dim = dim
    self.initializer: Initializer = (
      TruncatedNormal.default_for(dim) if initializer is None else initializer
    )
    self.optimizer = optimizer
    self.combiner = combiner
    self.name = name
    self.quantization_config = quantization_config
    self.layout = layout
    self.dtype = tf.as_dtype(dtype)
    self.vocabulary = vocabulary
    self.storage = storage

  def replace(self, **changes: Any) -> TableConfig:
    """Returns a shallow copy with ``changes`` applied; self is unchanged."""
    clone = copy.copy(self)
    for key, value in changes.items():
      if not hasattr(clone, key):
        raise AttributeError(f"TableConfig has no attribute {key!r}")
      setattr(clone, key, value)
    return clone

  def get_config(self) -> TableConfigDict:
    """This configuration as plain data that JSON keeps.

    Every field but ``layout`` (TPU only), with the optimizer
    (``optimizers.saving``) and the initializer (``initializers``) described
    as data; ``from_config`` rebuilds an equal configuration.

    Raises:
      ValueError: for what cannot be saved, naming the table: a TPU
        ``layout``, an optimizer with a callable learning rate or a
        ``slot_variable_creation_fn``.

    Example:
      >>> import tpu_embedding as tpe
      >>> table = tpe.TableConfig(10, 4, name="t", optimizer=tpe.SGD(0.1))
      >>> tpe.TableConfig.from_config(table.get_config())
      TableConfig(vocabulary_size=10, dim=4, initializer=None, \
optimizer=SGD(learning_rate=0.1), combiner='mean', name='t', \
quantization_config=None)
    """
    where = f"table {self.name!r}" if self.name else "an unnamed table"
    if self.layout is not None:
      raise ValueError(f"The TPU layout of {where} cannot be saved.")
    quantization = self.quantization_config
    return {
      "vocabulary_size": self.vocabulary_size,
      "dim": self.dim,
      "initializer": initializers.get_config(self.initializer),
      "optimizer": optimizer_saving.to_config(self.optimizer, where),
      "combiner": self.combiner,
      "name": self.name,
      "quantization_config": None
      if quantization is None
      else quantization.get_config(),
      "dtype": self.dtype.name,
      "vocabulary": None
      if self.vocabulary is None
      else {
        **self.vocabulary.get_config(),
        "key_dtype": self.vocabulary.key_dtype.name,
      },
      "storage": dataclasses.asdict(self.storage),
    }

  @classmethod
  def from_config(cls, config: TableConfigDict) -> TableConfig:
    """The configuration ``get_config`` described."""
    quantization = config["quantization_config"]
    vocabulary = config.get("vocabulary")
    return cls(
      vocabulary_size=config["vocabulary_size"],
      dim=config["dim"],
      initializer=initializers.from_config(
        config["initializer"], config["name"] or "<unnamed>"
      ),
      optimizer=optimizer_saving.from_config(config["optimizer"]),
      combiner=config["combiner"],
      name=config["name"],
      quantization_config=None
      if quantization is None
      else QuantizationConfig.from_config(quantization),
      dtype=tf.as_dtype(config["dtype"]),
      vocabulary=None
      if vocabulary is None
      else DynamicVocabulary(**vocabulary),
      storage=RowStorage(**config.get("storage", {})),
    )

  def __repr__(self) -> str:
    initializer: Initializer | None = self.initializer
    if isinstance(initializer, TruncatedNormal) and initializer.is_default_for(
      self.dim
    ):
      initializer = None
    return (
      f"TableConfig(vocabulary_size={self.vocabulary_size!r}, "
      f"dim={self.dim!r}, initializer={initializer!r}, "
      f"optimizer={self.optimizer!r}, combiner={self.combiner!r}, "
      f"name={self.name!r}, "
      f"quantization_config={self.quantization_config!r}"
      + (f", vocabulary={self.vocabulary!r}" if self.vocabulary else "")
      + (f", storage={self.storage!r})" if self.storage != FLOAT32 else ")")
    )


class FeatureConfig:
  """Configuration of one input feature: which table, and its output shape.

  Attributes:
    table: the ``TableConfig`` this feature is looked up in.
    max_sequence_length: 0 for a combined feature with output
      ``(batch, dim)``; ``L > 0`` for a sequence feature with output
      ``(batch, L, dim)``, truncated or zero-padded to ``L``.
    validate_weights_and_indices: serving lookups use TensorFlow's "safe"
      semantics (negative ids and non-positive weights pruned, empty rows
      give zeros) when True.
    output_shape: the activation shape without ``dim`` (a ``TensorShape``,
      unknown when not set). Takes priority over ``build()`` shapes and
      shapes detected from the first batch.
    name: optional feature name.

  Example:
    >>> import tpu_embedding as tpe
    >>> table = tpe.TableConfig(vocabulary_size=10, dim=2)
    >>> tpe.FeatureConfig(table=table, output_shape=[32]).output_shape
    TensorShape([32])
  """

  def __init__(
    self,
    table: TableConfig,
    max_sequence_length: int = 0,
    validate_weights_and_indices: bool = True,
    output_shape: Sequence[int] | tf.TensorShape | None = None,
    name: str | None = None,
  ):
    """Creates a feature configuration.

    Args:
      table: a ``TableConfig``.
      max_sequence_length: 0 (not a sequence) or the sequence length.
      validate_weights_and_indices: use safe lookups when serving.
      output_shape: optional activation shape excluding ``dim``.
      name: optional name.

    Raises:
      ValueError: if ``table`` is not a ``TableConfig``,
        ``max_sequence_length`` is not an int >= 0, or
        ``validate_weights_and_indices`` is not a bool.
    """
    if not isinstance(table, TableConfig):
      raise ValueError(
        f"Argument `table` has invalid type {type(table)}. "
        "Expected `tpu_embedding.TableConfig`."
      )
    if (
      not isinstance(max_sequence_length, int)
      or isinstance(max_sequence_length, bool)
      or max_sequence_length < 0
    ):
      raise ValueError(
        f"Argument `max_sequence_length` must be an int and must be >= 0. "
        f"Received: {max_sequence_length}"
      )
    if not isinstance(validate_weights_and_indices, bool):
      raise ValueError(
        f"Argument `validate_weights_and_indices` must be a boolean. "
        f"Received: {validate_weights_and_indices}"
      )
    try:
      shape = tf.TensorShape(output_shape)
    except (TypeError, ValueError) as e:
      raise ValueError(
        "Argument `output_shape` must be a list of ints or a TensorShape. "
        f"Received: {output_shape!r}"
      ) from e
    self.table = table
    self.max_sequence_length = max_sequence_length
    self.validate_weights_and_indices = validate_weights_and_indices
    self.output_shape = shape
    self.name = name

  def replace(self, **changes: Any) -> FeatureConfig:
    """Returns a shallow copy with ``changes`` applied; self is unchanged."""
    clone = copy.copy(self)
    for key, value in changes.items():
      if not hasattr(clone, key):
        raise AttributeError(f"FeatureConfig has no attribute {key!r}")
      setattr(clone, key, value)
    return clone

  def get_config(self) -> FeatureConfigDict:
    """This configuration, its table's included, as plain data.

    Features sharing a table each describe it here;
    ``serialize_feature_config`` keeps a nest's shared tables shared.

    Raises:
      ValueError: for a table that cannot be saved
        (``TableConfig.get_config``).

    Example:
      >>> import tpu_embedding as tpe
      >>> feature = tpe.FeatureConfig(tpe.TableConfig(10, 4), name="f")
      >>> tpe.FeatureConfig.from_config(feature.get_config()).name
      'f'
    """
    return {"table": self.table.get_config(), **self._own_fields()}

  @classmethod
  def from_config(cls, config: FeatureConfigDict) -> FeatureConfig:
    """The configuration ``get_config`` described, with a new table."""
    return cls._with_table(TableConfig.from_config(config["table"]), config)

  def _own_fields(self) -> FeatureFieldsDict:
    """The fields but the table, as plain data."""
    shape = self.output_shape
    return {
      "max_sequence_length": self.max_sequence_length,
      "validate_weights_and_indices": self.validate_weights_and_indices,
      "output_shape": shape.as_list() if shape.rank is not None else None,
      "name": self.name,
    }

  @classmethod
  def _with_table(
    cls, table: TableConfig, fields: FeatureFieldsDict
  ) -> FeatureConfig:
    return cls(
      table=table,
      max_sequence_length=fields["max_sequence_length"],
      validate_weights_and_indices=fields["validate_weights_and_indices"],
      output_shape=fields["output_shape"],
      name=fields["name"],
    )

  def __repr__(self) -> str:
    return (
      f"FeatureConfig(table={self.table!r}, "
      f"max_sequence_length={self.max_sequence_length!r}, "
      f"validate_weights_and_indices="
      f"{self.validate_weights_and_indices!r}, "
      f"output_shape={self.output_shape!r}, name={self.name!r})"
    )


# --- nests of feature configs as plain data ---------------------------------

#: A nest of ``FeatureConfig`` (as ``types.FeatureConfigNest``, which is
#: this module's alias gathered there).
FeatureConfigNest: TypeAlias = Union[
  FeatureConfig,
  Sequence["FeatureConfigNest"],
  Mapping[str, "FeatureConfigNest"],
]


class FeatureConfigNestDict(TypedDict):
  """A nest of ``FeatureConfig`` as plain data: its tables, listed once,
  and the nest, whose features name their table by index."""

  tables: list[TableConfigDict]
  features: dict[str, Any]


def serialize_feature_config(
  feature_config: FeatureConfigNest,
) -> FeatureConfigNestDict:
  """A JSON-able dict describing a nest of ``FeatureConfig``.

  The nest (a single ``FeatureConfig``, dicts with string keys, lists and
  tuples, to any depth) and every feature's fields
  (``FeatureConfig.get_config``); tables shared by several features stay
  shared: they are listed once (``TableConfig.get_config``) and referred to
  by index.

  Raises:
    ValueError: for what cannot be saved: a table as
      ``TableConfig.get_config`` says, dict keys that are not strings, other
      containers.

  Example:
    >>> import tpu_embedding as tpe
    >>> table = tpe.TableConfig(10, 4, name="t", optimizer=tpe.SGD(0.1))
    >>> config = {"a": tpe.FeatureConfig(table), "b": tpe.FeatureConfig(table)}
    >>> restored = deserialize_feature_config(serialize_feature_config(config))
    >>> restored["a"].table is restored["b"].table, restored["a"].table.name
    (True, 't')
  """
  tables: list[TableConfig] = []
  features = _encode(feature_config, tables)
  return {"tables": [t.get_config() for t in tables], "features": features}


def deserialize_feature_config(
  data: FeatureConfigNestDict,
) -> FeatureConfigNest:
  """The nest of ``FeatureConfig`` that ``serialize_feature_config`` saw."""
  tables = [TableConfig.from_config(t) for t in data["tables"]]
  return _decode(data["features"], tables)


def _encode(
  nest: FeatureConfigNest, tables: list[TableConfig]
) -> dict[str, Any]:
  if isinstance(nest, FeatureConfig):
    index = next(
      (i for i, t in enumerate(tables) if t is nest.table), len(tables)
    )
    if index == len(tables):
      tables.append(nest.table)
    return {"feature": {"table": index, **nest._own_fields()}}
  if isinstance(nest, dict):
    if not all(isinstance(k, str) for k in nest):
      raise ValueError(
        "Only feature configs whose dict keys are strings can be saved; "
        f"got keys {sorted(map(repr, nest))}."
      )
    return {"dict": {k: _encode(v, tables) for k, v in sorted(nest.items())}}
  if isinstance(nest, (list, tuple)):
    kind = "list" if isinstance(nest, list) else "tuple"
    return {kind: [_encode(v, tables) for v in nest]}
  raise ValueError(
    f"Cannot save a feature config containing a {type(nest)}; only "
    "FeatureConfig, dict, list and tuple nests can be saved."
  )


def _decode(
  data: Mapping[str, Any], tables: list[TableConfig]
) -> FeatureConfigNest:
  ((kind, value),) = data.items()
  if kind == "feature":
    return FeatureConfig._with_table(tables[value["table"]], value)
  if kind == "dict":
    return {k: _decode(v, tables) for k, v in value.items()}
  items = [_decode(v, tables) for v in value]
  return items if kind == "list" else tuple(items)
