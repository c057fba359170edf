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

A SavedModel must load with TensorFlow alone (TF Serving has no kernel
library), so kernels appear only in training steps: the update always runs
in one, and the lookup and exchange kernels are used only inside
``training_step()`` (what the engine opens around a training lookup and an
update) and never while a function is traced for a SavedModel.

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

import contextlib
import functools
from typing import Any

import tensorflow as tf
from absl import logging

from tpu_embedding import compat
from tpu_embedding.kernels import build as builder
from tpu_embedding.thread_setting import ThreadSetting

#: Per thread (replicas trace in their own): inside ``training_step()``.
_training = ThreadSetting(default=False)


@functools.cache
def load() -> Any:
  """The loaded kernel module, or None (disabled, or cannot build/load)."""
  if not builder.enabled():
    return None
  import os  # noqa: PLC0415

  try:
    if not os.path.exists(builder.library_path()):
      logging.info(
        "Building tpu_embedding's kernels (once, about 15 s): %s",
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


def training_step() -> contextlib.AbstractContextManager:
  """Ops built inside belong to a training step: lookup kernels may serve.

  Example:
    >>> with training_step():
    ...   inside = step_kernels() is load()
    >>> inside, step_kernels() is None
    (True, True)
  """
  return _training.set(True)


def step_kernels() -> Any:
  """The kernel module for lookup and exchange ops, or None.

  None outside ``training_step()``, while a function is traced for a
  SavedModel, with GPUs (the kernels are CPU kernels) or where the kernels
  cannot build: the TensorFlow ops then compute the same outputs.
  """
  if (
    not _training.get()
    or compat.in_save_context()
    or tf.config.list_logical_devices("GPU")
  ):
    return None
  return load()
