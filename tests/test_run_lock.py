"""One writer per directory (``tpu_embedding.run_lock``), between real
processes: a second ``CheckpointManager`` saving into a directory another
process saves into is refused in one line and writes nothing; a holder
killed with ``kill -9`` leaves a lock that the next writer takes over;
managers of one process (and a run's own lock) share it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

from tests import processes
from tpu_embedding import checkpoints
from tpu_embedding import run_lock

#: A process that saves one checkpoint into argv[1] with the library's
#: manager, says so, then waits (holding the directory) until killed or
#: told to go on; then saves once more.
SAVER = textwrap.dedent(
  """
  import sys
  import tensorflow as tf
  from tpu_embedding import checkpoints, run_lock
  step = tf.Variable(1)
  manager = checkpoints.CheckpointManager(
      tf.train.Checkpoint(step=step), sys.argv[1], max_to_keep=5)
  manager.restore_or_initialize()
  try:
    print("saved", manager.save(), flush=True)
  except run_lock.DirectoryInUseError as e:
    print(e, file=sys.stderr)
    sys.exit(1)
  sys.stdin.readline()
  step.assign_add(1)
  print("saved", manager.save(), flush=True)
  """
)


def saver(directory) -> processes.Popen:
  """A ``SAVER`` process; returns once it saved (and holds the lock)."""
  process = processes.Popen(
    [sys.executable, "-c", SAVER, str(directory)],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  line = process.stdout.readline()
  assert line.startswith("saved"), (line, process.stderr.read())
  return process


def listing(directory) -> dict[str, float]:
  return {
    name: os.stat(os.path.join(directory, name)).st_mtime
    for name in os.listdir(directory)
  }


def test_a_second_manager_in_another_process_is_refused(tmp_path):
  directory = tmp_path / "run"
  first = saver(directory)
  try:
    before = listing(directory)
    assert run_lock.LOCK_FILE in before
    second = processes.run(
      [sys.executable, "-c", SAVER, str(directory)],
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
    )
    assert second.returncode == 1, second.stderr
    line = second.stderr.strip().splitlines()[-1]
    assert line.startswith(
      f"{directory} is in use by another run (pid {first.pid} on "
    ), line
    assert line.endswith(
      f"lock file {directory / run_lock.LOCK_FILE}): wait for it to finish "
      "or stop it, or save into another directory."
    ), line
    assert listing(directory) == before  # the refused one wrote nothing
    # The holder goes on saving.
    out, _ = first.communicate("\n", timeout=300)
    assert out.startswith("saved") and first.returncode == 0
  finally:
    if first.poll() is None:
      first.kill()
      first.wait()
  # Released at exit: the lock file is gone, the directory free.
  assert run_lock.LOCK_FILE not in os.listdir(directory)
  assert tf.train.latest_checkpoint(str(directory)).endswith("ckpt-2")


def test_a_killed_holder_leaves_a_lock_the_next_writer_takes(tmp_path):
  directory = tmp_path / "run"
  first = saver(directory)
  os.kill(first.pid, signal.SIGKILL)
  first.wait()
  assert first.returncode == -signal.SIGKILL
  assert run_lock.LOCK_FILE in os.listdir(directory)  # stale, unheld
  assert run_lock.holder(str(directory)) is None
  second = saver(directory)  # takes it over, and resumes from ckpt-1
  try:
    assert run_lock.holder(str(directory)).pid == second.pid
    out, _ = second.communicate("\n", timeout=300)
    assert second.returncode == 0, out
    assert out.strip().endswith("ckpt-3")  # ckpt-2 above, then the save
  finally:
    if second.poll() is None:
      second.kill()
      second.wait()


def test_managers_of_one_process_share_the_lock(tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  step = tf.Variable(1)
  checkpoint = tf.train.Checkpoint(step=step)
  with run_lock.RunLock(a) as held:  # a run holding its directory
    first = checkpoints.CheckpointManager(checkpoint, a, max_to_keep=2)
    second = checkpoints.CheckpointManager(checkpoint, a, max_to_keep=2)
    other = checkpoints.CheckpointManager(checkpoint, b, max_to_keep=2)
    assert first.save().endswith("ckpt-1")
    assert second.save().endswith("ckpt-2")
    assert other.save().endswith("ckpt-3")
    assert run_lock.holder(a).pid == run_lock.holder(b).pid == os.getpid()
    assert held.held
    del first, second
  del other
  import gc  # noqa: PLC0415

  gc.collect()
  # Every holder gone: both directories free, their lock files removed.
  assert run_lock.holder(a) is None and run_lock.holder(b) is None
  assert run_lock.LOCK_FILE not in os.listdir(a) + os.listdir(b)


def test_a_worker_that_is_not_the_chief_takes_no_lock(tmp_path, monkeypatch):
  monkeypatch.setenv(
    "TF_CONFIG",
    '{"cluster": {"worker": ["a:1", "b:2"]}, '
    '"task": {"type": "worker", "index": 1}}',
  )
  manager = checkpoints.CheckpointManager(
    tf.train.Checkpoint(step=tf.Variable(1)), str(tmp_path), max_to_keep=2
  )
  manager.save()
  assert run_lock.holder(str(tmp_path)) is None


def test_a_refusal_is_one_line_naming_directory_and_holder(tmp_path):
  holder = run_lock.Holder(pid=42, host="h", started="2026-01-01 12:00:00")
  error = run_lock.DirectoryInUseError(str(tmp_path), holder, "do X")
  assert str(error) == (
    f"{tmp_path} is in use by another run (pid 42 on h, since 2026-01-01 "
    f"12:00:00; lock file {tmp_path / run_lock.LOCK_FILE}): wait for it to "
    "finish or stop it, or do X."
  )


@pytest.mark.parametrize(
  "cluster, task, chief",
  [
    (None, None, True),  # one process
    ({"worker": ["a:1", "b:2"]}, ("worker", 0), True),
    ({"worker": ["a:1", "b:2"]}, ("worker", 1), False),
    ({"chief": ["c:0"], "worker": ["a:1"]}, ("chief", 0), True),
    # A cluster with a chief task: worker 0 is not its chief, and must not
    # take (or be refused) the run directory's lock.
    ({"chief": ["c:0"], "worker": ["a:1"]}, ("worker", 0), False),
    ({"chief": ["c:0"], "worker": ["a:1"], "ps": ["p:2"]}, ("ps", 0), False),
  ],
)
def test_one_chief_task_per_cluster(monkeypatch, cluster, task, chief):
  from model_garden.ranking import train  # noqa: PLC0415

  if cluster is None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
  else:
    kind, index = task
    monkeypatch.setenv(
      "TF_CONFIG",
      json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}}),
    )
  assert run_lock.is_chief_task() is chief
  assert train.writes_run_dir("train") is chief
  assert train.writes_run_dir("eval") is False
