"""Each step's update applied once: the step ids a row block has taken.

Under ``ParameterServerStrategy``, TensorFlow's ``ClusterCoordinator``
runs a step again, with the same arguments, when the worker running it
fails, even if the step's update had already landed on the parameter
servers. With a step id (``apply_gradients(step_id=...)``, an argument of
the scheduled function, so the same on the re-run), each locked block
(``update_guards.LockedUpdates``) checks its ``StepRecord`` and updates its
rows only if that id has not updated them yet: inside the block's lock,
so checking, updating and recording are one atomic step.

The record is bounded: a ring of ``SLOTS`` int64 slots on the block's
device, slot ``id % SLOTS`` holding the largest id applied there. A
re-run finds its id as long as no step ``SLOTS`` ids later has updated
the block in between (the coordinator puts a failed step back at the end
of its queue: fewer than ``SLOTS`` steps scheduled ahead of it). Beyond
that the record cannot tell, and the update runs: at least once, as
without a step id. The record is not saved: it is about the steps in
flight, which a restart does not keep.

Example:
  >>> import tensorflow as tf
  >>> record = StepRecord("/device:CPU:0", "demo_steps")
  >>> runs = tf.Variable(0)
  >>> def update():
  ...   runs.assign_add(1)
  ...   return tf.constant(True)
  >>> [bool(record.once(tf.constant(s, tf.int64), update)) for s in (7, 7, 8)]
  [True, False, True]
  >>> int(runs.numpy())
  2
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from tpu_embedding import compat

#: Slots of the ring: a re-run is recognised while fewer than this many
#: later step ids have updated the block (8 bytes each: 64 KiB a block).
SLOTS = 8192

#: A slot no step has written (every other int64 is a step id).
_EMPTY = np.iinfo(np.int64).min


class StepRecord:
  """The step ids applied to one row block, in a ring of ``SLOTS``."""

  def __init__(self, device: str | None, name: str):
    """Creates the ring on ``device`` (a plain variable, not tracked: no
    checkpoint holds it)."""
    with tf.device(device):
      self._ring = compat.ResourceVariable(
        tf.fill([SLOTS], tf.constant(_EMPTY, tf.int64)),
        name=name,
        trainable=False,
      )

  def once(
    self, step_id: tf.Tensor, update: Callable[[], tf.Tensor]
  ) -> tf.Tensor:
    """Runs ``update`` unless step ``step_id`` has run it on this block.

    Call it inside the block's lock: the check, ``update`` and the record
    of ``step_id`` must not interleave with another step's.

    Args:
      step_id: a scalar int64 tensor.
      update: makes the block's writes; returns a tensor that exists once
        they are done.

    Returns:
      A scalar bool tensor: whether ``update`` ran, existing once it (and
      the record) is done.
    """
    slot = tf.math.floormod(step_id, SLOTS)
    last = tf.gather(self._ring, slot)

    def apply() -> tf.Tensor:
      done = update()
      with tf.control_dependencies([done]):
        mark = tf.raw_ops.ResourceScatterUpdate(
          resource=self._ring.handle,
          indices=slot[None],
          updates=tf.maximum(last, step_id)[None],
        )
      with tf.control_dependencies([mark]):
        return tf.constant(True)

    return tf.cond(tf.equal(last, step_id), lambda: tf.constant(False), apply)
