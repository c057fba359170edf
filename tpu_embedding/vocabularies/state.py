"""A dynamic table's vocabulary state: one copy per local replica.

Every replica runs the same step (``transition.advance``) on the global
batch's keys, so the copies stay equal without exchanging state; each
maps its own keys with its own copy. The state is small next to the rows
(three int64 per row and per probation entry).

Checkpoints hold one copy under the table's key ``<table>/vocabulary``
(``keys``, ``last_step``, ``counts``, the probation's, ``step``); a
restore writes every copy, so it moves between replica counts.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> state = VocabularyState(tpe.DynamicVocabulary(bucket_size=2), 4, [None])
  >>> sorted(state._serialize_to_tensors())[:4]
  ['counts', 'evictions', 'keys', 'last_step']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.vocabularies.config import DynamicVocabulary
from tpu_embedding.vocabularies.transition import VocabularyVariables


def variables_on(
  device: str | None, vocabulary: DynamicVocabulary, capacity: int
) -> VocabularyVariables:
  """A vocabulary's variables on ``device``: plain variables of that
  device, never mirrored (even inside a strategy's scope)."""

  def plain_variable(next_creator, **kwargs):
    del next_creator
    return compat.ResourceVariable(
      initial_value=kwargs["initial_value"],
      trainable=False,
      name=kwargs.get("name"),
    )

  with tf.init_scope(), tf.device(device):
    with tf.variable_creator_scope(plain_variable):
      return VocabularyVariables(vocabulary, capacity)


class VocabularyState(compat.Trackable):
  """Equal copies of a vocabulary's variables, saved as one.

  Args:
    vocabulary: the configuration.
    capacity: the table's rows for keys.
    devices: one device per local replica (None: the default device).
  """

  def __init__(
    self,
    vocabulary: DynamicVocabulary,
    capacity: int,
    devices: Sequence[str | None],
  ):
    self.vocabulary = vocabulary
    self.capacity = capacity
    self.copies = [
      variables_on(device, vocabulary, capacity) for device in devices
    ]

  def copy(self, replica: int) -> VocabularyVariables:
    """The copy of local replica ``replica``."""
    return self.copies[replica]

  def _serialize_to_tensors(self) -> dict[str, Any]:
    return {
      name: variable.read_value()
      for name, variable in self.copies[0].variables.items()
    }

  def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> Any:
    assigns = []
    for variables in self.copies:
      for name, variable in variables.variables.items():
        value = restored_tensors[name]
        if value.shape != variable.shape:
          raise ValueError(
            f"The checkpoint's vocabulary '{name}' has shape "
            f"{value.shape}; this table's has {variable.shape} (capacity "
            f"{self.capacity}, bucket_size {self.vocabulary.bucket_size}, "
            f"probation_size {self.vocabulary.probation_size})."
          )
        assigns.append(variable.assign(value))
    return tf.group(assigns)
