"""Kill -9 of the ranking trainer with a table on disk, then resume.

One run (``task.model.disk_directory``: table 0 on disk behind a cache
smaller than the rows it touches), SIGKILLed three times in the same
model and disk directories, each rerun finding the killed run's files
(its table's rows and its lock files): inside the save of step 5, the
first save, once the table's parameters are written from its files
(which then hold trained rows) and the rest not (``disk_tier_kill.py``):
the rerun starts afresh, the rows the dead run wrote must not come back;
inside the save of step 10 (the rerun resumes from ``ckpt-5``); after
step 12 (resumes from ``ckpt-10``).
The last rerun ends at step 15 with the checkpoint of a run never killed,
bit for bit: the disk files are working state, rebuilt from the last
checkpoint, never trusted after a crash.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import tensorflow as tf

from tests.model_garden.test_disk_tier import CACHE_BYTES
from tests.model_garden.test_disk_tier import VOCAB_SIZES
from tests.model_garden.test_disk_tier import checkpoint_values
from tests.model_garden.test_train import command
from tests.model_garden.test_train import finish
from tests.model_garden.test_train import start
from tpu_embedding.tables import row_files

SCRIPT = pathlib.Path(__file__).parent / "disk_tier_kill.py"
STEPS = 15


def params(disk) -> str:
  return (
    "task.train_data.global_batch_size=64,"
    "task.synthetic.num_train_examples=1024,"
    f"task.model.vocab_sizes=[{', '.join(map(str, VOCAB_SIZES))}],"
    "trainer.optimizer_config.embedding_optimizer=Adagrad,"
    f"trainer.train_steps={STEPS},"
    "trainer.checkpoint_interval=5,"
    "trainer.export_saved_model=false,"
    f"task.model.disk_directory={disk},"
    "task.model.disk_size_threshold=1000,"
    f"task.model.disk_cache_bytes={CACHE_BYTES}"
  )


def train(root, name, *flags, kill_in_save_of=None):
  """Starts the trainer on ``root/name`` (its disk ``root/name-ssd``)."""
  args = command(
    root / name,
    "--mode=train",
    "--progress_bar=off",
    *flags,
    params=params(root / f"{name}-ssd"),
  )
  if kill_in_save_of is not None:  # python disk_tier_kill.py STEP ARGS
    args = [sys.executable, str(SCRIPT), str(kill_in_save_of), *args[3:]]
  return start(args, root)


def output(process, rc=0):
  code, stdout, stderr = finish(process)
  assert code == rc, f"exit {code}, not {rc}:\n{(stdout + stderr)[-4000:]}"
  return stdout + stderr


def test_killed_runs_resume_from_the_last_checkpoint_bit_identical(tmp_path):
  uninterrupted = train(tmp_path, "whole")
  model, disk = tmp_path / "run", tmp_path / "run-ssd" / "embedding_table_00"
  log = output(train(tmp_path, "run", kill_in_save_of=5), rc=-9)
  assert "killing this process in the save of step 5" in log
  assert tf.train.latest_checkpoint(str(model)) is None
  # The save wrote the cache's changed rows to the files first: they hold
  # trained rows (Adagrad's accumulators start at 0.1), and the lock file.
  # Segments of records, each its rows' ids, then one record per row:
  # parameters, then accumulators (16 wide).
  records = np.fromfile(disk / "rows.records", np.uint8).reshape(
    -1, row_files.SEGMENT_RECORDS * (8 + 2 * 16 * 4)
  )[:, row_files.SEGMENT_RECORDS * 8 :]
  accumulators = records.copy().view(np.float32).reshape(-1, 2, 16)[:, 1]
  assert (accumulators != np.float32(0.1)).any()
  assert (accumulators == np.float32(0.1)).any()  # (rows not trained)
  assert (disk / ".tpu_embedding.lock").exists()  # (no holder)

  log = output(train(tmp_path, "run", kill_in_save_of=10), rc=-9)
  assert "Restored" not in log
  assert "killing this process in the save of step 10" in log
  assert not (model / "ckpt-10.index").exists()
  assert tf.train.latest_checkpoint(str(model)).endswith("ckpt-5")

  log = output(train(tmp_path, "run", "--kill_at_step=12"), rc=-9)
  assert "ckpt-5 (step 5)" in log
  assert tf.train.latest_checkpoint(str(model)).endswith("ckpt-10")

  log = output(train(tmp_path, "run"))
  assert "ckpt-10 (step 10)" in log
  output(uninterrupted)
  got_path, got = checkpoint_values(model)
  want_path, want = checkpoint_values(tmp_path / "whole")
  assert got_path.endswith(f"ckpt-{STEPS}") and want_path.endswith(
    f"ckpt-{STEPS}"
  )
  table = "embedding/embedding_table_00/.ATTRIBUTES/VARIABLE_VALUE"
  assert got[table].shape == (VOCAB_SIZES[0], 16)
  assert set(got) == set(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
