"""``model_garden.ranking.train``'s modes and config keys, end to end.

Three runs in subprocesses, started together (small tables, few steps):

* ``trainer``: ``--mode train`` with ``mixed_bfloat16`` into a
  ``file://`` model directory (every file operation goes through
  ``tf.io.gfile``), checkpoints every 10 steps; learning rates and steps/s
  in TensorBoard.
* ``sidecar``: ``--mode continuous_eval`` on the same directory, started
  at the same time: it waits for checkpoints, evaluates each new one once,
  stops after the last step's, and keeps the best one
  (``trainer.best_checkpoint_export_subdir``) with its metrics.
* ``overflow``: ``mixed_float16`` with a fixed loss scale so large that
  every gradient overflows: every step is skipped and counted (logs and
  TensorBoard), and the checkpoint still holds the initial tables with an
  untouched dense optimizer.

Then ``--mode eval`` of the trainer's last checkpoint equals the sidecar's
evaluation of it and leaves ``params.yaml`` alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from model_garden.ranking import train
from model_garden.ranking.task import RankingTask
from tests import processes

STEPS = 30
PARAMS = ",".join(
  [
    "task.train_data.global_batch_size=256",
    "task.validation_data.global_batch_size=256",
    "task.synthetic.num_train_examples=8192",
    "task.synthetic.num_eval_examples=1024",
    f"trainer.train_steps={STEPS}",
    "trainer.checkpoint_interval=10",
    "trainer.summary_interval=10",
    "trainer.steps_per_loop=10",
    "trainer.time_history.log_steps=10",
    "trainer.export_saved_model=false",
    "trainer.best_checkpoint_export_subdir=best",
    "trainer.best_checkpoint_eval_metric=auc",
    "runtime.mixed_precision_dtype=mixed_bfloat16",
  ]
)
OVERFLOW = ",".join(
  [
    "task.train_data.global_batch_size=64",
    "task.validation_data.global_batch_size=64",
    "task.synthetic.num_train_examples=1024",
    "trainer.train_steps=6",
    "trainer.checkpoint_interval=6",
    "trainer.summary_interval=3",
    "trainer.steps_per_loop=3",
    "trainer.export_saved_model=false",
    "runtime.mixed_precision_dtype=mixed_float16",
    "runtime.loss_scale=1e30",
  ]
)


def start(model_dir, params, *flags, cwd):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("TF_CONFIG", None)
  return processes.Popen(
    [
      sys.executable,
      "-m",
      "model_garden.ranking.train",
      "--experiment=dlrm_criteo_cpu_small",
      f"--model_dir={model_dir}",
      f"--params_override={params}",
      "--seed=3",
      *flags,
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=env,
    cwd=str(cwd),
  )


def finish(process, name, timeout=300):
  try:
    stdout, stderr = process.communicate(timeout=timeout)
  finally:
    process.kill()
  assert process.returncode == 0, (
    f"{name} failed ({process.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}"
  )
  return stdout


def scalars(directory):
  """``{tag: [(step, value)]}`` of a TensorBoard directory."""
  values: dict[str, list] = {}
  for path in tf.io.gfile.glob(os.path.join(directory, "events.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        number = float(tf.make_ndarray(value.tensor))
        values.setdefault(value.tag, []).append((event.step, number))
  return values


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("modes")
  model_dir = root / "run"
  processes = {
    "trainer": start(f"file://{model_dir}", PARAMS, "--mode=train", cwd=root),
    "sidecar": start(
      f"file://{model_dir}",
      PARAMS,
      "--mode=continuous_eval",
      "--eval_timeout=120",
      cwd=root,
    ),
    "overflow": start(root / "overflow", OVERFLOW, "--mode=train", cwd=root),
  }
  out = {name: finish(p, name) for name, p in processes.items()}
  params = (model_dir / "params.yaml").read_bytes()
  stamp = os.stat(model_dir / "params.yaml").st_mtime_ns
  out["eval"] = finish(
    start(
      model_dir,
      PARAMS,
      "--mode=eval",
      f"--config_file={model_dir / 'params.yaml'}",
      cwd=root,
    ),
    "eval",
  )
  assert (model_dir / "params.yaml").read_bytes() == params
  assert os.stat(model_dir / "params.yaml").st_mtime_ns == stamp
  return {"root": root, "dir": model_dir, "out": out}


def test_trainer_writes_through_gfile_with_bf16_and_rates_in_tensorboard(runs):
  out, model_dir = runs["out"]["trainer"], runs["dir"]
  assert f"{STEPS} steps, mixed_bfloat16" in out
  assert not (runs["root"] / "file:").exists()  # no local "file:" directory
  saved = json.loads((model_dir / "params.yaml").read_text())
  assert saved["runtime"]["mixed_precision_dtype"] == "mixed_bfloat16"
  assert tf.train.latest_checkpoint(str(model_dir)).endswith(f"ckpt-{STEPS}")
  logged = scalars(str(model_dir / "train"))
  for tag in ("loss", "auc", "learning_rate", "dense_learning_rate"):
    assert [s for s, _ in logged[tag]] == [10, 20, 30], tag
  assert {"steps_per_second", "examples_per_second"} <= set(logged)
  # The tables' rate: warm-up 0 -> 40 * 256 / 2048 over the 30 steps.
  rates = dict(logged["learning_rate"])
  assert rates[10] < rates[20] < rates[30] <= 5.0
  steps_per_second = dict(logged["steps_per_second"])
  examples = dict(logged["examples_per_second"])
  assert examples[30] == pytest.approx(steps_per_second[30] * 256, rel=1e-5)


def test_sidecar_evaluates_each_checkpoint_once_and_keeps_the_best(runs):
  out, model_dir = runs["out"]["sidecar"], runs["dir"]
  evaluated = [int(s) for s in re.findall(r"Evaluating \S+ckpt-(\d+) ", out)]
  assert evaluated and evaluated[-1] == STEPS, out
  assert evaluated == sorted(set(evaluated)), out  # each once, in order
  aucs = {
    int(step): float(auc)
    for step, auc in re.findall(r"validation at step (\d+): auc ([0-9.]+)", out)
  }
  assert sorted(aucs) == evaluated
  assert f"waiting for checkpoints in file://{model_dir}".lower() in out.lower()
  validation = scalars(str(model_dir / "validation"))
  # The sidecar's evaluations, and then --mode eval's of the last step.
  assert sorted(s for s, _ in validation["auc"]) == evaluated + [STEPS]
  info = json.loads((model_dir / "best" / "info.json").read_text())
  best_step = max(aucs, key=aucs.get)
  assert info["best_ckpt_global_step"] == best_step
  assert info["auc"] == pytest.approx(aucs[best_step], abs=1e-4)
  assert info["source_checkpoint"].endswith(f"ckpt-{best_step}")
  # The kept checkpoint restores, and holds that step.
  best = tf.train.latest_checkpoint(str(model_dir / "best"))
  assert best == str(model_dir / "best" / "best_ckpt")
  config = train.build_config("dlrm_criteo_cpu_small", params_override=PARAMS)
  task = RankingTask(config, tf.distribute.get_strategy())
  task.checkpoint.restore(best).assert_existing_objects_matched()
  assert int(task.step.numpy()) == best_step


def test_eval_mode_matches_the_sidecar_and_keeps_params_yaml(runs):
  sidecar, evaluation = runs["out"]["sidecar"], runs["out"]["eval"]
  line = f"validation at step {STEPS}: "
  want = re.search(re.escape(line) + r"(.*?)  \(", sidecar).group(1)
  got = re.search(re.escape(line) + r"(.*?)  \(", evaluation).group(1)
  assert got == want


def test_overflowing_steps_are_skipped_counted_and_change_nothing(runs):
  out, model_dir = runs["out"]["overflow"], runs["root"] / "overflow"
  assert "Skipped 6 step(s) whose gradients were not finite." in out
  assert "step 3: skipped 3 step(s) whose gradients were not finite" in out
  assert "6 skipped so far" in out
  logged = scalars(str(model_dir / "train"))
  assert logged["skipped_steps"] == [(3, 3.0), (6, 6.0)]
  assert dict(logged["loss_scale"]) == {
    3: np.float32(1e30),
    6: np.float32(1e30),
  }
  path = tf.train.latest_checkpoint(str(model_dir))
  assert path.endswith("ckpt-6")
  saved = dict(tf.train.list_variables(path))
  assert "loss_scale/scale/.ATTRIBUTES/VARIABLE_VALUE" in saved
  iterations = [
    k for k in saved if k.startswith("dense_optimizer/") and ("iteration" in k)
  ]
  assert iterations
  for key in iterations:
    assert int(tf.train.load_variable(path, key)) == 0, key
  assert (
    int(tf.train.load_variable(path, "step/.ATTRIBUTES/VARIABLE_VALUE")) == 6
  )
  # The tables are still their seeded initial values.
  config = train.build_config(
    "dlrm_criteo_cpu_small", params_override=OVERFLOW, seed=3
  )
  initial = RankingTask(config, tf.distribute.get_strategy(), seed=3)
  tables = initial.embedding.variables
  assert len(tables) == 26
  for name, slots in tables.items():
    np.testing.assert_array_equal(
      tf.train.load_variable(
        path, f"embedding/{name}/.ATTRIBUTES/VARIABLE_VALUE"
      ),
      np.asarray(slots["parameters"]),
      err_msg=name,
    )
