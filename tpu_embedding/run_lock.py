"""One writer per directory: the lock a run's chief holds for its life.

A training run, a ``CheckpointManager`` that saves and a SavedModel
version writer (``tools/export.py --apply_delta``) each write a directory
that a second writer would corrupt: checkpoints, summaries and versions
interleave, and one run is lost without a word. ``RunLock(directory)``
is the one lock all of them take: an exclusive ``fcntl.flock`` on
``<directory>/.tpu_embedding.lock``, kept open for as long as the writer
runs. The kernel releases it when the process ends, however it ends: a
run killed with ``kill -9`` leaves at most a lock file that nobody holds,
and the next run takes it over (and resumes from the last checkpoint).

* The holder writes who it is into the file (pid, host, start time, the
  command) and removes the file when it releases the lock; a refused
  writer reads it for its one-line error (``DirectoryInUseError``), and
  writes nothing: it does not create the directory or the file when they
  exist.
* Within one process the lock is counted, not exclusive: a trainer that
  holds its run's directory and the ``CheckpointManager`` it saves with
  share it; it is released when the last of them releases it.
* A process whose **parent** holds the lock shares it too (the local
  launcher, ``model_garden.ranking.launcher``, holds its run's directory
  for the task processes it starts and restarts).
* Readers (evaluation, ``--mode continuous_eval``, exports from a
  checkpoint) take no lock.
* Only local directories are locked: a path with a scheme (``gs://``,
  ``hdfs://``) has no ``flock``; there ``RunLock`` holds nothing
  (``held`` is False).

Example:
  >>> import tempfile
  >>> from tpu_embedding import run_lock
  >>> directory = tempfile.mkdtemp()
  >>> with run_lock.RunLock(directory) as lock:
  ...   lock.held, run_lock.holder(directory).pid == os.getpid()
  (True, True)
  >>> run_lock.holder(directory) is None  # released: nobody holds it
  True
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import sys
import time
from types import TracebackType

__all__ = [
  "LOCK_FILE",
  "DirectoryInUseError",
  "Holder",
  "RunLock",
  "check_free",
  "is_chief_task",
]

#: The lock file's name inside the locked directory.
LOCK_FILE = ".tpu_embedding.lock"


@dataclasses.dataclass(frozen=True)
class Holder:
  """Who holds a directory's lock, as its lock file says.

  Attributes:
    pid: the holding process.
    host: the machine it runs on.
    started: when it took the lock (local time, ``%Y-%m-%d %H:%M:%S``).
    command: its command line (``sys.argv``), shortened.
  """

  pid: int = 0
  host: str = ""
  started: str = ""
  command: str = ""

  def describe(self) -> str:
    """``pid 123 on host, since 2026-01-01 12:00:00`` (what is known)."""
    if not self.pid:
      return "another process (starting)"
    where = f" on {self.host}" if self.host else ""
    since = f", since {self.started}" if self.started else ""
    return f"pid {self.pid}{where}{since}"


class DirectoryInUseError(RuntimeError):
  """Another process holds the directory's lock (one-line message).

  Attributes:
    directory: the directory.
    holder: who holds it (``Holder``).
  """

  def __init__(self, directory: str, holder: Holder, what: str):
    self.directory = directory
    self.holder = holder
    super().__init__(
      f"{directory} is in use by another run ({holder.describe()}; lock "
      f"file {os.path.join(directory, LOCK_FILE)}): wait for it to finish "
      f"or stop it, or {what}."
    )


@dataclasses.dataclass
class _Entry:
  """A lock this process holds: its file (None: the parent's) and count."""

  fd: int | None
  count: int
  pid: int


#: The locks this process holds, by the directory's real path.
_HELD: dict[str, _Entry] = {}


def is_chief_task() -> bool:
  """Whether ``TF_CONFIG`` (if any) makes this process its cluster's
  chief, the one writer of a run's directory: its ``chief`` task, or
  worker 0 of a cluster without one (no ``TF_CONFIG``: a single process).

  Example:
    >>> import json, os
    >>> from tpu_embedding import run_lock
    >>> saved = os.environ.pop("TF_CONFIG", None)
    >>> run_lock.is_chief_task()  # no cluster: a single process
    True
    >>> cluster = {"chief": ["a:1"], "worker": ["b:2"]}
    >>> os.environ["TF_CONFIG"] = json.dumps(
    ...   {"cluster": cluster, "task": {"type": "worker", "index": 0}})
    >>> run_lock.is_chief_task()  # worker 0 of a cluster with a chief
    False
    >>> del os.environ["TF_CONFIG"]
    >>> os.environ.update({"TF_CONFIG": saved} if saved else {})
  """
  try:
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    task = config.get("task") or {}
    kind, index = task.get("type"), int(task.get("index") or 0)
    cluster = config.get("cluster") or {}
  except (ValueError, TypeError, AttributeError):
    return True  # (TensorFlow itself refuses such a TF_CONFIG)
  if kind in (None, "chief"):
    return True
  return kind == "worker" and index == 0 and "chief" not in cluster


def _is_local(directory: str) -> bool:
  return "://" not in directory


def _key(directory: str) -> str:
  return os.path.realpath(directory)


def _read_holder(fd: int) -> Holder:
  """The holder a lock file names (an empty ``Holder`` if unreadable)."""
  try:
    text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
    fields = json.loads(text) if text.strip() else {}
    return Holder(
      pid=int(fields.get("pid", 0)),
      host=str(fields.get("host", "")),
      started=str(fields.get("started", "")),
      command=str(fields.get("command", "")),
    )
  except (OSError, ValueError, TypeError):
    return Holder()


def _try_lock(fd: int) -> bool:
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
      return False
    raise
  return True


def _held_by_parent(holder: Holder) -> bool:
  return holder.pid == os.getppid() and holder.host == socket.gethostname()


def check_free(directory: str, what: str = "use another directory") -> None:
  """Raises ``DirectoryInUseError`` if another process holds ``directory``.

  Writes nothing (a check before a run's first write; the run then takes
  the lock with ``RunLock``). A directory held by this process or its
  parent is free to it.

  Args:
    directory: the directory a writer is about to write.
    what: the way out the message offers (e.g. ``"use another
      --model_dir"``).

  Raises:
    DirectoryInUseError: naming the directory and the holder.

  Example:
    >>> import tempfile
    >>> from tpu_embedding import run_lock
    >>> run_lock.check_free(tempfile.mkdtemp())  # nobody holds it
  """
  if not _is_local(directory) or _key(directory) in _HELD:
    return
  try:
    fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
  except OSError:
    return  # no lock file (or none readable): nobody holds it
  try:
    if _try_lock(fd):
      fcntl.flock(fd, fcntl.LOCK_UN)
      return
    found = _read_holder(fd)
    if not _held_by_parent(found):
      raise DirectoryInUseError(directory, found, what)
  finally:
    os.close(fd)


def holder(directory: str) -> Holder | None:
  """Who holds ``directory``'s lock now, or None (nobody does).

  Example:
    >>> import tempfile
    >>> from tpu_embedding import run_lock
    >>> run_lock.holder(tempfile.mkdtemp()) is None
    True
  """
  key = _key(directory)
  if key in _HELD:
    entry = _HELD[key]
    if entry.fd is not None:
      return _read_holder(entry.fd)
  try:
    fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
  except OSError:
    return None
  try:
    if key not in _HELD and _try_lock(fd):
      fcntl.flock(fd, fcntl.LOCK_UN)
      return None
    return _read_holder(fd)
  finally:
    os.close(fd)


class RunLock:
  """The writer lock of ``directory`` (see the module docstring).

  Args:
    directory: the directory written (created if missing, with its
      parents, when the lock is taken).
    what: the way out a refusal offers (``DirectoryInUseError``'s message),
      e.g. ``"use another --model_dir"``.

  Use it as a context manager, or call ``acquire`` and ``release``.

  Example:
    >>> import tempfile
    >>> from tpu_embedding import run_lock
    >>> lock = run_lock.RunLock(tempfile.mkdtemp()).acquire()
    >>> again = run_lock.RunLock(lock.directory).acquire()  # same process
    >>> again.release(); lock.release()
  """

  def __init__(self, directory: str, what: str = "use another directory"):
    self.directory = directory
    self.what = what
    self._acquired = False

  @property
  def held(self) -> bool:
    """Whether this lock holds its directory (False for remote paths)."""
    return self._acquired

  def acquire(self) -> RunLock:
    """Takes the lock; returns ``self``.

    Raises:
      DirectoryInUseError: another process holds it (nothing was written).
      OSError: the directory or the lock file cannot be made.
    """
    if self._acquired or not _is_local(self.directory):
      return self
    key = _key(self.directory)
    entry = _HELD.get(key)
    if entry is not None and entry.pid == os.getpid():
      entry.count += 1
      self._acquired = True
      return self
    os.makedirs(self.directory, exist_ok=True)
    path = os.path.join(self.directory, LOCK_FILE)
    for _ in range(10):
      fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
      if not _try_lock(fd):
        found = _read_holder(fd)
        os.close(fd)
        if _held_by_parent(found):
          _HELD[key] = _Entry(None, 1, os.getpid())
          self._acquired = True
          return self
        raise DirectoryInUseError(self.directory, found, self.what)
      try:
        same = os.fstat(fd).st_ino == os.stat(path).st_ino
      except FileNotFoundError:
        same = False
      if same:
        break
      # The previous holder removed the file as we opened it: again.
      os.close(fd)
    else:  # pragma: no cover - ten removals in a row
      raise DirectoryInUseError(self.directory, Holder(), self.what)
    record = {
      "pid": os.getpid(),
      "host": socket.gethostname(),
      "started": time.strftime("%Y-%m-%d %H:%M:%S"),
      "command": " ".join(sys.argv)[:500],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    _HELD[key] = _Entry(fd, 1, os.getpid())
    self._acquired = True
    return self

  def release(self) -> None:
    """Releases the lock (the last holder in this process removes the
    file and unlocks)."""
    if not self._acquired:
      return
    self._acquired = False
    key = _key(self.directory)
    entry = _HELD.get(key)
    if entry is None:
      return
    entry.count -= 1
    if entry.count > 0:
      return
    del _HELD[key]
    if entry.fd is None:
      return
    try:
      os.remove(os.path.join(self.directory, LOCK_FILE))
    except OSError:
      pass  # (the directory was removed: a failed run's cleanup)
    fcntl.flock(entry.fd, fcntl.LOCK_UN)
    os.close(entry.fd)

  def __enter__(self) -> RunLock:
    return self.acquire()

  def __exit__(
    self,
    kind: type[BaseException] | None,
    value: BaseException | None,
    traceback: TracebackType | None,
  ) -> None:
    self.release()
