"""The part writer: the checkpoint files this package writes itself.

A save by several processes (full saves of multi-worker state, deltas) is
written as parts: each worker writes its own (``PartWriter.write``: named
tensors, whole or as slices of a full tensor, ``slice_spec``; rows in
chunks of ``chunk_rows``) under ``<prefix>_temp/``, and the chief merges
them there (TensorFlow's ``MergeV2Checkpoints``, as for its partitioned
variables). The merged data files move to ``<prefix>`` and its index last,
so a ``<prefix>.index`` is only ever a whole save (the rename of the index
is the commit); whatever a killed save left is removed by the next save in
that directory before it writes anything. A save is named by ``save_id``:
a digest of its committed index, the same on every worker; a part's name
holds ``key_id`` of its key.

Example:
  >>> import tempfile
  >>> prefix = tempfile.mkdtemp() + "/ckpt"
  >>> write_tensors(prefix, [("t", slice_spec([4, 2], [(1, 2), (0, 2)]),
  ...                         tf.ones([2, 2]))])
  >>> tf.train.load_checkpoint(prefix).get_variable_to_shape_map()["t"]
  [4, 2]
  >>> len(save_id(prefix))
  16
"""

from __future__ import annotations

import hashlib
import os
import re
import weakref
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.checkpointing import slicing
from tpu_embedding.checkpointing.slicing import Entry

#: Chunks of rows a worker copies and writes at once (and the largest
#: stored piece a restore reads whole), by default: at least 8 MiB (a
#: small block is one chunk), a sixteenth of a block, at most 64 MiB.
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 8 * 2**20, 64 * 2**20


def slice_spec(
  full_shape: Sequence[int], extents: Sequence[tuple[int, int]]
) -> str:
  """The ``shape_and_slice`` of a slice of a ``full_shape`` tensor
  (``"6 2 0,3:-"``): ``(start, length)`` per dimension, length -1 for
  all of it."""
  slices = ":".join("-" if n < 0 else f"{s},{n}" for s, n in extents)
  return " ".join(str(d) for d in full_shape) + " " + slices


def rows_per_part(
  rows: int,
  width: int,
  chunk_bytes: int | None,
  parts: int,
  bounds: tuple[int, int],
) -> int:
  """``chunk_bytes`` of rows (at least one), or ``rows / parts`` within
  ``bounds`` (bytes of float32 rows of ``width``)."""
  if chunk_bytes is not None:
    return max(1, chunk_bytes // (4 * width))
  least, most = bounds
  share = max(-(-rows // parts), least // (4 * width))
  return max(1, min(share, most // (4 * width)))


def chunk_rows(rows: int, width: int, chunk_bytes: int | None = None) -> int:
  """Rows per chunk written of a block of ``rows`` rows (and the most rows
  of a stored piece read whole).

  Args:
    rows: the block's rows.
    width: the table's dim (float32 rows).
    chunk_bytes: None for the default (a sixteenth of the block, between
      ``MIN_CHUNK_BYTES`` and ``MAX_CHUNK_BYTES``), or the most bytes a
      chunk holds (at least one row).

  Returns:
    Rows per chunk.
  """
  bounds = (MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
  return rows_per_part(rows, width, chunk_bytes, 16, bounds)


def write_tensors(prefix: str, entries: Sequence[Entry]) -> None:
  """Writes ``entries`` as the checkpoint ``prefix``, in their order."""
  with tf.device("CPU"):
    tf.raw_ops.SaveV2(
      prefix=prefix,
      tensor_names=[key for key, _, _ in entries],
      shape_and_slices=[spec for _, spec, _ in entries],
      tensors=[value for _, _, value in entries],
    )


def worker_parts(checkpoint: Any) -> list[slicing.WorkerParts]:
  """What every worker writes its part of: multi-worker tables, and
  state sharded like them (a dynamic table's vocabulary)."""
  return [
    obj
    for obj in tf.train.TrackableView(checkpoint).descendants()
    if isinstance(obj, slicing.WorkerParts) and obj.written_in_parts
  ]


def is_chief(checkpoint: Any) -> bool:
  """Whether this process writes what is not a worker's part."""
  variables = worker_parts(checkpoint)
  return not variables or variables[0].worker_index == 0


def escaped(name: str) -> str:
  """A local name as a checkpoint key writes it (TensorFlow's escaping).

  Example:
    >>> escaped("t/accumulators"), escaped("a.b")
    ('t.Saccumulators', 'a..b')
  """
  return name.replace(".", "..").replace("/", ".S")


def key_id(key: str) -> str:
  """A file-name-safe, stable id of a checkpoint key."""
  return hashlib.sha1(key.encode()).hexdigest()[:12]


def checkpoint_keys(
  checkpoint: Any, variables: Sequence[Any]
) -> list[list[str]]:
  """The checkpoint keys of each of ``variables`` in ``checkpoint``."""
  # TensorFlow's own serialization names them (no value is read: the
  # variables are written apart).
  with slicing.written_apart():
    keys = compat.checkpoint_keys(checkpoint)
  return [keys[id(v)] for v in variables]


#: One compiled barrier per strategy.
_barriers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remove(path: str) -> None:
  """Removes the file or directory ``path``, if there is one."""
  if tf.io.gfile.isdir(path):
    tf.io.gfile.rmtree(path)
  elif tf.io.gfile.exists(path):
    tf.io.gfile.remove(path)


#: A checkpoint's data file: ``<prefix>.data-00000-of-00001``.
_DATA_FILE = re.compile(r"(.*)\.data-\d{5}-of-\d{5}")


def remove_stale_temps(file_prefix: str) -> None:
  """Removes what a save killed next to ``file_prefix`` left behind:
  ``*_temp`` directories, and data files without their index (a merge cut
  off before its commit)."""
  directory = os.path.dirname(file_prefix) or "."
  tf.io.gfile.makedirs(directory)
  names = {name.rstrip("/") for name in tf.io.gfile.listdir(directory)}
  for name in sorted(names):
    data = _DATA_FILE.fullmatch(name)
    if name.endswith("_temp") or (
      data is not None and f"{data.group(1)}.index" not in names
    ):
      remove(os.path.join(directory, name))


def commit(merged: str, file_prefix: str) -> None:
  """Moves the checkpoint ``merged`` to ``file_prefix``, its index last.

  A checkpoint already at ``file_prefix`` loses its index first and then
  its data files, so that no index ever names data files of another save.
  """
  for path in [
    f"{file_prefix}.index",
    *tf.io.gfile.glob(f"{file_prefix}.data-?????-of-?????"),
  ]:
    remove(path)
  for path in tf.io.gfile.glob(f"{merged}.data-?????-of-?????"):
    suffix = path[len(merged) :]
    tf.io.gfile.rename(path, file_prefix + suffix, overwrite=True)
  tf.io.gfile.rename(f"{merged}.index", f"{file_prefix}.index", overwrite=True)


class PartWriter:
  """One save to ``file_prefix``, written as parts by every worker.

  Every worker makes one with the same ``file_prefix`` and calls
  ``begin``, then writes its parts (``write``, or TensorFlow's own save to
  ``prefix(name)``), then ``commit``: each is a barrier over the workers.

  Args:
    file_prefix: the save's prefix, on a filesystem all workers share.
    variables: the saved state spread over the workers (``worker_parts``;
      none: this process alone writes the save).
  """

  def __init__(
    self, file_prefix: str, variables: Sequence[slicing.WorkerParts]
  ):
    self.file_prefix = file_prefix
    self.temp = f"{file_prefix}_temp"
    self._strategy = variables[0].strategy if variables else None
    self.index = variables[0].worker_index if variables else 0
    self.chief = self.index == 0

  def _barrier(self) -> None:
    strategy = self._strategy
    if strategy is None:
      return
    if strategy not in _barriers:
      _barriers[strategy] = tf.function(
        lambda: strategy.reduce(
          tf.distribute.ReduceOp.SUM,
          strategy.run(lambda: tf.constant(1.0)),
          axis=None,
        )
      )
    _barriers[strategy]()

  def begin(self) -> None:
    """The chief removes what killed saves left (every worker is here:
    any ``*_temp`` is stale)."""
    self._barrier()
    if self.chief:
      remove_stale_temps(self.file_prefix)
    self._barrier()

  def prefix(self, name: str) -> str:
    """The prefix of the part ``name``."""
    return f"{self.temp}/part-{name}"

  def write(self, name: str, entries: Sequence[Entry]) -> None:
    """Writes ``entries`` as the part ``name`` (names unique per save)."""
    tf.io.gfile.makedirs(self.temp)
    write_tensors(self.prefix(name), entries)

  def commit(self) -> None:
    """Once every worker wrote its parts, the chief merges them, moves
    the result to ``file_prefix`` (``commit``) and removes the parts;
    nobody returns before the save is whole."""
    self._barrier()
    if self.chief:
      parts = sorted(
        name[: -len(".index")]
        for name in tf.io.gfile.glob(f"{self.temp}/part-*.index")
      )
      merged = f"{self.temp}/merged"
      with tf.device("CPU"):
        tf.raw_ops.MergeV2Checkpoints(
          checkpoint_prefixes=parts,
          destination_prefix=merged,
          delete_old_dirs=False,
        )
      commit(merged, self.file_prefix)
      remove(self.temp)
    self._barrier()


def save_id(file_prefix: str) -> str:
  """A digest of the committed save ``file_prefix`` (of its index, which
  holds every tensor's checksum): what a delta names its parent by.

  Raises:
    tf.errors.NotFoundError: there is no ``<file_prefix>.index``.
  """
  with tf.io.gfile.GFile(f"{file_prefix}.index", "rb") as index:
    return hashlib.sha256(index.read()).hexdigest()[:16]
