"""The same layers under tf-keras, inside tensorflow-recommenders models.

``TF_USE_LEGACY_KERAS=1`` only works if set before TensorFlow first loads
Keras, so the checks run in a fresh interpreter
(``tf_keras_tfrs_script.py``, run by path: it imports the installed
``tpu_embedding``, not the checkout's).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).with_name("tf_keras_tfrs_script.py")


def test_tfrs_ranking_model_trains_under_tf_keras(tmp_path):
  # tf-keras and tensorflow-recommenders come with the `test` extra.
  for package in ("tf_keras", "tensorflow_recommenders"):
    assert importlib.util.find_spec(package), f"pip install {package}"
  env = {
    **os.environ,
    "TF_USE_LEGACY_KERAS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "CKPT_DIR": str(tmp_path),
  }
  result = subprocess.run(
    [sys.executable, str(SCRIPT)],
    env=env,
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert result.returncode == 0, result.stdout + result.stderr[-5000:]
  assert result.stdout.strip().endswith("OK"), result.stdout
