"""Fused C++ kernels for the sparse update, with a pure TensorFlow fallback.

``TpeFusedSparseApply`` (``fused_update.cc``) sums each distinct row's
gradients and applies SGD or Adagrad (with gradient clipping, weight decay
and weight clipping) in one pass, reading and writing every row and slot
row once, on all CPU threads; large table buffers are backed by huge pages.
Its numbers are identical to the TensorFlow ops path (``tables/updates.py``),
which remains for everything else and wherever the kernels cannot build.
``TpeUnique``, ``TpeGatherRows`` and ``TpeSplitByOwner`` deduplicate ids,
gather rows and route ids between replicas with exactly the outputs of
``tf.unique``, ``tf.gather`` and ``tf.dynamic_partition``.

Which ops serve a step is decided in one place, ``ops.select_ops``, from
the devices that hold the tables: the kernels (``ops.KernelOps``) only
where every table variable lives in this process's CPU memory (never on a
GPU, a parameter server or another worker), TensorFlow's ops
(``ops.TENSORFLOW_OPS``) everywhere else. The engine asks it and passes
the ops down explicitly to its training steps; a SavedModel must
load with TensorFlow alone (TF Serving has no kernel library), so lookups
for serving and functions traced for a SavedModel get TensorFlow's ops.

The install compiles the library against the TensorFlow the package runs
with (``build.py``, called by ``setup.py``); ``library.py`` picks the one
to load. Where there is none (no compiler at install, another TensorFlow,
``TPU_EMBEDDING_KERNELS=0``) the TensorFlow path runs, said once in one
line. No process ever compiles C++ on first use.

Example:
  >>> from tpu_embedding import kernels
  >>> module = kernels.load()  # None where the kernels cannot build
  >>> module is None or hasattr(module, "tpe_fused_sparse_apply")
  True
"""

from __future__ import annotations

import functools
from typing import Any

import tensorflow as tf
from absl import logging

from tpu_embedding.kernels import library


@functools.cache
def load() -> Any:
  """The loaded kernel module, or None (the TensorFlow ops path).

  Loads the library ``library.choose()`` picks: built by the install (or
  tuned by ``python3 -m tpu_embedding.kernels build``); never compiles.
  Without one, or where it fails to load, says so once, in one line.
  """
  choice = library.choose()
  if choice.path is None:
    if not choice.asked:
      logging.warning(library.tensorflow_path_message(choice.reason))
    return None
  try:
    return tf.load_op_library(choice.path)
  except (tf.errors.NotFoundError, OSError) as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    logging.warning(
      library.tensorflow_path_message(
        f"{choice.path} does not load: {first or type(e).__name__}"
      )
    )
    return None
