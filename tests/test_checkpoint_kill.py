"""Kill -9 inside ``tpu_embedding.checkpoints``' write, then resume.

Two real workers (tests/distributed/mwms_checkpoint_kill.py) save a
row-sharded Adam table at steps 2, 4 and 6 with
``tpe.checkpoints.CheckpointManager``. A kill cuts off the save of step 4
(``ckpt-2``): a worker dies writing its rows, or the chief dies merging
the parts, or in the commit that moves the merged files in place; the
other worker is then killed too, as the launcher does. No ``ckpt-2.index``
may exist then (an index is only ever a whole checkpoint). A fresh job
must restore ``ckpt-1`` (the last whole checkpoint), leave no file of the
cut-off save behind, and end bit-identical to a job never killed.

The resumed job writes ``ckpt-2`` again, which replaces what the kill left
under that name; what a save sweeps first (``*_temp`` directories, data
files without an index, left under names no save writes again: another
worker count, another numbering) is checked on its own, in one process.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
import tensorflow as tf

from tests.distributed import cluster
from tpu_embedding import checkpoints

SCRIPT = (
  pathlib.Path(__file__).parent / "distributed" / "mwms_checkpoint_kill.py"
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The tables and slots of a job never killed."""
  directory = tmp_path_factory.mktemp("uninterrupted")
  out = directory / "values.npz"
  for worker in cluster.run_workers([SCRIPT, directory / "model", "run", out]):
    assert "starting at step 0" in worker.check()
  return dict(np.load(out))


def checkpoint_files(directory: pathlib.Path) -> None:
  """Asserts ``directory`` holds the state file and the whole checkpoints
  it lists, nothing else."""
  state = tf.train.get_checkpoint_state(str(directory))
  prefixes = [pathlib.Path(p).name for p in state.all_model_checkpoint_paths]
  names = sorted(p.name for p in directory.iterdir())
  want = {"checkpoint"}
  for prefix in prefixes:
    data = [n for n in names if n.startswith(f"{prefix}.data-")]
    counts = {re.fullmatch(r".*-of-(\d{5})", n)[1] for n in data}
    assert len(counts) == 1, f"{prefix}: data files of two saves: {data}"
    (count,) = counts
    want |= {f"{prefix}.index"}
    want |= {f"{prefix}.data-{i:05d}-of-{count}" for i in range(int(count))}
    values = dict(tf.train.list_variables(str(directory / prefix)))
    assert values["embedding/t/.ATTRIBUTES/VARIABLE_VALUE"] == [20, 2]
  assert names == sorted(want), (names, prefixes)


def kill_and_resume(
  directory: pathlib.Path, mode: str, who: int, moved: int = 0
) -> dict:
  """Runs the job killed in ``mode``, then resumed; the resumed values.
  ``moved``: data files of ``ckpt-2`` the kill leaves in place."""
  model = directory / "model"
  killed = cluster.run_job([SCRIPT, model, mode, "-"])
  assert [w.returncode for w in killed] == [-9, -9], killed
  assert "killing this process" in killed[who].stdout, killed[who]
  assert "killing this process" not in killed[1 - who].stdout
  # Cut off inside the save: its parts are there, it is not recorded.
  assert (model / "ckpt-2_temp").is_dir()
  assert not (model / "ckpt-2.index").exists()
  assert len(list(model.glob("ckpt-2.data-*"))) == moved
  assert tf.train.latest_checkpoint(str(model)).endswith("ckpt-1")
  out = directory / "resumed.npz"
  for worker in cluster.run_workers([SCRIPT, model, "run", out]):
    assert "starting at step 2" in worker.check()
  checkpoint_files(model)
  assert tf.train.latest_checkpoint(str(model)).endswith("ckpt-3")
  return dict(np.load(out))


def assert_bit_identical(got: dict, want: dict) -> None:
  assert sorted(want) == ["momenta", "parameters", "velocities"]
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_a_worker_killed_writing_its_rows_resumes_bit_identical(
  tmp_path, uninterrupted
):
  """Worker 1 dies after writing 2 of its 3 keys' rows of ``ckpt-2``."""
  got = kill_and_resume(tmp_path, "kill_worker", who=1)
  assert_bit_identical(got, uninterrupted)


def test_the_chief_killed_merging_resumes_bit_identical(
  tmp_path, uninterrupted
):
  """The chief dies in the merge of ``ckpt-2``, one part not merged."""
  got = kill_and_resume(tmp_path, "kill_chief", who=0)
  assert_bit_identical(got, uninterrupted)


def test_the_chief_killed_moving_the_merged_files_resumes_bit_identical(
  tmp_path, uninterrupted
):
  """The chief dies in the commit of ``ckpt-2``: one file moved, a data
  file without its index left next to the checkpoints."""
  got = kill_and_resume(tmp_path, "kill_commit", who=0, moved=1)
  assert_bit_identical(got, uninterrupted)


def test_a_save_first_sweeps_what_killed_saves_left(tmp_path):
  """Kept: whole checkpoints, the state file, files of others; removed:
  ``*_temp`` directories and data files without their index."""
  kept = [
    "checkpoint",
    "ckpt-1.index",
    "ckpt-1.data-00000-of-00002",
    "ckpt-1.data-00001-of-00002",
    "notes.txt",
  ]
  left = ["ckpt-2.data-00001-of-00003", "ckpt-3_temp/part-main.index"]
  for name in kept + left:
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text("x")
  checkpoints._remove_stale_temps(str(tmp_path / "ckpt-4"))  # noqa: SLF001
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
