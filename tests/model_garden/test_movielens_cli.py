"""``python -m model_garden.movielens``: flags, checkpoints and resume,
TensorBoard, the SavedModel export, in subprocesses on the real data.

Short runs (1-2 epochs at batch 2048) of both tasks; the interrupted
ranking run (1 epoch, then started again for 2) must end with the tables,
weights and optimizer state of an uninterrupted 2-epoch run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

from tests import processes


def start(*flags: str, cwd) -> subprocess.Popen:
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  return processes.Popen(
    [sys.executable, "-m", "model_garden.movielens", *flags],
    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    cwd=str(cwd),
  )  # fmt: skip


def finish(process: subprocess.Popen, returncode: int = 0) -> str:
  stdout, stderr = process.communicate(timeout=300)
  assert process.returncode == returncode, f"{stdout}\n{stderr[-3000:]}"
  return stdout + stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("movielens")
  common = ("--batch_size=2048", "--progress_bar=off")
  resumed = start(
    "--task=ranking", f"--model_dir={root / 'resumed'}", "--epochs=1",
    *common, cwd=root,
  )  # fmt: skip
  whole = start(
    "--task=ranking", f"--model_dir={root / 'whole'}", "--epochs=2", *common,
    cwd=root,
  )  # fmt: skip
  out = {"first": finish(resumed)}
  resumed = start(
    "ranking", f"--model_dir={root / 'resumed'}", "--epochs=2", *common,
    cwd=root,
  )  # fmt: skip
  retrieval = start(
    "--task=retrieval", f"--model_dir={root / 'retrieval'}", "--epochs=1",
    *common, cwd=root,
  )  # fmt: skip
  out["whole"] = finish(whole)
  out["resumed"] = finish(resumed)
  out["retrieval"] = finish(retrieval)
  return root, out


def _values(directory) -> dict[str, np.ndarray]:
  path = tf.train.latest_checkpoint(str(directory))
  return {
    name: tf.train.load_variable(path, name)
    for name, _ in tf.train.list_variables(path)
    if not name.startswith("_CHECKPOINTABLE")
  }


def test_ranking_resumes_to_the_uninterrupted_state(runs):
  root, out = runs
  assert "80,000 training and 20,000 test ratings" in out["first"]
  assert re.search(r"restored \S+ckpt-1 \(1 epochs done\)", out["resumed"])
  assert "epoch 2/2" in out["resumed"] and "epoch 1/2" not in out["resumed"]
  got, want = _values(root / "resumed"), _values(root / "whole")
  assert set(got) == set(want)
  assert any("user_table" in k for k in want)
  assert any("movie_table" in k and "momenta" in k for k in want)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, atol=1e-6, err_msg=name)
  rmse = float(re.search(r"test RMSE ([\d.]+)", out["resumed"]).group(1))
  baseline = float(re.search(r"baseline ([\d.]+)", out["resumed"]).group(1))
  assert rmse < baseline


def test_ranking_writes_tensorboard_per_epoch(runs):
  root, _ = runs
  events = event_accumulator.EventAccumulator(str(root / "whole/validation"))
  events.Reload()
  steps = [e.step for e in events.Tensors("rmse")]
  assert steps == [1, 2]
  train = event_accumulator.EventAccumulator(str(root / "whole/train"))
  train.Reload()
  assert {"loss", "rmse"} <= set(train.Tags()["tensors"])


def _saved_model_cli(export_dir) -> str:
  return processes.run(
    [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli", "show",
     "--dir", str(export_dir), "--tag_set", "serve", "--signature_def",
     "serving_default"],
    capture_output=True, text=True, check=True,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
  ).stdout  # fmt: skip


def test_ranking_saved_model_serves_ratings(runs):
  root, out = runs
  export_dir = root / "whole" / "saved_model"
  assert (
    f"SavedModel: {export_dir} (tables: movie_table, user_table)"
    in (out["whole"])
  )
  show = _saved_model_cli(export_dir)
  assert "inputs['user_id']" in show and "inputs['movie_id']" in show
  serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
  ratings = serve(
    user_id=tf.constant([0, 1, 2], tf.int64),
    movie_id=tf.constant([0, 49, 99], tf.int64),
  )["predictions"].numpy()
  assert ratings.shape == (3, 1)
  assert np.all((ratings > -0.5) & (ratings < 1.5))


def test_retrieval_exports_the_query_tower(runs):
  root, out = runs
  assert re.search(r"recall@10: two-tower [\d.]+, popularity 0\.119", out[
    "retrieval"])  # fmt: skip
  export_dir = root / "retrieval" / "saved_model"
  assert "(tables: user_table)" in out["retrieval"]
  show = _saved_model_cli(export_dir)
  assert "inputs['user_id']" in show and "movie_id" not in show
  serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
  vectors = serve(user_id=tf.constant([3, 7], tf.int64))["predictions"]
  np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
  assert (root / "retrieval" / "ckpt-1.index").exists()


def test_usage_errors_and_help(tmp_path):
  bad_task = finish(start("--task=rank", cwd=tmp_path), returncode=2)
  assert "--task" in bad_task and "ranking" in bad_task
  no_dir = finish(start("--task=ranking", cwd=tmp_path), returncode=2)
  assert "Traceback" not in no_dir
  assert no_dir.strip().splitlines()[-1] == (
    "--model_dir is required; see --help"
  )
  help_text = finish(start("--help", cwd=tmp_path), returncode=1)
  for flag in ("task", "model_dir", "epochs", "batch_size", "export"):
    assert re.search(rf"--(\[no\])?{flag}: \S", help_text), flag
