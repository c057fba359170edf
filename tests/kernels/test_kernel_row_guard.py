"""Inside the kernels, an op touches only the rows it is given: a guard.

The traced-graph proof (tests/sparse_access.py) ends at an op: a kernel
given a table's handle could still read or copy its whole buffer.
tests/kernels/kernel_row_guard.py runs this package's kernels
(``TpeGatherRows``, ``TpeFusedSparseApply``, ``TpeVocabularyStep``),
TensorFlow's ops for the same, and whole training steps (one device, 2
replicas, pipelined), on variables whose pages outside the given rows are
``mprotect``-ed unreachable: a touch there kills the process with SIGSEGV,
so it runs as its own process. Its last act, the control, is a dense read of
a guarded table: the process must die there, after every guarded case
passed.
"""

from __future__ import annotations

import signal
import sys

import pytest

from tests import scripts
from tpu_embedding import kernels

CONTROL = "control: a dense read under the guard"


@pytest.mark.skipif(
  not sys.platform.startswith("linux"), reason="mprotect through glibc"
)
def test_kernels_touch_only_the_rows_they_are_given():
  done = scripts.run_script(
    "tests/kernels/kernel_row_guard.py", returncode=-signal.SIGSEGV
  )
  lines = done.stdout.splitlines()
  # Killed by the control, not before: every guarded case passed.
  assert lines[-1] == CONTROL, done.stdout[-3000:] + done.stderr[-3000:]
  guarded = [line for line in lines if line.startswith("guarded ")]
  cases = [
    "gather_rows (TENSORFLOW_OPS)",
    "update (TENSORFLOW_OPS)",
    "vocabulary_step (TENSORFLOW_OPS)",
  ]
  if kernels.load() is not None:
    cases += [
      f"{case} (KernelOps(spread={spread}))"
      for spread in (True, False)
      for case in ("gather_rows", "update", "vocabulary_step")
    ]
    cases.append("update of a 10 MiB table, on threads")
  ops = "KernelOps" if kernels.load() is not None else "TENSORFLOW_OPS"
  cases += [
    f"training step, {name} ({ops}"
    for name in ("one device", "2 replicas, sharded", "one device, pipelined")
  ]
  for case in cases:
    assert any(case in line for line in guarded), (case, guarded)
