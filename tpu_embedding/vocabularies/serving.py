"""Serving lookups of dynamic tables: raw keys become rows first.

A serving lookup (``serving.lookup_with_readers``, what
``export.ServingLookup`` and SavedModels run) maps each key of a dynamic
table to its row with the vocabulary as it is (``transition.find``:
TensorFlow ops only; keys without a row get the default row), then looks
the rows up as ids of a fixed table of ``vocabulary_size + 1`` rows.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.resolved import resolve
  >>> table = tpe.TableConfig(4, 2, name="t",
  ...                         vocabulary=tpe.DynamicVocabulary(bucket_size=4))
  >>> feature = resolve(tpe.FeatureConfig(table), None).features[0]
  >>> rows, fixed = rows_input(
  ...     tf.constant(["a", "b"]), feature, "f", lambda keys: keys % 4)
  Traceback (most recent call last):
  ...
  ValueError: Input f has keys of dtype string; table 't' has a \
DynamicVocabulary taking int32 or int64 keys.
  >>> rows, fixed = rows_input(
  ...     tf.constant([7, 9]), feature, "f", lambda keys: keys % 4)
  >>> rows.numpy().tolist(), fixed.table.vocabulary, fixed.table.vocabulary_size
  ([3, 1], None, 5)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tpu_embedding import errors
from tpu_embedding.config import FeatureConfig
from tpu_embedding.resolved import table_name
from tpu_embedding.vocabularies.buckets import key_ids
from tpu_embedding.vocabularies.config import capacity_of

#: Maps int64 keys (any shape) to int64 rows.
KeysToRows = Callable[[tf.Tensor], tf.Tensor]


def check_key_dtype(dtype: tf.DType, feature: FeatureConfig, path: str) -> None:
  """Raises unless ``dtype`` is a key dtype of ``feature``'s table.

  Raises:
    ValueError: naming the input, the table and the dtype expected.
  """
  vocabulary = feature.table.vocabulary
  assert vocabulary is not None
  strings = vocabulary.key_dtype == tf.string
  if (dtype == tf.string) != strings or not (strings or dtype.is_integer):
    raise ValueError(
      errors.DYNAMIC_KEY_DTYPE.format(
        path=path,
        dtype=dtype.name,
        table=table_name(feature.table),
        expected="tf.string" if strings else "int32 or int64",
      )
    )


def rows_input(
  inp: Any, feature: FeatureConfig, path: str, rows_of: KeysToRows
) -> tuple[Any, FeatureConfig]:
  """``(inp with rows for keys, feature on a fixed table)``.

  Args:
    inp: raw keys: a dense, sparse or ragged tensor.
    feature: a feature of a dynamic table (the user's or resolved).
    path: the feature path, for errors.
    rows_of: int64 keys to rows.
  """
  if not isinstance(inp, (tf.Tensor, tf.SparseTensor, tf.RaggedTensor)):
    return inp, feature  # The lookup names the type.
  check_key_dtype(inp.dtype, feature, path)
  rows = capacity_of(feature.table) + 1  # With the default row.
  fixed = feature.replace(
    table=feature.table.replace(vocabulary=None, vocabulary_size=rows)
  )
  return map_values(inp, lambda keys: rows_of(key_ids(keys))), fixed


def map_values(inp: Any, fn: Callable[[tf.Tensor], tf.Tensor]) -> Any:
  """``inp`` (dense, sparse or ragged) with ``fn`` applied to its values.

  Example:
    >>> import tensorflow as tf
    >>> map_values(tf.ragged.constant([[1], [2, 3]]), lambda v: v * 10)
    <tf.RaggedTensor [[10], [20, 30]]>
  """
  if isinstance(inp, tf.Tensor):
    return fn(inp)
  if isinstance(inp, tf.SparseTensor):
    return tf.SparseTensor(inp.indices, fn(inp.values), inp.dense_shape)
  return inp.with_flat_values(fn(inp.flat_values))
