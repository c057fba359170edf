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

import contextlib
import functools
import os
from typing import Any

import tensorflow as tf
from absl import logging

from tpu_embedding import compat
from tpu_embedding.kernels import library
from tpu_embedding.thread_setting import ThreadSetting

#: Per thread (replicas trace in their own): inside ``training_step()``,
#: the step's kernel chains that run at once in this process (else 0).
_training = ThreadSetting(default=0)


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


def training_step(concurrent: int = 1) -> contextlib.AbstractContextManager:
  """Ops built inside belong to a training step: lookup kernels may serve.

  Args:
    concurrent: the step's independent kernel chains that run at once in
      this process: each replica runs one per table or stack (its
      deduplication, gather and update). With one per CPU core or more,
      kernels do not spread their rows over the threads too
      (``spread_rows``).

  Example:
    >>> with training_step():
    ...   inside = step_kernels() is load()
    >>> inside, step_kernels() is None
    (True, True)
  """
  if concurrent < 1:
    raise ValueError(f"concurrent must be >= 1, got {concurrent}.")
  return _training.set(concurrent)


def spread_rows() -> bool:
  """Whether a kernel built here spreads its rows over the CPU threads.

  Not in a training step whose kernel chains already run one op on every
  core (replicas, or a replica's tables): there each kernel runs on the
  thread that runs its chain (spreading it only makes it queue behind the
  other chains' work; measured 1.16x faster steps on 2 and 4 replicas of
  2 cores, and 1.08x on one device with 26 tables).

  Example:
    >>> import os
    >>> with training_step(concurrent=len(os.sched_getaffinity(0))):
    ...   spread_rows()
    False
    >>> spread_rows()
    True
  """
  concurrent = _training.get()
  return concurrent < _cores() if concurrent else True


@functools.cache
def _cores() -> int:
  """The CPU threads an op can spread over (TensorFlow's intra-op pool)."""
  configured = tf.config.threading.get_intra_op_parallelism_threads()
  return configured or len(os.sched_getaffinity(0))


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
