"""A row-sharded dynamic table's vocabulary state: one shard per replica.

Replica ``r`` of ``R`` holds shard ``r`` (``buckets.BucketLayout``): the
buckets ``[floor(r B / R), floor((r + 1) B / R))`` and their rows' keys,
last steps, counts and probation entries, so no replica, and no worker,
holds the whole map, as none holds the whole table. Every replica runs
the step on the global batch's keys for its own buckets (-1 for the
others' keys); the replicas then combine their answers, each key's from
the one shard that owns it, and learn every new row (``sharing.py``).

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> strategy = tf.distribute.get_strategy()
  >>> state = ShardedVocabulary(tpe.DynamicVocabulary(bucket_size=2), 4,
  ...                           [None], strategy)
  >>> state.copy(0).layout.local_rows  # one replica: one shard, all rows
  4
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding.replicas import first_local_replica
from tpu_embedding.vocabularies.config import DynamicVocabulary
from tpu_embedding.vocabularies.sharing import flat
from tpu_embedding.vocabularies.sharing import slices_of
from tpu_embedding.vocabularies.state import ENTRY_ARRAYS
from tpu_embedding.vocabularies.state import ROW_ARRAYS
from tpu_embedding.vocabularies.state import VocabularyState
from tpu_embedding.vocabularies.state import variables_on
from tpu_embedding.vocabularies.transition import VocabularyVariables
from tpu_embedding.vocabularies.transition import advance
from tpu_embedding.vocabularies.transition import find


class ShardedVocabulary(VocabularyState):
  """Shard ``first + i`` of the state on local replica ``i``.

  Args:
    vocabulary: the configuration.
    capacity: the table's rows for keys.
    devices: one device per local replica (None: the default device).
    strategy: its replicas are the shards; it gathers the shards other
      workers hold.
  """

  def __init__(
    self,
    vocabulary: DynamicVocabulary,
    capacity: int,
    devices: Sequence[str | None],
    strategy: tf.distribute.Strategy,
  ):
    self._strategy = strategy
    self._first = first_local_replica(strategy)
    self.num_shards = strategy.num_replicas_in_sync
    super().__init__(
      vocabulary,
      capacity,
      [
        variables_on(
          device, vocabulary, capacity, self._first + i, self.num_shards
        )
        for i, device in enumerate(devices)
      ],
    )

  def step(self, occurrences, replica, sharing):
    result = advance(self.copies[replica], occurrences)
    (every,), _ = sharing.every_replica([result.new_rows])
    return sharing.combine_owned(result.rows), tf.concat(every, 0)

  def lookup(self, keys, replica, sharing):
    if tf.distribute.get_replica_context() is None:  # A direct lookup.
      return [
        tf.reduce_max(tf.stack([find(c, k) for c in self.copies]), axis=0)
        for k in keys
      ]
    parts, mine = sharing.every_replica([tf.reshape(k, [-1]) for k in keys])
    answers = sharing.combine_owned(
      find(self.copies[replica], tf.concat(flat(parts), 0))
    )
    return [
      tf.reshape(rows, tf.shape(k, out_type=tf.int64))
      for k, rows in zip(keys, slices_of(answers, parts, mine), strict=True)
    ]

  def whole(self):
    shards = self._all_shards()
    whole = {
      name: tf.concat([shard[name] for shard in shards], 0)
      for name in ROW_ARRAYS + ENTRY_ARRAYS
    }
    whole["step"] = shards[0]["step"]
    whole["evictions"] = tf.add_n([shard["evictions"] for shard in shards])
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
    """Every worker's shards (``MultiWorkerMirroredStrategy``): one
    all-gather per variable, each shard padded to the longest."""
    strategy = self._strategy
    layouts = [
      VocabularyVariables.layout_of(
        self.vocabulary, self.capacity, shard, self.num_shards
      )
      for shard in range(self.num_shards)
    ]
    probation = self.copies[0].probation
    sizes = {
      **{n: [lay.local_rows for lay in layouts] for n in ROW_ARRAYS},
      **{
        n: [lay.num_local_buckets * probation for lay in layouts]
        for n in ENTRY_ARRAYS
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
