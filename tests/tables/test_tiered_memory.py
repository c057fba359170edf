"""A disk-tiered table never held whole: peak RSS per phase (``VmHWM``).

tests/tables/tiered_memory_job.py (a fresh process) trains, saves, exports
(``export_for_serving``, float32 and int8) and restores (into a built
table, and before build) a 732 MiB table and slots kept on disk with a
32 MiB cache. Each phase's
peak over the process before the table exists (the restore before
build: before that phase, three tables' caches held) must stay under a
third of the table and slots: a copy of the table would cross it.
"""

from __future__ import annotations

import json
import pathlib
import sys

from tests import processes

JOB = pathlib.Path(__file__).parent / "tiered_memory_job.py"
STATE = 3_000_000 * 32 * 4 * 2
BOUND = STATE // 3


def _job(*args):
  done = processes.run(
    [sys.executable, str(JOB), *map(str, args)],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result["same"]
  assert result["exported"]
  return result["phases"]


def test_train_save_restore_and_export_stay_far_below_the_table(tmp_path):
  grown = _grown(_job(tmp_path))
  # A fresh process resuming: restore before the table exists, build().
  grown.update(_grown(_job(tmp_path, "resume")))
  assert sorted(grown) == sorted(
    [
      "build",
      "train",
      "save",
      "export_float32",
      "export_int8",
      "restore",
      "restore_before_build",
    ]
  )
  for phase, size in grown.items():
    assert size < BOUND, (phase, size / 2**20, grown)


def _grown(phases):
  """Each phase's peak over its process before the table existed."""
  return {k: v - phases["before"] for k, v in phases.items() if k != "before"}
