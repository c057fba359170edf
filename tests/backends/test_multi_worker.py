"""MultiWorkerMirroredStrategy: two real worker processes on 127.0.0.1.

The workers run tests/distributed/mwms_phases.py, which runs several of
the scripts beside it (their ``main``) one after another in one cluster
launch (a worker's setup costs more than most of them): three launches
in all, each of fresh processes. See each script for what each worker
asserts; every test here checks its phases' part of the workers' output.

* launch 1: ``training``, ``dynamic``, ``pipelining``, ``chunks:save``,
  ``resume:full``;
* launch 2: ``resume:kill`` (both workers SIGKILL themselves);
* launch 3: ``resume:resumed`` (fresh workers resume the killed job),
  then ``chunks:restore`` (fresh workers restore what launch 1 saved).

A phase that fails ends its launch: the tests of the phases after it in
that launch fail too, naming the phases that did not run.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import tensorflow as tf

from tests import sparse_access
from tests.distributed import cluster
from tests.distributed import mwms_checkpoint_chunks
from tests.distributed import mwms_training

PHASES = pathlib.Path(__file__).parents[1] / "distributed" / "mwms_phases.py"
LAUNCHES = (
  (
    "training",
    "dynamic",
    "pipelining",
    "row_storage",
    "chunks:save",
    "resume:full",
  ),
  ("resume:kill",),
  ("resume:resumed", "chunks:restore"),
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """``(directory, {phase: [worker 0's part, worker 1's part]}, launches'
  exit codes, the latest checkpoint of DIR/b after launch 2)``; a phase
  that did not start has no entry."""
  directory = tmp_path_factory.mktemp("mwms")
  by_phase: dict[str, list[cluster.Finished]] = {}
  codes, latest = [], None
  for names in LAUNCHES:
    workers = cluster.run_workers([PHASES, directory, *names])
    codes.append([w.returncode for w in workers])
    for worker in workers:
      for name, part in cluster.split_phases(worker).items():
        by_phase.setdefault(name, []).append(part)
    if "resume:kill" in names:
      latest = tf.train.latest_checkpoint(str(directory / "b"))
  return directory, by_phase, codes, latest


def phase(runs, name: str) -> list[str]:
  """Both workers' output of ``name``, each asserted to end with "OK"."""
  _, by_phase, codes, _ = runs
  workers = by_phase.get(name, [])
  assert len(workers) == 2, f"{name} did not run on both workers: {codes}"
  return [w.check() if name != "resume:kill" else w.stdout for w in workers]


def test_two_workers_train_sharded_tables_like_one_device(runs):
  for out in phase(runs, "training"):
    # Each optimizer's traced step gathered and updated the worker's
    # tables and slots by row only (asserted there: tests/sparse_access.py).
    assert sorted(sparse_access.reports(out)) == [
      f"mwms/{name}" for name in sorted(mwms_training.OPTIMIZERS)
    ], out


def test_killed_job_resumes_bit_identical_from_sliced_checkpoints(runs):
  """Both workers killed after step 7 (last checkpoint: step 6), resumed."""
  directory, _, codes, after_kill = runs
  for out in phase(runs, "resume:full"):
    assert "starting at step 0" in out
  for out in phase(runs, "resume:kill"):
    assert "starting at step 0" in out and "OK" not in out
  # Each worker SIGKILLs itself after step 7; one still in step 7's last
  # collective when its peer dies may exit 1 first (seen under load).
  assert -9 in codes[1] and 0 not in codes[1], codes[1]
  assert after_kill.endswith("ckpt-2"), after_kill
  for out in phase(runs, "resume:resumed"):
    assert "starting at step 6" in out
  want = np.load(directory / "full.npz")
  got = np.load(directory / "resumed.npz")
  assert sorted(want) == ["momenta", "parameters", "velocities"]
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_two_workers_train_16_bit_tables_as_float32_steps_rounded(runs):
  """Each step: the float32 step, every row rounded at its global id
  (mwms_row_storage.py asserts it); the checkpoint restores on one
  device with the stored types."""
  for out in phase(runs, "row_storage"):
    assert out.rstrip().endswith("OK"), out


def test_two_workers_train_dynamic_tables_like_one_device(runs):
  for out in phase(runs, "dynamic"):
    # Rows, slots and vocabulary arrays by row (asserted by the worker).
    assert list(sparse_access.reports(out)) == ["mwms/dynamic"], out


def test_tables_of_several_chunks_per_block_restore_exactly(runs):
  """Saved on 2 workers in 48-byte chunks (2 to 4 rows, several per
  block); restored on 2 fresh workers (chunk by chunk, whole blocks,
  before build) and on one device: the saved values, exactly."""
  directory = runs[0] / "chunks"
  phase(runs, "chunks:save")
  phase(runs, "chunks:restore")
  saved = np.load(directory / "saved.npz")
  emb = mwms_checkpoint_chunks.make_embedding(init=False)
  tf.train.Checkpoint(embedding=emb).restore(str(directory / "ckpt"))
  emb.build()
  got = mwms_checkpoint_chunks.values(emb)
  assert sorted(got) == sorted(saved)
  for key in saved:
    np.testing.assert_array_equal(got[key], saved[key], err_msg=key)


def test_two_workers_pipelined_follow_the_one_step_stale_schedule(runs):
  """Pipelined on 2 workers, flushed after step 1 and at the end: the
  one-step-stale schedule of tests/step/test_pipelining.py on one device."""
  for out in phase(runs, "pipelining"):
    # The pipelined step and the flush: by row only (asserted there).
    assert sorted(sparse_access.reports(out)) == [
      "mwms/flush_pipeline",
      "mwms/pipelined",
    ], out
