"""Memory per worker of a row-sharded table, measured (issue 12, item 5).

Runs ``tools/memory_report.py`` (MultiWorkerMirroredStrategy only): two
worker processes on 127.0.0.1 build a 1,500,000 x 64 table with Adagrad
(732 MiB of table + slot, sharded 1/2 per worker), train 5 steps, save a
checkpoint, and a fresh 2-worker job restores it. Each worker reads its
own peak resident memory per phase (``/proc/self/status`` ``VmHWM``, reset
at the start of each phase, minus a baseline taken before any table
exists); the restored job must reproduce the saved rows and slots.

Why this size: a phase costs a process 10-40 MiB whatever the table
(tracing, tf.data, collectives; measured with a 1,000-row table), and the
bound (0.6x of the full state) leaves 0.1x above the ideal 0.5x, so the
state must be several hundred MiB for the bound to be reachable: here
0.1x is 73 MiB. About 45 s.

``test_each_worker_holds_at_most_0_6_of_the_state`` is EXPECTED TO FAIL on
the code of today (build 1.3x, save 3.8x, restore 3.9x of the full state
per worker): it is marked ``xfail(strict=True)`` until the fixes of issue
12 land. When they do, it passes, pytest reports the strict xfail as a
failure, and the marker must be removed.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

TOOL = pathlib.Path(__file__).parents[1] / "tools" / "memory_report.py"
ROWS, DIM = 1_500_000, 64
FULL_STATE = ROWS * DIM * 4 * 2  # float32 table + Adagrad accumulator
PHASES = {"build", "train", "save", "restore"}
LIMIT = 0.6


def _can_reset_peak() -> bool:
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    return False
  return True


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  """The tool's JSON figures and exit code (0: within the limit, 1: not)."""
  if not _can_reset_peak():
    pytest.skip("/proc/self/clear_refs is not writable here (Linux only)")
  out = tmp_path_factory.mktemp("memory") / "report.json"
  finished = subprocess.run(
    [
      sys.executable,
      str(TOOL),
      f"--rows={ROWS}",
      f"--dim={DIM}",
      "--batch=1024",
      "--strategies=mwms",
      "--no-resize",
      "--no-export",
      f"--limit={LIMIT}",
      f"--json={out}",
    ],
    capture_output=True,
    text=True,
    timeout=600,
  )
  # 2: a job failed or the restored job did not hold the saved values.
  assert finished.returncode in (0, 1), finished.stdout + finished.stderr
  figures = json.loads(out.read_text())
  assert not figures["errors"], figures["errors"]
  return figures["rows"], finished.returncode, finished.stdout


def test_the_report_measures_every_worker_and_phase(report):
  rows, _, table = report
  assert {(r["process"], r["phase"]) for r in rows} == {
    (f"worker{w}", phase) for w in range(2) for phase in PHASES
  }, table
  for row in rows:
    assert row["full_bytes"] == FULL_STATE
    assert row["plan_bytes"] == FULL_STATE // 2  # 750,000 rows each
    # Every phase holds at least the worker's shard: the meter sees it.
    assert row["growth"] >= 0.45 * FULL_STATE, row


@pytest.mark.xfail(
  strict=True,
  raises=AssertionError,
  reason="issue 12: each worker holds 1.3-3.9x of the state today; remove "
  "this marker when build, save and restore hold ~1/2 per worker",
)
def test_each_worker_holds_at_most_0_6_of_the_state(report):
  rows, returncode, table = report
  over = [
    f"{r['process']} {r['phase']}: {r['ratio']:.2f}x"
    for r in rows
    if r["growth"] > LIMIT * FULL_STATE
  ]
  assert not over, f"peak growth above {LIMIT}x of the state: {over}\n{table}"
  assert returncode == 0, table
