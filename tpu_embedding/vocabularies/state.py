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
put side by side (gathered across workers under
``MultiWorkerMirroredStrategy``, a collective), and a restore gives each
copy or shard its part, so it moves between replica counts and layouts.

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


#: Per-row and per-probation-entry arrays (sharded), and the scalars.
_ROW_ARRAYS = ("keys", "last_step", "counts")
_ENTRY_ARRAYS = ("probation_keys", "probation_last_step", "probation_counts")


class VocabularyState(compat.Trackable):
  """A vocabulary's variables on every local replica, saved as one.

  Args:
    vocabulary: the configuration.
    capacity: the table's rows for keys.
    devices: one device per local replica (None: the default device).
    first_shard: the first local replica's shard (sharded state only).
    num_shards: 1: every local replica holds a whole copy; else the
      number of shards (all replicas), local replica ``i`` holding shard
      ``first_shard + i``.
    strategy: the strategy, to gather shards held by other workers.
  """

  def __init__(
    self,
    vocabulary: DynamicVocabulary,
    capacity: int,
    devices: Sequence[str | None],
    first_shard: int = 0,
    num_shards: int = 1,
    strategy: tf.distribute.Strategy | None = None,
  ):
    self.vocabulary = vocabulary
    self.capacity = capacity
    self.num_shards = num_shards
    self._strategy = strategy
    self._first = first_shard
    self.copies = [
      variables_on(
        device,
        vocabulary,
        capacity,
        first_shard + i if num_shards > 1 else 0,
        num_shards,
      )
      for i, device in enumerate(devices)
    ]

  @property
  def sharded(self) -> bool:
    """Whether each replica holds one shard (not a whole copy)."""
    return self.num_shards > 1

  def copy(self, replica: int) -> VocabularyVariables:
    """The copy (or shard) of local replica ``replica``."""
    return self.copies[replica]

  def whole(self) -> dict[str, tf.Tensor]:
    """The whole state's values, by variable name (shards side by side;
    across workers a collective every worker joins)."""
    if not self.sharded:
      return {
        name: variable.read_value()
        for name, variable in self.copies[0].variables.items()
      }
    shards = self._all_shards()
    whole = {
      name: tf.concat([shard[name] for shard in shards], 0)
      for name in _ROW_ARRAYS + _ENTRY_ARRAYS
    }
    whole["step"] = shards[0]["step"]
    whole["evictions"] = tf.add_n([shard["evictions"] for shard in shards])
    return whole

  def whole_variables(self) -> VocabularyVariables:
    """Copy 0 itself when it is whole, else a CPU snapshot of the whole
    state (for lookups outside the replicas: serving, export)."""
    if not self.sharded:
      return self.copies[0]
    whole = variables_on("/CPU:0", self.vocabulary, self.capacity)
    values = self.whole()
    with tf.init_scope():
      for name, variable in whole.variables.items():
        variable.assign(values[name])
    return whole

  def _all_shards(self) -> list[dict[str, tf.Tensor]]:
    """Every shard's values, in shard order."""
    local = [
      {name: v.read_value() for name, v in copy.variables.items()}
      for copy in self.copies
    ]
    if len(local) == self.num_shards:
      return local
    return self._gather_from_workers(local)

  def _gather_from_workers(self, local):
    """Every worker's shards (``MultiWorkerMirroredStrategy``)."""
    strategy = self._strategy
    assert strategy is not None, "sharded state across workers"
    layouts = [
      VocabularyVariables.layout_of(
        self.vocabulary, self.capacity, shard, self.num_shards
      )
      for shard in range(self.num_shards)
    ]
    probation = self.copies[0].probation
    sizes = {
      **{n: [lay.local_rows for lay in layouts] for n in _ROW_ARRAYS},
      **{
        n: [lay.num_local_buckets * probation for lay in layouts]
        for n in _ENTRY_ARRAYS
      },
      "step": [1] * self.num_shards,
      "evictions": [1] * self.num_shards,
    }
    shards: list[dict[str, tf.Tensor]] = [{} for _ in layouts]
    for name, lengths in sizes.items():
      width = max(max(lengths), 1)

      def padded(context, name=name, width=width):
        value = local[context.replica_id_in_sync_group - self._first][name]
        value = tf.reshape(value, [-1])
        return tf.pad(value, [[0, width - tf.size(value)]])

      stacked = strategy.gather(
        strategy.experimental_distribute_values_from_function(padded), axis=0
      )
      for shard, length in enumerate(lengths):
        value = stacked[shard * width : shard * width + length]
        scalar = name in ("step", "evictions")
        shards[shard][name] = value[0] if scalar else value
    return shards

  def _serialize_to_tensors(self) -> dict[str, Any]:
    return self.whole()

  def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> Any:
    whole = VocabularyVariables.layout_of(self.vocabulary, self.capacity)
    probation = self.copies[0].probation
    expected = {
      **dict.fromkeys(_ROW_ARRAYS, [whole.local_rows]),
      **dict.fromkeys(_ENTRY_ARRAYS, [whole.num_buckets * probation]),
    }
    for name, shape in expected.items():
      value = restored_tensors[name]
      if value.shape != shape:
        raise ValueError(
          f"The checkpoint's vocabulary '{name}' has shape "
          f"{value.shape}; this table's has {shape} (capacity "
          f"{self.capacity}, bucket_size {self.vocabulary.bucket_size}, "
          f"probation_size {self.vocabulary.probation_size})."
        )
    assigns = []
    for variables in self.copies:
      layout = variables.layout
      parts = {
        **dict.fromkeys(_ROW_ARRAYS, (layout.row_offset, layout.local_rows)),
        **dict.fromkeys(
          _ENTRY_ARRAYS,
          (
            layout.first_bucket * probation,
            layout.num_local_buckets * probation,
          ),
        ),
      }
      for name, variable in variables.variables.items():
        value = restored_tensors[name]
        if name in parts:
          start, size = parts[name]
          value = value[start : start + size]
        elif name == "evictions" and layout.shard > 0:
          # The total is kept by shard 0; the others count from zero.
          value = tf.zeros_like(value)
        assigns.append(variable.assign(value))
    return tf.group(assigns)
