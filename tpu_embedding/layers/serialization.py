"""Feature configs as JSON-able dicts, for the layers' ``get_config``.

Keras saves a layer's constructor arguments as JSON (``model.save`` of a
``.keras`` file, ``get_config``/``from_config``). Feature configs are Python
objects; this module turns them into plain data and back:

* the nest: a single ``FeatureConfig``, dicts with string keys, lists and
  tuples, nested to any depth;
* every ``FeatureConfig`` field; tables shared by several features stay
  shared (tables are listed once and referred to by index);
* every ``TableConfig`` field but ``layout`` (TPU only; must be None);
* optimizers (``SGD``, ``Adagrad``, ``AdagradMomentum``, ``Adam``, ``FTRL``)
  with a float learning rate and no ``slot_variable_creation_fn``;
* initializers: this package's (``TruncatedNormal``, ``RowIdInitializer``),
  Keras initializers, and ``tf.zeros_initializer``, ``tf.ones_initializer``,
  ``tf.constant_initializer``, ``tf.random_normal_initializer``,
  ``tf.random_uniform_initializer``;
* row-sharding thresholds, ``sharding.RowThreshold`` included.

A callable learning rate, a slot creation function or a TPU layout cannot be
saved: ``serialize_feature_config`` raises a ValueError naming the table.
Any other initializer is saved as ``"unserializable"`` and comes back as
zeros, with a warning: ``keras.models.load_model`` then restores the saved
table values, but a model rebuilt from the config alone starts from zeros.

Example:
  >>> import tpu_embedding as tpe
  >>> table = tpe.TableConfig(10, 4, name="t", optimizer=tpe.SGD(0.1))
  >>> config = {"a": tpe.FeatureConfig(table), "b": tpe.FeatureConfig(table)}
  >>> restored = deserialize_feature_config(serialize_feature_config(config))
  >>> restored["a"].table is restored["b"].table, restored["a"].table.name
  (True, 't')
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging

from tpu_embedding import optimizers
from tpu_embedding.config import FeatureConfig
from tpu_embedding.config import QuantizationConfig
from tpu_embedding.config import TableConfig
from tpu_embedding.initializers import RowIdInitializer
from tpu_embedding.initializers import TruncatedNormal
from tpu_embedding.layers.keras_compat import keras
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.sharding import RowThreshold
from tpu_embedding.types import FeatureConfigNest
from tpu_embedding.types import Initializer
from tpu_embedding.vocabularies.config import DynamicVocabulary

#: TensorFlow's v2 initializer classes that round-trip through get_config.
_TF_INITIALIZERS: dict[str, Any] = {
  type(make()).__name__: type(make())
  for make in (
    tf.zeros_initializer,
    tf.ones_initializer,
    lambda: tf.constant_initializer(0.0),
    tf.random_normal_initializer,
    tf.random_uniform_initializer,
  )
}
_OWN_INITIALIZERS = {
  "TruncatedNormal": TruncatedNormal,
  "RowIdInitializer": RowIdInitializer,
}
_OPTIMIZERS = {
  cls.__name__: cls
  for cls in (
    optimizers.SGD,
    optimizers.Adagrad,
    optimizers.AdagradMomentum,
    optimizers.Adam,
    optimizers.FTRL,
  )
}


# --- optimizers -------------------------------------------------------------


def serialize_optimizer(
  optimizer: Optimizer | None, where: str
) -> dict[str, Any] | None:
  """``{"class_name", "config"}`` of an optimizer (None stays None).

  Args:
    optimizer: one of this package's optimizers, or None.
    where: what the optimizer belongs to, for messages.

  Raises:
    ValueError: for a callable learning rate or a slot creation function.
  """
  if optimizer is None:
    return None
  config = optimizer.get_config()
  if callable(config["learning_rate"]):
    raise ValueError(
      f"The optimizer of {where} has a callable learning_rate (a Keras "
      "optimizer's learning rate schedule becomes one), which get_config "
      "cannot save. Use a float learning rate, or save the weights only "
      "(model.save_weights or tf.train.Checkpoint)."
    )
  if config.get("slot_variable_creation_fn") is not None:
    raise ValueError(
      f"The optimizer of {where} has a slot_variable_creation_fn, which "
      "get_config cannot save."
    )
  return {"class_name": type(optimizer).__name__, "config": config}


def deserialize_optimizer(data: dict[str, Any] | None) -> Optimizer | None:
  """The optimizer ``serialize_optimizer`` described."""
  if data is None:
    return None
  config = dict(data["config"])
  if isinstance(config.get("clipvalue"), list):  # JSON turned it into one.
    config["clipvalue"] = tuple(config["clipvalue"])
  return _OPTIMIZERS[data["class_name"]].from_config(config)


# --- initializers -----------------------------------------------------------


def _json_value(value: Any) -> Any:
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, np.generic):
    return value.item()
  return value


def serialize_initializer(initializer: Initializer) -> dict[str, Any]:
  """A dict describing ``initializer`` (see the module docstring)."""
  name = type(initializer).__name__
  if isinstance(initializer, TruncatedNormal):
    config = {
      "mean": initializer.mean,
      "stddev": initializer.stddev,
      "seed": initializer.seed,
    }
    return {"kind": "tpu_embedding", "class_name": name, "config": config}
  if isinstance(initializer, RowIdInitializer):
    config = {"offset": initializer.offset}
    return {"kind": "tpu_embedding", "class_name": name, "config": config}
  if isinstance(initializer, keras.initializers.Initializer):
    return {
      "kind": "keras",
      "config": keras.initializers.serialize(initializer),
    }
  if _TF_INITIALIZERS.get(name) is type(initializer):
    tf_config = _TF_INITIALIZERS[name].get_config(initializer)
    config = {k: _json_value(v) for k, v in tf_config.items()}
    return {"kind": "tensorflow", "class_name": name, "config": config}
  return {"kind": "unserializable", "repr": repr(initializer)}


def deserialize_initializer(data: dict[str, Any], table: str) -> Initializer:
  """The initializer ``serialize_initializer`` described (or zeros)."""
  kind = data["kind"]
  if kind == "tpu_embedding":
    return _OWN_INITIALIZERS[data["class_name"]](**data["config"])
  if kind == "keras":
    return keras.initializers.deserialize(data["config"])
  if kind == "tensorflow":
    return _TF_INITIALIZERS[data["class_name"]].from_config(data["config"])
  logging.warning(
    "Table %s: its initializer %s was not serializable; it is rebuilt with "
    "zeros. Loading saved weights (keras.models.load_model) restores the "
    "table values.",
    table,
    data.get("repr"),
  )
  return tf.zeros_initializer()


# --- tables and features ----------------------------------------------------


def _serialize_table(table: TableConfig) -> dict[str, Any]:
  where = f"table {table.name!r}" if table.name else "an unnamed table"
  if table.layout is not None:
    raise ValueError(f"The TPU layout of {where} cannot be saved.")
  quantization = table.quantization_config
  return {
    "vocabulary_size": table.vocabulary_size,
    "dim": table.dim,
    "initializer": serialize_initializer(table.initializer),
    "optimizer": serialize_optimizer(table.optimizer, where),
    "combiner": table.combiner,
    "name": table.name,
    "quantization_config": None
    if quantization is None
    else {
      "num_buckets": quantization.num_buckets,
      "lower": quantization.lower,
      "upper": quantization.upper,
    },
    "dtype": table.dtype.name,
    "vocabulary": None
    if table.vocabulary is None
    else {
      **table.vocabulary.get_config(),
      "key_dtype": table.vocabulary.key_dtype.name,
    },
  }


def _deserialize_table(data: dict[str, Any]) -> TableConfig:
  quantization = data["quantization_config"]
  return TableConfig(
    vocabulary_size=data["vocabulary_size"],
    dim=data["dim"],
    initializer=deserialize_initializer(
      data["initializer"], data["name"] or "<unnamed>"
    ),
    optimizer=deserialize_optimizer(data["optimizer"]),
    combiner=data["combiner"],
    name=data["name"],
    quantization_config=None
    if quantization is None
    else QuantizationConfig(**quantization),
    dtype=tf.as_dtype(data["dtype"]),
    vocabulary=None
    if data.get("vocabulary") is None
    else DynamicVocabulary(**data["vocabulary"]),
  )


def _serialize_feature(
  feature: FeatureConfig, tables: list[TableConfig]
) -> dict[str, Any]:
  index = next(
    (i for i, t in enumerate(tables) if t is feature.table), len(tables)
  )
  if index == len(tables):
    tables.append(feature.table)
  shape = feature.output_shape
  return {
    "table": index,
    "max_sequence_length": feature.max_sequence_length,
    "validate_weights_and_indices": feature.validate_weights_and_indices,
    "output_shape": shape.as_list() if shape.rank is not None else None,
    "name": feature.name,
  }


def _encode(
  nest: FeatureConfigNest, tables: list[TableConfig]
) -> dict[str, Any]:
  if isinstance(nest, FeatureConfig):
    return {"feature": _serialize_feature(nest, tables)}
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
  data: dict[str, Any], tables: list[TableConfig]
) -> FeatureConfigNest:
  ((kind, value),) = data.items()
  if kind == "feature":
    return FeatureConfig(
      table=tables[value["table"]],
      max_sequence_length=value["max_sequence_length"],
      validate_weights_and_indices=value["validate_weights_and_indices"],
      output_shape=value["output_shape"],
      name=value["name"],
    )
  if kind == "dict":
    return {k: _decode(v, tables) for k, v in value.items()}
  items = [_decode(v, tables) for v in value]
  return items if kind == "list" else tuple(items)


def serialize_feature_config(
  feature_config: FeatureConfigNest,
) -> dict[str, Any]:
  """A JSON-able dict describing a nest of ``FeatureConfig``.

  Raises:
    ValueError: for what cannot be saved (see the module docstring).
  """
  tables: list[TableConfig] = []
  features = _encode(feature_config, tables)
  return {
    "tables": [_serialize_table(t) for t in tables],
    "features": features,
  }


def deserialize_feature_config(data: dict[str, Any]) -> FeatureConfigNest:
  """The nest of ``FeatureConfig`` that ``serialize_feature_config`` saw."""
  tables = [_deserialize_table(t) for t in data["tables"]]
  return _decode(data["features"], tables)


def encode_layer_arguments(
  feature_config: FeatureConfigNest,
  optimizer: Optimizer | None,
  layer_name: str,
) -> dict[str, Any]:
  """The feature config and optimizer arguments of a layer, as plain data."""
  return {
    "feature_config": serialize_feature_config(feature_config),
    "optimizer": serialize_optimizer(optimizer, f"layer {layer_name!r}"),
  }


def decode_feature_config_argument(
  config: dict[str, Any], key: str = "feature_config"
) -> dict[str, Any]:
  """A copy of a layer ``config`` with its feature config ``key`` rebuilt."""
  config = dict(config)
  config[key] = deserialize_feature_config(config[key])
  return config


def decode_layer_arguments(config: dict[str, Any]) -> dict[str, Any]:
  """``config`` with its feature config, optimizer and threshold rebuilt."""
  config = decode_feature_config_argument(config)
  config["optimizer"] = deserialize_optimizer(config["optimizer"])
  if "row_sharding_threshold" in config:
    config["row_sharding_threshold"] = deserialize_row_threshold(
      config["row_sharding_threshold"]
    )
  return config


def serialize_row_threshold(threshold: int) -> int | dict[str, Any]:
  """A row-sharding threshold as plain data (see ``RowThreshold``).

  Example:
    >>> from tpu_embedding.sharding import RowThreshold
    >>> serialize_row_threshold(RowThreshold(10, {"t": "replicated"}))
    {'threshold': 10, 'forced': {'t': 'replicated'}}
    >>> deserialize_row_threshold(_)
    RowThreshold(10, {'t': 'replicated'})
  """
  if isinstance(threshold, RowThreshold):
    return {"threshold": int(threshold), "forced": dict(threshold.forced)}
  return int(threshold)


def deserialize_row_threshold(data: int | dict[str, Any]) -> int:
  """The threshold ``serialize_row_threshold`` described."""
  if isinstance(data, dict):
    return RowThreshold(data["threshold"], data["forced"])
  return data
