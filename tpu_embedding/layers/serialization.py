"""The Keras layers' constructor arguments as JSON-able data.

Keras saves a layer's constructor arguments as JSON (``model.save`` of a
``.keras`` file, ``get_config``/``from_config``). The configs describe
themselves: ``TableConfig.get_config`` / ``FeatureConfig.get_config``, and
``config.serialize_feature_config`` for a nest of them (tables shared by
several features stay shared); optimizers through ``optimizers.saving``,
initializers through ``initializers.get_config``. This module puts a layer's
arguments together from them (what can be saved):

* the nest: a single ``FeatureConfig``, dicts with string keys, lists and
  tuples, nested to any depth;
* every ``FeatureConfig`` field;
* every ``TableConfig`` field but ``layout`` (TPU only; must be None);
* optimizers (``SGD``, ``Adagrad``, ``AdagradMomentum``, ``Adam``, ``FTRL``)
  with a float learning rate and no ``slot_variable_creation_fn``;
* initializers: this package's (``TruncatedNormal``, ``RowIdInitializer``),
  Keras initializers, and ``tf.zeros_initializer``, ``tf.ones_initializer``,
  ``tf.constant_initializer``, ``tf.random_normal_initializer``,
  ``tf.random_uniform_initializer``;
* row-sharding thresholds, ``sharding.PlacementPolicy`` included.

A callable learning rate, a slot creation function or a TPU layout cannot be
saved: ``serialize_feature_config`` raises a ValueError naming the table.
Any other initializer is saved as ``"unserializable"`` and comes back as
zeros, with a warning: ``keras.models.load_model`` then restores the saved
table values, but a model rebuilt from the config alone starts from zeros.

Example:
  >>> import json
  >>> import tpu_embedding as tpe
  >>> features = [tpe.FeatureConfig(tpe.TableConfig(10, 4, name="t"))]
  >>> saved = json.dumps(encode_layer_arguments(features, tpe.SGD(0.1), "e"))
  >>> arguments = decode_layer_arguments(json.loads(saved))
  >>> arguments["optimizer"], arguments["feature_config"][0].table.name
  (SGD(learning_rate=0.1), 't')
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tpu_embedding.config import deserialize_feature_config
from tpu_embedding.config import serialize_feature_config
from tpu_embedding.optimizers import saving as optimizer_saving
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.sharding import IN_MEMORY
from tpu_embedding.sharding import DiskTier
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.types import FeatureConfigNest

__all__ = [
  "decode_feature_config_argument",
  "decode_layer_arguments",
  "deserialize_feature_config",
  "deserialize_row_threshold",
  "encode_layer_arguments",
  "serialize_feature_config",
  "serialize_row_threshold",
]


def encode_layer_arguments(
  feature_config: FeatureConfigNest,
  optimizer: Optimizer | None,
  layer_name: str,
) -> dict[str, Any]:
  """The feature config and optimizer arguments of a layer, as plain data."""
  return {
    "feature_config": serialize_feature_config(feature_config),
    "optimizer": optimizer_saving.to_config(optimizer, f"layer {layer_name!r}"),
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
  config["optimizer"] = optimizer_saving.from_config(config["optimizer"])
  if "row_sharding_threshold" in config:
    config["row_sharding_threshold"] = deserialize_row_threshold(
      config["row_sharding_threshold"]
    )
  return config


def serialize_row_threshold(
  threshold: int | PlacementPolicy,
) -> int | dict[str, Any]:
  """A ``row_sharding_threshold`` argument as plain data: an ``int``, or a
  ``PlacementPolicy`` as a dict (its ``DiskTier`` too, where it has one).

  Example:
    >>> serialize_row_threshold(PlacementPolicy(10, {"t": "replicated"}))
    {'threshold': 10, 'forced': {'t': 'replicated'}}
    >>> deserialize_row_threshold(_)
    PlacementPolicy(row_threshold=10, forced={'t': 'replicated'})
    >>> disk = DiskTier("/ssd/tables", 2**20, ("t",))
    >>> deserialize_row_threshold(serialize_row_threshold(
    ...     PlacementPolicy(10, disk=disk))).disk == disk
    True
  """
  if not isinstance(threshold, PlacementPolicy):
    return int(threshold)
  data: dict[str, Any] = {
    "threshold": threshold.row_threshold,
    "forced": dict(threshold.forced),
  }
  if threshold.disk.tables:
    data["disk"] = dataclasses.asdict(threshold.disk)
  return data


def deserialize_row_threshold(
  data: int | dict[str, Any],
) -> int | PlacementPolicy:
  """The threshold ``serialize_row_threshold`` described."""
  if isinstance(data, dict):
    disk = data.get("disk")
    return PlacementPolicy(
      data["threshold"],
      data["forced"],
      IN_MEMORY if disk is None else DiskTier(**disk),
    )
  return data
