"""Keras 3 ``fit`` / ``evaluate`` with MultiWorkerMirroredStrategy.

Keras 3 (3.0 to at least 3.15, the Keras TensorFlow 2.21 installs) cannot
train *any* model with ``tf.distribute.MultiWorkerMirroredStrategy`` once
the cluster has two or more workers (keras-team/keras#20585,
tensorflow/tensorflow#72388). Two of its TensorFlow-trainer functions
raise before or right after the first step:

1. ``TensorFlowTrainer._maybe_symbolic_build`` averages the first batch
   over all replicas with one ``strategy.reduce`` over the whole
   ``(x, y)`` structure, which MultiWorkerMirroredStrategy accepts only
   for a single tensor ("Attempt to convert a value ... to a Tensor").
2. ``reduce_per_replica`` averages the scalar loss and metrics with
   ``strategy.reduce("MEAN", v, axis=0)``; scalars have no axis 0
   ("Invalid reduction dimension 0 for input with 0 dimensions").

:func:`enable_multi_worker_fit` replaces these two functions with versions
that, in multi-worker mode only (Keras' own test for it), build the model
from the shapes of this worker's first replica batch (building needs only
shapes and dtypes, which every replica shares) and average every logged
value over all replicas. In any other case they call the Keras originals
unchanged, so nothing that works without the fix behaves differently.
``predict`` (concatenation across workers) works in Keras as is.

The layers of this package call it when they are created under a
multi-worker MultiWorkerMirroredStrategy, so a model holding one of them
trains with ``model.fit`` there. Call it yourself for models without them.
tf-keras (``TF_USE_LEGACY_KERAS=1``) trains across workers as is and is left
alone.

Example:
  >>> from tpu_embedding.layers import multi_worker_fit
  >>> multi_worker_fit.enable_multi_worker_fit() == multi_worker_fit.IS_KERAS_3
  True
"""

from __future__ import annotations

import warnings
from typing import Any

import tensorflow as tf

from tpu_embedding.layers.keras_compat import IS_KERAS_3
from tpu_embedding.layers.keras_compat import keras

_installed = False


def enable_multi_worker_fit() -> bool:
  """Makes Keras 3 ``fit`` and ``evaluate`` work across several workers.

  Idempotent and cheap; safe to call in every process of the cluster
  before ``model.fit``.

  Returns:
    Whether the fix is in place: always False under tf-keras (which
    needs none) and False, with a warning, on a Keras whose trainer no
    longer has the two functions it replaces.
  """
  global _installed
  if not IS_KERAS_3:
    return False
  if _installed:
    return True
  try:
    from keras.src.backend.tensorflow import trainer
  except ImportError:
    trainer = None
  names = ("reduce_per_replica", "_collective_all_reduce_multi_worker")
  if (
    trainer is None
    or not all(hasattr(trainer, name) for name in names)
    or not hasattr(trainer.TensorFlowTrainer, "_maybe_symbolic_build")
  ):
    warnings.warn(
      f"tpu_embedding: Keras {keras.__version__} has no "
      "keras.src.backend.tensorflow.trainer.reduce_per_replica / "
      "TensorFlowTrainer._maybe_symbolic_build; the MultiWorkerMirrored"
      "Strategy fix for model.fit is not installed.",
      stacklevel=2,
    )
    return False
  _install(trainer)
  _installed = True
  return True


def _install(trainer: Any) -> None:
  multi_worker = trainer._collective_all_reduce_multi_worker
  keras_build = trainer.TensorFlowTrainer._maybe_symbolic_build
  keras_reduce = trainer.reduce_per_replica

  def maybe_symbolic_build(self, iterator=None, data_batch=None):
    strategy = self._distribute_strategy
    if iterator is None or strategy is None or not multi_worker(strategy):
      return keras_build(self, iterator=iterator, data_batch=data_batch)
    for _, _, batches in iterator:
      data_batch = first_replica_batch(strategy, next(batches))
      break
    with strategy.scope():
      self._symbolic_build(data_batch=data_batch)

  def reduce_per_replica(values, strategy, reduction):
    if reduction in ("auto", "mean") and multi_worker(strategy):
      return tf.nest.map_structure(
        lambda value: strategy.reduce("MEAN", value, axis=None), values
      )
    return keras_reduce(values, strategy, reduction)

  trainer.TensorFlowTrainer._maybe_symbolic_build = maybe_symbolic_build
  trainer.reduce_per_replica = reduce_per_replica


def first_replica_batch(strategy: tf.distribute.Strategy, batch: Any) -> Any:
  """``batch`` with each distributed value replaced by this worker's first.

  Example:
    >>> first_replica_batch(tf.distribute.get_strategy(), {"x": 1})
    {'x': 1}
  """

  def first(value):
    if isinstance(value, tf.distribute.DistributedValues):
      return strategy.experimental_local_results(value)[0]
    return value

  return tf.nest.map_structure(first, batch)


def needs_fix(strategy: tf.distribute.Strategy) -> bool:
  """Whether Keras 3 needs the fix to train under ``strategy``.

  Example:
    >>> needs_fix(tf.distribute.get_strategy())
    False
  """
  return (
    IS_KERAS_3
    and isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    and strategy.extended._in_multi_worker_mode()
  )
