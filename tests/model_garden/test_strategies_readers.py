"""Every strategy trains with every reader; a waiting worker says so.

``python -m model_garden.ranking.train`` on tiny data (batches of 16, 4
steps, validating after step 2), each strategy started as a user would:

==========================  ===========================================
``default``                 no flag
``mirrored``                ``--num_replicas 2`` (logical CPU devices)
``multi_worker_mirrored``   ``--num_workers 2`` (a local cluster of
                            processes)
``parameter_server``        ``--ps_local_cluster 2,1`` (in-process)
==========================  ===========================================

with each reader: synthetic data, Criteo TSV files, and the same files as
TFRecords (``tools/criteo_to_tfrecord.py``). The preflight counts a
split's records before the strategy exists; reading TFRecords with
``tf.data`` there started TensorFlow's runtime, so ``mirrored`` could no
longer split the CPU (issue 49: "Cannot split the CPU into 2 logical
devices"). The runs are started together, in two waves (memory).

A ``multi_worker_mirrored`` worker whose peer never starts says which
task it waits for, at which address, and gives up after
``--cluster_timeout`` in one line, exit code 1 (a real process); the
notes repeat (``wait_for_cluster``, in this process).
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from model_garden.ranking import strategies
from tests import processes
from tests.model_garden.test_train import command
from tests.scripts import run_tool

BATCH = 16
STEPS = 4
PARAMS = (
  f"task.train_data.global_batch_size={BATCH},"
  f"task.validation_data.global_batch_size={BATCH},"
  "task.synthetic.num_train_examples=64,"
  "task.synthetic.num_eval_examples=32,"
  f"trainer.train_steps={STEPS},"
  "trainer.validation_interval=2,"
  "trainer.validation_steps=2,"
  "trainer.checkpoint_interval=2,"
  "trainer.summary_interval=1,"
  "trainer.time_history.log_steps=1,"
  "trainer.export_saved_model=false"
)
STRATEGIES = {
  "default": [],
  "mirrored": ["--strategy=mirrored", "--num_replicas=2"],
  "multi_worker_mirrored": [
    "--strategy=multi_worker_mirrored",
    "--num_workers=2",
    "--max_restarts=0",
  ],
  "parameter_server": ["--strategy=parameter_server", "--ps_local_cluster=2,1"],
}
STRATEGY_CLASSES = {
  "default": "_DefaultDistributionStrategy with 1 replica",
  "mirrored": "MirroredStrategy with 2 replica",
  "multi_worker_mirrored": "CollectiveAllReduceStrategy with 2 replica",
  "parameter_server": "ParameterServerStrategy",
}
READERS = ("synthetic", "tsv", "tfrecord")


def _tsv_lines(count: int, rng: random.Random) -> list[str]:
  return [
    "\t".join(
      [str(rng.randint(0, 1))]
      + [str(rng.randint(0, 50)) for _ in range(13)]
      + [f"{rng.getrandbits(32):08x}" for _ in range(26)]
    )
    for _ in range(count)
  ]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  """``{reader: params}``: two training files and a validation file, as
  TSV and converted to TFRecords."""
  root = tmp_path_factory.mktemp("data")
  rng = random.Random(7)
  (root / "tsv").mkdir()
  for name, count in (("train_0", 48), ("train_1", 48), ("valid", 32)):
    (root / "tsv" / f"{name}.tsv").write_text(
      "".join(line + "\n" for line in _tsv_lines(count, rng))
    )
  for split, pattern in (("train", "train_*.tsv"), ("valid", "valid.tsv")):
    run_tool(
      "criteo_to_tfrecord.py",
      f"--input={root / 'tsv' / pattern}",
      f"--output_dir={root / 'tfrecord' / split}",
      "--experiment=dlrm_criteo_cpu_small",
      "--num_shards=2" if split == "train" else "--num_shards=1",
    )
  tfrecord = root / "tfrecord"
  return {
    "synthetic": "task.use_synthetic_data=true",
    "tsv": "task.use_synthetic_data=false,task.data_format=tsv,"
    f"task.train_data.input_path={root / 'tsv' / 'train_*.tsv'},"
    f"task.validation_data.input_path={root / 'tsv' / 'valid.tsv'}",
    "tfrecord": "task.use_synthetic_data=false,task.use_tf_record_reader=true,"
    f"task.train_data.input_path={tfrecord / 'train' / '*.tfrecord'},"
    f"task.validation_data.input_path={tfrecord / 'valid' / '*.tfrecord'}",
  }


def _command(model_dir, strategy, reader_params):
  return command(
    model_dir,
    "--mode=train_and_eval",
    "--progress_bar=off",
    *STRATEGIES[strategy],
    params=f"{PARAMS},{reader_params}",
  )


def _env():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("TF_CONFIG", None)
  return env


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
  """``{(strategy, reader): (returncode, output, model_dir)}``, started in
  two waves of six."""
  root = tmp_path_factory.mktemp("runs")
  cases = [(s, r) for s in STRATEGIES for r in READERS]
  results = {}
  for wave in (cases[:6], cases[6:]):
    started = {}
    for strategy, reader in wave:
      model_dir = root / f"{strategy}-{reader}"
      started[strategy, reader] = (
        processes.Popen(
          _command(model_dir, strategy, data[reader]),
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
          env=_env(),
          cwd=str(root),
        ),
        model_dir,
      )
    for case, (process, model_dir) in started.items():
      try:
        output, _ = process.communicate(timeout=400)
      finally:
        process.kill()
      results[case] = (process.returncode, output, model_dir)
  return results


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_strategy_trains_with_every_reader(runs, strategy, reader):
  code, output, model_dir = runs[strategy, reader]
  assert code == 0, output[-6000:]
  assert "Traceback" not in output, output[-6000:]
  assert STRATEGY_CLASSES[strategy] in output, output[-3000:]
  assert f"{reader} data, {STEPS} steps" in output, output[-3000:]
  # The progress line counts to the steps asked, and says where the
  # validation stops it (not "step 1/2").
  assert re.search(rf"step +1/{STEPS} \(validation at 2\)  loss", output), (
    output[-3000:]
  )
  assert re.search(rf"step +{STEPS}/{STEPS}  loss", output), output[-3000:]
  assert "Validation AUC" in output, output[-3000:]
  assert (model_dir / f"ckpt-{STEPS}.index").exists(), sorted(
    p.name for p in model_dir.iterdir()
  )


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_a_worker_without_its_peer_says_so_and_gives_up(tmp_path):
  ports = [_free_port(), _free_port()]
  cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
  env = dict(
    _env(),
    TF_CONFIG=json.dumps(
      {"cluster": cluster, "task": {"type": "worker", "index": 0}}
    ),
  )
  args = [
    sys.executable,
    "-m",
    "model_garden.ranking.train",
    "--experiment=dlrm_criteo_cpu_small",
    f"--model_dir={tmp_path / 'run'}",
    f"--params_override={PARAMS}",
    "--mode=train",
    "--strategy=multi_worker_mirrored",
    "--cluster_timeout=8",
  ]
  started = time.monotonic()
  done = processes.run(
    args,
    capture_output=True,
    text=True,
    env=env,
    cwd=str(tmp_path),
    timeout=120,
  )
  elapsed = time.monotonic() - started
  peer = f"worker 1 at 127.0.0.1:{ports[1]}"
  assert done.returncode == 1, done.stdout + done.stderr
  # Said once it waits, for which task, at which address...
  notes = re.findall(
    r"^multi_worker_mirrored: waiting for TF_CONFIG's cluster \(\d+s\): "
    r"for (.*); giving up after 8s \(--cluster_timeout\)\.$",
    done.stdout,
    re.M,
  )
  assert notes == [f"{peer} (not answering yet)"], done.stdout + done.stderr
  # ... then gave up in one line, without a traceback.
  assert done.stderr.strip().splitlines()[-1] == (
    f"multi_worker_mirrored: {peer} did not start within 8s "
    "(--cluster_timeout): start every task of TF_CONFIG's cluster (or check "
    "its addresses), or raise --cluster_timeout."
  ), done.stderr
  assert "Traceback" not in done.stderr, done.stderr
  assert elapsed < 90, elapsed


def test_the_wait_repeats_its_note_holds_its_port_and_gives_up():
  closed = f"127.0.0.1:{_free_port()}"
  own = _free_port()
  out, seen = io.StringIO(), {}

  def probe_own_port():
    time.sleep(0.3)
    with socket.socket() as s:
      seen["own port answered"] = s.connect_ex(("127.0.0.1", own)) == 0

  prober = threading.Thread(target=probe_own_port)
  prober.start()
  with pytest.raises(strategies.ClusterTimeoutError) as raised:
    strategies.wait_for_cluster(
      [("worker 1", closed)],
      1.2,
      address=f"127.0.0.1:{own}",
      note_after=0.1,
      note_every=0.3,
      poll=0.05,
      stream=out,
    )
  prober.join()
  # While waiting, this task's own port answers (its peers see it).
  assert seen == {"own port answered": True}
  notes = out.getvalue().splitlines()
  assert len(notes) >= 3, notes
  for note in notes:
    assert re.fullmatch(
      r"multi_worker_mirrored: waiting for TF_CONFIG's cluster \(\d+s\): "
      rf"for worker 1 at {closed} \(not answering yet\); giving up after 1s "
      r"\(--cluster_timeout\)\.",
      note,
    ), note
  assert str(raised.value) == (
    f"multi_worker_mirrored: worker 1 at {closed} did not start within 1s "
    "(--cluster_timeout): start every task of TF_CONFIG's cluster (or check "
    "its addresses), or raise --cluster_timeout."
  )
  # ... and is released: TensorFlow's server takes it next.
  with socket.socket() as s:
    s.bind(("127.0.0.1", own))
  # A peer that answers: no wait, no note.
  with socket.socket() as listening:
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    out = io.StringIO()
    peer = ("chief 0", f"127.0.0.1:{listening.getsockname()[1]}")
    strategies.wait_for_cluster([peer], 0, note_after=0, stream=out)
    assert out.getvalue() == ""
