"""``tests/processes.py``: a forked child is what a fresh ``python`` is.

Each case runs the same command forked and as an ordinary subprocess
(``TPU_EMBEDDING_TEST_FORK=0``) and expects the same: argv, ``sys.path[0]``,
working directory, environment, streams and their buffering, exit codes,
tracebacks, kills and timeouts. ``tensorflow`` already imported when the
script starts tells the two apart: a test that could not fail if forking
silently fell back.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from tests import processes

SCRIPT = textwrap.dedent(
  """
  import os, sys, time
  import numpy as np
  print("argv", sys.argv)
  print("path0", sys.path[0])
  print("cwd", os.getcwd())
  print("config", os.environ.get("TF_CONFIG"))
  print("preloaded", "tensorflow" in sys.modules)
  print("hash", hash("a string"))
  print("random", np.random.random())
  print("to stderr", file=sys.stderr)
  for name in ("stdout", "stderr"):
    stream = getattr(sys, name)
    print(name, type(stream.buffer).__name__, stream.line_buffering,
          stream.write_through, stream.encoding, stream.errors)
  command = sys.argv[1]
  if command == "raise":
    raise ValueError("boom")
  if command == "echo":
    print("waiting", flush=False)
    sys.stdin.read()
  if command == "sleep":
    time.sleep(60)
  if command == "tensorflow":
    import tensorflow as tf
    print("sum", float(tf.reduce_sum(tf.ones([3]))))
  sys.exit(int(command) if command.isdigit() else 0)
  """
)


@pytest.fixture(params=["forked", "subprocess"])
def mode(request, monkeypatch) -> str:
  monkeypatch.setenv(
    "TPU_EMBEDDING_TEST_FORK", "1" if request.param == "forked" else "0"
  )
  return request.param


@pytest.fixture
def script(tmp_path) -> str:
  path = tmp_path / "script.py"
  path.write_text(SCRIPT)
  return str(path)


def python(*args, env=None, timeout=60, **kwargs):
  """``python *args`` through ``processes.run``, its output captured as
  text, in the servers' environment unless ``env`` is given."""
  if env is None:
    env = processes.server_environment()
  return processes.run(
    [sys.executable, *args], capture_output=True, text=True, env=env,
    timeout=timeout, **kwargs,
  )  # fmt: skip


def lines(output: str) -> dict[str, str]:
  return dict(line.split(" ", 1) for line in output.splitlines() if " " in line)


def test_a_script_runs_as_python_runs_it(mode, script, tmp_path):
  cwd = tmp_path / "elsewhere"
  cwd.mkdir()
  env = {**processes.server_environment(), "TF_CONFIG": '{"task": 1}'}
  done = python(script, "tensorflow", env=env, cwd=cwd, timeout=120)
  assert done.returncode == 0, done.stderr
  out = lines(done.stdout)
  assert out["argv"] == repr([script, "tensorflow"])
  assert out["path0"] == str(tmp_path)
  assert out["cwd"] == str(cwd)
  assert out["config"] == '{"task": 1}'
  assert out["preloaded"] == str(mode == "forked")
  assert out["sum"] == "3.0"
  assert "to stderr\n" in done.stderr


@pytest.mark.parametrize("command, code", [("3", 3), ("raise", 1)])
def test_exit_codes_and_tracebacks(mode, script, command, code):
  done = python(script, command)
  assert done.returncode == code
  assert lines(done.stdout)["preloaded"] == str(mode == "forked")
  if command == "raise":
    assert done.stderr.startswith("to stderr\nTraceback (most recent call")
    assert done.stderr.endswith("ValueError: boom\n")


def test_a_module_runs_as_python_m_runs_it(mode, tmp_path):
  package = tmp_path / "package"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "main.py").write_text(
    "import os, sys\n"
    "print(__name__, sys.argv[0] == __file__, sys.path[0] == os.getcwd())\n"
    "print(sys.argv[1:], 'tensorflow' in sys.modules)\n"
  )
  done = python("-m", "package.main", "x", "-y", cwd=tmp_path)
  assert done.returncode == 0, done.stderr
  assert done.stdout.splitlines() == [
    "__main__ True True",
    f"['x', '-y'] {mode == 'forked'}",
  ]


def test_kill_timeout_and_unbuffered_output(mode, script):
  env = {**processes.server_environment(), "PYTHONUNBUFFERED": "1"}
  process = processes.Popen(
    [sys.executable, script, "echo"], stdin=subprocess.PIPE,
    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
  )  # fmt: skip
  seen: list[str] = []
  reader = threading.Thread(
    target=lambda: seen.extend(iter(process.stdout.readline, "waiting\n"))
  )
  reader.start()
  reader.join(timeout=60)  # unbuffered: "waiting" arrives before it exits
  assert not reader.is_alive()
  assert lines("".join(seen))["preloaded"] == str(mode == "forked")
  assert process.poll() is None
  with pytest.raises(subprocess.TimeoutExpired):
    process.wait(timeout=0.5)
  os.kill(process.pid, 9)
  assert process.wait(timeout=60) == -9
  process.stdin.close()
  process.stdout.close()
  with pytest.raises(subprocess.TimeoutExpired):
    python(script, "sleep", env=env, timeout=1)


@pytest.mark.parametrize("unbuffered", [True, False])
def test_streams_are_buffered_as_at_startup(script, monkeypatch, unbuffered):
  """The same stream types and buffering as a fresh interpreter's, with
  ``PYTHONUNBUFFERED`` and without (the servers have their own)."""
  env = processes.server_environment()
  env.pop("PYTHONUNBUFFERED", None)
  if unbuffered:
    env["PYTHONUNBUFFERED"] = "1"
  found = {}
  for fork in ("0", "1"):
    monkeypatch.setenv("TPU_EMBEDDING_TEST_FORK", fork)
    out = lines(python(script, "0", env=env).stdout)
    assert out["preloaded"] == str(fork == "1")
    found[fork] = (out["stdout"], out["stderr"])
  assert found["1"] == found["0"]
  assert found["0"][0].startswith("FileIO" if unbuffered else "BufferedWriter")


def test_forked_children_differ_where_processes_do(script, monkeypatch):
  """Consecutive children: different string-hash seeds (two servers in
  turn, as for a 2-worker cluster); each its own numpy seed (the third
  comes from the first one's server)."""
  monkeypatch.setenv("TPU_EMBEDDING_TEST_FORK", "1")
  outputs = [lines(python(script, "0").stdout) for _ in range(3)]
  assert [o["preloaded"] for o in outputs] == ["True"] * 3
  assert outputs[0]["hash"] != outputs[1]["hash"]
  assert len({o["random"] for o in outputs}) == 3


def test_an_environment_the_servers_do_not_share_runs_afresh(
  script, monkeypatch
):
  monkeypatch.setenv("TPU_EMBEDDING_TEST_FORK", "1")
  env = {**processes.server_environment(), "TF_CPP_MIN_LOG_LEVEL": "0"}
  assert lines(python(script, "0", env=env).stdout)["preloaded"] == "False"


@pytest.mark.parametrize("breakage", ["closed", "fd closed under it"])
def test_a_broken_status_connection_stays_in_its_own_test(
  script, monkeypatch, breakage
):
  """A child abandoned by a failed test (left in ``subprocess._active``)
  whose status connection is closed or broken: its status is lost (255),
  and ``subprocess._cleanup``, which every later ``Popen`` runs, does not
  raise, so the failure does not spread to the tests after it."""
  monkeypatch.setenv("TPU_EMBEDDING_TEST_FORK", "1")
  process = processes.Popen(
    [sys.executable, script, "sleep"], stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL, env=processes.server_environment(),
  )  # fmt: skip
  try:
    assert process._status is not None
    if breakage == "closed":
      process._status.close()
    else:
      os.close(process._status.fileno())
    subprocess._active.append(process)
    subprocess._cleanup()
    assert process not in subprocess._active
    assert process.returncode == 255
    assert lines(python(script, "0").stdout)["preloaded"] == "True"
  finally:
    os.kill(process.pid, 9)
    with contextlib.suppress(ValueError):  # failed: keep it from the next
      subprocess._active.remove(process)


PORT_RACE = textwrap.dedent(
  """
  import json, os, sys
  config = json.loads(os.environ["TF_CONFIG"])
  if config["task"]["index"] == 0:  # (only worker 0 loses its port)
    with open(sys.argv[1] + "/0", "a") as f:
      f.write(config["cluster"]["worker"][0] + "\\n")
    if sum(1 for _ in open(sys.argv[1] + "/0")) <= int(sys.argv[2]):
      sys.exit("UnknownError: Could not start gRPC server")
  print("OK")
  """
)


@pytest.mark.parametrize("run", ["run_workers", "run_job"])
def test_a_job_whose_server_lost_its_port_runs_again_on_new_ports(
  run, tmp_path
):
  """``tests/distributed/cluster.py``: a worker whose server could not bind
  the port chosen for it (another process took it) runs the job again, on
  new ports, up to ``PORT_RETRIES`` times; other failures are returned."""
  from tests.distributed import cluster

  script = tmp_path / "race.py"
  script.write_text(PORT_RACE)
  for failures, want in [(2, 0), (cluster.PORT_RETRIES + 1, 1)]:
    runs = tmp_path / f"runs{failures}"
    runs.mkdir()
    finished = getattr(cluster, run)([script, runs, failures], timeout=60)
    assert finished[0].returncode == want, finished
    started = (runs / "0").read_text().split()
    assert len(started) == min(failures + 1, cluster.PORT_RETRIES + 1)
    assert len(set(started)) > 1  # new ports each time
