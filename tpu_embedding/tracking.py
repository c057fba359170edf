"""Checkpoint tracking of table variables under TensorFlow's keys.

Example:
  >>> import tensorflow as tf
  >>> owner = tf.__internal__.tracking.Trackable()
  >>> v = VariableTracker(owner).create(
  ...     "t", (2, 1), tf.zeros_initializer(),
  ...     lambda name, shape, dtype, initializer, trainable: tf.Variable(
  ...         initializer(shape, dtype)), True)
  >>> v.shape
  TensorShape([2, 1])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf


class VariableTracker:
  """Creates table variables as checkpoint dependencies of ``owner``.

  A variable tracked as ``"t"`` is saved under the key ``<owner>/t`` and one
  tracked as ``"t/accumulators"`` under ``<owner>/t.Saccumulators``: the
  keys TensorFlow's TPU embedding classes use. A checkpoint restored into
  ``owner`` before its variables exist is applied when they are created.
  """

  def __init__(self, owner: tf.__internal__.tracking.Trackable):
    self._owner = owner

  def create(
    self,
    name: str,
    shape: tuple[int, int],
    initializer: Any,
    getter: Callable[..., Any],
    trainable: bool,
  ) -> Any:
    # Trackable's restore-on-create entry point, as TensorFlow's own
    # TPUEmbedding classes use it.
    # pylint: disable=protected-access
    return self._owner._add_variable_with_custom_getter(
      name=name,
      shape=shape,
      dtype=tf.float32,
      initializer=initializer,
      getter=getter,
      trainable=trainable,
    )

  def register(self, name: str, variable: Any) -> None:
    # pylint: disable=protected-access
    self._owner._track_trackable(variable, name=name, overwrite=True)

  def pending_restore(self, name: str) -> Any:
    """A pending checkpoint value of variable ``name``, or None.

    The result is TensorFlow's restore-on-create callable: called with
    ``shape``, ``dtype`` and a ``shard_info`` it reads only those rows.
    """
    # pylint: disable=protected-access
    self._owner._maybe_initialize_trackable()
    return self._owner._preload_simple_restoration(name=name)

  @staticmethod
  def mark_restored(variable: Any, restore: Any) -> None:
    """Records that ``variable`` took its value from ``restore`` already.

    Tracking it afterwards then does not read the checkpoint again.
    """
    # pylint: disable=protected-access
    variable._maybe_initialize_trackable()
    variable._update_uid = restore.restore_uid
