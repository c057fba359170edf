"""Shared type aliases for the public API.

Feature configs, inputs, weights, activations and gradients are *nests*:
a leaf, or lists, tuples (namedtuples included) and dicts with string
keys of nests, as ``tf.nest`` understands them. ``Nest[T]`` is such a nest
of ``T``; the named aliases below say what the leaves are. The inputs,
weights, activations and gradients of one call have the structure of the
feature config they belong to.

The nests taken as arguments are exact unions. TensorFlow ships no type
information, so its classes (``tf.Tensor``, ...) are ``Any`` to a type
checker and only ``FeatureConfigNest`` is checked leaf by leaf.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.types import FeatureConfigNest, FeatureNest
  >>> from tpu_embedding.types import LearningRate
  >>> lr: LearningRate = 0.1
  >>> table = tpe.TableConfig(vocabulary_size=10, dim=4)
  >>> config: FeatureConfigNest = {
  ...     "user": tpe.FeatureConfig(table),
  ...     "history": [tpe.FeatureConfig(table), tpe.FeatureConfig(table)],
  ... }
  >>> features: FeatureNest = {
  ...     "user": tf.constant([1, 2]),
  ...     "history": [tf.ragged.constant([[1], [2, 3]]),
  ...                 tf.ragged.constant([[], [4]])],
  ... }
  >>> tf.nest.assert_same_structure(config, features)
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import TypeAlias
from typing import TypeVar
from typing import Union

import tensorflow as tf

# The aliases of one concern live with it and are gathered here (the feature
# config nest with FeatureConfig, Initializer with the initializers, the
# hyper-parameters' with the optimizers, an input feature with the key
# mappings): those modules never import this one, so imports flow one way.
from tpu_embedding.config import FeatureConfigNest
from tpu_embedding.initializers import Initializer
from tpu_embedding.keys import FeatureInput
from tpu_embedding.optimizers.base import ClipValue
from tpu_embedding.optimizers.base import LearningRate

__all__ = [
  "ActivationsNest",
  "ClipValue",
  "FeatureConfigNest",
  "FeatureInput",
  "FeatureNest",
  "GradientsNest",
  "Initializer",
  "InputShapes",
  "LearningRate",
  "Nest",
  "Nested",
  "WeightsNest",
]

T = TypeVar("T")

#: A nest of ``T``: a ``T``, or a list, tuple or namedtuple of nests, or a
#: dict from strings to nests.
Nest: TypeAlias = Union[T, Sequence["Nest[T]"], Mapping[str, "Nest[T]"]]

#: The ids of one batch: a nest of ``FeatureInput`` shaped like the config.
FeatureNest: TypeAlias = Nest[FeatureInput]

#: Per-id weights: like ``FeatureNest`` (each the kind of its ids, sparse or
#: ragged), None for a feature without weights.
WeightsNest: TypeAlias = Nest[FeatureInput | None]

#: Activations: a nest of float tensors shaped like the config, each
#: ``output_shape + [dim]``. Returned, and indexed by the caller as the
#: config is (``activations["user"]``), which a union would forbid without a
#: check: so it is ``Any``, under this name.
ActivationsNest: TypeAlias = Any

#: Gradients of the activations, shaped like them; None is a zero gradient.
GradientsNest: TypeAlias = Nest[tf.Tensor | None]

#: Per-replica input shapes for ``build``, a nest shaped like the config.
InputShapes: TypeAlias = Nest[tf.TensorShape]

#: Any nest (dict, list, tuple, namedtuple) of values.
Nested: TypeAlias = Nest[Any]
