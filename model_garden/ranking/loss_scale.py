"""Loss scaling for ``mixed_float16``: dynamic (Keras' rule) or fixed.

With float16 activations small gradients underflow to zero. The step
multiplies the loss by ``scale`` before differentiating and divides every
gradient (dense and embedding) by it afterwards. The dynamic scale follows
``keras.mixed_precision.LossScaleOptimizer``: it starts at ``2 ** 15``,
halves after a step whose gradients are not finite (that step is skipped
as a whole, ``finite_steps``) and doubles after ``growth_steps`` finite
steps in a row. ``runtime.loss_scale`` picks it: None or ``"dynamic"``, or
a number for a fixed scale.

The scale and the count of finite steps are variables (checkpointed with
the task) written once per step: ``ONLY_FIRST_REPLICA`` aggregation, the
replicas agree on ``finite``.

Example:
  >>> import tensorflow as tf
  >>> from model_garden.ranking.loss_scale import LossScale
  >>> scale = LossScale.from_config("dynamic", growth_steps=2)
  >>> float(scale.scale)
  32768.0
  >>> scale.update(tf.constant(False)); float(scale.scale)
  16384.0
  >>> scale.update(tf.constant(True)); scale.update(tf.constant(True))
  >>> float(scale.scale)
  32768.0
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

#: ``LossScaleOptimizer``'s defaults.
INITIAL_SCALE = 2.0**15
GROWTH_STEPS = 2000


def _variable(value: Any, dtype: tf.DType, name: str) -> tf.Variable:
  return tf.Variable(
    value,
    dtype=dtype,
    trainable=False,
    name=name,
    synchronization=tf.VariableSynchronization.ON_WRITE,
    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
  )


class LossScale(tf.Module):
  """The loss scale of a ``mixed_float16`` run (create it under the
  strategy's scope).

  Args:
    initial_scale: the starting (or fixed) scale.
    dynamic: adjust the scale after each step (else keep it fixed).
    growth_steps: finite steps in a row after which a dynamic scale
      doubles.
  """

  def __init__(
    self,
    initial_scale: float = INITIAL_SCALE,
    dynamic: bool = True,
    growth_steps: int = GROWTH_STEPS,
  ):
    super().__init__(name="loss_scale")
    if initial_scale <= 0:
      raise ValueError(
        f"runtime.loss_scale must be positive, got {initial_scale}."
      )
    self.dynamic = dynamic
    self.growth_steps = growth_steps
    self.scale = _variable(initial_scale, tf.float32, "scale")
    self.finite_steps = _variable(0, tf.int64, "finite_steps")

  @classmethod
  def from_config(
    cls, loss_scale: str | float | None, growth_steps: int = GROWTH_STEPS
  ) -> LossScale:
    """``runtime.loss_scale``: None or ``"dynamic"``, or a fixed number.

    Raises:
      ValueError: for any other text, or a scale that is not positive.
    """
    if loss_scale is None or loss_scale == "dynamic":
      return cls(INITIAL_SCALE, dynamic=True, growth_steps=growth_steps)
    if isinstance(loss_scale, str):
      raise ValueError(
        f'runtime.loss_scale must be "dynamic" or a number, got {loss_scale!r}.'
      )
    return cls(float(loss_scale), dynamic=False)

  def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
    """``loss * scale``."""
    return loss * tf.cast(self.scale, loss.dtype)

  def unscale(self, grads: Any) -> Any:
    """Each gradient of the nest divided by the scale."""
    return tf.nest.map_structure(
      lambda g: None if g is None else g / tf.cast(self.scale, g.dtype), grads
    )

  def update(self, finite: tf.Tensor) -> None:
    """After a step: halve on non-finite gradients, double after
    ``growth_steps`` finite steps (dynamic scales only)."""
    if not self.dynamic:
      return
    count = self.finite_steps + 1
    grow = tf.logical_and(finite, count >= self.growth_steps)
    scale = tf.where(
      finite,
      tf.where(grow, self.scale * 2.0, self.scale),
      tf.maximum(self.scale / 2.0, 1.0),
    )
    self.scale.assign(scale)
    self.finite_steps.assign(
      tf.where(tf.logical_and(finite, tf.logical_not(grow)), count, 0)
    )
