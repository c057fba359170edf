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

from tpu_embedding import compat
from tpu_embedding.checkpointing import rows


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
    dtype: tf.DType = tf.float32,
  ) -> Any:
    """A variable ``getter`` makes, tracked as ``name``: from the
    checkpoint restored before it existed, if any (read by TensorFlow, or
    part by part where a 16-bit type is saved or asked for: TensorFlow
    reads no type into another, nor float16 slices), else from
    ``initializer``."""
    pending = self.checked_restore(name, shape)
    saved = None if pending is None else compat.restore_dtype(pending)
    if pending is not None and (saved, dtype) != (tf.float32, tf.float32):
      variable = getter(
        name=name,
        shape=shape,
        dtype=dtype,
        initializer=tf.zeros_initializer(),
        trainable=trainable,
      )
      save_path, key = compat.restore_source(pending)
      rows.restore_rows(variable, rows.SavedRows(save_path), key)
      self.mark_restored(variable, pending)
      self.register(name, variable)
      return variable
    # Trackable's restore-on-create entry point, as TensorFlow's own
    # TPUEmbedding classes use it.
    # pylint: disable=protected-access
    return self._owner._add_variable_with_custom_getter(
      name=name,
      shape=shape,
      dtype=dtype,
      initializer=initializer,
      getter=getter,
      trainable=trainable,
    )

  def register(self, name: str, variable: Any, restore: bool = False) -> None:
    """Tracks ``variable`` as ``name``.

    Args:
      name: the checkpoint name.
      variable: a variable or other trackable.
      restore: also apply a checkpoint restored into the owner before
        ``variable`` existed (variables made by ``create`` get it anyway).
    """
    # pylint: disable=protected-access
    self._owner._track_trackable(variable, name=name, overwrite=True)
    if restore:
      self._owner._handle_deferred_dependencies(name=name, trackable=variable)

  def checked_restore(self, name: str, shape: tuple[int, int]) -> Any:
    """``pending_restore(name)``, refused where the checkpoint restored
    before build holds another shape than ``shape``."""
    pending = self.pending_restore(name)
    saved = None if pending is None else compat.restore_shape(pending)
    if saved is not None and tuple(saved) != tuple(shape):
      table, _, slot = name.partition("/")
      raise ValueError(
        f"Table '{table}': the checkpoint restored into this embedding "
        f"holds its {slot or 'parameters'} as "
        f"({', '.join(str(d) for d in saved)}), but its TableConfig gives "
        f"{tuple(shape)} (vocabulary_size, dim): restore into tables "
        "configured as the checkpoint's."
      )
    return pending

  def pending_restore(self, name: str) -> Any:
    """A pending checkpoint value of variable ``name``, or None.

    The result is TensorFlow's restore-on-create callable (called, it
    reads the value; ``compat.restore_source`` says where it is, for
    reading only some rows: ``checkpointing/rows.py``).
    """
    # pylint: disable=protected-access
    self._owner._maybe_initialize_trackable()
    return self._owner._preload_simple_restoration(name=name)

  @staticmethod
  def restored(variable: Any, restore: Any) -> bool:
    """Whether ``variable`` took its value from ``restore`` already."""
    # pylint: disable=protected-access
    variable._maybe_initialize_trackable()
    return bool(variable._update_uid >= restore.restore_uid)

  @staticmethod
  def mark_restored(variable: Any, restore: Any) -> None:
    """Records that ``variable`` took its value from ``restore`` already.

    Tracking it afterwards then does not read the checkpoint again.
    """
    # pylint: disable=protected-access
    variable._maybe_initialize_trackable()
    variable._update_uid = restore.restore_uid


class PartlyTracked(VariableTracker):
  """A tracker that leaves the variables of some tables untracked.

  A stack's store is made through it: the stack's own variables are not
  checkpointed (its member tables' views are, each under its own key).
  """

  def __init__(self, tracker: VariableTracker, untracked: set[str]):
    """Wraps ``tracker``; names ``t`` and ``t/<slot>`` of ``untracked``
    tables are created without tracking."""
    super().__init__(tracker._owner)  # pylint: disable=protected-access
    self._untracked = set(untracked)

  def _skips(self, name: str) -> bool:
    return name.split("/")[0] in self._untracked

  def create(
    self, name, shape, initializer, getter, trainable, dtype=tf.float32
  ):
    if self._skips(name):
      return getter(
        name=name,
        shape=shape,
        dtype=dtype,
        initializer=initializer,
        trainable=trainable,
      )
    return super().create(name, shape, initializer, getter, trainable, dtype)

  def register(self, name: str, variable: Any, restore: bool = False) -> None:
    if not self._skips(name):
      super().register(name, variable, restore)

  def pending_restore(self, name: str) -> Any:
    return None if self._skips(name) else super().pending_restore(name)
