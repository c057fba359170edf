"""Keys, their buckets, and the rows of each bucket.

A dynamic vocabulary of capacity ``C`` has ``B = ceil(C / S)`` buckets
(``S``: ``bucket_size``, at most ``C``); bucket ``b`` holds rows
``[floor(b C / B), floor((b + 1) C / B))``, ``S`` rows or one fewer.
Key ``k`` (int64) lives in bucket ``mix(k) mod B``, with ``mix`` the
splitmix64 finalizer (a bijection of 64-bit words that spreads nearby
keys over all buckets). String keys become int64 keys first: their
farmhash ``Fingerprint64`` modulo ``2**63 - 1``
(``tf.strings.to_hash_bucket_fast``).

Example:
  >>> import tensorflow as tf
  >>> layout = BucketLayout(capacity=10, bucket_size=4)
  >>> layout.num_buckets, layout.max_rows
  (3, 4)
  >>> [layout.first_row(b) for b in range(4)]
  [0, 3, 6, 10]
  >>> int(bucket_of(tf.constant([7], tf.int64), 3)[0]) in (0, 1, 2)
  True
"""

from __future__ import annotations

import tensorflow as tf

_MASK = 2**64 - 1


def key_ids(values: tf.Tensor) -> tf.Tensor:
  """Raw keys as int64 keys: ints widened, strings fingerprinted."""
  if values.dtype == tf.string:
    return tf.strings.to_hash_bucket_fast(values, 2**63 - 1)
  return tf.cast(values, tf.int64)


def mix(keys: tf.Tensor) -> tf.Tensor:
  """splitmix64's finalizer of int64 ``keys``, as uint64."""
  z = tf.bitcast(tf.cast(keys, tf.int64), tf.uint64)

  def shift_xor(z: tf.Tensor, bits: int) -> tf.Tensor:
    return tf.bitwise.bitwise_xor(
      z, tf.bitwise.right_shift(z, tf.constant(bits, tf.uint64))
    )

  z = shift_xor(z, 30) * tf.constant(0xBF58476D1CE4E5B9, tf.uint64)
  z = shift_xor(z, 27) * tf.constant(0x94D049BB133111EB, tf.uint64)
  return shift_xor(z, 31)


def bucket_of(keys: tf.Tensor, num_buckets: int) -> tf.Tensor:
  """Each int64 key's bucket, int64 in ``[0, num_buckets)``."""
  buckets = tf.math.floormod(mix(keys), tf.constant(num_buckets, tf.uint64))
  return tf.cast(buckets, tf.int64)


class BucketLayout:
  """Where each bucket's rows are, and which buckets a shard owns.

  The vocabulary's state may be split by bucket over ``num_shards``
  shards (the replicas holding a row-sharded table): shard ``i`` owns
  buckets ``[floor(i B / n), floor((i + 1) B / n))``, a contiguous range
  of rows, and keeps the state of those rows and buckets only. Local
  coordinates (state indices, local buckets) count from the shard's
  first row and bucket; rows handed out are global.

  Args:
    capacity: rows, ``C >= 1``.
    bucket_size: at most this many rows per bucket (clipped to ``C``).
    shard: which shard this layout is.
    num_shards: shards of the state.

  Example:
    >>> second = BucketLayout(capacity=10, bucket_size=4, shard=1,
    ...                       num_shards=2)
    >>> second.first_bucket, second.num_local_buckets, second.row_offset
    (1, 2, 3)
    >>> second.local_rows
    7
  """

  def __init__(
    self, capacity: int, bucket_size: int, shard: int = 0, num_shards: int = 1
  ):
    self.capacity = int(capacity)
    size = min(int(bucket_size), self.capacity)
    self.num_buckets = -(-self.capacity // size)
    #: The most rows a bucket has.
    self.max_rows = -(-self.capacity // self.num_buckets)
    self.shard, self.num_shards = int(shard), int(num_shards)
    #: The shard's buckets: ``first_bucket`` and the next
    #: ``num_local_buckets - 1``.
    self.first_bucket = self.shard * self.num_buckets // self.num_shards
    end = (self.shard + 1) * self.num_buckets // self.num_shards
    self.num_local_buckets = end - self.first_bucket
    #: The shard's rows: ``[row_offset, row_offset + local_rows)``.
    self.row_offset = self.first_row(self.first_bucket)
    self.local_rows = self.first_row(end) - self.row_offset

  def first_row(self, bucket: int) -> int:
    """First (global) row of global ``bucket`` (``first_row(B)`` is ``C``)."""
    return bucket * self.capacity // self.num_buckets

  def local_buckets(self, keys: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(owned, local)``: whether the shard owns each int64 key's bucket,
    and that bucket in local coordinates (meaningful where owned)."""
    local = bucket_of(keys, self.num_buckets) - self.first_bucket
    owned = tf.logical_and(local >= 0, local < self.num_local_buckets)
    return owned, local

  def rows(self, buckets: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(rows, valid)``: ``[n, max_rows]`` local rows of each local
    bucket, and which of them exist (invalid entries hold row 0)."""
    buckets = tf.cast(buckets, tf.int64) + self.first_bucket
    first = buckets * self.capacity // self.num_buckets
    end = (buckets + 1) * self.capacity // self.num_buckets
    # (expand_dims and a constant: indexing with None builds a slice and
    # its arguments, and this runs in every lookup of every table)
    offsets = tf.constant([list(range(self.max_rows))], tf.int64)
    rows = tf.expand_dims(first, 1) + offsets
    valid = rows < tf.expand_dims(end, 1)
    rows = rows - self.row_offset
    return tf.where(valid, rows, tf.zeros_like(rows)), valid

  def global_rows(self, local_rows: tf.Tensor) -> tf.Tensor:
    """Local rows as global ones; ``local_rows`` (no row) becomes
    ``capacity`` (the default row)."""
    return tf.where(
      tf.equal(local_rows, self.local_rows),
      tf.constant(self.capacity, tf.int64),
      local_rows + self.row_offset,
    )
