"""A dynamic table's vocabulary state: one copy, or one shard, per replica.

Every replica runs the vocabulary's step (``transition.advance``) on the
global batch's keys. For a replicated table each local replica keeps a
whole copy of the state, and the copies stay equal without exchanging
state. For a row-sharded table the state is sharded like the rows: replica
``r`` of ``R`` keeps the rows and buckets of shard ``r``
(``buckets.BucketLayout``), and the replicas combine their answers
(``sharing.py``). The state is small next to the rows (three int64 per
row and per probation entry).

Checkpoints hold the whole state once, under the table's key
``<table>/vocabulary`` (``keys``, ``last_step``, ``counts``, the
probation's, ``step``, ``evictions``), whatever the layout: shards are
put side by side (across workers: written as slices by
``tpu_embedding.checkpoints``, gathered by a plain save), and a restore
gives each copy or shard its part, so it moves between replica counts and
layouts.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> state = ReplicatedVocabulary(tpe.DynamicVocabulary(bucket_size=2), 4,
  ...                              [None])
  >>> sorted(state._serialize_to_tensors())[:4]
  ['counts', 'evictions', 'keys', 'last_step']
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.keys.vocabulary import DynamicVocabulary
from tpu_embedding.vocabularies.sharing import ReplicaSharing
from tpu_embedding.vocabularies.transition import VocabularyVariables
from tpu_embedding.vocabularies.transition import advance
from tpu_embedding.vocabularies.transition import find


def variables_on(
  device: str | None,
  vocabulary: DynamicVocabulary,
  capacity: int,
  shard: int = 0,
  num_shards: int = 1,
) -> VocabularyVariables:
  """A vocabulary's variables (of one shard) on ``device``: plain
  variables of that device, never mirrored (even inside a strategy's
  scope)."""

  def plain_variable(next_creator, **kwargs):
    del next_creator
    return compat.ResourceVariable(
      initial_value=kwargs["initial_value"],
      trainable=False,
      name=kwargs.get("name"),
    )

  with tf.init_scope(), tf.device(device):
    with tf.variable_creator_scope(plain_variable):
      return VocabularyVariables(vocabulary, capacity, shard, num_shards)


class VocabularyState(compat.Trackable, abc.ABC):
  """A vocabulary's variables on every local replica, saved as one.

  The layouts (``ReplicatedVocabulary``, ``ShardedVocabulary``) share one
  interface: ``step`` (a training step on the global batch's keys),
  ``lookup`` (keys to rows with the state as it is) and ``whole`` (the
  whole state's values, what checkpoints hold).

  Args:
    vocabulary: the configuration.
    capacity: the table's rows for keys.
    copies: each local replica's variables (a copy, or a shard).
  """

  def __init__(
    self,
    vocabulary: DynamicVocabulary,
    capacity: int,
    copies: list[VocabularyVariables],
  ):
    self.vocabulary = vocabulary
    self.capacity = capacity
    self.copies = copies

  def copy(self, replica: int) -> VocabularyVariables:
    """The copy (or shard) of local replica ``replica``."""
    return self.copies[replica]

  @abc.abstractmethod
  def step(
    self,
    occurrences: tf.Tensor,
    replica: int,
    sharing: ReplicaSharing,
    ops: StepOps,
  ) -> tuple[tf.Tensor, tf.Tensor]:
    """A training step on the global batch's key ``occurrences`` (every
    replica's, in order), on local replica ``replica``'s variables, by
    the step's row ops ``ops`` (``kernels/ops.py``).

    Returns:
      ``(rows, new_rows)``: every occurrence's row, and every row given
      to a new key (the same on every replica).
    """

  @abc.abstractmethod
  def lookup(
    self, keys: list[tf.Tensor], replica: int, sharing: ReplicaSharing
  ) -> list[tf.Tensor]:
    """The rows of this replica's ``keys`` (any shapes), with the state
    as it is (in replica context, or outside for a direct lookup)."""

  @abc.abstractmethod
  def whole(self) -> dict[str, tf.Tensor]:
    """The whole state's values, by variable name."""

  @abc.abstractmethod
  def find_live(self, keys: tf.Tensor) -> tf.Tensor:
    """Rows of ``keys`` with the state as it is now, from this process
    (serving lookups outside ``strategy.run``)."""

  def snapshot(self) -> VocabularyVariables:
    """Plain CPU variables holding the whole state now (what a SavedModel
    holds)."""
    whole = variables_on("/CPU:0", self.vocabulary, self.capacity)
    values = self.whole()
    with tf.init_scope():
      for name, variable in whole.variables.items():
        variable.assign(values[name])
    return whole

  def _serialize_to_tensors(self) -> dict[str, Any]:
    return self.whole()

  def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> Any:
    return self._restore_ranges(restored_tensors, None)

  def _restore_ranges(
    self, restored: dict[str, Any], origins: dict[str, int] | None
  ) -> Any:
    """Assigns each copy its part of the restored arrays: the whole
    arrays (``origins`` None, checked), or array ``name``'s elements from
    ``origins[name]`` on."""
    for name, (size, _, _) in self.copies[0].extents().items():
      shape = restored[name].shape
      if origins is None and shape != [size]:
        raise ValueError(
          f"The checkpoint's vocabulary '{name}' has shape {shape}; this "
          f"table's has {[size]} (capacity {self.capacity}, bucket_size "
          f"{self.vocabulary.bucket_size}, probation_size "
          f"{self.vocabulary.probation_size})."
        )
    assigns = []
    for variables in self.copies:
      extents = variables.extents()
      for name, variable in variables.variables.items():
        value = restored[name]
        if name in extents:
          _, start, length = extents[name]
          start -= 0 if origins is None else origins[name]
          value = value[start : start + length]
        elif name == "evictions" and variables.layout.shard > 0:
          # The total is kept by shard 0; the others count from zero.
          value = tf.zeros_like(value)
        assigns.append(variable.assign(value))
    return tf.group(assigns)


class ReplicatedVocabulary(VocabularyState):
  """A whole copy of the state on every local replica (replicated
  tables): every replica runs the same step, so the copies stay equal.

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
    super().__init__(
      vocabulary,
      capacity,
      [variables_on(device, vocabulary, capacity) for device in devices],
    )

  def step(self, occurrences, replica, sharing, ops):
    del sharing  # Every copy decides alone, and alike.
    result = advance(self.copies[replica], occurrences, ops)
    return result.rows, result.new_rows

  def lookup(self, keys, replica, sharing):
    del sharing
    return [find(self.copies[replica], k) for k in keys]

  def whole(self):
    return {
      name: variable.read_value()
      for name, variable in self.copies[0].variables.items()
    }

  def find_live(self, keys):
    return find(self.copies[0], keys)
