"""One command, a local multi-worker cluster: ``--num_workers`` / ``--num_ps``.

``launch(command, strategy, num_workers, num_ps)`` runs ``command`` (the
same ``train`` command without the launcher flags) as local processes,
each with its ``TF_CONFIG`` on free 127.0.0.1 ports, and supervises them:

* ``multi_worker_mirrored``: ``num_workers`` workers (worker 0 is the
  chief); done when all exit cleanly.
* ``parameter_server``: ``num_ps`` parameter servers, ``num_workers``
  workers (both serve until stopped) and a chief that coordinates the
  training; done when the chief exits cleanly (the servers are then
  stopped).

Every line a process prints is forwarded with its task as a prefix
(``[worker 1] step 100/300 ...``). When a process dies (killed,
preempted, crashed) the whole job stops and starts again, on new ports,
from the last checkpoint in ``model_dir`` (the training resumes there),
up to ``max_restarts`` times. A task whose server cannot bind its port
(another process on the host took it between the launcher choosing it
and the task starting, seconds later) starts the job again on new ports
without counting a restart, up to ``PORT_RETRIES`` times.

On a real cluster, start the same command on each machine with its own
``TF_CONFIG`` instead (see the README).

Example:
  >>> from model_garden.ranking import launcher
  >>> configs = launcher.cluster_configs("parameter_server", 2, 1)
  >>> [(c["task"]["type"], c["task"]["index"]) for c in configs]
  [('ps', 0), ('worker', 0), ('worker', 1), ('chief', 0)]
  >>> sorted(configs[0]["cluster"]), len(configs[0]["cluster"]["worker"])
  (['chief', 'ps', 'worker'], 2)
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any
from typing import TextIO

from model_garden.ranking.strategies import free_port

#: Attempts a job may lose to a port taken by another process after the
#: launcher chose it, each started again on new ports, not a restart.
PORT_RETRIES = 3

#: What TensorFlow says when a task's server cannot bind its port.
PORT_TAKEN = "Could not start gRPC server"

#: Lines of a task's output kept to tell why it failed.
_TAIL_LINES = 50


def cluster_configs(
  strategy: str, num_workers: int, num_ps: int
) -> list[dict[str, Any]]:
  """Every task's ``TF_CONFIG`` for a local cluster (free loopback ports).

  Servers come first (parameter servers, then workers), the chief last.

  Raises:
    ValueError: for a strategy without a cluster, or too few tasks.
  """
  if strategy == "multi_worker_mirrored":
    if num_workers < 1:
      raise ValueError("--num_workers must be at least 1.")
    cluster = {"worker": _addresses(num_workers)}
    tasks = [("worker", i) for i in range(num_workers)]
  elif strategy == "parameter_server":
    if num_workers < 1 or num_ps < 1:
      raise ValueError(
        "parameter_server needs --num_workers >= 1 and --num_ps >= 1."
      )
    cluster = {
      "chief": _addresses(1),
      "worker": _addresses(num_workers),
      "ps": _addresses(num_ps),
    }
    tasks = (
      [("ps", i) for i in range(num_ps)]
      + [("worker", i) for i in range(num_workers)]
      + [("chief", 0)]
    )
  else:
    raise ValueError(
      f"--num_workers starts a cluster for multi_worker_mirrored or "
      f"parameter_server, not {strategy}."
    )
  return [
    {"cluster": cluster, "task": {"type": kind, "index": index}}
    for kind, index in tasks
  ]


def _addresses(count: int) -> list[str]:
  return [f"127.0.0.1:{free_port()}" for _ in range(count)]


def task_name(tf_config: dict[str, Any]) -> str:
  """``"worker 1"``: a task's log prefix."""
  task = tf_config["task"]
  return f"{task['type']} {task['index']}"


class _Process:
  """One task's process, its lines forwarded with a prefix."""

  def __init__(
    self,
    command: Sequence[str],
    tf_config: dict[str, Any],
    stream: TextIO,
    lock: threading.Lock,
  ):
    self.name = task_name(tf_config)
    self.tf_config = tf_config
    self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    env = dict(os.environ, TF_CONFIG=json.dumps(tf_config))
    self.popen = subprocess.Popen(
      list(command),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=env,
      bufsize=1,
    )
    self._thread = threading.Thread(
      target=self._forward, args=(stream, lock), daemon=True
    )
    self._thread.start()

  def _forward(self, stream: TextIO, lock: threading.Lock) -> None:
    assert self.popen.stdout is not None
    for line in self.popen.stdout:
      self.tail.append(line)
      with lock:
        stream.write(f"[{self.name}] {line}")
        stream.flush()

  @property
  def address(self) -> str:
    """Its server's ``host:port``."""
    task = self.tf_config["task"]
    return self.tf_config["cluster"][task["type"]][task["index"]]

  def lost_its_port(self) -> bool:
    """Whether it failed because its server could not bind its port (read
    once it stopped: its last lines are in)."""
    return any(PORT_TAKEN in line for line in self.tail)

  def stop(self, kill: bool = False) -> None:
    """Stops the process: SIGTERM (then SIGKILL after 10 s), or SIGKILL at
    once (a failed job: its other tasks hang in collectives)."""
    if self.popen.poll() is None:
      if kill:
        self.popen.kill()
      else:
        self.popen.send_signal(signal.SIGTERM)
      try:
        self.popen.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.popen.kill()
        self.popen.wait()
    self._thread.join(timeout=10)


def _exit_text(code: int) -> str:
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exit code {code}"


def launch(
  command: Sequence[str],
  strategy: str,
  num_workers: int,
  num_ps: int = 0,
  *,
  max_restarts: int = 3,
  first_attempt_only: Sequence[str] = (),
  stream: TextIO | None = None,
  poll_seconds: float = 0.2,
) -> int:
  """Runs ``command`` as a local cluster until it succeeds.

  Args:
    command: the program and its arguments (without launcher flags).
    strategy: ``multi_worker_mirrored`` or ``parameter_server``.
    num_workers: worker processes.
    num_ps: parameter-server processes (``parameter_server``).
    max_restarts: restarts after a failure before giving up.
    first_attempt_only: extra arguments for one task of the first attempt
      only, the one that trains last in line (the last worker of
      ``multi_worker_mirrored``, the chief of ``parameter_server``):
      testing, ``--kill_at_step=N`` kills that task once.
    stream: where forwarded lines go (default stdout).
    poll_seconds: how often processes are checked.

  Returns:
    0 on success, else the failed attempt's exit code (or 1).
  """
  stream = stream or sys.stdout
  lock = threading.Lock()

  def say(message: str) -> None:
    with lock:
      stream.write(f"[launcher] {message}\n")
      stream.flush()

  attempts = max_restarts + 1
  attempt = port_retries = 0
  code = 1
  while attempt < attempts:
    configs = cluster_configs(strategy, num_workers, num_ps)
    processes = []
    target = (
      {"type": "chief", "index": 0}
      if strategy == "parameter_server"
      else {"type": "worker", "index": num_workers - 1}
    )
    for tf_config in configs:
      extra = []
      if attempt == 0 and tf_config["task"] == target:
        extra = list(first_attempt_only)
      processes.append(_Process([*command, *extra], tf_config, stream, lock))
    say(
      f"attempt {attempt + 1} of {attempts}: started "
      + ", ".join(f"{p.name} (pid {p.popen.pid})" for p in processes)
      + f" on 127.0.0.1 ports {_ports(configs[0])}."
    )
    failed, code = _supervise(strategy, processes, poll_seconds)
    for process in processes:
      process.stop(kill=failed is not None)
    if failed is None:
      say("all tasks finished.")
      return 0
    if failed.lost_its_port() and port_retries < PORT_RETRIES:
      port_retries += 1
      say(
        f"{failed.name} could not start its server on {failed.address}: "
        "another process took the port after the launcher chose it; "
        f"starting every task again on new ports (not a restart; "
        f"{port_retries} of {PORT_RETRIES})."
      )
      continue
    attempt += 1
    if attempt < attempts:
      say(
        f"{failed.name} stopped ({_exit_text(code)}); restarting every "
        f"task from the last checkpoint (restart {attempt} of "
        f"{max_restarts})."
      )
    else:
      say(
        f"{failed.name} stopped ({_exit_text(code)}); giving up after "
        f"{max_restarts} restart(s)."
      )
  return code if code > 0 else 1


def _ports(tf_config: dict[str, Any]) -> str:
  return ", ".join(
    address.rsplit(":", 1)[1]
    for job in tf_config["cluster"].values()
    for address in job
  )


def _supervise(
  strategy: str, processes: list[_Process], poll_seconds: float
) -> tuple[_Process | None, int]:
  """Waits until the job succeeds or a task fails.

  Returns:
    ``(None, 0)`` on success, else ``(failed task, its exit code)``.
  """
  coordinator = processes[-1] if strategy == "parameter_server" else None
  while True:
    for process in processes:
      code = process.popen.poll()
      if code is None:
        continue
      if coordinator is not None:
        if process is coordinator and code == 0:
          return None, 0
        return process, code  # a server never exits by itself
      if code != 0:
        return process, code
    if coordinator is None and all(p.popen.poll() == 0 for p in processes):
      return None, 0
    time.sleep(poll_seconds)
