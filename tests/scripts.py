"""Runs the checkout's command-line scripts (``tools/``, ``examples/``).

``run_script("tools/export.py", "--help")`` starts the script with this
interpreter (forked, as ``tests/processes.py`` explains) in a temporary
working directory (not the checkout, so that it imports the installed
packages, as the tests do) and returns the finished process; it fails
the test, showing the output, when the exit code is not the expected
one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from tests import processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(
  path: str, *args: str, returncode: int = 0, timeout: float = 300
) -> subprocess.CompletedProcess:
  """Runs ``ROOT/path`` with ``args``; returns the completed process.

  Args:
    path: the script, relative to the checkout (``"tools/benchmark.py"``).
    *args: its command line.
    returncode: the exit code expected.
    timeout: seconds before the script is killed (and the test fails).
  """
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
  with tempfile.TemporaryDirectory() as cwd:
    process = processes.run(
      [sys.executable, os.path.join(ROOT, path), *args],
      capture_output=True,
      text=True,
      env=env,
      cwd=cwd,
      timeout=timeout,
      check=False,
    )
  assert process.returncode == returncode, (
    f"{path} {' '.join(args)} exited {process.returncode}:\n"
    f"{process.stdout[-3000:]}\n{process.stderr[-3000:]}"
  )
  return process


def run_tool(name: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
  """``run_script("tools/<name>", *args)``."""
  return run_script(os.path.join("tools", name), *args, **kwargs)
