"""Checkpoints in which each worker writes and reads only its own rows.

Under ``MultiWorkerMirroredStrategy`` a row-sharded table has no process
that holds it whole. A plain ``tf.train.Checkpoint`` save, which every
worker writes on its own (the chief to the real path, the others to a
temporary one), must therefore gather every table on every worker. The
functions here are called by **every worker with the same path** on a
filesystem they share, and keep each worker at its own rows:

1. the chief writes everything but the multi-worker tables' rows (dense
   weights, small tables, the object graph, which records every table) as
   one part under ``<prefix>_temp/``; every worker writes its own rows, as
   slices of each full ``[vocabulary_size, dim]`` tensor, in chunks of at
   most 64 MiB (read row by row: no whole-block copy; ``chunk_bytes``
   sets another size);
2. the chief merges the parts (TensorFlow's own ``MergeV2Checkpoints``,
   as for its partitioned variables) inside ``<prefix>_temp``, then moves
   the merged data files to ``<prefix>`` and its index last: a
   ``<prefix>.index`` is only ever a whole checkpoint (the rename of the
   index is the commit), and ``<prefix>_temp`` is removed;
3. a worker or chief killed while saving leaves a ``*_temp`` directory,
   or data files without an index: the next save in that directory
   removes them, before writing anything.

The result is an ordinary TensorFlow checkpoint: each table under its usual
key with its full value, readable by one device, any replica or worker
count and TensorFlow's ``TPUEmbeddingForServing``. Elsewhere (one worker,
parameter servers, one device) ``write`` is ``Checkpoint.write``:
TensorFlow already writes each parameter server's rows on that server.

``restore`` reads only this process's rows of each row-sharded table
(multi-worker, parameter servers, ``MirroredStrategy``), whoever wrote the
checkpoint: a table saved whole by one process, or in slices, is read by
parts of at most a chunk (``tables/saved_rows.py``), never whole.

Example:
  >>> import tempfile
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> emb = tpe.TPUEmbedding(tpe.FeatureConfig(tpe.TableConfig(8, 2)),
  ...                        tpe.SGD(0.1))
  >>> emb.build()
  >>> checkpoint = tf.train.Checkpoint(embedding=emb)
  >>> path = write(checkpoint, tempfile.mkdtemp() + "/ckpt")
  >>> _ = restore(checkpoint, path)
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.tables import saved_rows
from tpu_embedding.tables import slicing

__all__ = ["CheckpointManager", "restore", "write"]


def _row_blocks(checkpoint: Any) -> list[saved_rows.RowBlocks]:
  """The row-sharded tables' variables: a restore fills them in place."""
  return [
    obj
    for obj in tf.train.TrackableView(checkpoint).descendants()
    if isinstance(obj, saved_rows.RowBlocks)
  ]


def _worker_parts(checkpoint: Any) -> list[slicing.WorkerParts]:
  """What every worker writes its part of: multi-worker tables, and
  state sharded like them (a dynamic table's vocabulary)."""
  return [
    obj
    for obj in tf.train.TrackableView(checkpoint).descendants()
    if isinstance(obj, slicing.WorkerParts) and obj.worker_count > 1
  ]


#: One compiled barrier per strategy.
_barriers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Workers:
  """This worker's place in the cluster, and a barrier over all workers."""

  def __init__(self, variable: slicing.WorkerParts):
    self.strategy = variable.strategy
    self.index, self.count = variable.worker_index, variable.worker_count
    self.chief = self.index == 0

  def barrier(self) -> None:
    if self.strategy not in _barriers:
      strategy = self.strategy
      _barriers[strategy] = tf.function(
        lambda: strategy.reduce(
          tf.distribute.ReduceOp.SUM,
          strategy.run(lambda: tf.constant(1.0)),
          axis=None,
        )
      )
    _barriers[self.strategy]()


def key_id(key: str) -> str:
  """A file-name-safe, stable id of a checkpoint key."""
  return hashlib.sha1(key.encode()).hexdigest()[:12]


def _checkpoint_keys(
  checkpoint: Any, variables: Sequence[Any]
) -> list[list[str]]:
  """The checkpoint keys of each of ``variables`` in ``checkpoint``."""
  # TensorFlow's own serialization names them (no value is read: the
  # variables are written apart).
  with slicing.written_apart():
    keys = compat.checkpoint_keys(checkpoint)
  return [keys[id(v)] for v in variables]


def _remove(path: str) -> None:
  """Removes the file or directory ``path``, if there is one."""
  if tf.io.gfile.isdir(path):
    tf.io.gfile.rmtree(path)
  elif tf.io.gfile.exists(path):
    tf.io.gfile.remove(path)


#: A checkpoint's data file: ``<prefix>.data-00000-of-00001``.
_DATA_FILE = re.compile(r"(.*)\.data-\d{5}-of-\d{5}")


def _remove_stale_temps(file_prefix: str) -> None:
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
      _remove(os.path.join(directory, name))


def _commit(merged: str, file_prefix: str) -> None:
  """Moves the checkpoint ``merged`` to ``file_prefix``, its index last.

  A checkpoint already at ``file_prefix`` loses its index first and then
  its data files, so that no index ever names data files of another save.
  """
  for path in [
    f"{file_prefix}.index",
    *tf.io.gfile.glob(f"{file_prefix}.data-?????-of-?????"),
  ]:
    _remove(path)
  for path in tf.io.gfile.glob(f"{merged}.data-?????-of-?????"):
    suffix = path[len(merged) :]
    tf.io.gfile.rename(path, file_prefix + suffix, overwrite=True)
  tf.io.gfile.rename(f"{merged}.index", f"{file_prefix}.index", overwrite=True)


def write(
  checkpoint: Any,
  file_prefix: str,
  options: Any = None,
  *,
  chunk_bytes: int | None = None,
) -> str:
  """Writes ``checkpoint`` to ``file_prefix``, each worker its own rows.

  Call it on every worker with the same ``file_prefix`` (like
  ``tf.train.Checkpoint.write``, without a save counter).

  Args:
    checkpoint: a ``tf.train.Checkpoint``.
    file_prefix: the checkpoint prefix, on a filesystem all workers share.
    options: optional ``tf.train.CheckpointOptions`` (used by the chief).
    chunk_bytes: the most bytes of a table's rows a worker copies and
      writes at once (at least one row); None (default): a sixteenth of
      its block, between 8 and 64 MiB. The checkpoint's keys and values
      do not depend on it.

  Returns:
    ``file_prefix``.

  Raises:
    ValueError: ``chunk_bytes`` is not positive.
  """
  return _write_parts(
    checkpoint,
    _worker_parts(checkpoint),
    file_prefix,
    options,
    _checked(chunk_bytes),
  )


def _checked(chunk_bytes: int | None) -> int | None:
  """``chunk_bytes``, if None or positive."""
  if chunk_bytes is not None and chunk_bytes < 1:
    raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}.")
  return chunk_bytes


def _write_parts(
  checkpoint: Any,
  variables: list[slicing.WorkerParts],
  file_prefix: str,
  options: Any,
  chunk_bytes: int | None = None,
) -> str:
  """``write`` for the multi-worker state ``variables`` of ``checkpoint``."""
  if not variables:
    return checkpoint.write(file_prefix, options=options)
  workers = _Workers(variables[0])
  temp = f"{file_prefix}_temp"
  workers.barrier()  # Every worker is here: any *_temp is stale.
  if workers.chief:
    _remove_stale_temps(file_prefix)
  workers.barrier()
  # The chief's part: everything but the multi-worker state (recorded, so
  # a restore finds it); then every worker's parts.
  with slicing.written_apart():
    if workers.chief:
      checkpoint.write(f"{temp}/part-main", options=options)
  for keys, variable in zip(
    _checkpoint_keys(checkpoint, variables), variables, strict=True
  ):
    variable.write_parts(
      keys, f"{temp}/part-{workers.index:05d}-{key_id(keys[0])}", chunk_bytes
    )
  workers.barrier()
  if workers.chief:
    parts = sorted(
      name[: -len(".index")]
      for name in tf.io.gfile.glob(f"{temp}/part-*.index")
    )
    merged = f"{temp}/merged"
    with tf.device("CPU"):
      tf.raw_ops.MergeV2Checkpoints(
        checkpoint_prefixes=parts,
        destination_prefix=merged,
        delete_old_dirs=False,
      )
    _commit(merged, file_prefix)
    _remove(temp)
  workers.barrier()  # Nobody reads the checkpoint before it is whole.
  return file_prefix


def restore(
  checkpoint: Any,
  save_path: str,
  options: Any = None,
  *,
  chunk_bytes: int | None = None,
) -> Any:
  """``checkpoint.restore(save_path)``, each process reading its own rows.

  Row-sharded tables built after the restore read their rows when created
  (restore-on-create: each row is read once, part by part, into its
  block). Row-sharded tables that exist already (on workers, parameter
  servers or this process's devices) are read part by part into their
  rows, beside them, instead of by TensorFlow's restore (which would hold
  a second copy of every block at once). A part is a stored piece of at
  most a chunk, read whole, or a range of a larger piece's rows
  (``tables/saved_rows.py``): a table saved whole by one process is never
  read whole.

  Args:
    checkpoint: a ``tf.train.Checkpoint``.
    save_path: the checkpoint prefix (any chunk size wrote it).
    options: optional ``tf.train.CheckpointOptions``.
    chunk_bytes: the most bytes of a built table's rows a process reads at
      once (at least one row); None (default): stored pieces up to a
      sixteenth of its block (between 8 and 64 MiB) whole, other rows by
      ranges of a 64th of it (between 1 and 16 MiB).

  Returns:
    TensorFlow's restore status.

  Raises:
    ValueError: ``chunk_bytes`` is not positive.
  """
  _checked(chunk_bytes)
  saved = saved_rows.SavedRows(save_path)
  tables = _held(checkpoint, saved) if save_path else []
  previous = [compat.update_uid(v) for _, v in tables]
  for _, variable in tables:  # TensorFlow's restore leaves them alone.
    compat.set_update_uid(variable, sys.maxsize)
  status = None
  try:
    with slicing.sliced():
      status = checkpoint.restore(save_path, options=options)
  finally:
    # Restored by this restore (once read below), as TensorFlow records it:
    # the status's assertions then count them as matched.
    uid = compat.restore_uid(status)
    for (_, variable), old in zip(tables, previous, strict=True):
      compat.set_update_uid(variable, old if uid is None else uid)
  for key, variable in tables:
    saved_rows.restore_blocks(
      variable.row_blocks(), saved, key, variable.shape, chunk_bytes
    )
  return status


def _held(
  checkpoint: Any, saved: saved_rows.SavedRows
) -> list[tuple[str, saved_rows.RowBlocks]]:
  """``(key, variable)`` of the row-sharded tables' variables that
  ``saved`` holds (``restore`` reads them)."""
  variables = _row_blocks(checkpoint)
  if not variables:
    return []
  keys = [key for (key,) in _checkpoint_keys(checkpoint, variables)]
  return [
    (key, variable)
    for key, variable in zip(keys, variables, strict=True)
    if saved.holds(key)
  ]


class _SlicedWriter:
  """A checkpoint whose ``_write`` is ``write`` (for ``CheckpointManager``)."""

  def __init__(self, checkpoint: Any):
    self._checkpoint = checkpoint

  def __getattr__(self, name: str) -> Any:
    return getattr(self._checkpoint, name)

  def _write(self, file_prefix: str, options: Any = None) -> str:
    callbacks = list(
      getattr(options, "experimental_write_callbacks", None) or []
    )
    variables = _worker_parts(self._checkpoint)
    self.chief = not variables or variables[0].worker_index == 0
    if callbacks:
      options = tf.train.CheckpointOptions()
    path = _write_parts(self._checkpoint, variables, file_prefix, options)
    if self.chief:  # Only the chief records the state file and sweeps.
      for callback in callbacks:
        callback(path)
    return path


class CheckpointManager(tf.train.CheckpointManager):
  """``tf.train.CheckpointManager`` whose saves and restores are sliced.

  Create it on every worker with the same ``directory``: every worker
  writes its rows, the chief keeps the ``checkpoint`` state file and
  deletes old checkpoints.

  Example:
    >>> import tempfile
    >>> import tensorflow as tf
    >>> manager = CheckpointManager(
    ...     tf.train.Checkpoint(step=tf.Variable(1)), tempfile.mkdtemp(), 2)
    >>> manager.save().endswith("ckpt-1")
    True
  """

  _checkpoint: Any  # TensorFlow's attribute: swapped while saving

  def save(self, checkpoint_number=None, check_interval=True, options=None):
    original = self._checkpoint
    writer = _SlicedWriter(original)
    self._checkpoint = writer
    try:
      path = super().save(checkpoint_number, check_interval, options)
    finally:
      self._checkpoint = original
    if path is not None and not getattr(writer, "chief", True):
      self._latest_checkpoint = path  # (the chief's state file says so too)
    return path

  def restore_or_initialize(self):
    with slicing.sliced():
      return super().restore_or_initialize()
