"""Key mappings: how a table's inputs become its rows.

A ``TableConfig`` declares what its inputs are: ids that are rows (the
default), or raw keys that a ``DynamicVocabulary`` gives rows to as they
come. ``resolve`` turns the declaration into the ``KeyMapping`` that the
resolved table carries (``resolved.ResolvedTable``; ``resolved.key_mapping``
answers for any table), with the rows the table holds. Whatever handles a
table's inputs asks its mapping, never the declaration:

==========================  =============================================
who                         asks
==========================  =============================================
``inputs.prepare_feature``  ``input_ids``, ``inputs_are_rows``
``serving`` lookups         ``serving_rows``
``export.signature``        ``check_signature_dtype``
``stacking``                ``unstackable``
the TPU engines             ``check_on_tpu``
``OffTPUEngine``            ``updated_rows``
==========================  =============================================

The mappings: ``IdentityMapping`` (here), a fixed table's: ids are rows;
``DynamicMapping`` (``dynamic.py``): keys get rows ``[0, capacity)`` from
the state of the table's ``DynamicVocabulary`` (``vocabulary.py``, keys in
buckets: ``buckets.py``), and keys without a row read the default row.

Example:
  >>> import tensorflow as tf
  >>> mapping = IdentityMapping(10)
  >>> mapping.rows, mapping.inputs_are_rows, mapping.unstackable
  (10, True, None)
  >>> mapping.serving_rows(tf.constant([3]), "f", "t", None).numpy().tolist()
  [3]
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any
from typing import TypeAlias
from typing import Union

import tensorflow as tf

from tpu_embedding.gradients import RowGradients

#: One input feature: ids as a dense tensor, a sparse tensor or a ragged one.
FeatureInput: TypeAlias = Union[tf.Tensor, tf.SparseTensor, tf.RaggedTensor]

#: Maps int64 keys (any shape) to int64 rows: a dynamic table's state, as
#: it is (serving lookups and exports).
KeysToRows = Callable[[tf.Tensor], tf.Tensor]

#: A runtime check of an input: ``(valid, message)``, ``valid`` a scalar
#: bool tensor (``inputs.Check``).
KeyCheck = tuple[tf.Tensor, str]


class KeyMapping(abc.ABC):
  """How one table's inputs become its rows (its lookup's and update's).

  ``table`` arguments are table names, for messages.
  """

  #: Whether the ids a lookup groups are rows, checked in ``[0, rows)``
  #: (else keys, mapped to rows before the rows are read).
  inputs_are_rows: bool = True

  #: Why the table is never stacked with others (``stacking.py``), or
  #: None where it may be.
  unstackable: str | None = None

  @property
  @abc.abstractmethod
  def rows(self) -> int:
    """The rows the table holds: its resolved ``vocabulary_size``."""

  @abc.abstractmethod
  def input_ids(
    self, inp: FeatureInput, path: str, table: str | None
  ) -> tuple[FeatureInput, list[KeyCheck]]:
    """``inp`` as the integer ids a lookup groups, and their runtime
    checks.

    Raises:
      ValueError: for an input this mapping does not take (naming
        ``path``).
    """

  @abc.abstractmethod
  def check_signature_dtype(
    self, dtype: tf.DType, name: str, path: str, table: str | None
  ) -> None:
    """Raises unless a serving signature's input ``name`` (feature
    ``path``) may have ``dtype``.

    Raises:
      ValueError: naming the input and what it takes.
    """

  @abc.abstractmethod
  def serving_rows(
    self,
    inp: Any,
    path: str,
    table: str | None,
    translate: KeysToRows | None,
  ) -> Any:
    """``inp`` (dense, sparse or ragged) with rows for its values.

    Args:
      inp: a serving input.
      path: the feature path, for errors.
      table: the table's name, for errors.
      translate: the table's keys to rows (its state), where given.

    Raises:
      ValueError: where keys need a state that was not given, or have
        the wrong dtype.
    """

  @abc.abstractmethod
  def check_on_tpu(self, table: str | None) -> None:
    """Raises where TensorFlow's TPU embedding cannot hold the table.

    Raises:
      ValueError: naming the table and why.
    """

  @abc.abstractmethod
  def updated_rows(
    self, ids: tf.Tensor, grads: RowGradients, index: tf.Tensor
  ) -> tuple[tf.Tensor, RowGradients, tf.Tensor]:
    """An update ``(ids, grads, index)`` (``lookup.occurrence_gradients``)
    without the rows an update must not change."""


@dataclasses.dataclass(frozen=True)
class IdentityMapping(KeyMapping):
  """A fixed table's mapping: ids are rows, every row updates.

  Attributes:
    size: the table's ``vocabulary_size``.
  """

  size: int

  @property
  def rows(self) -> int:
    return self.size

  def input_ids(self, inp, path, table):
    del path, table  # check_input_type and the range check tell.
    return inp, []

  def check_signature_dtype(self, dtype, name, path, table):
    del name
    if dtype == tf.string:
      raise ValueError(
        f"Feature {path!r} takes integer ids (table {table!r} has no "
        "DynamicVocabulary of strings)."
      )

  def serving_rows(self, inp, path, table, translate):
    del path, table, translate
    return inp

  def check_on_tpu(self, table):
    del table

  def updated_rows(self, ids, grads, index):
    return ids, grads, index
