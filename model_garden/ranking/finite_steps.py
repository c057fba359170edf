"""Skipping a training step whose gradients are not finite, as a whole.

One NaN or infinite gradient element would poison the table rows and
dense weights it reaches. A ranking step therefore checks all of its
gradients (dense and embedding, on every replica) and, if any is not
finite, applies no update at all: no table row or slot changes
(``TPUEmbedding.apply_gradients(skip=...)``) and the dense optimizer
does not run (its weights, slots and iteration count stay as they are).
A zero gradient would not do: Adam or FTRL would still move their slots.

* ``all_finite(tensors)``: whether every element of every tensor is finite.
* ``on_all_replicas(finite)``: the same decision on every replica (an
  all-reduce of the replicas' verdicts), as ``skip`` requires.
* ``apply_if(optimizer, grads, variables, condition)``: a Keras optimizer
  update that happens only when ``condition`` holds, in replica context
  under any strategy (the ``tf.cond`` runs in cross-replica context where
  the strategy needs merge calls, as ``keras.mixed_precision``'s loss scale
  optimizer does).

Example:
  >>> import keras
  >>> import tensorflow as tf
  >>> from model_garden.ranking import finite_steps
  >>> v = tf.Variable([1.0, 2.0])
  >>> opt = keras.optimizers.Adam(0.1)
  >>> grads = [tf.constant([float("nan"), 1.0])]
  >>> finite = finite_steps.all_finite(grads)
  >>> finite_steps.apply_if(opt, grads, [v], finite)
  >>> bool(finite), v.numpy().tolist(), int(opt.iterations)
  (False, [1.0, 2.0], 0)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf


def all_finite(tensors: Any) -> tf.Tensor:
  """A scalar bool: every element of every tensor of the nest is finite
  (None entries are ignored)."""
  checks = [
    tf.reduce_all(tf.math.is_finite(t))
    for t in tf.nest.flatten(tensors)
    if t is not None
  ]
  if not checks:
    return tf.constant(True)
  return tf.reduce_all(tf.stack(checks))


def on_all_replicas(finite: tf.Tensor) -> tf.Tensor:
  """True when ``finite`` holds on every replica in sync (replica context).

  Every replica gets the same value, so that all of them skip or none.
  """
  context = tf.distribute.get_replica_context()
  if context is None or context.num_replicas_in_sync == 1:
    return finite
  failures = context.all_reduce(
    tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.int32)
  )
  return tf.equal(failures, 0)


def apply_if(
  optimizer: Any,
  grads: Sequence[tf.Tensor],
  variables: Sequence[tf.Variable],
  condition: tf.Tensor,
) -> None:
  """``optimizer.apply_gradients`` only when ``condition`` is true.

  Call it in replica context (inside ``strategy.run``) or outside any
  strategy, with a ``condition`` that is the same on every replica.
  """

  def apply(grads: Any) -> None:
    optimizer.apply_gradients(zip(grads, variables, strict=True))

  if tf.__internal__.distribute.strategy_supports_no_merge_call():
    tf.cond(condition, lambda: apply(grads), lambda: None)
    return

  def in_cross_replica_context(distribution, grads, condition):
    # Every replica holds the same condition: take the first one's.
    condition = distribution.experimental_local_results(condition)[0]
    tf.cond(
      condition,
      lambda: distribution.extended.call_for_each_replica(apply, args=(grads,)),
      lambda: None,
    )

  tf.distribute.get_replica_context().merge_call(
    in_cross_replica_context, args=(list(grads), condition)
  )
