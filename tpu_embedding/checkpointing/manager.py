"""``CheckpointManager``, and a directory's chain of full and delta saves.

A ``CheckpointManager`` directory holds full checkpoints (``full.write``:
each worker its own rows) and, with ``delta_interval``, the deltas after
the latest (``deltas.write_delta``), recorded in ``deltas.json``:
``latest_with_deltas`` and ``saved_chain`` turn a directory or a save
back into what ``full.restore(..., deltas=)`` takes.

Example:
  >>> chain_end("/run/ckpt-2", ["/run/delta-4"])
  '/run/delta-4'
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Sequence
from typing import Any
from typing import TypeVar

import tensorflow as tf

from tpu_embedding import run_lock
from tpu_embedding.checkpointing import deltas as delta_saves
from tpu_embedding.checkpointing import full
from tpu_embedding.checkpointing.parts import is_chief


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
    self.chief = is_chief(self._checkpoint)
    if callbacks:
      options = tf.train.CheckpointOptions()
    path = full.write(self._checkpoint, file_prefix, options)
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
  chain = _read_chain(directory)
  if os.path.join(directory, chain["base"]) != latest:
    return latest, []
  return latest, [os.path.join(directory, name) for name in chain["deltas"]]


def _read_chain(directory: str) -> dict[str, Any]:
  """The chain ``directory`` records (``write_chain``), or an empty one."""
  state = os.path.join(directory, DELTA_STATE)
  if not tf.io.gfile.exists(state):
    return {"base": "", "deltas": []}
  with tf.io.gfile.GFile(state) as f:
    return dict(json.load(f))


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
  if not reader.has_tensor(delta_saves.META_KEY):
    return path, []
  directory, name = os.path.split(path)
  chain = _read_chain(directory)
  if name not in chain["deltas"]:
    state = os.path.join(directory, DELTA_STATE)
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
      is_chief(self._checkpoint) and run_lock.is_chief_task()
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
    last = delta_saves.last_save(self._checkpoint)
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
      if is_chief(self._checkpoint):
        write_chain(self._directory, path, [])
        for delta in old:
          for name in tf.io.gfile.glob(f"{delta}.*"):
            tf.io.gfile.remove(name)
    return path

  def _save_delta(self, checkpoint_number: Any) -> str:
    counter = self._checkpoint.save_counter
    counter.assign_add(1)
    number = int(counter) if checkpoint_number is None else checkpoint_number
    prefix = os.path.join(self._directory, f"delta-{int(number)}")
    path = delta_saves.write_delta(self._checkpoint, prefix)
    self.deltas.append(path)
    if is_chief(self._checkpoint):
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
    """Restores the latest full checkpoint and its deltas by parts
    (``full.restore``), or initializes as TensorFlow's manager does."""
    base, deltas = latest_with_deltas(self._directory)
    if base is None:
      return super().restore_or_initialize()
    full.restore(self._checkpoint, base, deltas=deltas)
    self.deltas = deltas
    return chain_end(base, deltas)
