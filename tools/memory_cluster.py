"""Localhost clusters for tools/memory_report.py: child processes, events.

A ``Job`` starts the processes of one cluster on 127.0.0.1 (free ports,
one ``TF_CONFIG`` each), runs ``tools/memory_jobs.py`` in them, and yields
the events they write on stdout (``memory_config.TAG`` lines) in arrival
order. Each child's stderr goes to a log file, quoted when it fails. A job
fails (``JobError``) when a child exits non-zero, a server dies, or the
timeout passes; closing it kills the children still running (its own,
by process handle).

Example:
  >>> spec = cluster_spec(worker=2)
  >>> [a.startswith("127.0.0.1:") for a in spec["worker"]]
  [True, True]
  >>> json.loads(tf_config(spec, "worker", 1))["task"]
  {'type': 'worker', 'index': 1}
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from memory_config import TAG

#: The child processes' program.
JOBS_SCRIPT = pathlib.Path(__file__).with_name("memory_jobs.py")


def free_port() -> int:
  """A TCP port free on 127.0.0.1 now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def cluster_spec(**tasks: int) -> dict[str, list[str]]:
  """``{job: [address, ...]}`` with ``tasks[job]`` free localhost ports."""
  return {
    job: [f"127.0.0.1:{free_port()}" for _ in range(count)]
    for job, count in tasks.items()
  }


def tf_config(spec: dict[str, list[str]], task_type: str, index: int) -> str:
  """The ``TF_CONFIG`` of one task of ``spec``."""
  return json.dumps(
    {"cluster": spec, "task": {"type": task_type, "index": index}}
  )


class JobError(Exception):
  """A child process failed, or the job timed out."""


class Job:
  """The processes of one localhost cluster and their events."""

  def __init__(self, name: str, log_dir: str, timeout: float):
    """Creates an empty job.

    Args:
      name: names the job in errors and log files.
      log_dir: where the children's stderr is written.
      timeout: seconds the whole job may take.
    """
    self.name = name
    self._log_dir = log_dir
    self._deadline = time.time() + timeout
    self._timeout = timeout
    self._children: dict[str, subprocess.Popen] = {}
    self._logs: dict[str, str] = {}
    self._reporting: set[str] = set()
    self._lines: queue.Queue = queue.Queue()

  def __enter__(self) -> Job:
    return self

  def __exit__(self, *exc_info: Any) -> None:
    self.close()

  def start(
    self,
    label: str,
    args: list[str],
    tf_config_json: str,
    *,
    reports: bool = True,
    answers: bool = False,
  ) -> None:
    """Starts ``python tools/memory_jobs.py *args`` as ``label``.

    Args:
      label: the process's name in the report (``worker0``, ``ps1``, ...).
      args: arguments of memory_jobs.py.
      tf_config_json: its ``TF_CONFIG``.
      reports: it writes events (the job lasts until it exits); otherwise
        it is a server, killed when the job closes.
      answers: its stdin is a pipe for ``answer``.
    """
    log = os.path.join(self._log_dir, f"{self.name}.{label}.log")
    self._logs[label] = log
    env = {**os.environ, "TF_CONFIG": tf_config_json}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with open(log, "w") as stderr:
      process = subprocess.Popen(
        [sys.executable, str(JOBS_SCRIPT), *args],
        stdin=subprocess.PIPE if answers else subprocess.DEVNULL,
        stdout=subprocess.PIPE if reports else stderr,
        stderr=stderr,
        text=True,
        env=env,
      )
    self._children[label] = process
    if reports:
      self._reporting.add(label)
      threading.Thread(
        target=self._read, args=(label, process), daemon=True
      ).start()

  def _read(self, label: str, process: subprocess.Popen) -> None:
    for line in process.stdout:
      self._lines.put((label, line))
    self._lines.put((label, None))

  def pid(self, label: str) -> int:
    """The process id of child ``label``."""
    return self._children[label].pid

  def labels(self) -> list[str]:
    """Every child's label, in start order."""
    return list(self._children)

  def answer(self, label: str, line: str) -> None:
    """Writes ``line`` to the stdin of child ``label``."""
    stdin = self._children[label].stdin
    stdin.write(line + "\n")
    stdin.flush()

  def events(self) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(label, event)`` as they arrive, until every reporter has exited.

    Raises:
      JobError: a child exited non-zero, a server exited, or time ran out.
    """
    open_streams = set(self._reporting)
    while open_streams:
      self._check_servers()
      if time.time() > self._deadline:
        raise JobError(f"{self.name}: no result after {self._timeout:.0f}s")
      try:
        label, line = self._lines.get(timeout=1.0)
      except queue.Empty:
        continue
      if line is None:
        open_streams.discard(label)
        code = self._children[label].wait()
        if code:
          self._fail(label, f"exited with code {code}")
      elif line.startswith(TAG):
        yield label, json.loads(line[len(TAG) :])

  def _check_servers(self) -> None:
    for label, process in self._children.items():
      if label not in self._reporting and process.poll() is not None:
        self._fail(label, f"(a server) exited with code {process.returncode}")

  def _fail(self, label: str, what: str) -> None:
    with open(self._logs[label]) as f:
      tail = f.read()[-4000:]
    raise JobError(f"{self.name}: {label} {what}. Its stderr ends:\n{tail}")

  def close(self) -> None:
    """Kills the children still running and waits for them."""
    for process in self._children.values():
      if process.poll() is None:
        process.kill()
    for process in self._children.values():
      process.wait()
