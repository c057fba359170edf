"""``model.fit`` with the Keras layers, one process of a comparison.

Run by tests/layers/test_multi_worker_fit.py, under Keras 3 or tf-keras:

* with ``TF_CONFIG`` (one process per worker): under
  MultiWorkerMirroredStrategy, the ``tests.layers.test_mirrored`` models
  (``TPUEmbedding``; ``PartialTPUEmbedding``) are built, fitted, evaluated
  and predicted with Keras, and each worker writes a
  ``tf.train.Checkpoint`` of each model (every worker must take part; the
  chief's is the one kept);
* without (after the workers): the same on the default strategy (the
  reference), then the chief's checkpoints restored into fresh one-device
  models.

Before any of our layers exists, a plain Keras model (no tpu_embedding
layer) is fitted too, fixed with ``fix_distributed_fit(model)`` alone: the
per-model fix, with Keras' trainer untouched.

Writes ``OUT/<run>.npz`` (``<run>``: ``worker0``, ``worker1`` or
``one_device``) with, per model kind, every table and slot, the dense kernel,
``evaluate``'s loss, ``predict``'s outputs, the rows of the big table this
process holds
(and, for the reference, the restored tables); for the plain model its
weights, ``fit``'s history and ``evaluate``'s logs; and whether the Keras 3
``fit`` fix (``distributed_fit``) was applied to the models and its hook
installed; per model kind, the op types ``fit``'s traced steps gave the
layer's tables (``row_only_ops/<kind>``, asserted row ops only here).
Prints "OK" last.

``python mwms_keras_fit.py OUT [KIND ...]``: only the model kinds named
(``tpu_embedding``, ``partial``; all of them when none is).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# ``tests`` from this checkout, without putting the checkout on sys.path
# (as the root conftest.py does): ``tpu_embedding`` is the installed one.
_tests = importlib.machinery.ModuleSpec("tests", None, is_package=True)
_tests.submodule_search_locations = [str(pathlib.Path(__file__).parents[1])]
sys.modules["tests"] = importlib.util.module_from_spec(_tests)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests import sparse_access  # noqa: E402
from tests.layers import test_mirrored  # noqa: E402
from tpu_embedding.layers import distributed_fit  # noqa: E402
from tpu_embedding.layers.keras_compat import keras  # noqa: E402

BATCH = 8


def results(model, layer, x, y):
  out = {
    f"{table}/{slot}": value
    for (table, slot), value in test_mirrored.layer_values(layer).items()
  }
  mid_level = test_mirrored.mid_level(layer)
  if hasattr(mid_level.backend, "shards"):  # Sharded: this worker's shards.
    held = mid_level.backend.shards("big")
  else:
    held = [mid_level.variables["big"]["parameters"]]
  out["big_rows_held"] = np.asarray([variable.shape[0] for variable in held])
  out["kernel"] = model.dense.kernel.numpy()
  out["evaluate"] = np.asarray(
    model.evaluate(x, y, batch_size=BATCH, verbose=0)
  )
  out["predict"] = model.predict(x, batch_size=BATCH, verbose=0)
  return out


def row_only_ops(model, layer):
  """The op types ``fit``'s traced steps gave the layer's tables and
  slots, asserted row ops only (tests/sparse_access.py)."""
  accesses = sparse_access.check_row_only(
    sparse_access.concrete_functions(model.train_function),
    test_mirrored.mid_level(layer),
  )
  return np.asarray(sorted(accesses))


def restored(kind, checkpoint, x):
  """Values of a fresh one-device model restored from ``checkpoint``."""
  model, layer = test_mirrored.make_model(kind)
  model({k: tf.constant(v[:2]) for k, v in x.items()}, training=False)
  status = tf.train.Checkpoint(model=model).read(checkpoint)
  status.assert_existing_objects_matched()
  return {
    f"restored/{table}/{slot}": value
    for (table, slot), value in test_mirrored.layer_values(layer).items()
  }


def plain_model(strategy):
  """A Keras model without our layers, fixed per model; its results."""
  rng = np.random.default_rng(3)
  x = rng.normal(size=(test_mirrored.SAMPLES, 3)).astype(np.float32)
  y = rng.normal(size=(test_mirrored.SAMPLES, 1)).astype(np.float32)
  with strategy.scope():
    model = keras.Sequential(
      [
        keras.layers.Dense(4, "relu", kernel_initializer=constant(3, 4)),
        keras.layers.Dense(1, kernel_initializer=constant(4, 1)),
      ]
    )
    model.compile(keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
  fixed = distributed_fit.fix_distributed_fit(model)
  history = model.fit(
    x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0
  )
  logs = model.evaluate(x, y, batch_size=BATCH, verbose=0)
  out = {f"plain/weight{i}": w for i, w in enumerate(model.get_weights())}
  out["plain/loss"] = np.asarray(history.history["loss"])
  out["plain/mae"] = np.asarray(history.history["mae"])
  out["plain/evaluate"] = np.asarray(logs)
  out["plain_fixed"] = np.asarray(fixed)
  out["plain_hook_installed"] = np.asarray(distributed_fit.installed())
  return out


def constant(rows, cols):
  values = np.linspace(-1.0, 1.0, rows * cols).reshape(rows, cols)
  return keras.initializers.Constant(values.astype(np.float32))


def main(out_dir: pathlib.Path, kinds: list[str]) -> None:
  """Fits ``kinds`` (``test_mirrored.LAYERS`` keys; all when empty)."""
  tf_config = json.loads(os.environ.get("TF_CONFIG", "null"))
  if tf_config:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    run = f"worker{tf_config['task']['index']}"
  else:
    strategy = tf.distribute.get_strategy()
    run = "one_device"
  saved = plain_model(strategy)
  fixed = []
  for kind in sorted(kinds or test_mirrored.LAYERS):
    model, layer, x, y = test_mirrored.train(strategy, kind)
    fixed.append(distributed_fit.is_fixed(model))
    saved[f"row_only_ops/{kind}"] = row_only_ops(model, layer)
    for key, value in results(model, layer, x, y).items():
      saved[f"{kind}/{key}"] = value
    checkpoint = out_dir / "worker0" / kind / "ckpt"
    if tf_config:
      path = checkpoint if run == "worker0" else out_dir / run / kind / "ckpt"
      tf.train.Checkpoint(model=model).write(str(path))
    else:
      for key, value in restored(kind, str(checkpoint), x).items():
        saved[f"{kind}/{key}"] = value
  saved["fix_installed"] = np.asarray(distributed_fit.installed())
  saved["layer_models_fixed"] = np.asarray(fixed)
  np.savez(out_dir / f"{run}.npz", **saved)
  print("OK")


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]), sys.argv[2:])
