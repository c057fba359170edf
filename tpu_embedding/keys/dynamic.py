"""A dynamic table's key mapping: raw keys become rows by its vocabulary.

A table declared with a ``DynamicVocabulary`` of capacity ``C`` holds
``C + 1`` rows: rows ``[0, C)`` are given to keys as they come, row ``C``
is the default row (what keys without a row read; never updated).
``DynamicMapping`` is what its resolved table carries (``keys``):

* inputs: raw keys of the vocabulary's dtype become int64 keys
  (``buckets.key_ids``; a string key must not be empty), never checked
  against the rows; the engine maps them to rows before reading
  (``dynamic_tables.py``);
* serving lookups (``serving.lookup_with_readers``, what
  ``export.ServingLookup`` and SavedModels run) map each key with the
  state as it is (``transition.find``: TensorFlow ops only), then read
  the rows as ids;
* updates drop the default row; the table is never stacked, and
  TensorFlow's TPU embedding does not hold it.

``declared_mapping`` turns a table's declaration into its mapping.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> mapping = declared_mapping(tpe.DynamicVocabulary(bucket_size=4), 4)
  >>> mapping.capacity, mapping.default_row, mapping.rows
  (4, 4, 5)
  >>> mapping.serving_rows(tf.constant(["a"]), "f", "t", lambda k: k % 4)
  Traceback (most recent call last):
  ...
  ValueError: Input f has keys of dtype string; table 't' has a \
DynamicVocabulary taking int32 or int64 keys.
  >>> rows = mapping.serving_rows(tf.constant([7, 9]), "f", "t",
  ...                             lambda keys: keys % 4)
  >>> rows.numpy().tolist()
  [3, 1]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tpu_embedding import errors
from tpu_embedding.gradients import RowGradients
from tpu_embedding.gradients import concat_pieces
from tpu_embedding.gradients import keep_rows
from tpu_embedding.keys import IdentityMapping
from tpu_embedding.keys import KeyMapping
from tpu_embedding.keys.buckets import key_ids
from tpu_embedding.keys.vocabulary import DynamicVocabulary


def declared_mapping(
  vocabulary: DynamicVocabulary | None, vocabulary_size: int
) -> KeyMapping:
  """The mapping a ``TableConfig``'s declaration gives: ids are rows
  without a vocabulary; with one, ``capacity`` rows for keys (None: the
  ``vocabulary_size``) and the default row."""
  if vocabulary is None:
    return IdentityMapping(vocabulary_size)
  capacity = vocabulary.capacity
  return DynamicMapping(
    vocabulary.replace(
      capacity=vocabulary_size if capacity is None else capacity
    )
  )


@dataclasses.dataclass(frozen=True)
class DynamicMapping(KeyMapping):
  """Keys to rows by a ``DynamicVocabulary`` (its capacity set).

  Attributes:
    vocabulary: the rules, ``capacity`` given.
  """

  vocabulary: DynamicVocabulary

  inputs_are_rows = False
  unstackable = "a table with a DynamicVocabulary is never stacked"

  @property
  def capacity(self) -> int:
    """Rows given to keys."""
    assert self.vocabulary.capacity is not None
    return self.vocabulary.capacity

  @property
  def default_row(self) -> int:
    """The row keys without one read: ``default_value``, never updated."""
    return self.capacity

  @property
  def rows(self) -> int:
    return self.capacity + 1

  def input_ids(self, inp, path, table):
    if not isinstance(inp, (tf.Tensor, tf.SparseTensor, tf.RaggedTensor)):
      return inp, []  # check_input_type names the type.
    self.check_key_dtype(inp.dtype, path, table)
    checks = []

    def to_keys(values: tf.Tensor) -> tf.Tensor:
      if values.dtype == tf.string:
        empty = tf.equal(tf.strings.length(values), 0)
        checks.append(
          (
            ~tf.reduce_any(empty),
            errors.EMPTY_STRING_KEYS.format(path=path, table=table),
          )
        )
      return key_ids(values)

    return map_values(inp, to_keys), checks

  def check_signature_dtype(self, dtype, name, path, table):
    del path
    self.check_key_dtype(dtype, name, table)

  def serving_rows(self, inp, path, table, translate):
    if translate is None:
      raise ValueError(errors.DYNAMIC_EXPORT.format(tables=[table]))
    if not isinstance(inp, (tf.Tensor, tf.SparseTensor, tf.RaggedTensor)):
      return inp  # The lookup names the type.
    self.check_key_dtype(inp.dtype, path, table)
    return map_values(inp, lambda keys: translate(key_ids(keys)))

  def check_on_tpu(self, table):
    raise ValueError(errors.DYNAMIC_ON_TPU.format(table=table))

  def updated_rows(self, ids, grads, index):
    """Most steps have no key without a row: then nothing is copied."""
    keep = tf.not_equal(ids, self.default_row)

    def drop():
      return keep_rows(ids, grads, index, keep)

    def as_they_are():
      return ids, concat_pieces(grads), index

    ids, rows, index = tf.cond(tf.reduce_all(keep), as_they_are, drop)
    return ids, RowGradients.dense(rows), index

  def check_key_dtype(
    self, dtype: tf.DType, path: str, table: str | None
  ) -> None:
    """Raises unless ``dtype`` is a key dtype of this vocabulary.

    Raises:
      ValueError: naming the input, the table and the dtype expected.
    """
    strings = self.vocabulary.key_dtype == tf.string
    if (dtype == tf.string) != strings or not (strings or dtype.is_integer):
      raise ValueError(
        errors.DYNAMIC_KEY_DTYPE.format(
          path=path,
          dtype=dtype.name,
          table=table,
          expected="tf.string" if strings else "int32 or int64",
        )
      )


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
