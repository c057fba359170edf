"""The tests' Python processes, forked from a parent that imported TensorFlow.

The suite starts about 130 Python processes that import TensorFlow:
command-line tools, cluster workers, the Model Garden trainer. Importing
it (and the Keras it imports) costs 4-6 s of CPU on this 2-core machine;
a forked child costs about 0.3 s. :class:`Popen` and :func:`run` are
``subprocess``'s, except that a Python command (``[sys.executable,
script | -m module | -c code, *args]``, or a console script such as
``saved_model_cli`` whose ``#!`` line names this interpreter's directory)
is forked from a server process that has imported TensorFlow, Keras and
numpy, and nothing of ``tpu_embedding`` or of the tests
(``tests/fork_server.py``). The child sets itself up as ``python`` would:
argv, environment, working directory, ``sys.path[0]``, a new ``__main__``,
standard streams buffered as at startup, numpy's seed; it exits as Python
does (an uncaught exception: its traceback and exit code 1; killed:
``-9``). Its pid is real: ``kill``, ``os.kill`` and ``/proc/PID`` work as
for any process.

A command is forked only where that is the same as starting it afresh:
its environment may differ from the server's only in variables read after
TensorFlow's import (``RUNTIME_VARIABLES``, ``RUNTIME_PREFIXES``), and it
passes no interpreter options and no ``Popen`` option a forked child
cannot honour (``preexec_fn``, ``start_new_session``, ...). Anything else
is an ordinary subprocess, as are the runs that measure a process's own
memory against a fresh one (``tests/test_memory.py``: a forked child
starts with its parent's resident pages). ``tests/test_processes.py``
checks each of these behaviours against a plain subprocess.

What forking cannot give: each process its own string-hash seed. Two
servers take the spawns in turn, so the workers of a 2-process cluster
still hash strings differently, as separate interpreters do.

``TPU_EMBEDDING_TEST_FORK=0`` turns forking off (every command a real
subprocess), to compare or to rule it out; ``TPU_EMBEDDING_TEST_FORK_LOG=
FILE`` appends each command and whether it was forked (or why not).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping

#: Variables that may differ between the server and a forked child: read
#: by the child's own code after startup (TensorFlow's cluster, this
#: package's switches, pytest's bookkeeping) or applied by the child
#: itself (``PYTHONUNBUFFERED``).
RUNTIME_VARIABLES = ("TF_CONFIG", "PYTHONUNBUFFERED", "CI")
RUNTIME_PREFIXES = ("TPU_EMBEDDING_", "PYTEST_", "MODEL_GARDEN_")

#: What the servers' environment sets on top of this process's.
SERVER_ENVIRONMENT = {"TF_CPP_MIN_LOG_LEVEL": "3"}

NUM_SERVERS = 2

_SERVER_SCRIPT = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "fork_server.py"
)


def _varies(name: str) -> bool:
  return name in RUNTIME_VARIABLES or name.startswith(RUNTIME_PREFIXES)


class _Server:
  """One fork server process and the socket it listens on."""

  def __init__(self, environment: Mapping[str, str]):
    self.environment = dict(environment)
    # A Unix socket's path must fit in 108 bytes: /tmp where TMPDIR is deep.
    self.directory = tempfile.mkdtemp(prefix="fork_server_")
    if len(self.directory) > 80:
      os.rmdir(self.directory)
      self.directory = tempfile.mkdtemp(prefix="fork_server_", dir="/tmp")
    self.address = os.path.join(self.directory, "socket")
    self.log = os.path.join(self.directory, "stderr")
    with open(self.log, "wb") as log:
      self.process = subprocess.Popen(
        [sys.executable, _SERVER_SCRIPT, self.address],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,
        env=self.environment,
        cwd=self.directory,
      )
    self._ready = False

  def connect(self) -> socket.socket:
    if not self._ready:
      if self.process.stdout.readline().strip() != b"ready":
        with open(self.log, errors="replace") as log:
          tail = log.read()[-2000:]
        raise RuntimeError(
          f"the tests' fork server did not start (TPU_EMBEDDING_TEST_FORK=0 "
          f"runs without it):\n{tail}"
        )
      self._ready = True
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(self.address)
    return connection

  def stop(self) -> None:
    self.process.kill()
    self.process.wait()
    for name in os.listdir(self.directory):
      os.unlink(os.path.join(self.directory, name))
    os.rmdir(self.directory)


class _Servers:
  """The servers of this process, started on first use, taken in turn."""

  def __init__(self):
    self._servers: list[_Server] = []
    self._turn = 0
    self._lock = threading.Lock()

  def environment(self) -> dict[str, str]:
    """The servers' environment (what it will be, before they start)."""
    if self._servers:
      return dict(self._servers[0].environment)
    return {**os.environ, **SERVER_ENVIRONMENT}

  def next(self) -> _Server:
    with self._lock:
      if not self._servers:
        environment = self.environment()
        self._servers = [_Server(environment) for _ in range(NUM_SERVERS)]
        atexit.register(self.stop)
      self._turn += 1
      return self._servers[self._turn % len(self._servers)]

  def stop(self) -> None:
    for server in self._servers:
      server.stop()
    self._servers = []


_SERVERS = _Servers()


def server_environment() -> dict[str, str]:
  """The environment a command needs to be forked (``TF_CONFIG`` and the
  other ``RUNTIME_VARIABLES`` may differ)."""
  return _SERVERS.environment()


def _python_command(args) -> list[str] | None:
  """What follows the interpreter in ``args``: a script or ``-m``/``-c``.

  A console script whose first line runs this interpreter (such as
  ``saved_model_cli``) counts as ``python SCRIPT``. None for anything
  else (another program, interpreter options).
  """
  if isinstance(args, (str, bytes)) or not args:
    return None
  args = [os.fspath(a) for a in args]
  if args[0] != sys.executable:
    try:
      with open(args[0], "rb") as file:
        first = file.readline()
    except OSError:
      return None
    interpreter = os.fsdecode(first[2:].strip()) if first[:2] == b"#!" else ""
    same = os.path.dirname(interpreter) == os.path.dirname(sys.executable)
    if not (same and os.path.basename(interpreter).startswith("python")):
      return None
    return args
  if len(args) < 2 or not args[1].startswith("-"):
    return args[1:] or None
  return args[1:] if args[1] in ("-m", "-c") and len(args) > 2 else None


def _why_not_forked(command, env: Mapping[str, str]) -> str | None:
  if os.environ.get("TPU_EMBEDDING_TEST_FORK", "1") == "0":
    return "TPU_EMBEDDING_TEST_FORK=0"
  if command is None:
    return "not a Python script, -m or -c"
  expected = server_environment()
  differ = sorted(
    n
    for n in set(expected) | set(env)
    if not _varies(n) and expected.get(n) != env.get(n)
  )
  return f"environment differs: {', '.join(differ)}" if differ else None


def _log(args, reason: str | None) -> None:
  log = os.environ.get("TPU_EMBEDDING_TEST_FORK_LOG")
  if log:
    with open(log, "a") as file:
      test = os.environ.get("PYTEST_CURRENT_TEST")
      file.write(f"{reason or 'forked'}\t{test}\t{args!r:.300}\n")


class Popen(subprocess.Popen):
  """``subprocess.Popen``; forked from a fork server where it can be."""

  _status: socket.socket | None = None

  def _execute_child(self, *arguments):
    # subprocess.Popen's (POSIX) arguments, in its order; ``rest``:
    # restore_signals, gid, gids, uid, umask, start_new_session,
    # process_group (3.11). A forked child honours none but the defaults.
    (args, executable, preexec_fn, _, pass_fds, cwd, env, _, _, shell,
     p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
     *rest) = arguments  # fmt: skip
    environment = dict(os.environ if env is None else env)
    command = _python_command(args)
    plain = (True, None, None, None, -1, False, -1)[: len(rest)]
    reason = _why_not_forked(command, environment)
    if executable or preexec_fn or shell or pass_fds or tuple(rest) != plain:
      reason = "Popen options a forked child does not honour"
    _log(args, reason)
    if reason is not None:
      return super()._execute_child(*arguments)
    stdin = p2cread if p2cread != -1 else 0
    stdout = c2pwrite if c2pwrite != -1 else 1
    stderr = errwrite if errwrite != -1 else 2
    request = {
      "argv": command,
      "env": environment,
      "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
    }
    connection = _SERVERS.next().connect()
    try:
      socket.send_fds(
        connection, [json.dumps(request).encode()], [stdin, stdout, stderr]
      )
      reply = json.loads(connection.recv(1 << 16))
    except BaseException:
      connection.close()
      raise
    finally:
      self._close_pipe_fds(
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite
      )
    self._status = connection
    self.pid = reply["pid"]
    self._child_created = True

  def _try_wait(self, wait_flags):
    if self._status is None:
      return super()._try_wait(wait_flags)
    try:
      self._status.setblocking(not wait_flags & os.WNOHANG)
      message = self._status.recv(1 << 16)
    except BlockingIOError:
      return (0, 0)
    except OSError as error:  # closed or broken (EBADF, ECONNRESET, ...)
      message = b""
      if error.errno == errno.EBADF:  # its fd may be another file's by now
        self._status.detach()
    with contextlib.suppress(OSError):
      self._status.close()
    self._status = None
    if not message:  # the server died or the connection broke: status lost
      return (self.pid, 255 << 8)
    return (self.pid, json.loads(message)["status"])

  def _internal_poll(self, _deadstate=None, **unused):
    if self._status is None:
      return super()._internal_poll(_deadstate)
    if self.returncode is None and self._waitpid_lock.acquire(False):
      try:
        if self.returncode is None:
          pid, status = self._try_wait(os.WNOHANG)
          if pid == self.pid:
            self._handle_exitstatus(status)
      finally:
        self._waitpid_lock.release()
    return self.returncode


def run(
  *popenargs,
  input=None,
  capture_output=False,
  timeout=None,
  check=False,
  **kwargs,
) -> subprocess.CompletedProcess:
  """``subprocess.run`` with :class:`Popen`."""
  if capture_output:
    kwargs["stdout"] = subprocess.PIPE
    kwargs["stderr"] = subprocess.PIPE
  with Popen(*popenargs, **kwargs) as process:
    try:
      stdout, stderr = process.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
      raise
    except BaseException:
      process.kill()
      raise
    code = process.poll()
  if check and code:
    raise subprocess.CalledProcessError(code, process.args, stdout, stderr)
  return subprocess.CompletedProcess(process.args, code, stdout, stderr)
