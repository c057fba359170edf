"""Two runs in one ``--model_dir``, as a user meets them (real processes).

A training run holds its directory (``tpu_embedding.run_lock``): a second
training run into it stops in one line naming the directory and the
holder, exit 1, and writes nothing there (it does not remove the first
run's fresh directory either); evaluations read alongside; a holder killed
with ``kill -9`` leaves a lock the rerun takes over, resuming from the
last checkpoint. ``tools/export.py --apply_delta`` is refused the same way
while another process writes the model's versions.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import tensorflow as tf

from tests import processes
from tests.scripts import run_tool
from tpu_embedding import run_lock

#: A long run on synthetic data with a checkpoint every 2 steps.
LONG = ",".join(
  [
    f"task.model.vocab_sizes={[40] * 26}",
    "task.train_data.global_batch_size=8",
    "task.validation_data.global_batch_size=8",
    "task.synthetic.num_train_examples=64",
    "task.synthetic.num_eval_examples=16",
    "trainer.train_steps=100000",
    "trainer.checkpoint_interval=2",
    "trainer.summary_interval=2",
    "trainer.steps_per_loop=2",
    "trainer.validation_interval=100000",
    "trainer.export_saved_model=false",
  ]
)


def command(model_dir, *args: str, override: str = LONG) -> list[str]:
  return [
    sys.executable, "-m", "model_garden.ranking.train", "--data=synthetic",
    f"--model_dir={model_dir}", "--progress_bar=off",
    f"--params_override={override}", *args,
  ]  # fmt: skip


def train(model_dir, *args: str, override: str = LONG):
  return processes.run(
    command(model_dir, *args, override=override),
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )


def start(model_dir) -> processes.Popen:
  """A long training run, once it has written its first checkpoint."""
  process = processes.Popen(
    command(model_dir, "--mode=train"),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  deadline = time.time() + 240
  while tf.train.latest_checkpoint(str(model_dir)) is None:
    assert process.poll() is None, process.stdout.read()
    assert time.time() < deadline, "no checkpoint in 240 s"
    time.sleep(0.5)
  return process


def last_line(result) -> str:
  assert "Traceback" not in result.stderr, result.stderr
  return result.stderr.strip().splitlines()[-1]


def stop(process) -> None:
  if process.poll() is None:
    process.kill()
  process.wait()


def test_a_second_run_is_refused_evaluations_run_and_a_kill_resumes(tmp_path):
  model_dir = tmp_path / "run"
  first = start(model_dir)
  try:
    before = sorted(os.listdir(model_dir))
    assert run_lock.LOCK_FILE in before
    second = train(model_dir, "--mode=train")
    assert second.returncode == 1, second.stderr
    line = last_line(second)
    assert line.startswith(
      f"{model_dir} is in use by another run (pid {first.pid} on "
    ), line
    assert line.endswith(
      f"lock file {model_dir / run_lock.LOCK_FILE}): wait for it to finish "
      "or stop it, or use another --model_dir."
    ), line
    # Nothing of the refused run in the directory (the first run's own
    # files may have moved on: only names the first run writes).
    assert not [n for n in os.listdir(model_dir) if n.startswith(".preflight")]
    # A reader alongside: --mode eval evaluates the latest checkpoint.
    evaluation = train(model_dir, "--mode=eval")
    assert evaluation.returncode == 0, evaluation.stderr[-2000:]
    assert "Validation AUC" in evaluation.stdout
    assert first.poll() is None  # still training, still holding
    assert run_lock.holder(str(model_dir)).pid == first.pid
  finally:
    if first.poll() is None:
      os.kill(first.pid, signal.SIGKILL)
    first.wait()
  assert first.returncode == -signal.SIGKILL
  killed_at = tf.train.latest_checkpoint(str(model_dir))
  step = int(killed_at.rsplit("-", 1)[1])
  # The rerun takes the killed run's lock over and resumes.
  rerun = train(
    model_dir,
    "--mode=train",
    override=LONG.replace("train_steps=100000", f"train_steps={step + 2}"),
  )
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  assert f"Restored {killed_at} (step {step})." in rerun.stdout
  assert tf.train.latest_checkpoint(str(model_dir)).endswith(f"-{step + 2}")
  assert run_lock.LOCK_FILE not in os.listdir(model_dir)


def test_a_refused_run_leaves_a_fresh_directory_of_another_run_alone(
  tmp_path,
):
  """The holder made the directory and has no checkpoint yet: the refused
  run, which fails before a checkpoint, must not remove it."""
  model_dir = tmp_path / "run"
  holder = processes.Popen(
    [
      sys.executable,
      "-c",
      textwrap.dedent(
        f"""
        import sys
        from tpu_embedding import run_lock
        lock = run_lock.RunLock({str(model_dir)!r}).acquire()
        open({str(model_dir / "mine.txt")!r}, "w").write("mine")
        print("held", flush=True)
        sys.stdin.readline()
        """
      ),
    ],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "held"
    before = sorted(os.listdir(model_dir))
    refused = train(model_dir, "--mode=train_and_eval")
    assert refused.returncode == 1
    assert last_line(refused).startswith(f"{model_dir} is in use by another")
    assert sorted(os.listdir(model_dir)) == before
    assert (model_dir / "mine.txt").read_text() == "mine"
  finally:
    stop(holder)


def test_apply_delta_is_refused_while_another_writes_the_versions(tmp_path):
  versions = tmp_path / "serving"
  holder = processes.Popen(
    [
      sys.executable,
      "-c",
      "import sys; from tpu_embedding import run_lock; "
      f"lock = run_lock.RunLock({str(versions)!r}).acquire(); "
      "print('held', flush=True); sys.stdin.readline()",
    ],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "held"
    before = sorted(os.listdir(versions))
    result = run_tool(
      "export.py",
      f"--apply_delta={tmp_path / 'run' / 'delta-3'}",
      f"--base_export={versions / '1'}",
      f"--export_dir={versions / '2'}",
      returncode=1,
    )
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(
      f"{versions} is in use by another run (pid {holder.pid} on "
    ), line
    assert line.endswith("or write the version when it is done."), line
    assert sorted(os.listdir(versions)) == before
  finally:
    stop(holder)
  # Free again: the same command gets past the lock (to the missing delta).
  result = run_tool(
    "export.py",
    f"--apply_delta={tmp_path / 'run' / 'delta-3'}",
    f"--base_export={versions / '1'}",
    f"--export_dir={versions / '2'}",
    returncode=1,
  )
  assert "in use by another run" not in result.stderr, result.stderr
