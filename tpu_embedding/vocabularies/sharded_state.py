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

import functools
from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.checkpointing import slicing
from tpu_embedding.checkpointing.parts import slice_spec
from tpu_embedding.keys.vocabulary import DynamicVocabulary
from tpu_embedding.replicas import current_replica
from tpu_embedding.replicas import first_local_replica
from tpu_embedding.vocabularies.sharing import flat
from tpu_embedding.vocabularies.sharing import slices_of
from tpu_embedding.vocabularies.state import VocabularyState
from tpu_embedding.vocabularies.state import variables_on
from tpu_embedding.vocabularies.transition import ENTRY_ARRAYS
from tpu_embedding.vocabularies.transition import ROW_ARRAYS
from tpu_embedding.vocabularies.transition import SCALARS
from tpu_embedding.vocabularies.transition import VocabularyVariables
from tpu_embedding.vocabularies.transition import advance
from tpu_embedding.vocabularies.transition import array_extents
from tpu_embedding.vocabularies.transition import find


class ShardedVocabulary(VocabularyState, slicing.WorkerParts):
  """Shard ``first + i`` of the state on local replica ``i``.

  Checkpoints hold the whole state. Across workers, a plain
  ``tf.train.Checkpoint`` save gathers it on every worker (a collective,
  run only when the save reads it); ``tpu_embedding.checkpoints.write``
  has every worker write its shards as slices of the whole arrays instead
  (``saved_parts``), and ``tpu_embedding.checkpoints.restore`` reads each
  worker's range only.

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

  @property
  def strategy(self) -> tf.distribute.Strategy:
    return self._strategy

  @property
  def worker_count(self) -> int:
    return self.num_shards // len(self.copies)

  @property
  def worker_index(self) -> int:
    return self._first // len(self.copies)

  def step(self, occurrences, replica, sharing, ops):
    result = advance(self.copies[replica], occurrences, ops)
    (every,), _ = sharing.every_replica([result.new_rows])
    return sharing.combine_owned(result.rows), tf.concat(every, 0)

  def lookup(self, keys, replica, sharing):
    if current_replica(self._strategy) is None:  # A direct lookup.
      return [self.find_live(k) for k in keys]
    parts, mine = sharing.every_replica([tf.reshape(k, [-1]) for k in keys])
    answers = sharing.combine_owned(
      find(self.copies[replica], tf.concat(flat(parts), 0))
    )
    return [
      tf.reshape(rows, tf.shape(k, out_type=tf.int64))
      for k, rows in zip(keys, slices_of(answers, parts, mine), strict=True)
    ]

  def find_live(self, keys):
    """Every local shard answers; the others' keys need their workers.

    Raises:
      RuntimeError: where other workers hold shards.
    """
    if self.worker_count > 1:
      raise RuntimeError(
        "This dynamic table's vocabulary is sharded over several workers: "
        "look its keys up inside strategy.run (every worker together), or "
        "save a checkpoint and serve from it (tools/export.py)."
      )
    return tf.reduce_max(
      tf.stack([find(copy, keys) for copy in self.copies]), axis=0
    )

  def whole(self):
    shards = self._all_shards()
    whole = {
      name: tf.concat([shard[name] for shard in shards], 0)
      for name in ROW_ARRAYS + ENTRY_ARRAYS
    }
    whole["step"] = shards[0]["step"]
    whole["evictions"] = tf.add_n([shard["evictions"] for shard in shards])
    return whole

  def _serialize_to_tensors(self):
    device = self.copies[0]["keys"].device
    if self.worker_count == 1:
      return super()._serialize_to_tensors()
    if not slicing.active():
      # Gathered only if a save reads them (a restore needs names only).
      gathered: dict[str, tf.Tensor] = {}

      def value(name):
        if not gathered:
          gathered.update(self.whole())
        return gathered[name]

      return {
        name: compat.SaveSpec(
          functools.partial(value, name), "", "", dtype=tf.int64, device=device
        )
        for name in self.copies[0].variables
      }
    if slicing.apart():
      # Recorded, not read: every worker writes its own (saved_parts).
      return {
        name: slicing.recorded_only(tf.int64, device)
        for name in self.copies[0].variables
      }
    # A sliced restore reads this worker's range of each array (and the
    # scalars whole): ``_restore_from_tensors`` takes the slices.
    specs = {}
    for name, (size, start, length) in self._worker_ranges().items():
      spec = slice_spec([size], [(start, length)]) if length else ""

      def local_values(name=name):
        return tf.concat([copy[name].read_value() for copy in self.copies], 0)

      specs[name] = {
        spec: compat.SaveSpec(
          local_values, spec, "", dtype=tf.int64, device=device
        )
      }
    for name in SCALARS:
      read = self.copies[0][name].read_value
      if name == "evictions" and slicing.rows():
        # A delta holds the whole state's total, as a full save does (a
        # collective: every worker reads it, the chief writes it).
        read = self._total_evictions
      specs[name] = compat.SaveSpec(read, "", "", dtype=tf.int64, device=device)
    return specs

  def _total_evictions(self) -> tf.Tensor:
    """Every shard's evictions, summed (a collective over the workers)."""
    return self._strategy.reduce(
      tf.distribute.ReduceOp.SUM,
      self._strategy.experimental_distribute_values_from_function(
        lambda context: self.copies[
          context.replica_id_in_sync_group - self._first
        ]["evictions"].read_value()
      ),
      axis=None,
    )

  def _restore_from_tensors(self, restored_tensors):
    if self.worker_count == 1 or not slicing.active():
      return super()._restore_from_tensors(restored_tensors)
    # Each array holds this worker's range of the whole one.
    ranges = self._worker_ranges()
    return self._restore_ranges(
      restored_tensors, {name: start for name, (_, start, _) in ranges.items()}
    )

  def _worker_ranges(self) -> dict[str, tuple[int, int, int]]:
    """Per array: its whole size, and the start and length of this
    worker's (contiguous) shards."""
    first, last = self.copies[0].extents(), self.copies[-1].extents()
    return {
      name: (size, start, last[name][1] + last[name][2] - start)
      for name, (size, start, _) in first.items()
    }

  def saved_parts(self, keys, chunk_bytes=None):
    """This worker's shards as slices of each whole array; the chief adds
    the step and every worker's evictions (summed: a collective). Each
    array is written whole (a vocabulary's state is small: ``chunk_bytes``
    is not used)."""
    del chunk_bytes  # unused
    by_name = {key.rsplit("/", 1)[-1]: key for key in keys}
    parts = [  # (key, slice spec, tensor) of each non-empty array, per shard
      [
        (
          by_name[name],
          slice_spec([size], [(start, length)]),
          copy[name].read_value(),
        )
        for name, (size, start, length) in copy.extents().items()
        if length
      ]
      for copy in self.copies
    ]
    evictions = self._total_evictions()
    if self.worker_index == 0:
      # The scalars, and arrays without elements (no slice to write).
      empty = [
        name for name, (size, _, _) in self._worker_ranges().items() if not size
      ]
      parts.append(
        [
          (by_name["step"], "", self.copies[0]["step"].read_value()),
          (by_name["evictions"], "", evictions),
          *[(by_name[name], "", tf.zeros([0], tf.int64)) for name in empty],
        ]
      )
    return [(f"{i:03d}", part) for i, part in enumerate(parts) if part]

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
    extents = [
      array_extents(
        self.vocabulary,
        VocabularyVariables.layout_of(
          self.vocabulary, self.capacity, shard, self.num_shards
        ),
      )
      for shard in range(self.num_shards)
    ]
    sizes = {
      **{n: [e[n][2] for e in extents] for n in extents[0]},
      **dict.fromkeys(SCALARS, [1] * self.num_shards),
    }
    shards: list[dict[str, tf.Tensor]] = [{} for _ in extents]
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
        scalar = name in SCALARS
        shards[shard][name] = value[0] if scalar else value
    return shards
