"""Drifting synthetic Criteo: raw hashed 64-bit keys whose popularity moves.

Real click logs do not come with ids in ``[0, vocabulary_size)``: their
categorical values are hashes (Criteo publishes 32-bit hashes; ad and user
ids are 64-bit), new values arrive every hour and old ones fade. The usual
answer is ``key mod rows``, which makes every row the sum of many unrelated
keys. ``DriftingCriteo`` makes such a stream, to compare that answer with a
dynamic vocabulary (``tpu_embedding.DynamicVocabulary``):

* feature ``f`` draws a Zipf rank ``r`` over ``vocab_sizes[f]`` *entities
  in play* (as ``SyntheticCriteo``), and the rank names entity
  ``e = r + shift_f(i)`` at example ``i``, where ``shift_f(i) = i //
  examples_per_shift`` for features with at least
  ``drift_min_cardinality`` entities and 0 for the small ones (device
  types, countries). So the ranking slides along an endless line of
  entities: each one becomes more frequent until it is the most frequent,
  then is never seen again, and new entities keep coming in at the tail;
* the key a reader sees is a 64-bit hash of ``(seed, f, e)``, any int64
  value (0 for a missing value);
* labels are drawn from ``SyntheticCriteo``'s hidden click model, keyed by
  the entity, so a model can learn a weight per key (until its key leaves).

Each value is a hash of (seed, example index, feature): the stream is
deterministic and example ``i`` is the same whatever the chunking.

Example:
  >>> from model_garden.ranking.data import drifting
  >>> gen = drifting.DriftingCriteo((1000,) * 26, examples_per_shift=10)
  >>> early, late = gen.examples(0, 2000), gen.examples(10**6, 2000)
  >>> keys = lambda ex: set(gen.keys(ex)[:, 0].tolist()) - {0}  # 0: missing
  >>> len(keys(early) & keys(late))  # the keys in play moved on
  0
  >>> gen.keys(early).dtype.name
  'int64'
  >>> features, labels = next(iter(gen.stream(batch_size=4, start=0,
  ...                                             count=8)))
  >>> features["sparse_features"]["0"].dtype.name, labels.shape.as_list()
  ('int64', [4])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from model_garden.ranking.data import criteo_schema
from model_garden.ranking.data import hashing
from model_garden.ranking.data import synthetic

_KEY = 20  # The hash stream of the raw keys (synthetic's use 0..9).
_NO_READER = (
  "DriftingCriteo's values are raw 64-bit keys, not ids below the "
  "vocabulary sizes: read it with stream() or batches()."
)


@dataclasses.dataclass(frozen=True)
class DriftingCriteo(synthetic.SyntheticCriteo):
  """An endless Criteo-like stream of raw 64-bit keys with drift.

  ``vocab_sizes`` are the entities in play per feature at any moment (the
  distinct keys of a feature over the whole stream are many more where it
  drifts); the other fields are ``SyntheticCriteo``'s.
  """

  examples_per_shift: int = 64
  """Examples after which a drifting feature's ranking slides by one
  entity (smaller: faster drift)."""

  drift_min_cardinality: int = 1000
  """Features with fewer entities in play do not drift."""

  def __post_init__(self):
    super().__post_init__()
    if self.examples_per_shift < 1:
      raise ValueError(
        f"examples_per_shift must be >= 1, got {self.examples_per_shift}."
      )

  def _ids_of_ranks(self, ranks: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The entities the ranks name at examples ``rows`` (``[n, 1]``)."""
    vocab = np.array(self.vocab_sizes, np.int64)[None, :]
    drifts = vocab >= self.drift_min_cardinality
    return ranks + np.where(drifts, rows // self.examples_per_shift, 0)

  def _features(self, start: int, count: int) -> dict[str, np.ndarray]:
    """``ids`` are the entities, -1 where missing (entity 0 is a real
    one): the hidden click model keys its weights by entity."""
    ex = super()._features(start, count)
    ex["ids"] = np.where(ex["categorical_missing"], -1, ex["ids"])
    return ex

  def keys(self, ex: dict[str, np.ndarray]) -> np.ndarray:
    """``[n, 26]`` int64 raw keys of ``examples``' entities (0: missing)."""
    sparse_f = np.arange(synthetic.NUM_SPARSE)[None, :]
    keys = hashing.hash_np(self.seed, _KEY, sparse_f, ex["ids"])
    return np.where(ex["categorical_missing"], 0, keys.view(np.int64))

  def batches(
    self,
    batch_size: int,
    start: int,
    count: int,
    rows: Sequence[int] | None = None,
  ) -> Iterator[tuple[dict, np.ndarray]]:
    """``(features, labels)`` numpy batches of examples ``start ..
    start + count - 1`` (a last short batch is dropped).

    Args:
      batch_size: examples per batch.
      start: the first example.
      count: examples.
      rows: None: raw keys; else the table sizes, and each key becomes
        ``key mod rows[f]`` (in ``[0, rows[f])``), the usual hashing of
        fixed tables.
    """
    chunk = batch_size * max(1, 32768 // batch_size)
    stop = start + (count // batch_size) * batch_size
    for first in range(start, stop, chunk):
      ex = self.examples(first, min(chunk, stop - first))
      keys = self.keys(ex)
      if rows is not None:
        keys = np.mod(keys, np.array(rows, np.int64)[None, :])
      counts = np.where(ex["dense_missing"], 0, ex["counts"])
      for b in range(0, len(keys), batch_size):
        part = slice(b, b + batch_size)
        yield (
          {
            "dense_features": np.log1p(np.maximum(counts[part], 0)).astype(
              np.float32
            ),
            "sparse_features": {
              str(f): keys[part, f] for f in range(synthetic.NUM_SPARSE)
            },
          },
          ex["labels"][part].astype(np.float32),
        )

  def stream(
    self,
    batch_size: int,
    start: int,
    count: int,
    rows: Sequence[int] | None = None,
  ) -> tf.data.Dataset:
    """``batches`` as a ``tf.data.Dataset`` (generated while it is read,
    so memory does not grow with ``count``)."""
    signature = (
      {
        "dense_features": tf.TensorSpec(
          [batch_size, criteo_schema.NUM_DENSE_FEATURES], tf.float32
        ),
        "sparse_features": {
          str(f): tf.TensorSpec([batch_size], tf.int64)
          for f in range(synthetic.NUM_SPARSE)
        },
      },
      tf.TensorSpec([batch_size], tf.float32),
    )
    return tf.data.Dataset.from_generator(
      lambda: self.batches(batch_size, start, count, rows),
      output_signature=signature,
    ).prefetch(2)

  def parsed(self, start: int, count: int):  # type: ignore[override]
    raise NotImplementedError(_NO_READER)

  def tsv_lines(self, start: int, count: int) -> list[str]:
    raise NotImplementedError(_NO_READER)
