"""Keras 3 ``fit`` / ``evaluate`` where Keras itself fails under a strategy.

Keras 3 (3.0 to at least 3.15, the Keras TensorFlow 2.21 installs) raises
in two places of its TensorFlow trainer under ``tf.distribute``, for any
model:

1. ``TensorFlowTrainer._maybe_symbolic_build`` builds the model from the
   first batch averaged over the replicas with one ``strategy.reduce``.
   MultiWorkerMirroredStrategy with two or more workers accepts no
   structure there ("Attempt to convert a value ... to a Tensor",
   keras-team/keras#20585, tensorflow/tensorflow#72388), and no strategy
   can average ragged or sparse ids ("'RaggedTensor' object has no
   attribute 'device'").
2. ``reduce_per_replica`` averages the scalar loss and metrics across
   workers with ``strategy.reduce("MEAN", v, axis=0)``; scalars have no
   axis 0 ("Invalid reduction dimension 0 for input with 0 dimensions").

:func:`enable_distributed_fit` replaces these two functions with versions
that, exactly in those cases, build the model from this worker's first
replica batch (building needs only shapes and dtypes, which the replicas
share, and integer ids stay integers) and average every logged value over
all replicas. In every other case they do what Keras does, so nothing that
works without the fix behaves differently. ``predict`` works in Keras as is.

The layers of this package call it when they are created under a
``MirroredStrategy`` or ``MultiWorkerMirroredStrategy``, so a model holding
one of them trains with ``model.fit`` there, on dense, ragged or sparse ids
and across workers. Call it yourself for models without them. tf-keras
(``TF_USE_LEGACY_KERAS=1``) needs none and is left alone.

Example:
  >>> from tpu_embedding.layers import distributed_fit
  >>> distributed_fit.enable_distributed_fit() == distributed_fit.IS_KERAS_3
  True
"""

from __future__ import annotations

import warnings
from typing import Any

import tensorflow as tf

from tpu_embedding.layers.keras_compat import IS_KERAS_3
from tpu_embedding.layers.keras_compat import keras

_installed = False

#: The strategies whose Keras 3 ``fit`` the fix concerns.
_MIRRORED = (
  tf.distribute.MirroredStrategy,
  tf.distribute.MultiWorkerMirroredStrategy,
)


def enable_distributed_fit() -> bool:
  """Lets Keras 3 ``fit``/``evaluate`` run where it fails (see module).

  Idempotent and cheap; safe to call in every process of a cluster before
  ``model.fit``.

  Returns:
    Whether the fix is in place: always False under tf-keras (which needs
    none) and False, with a warning, on a Keras whose trainer no longer has
    the two functions it replaces.
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
      "TensorFlowTrainer._maybe_symbolic_build; the model.fit fix for "
      "MultiWorkerMirroredStrategy and ragged or sparse inputs is not "
      "installed.",
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
    if iterator is None or not isinstance(strategy, _MIRRORED):
      return keras_build(self, iterator=iterator, data_batch=data_batch)
    for _, _, batches in iterator:
      batch = next(batches)
      break
    if multi_worker(strategy) or has_composite_values(strategy, batch):
      data_batch = first_replica_batch(strategy, batch)
    else:  # What Keras does, and can do: dense ids on one worker.
      data_batch = keras_mean_batch(strategy, batch)
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


def has_composite_values(strategy: tf.distribute.Strategy, batch: Any) -> bool:
  """Whether ``batch`` holds ragged or sparse tensors (Keras can't average).

  Example:
    >>> has_composite_values(
    ...   tf.distribute.get_strategy(), {"ids": tf.ragged.constant([[1]])}
    ... )
    True
  """
  return any(
    isinstance(value, (tf.RaggedTensor, tf.SparseTensor))
    for value in tf.nest.flatten(first_replica_batch(strategy, batch))
  )


def keras_mean_batch(strategy: tf.distribute.Strategy, batch: Any) -> Any:
  """Keras 3's own build batch: the mean over the replicas, if distributed."""
  distributed = [
    isinstance(value, tf.distribute.DistributedValues)
    for value in tf.nest.flatten(batch)
  ]
  if all(distributed):
    return strategy.reduce("MEAN", batch, axis=None)
  return batch


def needs_fix(strategy: tf.distribute.Strategy) -> bool:
  """Whether Keras 3 ``fit`` under ``strategy`` can hit the failures.

  Example:
    >>> needs_fix(tf.distribute.get_strategy())
    False
  """
  return IS_KERAS_3 and isinstance(strategy, _MIRRORED)
