"""Serving signature inputs: ``FeatureSpec`` and the padded-id convention.

A SavedModel signature takes dense tensors only. ``FeatureSpec`` declares
the id tensor of an embedding feature (how each shape is fed and looked up
is tabled in ``tpu_embedding.export.saved_model``); ``padded_to_sparse``
turns ids padded with ``PADDING_ID`` (-1) into a ``tf.SparseTensor``; and
``validate_signature`` checks a signature against a feature config and a
table selection before anything is exported.

Example:
  >>> from tpu_embedding.export import FeatureSpec
  >>> sorted(FeatureSpec([None, None], weights=True).tensor_specs("history"))
  ['history', 'history_weights']
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding.config import FeatureConfig
from tpu_embedding.export.subset import TableSelection
from tpu_embedding.export.subset import TableSubset
from tpu_embedding.resolved import key_mapping
from tpu_embedding.structure import flatten_with_paths
from tpu_embedding.types import FeatureConfigNest

#: The id that pads a ``[B, L]`` id tensor; such entries are no ids.
PADDING_ID = -1

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  """One embedding feature of a serving signature: its dense id tensor.

  Attributes:
    shape: the id tensor's shape, batch first. ``[None]``: one id per
      example (a dense lookup). ``[None, L]`` (``L`` an int or None):
      up to ``L`` ids per example, padded with ``PADDING_ID`` (-1), for
      the table's combiner or a sequence feature. Higher ranks pad the
      last dimension (``[B, S, L]`` gives ``(B, S, dim)``).
    dtype: ``tf.int64`` or ``tf.int32``; ``tf.string`` for a table with
      a ``DynamicVocabulary`` of string keys (padded with ``""``).
    weights: also take ``<name>_weights``, float32 of the same shape
      (rank >= 2 only, not for sequence features).
    feature: the feature path in the feature config (``"query/user"``
      for nested configs); defaults to the signature input's name.
    padding: the value that pads ``[B, L]`` inputs (never looked up);
      None: ``PADDING_ID`` (-1) for ids, ``""`` for string keys. A
      ``DynamicVocabulary`` of int keys where -1 is a key takes another.

  Example:
    >>> from tpu_embedding.export import FeatureSpec
    >>> FeatureSpec([None, 5], weights=True).tensor_specs("genres")
    {'genres': TensorSpec(shape=(None, 5), dtype=tf.int64, name='genres'), \
'genres_weights': TensorSpec(shape=(None, 5), dtype=tf.float32, \
name='genres_weights')}
  """

  shape: Sequence[int | None] = (None,)
  dtype: tf.DType = tf.int64
  weights: bool = False
  feature: str | None = None
  padding: int | str | None = None

  def __post_init__(self) -> None:
    shape = tf.TensorShape(self.shape)
    if shape.rank is not None:  # hashable and printable like TensorSpec's
      object.__setattr__(self, "shape", tuple(shape.as_list()))
    if shape.rank is None or shape.rank < 1:
      raise ValueError(
        f"FeatureSpec shape must be [batch] or [batch, ..., ids], got "
        f"{self.shape!r}."
      )
    if tf.as_dtype(self.dtype) not in (tf.int32, tf.int64, tf.string):
      raise ValueError(
        "FeatureSpec dtype must be tf.int32 or tf.int64 (or tf.string for "
        f"string keys), got {self.dtype!r}."
      )
    strings = tf.as_dtype(self.dtype) == tf.string
    if self.padding is not None and (
      isinstance(self.padding, bool)
      or not isinstance(self.padding, str if strings else int)
    ):
      raise ValueError(
        f"FeatureSpec padding must be {'a str' if strings else 'an int'} "
        f"for dtype {tf.as_dtype(self.dtype).name}, got {self.padding!r}."
      )
    if self.weights and shape.rank < 2:
      raise ValueError(
        "FeatureSpec(weights=True) needs padded ids of shape [batch, L]: a "
        "rank-1 id tensor is a dense lookup, which takes no weights."
      )

  def tensor_specs(self, name: str) -> dict[str, tf.TensorSpec]:
    """The signature inputs of this feature when named ``name``."""
    specs = {name: tf.TensorSpec(self.shape, self.dtype, name=name)}
    if self.weights:
      specs[weights_name(name)] = tf.TensorSpec(
        self.shape, tf.float32, name=weights_name(name)
      )
    return specs


def weights_name(name: str) -> str:
  """The signature input holding the weights of feature input ``name``."""
  return f"{name}_weights"


def padded_to_sparse(
  ids: tf.Tensor,
  weights: tf.Tensor | None = None,
  padding: int | str | None = None,
) -> tuple[tf.SparseTensor, tf.SparseTensor | None]:
  """The ids ``!= padding`` of a padded tensor, as a SparseTensor.

  Args:
    ids: ``[B, ..., L]`` integer ids padded with ``PADDING_ID``, or
      string keys padded with ``""`` (or with ``padding``).
    weights: None, or float weights of the same shape (their values at
      padded positions are ignored).
    padding: the padding value; None: ``PADDING_ID`` or ``""``.

  Returns:
    ``(ids, weights)`` SparseTensors with the dense shape of ``ids``
    (weights None when not given).

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding.export import padded_to_sparse
    >>> sp, _ = padded_to_sparse(tf.constant([[3, -1], [-1, -1], [1, 2]]))
    >>> sp.indices.numpy().tolist(), sp.values.numpy().tolist()
    ([[0, 0], [2, 0], [2, 1]], [3, 1, 2])
  """
  if padding is None:
    padding = "" if ids.dtype == tf.string else PADDING_ID
  pad = tf.constant(padding, ids.dtype)
  indices = tf.where(tf.not_equal(ids, pad))
  dense_shape = tf.shape(ids, out_type=tf.int64)
  sparse_ids = tf.SparseTensor(indices, tf.gather_nd(ids, indices), dense_shape)
  if weights is None:
    return sparse_ids, None
  check = tf.debugging.assert_equal(
    tf.shape(weights, out_type=tf.int64),
    dense_shape,
    message="Weights must have the shape of their padded ids.",
  )
  with tf.control_dependencies([check]):
    values = tf.gather_nd(tf.cast(weights, tf.float32), indices)
  return sparse_ids, tf.SparseTensor(indices, values, dense_shape)


@dataclasses.dataclass(frozen=True)
class PreprocessedSignature:
  """Another signature of an export: its inputs preprocessed into the main
  signature's, then served alike (``export_for_serving(extra_signatures=
  {name: PreprocessedSignature(...)})``).

  Attributes:
    input_signature: ``{input name: tf.TensorSpec}`` of this signature.
    preprocess: TensorFlow ops (no variables) taking ``{input name:
      tensor}`` and returning ``{main signature input name: tensor}``,
      every input of the main signature with its dtype and a compatible
      shape; a request is then the main signature's on those tensors.

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding.export import PreprocessedSignature
    >>> raw = PreprocessedSignature(
    ...   {"hex_id": tf.TensorSpec([None], tf.string)},
    ...   lambda x: {"id": tf.strings.to_hash_bucket_fast(x["hex_id"], 10)})
    >>> sorted(raw.input_signature)
    ['hex_id']
  """

  input_signature: Mapping[str, tf.TensorSpec]
  preprocess: Callable[[dict[str, tf.Tensor]], Mapping[str, tf.Tensor]]

  def specs(self, name: str) -> dict[str, tf.TensorSpec]:
    """The signature's named input specs; ValueError if invalid."""
    if not isinstance(self.input_signature, Mapping) or not (
      self.input_signature
    ):
      raise ValueError(
        f"Signature {name!r}: input_signature must be a non-empty dict "
        "{input name: tf.TensorSpec}."
      )
    specs = {}
    for key, spec in self.input_signature.items():
      if not isinstance(key, str) or not _NAME.match(key):
        raise ValueError(
          f"Signature {name!r}: input name {key!r} must start with a letter "
          "and hold only letters, digits and '_'."
        )
      if not isinstance(spec, tf.TensorSpec):
        raise TypeError(
          f"Signature {name!r}: input {key!r} is a {type(spec).__name__}; "
          "expected a tf.TensorSpec (preprocess makes the main signature's "
          "inputs from it)."
        )
      specs[key] = tf.TensorSpec(spec.shape, spec.dtype, name=key)
    return specs


@dataclasses.dataclass(frozen=True)
class _Signature:
  """A parsed ``input_signature``: embedding features and dense inputs."""

  features: dict[str, tuple[FeatureSpec, str, FeatureConfig]]
  dense: dict[str, tf.TensorSpec]
  specs: dict[str, tf.TensorSpec]


def validate_signature(
  feature_config: FeatureConfigNest,
  input_signature: Mapping[str, FeatureSpec | tf.TensorSpec],
  tables: TableSelection = None,
) -> None:
  """Checks a serving signature against the feature config and tables.

  ``export_for_serving`` runs the same checks; this runs them before any
  table is restored or copied (``tools/export.py`` does).

  Raises:
    ValueError: for an unknown table or feature, a feature whose table is
      not selected, invalid names or specs.

  Example:
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding.export import FeatureSpec, validate_signature
    >>> config = {"user": tpe.FeatureConfig(tpe.TableConfig(9, 2, name="u")),
    ...           "item": tpe.FeatureConfig(tpe.TableConfig(9, 2, name="i"))}
    >>> validate_signature(config, {"item": FeatureSpec()}, tables=["u"])
    Traceback (most recent call last):
    ...
    ValueError: Feature 'item' is looked up in table 'i', which is not \
among the selected tables ['u']: add it to `tables` or drop the feature.
  """
  _parse_signature(input_signature, TableSubset(feature_config, tables))


def _parse_signature(
  input_signature: Mapping[str, FeatureSpec | tf.TensorSpec],
  subset: TableSubset,
) -> _Signature:
  if not isinstance(input_signature, Mapping) or not input_signature:
    raise ValueError(
      "input_signature must be a non-empty dict {input name: FeatureSpec "
      "or tf.TensorSpec}."
    )
  known = {path for path, _ in flatten_with_paths(subset.feature_config)}
  features: dict[str, tuple[FeatureSpec, str, FeatureConfig]] = {}
  dense: dict[str, tf.TensorSpec] = {}
  specs: dict[str, tf.TensorSpec] = {}
  for name, spec in input_signature.items():
    if not isinstance(name, str) or not _NAME.match(name):
      raise ValueError(
        f"Signature input name {name!r} must start with a letter and hold "
        "only letters, digits and '_'; name nested features with "
        "FeatureSpec(feature='a/b')."
      )
    if isinstance(spec, tf.TensorSpec) and name in known:
      spec = FeatureSpec(spec.shape, spec.dtype)  # ids of that feature
    if isinstance(spec, FeatureSpec):
      path = spec.feature or name
      feature = subset.feature(path)
      rank = tf.TensorShape(spec.shape).rank
      if feature.max_sequence_length > 0 and rank == 1:
        raise ValueError(
          f"Feature {path!r} is a sequence feature (max_sequence_length="
          f"{feature.max_sequence_length}): declare its ids as "
          "FeatureSpec([None, L]), padded with -1."
        )
      if feature.max_sequence_length > 0 and spec.weights and rank == 2:
        raise ValueError(
          f"Feature {path!r} is a sequence feature: it takes no weights."
        )
      key_mapping(feature.table).check_signature_dtype(
        tf.as_dtype(spec.dtype), name, path, feature.table.name
      )
      features[name] = (spec, path, feature)
      new = spec.tensor_specs(name)
    elif isinstance(spec, tf.TensorSpec):
      dense[name] = tf.TensorSpec(spec.shape, spec.dtype, name=name)
      new = {name: dense[name]}
    else:
      raise TypeError(
        f"input_signature[{name!r}] is a {type(spec).__name__}; expected "
        "a FeatureSpec (embedding ids) or a tf.TensorSpec (dense feature)."
      )
    clash = set(new) & (set(specs) | set(input_signature) - {name})
    if clash:
      raise ValueError(
        f"Signature input names {sorted(clash)} are used twice (weights "
        f"of feature {name!r} are named {weights_name(name)!r})."
      )
    specs.update(new)
  return _Signature(features, dense, specs)


def _activation_shape(
  spec: FeatureSpec, feature: FeatureConfig
) -> list[int | None]:
  shape = tf.TensorShape(spec.shape).as_list()
  dim = feature.table.dim
  if len(shape) == 1:
    return shape + [dim]
  if len(shape) == 2 and feature.max_sequence_length > 0:
    return [shape[0], feature.max_sequence_length, dim]
  return shape[:-1] + [dim]
