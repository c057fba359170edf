"""FTRL-Proximal for embedding tables.

Example:
  >>> import tpu_embedding as tpe
  >>> tpe.FTRL(0.1).SLOT_NAMES
  ('accumulators', 'linears')
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from tpu_embedding.initializers import Initializer
from tpu_embedding.optimizers.base import ClipValue
from tpu_embedding.optimizers.base import LearningRate
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.optimizers.base import SlotVariableCreationFn
from tpu_embedding.optimizers.base import check_initial_accumulator
from tpu_embedding.optimizers.base import check_number
from tpu_embedding.optimizers.base import constant_initializer
from tpu_embedding.optimizers.base import shared_arguments


class FtrlSlots(NamedTuple):
  """FTRL's slot rows."""

  accumulators: tf.Tensor
  linears: tf.Tensor


class FTRL(Optimizer):
  """FTRL-Proximal (McMahan et al. 2013, Algorithm 1), TPU semantics.

  With ``p = learning_rate_power`` (-0.5 gives the paper's square root),
  for each row with summed gradient ``g``:

  .. math::

     n' &= n + g^2 \\\\
     \\sigma &= (n'^{-p} - n^{-p}) / lr \\\\
     z &\\leftarrow z + g - \\sigma w \\\\
     q &= (n'^{-p} + \\beta) / lr + 2 l_2 \\\\
     w &\\leftarrow \\begin{cases}
        (\\mathrm{sign}(z) l_1 - z) / q & |z| > l_1 \\\\
        0 & \\text{otherwise}\\end{cases} \\\\
     n &\\leftarrow n'

  ``n`` is slot ``accumulators``, ``z`` slot ``linears``. With
  ``multiply_linear_by_learning_rate=True`` the slot stores ``lr * z``:
  ``z += lr g - (n'^{-p} - n^{-p}) w``, ``q = n'^{-p} + \\beta + 2 l_2 lr``
  and the threshold is ``l_1 lr``. ``beta / (2 lr)`` added to ``l2``
  gives the equivalent Keras FTRL.

  Example:
    >>> import tpu_embedding as tpe
    >>> tpe.FTRL(0.1, l1_regularization_strength=0.01)
    FTRL(learning_rate=0.1, l1_regularization_strength=0.01)
  """

  SLOT_NAMES = ("accumulators", "linears")
  SLOTS_IN_16_BITS = ()
  SLOTS_IN_16_BITS_WHY = (
    "its linears accumulate differences of large terms, which 16 bits cancel"
  )
  Slots = FtrlSlots

  def __init__(
    self,
    learning_rate: LearningRate = 0.001,
    learning_rate_power: float = -0.5,
    l1_regularization_strength: float = 0.0,
    l2_regularization_strength: float = 0.0,
    beta: float = 0.0,
    initial_accumulator_value: float = 0.1,
    use_gradient_accumulation: bool = True,
    clip_weight_min: float | None = None,
    clip_weight_max: float | None = None,
    weight_decay_factor: float | None = None,
    multiply_weight_decay_factor_by_learning_rate: bool | None = None,
    slot_variable_creation_fn: SlotVariableCreationFn | None = None,
    clipvalue: ClipValue | None = None,
    multiply_linear_by_learning_rate: bool = False,
    allow_zero_accumulator: bool = False,
    low_dimensional_packing_status: bool = False,
  ):
    """Creates the FTRL configuration.

    Args:
      learning_rate: float, or a zero-argument callable for a dynamic rate.
      learning_rate_power: ``p <= 0``; 0 gives a fixed learning rate.
      l1_regularization_strength: ``l1 >= 0``.
      l2_regularization_strength: ``l2 >= 0``.
      beta: the paper's beta, ``>= 0``.
      initial_accumulator_value: initial ``n``, must be > 0.
      use_gradient_accumulation: TPU option; off TPU duplicates are summed.
      clip_weight_min: minimum weight after the update; None: -infinity.
      clip_weight_max: maximum weight after the update; None: +infinity.
      weight_decay_factor: decoupled weight decay; None: no decay.
      multiply_weight_decay_factor_by_learning_rate: scale the decay by lr.
      slot_variable_creation_fn: ``(table, slot_names, initializers) ->
        {slot_name: variable}`` to create the slots yourself.
      clipvalue: gradient clipping: ``c`` for ``[-c, c]`` or ``(min, max)``.
      multiply_linear_by_learning_rate: store ``lr * z`` in ``linears``;
        robust to zero and near-zero learning rates.
      allow_zero_accumulator: guard the formulas against a zero ``n``.
      low_dimensional_packing_status: TPU memory-packing option.

    Raises:
      ValueError: for an invalid hyper-parameter.
    """
    super().__init__(**shared_arguments(locals()))
    check_initial_accumulator(initial_accumulator_value)
    check_number("learning_rate_power", learning_rate_power)
    if learning_rate_power > 0:
      raise ValueError(
        "Argument `learning_rate_power` must be <= 0. "
        f"Received: {learning_rate_power}"
      )
    check_number(
      "l1_regularization_strength", l1_regularization_strength, minimum=0.0
    )
    check_number(
      "l2_regularization_strength", l2_regularization_strength, minimum=0.0
    )
    check_number("beta", beta, minimum=0.0)
    self.initial_accumulator_value = initial_accumulator_value
    self.learning_rate_power = learning_rate_power
    self.l1_regularization_strength = l1_regularization_strength
    self.l2_regularization_strength = l2_regularization_strength
    self.beta = beta
    self.multiply_linear_by_learning_rate = multiply_linear_by_learning_rate
    self.allow_zero_accumulator = allow_zero_accumulator

  def slot_initializers(self) -> list[Initializer]:
    return [
      constant_initializer(self.initial_accumulator_value),
      constant_initializer(),
    ]

  def _rule(
    self, params: tf.Tensor, slots: FtrlSlots, grads: tf.Tensor, lr: tf.Tensor
  ) -> tuple[tf.Tensor, FtrlSlots]:
    power = -self.learning_rate_power
    l1 = self.l1_regularization_strength
    l2 = self.l2_regularization_strength
    old_n = slots.accumulators
    new_n = old_n + tf.square(grads)
    sigma_lr = tf.pow(new_n, power) - tf.pow(old_n, power)
    if self.multiply_linear_by_learning_rate:
      linears = slots.linears + lr * grads - sigma_lr * params
      quadratic = tf.pow(new_n, power) + self.beta + 2.0 * l2 * lr
      threshold = l1 * lr
    else:
      linears = slots.linears + grads - sigma_lr / lr * params
      quadratic = (tf.pow(new_n, power) + self.beta) / lr + 2.0 * l2
      threshold = l1
    numerator = tf.sign(linears) * threshold - linears
    if self.allow_zero_accumulator:
      shrunk = tf.math.divide_no_nan(numerator, quadratic)
    else:
      shrunk = numerator / quadratic
    params = tf.where(
      tf.abs(linears) > threshold, shrunk, tf.zeros_like(params)
    )
    return params, FtrlSlots(new_n, linears)
