"""``--num_workers`` / ``--num_ps``: one command, a local cluster, restarts.

* The launcher itself, on a small program that reports its ``TF_CONFIG``
  and fails once: every task gets its own ``TF_CONFIG`` on 127.0.0.1,
  lines come back prefixed with the task, a dying task restarts the whole
  job (up to ``max_restarts``), a parameter-server job ends when its chief
  does (the servers are stopped).
* ``model_garden.ranking.train --strategy multi_worker_mirrored
  --num_workers 2``: worker 1 is killed (SIGKILL) after step 5, the job
  restarts from the checkpoint of step 4 and finishes; its final
  checkpoint (tables, dense weights, optimizer state) is bit-identical to
  the same job never killed. (The same training in one process on 2
  mirrored replicas differs by a few float32 ulps, up to 3e-8, in most
  tables: the strategy, not the kill; tests/backends/test_multi_worker.py
  compares strategies within 1e-5.)
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import numpy as np
import tensorflow as tf

from model_garden.ranking import launcher
from model_garden.ranking import strategies

TASK = textwrap.dedent(
  """
  import json, os, pathlib, sys
  config = json.loads(os.environ["TF_CONFIG"])
  task = config["task"]
  print("task", task["type"], task["index"], "of", sorted(config["cluster"]),
        "extra", sys.argv[2:], flush=True)
  root = pathlib.Path(sys.argv[1])
  marker = root / f"{task['type']}{task['index']}"
  if "chief" in config["cluster"]:
    import time
    servers = [f"{job}{i}" for job in ("ps", "worker")
               for i in range(len(config["cluster"][job]))]
    if task["type"] != "chief":
      (root / f"ready-{marker.name}").touch()
      time.sleep(600)  # a server: runs until stopped
    while not all((root / f"ready-{s}").exists() for s in servers):
      time.sleep(0.05)  # the chief: until every server runs
  if task == {"type": "worker", "index": 1} and not marker.exists():
    marker.touch()
    sys.exit(3)  # fails in the first attempt only
  if "always_fail" in sys.argv:
    sys.exit(5)
  """
)


def run_launcher(tmp_path, strategy, workers, ps=0, *args, **kwargs):
  script = tmp_path / "task.py"
  script.write_text(TASK)
  out = io.StringIO()
  code = launcher.launch(
    [sys.executable, str(script), str(tmp_path), *args],
    strategy,
    workers,
    ps,
    stream=out,
    poll_seconds=0.05,
    **kwargs,
  )
  return code, out.getvalue()


def test_a_failed_task_restarts_the_job_with_prefixed_logs(tmp_path):
  code, out = run_launcher(
    tmp_path,
    "multi_worker_mirrored",
    2,
    max_restarts=2,
    first_attempt_only=["--kill_at_step=5"],
  )
  assert code == 0, out
  lines = out.splitlines()
  assert "[worker 0] task worker 0 of ['worker'] extra []" in lines
  # The extra arguments go to the last worker of the first attempt only.
  assert (
    "[worker 1] task worker 1 of ['worker'] extra ['--kill_at_step=5']"
    in (lines)
  )
  assert "[worker 1] task worker 1 of ['worker'] extra []" in lines
  assert (
    "[launcher] worker 1 stopped (exit code 3); restarting every task from "
    "the last checkpoint (restart 1 of 2)." in lines
  )
  assert re.search(r"\[launcher\] attempt 2 of 3: started worker 0 \(pid", out)
  assert lines[-1] == "[launcher] all tasks finished."


#: A task that starts its real TensorFlow server (gRPC on its address).
SERVER_TASK = textwrap.dedent(
  """
  import json, os
  import tensorflow as tf
  config = json.loads(os.environ["TF_CONFIG"])
  task = config["task"]
  tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]),
                       job_name=task["type"], task_index=task["index"])
  print("server up", flush=True)
  """
)


def test_a_port_taken_before_its_task_binds_it_starts_the_job_again(
  tmp_path, monkeypatch
):
  """Another process took a port after the launcher chose it (a busy
  host): the task's real server cannot bind it, and the job starts again
  on new ports, not counted as a restart (``max_restarts=0``); a port
  taken every time counts as a failure after ``PORT_RETRIES`` tries."""
  taken = socket.socket()
  taken.bind(("127.0.0.1", 0))
  taken.listen(1)
  address = f"127.0.0.1:{taken.getsockname()[1]}"
  script = tmp_path / "server.py"
  script.write_text(SERVER_TASK)
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")

  def launch(ports):
    monkeypatch.setattr(launcher, "free_port", ports)
    out = io.StringIO()
    code = launcher.launch(
      [sys.executable, str(script)],
      "multi_worker_mirrored",
      1,
      max_restarts=0,
      stream=out,
      poll_seconds=0.05,
    )
    return code, out.getvalue()

  first = iter([taken.getsockname()[1]])
  code, out = launch(lambda: next(first, None) or strategies.free_port())
  assert code == 0, out
  assert out.count("[worker 0] server up") == 1, out
  assert (
    f"[launcher] worker 0 could not start its server on {address}: another "
    "process took the port after the launcher chose it; starting every task "
    "again on new ports (not a restart; 1 of 3)." in out.splitlines()
  ), out
  assert out.splitlines()[-1] == "[launcher] all tasks finished."
  monkeypatch.setattr(launcher, "PORT_RETRIES", 1)
  code, out = launch(lambda: taken.getsockname()[1])
  assert code == 1, out
  assert out.count("could not start its server") == 1, out
  assert out.splitlines()[-1] == (
    "[launcher] worker 0 stopped (exit code 1); giving up after 0 restart(s)."
  )
  taken.close()


def test_the_launcher_gives_up_after_max_restarts(tmp_path):
  code, out = run_launcher(
    tmp_path, "multi_worker_mirrored", 1, 0, "always_fail", max_restarts=1
  )
  assert code == 5
  assert out.count("[launcher] attempt") == 2
  assert out.splitlines()[-1] == (
    "[launcher] worker 0 stopped (exit code 5); giving up after 1 restart(s)."
  )


def test_a_parameter_server_job_ends_with_its_chief(tmp_path):
  code, out = run_launcher(
    tmp_path, "parameter_server", 2, 1, first_attempt_only=["--kill_at_step=2"]
  )
  assert code == 0, out
  for task in ("ps 0", "worker 0", "worker 1", "chief 0"):
    kind, index = task.split()
    extra = ["--kill_at_step=2"] if kind == "chief" else []
    assert (
      f"[{task}] task {kind} {index} of ['chief', 'ps', 'worker'] extra "
      f"{extra}" in out
    )
  configs = launcher.cluster_configs("parameter_server", 2, 1)
  addresses = [a for job in configs[0]["cluster"].values() for a in job]
  assert len(set(addresses)) == 4
  assert all(a.startswith("127.0.0.1:") for a in addresses)


PARAMS = ",".join(
  [
    f"task.model.vocab_sizes={[600] * 26}",
    "task.model.size_threshold=500",  # row-sharded over both workers
    "task.train_data.global_batch_size=64",
    "task.validation_data.global_batch_size=64",
    "task.synthetic.num_train_examples=1024",
    "task.synthetic.num_eval_examples=256",
    "trainer.train_steps=8",
    "trainer.checkpoint_interval=4",
    "trainer.summary_interval=4",
    "trainer.steps_per_loop=4",
    "trainer.time_history.log_steps=4",
    "trainer.export_saved_model=false",
  ]
)


def train_command(model_dir, *flags):
  return [
    sys.executable,
    "-m",
    "model_garden.ranking.train",
    f"--model_dir={model_dir}",
    f"--params_override={PARAMS}",
    "--seed=3",
    "--mode=train",
    *flags,
  ]


def checkpoint_values(directory):
  """Every value of the last checkpoint in ``directory``, by key."""
  path = tf.train.latest_checkpoint(str(directory))
  assert path and path.endswith("ckpt-8"), path
  return {
    name: tf.train.load_variable(path, name)
    for name, _ in tf.train.list_variables(path)
  }


def test_multi_worker_job_survives_a_killed_worker(tmp_path):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("TF_CONFIG", None)
  job = subprocess.Popen(
    train_command(
      tmp_path / "mwms",
      "--strategy=multi_worker_mirrored",
      "--num_workers=2",
      "--kill_at_step=5",
    ),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=env,
    cwd=str(tmp_path),
  )
  uninterrupted = subprocess.Popen(
    train_command(
      tmp_path / "uninterrupted",
      "--strategy=multi_worker_mirrored",
      "--num_workers=2",
    ),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=env,
    cwd=str(tmp_path),
  )
  try:
    out, _ = job.communicate(timeout=400)
    uninterrupted_out, _ = uninterrupted.communicate(timeout=400)
  finally:
    job.kill()
    uninterrupted.kill()
  assert job.returncode == 0, out[-5000:]
  assert uninterrupted.returncode == 0, uninterrupted_out[-3000:]
  assert "Killing this process" not in uninterrupted_out
  assert "[worker 1] Killing this process after step 5" in out
  assert (
    "[launcher] worker 1 stopped (killed by SIGKILL); restarting every task "
    "from the last checkpoint (restart 1 of 3)." in out
  )
  for worker in (0, 1):
    assert f"[worker {worker}] Restored {tmp_path / 'mwms' / 'ckpt-4'}" in out
    assert re.search(
      rf"\[worker {worker}\] .*CollectiveAllReduceStrategy with 2 replica", out
    )
  assert out.splitlines()[-1] == "[launcher] all tasks finished."
  params = json.loads((tmp_path / "mwms" / "params.yaml").read_text())
  assert params["runtime"]["distribution_strategy"] == "multi_worker_mirrored"
  got, want = (
    checkpoint_values(tmp_path / "mwms"),
    checkpoint_values(tmp_path / "uninterrupted"),
  )
  assert sum(name.startswith("embedding/") for name in want) == 26
  assert set(got) == set(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
