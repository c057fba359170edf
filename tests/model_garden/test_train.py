"""``python -m model_garden.ranking.train`` end to end, in subprocesses.

Small runs of ``dlrm_criteo_cpu_small`` on synthetic data (batch 512,
40 steps, tiny synthetic sets), started together to share the two cores:

* ``full``: default strategy, ``train_and_eval`` and the SavedModel
  export: the validation AUC beats chance by a margin, and the SavedModel
  loads and predicts with TensorFlow alone;
* ``killed`` then ``resumed``: the same training SIGKILLed after step 25
  (the last checkpoint is at step 20), then started again: it resumes and
  ends with ``full``'s tables, dense weights and optimizer state, exactly;
* ``mirrored``: the same training on 2 replicas with row-sharded tables:
  the same state as one device;
* ``parameter_server``: an in-process cluster (2 workers, 2 PS tasks), big
  tables split over the PS tasks, steps scheduled on both workers at once
  (evaluating every 20 steps): it learns, its metrics count every example
  of the concurrent steps, and its checkpoint restores on one device.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from model_garden.ranking import configs
from model_garden.ranking import saved_model
from model_garden.ranking.task import RankingTask
from tests import processes

STEPS = 40
PARAMS = (
  "task.train_data.global_batch_size=512,"
  "task.validation_data.global_batch_size=512,"
  "task.synthetic.num_train_examples=16384,"
  "task.synthetic.num_eval_examples=4096,"
  f"trainer.train_steps={STEPS},"
  "trainer.checkpoint_interval=20,"
  "trainer.optimizer_config.lr_config.learning_rate=20,"
  "trainer.optimizer_config.lr_config.warmup_steps=5"
)
NO_EXPORT = PARAMS + ",trainer.export_saved_model=false"


def command(model_dir, *flags, params=NO_EXPORT):
  return [
    sys.executable,
    "-m",
    "model_garden.ranking.train",
    "--experiment=dlrm_criteo_cpu_small",
    f"--model_dir={model_dir}",
    f"--params_override={params}",
    "--seed=3",
    *flags,
  ]


def start(args, cwd):
  """Starts ``args`` in directory ``cwd``.

  ``python -m`` puts its working directory first on ``sys.path``: not the
  checkout's root, so that the installed ``model_garden`` is the one run.
  """
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  return processes.Popen(
    args,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=env,
    cwd=str(cwd),
  )


def finish(process, timeout=240):
  try:
    stdout, stderr = process.communicate(timeout=timeout)
  finally:
    process.kill()
  return process.returncode, stdout, stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Starts the runs together; returns their directories and results."""
  root = tmp_path_factory.mktemp("train")
  names = ("full", "resumed", "mirrored", "parameter_server")
  dirs = {name: root / name for name in names}
  killed = start(
    command(dirs["resumed"], "--mode=train", "--kill_at_step=25"), root
  )
  others = {
    "full": start(
      command(dirs["full"], "--mode=train_and_eval", params=PARAMS), root
    ),
    "mirrored": start(
      command(
        dirs["mirrored"],
        "--mode=train",
        "--strategy=mirrored",
        "--num_replicas=2",
      ),
      root,
    ),
    "parameter_server": start(
      command(
        dirs["parameter_server"],
        "--mode=train_and_eval",
        "--strategy=parameter_server",
        "--ps_local_cluster=2,2",
        params=NO_EXPORT
        + ",trainer.validation_steps=8,trainer.validation_interval=20",
      ),
      root,
    ),
  }
  results = {"killed": finish(killed)}
  resumed = start(command(dirs["resumed"], "--mode=train"), root)
  results.update({name: finish(p) for name, p in others.items()})
  results["resumed"] = finish(resumed)
  return {"dirs": dirs, "results": results}


def checkpoint_values(directory):
  path = tf.train.latest_checkpoint(str(directory))
  assert path, f"no checkpoint in {directory}"
  return path, {
    name: tf.train.load_variable(path, name)
    for name, _ in tf.train.list_variables(path)
    if not name.startswith("_CHECKPOINTABLE")
  }


def assert_same_state(got_dir, want_dir, atol):
  got_path, got = checkpoint_values(got_dir)
  want_path, want = checkpoint_values(want_dir)
  assert got_path.endswith(f"ckpt-{STEPS}"), got_path
  assert want_path.endswith(f"ckpt-{STEPS}"), want_path
  assert set(got) == set(want)
  tables = [k for k in want if k.startswith("embedding/embedding_table_")]
  assert len(tables) == 26  # whole tables (SGD has no slot)
  assert "step/.ATTRIBUTES/VARIABLE_VALUE" in want
  for name, value in want.items():
    np.testing.assert_allclose(
      np.asarray(got[name], np.float64),
      np.asarray(value, np.float64),
      atol=atol,
      err_msg=name,
    )


def check_ok(results, name):
  rc, stdout, stderr = results[name]
  assert rc == 0, f"{name} failed ({rc}):\n{stdout[-2000:]}\n{stderr[-4000:]}"
  return stdout


def test_train_and_eval_learns_and_exports_a_saved_model(runs):
  stdout = check_ok(runs["results"], "full")
  auc = float(re.search(r"Validation AUC ([0-9.]+)", stdout).group(1))
  assert auc > 0.55, stdout
  assert re.search(r"Training throughput: [0-9,]+ examples/s", stdout)
  export_dir = re.search(r"SavedModel: (\S+)", stdout).group(1)
  assert export_dir == str(runs["dirs"]["full"] / "saved_model" / str(STEPS))
  for sub in ("train", "validation"):
    assert list((runs["dirs"]["full"] / sub).iterdir()), sub  # TensorBoard
  serve = tf.saved_model.load(export_dir).signatures["serving_default"]
  config = configs.get_config("dlrm_criteo_cpu_small")
  request = saved_model.example_request(config, batch_size=5)
  predictions = serve(**request)["predictions"].numpy()
  assert predictions.shape == (5,)
  _, want = restored_model_outputs(config, runs["dirs"]["full"], request)
  np.testing.assert_allclose(predictions, want, atol=1e-5)


def restored_model_outputs(config, model_dir, request):
  """``(activations, click probabilities)`` of a signature ``request`` by
  the model restored from ``model_dir``'s last checkpoint: the reference
  an exported SavedModel must match."""
  trained = RankingTask(config, tf.distribute.get_strategy())
  trained.checkpoint.restore(
    tf.train.latest_checkpoint(str(model_dir))
  ).assert_existing_objects_matched()
  features = range(len(config.task.model.vocab_sizes))
  activations = trained.embedding(
    {str(i): request[f"sparse_{i}"] for i in features}
  )
  logits = trained.model(
    {
      "dense_features": request["dense_features"],
      "embeddings": [activations[str(i)] for i in features],
    }
  )
  return activations, tf.sigmoid(logits)


def test_killed_run_resumes_to_the_uninterrupted_state(runs):
  rc, stdout, _ = runs["results"]["killed"]
  assert rc == -signal.SIGKILL, stdout
  assert "Killing this process after step 25" in stdout
  resumed = check_ok(runs["results"], "resumed")
  assert "Restored" in resumed and "ckpt-20 (step 20)" in resumed
  check_ok(runs["results"], "full")
  assert_same_state(runs["dirs"]["resumed"], runs["dirs"]["full"], atol=0.0)


def test_mirrored_two_replicas_shard_tables_and_equal_one_device(runs):
  stdout = check_ok(runs["results"], "mirrored")
  match = re.search(r"(\d+) row-sharded\), MirroredStrategy with 2", stdout)
  assert match and int(match.group(1)) > 0, stdout
  check_ok(runs["results"], "full")
  assert_same_state(runs["dirs"]["mirrored"], runs["dirs"]["full"], atol=1e-5)


def test_parameter_server_learns_and_its_checkpoint_restores_on_one_device(
  runs,
):
  stdout = check_ok(runs["results"], "parameter_server")
  match = re.search(r"(\d+) row-sharded\), ParameterServerStrategy", stdout)
  assert match and int(match.group(1)) > 0, stdout
  auc = float(re.search(r"Validation AUC ([0-9.]+)", stdout).group(1))
  assert auc > 0.55, stdout
  # 8 evaluation steps run concurrently: all 8 x 512 examples are counted.
  evaluations = re.findall(
    r"validation at step (\d+): .*\(([0-9,]+) examples", stdout
  )
  assert evaluations == [("20", "4,096"), ("40", "4,096")], stdout
  path, saved = checkpoint_values(runs["dirs"]["parameter_server"])
  assert path.endswith(f"ckpt-{STEPS}"), path
  config = configs.get_config("dlrm_criteo_cpu_small")
  task = RankingTask(config, tf.distribute.get_strategy())
  task.checkpoint.restore(path).assert_existing_objects_matched()
  assert int(task.step.numpy()) == STEPS
  tables = task.embedding.embedding_tables
  assert len(tables) == 26
  for table, variable in tables.items():  # Saved whole, restored whole.
    saved_table = saved[f"embedding/{table.name}/.ATTRIBUTES/VARIABLE_VALUE"]
    assert saved_table.shape == (table.vocabulary_size, table.dim)
    np.testing.assert_array_equal(np.asarray(variable), saved_table)
