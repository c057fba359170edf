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
(``ops.TENSORFLOW_OPS``) everywhere else. The engine decides once and
passes the ops down explicitly to its training steps; a SavedModel must
load with TensorFlow alone (TF Serving has no kernel library), so lookups
for serving and functions traced for a SavedModel get TensorFlow's ops.

The library is compiled against the installed TensorFlow on first use (or
ahead of time: ``python3 -m tpu_embedding.kernels build``) and cached
(``build.py``). If the compiler is missing or the build fails, a warning is
logged once and the TensorFlow path is used.

Example:
  >>> from tpu_embedding import kernels
  >>> module = kernels.load()  # None where the kernels cannot build
  >>> module is None or hasattr(module, "tpe_fused_sparse_apply")
  True
"""

from __future__ import annotations

import functools
import os
from typing import Any

import tensorflow as tf
from absl import logging

from tpu_embedding.kernels import build as builder


@functools.cache
def load() -> Any:
  """The loaded kernel module, or None (disabled, or cannot build/load)."""
  if not builder.enabled():
    return None
  try:
    if not os.path.exists(builder.library_path()):
      logging.info(
        "Building tpu_embedding's kernels (once, about 30 s): %s",
        builder.library_path(),
      )
    return tf.load_op_library(builder.build())
  except (builder.BuildError, tf.errors.NotFoundError, OSError) as e:
    logging.warning(
      "tpu_embedding's fused kernels are not available (%s); using the "
      "TensorFlow ops path (same numbers, slower). Build them with "
      "`python3 -m tpu_embedding.kernels build`.",
      str(e).splitlines()[0] if str(e) else type(e).__name__,
    )
    return None
