"""Sharded text files read in parallel, as chunks of numbered lines.

``list_files`` expands glob patterns the same way on every host;
``numbered_lines`` reads the files in parallel (``interleave``), in chunks
of lines that keep their file and line numbers, so that a vectorised
parser can say where a bad record is (see ``bad_records``). Under
``strategy.distribute_datasets_from_function`` each input pipeline reads
its own files.

Example:
  >>> import os, tempfile
  >>> from model_garden.ranking.data import text_files
  >>> d = tempfile.mkdtemp()
  >>> _ = open(os.path.join(d, "a.txt"), "w").write("x\\ny\\n")
  >>> chunks = text_files.numbered_lines(text_files.list_files(d + "/*"), 8)
  >>> [c["line_number"].tolist() for c in chunks.as_numpy_iterator()]
  [[1, 2]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding import data


def list_files(file_pattern: str | Sequence[str]) -> list[str]:
  """Expands glob patterns into a sorted, de-duplicated list of files.

  Args:
    file_pattern: a glob pattern, a file name, or a list of either.

  Returns:
    The matching file names, sorted (so every host sees the same order).

  Raises:
    FileNotFoundError: when nothing matches.

  Example:
    >>> import os, tempfile
    >>> from model_garden.ranking.data import text_files
    >>> d = tempfile.mkdtemp()
    >>> for name in ("b.tsv", "a.tsv"):
    ...   _ = open(os.path.join(d, name), "w").write("x\\n")
    >>> [os.path.basename(f) for f in text_files.list_files(d + "/*.tsv")]
    ['a.tsv', 'b.tsv']
  """
  patterns = [file_pattern] if isinstance(file_pattern, str) else file_pattern
  files = set()
  for pattern in patterns:
    files.update(tf.io.gfile.glob(pattern))
  if not files:
    raise FileNotFoundError(f"No file matches {list(patterns)!r}.")
  return sorted(files)


def numbered_lines(
  files: Sequence[str],
  chunk_size: int,
  *,
  cycle_length: int | None = None,
  deterministic: bool = True,
  input_context: tf.distribute.InputContext | None = None,
  repeat: bool = False,
  compression_type: str | None = None,
  records_of: Callable[[tf.Tensor], tf.data.Dataset] | None = None,
) -> tf.data.Dataset:
  """Reads text files in parallel, in chunks of numbered lines.

  Each file is read as chunks of up to ``chunk_size`` consecutive lines
  (a parser then works on a whole chunk at once, with no per-line tf.data
  overhead), and ``cycle_length`` files at a time are interleaved chunk by
  chunk (``num_parallel_calls=tf.data.AUTOTUNE``). Under
  ``distribute_datasets_from_function`` each input pipeline reads its own
  files, or its own lines when there are fewer files than pipelines.

  Args:
    files: the files to read, in order.
    chunk_size: lines per chunk (a file's last chunk may be shorter).
    cycle_length: files read concurrently, at most this pipeline's number
      of files (more would read a repeated file several times at once and
      repeat its chunks; default: all of them, at most 16).
    deterministic: whether the interleaved order is reproducible. False
      lets a slow file not hold back the others.
    input_context: from ``distribute_datasets_from_function``, or None.
    repeat: read the files again and again (training).
    compression_type: ``None``, ``"GZIP"`` or ``"ZLIB"``.
    records_of: ``records_of(file)``: the dataset of a file's records
      (default: its lines, ``tf.data.TextLineDataset``); e.g.
      ``tf.data.TFRecordDataset`` numbers TFRecord files' records.

  Returns:
    A dataset of chunks ``{"file": string [n], "line_number": int64 [n]
    (from 1), "line": string [n]}`` (lines without their ``\\n``).

  Example:
    >>> import os, tempfile
    >>> from model_garden.ranking.data import text_files
    >>> path = os.path.join(tempfile.mkdtemp(), "f.txt")
    >>> _ = open(path, "w").write("a\\nb\\nc\\n")
    >>> [(c["line_number"].tolist(), c["line"].tolist()) for c in
    ...  text_files.numbered_lines([path], 2).as_numpy_iterator()]
    [([1, 2], [b'a', b'b']), ([3], [b'c'])]
  """
  files = list(files)
  if not files:
    raise ValueError("numbered_lines needs at least one file.")
  if chunk_size <= 0:
    raise ValueError(f"chunk_size must be positive, got {chunk_size}.")
  pipelines = input_context.num_input_pipelines if input_context else 1
  shard_files = len(files) >= pipelines
  if shard_files and input_context is not None:
    files = files[input_context.input_pipeline_id :: pipelines]
  file_ds = tf.data.Dataset.from_tensor_slices(files)
  if repeat:
    file_ds = file_ds.repeat()

  def read(file: tf.Tensor) -> tf.data.Dataset:
    if records_of is None:
      lines = tf.data.TextLineDataset(file, compression_type=compression_type)
    else:
      lines = records_of(file)
    if not shard_files:  # Every pipeline reads the file, keeps its lines.
      lines = data.shard_for_input_pipeline(
        lines.enumerate(start=1), input_context
      )
      return lines.batch(chunk_size).map(
        tf.autograph.experimental.do_not_convert(
          lambda n, chunk: {
            "file": tf.fill(tf.shape(chunk), file),
            "line_number": n,
            "line": chunk,
          }
        )
      )

    def number(index: tf.Tensor, chunk: tf.Tensor) -> dict[str, tf.Tensor]:
      first = index * chunk_size + 1
      size = tf.size(chunk, out_type=tf.int64)
      return {
        "file": tf.fill(tf.shape(chunk), file),
        "line_number": tf.range(first, first + size),
        "line": chunk,
      }

    return (
      lines.batch(chunk_size)
      .enumerate()
      .map(tf.autograph.experimental.do_not_convert(number))
    )

  return file_ds.interleave(
    read,
    cycle_length=min(cycle_length or 16, len(files)),
    block_length=1,
    num_parallel_calls=tf.data.AUTOTUNE,
    deterministic=deterministic,
  )


def select_lines(
  chunks: tf.data.Dataset, first: int, last: int
) -> tf.data.Dataset:
  """Keeps lines ``first`` to ``last`` (1-based, inclusive) of each file.

  Args:
    chunks: ``numbered_lines`` chunks.
    first: the first line kept.
    last: the last line kept.

  Returns:
    The same chunks with only those lines (chunks left empty dropped).

  Example:
    >>> import os, tempfile
    >>> from model_garden.ranking.data import text_files
    >>> path = os.path.join(tempfile.mkdtemp(), "f.txt")
    >>> _ = open(path, "w").write("a\\nb\\nc\\nd\\n")
    >>> chunks = text_files.select_lines(
    ...   text_files.numbered_lines([path], 3), 2, 3)
    >>> [c["line"].tolist() for c in chunks.as_numpy_iterator()]
    [[b'b', b'c']]
  """
  if not 1 <= first <= last:
    raise ValueError(f"Need 1 <= first <= last, got lines {first}..{last}.")
  return _keep_numbered(chunks, lambda n: (n >= first) & (n <= last))


def _keep_numbered(
  chunks: tf.data.Dataset, keeps: Callable[[tf.Tensor], tf.Tensor]
) -> tf.data.Dataset:
  """The lines of ``numbered_lines`` chunks whose numbers ``keeps``
  (line numbers → bools), chunks left empty dropped."""

  def keep(chunk: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    inside = keeps(chunk["line_number"])
    return {k: tf.boolean_mask(v, inside) for k, v in chunk.items()}

  return chunks.map(tf.autograph.experimental.do_not_convert(keep)).filter(
    lambda chunk: tf.size(chunk["line"]) > 0
  )


@dataclasses.dataclass(frozen=True)
class Holdout:
  """A validation split held out of the training files, record by record.

  Records ``every, 2 * every, ...`` of each file (numbered from 1 in
  each file, as ``numbered_lines`` numbers them: lines of text files,
  records of TFRecord files) are validation's, the others training's:
  the two splits are disjoint and together the whole data, whatever the
  number of files, their order, the input pipelines or the step a run
  resumes from.

  Attributes:
    every: one record in ``every`` validates (> 1).
    validation: which side this split reads: the held-out records (True)
      or the others (False).

  Example:
    >>> import os, tempfile
    >>> from model_garden.ranking.data import text_files
    >>> path = os.path.join(tempfile.mkdtemp(), "f.txt")
    >>> _ = open(path, "w").write("".join(f"{i}\\n" for i in range(1, 8)))
    >>> def lines(validation):
    ...   chunks = text_files.Holdout(3, validation).select(
    ...     text_files.numbered_lines([path], 4))
    ...   return [x.decode() for c in chunks.as_numpy_iterator()
    ...           for x in c["line"]]
    >>> lines(validation=True), lines(validation=False)
    (['3', '6'], ['1', '2', '4', '5', '7'])
  """

  every: int
  validation: bool

  def __post_init__(self) -> None:
    if self.every < 2:
      raise ValueError(f"Holdout.every must be > 1, got {self.every}.")

  def holds(self, record_number: Any) -> Any:
    """Whether record ``record_number`` (from 1) of a file is held out
    (an int, or a tensor of them: bools)."""
    return record_number % self.every == 0

  def select(self, chunks: tf.data.Dataset) -> tf.data.Dataset:
    """This split's records of ``numbered_lines`` chunks (chunks left
    empty dropped)."""
    return _keep_numbered(
      chunks, lambda n: tf.equal(self.holds(n), self.validation)
    )
