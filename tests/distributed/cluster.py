"""Runs test scripts as real processes: worker clusters on 127.0.0.1.

A MultiWorkerMirroredStrategy worker needs its own process with its own
``TF_CONFIG``; :func:`run_workers` starts one per worker, together, and
waits for all of them; :func:`run_job` does too, but kills every worker
(SIGKILL) once one dies, as ``model_garden.ranking.launcher`` stops a job.
:func:`run_script` runs one process (no cluster).
Scripts run by path, so they import the installed ``tpu_embedding`` (the
checkout is not put on their ``sys.path``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import NamedTuple

from tests import processes


class Finished(NamedTuple):
  """A finished process: exit code and its whole output."""

  returncode: int
  stdout: str
  stderr: str

  def check(self) -> str:
    """Asserts it exited 0 printing "OK" last; returns stdout."""
    assert self.returncode == 0, self.stdout[-3000:] + self.stderr[-6000:]
    assert self.stdout.strip().endswith("OK"), self.stdout[-3000:]
    return self.stdout


#: Times a job whose server could not bind its port is run again (on new
#: ports): another process on the host can take a port ``free_port`` chose
#: before the server binds it.
PORT_RETRIES = 3

#: What TensorFlow says when a server's port is taken.
PORT_TAKEN = "Could not start gRPC server"


def _on_free_ports(run: Callable[[], list[Finished]]) -> list[Finished]:
  """``run()``, again on new ports while a server could not bind its own
  (at most ``PORT_RETRIES`` times)."""
  for _ in range(PORT_RETRIES):
    finished = run()
    if not any(PORT_TAKEN in f.stderr for f in finished):
      return finished
  return run()


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(extra: dict[str, str] | None) -> dict[str, str]:
  return {
    **os.environ,
    "TF_CPP_MIN_LOG_LEVEL": "3",
    **(extra or {}),
  }


def _start(args: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
  return processes.Popen(
    [sys.executable, *map(str, args)],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=env,
  )


def _wait(processes: list[subprocess.Popen], timeout: int) -> list[Finished]:
  finished = []
  try:
    for process in processes:
      stdout, stderr = process.communicate(timeout=timeout)
      finished.append(Finished(process.returncode, stdout, stderr))
  finally:
    for process in processes:
      process.kill()
  return finished


def _worker_envs(
  num_workers: int, env: dict[str, str] | None
) -> list[dict[str, str]]:
  """Each worker's environment: ``env`` and its ``TF_CONFIG``."""
  workers = [f"127.0.0.1:{free_port()}" for _ in range(num_workers)]
  envs = []
  for index in range(num_workers):
    tf_config = {
      "cluster": {"worker": workers},
      "task": {"type": "worker", "index": index},
    }
    envs.append(_env({**(env or {}), "TF_CONFIG": json.dumps(tf_config)}))
  return envs


def run_workers(
  args: Sequence[str],
  num_workers: int = 2,
  env: dict[str, str] | None = None,
  timeout: int = 300,
) -> list[Finished]:
  """Runs ``python *args`` once per worker of a localhost cluster.

  Args:
    args: the script and its arguments.
    num_workers: cluster size; worker ``i`` gets task index ``i``.
    env: extra environment variables for every worker.
    timeout: seconds to wait for each worker.

  Returns:
    The workers' results, in task order.
  """
  return _on_free_ports(
    lambda: _wait(
      [_start(args, e) for e in _worker_envs(num_workers, env)], timeout
    )
  )


def run_job(
  args: Sequence[str],
  num_workers: int = 2,
  env: dict[str, str] | None = None,
  timeout: int = 300,
) -> list[Finished]:
  """``run_workers``, but once a worker exits with an error or a signal
  the others are killed (SIGKILL): a worker waiting in a collective for a
  dead one would wait on. Output goes through files (no pipe to fill).

  Returns:
    The workers' results, in task order (killed ones: returncode -9).
  """
  return _on_free_ports(lambda: _run_job(args, num_workers, env, timeout))


def _run_job(
  args: Sequence[str],
  num_workers: int,
  env: dict[str, str] | None,
  timeout: int,
) -> list[Finished]:
  with tempfile.TemporaryDirectory() as directory:
    outputs, workers = [], []
    for index, worker_env in enumerate(_worker_envs(num_workers, env)):
      out = open(os.path.join(directory, f"{index}.out"), "w+")  # noqa: SIM115
      err = open(os.path.join(directory, f"{index}.err"), "w+")  # noqa: SIM115
      outputs.append((out, err))
      workers.append(
        processes.Popen(
          [sys.executable, *map(str, args)],
          stdout=out,
          stderr=err,
          text=True,
          env=worker_env,
        )
      )
    deadline = time.monotonic() + timeout
    try:
      while any(p.poll() is None for p in workers):
        if any(p.poll() not in (None, 0) for p in workers):
          break
        if time.monotonic() > deadline:
          raise TimeoutError(f"{args} ran past {timeout} s")
        time.sleep(0.1)
    finally:
      for process in workers:
        if process.poll() is None:
          process.kill()
        process.wait()
    finished = []
    for process, (out, err) in zip(workers, outputs, strict=True):
      out.seek(0)
      err.seek(0)
      finished.append(Finished(process.returncode, out.read(), err.read()))
      out.close()
      err.close()
    return finished


def run_script(
  args: Sequence[str], env: dict[str, str] | None = None, timeout: int = 300
) -> Finished:
  """Runs ``python *args`` in one fresh process (no ``TF_CONFIG``)."""
  clean = _env(env)
  clean.pop("TF_CONFIG", None)
  # (a script may start in-process servers on ports it chose: free_port)
  return _on_free_ports(lambda: _wait([_start(args, clean)], timeout))[0]


def split_phases(finished: Finished) -> dict[str, Finished]:
  """A process's output, by phase: the parts after its ``=== NAME`` lines.

  Each part keeps the process's stderr; a phase followed by another
  returned (exit code 0), the last one has the process's exit code.
  """
  parts = finished.stdout.split("=== ")[1:]
  split = {}
  for number, part in enumerate(parts, 1):
    name, out = part.split("\n", 1)
    code = finished.returncode if number == len(parts) else 0
    split[name] = Finished(code, out, finished.stderr)
  return split
