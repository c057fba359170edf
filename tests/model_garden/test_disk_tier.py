"""The ranking trainer with tables kept on a local disk (``DiskTier``).

``task.model.disk_directory`` keeps the tables of more than
``disk_size_threshold`` rows on disk behind a RAM cache of
``disk_cache_bytes`` each. End to end (``python -m
model_garden.ranking.train``, two runs started together): a run with one
table on disk, its cache smaller than the table, trains, evaluates and
checkpoints, and its checkpoint equals, bit for bit, that of the same run
with every table in memory; so do its delta checkpoints, a run on 2
mirrored replicas (each its block of the table, its files and its
cache) and one on 2 ``multi_worker_mirrored`` workers (each its own
subdirectory, which the preflight checks). Refusals (one line, before
anything is written): parameter servers (a subprocess, as a user sees
it), dynamic vocabularies, a remote directory; the memory refusal names
the disk tier, which makes ``dlrm_criteo`` fit, and counts a cache a
replica.
Failures (one line naming the table and its directory, exit 1, the saves
as they were): a cache too small for a step, a full disk (the
files' writes fail with ENOSPC once the run has saved).
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from model_garden import cli
from model_garden.ranking import configs
from model_garden.ranking import preflight
from model_garden.ranking import saved_model
from model_garden.ranking.configs import params_file
from tests import processes
from tests.model_garden.test_train import command as train_command
from tests.model_garden.test_train import finish
from tests.model_garden.test_train import start
from tpu_embedding.checkpointing import manager

STEPS = 10
MWMS_STEPS = 4  # (2 clusters of 2 workers: the slowest test here)
#: Table 0 (5,000 rows) on disk; the 25 others (100 rows) in memory.
VOCAB_SIZES = [5000] + [100] * 25
DIM = 16  # dlrm_criteo_cpu_small's width
#: Adagrad: parameters and one slot, 160 rows cached (twice a step's
#: distinct ids of table 0 is about 100; the run touches about 300).
CACHE_BYTES = 160 * DIM * 4 * 2
PARAMS = (
  "task.train_data.global_batch_size=64,"
  "task.validation_data.global_batch_size=64,"
  "task.synthetic.num_train_examples=1024,"
  "task.synthetic.num_eval_examples=128,"
  f"task.model.vocab_sizes=[{', '.join(map(str, VOCAB_SIZES))}],"
  "trainer.optimizer_config.embedding_optimizer=Adagrad,"
  f"trainer.train_steps={STEPS},"
  f"trainer.validation_interval={STEPS},"
  "trainer.checkpoint_interval=5,"
  "trainer.export_saved_model=false"
)


def disk_params(directory) -> str:
  return (
    f"{PARAMS},task.model.disk_directory={directory},"
    f"task.model.disk_size_threshold=1000,"
    f"task.model.disk_cache_bytes={CACHE_BYTES}"
  )


def command(model_dir, params, *flags):
  """``test_train.command`` with this file's params, without progress bars."""
  return train_command(model_dir, "--progress_bar=off", *flags, params=params)


def checkpoint_values(directory):
  path = tf.train.latest_checkpoint(str(directory))
  assert path, f"no checkpoint in {directory}"
  return path, {
    name: tf.train.load_variable(path, name)
    for name, _ in tf.train.list_variables(path)
    if not name.startswith("_CHECKPOINTABLE")
  }


def test_a_table_on_disk_trains_to_the_in_memory_checkpoint(
  tmp_path, monkeypatch
):
  """... and exports the in-memory run's SavedModel (the export keeps the
  table on disk too, in a directory of its own, removed afterwards)."""
  disk = tmp_path / "ssd"
  export = ",trainer.export_saved_model=true"
  runs = {
    "disk": start(
      command(
        tmp_path / "disk", disk_params(disk) + export, "--mode=train_and_eval"
      ),
      tmp_path,
    ),
    "memory": start(
      command(tmp_path / "memory", PARAMS + export, "--mode=train_and_eval"),
      tmp_path,
    ),
  }
  results = {}
  for name, process in runs.items():
    rc, stdout, stderr = finish(process)
    results[name] = (rc, stdout + stderr)
  for name, (rc, output) in results.items():
    assert rc == 0, f"{name} failed ({rc}):\n{output[-4000:]}"
  # One table (or stack) kept on disk, as the trainer reports it.
  assert f"0 row-sharded, 1 on disk in {disk})" in results["disk"][1]
  assert " on disk in " not in results["memory"][1]
  assert os.listdir(disk / "embedding_table_00")  # its files
  got_path, got = checkpoint_values(tmp_path / "disk")
  want_path, want = checkpoint_values(tmp_path / "memory")
  assert got_path.endswith(f"ckpt-{STEPS}"), got_path
  assert want_path.endswith(f"ckpt-{STEPS}"), want_path
  assert set(got) == set(want)
  table = "embedding/embedding_table_00/.ATTRIBUTES/VARIABLE_VALUE"
  assert got[table].shape == (VOCAB_SIZES[0], DIM)  # full values
  slots = [k for k in want if "embedding_table_00" in k]
  assert len(slots) == 2, slots  # the table and its Adagrad accumulator
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
  # The same validation, to the last digit.
  auc = [
    line
    for line in results["memory"][1].splitlines()
    if line.startswith("Validation AUC")
  ]
  assert auc and auc[-1] in results["disk"][1]
  # The disk table's hit rate and reads, in the log and the summaries.
  found = re.search(
    r"Disk tables: hit rate embedding_table_00 ([\d.]+)%; ([\d,]+) rows "
    r"read/s \((\d+)% read ahead\), ([\d,]+) written/s.",
    results["disk"][1],
  )
  assert found, results["disk"][1][-3000:]
  assert 0 < float(found[1]) < 100 and int(found[2].replace(",", "")) > 0
  # The trainer reads the missed rows of a batch while the step before
  # runs (data.prefetch_rows): most rows read come from RAM.
  assert int(found[3]) > 0, found[0]
  assert "Disk tables" not in results["memory"][1]
  # The same SavedModel, its table read from the export's own files.
  exported = {
    name: saved_model_values(tmp_path / name / "saved_model" / str(STEPS))
    for name in ("disk", "memory")
  }
  assert sorted(exported["disk"]) == sorted(exported["memory"])
  for key, value in exported["memory"].items():
    np.testing.assert_array_equal(exported["disk"][key], value, err_msg=key)
  assert sorted(os.listdir(disk)) == ["embedding_table_00"]  # (removed)
  # The export's serving tables: the disk table on disk, in its own files.
  made = []

  class Spy(tpe.TPUEmbeddingForServing):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      made.append((kwargs["disk"], self))

  monkeypatch.setattr(tpe, "TPUEmbeddingForServing", Spy)
  config = params_file.read_params(str(tmp_path / "disk"))
  saved_model.export_from_checkpoint(
    config, str(tmp_path / "disk"), str(tmp_path / "again")
  )
  ((tier, serving),) = made
  assert tier.tables == ("embedding_table_00",)
  assert os.path.dirname(tier.directory) == str(disk)
  assert serving.table_stores["embedding_table_00"].cache_counts()
  assert not os.path.exists(tier.directory)  # removed after the export
  again = saved_model_values(tmp_path / "again")
  for key, value in exported["memory"].items():
    np.testing.assert_array_equal(again[key], value, err_msg=key)
  scalars = train_scalars(tmp_path / "disk")
  rate = scalars["disk/embedding_table_00/hit_rate"]
  assert rate and all(0 < r < 1 for r in rate), rate
  assert all(
    r > 0 for r in scalars["disk/embedding_table_00/rows_read_per_second"]
  )
  ahead = scalars["disk/embedding_table_00/read_ahead_rate"]
  assert ahead and all(0 <= r <= 1 for r in ahead) and max(ahead) > 0, ahead
  assert not any(
    k.startswith("disk/") for k in train_scalars(tmp_path / "memory")
  )


def run_disk_and_memory(tmp_path, disk, params, flags) -> str:
  """Runs the trainer twice at once, table 0 on ``disk`` and in memory
  (``PARAMS`` and ``params``, ``flags``); returns the disk run's output."""
  runs = {
    "disk": start(
      command(tmp_path / "disk", disk_params(disk) + params, *flags), tmp_path
    ),
    "memory": start(
      command(tmp_path / "memory", PARAMS + params, *flags), tmp_path
    ),
  }
  results = {name: finish(process) for name, process in runs.items()}
  for name, (rc, stdout, stderr) in results.items():
    assert rc == 0, f"{name} failed ({rc}):\n{(stdout + stderr)[-4000:]}"
  return "".join(results["disk"][1:])


def assert_same_checkpoints(tmp_path, steps):
  """The ``disk`` run's last checkpoint (of step ``steps``) holds the
  ``memory`` run's keys and values, table 0 as its full value."""
  got_path, got = checkpoint_values(tmp_path / "disk")
  want_path, want = checkpoint_values(tmp_path / "memory")
  assert got_path.endswith(f"ckpt-{steps}"), got_path
  assert want_path.endswith(f"ckpt-{steps}"), want_path
  assert set(got) == set(want)
  key = "embedding/embedding_table_00/.ATTRIBUTES/VARIABLE_VALUE"
  assert got[key].shape == (VOCAB_SIZES[0], DIM)  # full values
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


def saved_model_values(path) -> dict[str, np.ndarray]:
  """Every variable of a SavedModel, by checkpoint key."""
  reader = tf.train.load_checkpoint(str(path / "variables" / "variables"))
  return {
    key: reader.get_tensor(key)
    for key in reader.get_variable_to_shape_map()
    if key != "_CHECKPOINTABLE_OBJECT_GRAPH"
  }


def train_scalars(model_dir) -> dict[str, list[float]]:
  """``{tag: values in step order}`` of a run's training summaries."""
  scalars: dict[str, list[float]] = {}
  for path in sorted((model_dir / "train").glob("events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(str(path)):
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append(
          float(tf.make_ndarray(value.tensor))
        )
  return scalars


def test_two_mirrored_replicas_train_to_the_in_memory_checkpoint(tmp_path):
  """Table 0 row-sharded in both runs (``size_threshold``): its 2 blocks
  on disk, ``directory/<table>/block<r>``, each behind its own cache."""
  disk = tmp_path / "ssd"
  flags = ("--mode=train", "--strategy=mirrored", "--num_replicas=2")
  sharded = ",task.model.size_threshold=1000"
  output = run_disk_and_memory(tmp_path, disk, sharded, flags)
  assert f"1 row-sharded, 1 on disk in {disk})" in output, output[-4000:]
  assert "MirroredStrategy with 2 replica(s)" in output
  table = disk / "embedding_table_00"
  assert sorted(os.listdir(table)) == ["block0", "block1"]
  assert_same_checkpoints(tmp_path, STEPS)


def test_two_workers_train_to_the_in_memory_checkpoint(tmp_path):
  """``multi_worker_mirrored``, 2 local workers (``--num_workers``): each
  keeps its block of table 0 in its own subdirectory
  (``directory/worker<i>/<table>/block<i>``, ``embedding.disk_directory``);
  the checkpoint equals, bit for bit, the same cluster's in memory (the
  library's tests/tables/test_tiered_sharded.py: and a one-device run's)."""
  disk = tmp_path / "ssd"
  flags = (
    "--mode=train",
    "--strategy=multi_worker_mirrored",
    "--num_workers=2",
    "--max_restarts=0",
  )
  few = f",task.model.size_threshold=1000,trainer.train_steps={MWMS_STEPS}"
  output = run_disk_and_memory(tmp_path, disk, few, flags)
  assert f"1 row-sharded, 1 on disk in {disk / 'worker0'})" in output, output[
    -4000:
  ]
  assert "CollectiveAllReduceStrategy with 2 replica(s)" in output
  blocks = sorted(str(p.relative_to(disk)) for p in disk.glob("*/*/block*"))
  assert blocks == [
    "worker0/embedding_table_00/block0",
    "worker1/embedding_table_00/block1",
  ]
  assert_same_checkpoints(tmp_path, MWMS_STEPS)


#: Holds ``argv[1]``'s lock (a table's directory) until its stdin closes.
HOLDER = (
  "import sys; from tpu_embedding import run_lock; "
  "lock = run_lock.RunLock(sys.argv[1]).acquire(); "
  "print('held', flush=True); sys.stdin.read()"
)


def test_each_worker_checks_its_own_directory(tmp_path, monkeypatch):
  """The preflight checks this task's subdirectory (``TF_CONFIG``), or
  every worker's for the launcher (``--num_workers``): another process
  holding worker 1's table is refused there, and only there."""
  config = small(
    **{
      "task.model.disk_directory": str(tmp_path),
      "runtime.distribution_strategy": "multi_worker_mirrored",
    }
  )
  table = tmp_path / "worker1" / "embedding_table_00"
  holder = processes.Popen(
    [sys.executable, "-c", HOLDER, str(table)],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline() == "held\n"
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    for index, refused in ((0, False), (1, True)):
      task = {"cluster": cluster, "task": {"type": "worker", "index": index}}
      monkeypatch.setenv("TF_CONFIG", json.dumps(task))
      if refused:
        with pytest.raises(cli.FixableError, match=f"^{table} is in use"):
          preflight.check_disk_directory(config)
      else:
        preflight.check_disk_directory(config)
    monkeypatch.delenv("TF_CONFIG")
    with pytest.raises(cli.FixableError, match=f"^{table} is in use"):
      preflight.check_disk_directory(config, workers=2)
    preflight.check_disk_directory(config, workers=1)
    mirrored = configs.override(
      config, {"runtime.distribution_strategy": "mirrored"}
    )
    preflight.check_disk_directory(mirrored)  # tmp_path/embedding_table_00
  finally:
    holder.stdin.close()
    holder.wait(timeout=60)


def test_parameter_servers_are_refused_in_one_line_before_any_write(tmp_path):
  model_dir, disk = tmp_path / "run", tmp_path / "ssd"
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("TF_CPP_MIN_LOG_LEVEL", "TPE_DEBUG")
  }
  process = processes.run(
    command(model_dir, disk_params(disk), "--strategy=parameter_server"),
    capture_output=True,
    text=True,
    cwd=str(tmp_path),
    env=env,
    timeout=120,
    check=False,
  )
  assert process.returncode == 2, process.stderr
  assert "Traceback" not in process.stderr, process.stderr
  line = process.stderr.strip().splitlines()[-1]
  assert (
    "task.model.disk_directory keeps 1 table(s) on disk (more rows than "
    "disk_size_threshold=1000), which train on one device or row-sharded "
    "over mirrored replicas (--strategy default, one_device, mirrored or "
    "multi_worker_mirrored), not parameter_server: use one of those, or "
    "remove task.model.disk_directory"
  ) in line, line
  assert not model_dir.exists() and not disk.exists()


def small(**changes):
  config = configs.get_config("dlrm_criteo_cpu_small")
  keys = {
    "task.model.disk_directory": "/ssd/tables",
    "task.model.disk_size_threshold": 30_000,
  }
  return configs.override(config, {**keys, **changes})


@pytest.mark.parametrize(
  "changes, expected",
  [
    (
      {"task.model.vocabulary": "dynamic"},
      "and task.model.vocabulary='dynamic': tables with a dynamic "
      "vocabulary are not kept on disk",
    ),
    (
      {"task.model.disk_directory": "gs://bucket/tables"},
      "task.model.disk_directory='gs://bucket/tables' is not local",
    ),
    ({"task.model.disk_cache_bytes": 0}, "disk_cache_bytes positive"),
    (
      {"runtime.distribution_strategy": "parameter_server"},
      "which train on one device or row-sharded over mirrored replicas",
    ),
  ],
)
def test_what_tables_on_disk_do_not_run_with_is_refused(changes, expected):
  with pytest.raises(ValueError) as raised:
    configs.validate(small(**changes))
  assert expected in str(raised.value)
  assert "\n" not in str(raised.value)


def test_disk_fields_keep_in_memory_runs_as_they_were():
  # No directory, or no table above the threshold: nothing on disk, so
  # the combinations refused above are accepted.
  assert configs.validate(small(**{"trainer.checkpoint_delta_interval": 2}))
  for config in (
    configs.override(
      configs.get_config("dlrm_criteo_cpu_small"),
      {"runtime.distribution_strategy": "parameter_server"},
    ),
    small(
      **{
        "task.model.disk_size_threshold": 10**9,
        "runtime.distribution_strategy": "parameter_server",
      }
    ),
  ):
    assert configs.validate(config).task.model.disk_tables() == ()
  # Where the tables live does not shape the checkpoint: a run resumes
  # (or evaluates) with another disk tier.
  assert preflight.differing_keys(small(), {"task": {"model": {}}}) == []
  saved = {
    "task": {
      "model": {
        "disk_directory": "",
        "disk_size_threshold": 1,
        "disk_cache_bytes": 1,
      }
    }
  }
  assert preflight.differing_keys(small(), saved) == []


def test_the_memory_refusal_names_the_disk_tier_which_makes_it_fit():
  config = configs.get_config("dlrm_criteo")
  available = 16 * 2**30
  with pytest.raises(cli.FixableError) as raised:
    preflight.check_memory(config, "dlrm_criteo", available=available)
  message = str(raised.value)
  assert "\n" not in message
  assert message.endswith(
    "or keep the largest tables on a local disk behind a RAM cache "
    "(task.model.disk_directory, disk_size_threshold, disk_cache_bytes; "
    "one device, mirrored or multi_worker_mirrored)."
  )
  on_disk = configs.override(
    config, {"task.model.disk_directory": "/ssd/tables"}
  )
  estimate = preflight.check_memory(on_disk, "dlrm_criteo", available=available)
  # The six tables of more than 1,000,000 rows: each a 256 MiB cache and
  # 4 bytes a row.
  model = on_disk.task.model
  big = [rows for rows in model.vocab_sizes if rows > 1_000_000]
  assert len(model.disk_tables()) == len(big) == 6
  assert estimate.disk == 6 * 256 * 2**20 + 4 * sum(big)
  assert estimate.total < available
  # Too small a machine even so: the message counts the caches.
  with pytest.raises(cli.FixableError) as raised:
    preflight.check_memory(on_disk, "dlrm_criteo", available=2**30)
  caches = f"the caches of the 6 table(s) on disk {estimate.disk / 2**30:.1f}"
  assert caches in str(raised.value)
  # Mirrored over 4 replicas: each table is 4 blocks, a cache each.
  four = preflight.check_memory(
    on_disk, "dlrm_criteo", replicas=4, available=available
  )
  assert four.disk == 4 * 6 * 256 * 2**20 + 4 * sum(big)
  assert four.tables == estimate.tables


#: Saves every 2 steps: a full one, then 2 deltas (10 steps: ckpt-2,
#: delta-4, delta-6, ckpt-8, delta-10).
DELTAS = "trainer.checkpoint_interval=2,trainer.checkpoint_delta_interval=2"

#: ``-c`` code: the trainer, whose disk tier's writes (``os.pwritev``)
#: fail with ENOSPC once ``argv[1]`` exists (its first committed save).
FULL_DISK = f"""
import errno, os, runpy, sys
state, sys.argv = sys.argv[1], ["train", *sys.argv[2:]]
write = os.pwritev
def pwritev(*args):
  if os.path.exists(state):
    raise OSError({errno.ENOSPC}, os.strerror({errno.ENOSPC}))
  return write(*args)
os.pwritev = pwritev
runpy.run_module("model_garden.ranking.train", run_name="__main__")
"""


def saves(directory):
  """``{name: {key: value}}`` of the chain ``directory`` resumes from."""
  base, deltas = manager.latest_with_deltas(str(directory))
  assert base, f"no checkpoint in {directory}"
  out = {}
  for path in (base, *deltas):
    reader = tf.train.load_checkpoint(path)
    out[os.path.basename(path)] = {
      key: reader.get_tensor(key)
      for key in reader.get_variable_to_shape_map()
      if not key.startswith("_CHECKPOINTABLE")
    }
  return out


def saved_files(directory):
  """``{file: mtime}`` of the saves in ``directory`` (not the params and
  summaries every start writes)."""
  return {
    name: os.stat(directory / name).st_mtime_ns
    for name in os.listdir(directory)
    if name != "params.yaml" and (directory / name).is_file()
  }


def user_run(args, cwd):
  """``args`` as a user starts them: TensorFlow's log level not set."""
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  return processes.run(
    args, capture_output=True, text=True, cwd=str(cwd), env=env,
    timeout=300, check=False,
  )  # fmt: skip


def assert_one_line(process, *parts):
  assert process.returncode == 1, process.stderr[-4000:]
  assert "Traceback" not in process.stderr, process.stderr[-4000:]
  line = process.stderr.strip().splitlines()[-1]
  for part in parts:
    assert part in line, line
  return line


def test_deltas_of_a_table_on_disk_and_its_failures(tmp_path):
  """The disk run's chain of saves equals the in-memory run's, bit for
  bit; a resume with a cache too small stops at its first step in one
  line, its saves as they were; a full disk stops a run in one
  line, its last save intact (equal to the other runs' save)."""
  disk = tmp_path / "ssd"
  runs = {
    "disk": start(
      command(
        tmp_path / "disk", f"{disk_params(disk)},{DELTAS}", "--mode=train"
      ),
      tmp_path,
    ),
    "memory": start(
      command(tmp_path / "memory", f"{PARAMS},{DELTAS}", "--mode=train"),
      tmp_path,
    ),
    "full": start(
      [
        sys.executable,
        "-c",
        FULL_DISK,
        str(tmp_path / "full" / "checkpoint"),
        *command(
          tmp_path / "full",
          f"{disk_params(tmp_path / 'ssd2')},{DELTAS}",
          "--mode=train",
        )[3:],
      ],
      tmp_path,
    ),  # fmt: skip
  }
  results = {name: finish(process) for name, process in runs.items()}
  for name in ("disk", "memory"):
    rc, stdout, stderr = results[name]
    assert rc == 0, f"{name} failed ({rc}):\n{(stdout + stderr)[-4000:]}"
  got, want = saves(tmp_path / "disk"), saves(tmp_path / "memory")
  assert list(got) == list(want) == ["ckpt-8", "delta-10"]
  for name, tensors in want.items():
    assert sorted(got[name]) == sorted(tensors)
    for key, value in tensors.items():
      if key != "_DELTA/meta":
        np.testing.assert_array_equal(got[name][key], value, err_msg=key)
  meta = json.loads(got["delta-10"]["_DELTA/meta"])
  assert 0 < meta["rows"] < VOCAB_SIZES[0]
  # A full disk: one line naming the table and its directory, exit 1.
  rc, stdout, stderr = results["full"]
  assert rc == 1, (stdout + stderr)[-4000:]
  assert "Traceback" not in stderr, stderr[-4000:]
  line = stderr.strip().splitlines()[-1]
  assert (
    f"Table 'embedding_table_00': the disk of its DiskTier directory "
    f"{tmp_path / 'ssd2'} is full"
  ) in line, line
  # ... its last committed save whole (every value reads back).
  kept = saves(tmp_path / "full")
  assert list(kept) == ["ckpt-2"]
  assert sorted(kept["ckpt-2"]) == sorted(got["ckpt-8"])
  # A cache too small: the resume (its chain restored into the disk
  # table) stops at its first step; the saves as they were.
  before = saved_files(tmp_path / "disk")
  params = disk_params(disk).replace(
    f"disk_cache_bytes={CACHE_BYTES}", f"disk_cache_bytes={8 * DIM * 4 * 2}"
  )
  process = user_run(
    command(
      tmp_path / "disk",
      f"{params},{DELTAS},trainer.train_steps={STEPS + 4}",
      "--mode=train",
    ),
    tmp_path,
  )
  assert_one_line(
    process,
    f"Table 'embedding_table_00' (DiskTier directory {disk}): a step asks",
    "task.model.disk_cache_bytes",
  )
  assert saved_files(tmp_path / "disk") == before
  assert saves(tmp_path / "disk").keys() == got.keys()


#: ``-c`` code: the trainer, in which a disk table assigned a whole value
#: (TensorFlow's restore, which reads it whole) fails.
STREAMED_ONLY = """
import runpy, sys
from tpu_embedding.tables import tiered
def assign(*args, **kwargs):
  raise AssertionError("a disk table was assigned a whole value")
tiered.TieredTable.assign = assign
sys.argv = ["train", *sys.argv[1:]]
runpy.run_module("model_garden.ranking.train", run_name="__main__")
"""


def streamed_only(args):
  """``command(...)`` run with ``STREAMED_ONLY``."""
  return [sys.executable, "-c", STREAMED_ONLY, *args[3:]]


def test_resumed_and_initialized_disk_runs_equal_the_uninterrupted_one(
  tmp_path,
):
  """A disk run stopped at step 5, then resumed from its directory, and a
  run started from its step-5 save (``task.init_checkpoint``): both
  restores stream into the disk table (none assigns it a whole value),
  and both runs save the uninterrupted in-memory run's step 10, bit for
  bit."""
  half = f"trainer.train_steps={STEPS // 2},"
  assert f"trainer.train_steps={STEPS}," in PARAMS
  first = start(
    command(
      tmp_path / "resumed",
      disk_params(tmp_path / "ssd1").replace(
        f"trainer.train_steps={STEPS},", half
      ),
      "--mode=train",
    ),
    tmp_path,
  )
  memory = start(command(tmp_path / "memory", PARAMS, "--mode=train"), tmp_path)
  rc, stdout, stderr = finish(first)
  assert rc == 0, (stdout + stderr)[-4000:]
  saved = tmp_path / "resumed" / f"ckpt-{STEPS // 2}"
  runs = {
    "resumed": start(
      streamed_only(
        command(
          tmp_path / "resumed", disk_params(tmp_path / "ssd1"), "--mode=train"
        )
      ),
      tmp_path,
    ),
    "initialized": start(
      streamed_only(
        command(
          tmp_path / "initialized",
          f"{disk_params(tmp_path / 'ssd2')},task.init_checkpoint={saved}",
          "--mode=train",
        )
      ),
      tmp_path,
    ),
    "memory": memory,
  }
  results = {name: finish(process) for name, process in runs.items()}
  for name, (rc, stdout, stderr) in results.items():
    assert rc == 0, f"{name} failed ({rc}):\n{(stdout + stderr)[-4000:]}"
  assert f"Restored {saved} (step 5)" in results["resumed"][1]
  assert f"Initialized from {saved} (step 5)" in results["initialized"][1]
  want_path, want = checkpoint_values(tmp_path / "memory")
  assert want_path.endswith(f"ckpt-{STEPS}"), want_path
  for name in ("resumed", "initialized"):
    got_path, got = checkpoint_values(tmp_path / name)
    assert got_path.endswith(f"ckpt-{STEPS}"), (name, got_path)
    assert set(got) == set(want), name
    for key, value in want.items():
      np.testing.assert_array_equal(got[key], value, err_msg=f"{name} {key}")
