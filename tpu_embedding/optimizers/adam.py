"""Adam (lazy by default) for embedding tables.

Example:
  >>> import tpu_embedding as tpe
  >>> tpe.Adam(0.01).SLOT_NAMES
  ('momenta', 'velocities')
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from tpu_embedding.initializers import Initializer
from tpu_embedding.optimizers.base import ClipValue
from tpu_embedding.optimizers.base import LearningRate
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.optimizers.base import SlotVariableCreationFn
from tpu_embedding.optimizers.base import check_number
from tpu_embedding.optimizers.base import constant_initializer
from tpu_embedding.optimizers.base import shared_arguments


class AdamSlots(NamedTuple):
  """Adam's slot rows."""

  momenta: tf.Tensor
  velocities: tf.Tensor


class Adam(Optimizer):
  """Adam with TPU embedding semantics (no bias correction).

  For each row with summed gradient ``g``:

  .. math::

     m &\\leftarrow \\beta_1 m + (1 - \\beta_1) g \\\\
     v &\\leftarrow \\beta_2 v + (1 - \\beta_2) g^2 \\\\
     w &\\leftarrow w - lr \\cdot m / \\sqrt{v + \\epsilon^2}
        && \\text{(sum\\_inside\\_sqrt=True, the default)} \\\\
     w &\\leftarrow w - lr \\cdot m / (\\sqrt{v} + \\epsilon)
        && \\text{(sum\\_inside\\_sqrt=False)}

  With ``lazy_adam=True`` (default) only looked-up rows change. With
  ``lazy_adam=False`` every row of the table is updated each step (rows not
  in the batch with ``g = 0``), which reads and writes the whole table.
  For bias correction, pass a callable learning rate
  ``lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)``, as on TPU.

  Example:
    >>> import tpu_embedding as tpe
    >>> tpe.Adam(0.01, sum_inside_sqrt=False)
    Adam(learning_rate=0.01, sum_inside_sqrt=False)
  """

  SLOT_NAMES = ("momenta", "velocities")
  Slots = AdamSlots
  SLOTS_IN_16_BITS = ()
  SLOTS_IN_16_BITS_WHY = (
    "its velocities average squared gradients (often below float16's 6e-8) "
    "and a 16-bit momentum's rounding biases every step"
  )

  def __init__(
    self,
    learning_rate: LearningRate = 0.001,
    beta_1: float = 0.9,
    beta_2: float = 0.999,
    epsilon: float = 1e-07,
    lazy_adam: bool = True,
    sum_inside_sqrt: bool = True,
    use_gradient_accumulation: bool = True,
    clip_weight_min: float | None = None,
    clip_weight_max: float | None = None,
    weight_decay_factor: float | None = None,
    multiply_weight_decay_factor_by_learning_rate: bool | None = None,
    slot_variable_creation_fn: SlotVariableCreationFn | None = None,
    clipvalue: ClipValue | None = None,
    low_dimensional_packing_status: bool = False,
  ):
    """Creates the Adam configuration.

    Args:
      learning_rate: float, or a zero-argument callable for a dynamic rate.
      beta_1: decay of the first moment, in [0, 1).
      beta_2: decay of the second moment, in [0, 1).
      epsilon: a small positive constant for numerical stability.
      lazy_adam: update only looked-up rows (True) or all rows (False).
      sum_inside_sqrt: use ``m / sqrt(v + eps**2)`` instead of
        ``m / (sqrt(v) + eps)``.
      use_gradient_accumulation: TPU option; off TPU duplicates are summed.
      clip_weight_min: minimum weight after the update; None: -infinity.
      clip_weight_max: maximum weight after the update; None: +infinity.
      weight_decay_factor: decoupled weight decay; None: no decay.
      multiply_weight_decay_factor_by_learning_rate: scale the decay by lr.
      slot_variable_creation_fn: ``(table, slot_names, initializers) ->
        {slot_name: variable}`` to create the slots yourself.
      clipvalue: gradient clipping: ``c`` for ``[-c, c]`` or ``(min, max)``.
      low_dimensional_packing_status: TPU memory-packing option.

    Raises:
      ValueError: for an invalid hyper-parameter.
    """
    super().__init__(**shared_arguments(locals()))
    check_number("beta_1", beta_1)
    check_number("beta_2", beta_2)
    if beta_1 < 0.0 or beta_1 >= 1.0:
      raise ValueError(
        f"Argument `beta_1` must be >= 0 and < 1. Received: {beta_1}."
      )
    if beta_2 < 0.0 or beta_2 >= 1.0:
      raise ValueError(
        f"Argument `beta_2` must be >= 0 and < 1. Received: {beta_2}."
      )
    check_number("epsilon", epsilon)
    if epsilon <= 0.0:
      raise ValueError(f"epsilon must be positive; got {epsilon}.")
    if not use_gradient_accumulation and not lazy_adam:
      raise ValueError(
        "When disabling lazy Adam (`lazy_adam=False`), gradient "
        "accumulation must be used. Set `use_gradient_accumulation` to "
        "True."
      )
    self.beta_1 = beta_1
    self.beta_2 = beta_2
    self.epsilon = epsilon
    self.lazy_adam = lazy_adam
    self.sum_inside_sqrt = sum_inside_sqrt

  def slot_initializers(self) -> list[Initializer]:
    return [constant_initializer(), constant_initializer()]

  @property
  def updates_all_rows(self) -> bool:
    return not self.lazy_adam

  def _rule(
    self, params: tf.Tensor, slots: AdamSlots, grads: tf.Tensor, lr: tf.Tensor
  ) -> tuple[tf.Tensor, AdamSlots]:
    momenta = self.beta_1 * slots.momenta + (1.0 - self.beta_1) * grads
    velocities = self.beta_2 * slots.velocities + (
      1.0 - self.beta_2
    ) * tf.square(grads)
    if self.sum_inside_sqrt:
      denominator = tf.sqrt(velocities + self.epsilon**2)
    else:
      denominator = tf.sqrt(velocities) + self.epsilon
    params = params - lr * momenta / denominator
    return params, AdamSlots(momenta, velocities)
