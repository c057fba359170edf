"""A plain Keras 3 model's ``fit``, the reference for stock Keras behaviour.

``test_distributed_fit.py`` runs this file in a fresh interpreter that never
imports ``tpu_embedding`` (checked before writing), and calls :func:`run`
in its own process to compare: on the default strategy and on a
``MirroredStrategy`` over two logical CPUs (as ``tests/conftest.py``), the
weights, ``fit``'s history and ``evaluate``'s logs must be bit-identical.
Importing this module only defines functions.
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: Logical CPUs, as tests/conftest.py.
NUM_LOGICAL_CPUS = 4
SAMPLES, BATCH = 24, 8


def _constant(keras: Any, np: Any, rows: int, cols: int):
  values = np.linspace(-1.0, 1.0, rows * cols).reshape(rows, cols)
  return keras.initializers.Constant(values.astype(np.float32))


def run(strategy: Any) -> dict[str, Any]:
  """Builds, fits and evaluates a small Keras model under ``strategy``."""
  import keras
  import numpy as np

  rng = np.random.default_rng(7)
  x = rng.normal(size=(SAMPLES, 3)).astype(np.float32)
  y = rng.normal(size=(SAMPLES, 1)).astype(np.float32)
  with strategy.scope():
    model = keras.Sequential(
      [
        keras.layers.Dense(
          4, "relu", kernel_initializer=_constant(keras, np, 3, 4)
        ),
        keras.layers.Dense(1, kernel_initializer=_constant(keras, np, 4, 1)),
      ]
    )
    model.compile(keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
  history = model.fit(
    x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0
  )
  out = {f"weight{i}": w for i, w in enumerate(model.get_weights())}
  for key, values in history.history.items():
    out[f"history_{key}"] = np.asarray(values)
  out["evaluate"] = np.asarray(
    model.evaluate(x, y, batch_size=BATCH, verbose=0)
  )
  return out


def main(out_path: str) -> None:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import numpy as np
  import tensorflow as tf

  cpus = tf.config.list_physical_devices("CPU")
  tf.config.set_logical_device_configuration(
    cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
  )
  strategies = {
    "default": tf.distribute.get_strategy(),
    "mirrored": tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
  }
  saved = {}
  for name, strategy in strategies.items():
    for key, value in run(strategy).items():
      saved[f"{name}/{key}"] = value
  imported = sorted(m for m in sys.modules if m.startswith("tpu_embedding"))
  assert not imported, imported
  np.savez(out_path, **saved)
  print("OK")


if __name__ == "__main__":
  main(sys.argv[1])
