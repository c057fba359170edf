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

import json
import os
import sys
import weakref
from collections.abc import Sequence
from typing import Any
from typing import TypeVar

import tensorflow as tf

from tpu_embedding import checkpoint_deltas
from tpu_embedding import compat
from tpu_embedding import run_lock
from tpu_embedding.checkpoint_files import Workers as _Workers
from tpu_embedding.checkpoint_files import checkpoint_keys as _checkpoint_keys
from tpu_embedding.checkpoint_files import key_id
from tpu_embedding.checkpoint_files import merge_and_commit
from tpu_embedding.checkpoint_files import remove_stale_temps
from tpu_embedding.checkpoint_files import worker_parts as _worker_parts
from tpu_embedding.tables import saved_rows
from tpu_embedding.tables import slicing

__all__ = [
  "CheckpointManager",
  "DeltaMismatchError",
  "apply_deltas",
  "chain_end",
  "key_id",
  "latest_with_deltas",
  "restore",
  "saved_chain",
  "write",
  "write_chain",
  "write_delta",
]

#: Removes what a killed save left (see ``checkpoint_files``).
_remove_stale_temps = remove_stale_temps


def _row_blocks(checkpoint: Any) -> list[saved_rows.RowBlocks]:
  """The row-sharded tables' variables: a restore fills them in place."""
  return [
    obj
    for obj in tf.train.TrackableView(checkpoint).descendants()
    if isinstance(obj, saved_rows.RowBlocks)
  ]


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
    path: str = checkpoint.write(file_prefix, options=options)
    checkpoint_deltas.record_save(checkpoint, path)
    return path
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
    merge_and_commit(temp, file_prefix)
  workers.barrier()  # Nobody reads the checkpoint before it is whole.
  checkpoint_deltas.record_save(checkpoint, file_prefix)
  return file_prefix


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
    deltas: delta checkpoints (``write_delta``) to apply after
      ``save_path``, in order: the first follows ``save_path``, each next
      one the one before. The tables must exist (build them first). The
      result is the state of the last delta's save, bit for bit.

  Returns:
    TensorFlow's restore status (of ``save_path``).

  Raises:
    ValueError: ``chunk_bytes`` is not positive, or a delta holds a table
      the checkpoint does not have.
    checkpoint_deltas.DeltaMismatchError: a delta does not follow the save
      before it (another run's, or one skipped); nothing is restored.
  """
  _checked(chunk_bytes)
  if deltas:  # Refused before anything changes.
    checkpoint_deltas.check_chain(save_path, deltas)
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
  if save_path:
    checkpoint_deltas.apply_deltas(checkpoint, save_path, deltas)
  return status


#: Writes the rows changed since the last save (``checkpoint_deltas``).
write_delta = checkpoint_deltas.write_delta
#: Applies deltas after a restored full checkpoint (``checkpoint_deltas``).
apply_deltas = checkpoint_deltas.apply_deltas
#: A delta given after a save it does not follow.
DeltaMismatchError = checkpoint_deltas.DeltaMismatchError


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


_Base = TypeVar("_Base", str, None)

#: A directory's chain of deltas: ``{"base": name, "deltas": [names]}``.
DELTA_STATE = "deltas.json"


def latest_with_deltas(directory: str) -> tuple[str | None, list[str]]:
  """``(latest full checkpoint, its deltas in order)`` of a
  ``CheckpointManager`` directory: what ``restore(..., deltas=)`` takes
  to return to the last save. ``(None, [])`` if there is no checkpoint.

  Example:
    >>> import tempfile
    >>> latest_with_deltas(tempfile.mkdtemp())
    (None, [])
  """
  latest = tf.train.latest_checkpoint(directory)
  if latest is None:
    return None, []
  state = os.path.join(directory, DELTA_STATE)
  if not tf.io.gfile.exists(state):
    return latest, []
  with tf.io.gfile.GFile(state) as f:
    chain = json.load(f)
  if os.path.join(directory, chain["base"]) != latest:
    return latest, []
  return latest, [os.path.join(directory, name) for name in chain["deltas"]]


def chain_end(base: _Base, deltas: Sequence[str]) -> _Base | str:
  """The save a chain ends in, whose state it restores: its last delta,
  else its full checkpoint (None: no checkpoint).

  Example:
    >>> chain_end("/run/ckpt-2", ["/run/delta-4"]), chain_end("/run/ckpt-2", [])
    ('/run/delta-4', '/run/ckpt-2')
  """
  return deltas[-1] if deltas else base


def saved_chain(path: str) -> tuple[str, list[str]]:
  """``(full checkpoint, deltas in order)`` whose restore gives the save
  ``path``: the state a user means by it.

  ``path`` is a ``CheckpointManager`` directory (its latest save, full or
  delta: ``latest_with_deltas``), a full checkpoint's prefix (no deltas),
  or a delta's prefix (its directory's ``deltas.json`` names the full
  checkpoint it follows and the deltas before it).

  Raises:
    ValueError: no checkpoint there, or a delta whose directory does not
      record its chain (one line naming it and what to pass instead).

  Example:
    >>> import tempfile
    >>> import tensorflow as tf
    >>> directory = tempfile.mkdtemp()
    >>> manager = CheckpointManager(tf.train.Checkpoint(
    ...     v=tf.Variable(1.0)), directory, 2, delta_interval=2)
    >>> base, delta = manager.save(), manager.save()
    >>> saved_chain(directory) == (base, [delta])
    True
    >>> saved_chain(base) == (base, [])
    True
  """
  path = path.rstrip("/") or "/"
  if tf.io.gfile.isdir(path):
    base, deltas = latest_with_deltas(path)
    if base is None:
      raise ValueError(
        f"Directory {path} has no checkpoint (no 'checkpoint' state file, "
        "written by CheckpointManager or Checkpoint.save): train first, or "
        "pass a checkpoint's prefix."
      )
    return base, deltas
  if not tf.io.gfile.exists(path + ".index"):
    raise ValueError(f"No checkpoint {path} ({path}.index does not exist).")
  reader = tf.train.load_checkpoint(path)
  if not reader.has_tensor(checkpoint_deltas.META_KEY):
    return path, []
  directory, name = os.path.split(path)
  state = os.path.join(directory, DELTA_STATE)
  chain: dict[str, Any] = {"base": "", "deltas": []}
  if tf.io.gfile.exists(state):
    with tf.io.gfile.GFile(state) as f:
      chain = json.load(f)
  if name not in chain["deltas"]:
    raise ValueError(
      f"{path} is a delta checkpoint, and {state} does not name the full "
      "checkpoint it follows (its chain was replaced by a newer full "
      "save): pass the run's directory, or a full checkpoint."
    )
  deltas = chain["deltas"][: chain["deltas"].index(name) + 1]
  return (
    os.path.join(directory, chain["base"]),
    [os.path.join(directory, d) for d in deltas],
  )


def write_chain(directory: str, base: str, deltas: Sequence[str]) -> None:
  """Records ``base`` and its ``deltas`` (saves in ``directory``) as the
  directory's chain, in ``DELTA_STATE``, atomically (a rename):
  ``latest_with_deltas`` then returns them once ``base`` is its latest
  checkpoint."""
  path = os.path.join(directory, DELTA_STATE)
  with tf.io.gfile.GFile(path + ".tmp", "w") as f:
    json.dump(
      {
        "base": os.path.basename(base),
        "deltas": [os.path.basename(d) for d in deltas],
      },
      f,
    )
  tf.io.gfile.rename(path + ".tmp", path, overwrite=True)


class CheckpointManager(tf.train.CheckpointManager):
  """``tf.train.CheckpointManager`` whose saves and restores are sliced.

  Create it on every worker with the same ``directory``: every worker
  writes its rows, the chief keeps the ``checkpoint`` state file and
  deletes old checkpoints.

  With ``delta_interval=K`` (K > 0), a full save is followed by up to K
  delta saves (``write_delta``: the rows changed since the save before,
  as ``delta-<number>``), then the next full one. The chain of the latest
  full checkpoint is kept in ``deltas.json`` (``latest_with_deltas``;
  ``restore_or_initialize`` applies it); the deltas of an older full
  checkpoint are removed once a newer full one is committed.

  One writer per directory: the chief (the process that keeps the state
  file; under a ``TF_CONFIG`` cluster its chief, or worker 0 without
  one) takes the directory's ``run_lock.RunLock`` at its first save and
  holds it for the manager's life. A manager of another process saving
  into the same directory is refused at its first save, before it writes
  anything (``run_lock.DirectoryInUseError``: one line naming the directory
  and the holder's pid). Managers of one process share the lock, as do a
  training run that holds its directory and its manager; restoring
  takes no lock.

  Example:
    >>> import tempfile
    >>> import tensorflow as tf
    >>> manager = CheckpointManager(
    ...     tf.train.Checkpoint(step=tf.Variable(1)), tempfile.mkdtemp(), 2)
    >>> manager.save().endswith("ckpt-1")
    True
  """

  _checkpoint: Any  # TensorFlow's attribute: swapped while saving

  def __init__(self, *args: Any, delta_interval: int = 0, **kwargs: Any):
    if not isinstance(delta_interval, int) or delta_interval < 0:
      raise ValueError(
        "CheckpointManager: delta_interval must be an int >= 0 (deltas "
        f"between full saves; 0: full saves only), got {delta_interval!r}."
      )
    super().__init__(*args, **kwargs)
    self.delta_interval = delta_interval
    #: The deltas written (or restored) after the latest full checkpoint.
    self.deltas: list[str] = []
    self._lock: run_lock.RunLock | None = None

  def _hold_directory(self) -> None:
    """The chief takes the directory's writer lock (once, for the
    manager's life: released when it is collected, or by the kernel when
    the process ends)."""
    if self._lock is not None or not (
      self._is_chief() and run_lock.is_chief_task()
    ):
      return
    lock = run_lock.RunLock(
      self._directory, "save into another directory"
    ).acquire()
    self._lock = lock
    weakref.finalize(self, lock.release)

  @property
  def latest_save(self) -> str | None:
    """The last save, full or delta (``latest_checkpoint`` names the last
    full one): what ``saved_chain`` turns back into this state."""
    return chain_end(self._latest_checkpoint, self.deltas)

  def save(self, checkpoint_number=None, check_interval=True, options=None):
    """A full save, or a delta if ``delta_interval`` says one is due.

    Raises:
      run_lock.DirectoryInUseError: (first save) another process writes the
        directory.
    """
    self._hold_directory()
    latest = self._latest_checkpoint
    last = checkpoint_deltas.last_save(self._checkpoint)
    expected = (self.deltas or [latest])[-1] if latest else None
    if (
      self.delta_interval
      and len(self.deltas) < self.delta_interval
      and last is not None
      and expected is not None
      and last[0] == expected
    ):
      return self._save_delta(checkpoint_number)
    old = list(self.deltas)
    path = self._save_full(checkpoint_number, check_interval, options)
    if path is not None and self.delta_interval:
      self.deltas = []
      if self._is_chief():
        write_chain(self._directory, path, [])
        for delta in old:
          for name in tf.io.gfile.glob(f"{delta}.*"):
            tf.io.gfile.remove(name)
    return path

  def _is_chief(self) -> bool:
    variables = _worker_parts(self._checkpoint)
    return not variables or variables[0].worker_index == 0

  def _save_delta(self, checkpoint_number: Any) -> str:
    counter = self._checkpoint.save_counter
    counter.assign_add(1)
    number = int(counter) if checkpoint_number is None else checkpoint_number
    prefix = os.path.join(self._directory, f"delta-{int(number)}")
    path = checkpoint_deltas.write_delta(self._checkpoint, prefix)
    self.deltas.append(path)
    if self._is_chief():
      write_chain(self._directory, self._latest_checkpoint, self.deltas)
    return path

  def _save_full(self, checkpoint_number, check_interval, options):
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
    """Restores the latest full checkpoint and its deltas (or initializes,
    as TensorFlow's manager does)."""
    base, deltas = latest_with_deltas(self._directory)
    if base is not None and deltas:
      restore(self._checkpoint, base, deltas=deltas)
      self.deltas = deltas
      return deltas[-1]
    with slicing.sliced():
      path = super().restore_or_initialize()
    if base is not None and path == base:
      checkpoint_deltas.record_save(self._checkpoint, base)
    return path
