"""The fork server of ``tests/processes.py``: ``python fork_server.py SOCKET``.

Imports TensorFlow, Keras and numpy, prints ``ready``, then forks one
child per request on the Unix socket (a sequenced-packet socket). A
request is the child's argv (after the interpreter), environment and
working directory, with its stdin, stdout and stderr passed as file
descriptors; the reply is the child's pid, and once it has exited, its
wait status. The server exits when the process that started it does.

The child leaves the server's loop and becomes ``python ARGV`` (a script
path, ``-m`` and a module, or ``-c`` and code), run as ``__main__``; it
exits as an interpreter does, through Python's own handling of
``SystemExit`` and of uncaught exceptions.
"""

import builtins
import gc
import io
import json
import os
import runpy
import select
import socket
import sys
import types

import numpy as np
import tensorflow as tf  # noqa: F401  (the point: imported once, here)


def serve(address: str) -> dict:
  """Forks children until the parent exits; returns in each child."""
  parent = os.getppid()
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
  listener.bind(address)
  listener.listen(64)
  # Everything imported so far stays out of the collector's sight: a
  # child's collections (and its exit) then neither walk nor copy the
  # server's objects (about 1.1 s of CPU per child without this, 0.3 s
  # with it).
  gc.collect()
  gc.freeze()
  print("ready", flush=True)
  os.dup2(2, 1)  # nobody reads the pipe after "ready": to the log instead
  waiting: dict[int, socket.socket] = {}
  while os.getppid() == parent:
    readable, _, _ = select.select([listener], [], [], 0.05)
    if readable:
      connection, _ = listener.accept()
      message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
      if len(fds) != 3:  # the test process went away before asking
        connection.close()
        for fd in fds:
          os.close(fd)
        continue
      sys.stdout.flush()
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        listener.close()
        connection.close()
        for other in waiting.values():
          other.close()
        return {**json.loads(message), "fds": fds}
      for fd in fds:
        os.close(fd)
      connection.send(json.dumps({"pid": pid}).encode())
      waiting[pid] = connection
    while waiting:
      pid, status = os.waitpid(-1, os.WNOHANG)
      if pid == 0:
        break
      connection = waiting.pop(pid, None)
      if connection is not None:
        try:
          connection.send(json.dumps({"status": status}).encode())
        except OSError:
          pass  # the test process stopped waiting for it
        connection.close()
  sys.exit(0)


def _standard_streams(unbuffered: bool) -> None:
  """New ``sys.stdout`` and ``sys.stderr``, buffered as at startup.

  Python buffers stdout (by line on a terminal) and line-buffers stderr,
  or writes both straight through with ``PYTHONUNBUFFERED``; the server's own
  streams were made for the server's environment.
  """
  for name, fd in (("stdout", 1), ("stderr", 2)):
    old = getattr(sys, name)
    raw = io.FileIO(fd, "w", closefd=False)
    stream = io.TextIOWrapper(
      raw if unbuffered else io.BufferedWriter(raw),
      encoding=old.encoding,
      errors=old.errors,
      line_buffering=not unbuffered and (name == "stderr" or os.isatty(fd)),
      write_through=unbuffered,
    )
    setattr(sys, name, stream)
    setattr(sys, f"__{name}__", stream)


def become(request: dict) -> None:
  """Turns this forked process into ``python ARGV`` (see the docstring)."""
  for target, fd in enumerate(request["fds"]):
    os.dup2(fd, target)
  for fd in set(request["fds"]):
    if fd > 2:
      os.close(fd)
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  _standard_streams(unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")))
  np.random.seed()  # a fresh process seeds numpy's global generator anew
  argv = request["argv"]
  sys.orig_argv = [sys.executable, *argv]
  if argv[0] == "-m":
    sys.argv = ["-m", *argv[2:]]
    sys.path[0] = os.getcwd()
    runpy._run_module_as_main(argv[1])  # pylint: disable=protected-access
  elif argv[0] == "-c":
    sys.argv = ["-c", *argv[2:]]
    sys.path[0] = ""
    _run_as_main(argv[1], "<string>", {})
  else:
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    with io.open_code(argv[0]) as file:
      source = file.read()
    _run_as_main(source, argv[0], {"__file__": argv[0], "__cached__": None})


def _run_as_main(source, filename: str, names: dict) -> None:
  """Runs ``source`` in a new ``__main__`` module, as the interpreter does."""
  main = types.ModuleType("__main__")
  main.__dict__.update(names, __builtins__=builtins)
  sys.modules["__main__"] = main
  exec(compile(source, filename, "exec"), main.__dict__)  # noqa: S102


if __name__ == "__main__":
  become(serve(sys.argv[1]))
