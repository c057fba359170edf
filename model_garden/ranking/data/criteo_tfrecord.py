"""Criteo as TFRecord files: Model Garden's TFRecord reader, and a converter.

Model Garden's ranking task reads preprocessed Criteo from TFRecord files
of ``tf.train.Example``\\ s when ``task.use_tf_record_reader`` is set
(``CriteoTFRecordReader``). One example per record:

=========================  ===============  ===============================
key                        type             value
=========================  ===============  ===============================
``label``                  int64 ``[1]``    0 or 1 (a click)
``dense-feature-1..13``    float ``[1]``    the transformed count
                                            (``log(1 + max(x, 0))``)
``sparse-feature-14..39``  int64 ``[k]``    the ids of categorical feature
                                            ``f = n - 14`` (``k = 1``, or
                                            its multi-hot size)
=========================  ===============  ===============================

``convert(pattern, output_dir, config)`` writes such files from Criteo
TSV (or PaddleRec) files with ``criteo.CriteoReader``: the same parsing,
transforms, vocabulary reduction and multi-hot expansion, so that
``CriteoTFRecordReader`` yields exactly the batches the TSV reader yields
(and parsing costs nothing at training time). ``tools/criteo_to_tfrecord.py``
is its command line.

``CriteoTFRecordReader(vocab_sizes).dataset(pattern, batch_size)`` checks
every record (the features present with the right lengths, a 0/1 label,
finite dense values, ids in ``[0, vocab_size)``) and applies the
bad-record policy (``bad_records``): errors name the file and the record
number.

Example:
  >>> import os, tempfile
  >>> from model_garden.ranking.data import criteo, criteo_tfrecord, paddlerec
  >>> config = criteo.CriteoConfig(vocab_sizes=paddlerec.VOCAB_SIZES,
  ...                              file_format="paddlerec")
  >>> out = tempfile.mkdtemp()
  >>> result = criteo_tfrecord.convert(paddlerec.find_sample_file(), out,
  ...                                  config, num_shards=2)
  >>> result.examples, [os.path.basename(f) for f in result.files]
  (80, ['part-00000-of-00002.tfrecord', 'part-00001-of-00002.tfrecord'])
  >>> reader = criteo_tfrecord.CriteoTFRecordReader(paddlerec.VOCAB_SIZES)
  >>> features, labels = next(iter(reader.dataset(result.files, 16)))
  >>> features["dense_features"].shape.as_list(), labels.shape.as_list()
  ([16, 13], [16])
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from model_garden.ranking.data import bad_records
from model_garden.ranking.data import criteo
from model_garden.ranking.data import criteo_schema
from model_garden.ranking.data import text_files
from tpu_embedding import data

LABEL_KEY = "label"
DENSE_KEYS = tuple(
  f"dense-feature-{i}" for i in range(1, criteo_schema.NUM_DENSE_FEATURES + 1)
)
SPARSE_KEYS = tuple(
  f"sparse-feature-{i}"
  for i in range(14, 14 + criteo_schema.NUM_SPARSE_FEATURES)
)
#: Shown in place of a bad record's text (records are binary protos).
_RECORD_TEXT = "(a serialized tf.train.Example)"


def serialize(features: dict[str, Any], labels: Any) -> list[bytes]:
  """A batch ``(features, labels)`` of ``CriteoReader`` as Examples.

  Args:
    features: ``{"dense_features": [B, 13], "sparse_features": {"0": [B]
      or [B, k], ...}}`` (numpy or eager tensors).
    labels: ``[B]`` 0/1.

  Returns:
    ``B`` serialized ``tf.train.Example``\\ s in the module's format.
  """
  labels = np.asarray(labels).astype(np.int64)
  dense = np.asarray(features["dense_features"], np.float32)
  sparse = [
    np.asarray(features["sparse_features"][str(i)], np.int64)
    for i in range(len(SPARSE_KEYS))
  ]
  sparse = [ids.reshape(len(labels), -1) for ids in sparse]
  out = []
  for row in range(len(labels)):
    feature = {
      LABEL_KEY: _int64s([labels[row]]),
      **{
        key: tf.train.Feature(float_list=tf.train.FloatList(value=[v]))
        for key, v in zip(DENSE_KEYS, dense[row], strict=True)
      },
      **{
        key: _int64s(ids[row])
        for key, ids in zip(SPARSE_KEYS, sparse, strict=True)
      },
    }
    example = tf.train.Example(features=tf.train.Features(feature=feature))
    out.append(example.SerializeToString())
  return out


def _int64s(values: Any) -> tf.train.Feature:
  return tf.train.Feature(int64_list=tf.train.Int64List(value=list(values)))


@dataclasses.dataclass(frozen=True)
class ConversionResult:
  """What ``convert`` wrote.

  Attributes:
    files: the TFRecord files, in order.
    examples: examples written.
    bad_records: lines dropped, by kind (``on_bad_record="count"``).
  """

  files: tuple[str, ...]
  examples: int
  bad_records: dict[str, int]


def convert(
  file_pattern: str | Sequence[str],
  output_dir: str,
  config: criteo.CriteoConfig,
  *,
  num_shards: int = 1,
  on_bad_record: bad_records.BadRecordPolicy | str = "raise",
  batch_size: int = 4096,
  progress: Any = None,
) -> ConversionResult:
  """Converts Criteo text files into TFRecord files of this module's format.

  The files are read in order (``deterministic``), parsed by
  ``criteo.CriteoReader(config, on_bad_record)`` and written round-robin,
  ``batch_size`` examples at a time, to ``num_shards`` files
  ``part-<i>-of-<n>.tfrecord`` in ``output_dir`` (any TensorFlow
  filesystem).

  Args:
    file_pattern: the input files (glob pattern(s)).
    output_dir: where to write (created if needed).
    config: the input format, vocabularies and multi-hot expansion.
    num_shards: output files.
    on_bad_record: ``"raise"``, ``"count"`` or ``"skip"``.
    batch_size: examples parsed and written at a time.
    progress: ``progress(examples_so_far)`` after each batch, or None.

  Returns:
    A ``ConversionResult``.

  Raises:
    tf.errors.InvalidArgumentError: a bad line under ``"raise"`` (the
      message names its file and line).
    ValueError: ``num_shards`` < 1, or an existing output file.
  """
  if num_shards < 1:
    raise ValueError(f"num_shards must be >= 1, got {num_shards}.")
  reader = criteo.CriteoReader(config, on_bad_record)
  dataset = reader.dataset(
    file_pattern, batch_size, drop_remainder=False, deterministic=True
  )
  tf.io.gfile.makedirs(output_dir)
  files = tuple(
    os.path.join(output_dir, f"part-{i:05d}-of-{num_shards:05d}.tfrecord")
    for i in range(num_shards)
  )
  existing = [f for f in files if tf.io.gfile.exists(f)]
  if existing:
    raise ValueError(f"Output files exist already: {existing}.")
  writers = [tf.io.TFRecordWriter(f) for f in files]
  examples = 0
  try:
    for features, labels in dataset:
      for record in serialize(features, labels):
        writers[examples % num_shards].write(record)
        examples += 1
      if progress is not None:
        progress(examples)
  finally:
    for writer in writers:
      writer.close()
  counts = (
    reader.bad_records.counts()
    if reader.policy is bad_records.BadRecordPolicy.COUNT
    else {}
  )
  return ConversionResult(files, examples, counts)


class CriteoTFRecordReader:
  """Reads TFRecord Criteo files into ``CriteoReader``'s batches.

  Args:
    vocab_sizes: 26 vocabulary sizes: ids must lie in ``[0, size)``.
    multi_hot_sizes: ids per categorical feature, or None for one id each
      (``[B]`` outputs, else ``[B, k]``).
    on_bad_record: ``"raise"`` (default), ``"count"`` or ``"skip"``.

  Attributes:
    bad_records: dropped records by kind (``columns``: a feature missing
      or of the wrong length, ``label``, ``dense``: not finite,
      ``categorical``: an id out of range).

  Example:
    >>> from model_garden.ranking.data import criteo_tfrecord
    >>> reader = criteo_tfrecord.CriteoTFRecordReader([10] * 26)
    >>> sorted(reader.feature_spec())[:2]
    ['dense-feature-1', 'dense-feature-10']
  """

  def __init__(
    self,
    vocab_sizes: Sequence[int],
    multi_hot_sizes: Sequence[int] | None = None,
    on_bad_record: bad_records.BadRecordPolicy | str = "raise",
  ):
    # The same checks of sizes as the text reader's.
    config = criteo.CriteoConfig(
      vocab_sizes=vocab_sizes, multi_hot_sizes=multi_hot_sizes
    )
    self.vocab_sizes = config.vocab_sizes
    self.multi_hot_sizes = config.multi_hot_sizes
    self.policy = bad_records.BadRecordPolicy(on_bad_record)
    self.bad_records = bad_records.BadRecordCounter(
      criteo_schema.BAD_RECORD_KINDS
    )

  def feature_spec(self) -> dict[str, tf.io.RaggedFeature]:
    """``tf.io.parse_example``'s spec (ragged: lengths are checked)."""
    spec = {LABEL_KEY: tf.io.RaggedFeature(tf.int64)}
    spec.update({k: tf.io.RaggedFeature(tf.float32) for k in DENSE_KEYS})
    spec.update({k: tf.io.RaggedFeature(tf.int64) for k in SPARSE_KEYS})
    return spec

  def parse(self, records: dict[str, tf.Tensor]) -> criteo.Batch:
    """Parses a chunk of numbered records (``text_files.numbered_lines``).

    Returns:
      ``(features, labels)`` after the bad-record policy.
    """
    parsed = tf.io.parse_example(records["line"], self.feature_spec())
    n = tf.shape(records["line"], out_type=tf.int64)[0]

    def fixed(key: str, width: int) -> tuple[tf.Tensor, tf.Tensor]:
      ragged = parsed[key]
      ok = tf.equal(ragged.row_lengths(), width)
      return ragged.to_tensor(shape=[n, width]), ok

    label, label_len_ok = fixed(LABEL_KEY, 1)
    dense_cols, lengths_ok = [], [label_len_ok]
    for key in DENSE_KEYS:
      value, ok = fixed(key, 1)
      dense_cols.append(value[:, 0])
      lengths_ok.append(ok)
    sizes = self.multi_hot_sizes or (1,) * len(SPARSE_KEYS)
    ids, ids_ok = [], []
    for key, size, vocab in zip(
      SPARSE_KEYS, sizes, self.vocab_sizes, strict=True
    ):
      value, ok = fixed(key, size)
      lengths_ok.append(ok)
      ids.append(value)
      ids_ok.append(tf.reduce_all((value >= 0) & (value < vocab), axis=1))
    dense = tf.stack(dense_cols, axis=1)
    label = label[:, 0]
    problems = tf.stack(
      [
        tf.logical_not(tf.reduce_all(tf.stack(lengths_ok, 1), axis=1)),
        tf.logical_not((label == 0) | (label == 1)),
        tf.logical_not(tf.reduce_all(tf.math.is_finite(dense), axis=1)),
        tf.logical_not(tf.reduce_all(tf.stack(ids_ok, 1), axis=1)),
      ],
      axis=1,
    )
    sparse = {
      str(i): tf.cast(v if self.multi_hot_sizes else v[:, 0], tf.int32)
      for i, v in enumerate(ids)
    }
    batch = (
      {"dense_features": dense, "sparse_features": sparse},
      tf.cast(label, tf.float32),
    )
    records = dict(
      records, line=tf.fill(tf.shape(records["line"]), _RECORD_TEXT)
    )
    return bad_records.apply_bad_record_policy(
      batch, problems, records, self.policy, self.bad_records
    )

  def dataset(
    self,
    file_pattern: str | Sequence[str],
    batch_size: int,
    *,
    input_context: tf.distribute.InputContext | None = None,
    repeat: bool = False,
    drop_remainder: bool = True,
    cycle_length: int | None = None,
    deterministic: bool = True,
    chunk_size: int | None = None,
    holdout: text_files.Holdout | None = None,
  ) -> tf.data.Dataset:
    """Batches of the files' examples (``CriteoReader.dataset``'s arguments).

    Returns:
      ``tf.data.Dataset`` of ``(features, labels)``.
    """
    chunks = text_files.numbered_lines(
      text_files.list_files(file_pattern),
      chunk_size or min(batch_size, 4096),
      cycle_length=cycle_length,
      deterministic=deterministic,
      input_context=input_context,
      repeat=repeat,
      records_of=tf.data.TFRecordDataset,
    )
    if holdout is not None:
      chunks = holdout.select(chunks)
    ds = chunks.map(
      tf.autograph.experimental.do_not_convert(self.parse),
      num_parallel_calls=tf.data.AUTOTUNE,
      deterministic=deterministic,
    )
    ds = ds.rebatch(batch_size, drop_remainder=drop_remainder)
    ds = data.with_options(ds, deterministic=deterministic)
    return data.prefetch(ds)
