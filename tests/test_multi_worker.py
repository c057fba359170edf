"""MultiWorkerMirroredStrategy: two real worker processes on 127.0.0.1.

Each process runs tests/distributed/mwms_training.py with its ``TF_CONFIG``;
the table is sharded across the two workers' replicas. See that script for
what each worker asserts.
"""

from __future__ import annotations

import pathlib

import numpy as np
import tensorflow as tf

from tests import sparse_access
from tests.distributed import cluster
from tests.distributed import mwms_checkpoint_chunks
from tests.distributed import mwms_training

SCRIPT = pathlib.Path(__file__).parent / "distributed" / "mwms_training.py"


def test_two_workers_train_sharded_tables_like_one_device(tmp_path):
  for worker in cluster.run_workers([SCRIPT, tmp_path]):
    out = worker.check()
    # Each optimizer's traced step gathered and updated the worker's
    # tables and slots by row only (asserted there: tests/sparse_access.py).
    assert sorted(sparse_access.reports(out)) == [
      f"mwms/{name}" for name in sorted(mwms_training.OPTIMIZERS)
    ], out


RESUME = pathlib.Path(__file__).parent / "distributed" / "mwms_resume.py"


def test_killed_job_resumes_bit_identical_from_sliced_checkpoints(tmp_path):
  """Both workers killed after step 7 (last checkpoint: step 6), resumed."""
  full, resumed = tmp_path / "full.npz", tmp_path / "resumed.npz"
  for worker in cluster.run_workers([RESUME, tmp_path / "a", "run", full]):
    assert "starting at step 0" in worker.check()
  killed = cluster.run_workers([RESUME, tmp_path / "b", "kill", "-"])
  assert [w.returncode for w in killed] == [-9, -9]
  assert tf.train.latest_checkpoint(str(tmp_path / "b")).endswith("ckpt-2")
  for worker in cluster.run_workers([RESUME, tmp_path / "b", "run", resumed]):
    assert "starting at step 6" in worker.check()
  want, got = np.load(full), np.load(resumed)
  assert sorted(want) == ["momenta", "parameters", "velocities"]
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


DYNAMIC = pathlib.Path(__file__).parent / "distributed" / "mwms_dynamic.py"


def test_two_workers_train_dynamic_tables_like_one_device(tmp_path):
  for worker in cluster.run_workers([DYNAMIC, tmp_path]):
    out = worker.check()
    # Rows, slots and vocabulary arrays by row (asserted by the worker).
    assert list(sparse_access.reports(out)) == ["mwms/dynamic"], out


CHUNKS = (
  pathlib.Path(__file__).parent / "distributed" / "mwms_checkpoint_chunks.py"
)


def test_tables_of_several_chunks_per_block_restore_exactly(tmp_path):
  """Saved on 2 workers in 48-byte chunks (2 to 4 rows, several per
  block); restored on 2 fresh workers (chunk by chunk, whole blocks,
  before build) and on one device: the saved values, exactly."""
  for worker in cluster.run_workers([CHUNKS, "save", tmp_path]):
    worker.check()
  for worker in cluster.run_workers([CHUNKS, "restore", tmp_path]):
    worker.check()
  saved = np.load(tmp_path / "saved.npz")
  emb = mwms_checkpoint_chunks.make_embedding(init=False)
  tf.train.Checkpoint(embedding=emb).restore(str(tmp_path / "ckpt"))
  emb.build()
  got = mwms_checkpoint_chunks.values(emb)
  assert sorted(got) == sorted(saved)
  for key in saved:
    np.testing.assert_array_equal(got[key], saved[key], err_msg=key)


PIPELINING = (
  pathlib.Path(__file__).parent / "distributed" / "mwms_pipelining.py"
)


def test_two_workers_pipelined_follow_the_one_step_stale_schedule():
  """Pipelined on 2 workers, flushed after step 1 and at the end: the
  one-step-stale schedule of tests/test_pipelining.py on one device."""
  for worker in cluster.run_workers([PIPELINING]):
    out = worker.check()
    # The pipelined step and the flush: by row only (asserted there).
    assert sorted(sparse_access.reports(out)) == [
      "mwms/flush_pipeline",
      "mwms/pipelined",
    ], out
