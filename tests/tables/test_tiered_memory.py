"""A disk-tiered table never held whole: peak RSS per phase (``VmHWM``).

tests/tables/tiered_memory_job.py (a fresh process) trains, saves, exports
(``export_for_serving``, float32 and int8) and restores (into a built
table, and before build) 2 GiB of table and slots kept on disk with a
256 MiB cache. Each phase's peak over the process before the table
exists must stay within the cache budget plus the stated overhead, for
each table then alive (the restore into a built table: two): the host's
maps, ``PER_ROW`` bytes a row (a row's record in the file, its slot, its
count of lookups, its changed bit), and ``FIXED``: a checkpoint's chunk
in flight, TensorFlow's buffers of a save or an export. A copy of the
table would cross it.
"""

from __future__ import annotations

import json
import pathlib
import sys

from tests import processes

JOB = pathlib.Path(__file__).parent / "tiered_memory_job.py"
ROWS, CACHE = 2**23, 256 * 2**20
STATE = ROWS * 32 * 4 * 2
PER_ROW = 10
FIXED = 256 * 2**20  # (measured: about 230 MiB)
TABLES = {"restore": 2}  # (the others: one)


def bound(phase: str) -> int:
  """The most a phase may grow: per table alive, its cache and maps."""
  return TABLES.get(phase, 1) * (CACHE + PER_ROW * ROWS) + FIXED


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


def test_each_phase_stays_within_the_cache_and_the_stated_overhead(tmp_path):
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
  assert bound("restore") < STATE
  for phase, size in grown.items():
    assert size < bound(phase), (phase, size / 2**20, grown)


def _grown(phases):
  """Each phase's peak over its process before the table existed."""
  return {k: v - phases["before"] for k, v in phases.items() if k != "before"}
