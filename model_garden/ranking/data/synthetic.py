"""Synthetic Criteo: Criteo-like cardinalities, Zipf ids, learnable labels.

``SyntheticCriteo`` makes click-log records with no download, for tests,
CPU training and benchmarks:

* 26 categorical features with the given vocabulary sizes (Model Garden's
  Criteo 1TB sizes, or ``capped_vocab_sizes`` for CPU-sized tables); ids
  are Zipf-distributed (bounded power law of exponent ``zipf_exponent``
  over ranks, ranks scattered over the id space by a fixed permutation);
* 13 heavy-tailed integer counts (log-normal; feature 1 is sometimes
  ``-1`` as in Criteo); features are missing at the given rates;
* labels drawn from ``sigmoid(logit)``, where the logit adds a hidden
  weight per (feature, id), a dense term and a few pairwise interactions
  of hidden per-id factors, so a DLRM / DCN model can learn them (and a
  model with feature crosses can learn more); an offset fitted once per
  generator makes the click rate ``click_rate`` (0.25, Criteo-like). The
  best possible AUC is about 0.89.

Every value is a hash of (seed, example index, feature), so example ``i``
is the same whatever the chunking or sharding, and the data set is
deterministic given the seed. ``write_tsv`` writes raw Criteo TSV shards
(hex categorical values whose value modulo the vocabulary size is the id)
that ``criteo.CriteoReader`` reads back into exactly what ``dataset``
yields directly.

Example:
  >>> from model_garden.ranking.data import synthetic
  >>> gen = synthetic.SyntheticCriteo(synthetic.capped_vocab_sizes(1000))
  >>> features, labels = next(iter(gen.dataset(batch_size=8,
  ...                                          num_examples=16)))
  >>> features["dense_features"].shape.as_list(), labels.shape.as_list()
  ([8, 13], [8])
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from model_garden.ranking.data import criteo
from model_garden.ranking.data import criteo_schema
from model_garden.ranking.data import hashing

NUM_DENSE = criteo_schema.NUM_DENSE_FEATURES
NUM_SPARSE = criteo_schema.NUM_SPARSE_FEATURES

# Hash "streams": each kind of random number gets its own key.
_CAT, _CAT_MISSING, _DENSE, _DENSE_MISSING, _LABEL = range(5)
_WEIGHT, _FACTOR, _RAW, _NEGATIVE, _PAIRS = range(5, 10)
# A prime above 2**31: multiplying ranks by it permutes [0, vocab_size).
_PERMUTATION_PRIME = 2654435761
# Per-feature log-normal location of the counts (Criteo's vary a lot).
_DENSE_LOG_MEAN = (
  0.5, 2.0, 1.5, 1.5, 7.0, 3.5, 1.5, 2.5, 4.0, 0.2, 0.8, 0.2, 1.5,
)  # fmt: skip


def _sigmoid(x: np.ndarray) -> np.ndarray:
  return 1.0 / (1.0 + np.exp(-x))


def capped_vocab_sizes(
  cap: int, vocab_sizes: Sequence[int] = criteo_schema.CRITEO_1TB_VOCAB_SIZES
) -> tuple[int, ...]:
  """Criteo's vocabulary sizes with every size above ``cap`` set to ``cap``.

  The small features keep their real cardinality; the huge ones (40M) fit
  on a CPU.

  Example:
    >>> from model_garden.ranking.data import synthetic
    >>> synthetic.capped_vocab_sizes(1000)[:6]
    (1000, 1000, 1000, 1000, 1000, 3)
  """
  if cap < 1:
    raise ValueError(f"cap must be >= 1, got {cap}.")
  return tuple(min(int(v), cap) for v in vocab_sizes)


#: Vocabulary sizes by name: the real Criteo 1TB ones and CPU-sized ones.
VOCAB_SIZES = {
  "criteo_1tb": criteo_schema.CRITEO_1TB_VOCAB_SIZES,
  "cpu": capped_vocab_sizes(100_000),
  "small": capped_vocab_sizes(10_000),
  "tiny": capped_vocab_sizes(1_000),
}


def zipf_ranks(u: np.ndarray, n: np.ndarray, exponent: float) -> np.ndarray:
  """Bounded Zipf ranks in ``[0, n)`` from uniforms ``u`` in ``[0, 1)``.

  Inverts the CDF of the continuous power law ``p(x) ~ x**-exponent`` on
  ``[1, n + 1)`` and floors, so rank 0 is the most frequent.

  Example:
    >>> import numpy as np
    >>> from model_garden.ranking.data import synthetic
    >>> u = np.linspace(0, 0.999, 1000)
    >>> r = synthetic.zipf_ranks(u, np.array(100), 1.2)
    >>> int(r.min()), int(r.max()) < 100, int((r == 0).sum()) > 100
    (0, True, True)
  """
  n = np.asarray(n, np.float64)
  if abs(exponent - 1.0) < 1e-9:
    x = np.power(n + 1.0, u)
  else:
    a = 1.0 - exponent
    x = np.power(1.0 + u * (np.power(n + 1.0, a) - 1.0), 1.0 / a)
  return np.minimum(np.floor(x).astype(np.int64) - 1, n.astype(np.int64) - 1)


@dataclasses.dataclass(frozen=True)
class SyntheticCriteo:
  """A deterministic, endless synthetic Criteo data set.

  Example:
    >>> from model_garden.ranking.data import synthetic
    >>> gen = synthetic.SyntheticCriteo(synthetic.VOCAB_SIZES["tiny"])
    >>> ex = gen.examples(0, 4)
    >>> ex["ids"].shape, ex["labels"].tolist() == gen.examples(0, 4)[
    ...   "labels"].tolist()
    ((4, 26), True)
  """

  vocab_sizes: Sequence[int] = VOCAB_SIZES["cpu"]
  """26 vocabulary sizes."""

  seed: int = 0
  """Everything is a function of the seed and the example index."""

  zipf_exponent: float = 1.05
  """Skew of the ids: 0 is uniform, ~1 is Criteo-like."""

  missing_dense_rate: float = 0.1
  """Probability that a count is missing."""

  missing_categorical_rate: float = 0.05
  """Probability that a categorical value is missing."""

  num_interactions: int = 4
  """Pairs of features whose hidden factors multiply into the logit."""

  missing_id: int = 0
  """The id a missing categorical value gets (as in ``CriteoConfig``)."""

  click_rate: float = 0.25
  """Mean label (Criteo's Kaggle data: about 0.26)."""

  def __post_init__(self):
    object.__setattr__(
      self, "vocab_sizes", tuple(int(v) for v in self.vocab_sizes)
    )
    criteo_schema.check_vocab_sizes(self.vocab_sizes)
    if not 0 <= self.missing_id < min(self.vocab_sizes):
      raise ValueError("missing_id must be below every vocabulary size.")
    if not 0.0 < self.click_rate < 1.0:
      raise ValueError(f"click_rate must be in (0, 1), got {self.click_rate}.")

  @property
  def interaction_pairs(self) -> list[tuple[int, int]]:
    """The (feature, feature) pairs of the hidden interactions."""
    order = np.argsort(hashing.hash_np(self.seed, _PAIRS, np.arange(26)))
    pairs = order[: 2 * self.num_interactions].reshape(-1, 2)
    return [(int(a), int(b)) for a, b in pairs]

  def examples(self, start: int, count: int) -> dict[str, np.ndarray]:
    """Examples ``start .. start + count - 1`` as numpy arrays.

    Returns:
      ``labels`` [n] int64 (0/1); ``counts`` [n, 13] int64 and
      ``dense_missing`` [n, 13] bool; ``ids`` [n, 26] int64 (the ids a
      reader sees, ``missing_id`` where missing) and ``categorical_missing``
      [n, 26] bool; ``click_probability`` [n] float64, the hidden
      ``sigmoid(logit)`` each label was drawn from.
    """
    ex = self._features(start, count)
    p = _sigmoid(self._logit(ex) + self._bias)
    rows = np.arange(start, start + count, dtype=np.int64)
    labels = hashing.uniform_np(self.seed, _LABEL, rows) < p
    ex["labels"] = labels.astype(np.int64)
    ex["click_probability"] = p
    return ex

  def _features(self, start: int, count: int) -> dict[str, np.ndarray]:
    """Everything but the labels, for examples ``start ..``."""
    rows = np.arange(start, start + count, dtype=np.int64)[:, None]
    dense_f = np.arange(NUM_DENSE)[None, :]
    sparse_f = np.arange(NUM_SPARSE)[None, :]
    vocab = np.array(self.vocab_sizes, np.int64)[None, :]
    seed = self.seed

    u = hashing.uniform_np(seed, _CAT, sparse_f, rows)
    ranks = zipf_ranks(u, vocab, self.zipf_exponent)
    ids = self._ids_of_ranks(ranks, rows)
    cat_missing = (
      hashing.uniform_np(seed, _CAT_MISSING, sparse_f, rows)
      < self.missing_categorical_rate
    )
    ids = np.where(cat_missing, self.missing_id, ids)

    u1 = hashing.uniform_np(seed, _DENSE, dense_f, rows)
    u2 = hashing.uniform_np(seed, _DENSE + 100, dense_f, rows)
    normal = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)
    log_mean = np.array(_DENSE_LOG_MEAN)[None, :]
    counts = np.floor(np.expm1(np.maximum(log_mean + 1.2 * normal, 0.0)))
    counts = counts.astype(np.int64)
    negative = hashing.uniform_np(seed, _NEGATIVE, rows[:, 0]) < 0.05
    counts[:, 1] = np.where(negative, -1, counts[:, 1])
    dense_missing = (
      hashing.uniform_np(seed, _DENSE_MISSING, dense_f, rows)
      < self.missing_dense_rate
    )
    dense_missing[:, 1] = False  # Criteo's feature 1 is never missing.
    return {
      "counts": counts,
      "dense_missing": dense_missing,
      "ids": ids,
      "categorical_missing": cat_missing,
    }

  def _ids_of_ranks(self, ranks: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``[n, 26]`` ids of Zipf ``ranks`` at examples ``rows`` (``[n, 1]``):
    each feature's ranks scattered over its ids by a fixed permutation."""
    del rows  # The same ids at every example.
    sparse_f = np.arange(NUM_SPARSE)[None, :]
    vocab = np.array(self.vocab_sizes, np.int64)[None, :]
    offset = hashing.hash_to_range_np(vocab, self.seed, _CAT, sparse_f)
    return (ranks * _PERMUTATION_PRIME + offset) % vocab

  @functools.cached_property
  def _bias(self) -> float:
    """The logit offset that makes the click rate ``click_rate``.

    Fitted once, by bisection, on examples 0..4095 (a function of the seed
    only, so every chunk of examples uses the same offset).
    """
    logit = self._logit(self._features(0, 4096))
    low, high = -30.0, 30.0
    for _ in range(60):
      mid = (low + high) / 2
      if _sigmoid(logit + mid).mean() > self.click_rate:
        high = mid
      else:
        low = mid
    return (low + high) / 2

  def _logit(self, ex: dict[str, np.ndarray]) -> np.ndarray:
    """The hidden logit, before ``_bias``, from what a reader sees."""
    ids = ex["ids"]
    counts = np.where(ex["dense_missing"], 0, ex["counts"])
    sparse_f = np.arange(NUM_SPARSE)[None, :]
    weights = hashing.uniform_np(self.seed, _WEIGHT, sparse_f, ids) - 0.5
    logit = 1.5 * weights.sum(axis=1)
    dense = np.log1p(np.maximum(counts, 0))
    dense_w = hashing.uniform_np(self.seed, _WEIGHT, 100, np.arange(13)) - 0.5
    # Centred by a constant (not the batch mean): example i's label must
    # not depend on the other examples generated with it.
    logit += 0.3 * (dense - np.array(_DENSE_LOG_MEAN)) @ dense_w
    factors = hashing.uniform_np(self.seed, _FACTOR, sparse_f, ids) * 2 - 1
    for a, b in self.interaction_pairs:
      logit += 1.5 * factors[:, a] * factors[:, b]
    return logit

  def parsed(self, start: int, count: int) -> criteo_schema.ParsedLines:
    """Examples as a reader parses them (``dense_transform="log"``)."""
    ex = self.examples(start, count)
    counts = np.where(ex["dense_missing"], 0, ex["counts"])
    n = count
    return criteo_schema.ParsedLines(
      labels=tf.constant(ex["labels"], tf.float32),
      dense=criteo_schema.log_transform(tf.constant(counts)),
      ids=tf.constant(ex["ids"], tf.int64),
      problems=tf.zeros([n, len(criteo_schema.BAD_RECORD_KINDS)], tf.bool),
    )

  def dataset(
    self,
    batch_size: int,
    num_examples: int,
    *,
    config: criteo.CriteoConfig | None = None,
    repeat: bool = False,
    drop_remainder: bool = True,
  ) -> tf.data.Dataset:
    """Examples ``0 .. num_examples - 1``, batched, held in memory.

    Args:
      batch_size: examples per batch.
      num_examples: examples generated (then repeated if ``repeat``).
      config: multi-hot settings (``vocab_sizes`` must match); default
        one-hot.
      repeat: cycle through the examples forever.
      drop_remainder: drop a last short batch.

    Returns:
      ``(features, labels)`` batches, as ``criteo.CriteoReader`` yields
      from ``write_tsv``'s files (with ``multi_hot_mode="model_garden"``
      the made-up ids are keyed by example index instead).
    """
    config = config or criteo.CriteoConfig(
      vocab_sizes=self.vocab_sizes, missing_id=self.missing_id
    )
    if config.vocab_sizes != self.vocab_sizes:
      raise ValueError("config.vocab_sizes differ from the generator's.")
    parsed = self.parsed(0, num_examples)
    row_keys = tf.range(num_examples, dtype=tf.int64)
    features, labels = criteo.to_features(parsed, config, row_keys)
    ds = tf.data.Dataset.from_tensor_slices((features, labels))
    if repeat:
      ds = ds.repeat()
    return ds.batch(batch_size, drop_remainder=drop_remainder).prefetch(
      tf.data.AUTOTUNE
    )

  def tsv_lines(self, start: int, count: int) -> list[str]:
    """Examples as raw Criteo TSV lines (without newlines).

    A categorical id ``i`` of vocabulary ``v`` is written as the 8-digit
    hex of a 32-bit value ``i + k * v`` (``k`` hashed), so ``int(hex, 16)
    % v == i`` as in the click logs' hashed values.
    """
    ex = self.examples(start, count)
    rows = np.arange(start, start + count, dtype=np.int64)[:, None]
    vocab = np.array(self.vocab_sizes, np.int64)[None, :]
    ids = ex["ids"]
    choices = (2**32 - 1 - ids) // vocab + 1
    k = hashing.hash_to_range_np(choices, self.seed, _RAW, rows)
    raw = ids + k * vocab
    lines = []
    for r in range(count):
      fields = [str(ex["labels"][r])]
      for f in range(NUM_DENSE):
        missing = ex["dense_missing"][r, f]
        fields.append("" if missing else str(ex["counts"][r, f]))
      for f in range(NUM_SPARSE):
        missing = ex["categorical_missing"][r, f]
        fields.append("" if missing else f"{raw[r, f]:08x}")
      lines.append("\t".join(fields))
    return lines

  def write_tsv(
    self,
    directory: str,
    num_examples: int,
    num_shards: int = 1,
    prefix: str = "criteo",
  ) -> list[str]:
    """Writes examples ``0 .. num_examples - 1`` as raw Criteo TSV shards.

    Shard ``s`` holds a contiguous block of examples, so reading the shards
    in order (``deterministic=True``, ``cycle_length=1``) gives back the
    examples in order.

    Args:
      directory: created if needed.
      num_examples: total examples.
      num_shards: files to split them into.
      prefix: file names are ``{prefix}-{s:05d}-of-{num_shards:05d}.tsv``.

    Returns:
      The file paths, in example order.
    """
    if num_shards < 1:
      raise ValueError(f"num_shards must be >= 1, got {num_shards}.")
    tf.io.gfile.makedirs(directory)
    bounds = np.linspace(0, num_examples, num_shards + 1).astype(np.int64)
    paths = []
    for s in range(num_shards):
      name = f"{prefix}-{s:05d}-of-{num_shards:05d}.tsv"
      path = os.path.join(directory, name)
      start, stop = int(bounds[s]), int(bounds[s + 1])
      with tf.io.gfile.GFile(path, "w") as f:
        for chunk in range(start, stop, 65536):
          lines = self.tsv_lines(chunk, min(65536, stop - chunk))
          f.write("".join(line + "\n" for line in lines))
      paths.append(path)
    return paths
