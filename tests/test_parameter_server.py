"""ParameterServerStrategy: an in-process cluster on 127.0.0.1, one device.

The cluster script runs in its own process (connecting to a cluster changes
TensorFlow's context for the whole process): 2 workers and 2 parameter
servers as gRPC servers on loopback ports, a ``ClusterCoordinator`` driving
the TPU-style loop, big tables split over both PS tasks. It asserts the
tables and slots equal the same steps on one device, that the PS
checkpoint restores into a single-device object, that steps scheduled
on both workers at once all land, and that the scheduled step touches the
tables by row only; a killed worker's re-run step lands once
(``apply_gradients(step_id=...)``).
"""

from __future__ import annotations

import pathlib

from tests import sparse_access
from tests.distributed import cluster

SCRIPT = pathlib.Path(__file__).parent / "distributed" / "ps_training.py"


def test_parameter_server_training_equals_one_device(tmp_path):
  out = cluster.run_script([SCRIPT, tmp_path]).check()
  # The scheduled step gathered and updated the tables and slots on the
  # PS tasks by row only (asserted there: tests/sparse_access.py).
  assert "ps" in sparse_access.reports(out), out


KILL = pathlib.Path(__file__).parent / "distributed" / "ps_worker_kill.py"


def test_a_killed_workers_steps_are_rerun_and_each_update_lands_once():
  """Worker processes: one is killed holding a step whose update landed;
  the coordinator re-runs it and the step id keeps it from counting twice
  (see the script)."""
  out = cluster.run_script([KILL]).check()
  assert "killed worker 1" in out, out
  assert "41 steps ran for 40 scheduled" in out, out
