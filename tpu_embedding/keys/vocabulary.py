"""``DynamicVocabulary``: rows given to raw ids as they arrive, bounded.

A table declared with ``TableConfig(..., vocabulary=DynamicVocabulary(...))``
takes raw keys (any int64 value, or strings) instead of row ids. It holds
``capacity`` rows; a key gets a row once it has been seen ``min_count``
times, and keeps it until it is evicted.

**Buckets.** The ``C = capacity`` rows are cut into ``B = ceil(C / S)``
buckets of ``S = bucket_size`` rows or fewer (bucket ``b`` holds rows
``[floor(b C / B), floor((b + 1) C / B))``). Key ``k`` lives in bucket
``h(k) mod B`` only (``h``: a 64-bit mix of the key; strings are keyed by
their 64-bit fingerprint first). Eviction chooses within the bucket, so a
step costs what its keys touch, never what the table holds.

**A training step ``t``** (``t = 1, 2, ...``; every replica computes the
same step from the global batch, so 1 device and N replicas agree). For
each distinct key ``k`` with ``n_k`` occurrences in the global batch, in
order of first occurrence:

* *live* entries: a row holding ``k`` with ``t - last <= ttl_steps``
  (always, without ``ttl_steps``);
* **hit** (``k`` holds a live row ``r``): ``last_r = t``,
  ``count_r += n_k``;
* **miss**: ``c_k = n_k + p_k``, with ``p_k`` its live probation count
  (0 when not on probation). If ``c_k >= min_count`` the key asks for a
  row, else it goes on (or stays on) probation with count ``c_k``.
* Per bucket, keys asking for a row, in order of ``c_k`` descending then
  first occurrence, take in turn: empty or expired rows (by row), then,
  never a row hit at step ``t``, the rows whose keys are evicted:
  ``eviction="lru"``: least recent ``last`` first (then lower ``count``,
  then row); ``"lfu"``: lowest ``count`` first (then ``last``, then row).
  A key that gets row ``r``: ``key_r = k``, ``last_r = t``,
  ``count_r = c_k``; the row and its optimizer slots are reset to the
  initializer's values (drawn for the new rows of the step) and the
  evicted key is forgotten. A key that finds no row stays on probation.
* Probation (``min_count > 1``): ``P = probation_size`` entries per
  bucket of ``(key, count, last)``; a key joining takes an empty or
  expired entry, else the least recent one not touched at step ``t``
  (then lowest count, then entry); a key that finds none is forgotten
  (it will need ``min_count`` more occurrences). Admitted keys leave it.

Looked up, a key without a live row (never seen enough, evicted, expired)
reads the **default row**: ``default_value`` in every element, never
updated. Its gradients are dropped. Serving and ``embedding_lookup`` map
keys with the state as it is, without changing it.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> table = tpe.TableConfig(
  ...     vocabulary_size=1000, dim=8, name="users",
  ...     vocabulary=tpe.DynamicVocabulary(min_count=2, eviction="lfu"))
  >>> table.vocabulary.capacity is None  # capacity: vocabulary_size
  True
  >>> tpe.DynamicVocabulary(capacity=0)
  Traceback (most recent call last):
  ...
  ValueError: DynamicVocabulary: capacity must be None ... Received: 0
"""

from __future__ import annotations

import copy
from typing import Any

import tensorflow as tf

#: Eviction policies.
EVICTIONS = ("lru", "lfu")

#: Key dtypes a dynamic vocabulary takes.
KEY_DTYPES = (tf.int64, tf.string)


def _check_count(name: str, value: Any, none: str | None = None) -> None:
  """Raises unless ``value`` is an int >= 1, or None where ``none`` (what
  None means, for the message) is given."""
  if none is not None and value is None:
    return
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    allowed = "" if none is None else f"None{none} or "
    raise ValueError(
      f"DynamicVocabulary: {name} must be {allowed}an int >= 1. Received: "
      f"{value!r}"
    )


class DynamicVocabulary:
  """A bounded vocabulary of raw keys, with admission and eviction.

  Args:
    capacity: rows for keys; None takes the table's ``vocabulary_size``
      (given both, they must be equal).
    min_count: occurrences (over training steps) before a key gets a row;
      1 gives every new key a row at once.
    eviction: ``"lru"`` (least recently seen) or ``"lfu"`` (least often
      seen) key of the bucket gives up its row when the bucket is full.
    ttl_steps: None, or an int >= 1: keys (and probation entries) not
      seen for more than this many steps lose their row.
    key_dtype: ``tf.int64`` (int32 keys are widened) or ``tf.string``.
    bucket_size: rows per bucket (the eviction's scope), an int >= 1.
    probation_size: probation entries per bucket (``min_count > 1``);
      None: ``bucket_size``.
    default_value: every element of the row unknown keys read.

  Raises:
    ValueError: for an invalid argument; the message gives what was
      received and what is allowed.

  Example:
    >>> import tensorflow as tf
    >>> vocabulary = DynamicVocabulary(min_count=3, key_dtype=tf.string)
    >>> vocabulary.probation_size, vocabulary.replace(min_count=1).min_count
    (64, 1)
  """

  def __init__(
    self,
    capacity: int | None = None,
    min_count: int = 1,
    eviction: str = "lru",
    ttl_steps: int | None = None,
    key_dtype: tf.DType = tf.int64,
    bucket_size: int = 64,
    probation_size: int | None = None,
    default_value: float = 0.0,
  ):
    _check_count("capacity", capacity, " (the table's vocabulary_size)")
    _check_count("min_count", min_count)
    if eviction not in EVICTIONS:
      raise ValueError(
        f"DynamicVocabulary: eviction must be one of {EVICTIONS}. "
        f"Received: {eviction!r}"
      )
    _check_count("ttl_steps", ttl_steps, "")
    try:
      dtype = tf.as_dtype(key_dtype)
    except TypeError:
      dtype = None
    if dtype not in KEY_DTYPES:
      raise ValueError(
        "DynamicVocabulary: key_dtype must be tf.int64 or tf.string. "
        f"Received: {key_dtype!r}"
      )
    _check_count("bucket_size", bucket_size)
    _check_count("probation_size", probation_size, "")
    if isinstance(default_value, bool) or not isinstance(
      default_value, (int, float)
    ):
      raise ValueError(
        "DynamicVocabulary: default_value must be a number. Received: "
        f"{default_value!r}"
      )
    self.capacity = capacity
    self.min_count = min_count
    self.eviction = eviction
    self.ttl_steps = ttl_steps
    self.key_dtype = dtype
    self.bucket_size = bucket_size
    self.probation_size = (
      bucket_size if probation_size is None else probation_size
    )
    self.default_value = float(default_value)

  def replace(self, **changes: Any) -> DynamicVocabulary:
    """A copy with ``changes`` applied (validated again)."""
    arguments = {**self.get_config(), **changes}
    return DynamicVocabulary(**arguments)

  def get_config(self) -> dict[str, Any]:
    """The constructor's arguments."""
    return {
      "capacity": self.capacity,
      "min_count": self.min_count,
      "eviction": self.eviction,
      "ttl_steps": self.ttl_steps,
      "key_dtype": self.key_dtype,
      "bucket_size": self.bucket_size,
      "probation_size": self.probation_size,
      "default_value": self.default_value,
    }

  def __copy__(self) -> DynamicVocabulary:
    clone = DynamicVocabulary.__new__(DynamicVocabulary)
    clone.__dict__.update(copy.copy(self.__dict__))
    return clone

  def __eq__(self, other: object) -> bool:
    return (
      isinstance(other, DynamicVocabulary)
      and self.get_config() == other.get_config()
    )

  def __hash__(self) -> int:
    return hash(
      tuple(sorted((k, str(v)) for k, v in self.get_config().items()))
    )

  def __repr__(self) -> str:
    arguments = ", ".join(
      f"{k}={v.name if isinstance(v, tf.DType) else v!r}"
      for k, v in self.get_config().items()
    )
    return f"DynamicVocabulary({arguments})"
