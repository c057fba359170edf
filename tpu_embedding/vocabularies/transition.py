"""One training step of a dynamic vocabulary, in TensorFlow ops.

``find`` maps keys to rows; ``advance`` runs the step's admission and
eviction (the rules are in ``keys/vocabulary.py``) on
``VocabularyVariables`` and returns each key's row and the rows to reset.
Both touch only the buckets of the step's keys: ``[keys, bucket_size]``
gathers, never a pass over the table.

Example:
  >>> import tensorflow as tf
  >>> from tpu_embedding.keys.vocabulary import DynamicVocabulary
  >>> variables = VocabularyVariables(DynamicVocabulary(4, bucket_size=4), 4)
  >>> step = advance(variables, tf.constant([7, 9, 7], tf.int64))
  >>> step.rows.numpy().tolist(), sorted(step.new_rows.numpy().tolist())
  ([0, 1, 0], [0, 1])
  >>> find(variables, tf.constant([9, 5], tf.int64)).numpy().tolist()
  [1, 4]
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.keys.buckets import BucketLayout
from tpu_embedding.keys.vocabulary import DynamicVocabulary

#: The state's arrays: per row, and per probation entry (both sharded by
#: bucket range); and its scalars (the step, and evictions so far).
ROW_ARRAYS = ("keys", "last_step", "counts")
ENTRY_ARRAYS = ("probation_keys", "probation_last_step", "probation_counts")
SCALARS = ("step", "evictions")


def probation_entries(vocabulary: DynamicVocabulary) -> int:
  """Probation entries per bucket: none when every key is admitted at
  once (``min_count`` 1)."""
  return vocabulary.probation_size if vocabulary.min_count > 1 else 0


def array_extents(
  vocabulary: DynamicVocabulary, layout: BucketLayout
) -> dict[str, tuple[int, int, int]]:
  """Per array of ``layout``'s shard: ``(whole size, start, length)``, the
  shard holding elements ``[start, start + length)`` of the whole array.

  Example:
    >>> from tpu_embedding.keys.buckets import BucketLayout
    >>> vocabulary = DynamicVocabulary(bucket_size=4, min_count=2)
    >>> extents = array_extents(vocabulary, BucketLayout(10, 4, 1, 2))
    >>> extents["keys"], extents["probation_keys"]
    ((10, 3, 7), (12, 4, 8))
  """
  probation = probation_entries(vocabulary)
  rows = (layout.capacity, layout.row_offset, layout.local_rows)
  entries = (
    layout.num_buckets * probation,
    layout.first_bucket * probation,
    layout.num_local_buckets * probation,
  )
  return {
    **dict.fromkeys(ROW_ARRAYS, rows),
    **dict.fromkeys(ENTRY_ARRAYS, entries),
  }


class VocabularyVariables:
  """A dynamic vocabulary's state: per row and per probation entry, the
  key, the step it was last seen (0: empty) and its count; the step and
  the number of live keys evicted so far. With several shards, the rows
  and buckets of one shard only (``BucketLayout``).

  Args:
    vocabulary: the configuration.
    capacity: its rows (all shards').
    shard: which shard of the state this is.
    num_shards: shards of the state.
  """

  def __init__(
    self,
    vocabulary: DynamicVocabulary,
    capacity: int,
    shard: int = 0,
    num_shards: int = 1,
  ):
    self.vocabulary = vocabulary
    self.layout = self.layout_of(vocabulary, capacity, shard, num_shards)
    self.probation = probation_entries(vocabulary)
    #: name -> variable, in checkpoint order.
    self.variables = {
      name: tf.Variable(
        tf.zeros([length], tf.int64), trainable=False, name=name
      )
      for name, (_, _, length) in array_extents(vocabulary, self.layout).items()
    }
    for name in SCALARS:
      self.variables[name] = tf.Variable(
        tf.constant(0, tf.int64), trainable=False, name=name
      )

  @staticmethod
  def layout_of(
    vocabulary: DynamicVocabulary,
    capacity: int,
    shard: int = 0,
    num_shards: int = 1,
  ) -> BucketLayout:
    """The layout of a shard's state (without creating variables)."""
    return BucketLayout(capacity, vocabulary.bucket_size, shard, num_shards)

  @staticmethod
  def bytes_of(
    vocabulary: DynamicVocabulary,
    capacity: int,
    shard: int = 0,
    num_shards: int = 1,
  ) -> int:
    """Bytes of a shard's variables (without creating them): three int64
    per row and per probation entry, the step and the evictions."""
    layout = VocabularyVariables.layout_of(
      vocabulary, capacity, shard, num_shards
    )
    extents = array_extents(vocabulary, layout).values()
    return 8 * (sum(length for _, _, length in extents) + len(SCALARS))

  def extents(self) -> dict[str, tuple[int, int, int]]:
    """``array_extents`` of this shard."""
    return array_extents(self.vocabulary, self.layout)

  def __getitem__(self, name: str) -> tf.Variable:
    return self.variables[name]


class StepRows(NamedTuple):
  """What ``advance`` decided.

  Attributes:
    rows: ``[m]`` int64 row of each key given (``capacity``: the default
      row, for keys without one; -1: a key of another shard's buckets).
    new_rows: ``[r]`` int64 rows given to new keys this step: their
      values and optimizer slots are to be reset.
  """

  rows: tf.Tensor
  new_rows: tf.Tensor


def is_live(last: tf.Tensor, step: tf.Tensor, ttl: int | None) -> tf.Tensor:
  """Entries holding a key, seen within ``ttl`` steps of ``step``."""
  held = last > 0
  if ttl is None:
    return held
  return tf.logical_and(held, step - last <= ttl)


def _matches(keys, stored, live):
  """``(found, at)``: whether each key is in its live ``stored`` row
  entries ``[n, k]``, and at which column (0 when not)."""
  match = tf.logical_and(live, tf.equal(stored, tf.expand_dims(keys, 1)))
  found = tf.reduce_any(match, axis=1)
  at = tf.argmax(tf.cast(match, tf.int32), axis=1, output_type=tf.int64)
  return found, at


def _pick(at, *matrices):
  """Each row's entry of ``[n, k]`` matrices at columns ``at`` ``[n, 1]``."""
  return [tf.gather(m, at, batch_dims=1) for m in matrices]


def find(
  variables: VocabularyVariables,
  keys: tf.Tensor,
  step: tf.Tensor | None = None,
) -> tf.Tensor:
  """The row of each int64 key (``capacity`` for keys without one, -1
  for keys of another shard's buckets).

  Args:
    variables: the vocabulary's state.
    keys: int64 keys, any shape.
    step: liveness as at this step; None: the last step taken.
  """
  layout = variables.layout
  flat = tf.reshape(keys, [-1])
  if step is None:
    step = variables["step"].read_value()
  if not layout.local_rows:  # A shard without buckets owns no key.
    return tf.fill(tf.shape(keys, out_type=tf.int64), tf.constant(-1, tf.int64))
  owned, buckets = layout.local_buckets(flat)
  rows, valid = layout.rows(tf.where(owned, buckets, 0))
  valid = tf.logical_and(valid, tf.expand_dims(owned, 1))
  stored = tf.gather(variables["keys"], rows)
  last = tf.gather(variables["last_step"], rows)
  live = tf.logical_and(
    valid, is_live(last, step, variables.vocabulary.ttl_steps)
  )
  found, at = _matches(flat, stored, live)
  (row,) = _pick(tf.expand_dims(at, 1), rows)
  row = tf.squeeze(row, 1)
  result = layout.global_rows(tf.where(found, row, layout.local_rows))
  result = tf.where(owned, result, tf.constant(-1, tf.int64))
  return tf.reshape(result, tf.shape(keys, out_type=tf.int64))


def _rank_in_groups(groups: tf.Tensor, priority: list[tf.Tensor]):
  """Orders items by group, then by ``priority`` (most significant
  first, ascending, ties by position).

  Returns:
    ``(order, sorted_groups, rank)``: item positions in that order, their
    groups, and each one's rank within its group.
  """
  order = tf.range(tf.size(groups, out_type=tf.int64), dtype=tf.int64)
  for key in reversed([groups, *priority]):
    order = tf.gather(order, tf.argsort(tf.gather(key, order), stable=True))
  sorted_groups = tf.gather(groups, order)
  unique_groups, group_ids = tf.unique(sorted_groups, out_idx=tf.int64)
  position = tf.range(tf.size(order, out_type=tf.int64), dtype=tf.int64)
  starts = tf.math.unsorted_segment_min(
    position, group_ids, tf.size(unique_groups, out_type=tf.int64)
  )
  return order, sorted_groups, position - tf.gather(starts, group_ids)


def _in_sorted(values: tf.Tensor, sorted_set: tf.Tensor) -> tf.Tensor:
  """Whether each of ``values`` (any shape) is in ``sorted_set`` [n]."""
  flat = tf.reshape(values, [-1])
  at = tf.searchsorted(sorted_set, flat)
  padded = tf.concat([sorted_set, tf.zeros([1], sorted_set.dtype)], 0)
  hit = tf.logical_and(
    at < tf.size(sorted_set, out_type=at.dtype),
    tf.equal(tf.gather(padded, at), flat),
  )
  return tf.reshape(hit, tf.shape(values))


def _allot(
  groups: tf.Tensor,
  priority: list[tf.Tensor],
  entries: tf.Tensor,
  entry_order: list[tf.Tensor],
  available: tf.Tensor,
):
  """Gives the items of each group the group's available entries.

  Args:
    groups: ``[n]`` group of each item (index into ``entries``' rows).
    priority: keys ordering the items within a group (see
      ``_rank_in_groups``).
    entries: ``[g, k]`` entry ids of each group.
    entry_order: ``[g, k]`` keys ordering the entries (most significant
      first, ascending, ties by column).
    available: ``[g, k]`` entries that may be given.

  Returns:
    ``(got, entry)``: per item whether it got an entry, and which.
  """
  order, group_ids, rank = _rank_in_groups(groups, priority)
  columns = tf.broadcast_to(
    tf.range(tf.shape(entries, out_type=tf.int64)[1], dtype=tf.int64),
    tf.shape(entries, out_type=tf.int64),
  )
  # Available entries first, then by entry_order (stable sorts, least
  # significant key first).
  permutation = columns
  for key in reversed([tf.cast(~available, tf.int64), *entry_order]):
    values = tf.gather(key, permutation, batch_dims=1)
    permutation = tf.gather(
      permutation, tf.argsort(values, axis=1, stable=True), batch_dims=1
    )
  ranked = tf.gather(entries, permutation, batch_dims=1)
  count = tf.reduce_sum(tf.cast(available, tf.int64), axis=1)
  width = tf.shape(entries, out_type=tf.int64)[1]
  got_sorted = rank < tf.gather(count, group_ids)
  column = tf.minimum(rank, width - 1)
  entry_sorted = tf.gather_nd(ranked, tf.stack([group_ids, column], axis=1))
  # Back to item order.
  inverse = tf.math.invert_permutation(order)
  return tf.gather(got_sorted, inverse), tf.gather(entry_sorted, inverse)


def _scatter(variable: tf.Variable, indices: tf.Tensor, values) -> None:
  tf.raw_ops.ResourceScatterUpdate(
    resource=variable.handle,
    indices=indices,
    updates=tf.cast(values, variable.dtype),
  )


def advance(
  variables: VocabularyVariables,
  occurrences: tf.Tensor,
  ops: StepOps = TENSORFLOW_OPS,
) -> StepRows:
  """Runs one training step on the global batch's key ``occurrences``.

  Args:
    variables: the vocabulary's state (written).
    occurrences: ``[m]`` int64 keys of the global batch, in order.
    ops: the step's row ops (``kernels/ops.py``): the kernels' run the
      whole step in one kernel (the same outputs and state).

  Returns:
    The ``StepRows`` of the occurrences.
  """
  done = ops.vocabulary_step(variables, occurrences)
  if done is not None:  # The kernel (training steps): the same step.
    return StepRows(*done)
  vocabulary, layout = variables.vocabulary, variables.layout
  ttl, no_row = vocabulary.ttl_steps, layout.local_rows
  # Nothing moves before the keys exist (a failed input check stops here).
  with tf.control_dependencies([occurrences]):
    step = variables["step"].read_value() + 1
  all_keys, position = tf.unique(occurrences, out_idx=tf.int64)
  all_seen = tf.math.unsorted_segment_sum(
    tf.ones_like(position), position, tf.size(all_keys, out_type=tf.int64)
  )
  # This shard's keys (local coordinates from here).
  owned, all_buckets = layout.local_buckets(all_keys)
  mine = tf.where(owned)[:, 0]
  keys, seen, buckets = (
    tf.gather(v, mine) for v in (all_keys, all_seen, all_buckets)
  )

  # Hits: keys holding a live row.
  rows, valid = layout.rows(buckets)
  live = tf.logical_and(
    valid, is_live(tf.gather(variables["last_step"], rows), step, ttl)
  )
  hit, at = _matches(keys, tf.gather(variables["keys"], rows), live)
  (hit_row,) = _pick(at[:, None], rows)
  hit_row = hit_row[:, 0]

  # Probation counts of the others.
  probation = variables.probation
  if probation:
    entries = buckets[:, None] * probation + tf.range(probation, dtype=tf.int64)
    entry_last = tf.gather(variables["probation_last_step"], entries)
    on_probation, column = _matches(
      keys,
      tf.gather(variables["probation_keys"], entries),
      is_live(entry_last, step, ttl),
    )
    on_probation = tf.logical_and(on_probation, ~hit)
    entry, prior = _pick(
      column[:, None],
      entries,
      tf.gather(variables["probation_counts"], entries),
    )
    entry, prior = entry[:, 0], tf.where(on_probation, prior[:, 0], 0)
  else:
    on_probation = tf.zeros_like(hit)
    prior = tf.zeros_like(seen)
  total = seen + prior
  wants = tf.logical_and(~hit, total >= vocabulary.min_count)

  # Rows for the keys that want one, bucket by bucket.
  asking = tf.where(wants)[:, 0]
  asking_buckets = tf.gather(buckets, asking)
  touched, bucket_index = tf.unique(asking_buckets, out_idx=tf.int64)
  candidate_rows, candidate_valid = layout.rows(touched)
  candidate_last = tf.gather(variables["last_step"], candidate_rows)
  candidate_live = tf.logical_and(
    candidate_valid, is_live(candidate_last, step, ttl)
  )
  held = tf.sort(tf.boolean_mask(hit_row, hit))
  protected = _in_sorted(candidate_rows, held)
  free = tf.logical_and(candidate_valid, ~candidate_live)
  evictable = tf.logical_and(candidate_live, ~protected)
  # Free rows by row (their last step and count do not order them).
  zero = tf.zeros_like(candidate_last)
  last_key = tf.where(free, zero, candidate_last)
  count_key = tf.where(
    free, zero, tf.gather(variables["counts"], candidate_rows)
  )
  entry_order = [tf.cast(~free, tf.int64)] + (
    [last_key, count_key]
    if vocabulary.eviction == "lru"
    else [count_key, last_key]
  )
  got, new_row = _allot(
    bucket_index,
    [-tf.gather(total, asking), asking],
    candidate_rows,
    entry_order,
    tf.logical_or(free, evictable),
  )
  admitted = tf.boolean_mask(asking, got)
  new_rows = tf.boolean_mask(new_row, got)
  evicted = is_live(tf.gather(variables["last_step"], new_rows), step, ttl)

  # Writes: hits, then the admitted keys' rows (disjoint rows).
  hits = tf.where(hit)[:, 0]
  hit_rows = tf.gather(hit_row, hits)
  _scatter(variables["last_step"], hit_rows, tf.fill(tf.shape(hits), step))
  _scatter(
    variables["counts"],
    hit_rows,
    tf.gather(variables["counts"], hit_rows) + tf.gather(seen, hits),
  )
  _scatter(variables["keys"], new_rows, tf.gather(keys, admitted))
  _scatter(variables["last_step"], new_rows, tf.fill(tf.shape(admitted), step))
  _scatter(variables["counts"], new_rows, tf.gather(total, admitted))
  key_row = tf.tensor_scatter_nd_update(
    tf.where(hit, hit_row, no_row), admitted[:, None], new_rows
  )

  if probation:
    _update_probation(
      variables,
      step,
      keys,
      buckets,
      total,
      hit,
      on_probation,
      entry,
      admitted,
    )
  variables["evictions"].assign_add(tf.reduce_sum(tf.cast(evicted, tf.int64)))
  variables["step"].assign(step)
  every_key_row = tf.tensor_scatter_nd_update(
    tf.fill(tf.shape(all_keys, out_type=tf.int64), tf.constant(-1, tf.int64)),
    mine[:, None],
    layout.global_rows(key_row),
  )
  return StepRows(
    tf.gather(every_key_row, position), new_rows + layout.row_offset
  )


def _update_probation(
  variables, step, keys, buckets, total, hit, on_probation, entry, admitted
) -> None:
  """Probation after the step: admitted keys leave, the others are
  counted (joining where an entry is free or can be taken)."""
  ttl = variables.vocabulary.ttl_steps
  num_keys = tf.size(keys, out_type=tf.int64)
  is_admitted = (
    tf.scatter_nd(admitted[:, None], tf.ones_like(admitted), [num_keys]) > 0
  )
  staying = tf.logical_and(~hit, ~is_admitted)
  # Keys on probation: updated in place, or freed when admitted.
  update = tf.where(tf.logical_and(on_probation, staying))[:, 0]
  leave = tf.where(tf.logical_and(on_probation, is_admitted))[:, 0]
  touched_entries = tf.sort(tf.boolean_mask(entry, on_probation))
  # Keys joining: entries of their bucket not touched this step.
  joining = tf.where(tf.logical_and(staying, ~on_probation))[:, 0]
  joining_buckets = tf.gather(buckets, joining)
  touched, bucket_index = tf.unique(joining_buckets, out_idx=tf.int64)
  probation = variables.probation
  candidates = touched[:, None] * probation + tf.range(
    probation, dtype=tf.int64
  )
  candidate_last = tf.gather(variables["probation_last_step"], candidates)
  free = ~is_live(candidate_last, step, ttl)
  available = ~_in_sorted(candidates, touched_entries)
  zero = tf.zeros_like(candidate_last)
  got, new_entry = _allot(
    bucket_index,
    [-tf.gather(total, joining), joining],
    candidates,
    [
      tf.cast(~free, tf.int64),
      tf.where(free, zero, candidate_last),
      tf.where(
        free, zero, tf.gather(variables["probation_counts"], candidates)
      ),
    ],
    available,
  )
  joined = tf.boolean_mask(joining, got)
  new_entries = tf.boolean_mask(new_entry, got)
  kept = tf.concat([tf.gather(entry, update), new_entries], 0)
  kept_keys = tf.concat([update, joined], 0)
  _scatter(variables["probation_keys"], kept, tf.gather(keys, kept_keys))
  _scatter(variables["probation_counts"], kept, tf.gather(total, kept_keys))
  _scatter(
    variables["probation_last_step"], kept, tf.fill(tf.shape(kept), step)
  )
  _scatter(
    variables["probation_last_step"],
    tf.gather(entry, leave),
    tf.zeros_like(leave),
  )
