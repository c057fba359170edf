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

Launches: one per kill (each kill patches TensorFlow's ops in its
processes), then one launch of fresh workers running the job never
killed and the three resumed jobs one after another (a worker's setup
costs more than such a job; each job restores from its own directory
into its own new objects).
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
import tensorflow as tf

from tests.distributed import cluster
from tpu_embedding.checkpointing.parts import remove_stale_temps

SCRIPT = (
  pathlib.Path(__file__).parents[1] / "distributed" / "mwms_checkpoint_kill.py"
)


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


KILLS = {  # mode: (the worker that dies, ckpt-2 data files left in place)
  "kill_worker": (1, 0),
  "kill_chief": (0, 0),
  "kill_commit": (0, 1),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  """Each kill mode's job killed (a launch each: the modes patch
  TensorFlow's ops), what the kill left checked at once; then, in one
  launch of fresh workers, a job never killed and each killed job resumed
  (one after another). Returns ``{name: (resumed job's output per
  worker, its model dir, its values)}`` for ``uninterrupted`` and each
  mode, and ``{mode: the killed workers}``."""
  root = tmp_path_factory.mktemp("jobs")
  killed, args = {}, []
  for mode, (who, moved) in KILLS.items():
    model = root / mode / "model"
    killed[mode] = cluster.run_job([SCRIPT, model, mode, "-"])
    check_cut_off(model, killed[mode], who, moved)
  for name in ["uninterrupted", *KILLS]:
    args += [root / name / "model", "run", root / name / "values.npz"]
  by_name = {}
  for worker in cluster.run_workers([SCRIPT, *args]):
    for model, part in cluster.split_phases(worker).items():
      by_name.setdefault(pathlib.Path(model).parent.name, []).append(part)
  runs = {}
  for name, parts in by_name.items():
    values = root / name / "values.npz"
    loaded = dict(np.load(values)) if values.exists() else None
    runs[name] = (parts, root / name / "model", loaded)
  return runs, killed


def check_cut_off(model: pathlib.Path, killed, who: int, moved: int) -> None:
  """What a kill in the save of ``ckpt-2`` leaves: both workers killed,
  by worker ``who``'s kill; its parts there, not recorded; ``moved``:
  data files of ``ckpt-2`` the kill leaves in place."""
  assert [w.returncode for w in killed] == [-9, -9], killed
  assert "killing this process" in killed[who].stdout, killed[who]
  assert "killing this process" not in killed[1 - who].stdout
  assert (model / "ckpt-2_temp").is_dir()
  assert not (model / "ckpt-2.index").exists()
  assert len(list(model.glob("ckpt-2.data-*"))) == moved
  assert tf.train.latest_checkpoint(str(model)).endswith("ckpt-1")


def resumed(jobs, name: str, start: int) -> dict:
  """Job ``name``'s values; asserts it ran on both workers from step
  ``start`` and left only whole checkpoints, the last ``ckpt-3``."""
  runs, _ = jobs
  assert name in runs, f"{name} did not run: {sorted(runs)}"
  parts, model, values = runs[name]
  assert len(parts) == 2, parts
  for part in parts:
    assert f"starting at step {start}" in part.check()
  checkpoint_files(model)
  assert tf.train.latest_checkpoint(str(model)).endswith("ckpt-3")
  return values


def assert_bit_identical(got: dict, want: dict) -> None:
  assert sorted(want) == ["momenta", "parameters", "velocities"]
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_a_worker_killed_writing_its_rows_resumes_bit_identical(jobs):
  """Worker 1 dies after writing 2 of its 3 keys' rows of ``ckpt-2``."""
  got = resumed(jobs, "kill_worker", start=2)
  assert_bit_identical(got, resumed(jobs, "uninterrupted", start=0))


def test_the_chief_killed_merging_resumes_bit_identical(jobs):
  """The chief dies in the merge of ``ckpt-2``, one part not merged."""
  got = resumed(jobs, "kill_chief", start=2)
  assert_bit_identical(got, resumed(jobs, "uninterrupted", start=0))


def test_the_chief_killed_moving_the_merged_files_resumes_bit_identical(
  jobs,
):
  """The chief dies in the commit of ``ckpt-2``: one file moved, a data
  file without its index left next to the checkpoints."""
  got = resumed(jobs, "kill_commit", start=2)
  assert_bit_identical(got, resumed(jobs, "uninterrupted", start=0))


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
  remove_stale_temps(str(tmp_path / "ckpt-4"))
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
