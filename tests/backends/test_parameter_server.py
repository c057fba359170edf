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

import numpy as np
import pytest
import tensorflow as tf

from tests import sparse_access
from tests.conftest import mirrored_strategy
from tests.distributed import cluster
from tests.tables import test_step_ids as step_ids
from tpu_embedding.gradients import RowGradients
from tpu_embedding.tables.step_record import SLOTS

SCRIPT = pathlib.Path(__file__).parents[1] / "distributed" / "ps_training.py"


def test_parameter_server_training_equals_one_device(tmp_path):
  out = cluster.run_script([SCRIPT, tmp_path]).check()
  # The scheduled step gathered and updated the tables and slots on the
  # PS tasks by row only (asserted there: tests/sparse_access.py).
  assert "ps" in sparse_access.reports(out), out


KILL = pathlib.Path(__file__).parents[1] / "distributed" / "ps_worker_kill.py"


def test_a_killed_workers_steps_are_rerun_and_each_update_lands_once():
  """Worker processes: one is killed holding a step whose update landed;
  the coordinator re-runs it and the step id keeps it from counting twice
  (see the script)."""
  out = cluster.run_script([KILL]).check()
  assert "killed worker 1" in out, out
  assert "41 steps ran for 40 scheduled" in out, out


@pytest.mark.parametrize("replicas", [1, 2], ids=["whole", "two_blocks"])
def test_out_of_order_steps_in_one_slot_each_land_once(replicas):
  """The step record (``tables/step_record.py``) out of order, in one
  process with locked stores as the parameter servers lock them: a newer
  step ``N + SLOTS``, then a late older step ``N`` (same ring slot), then
  a re-run of the newer. The first two land, the re-run does not (the
  slot keeps the newest id). The oracle counts applications: each adds
  the squared gradient (1) to Adagrad's accumulators of the rows."""
  strategy = (
    tf.distribute.get_strategy() if replicas == 1 else mirrored_strategy(2)
  )
  emb = step_ids.make_embedding(strategy, locked=True)
  store = emb.table_stores["big"]
  assert len(store.blocks) == replicas
  ids = np.array([0, 3, 11])  # rows of both blocks
  start = store.read("accumulators").numpy()

  @tf.function
  def update(step_id):
    store.update(
      tf.constant(ids, tf.int64),
      RowGradients.dense(tf.ones([ids.size, step_ids.DIM])),
      step_id=step_id,
    )

  newer = 5 + SLOTS
  applied = 0
  for step_id, lands in ((newer, True), (5, True), (newer, False)):
    update(tf.constant(step_id, tf.int64))
    applied += lands
    want = start.copy()
    want[ids] += applied
    np.testing.assert_array_equal(
      store.read("accumulators").numpy(), want, err_msg=f"step {step_id}"
    )
