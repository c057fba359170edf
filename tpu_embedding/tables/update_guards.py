"""How a store's block updates run: as they come, or one at a time.

A store is given its guard when it is made (``TableStore(guard=...)``):

* ``UNGUARDED`` — synchronous training, where one step at a time writes
  each block (one device, Mirrored, MultiWorkerMirrored): an update runs
  as it is traced.
* ``LockedUpdates`` — asynchronous training (parameter servers), where
  steps from several workers update the same rows at once: each block
  gets a ``tf.CriticalSection`` on its device, and the update reads,
  computes and writes its rows inside it, so no update is lost or
  doubled. One ``LockChain`` per backend orders a step's locked updates
  one after another, so a step never holds two locks and steps cannot
  deadlock. Each block also keeps a ``StepRecord`` (``step_record.py``):
  an update with a step id lands once, however often the step runs.

Example:
  >>> import tensorflow as tf
  >>> total = tf.Variable(0)
  >>> blocks = LockedUpdates().for_blocks("t", ["/device:CPU:0"])
  >>> add_one = lambda: [total.assign_add(1)]
  >>> for step in (7, 7, 8):  # step 7 re-run: it lands once
  ...   blocks.run(0, add_one, tf.constant(step, tf.int64))
  >>> int(total.numpy())
  2
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding.tables.step_record import StepRecord

#: A block update: traces its writes, returns them (None where none).
Writes = Callable[[], list[Any]]


class BlockGuard:
  """Runs the updates of one store's blocks as they come."""

  def run(self, block: int, update: Writes, step_id: tf.Tensor | None) -> None:
    """Runs ``update`` of local block ``block``.

    Args:
      block: the local block index.
      update: traces the block's writes.
      step_id: None, or the step's scalar int64 id (a guard that records
        steps applies a step's update once).
    """
    del block, step_id  # One writer at a time: nothing to order.
    update()


class UpdateGuard:
  """Makes each store's ``BlockGuard`` (``UNGUARDED``: updates as they come)."""

  def for_blocks(self, name: str, devices: Sequence[str | None]) -> BlockGuard:
    """The guard of a store named ``name`` with blocks on ``devices``."""
    del name, devices
    return BlockGuard()


#: Updates run as they are traced (synchronous training).
UNGUARDED = UpdateGuard()


class LockChain:
  """Runs critical sections of one traced step one after another.

  Each ``run`` waits for the previous one of the same graph (a step
  function), so a step holds at most one lock at a time.

  Example:
    >>> chain = LockChain()
    >>> bool(chain.run(tf.CriticalSection(), lambda: tf.constant(True)))
    True
  """

  def __init__(self) -> None:
    self._last: weakref.WeakKeyDictionary[tf.Graph, tf.Tensor] = (
      weakref.WeakKeyDictionary()
    )

  def run(self, lock: tf.CriticalSection, fn: Callable[[], Any]) -> Any:
    graph = tf.compat.v1.get_default_graph()
    previous = self._last.get(graph)
    with tf.control_dependencies([] if previous is None else [previous]):
      # Shared reads (a learning-rate variable) are fine: the writes are
      # to the block's own variables.
      done = lock.execute(fn, exclusive_resource_access=False)
    if not tf.executing_eagerly():
      self._last[graph] = done
    return done


class LockedUpdates(UpdateGuard):
  """Each block's updates one at a time, each step's once (parameter
  servers). One per backend: its stores' updates share one ``LockChain``.
  """

  def __init__(self) -> None:
    self._chain = LockChain()

  def for_blocks(self, name: str, devices: Sequence[str | None]) -> BlockGuard:
    return _LockedBlocks(self._chain, name, devices)


class _LockedBlocks(BlockGuard):
  """A critical section and a step record per block, on its device."""

  def __init__(
    self, chain: LockChain, name: str, devices: Sequence[str | None]
  ):
    self._chain = chain
    self._locks = []
    self._records = []
    for index, device in enumerate(devices):
      block = f"{name}_block_{index}"
      with tf.device(device):
        self._locks.append(tf.CriticalSection(name=f"{block}_lock"))
      self._records.append(StepRecord(device, f"{block}_steps"))

  def run(self, block: int, update: Writes, step_id: tf.Tensor | None) -> None:
    def locked_update() -> tf.Tensor:
      writes = update()
      # The lock is released once this result exists: after the writes.
      with tf.control_dependencies([w for w in writes if w is not None]):
        return tf.constant(True)

    lock = self._locks[block]
    if step_id is None:
      self._chain.run(lock, locked_update)
      return
    record = self._records[block]
    self._chain.run(lock, lambda: record.once(step_id, locked_update))
