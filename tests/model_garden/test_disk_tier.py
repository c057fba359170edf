"""The ranking trainer with tables kept on a local disk (``DiskTier``).

``task.model.disk_directory`` keeps the tables of more than
``disk_size_threshold`` rows on disk behind a RAM cache of
``disk_cache_bytes`` each. End to end (``python -m
model_garden.ranking.train``, two runs started together): a run with one
table on disk, its cache smaller than the table, trains, evaluates and
checkpoints, and its checkpoint equals, bit for bit, that of the same run
with every table in memory. Refusals (one line, before anything is
written): other strategies than one device (a subprocess, as a user sees
it), dynamic vocabularies, delta checkpoints, a remote directory; the
memory refusal names the disk tier, which makes ``dlrm_criteo`` fit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

from model_garden import cli
from model_garden.ranking import configs
from model_garden.ranking import preflight
from tests import processes
from tests.model_garden.test_train import command as train_command
from tests.model_garden.test_train import finish
from tests.model_garden.test_train import start

STEPS = 10
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


def test_a_table_on_disk_trains_to_the_in_memory_checkpoint(tmp_path):
  disk = tmp_path / "ssd"
  runs = {
    "disk": start(
      command(tmp_path / "disk", disk_params(disk), "--mode=train_and_eval"),
      tmp_path,
    ),
    "memory": start(
      command(tmp_path / "memory", PARAMS, "--mode=train_and_eval"), tmp_path
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


def test_other_strategies_are_refused_in_one_line_before_any_write(tmp_path):
  model_dir, disk = tmp_path / "run", tmp_path / "ssd"
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("TF_CPP_MIN_LOG_LEVEL", "TPE_DEBUG")
  }
  process = processes.run(
    command(model_dir, disk_params(disk), "--strategy=mirrored"),
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
    "disk_size_threshold=1000), which train on one device only (--strategy "
    "default or one_device), not mirrored: use one of those, or remove "
    "task.model.disk_directory"
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
      {"trainer.checkpoint_delta_interval": 2},
      "and trainer.checkpoint_delta_interval=2: delta checkpoints do not "
      "cover tables kept on disk; set it to 0",
    ),
    (
      {"task.model.disk_directory": "gs://bucket/tables"},
      "task.model.disk_directory='gs://bucket/tables' is not local",
    ),
    ({"task.model.disk_cache_bytes": 0}, "disk_cache_bytes positive"),
    (
      {"runtime.distribution_strategy": "parameter_server"},
      "which train on one device only",
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
  for config in (
    configs.override(
      configs.get_config("dlrm_criteo_cpu_small"),
      {"runtime.distribution_strategy": "mirrored"},
    ),
    small(
      **{
        "task.model.disk_size_threshold": 10**9,
        "runtime.distribution_strategy": "mirrored",
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
    "one device)."
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
