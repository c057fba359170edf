"""Full saves in which each worker writes and reads only its own rows.

Under ``MultiWorkerMirroredStrategy`` a row-sharded table has no process
that holds it whole. A plain ``tf.train.Checkpoint`` save, which every
worker writes on its own (the chief to the real path, the others to a
temporary one), must therefore gather every table on every worker. The
functions here are called by **every worker with the same path** on a
filesystem they share, and keep each worker at its own rows: the chief
writes everything but the multi-worker tables' rows (dense weights, small
tables, the object graph, which records every table) as one part; every
worker writes its own rows, as slices of each full ``[vocabulary_size,
dim]`` tensor, in chunks of at most 64 MiB (read row by row: no
whole-block copy; ``chunk_bytes`` sets another size); the chief merges
and commits them (``parts.PartWriter``: atomic).

The result is an ordinary TensorFlow checkpoint: each table under its usual
key with its full value, readable by one device, any replica or worker
count and TensorFlow's ``TPUEmbeddingForServing``. Elsewhere (one worker,
parameter servers, one device) ``write`` is ``Checkpoint.write``:
TensorFlow already writes each parameter server's rows on that server.

``restore`` reads only this process's rows of each row-sharded table
(multi-worker, parameter servers, ``MirroredStrategy``), whoever wrote the
checkpoint: a table saved whole by one process, or in slices, is read by
parts of at most a chunk (``checkpointing/rows.py``), never whole.

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

import abc
import sys
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.checkpointing import deltas as delta_saves
from tpu_embedding.checkpointing import parts
from tpu_embedding.checkpointing import rows
from tpu_embedding.checkpointing import slicing
from tpu_embedding.checkpointing.parts import checkpoint_keys
from tpu_embedding.checkpointing.parts import key_id


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
  _checked(chunk_bytes)
  variables = parts.worker_parts(checkpoint)
  if not variables:
    path: str = checkpoint.write(file_prefix, options=options)
    delta_saves.record_save(checkpoint, path)
    return path
  writer = parts.PartWriter(file_prefix, variables)
  writer.begin()
  # The chief's part: everything but the multi-worker state (recorded, so
  # a restore finds it); then every worker's parts.
  with slicing.written_apart():
    if writer.chief:
      checkpoint.write(writer.prefix("main"), options=options)
  for keys, variable in zip(
    checkpoint_keys(checkpoint, variables), variables, strict=True
  ):
    name = f"{writer.index:05d}-{key_id(keys[0])}"
    for part in variable.saved_parts(keys, chunk_bytes):
      writer.write(f"{name}-{part[0]}", part[1])
      del part  # (one chunk of rows held at a time)
  writer.commit()
  delta_saves.record_save(checkpoint, file_prefix)
  return file_prefix


def _checked(chunk_bytes: int | None) -> None:
  """Raises a ``ValueError`` unless ``chunk_bytes`` is None or positive."""
  if chunk_bytes is not None and chunk_bytes < 1:
    raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}.")


def restore(
  checkpoint: Any,
  save_path: str,
  options: Any = None,
  *,
  chunk_bytes: int | None = None,
  deltas: Sequence[str] = (),
) -> Any:
  """``checkpoint.restore(save_path)``, each process reading its own rows.

  Row-sharded tables built after the restore read their rows when created
  (restore-on-create: each row is read once, part by part, into its
  block). Row-sharded tables that exist already (on workers, parameter
  servers or this process's devices) are read part by part into their
  rows, beside them, instead of by TensorFlow's restore (which would hold
  a second copy of every block at once). A part is a stored piece of at
  most a chunk, read whole, or a range of a larger piece's rows
  (``checkpointing/rows.py``): a table saved whole by one process is never
  read whole.

  Args:
    checkpoint: a ``tf.train.Checkpoint``.
    save_path: the checkpoint prefix (any chunk size wrote it).
    options: optional ``tf.train.CheckpointOptions``; its
      ``experimental_io_device`` reads every part (default: each block's
      host: a parameter server reads its rows itself, as in TensorFlow's
      restore, so the checkpoint's path must reach it).
    chunk_bytes: the most bytes of a built table's rows a process reads at
      once (at least one row); None (default): stored pieces up to a
      sixteenth of its block (between 8 and 64 MiB) whole, other rows by
      ranges of a 64th of it (between 1 and 16 MiB).
    deltas: delta checkpoints (``write_delta``) to apply after
      ``save_path``, in order: the first follows ``save_path``, each next
      one the one before. The tables must exist (build them first). The
      result is the state of the last delta's save, bit for bit.

  Returns:
    TensorFlow's restore status (of ``save_path``).

  Raises:
    ValueError: ``chunk_bytes`` is not positive, or a delta holds a table
      the checkpoint does not have.
    DeltaMismatchError: a delta does not follow the save
      before it (another run's, or one skipped); nothing is restored.
  """
  _checked(chunk_bytes)
  if deltas:  # Refused before anything changes.
    delta_saves.check_chain(save_path, deltas)
  io_device = getattr(options, "experimental_io_device", None)
  saved = rows.SavedRows(save_path, io_device)
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
    rows.restore_rows(variable, saved, key, chunk_bytes)
  if save_path:
    delta_saves.apply_deltas(checkpoint, save_path, deltas)
  for state in tf.train.TrackableView(checkpoint).descendants():
    if isinstance(state, DroppedOnRestore):
      state.drop()
  return status


# Trackable is TensorFlow's (untyped: ``Any`` to mypy).
class DroppedOnRestore(compat.Trackable, metaclass=abc.ABCMeta):
  """State that no checkpoint holds and every restore drops (an update
  pipelining holds back: ``step/pipelining.py``). ``restore`` calls
  ``drop`` on each one the checkpoint reaches, whoever wrote the file."""

  @abc.abstractmethod
  def drop(self) -> Any:
    """Drops the state; the writes (a graph's) or None."""


def _held(checkpoint: Any, saved: rows.SavedRows) -> list[tuple[str, Any]]:
  """``(key, variable)`` of the variables ``restore`` reads itself: the
  row-sharded tables' that ``saved`` holds, variables ``saved`` holds in
  another type (a table's ``RowStorage`` other than the saving run's:
  TensorFlow reads no type into another), and float16 ones (TensorFlow
  reads no float16 slice: a row-sharded run's save)."""
  descendants = tf.train.TrackableView(checkpoint).descendants()
  variables = [
    obj
    for obj in descendants
    if isinstance(obj, (rows.RowBlocks, tf.Variable)) and len(obj.shape) == 2
  ]
  if not variables:
    return []
  keys = [key for (key,) in checkpoint_keys(checkpoint, variables)]
  return [
    (key, variable)
    for key, variable in zip(keys, variables, strict=True)
    if saved.holds(key)
    and (
      isinstance(variable, rows.RowBlocks)
      or saved.saved_dtype(key) not in (None, variable.dtype)
      or saved.saved_dtype(key) == tf.float16
    )
  ]
