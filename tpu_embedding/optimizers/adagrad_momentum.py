"""Adagrad with momentum for embedding tables.

Example:
  >>> import tpu_embedding as tpe
  >>> tpe.AdagradMomentum(0.1, momentum=0.9).SLOT_NAMES
  ('accumulators', 'momenta')
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


class AdagradMomentumSlots(NamedTuple):
  """AdagradMomentum's slot rows."""

  accumulators: tf.Tensor
  momenta: tf.Tensor


class AdagradMomentum(Optimizer):
  """Adagrad with momentum, TPU embedding semantics.

  For each looked-up row with summed gradient ``g`` (``k = exponent``):

  .. math::

     a &\\leftarrow \\begin{cases} a + g^2 & \\beta_2 = 1 \\\\
         \\beta_2 a + (1 - \\beta_2) g^2 & \\text{otherwise}\\end{cases} \\\\
     u &= g \\cdot (a + \\epsilon)^{-1/k} \\\\
     m &\\leftarrow \\mu m + u \\\\
     w &\\leftarrow w - lr \\cdot (\\mu m + u \\text{ if nesterov else } m)

  ``a`` is slot ``accumulators`` and ``m`` slot ``momenta``; both start at 0.

  Example:
    >>> import tpu_embedding as tpe
    >>> tpe.AdagradMomentum(0.1, momentum=0.9, use_nesterov=True)
    AdagradMomentum(learning_rate=0.1, momentum=0.9, use_nesterov=True)
  """

  SLOT_NAMES = ("accumulators", "momenta")
  Slots = AdagradMomentumSlots

  def __init__(
    self,
    learning_rate: LearningRate = 0.001,
    momentum: float = 0.0,
    use_nesterov: bool = False,
    exponent: float = 2,
    beta2: float = 1,
    epsilon: float = 1e-10,
    use_gradient_accumulation: bool = True,
    clip_weight_min: float | None = None,
    clip_weight_max: float | None = None,
    weight_decay_factor: float | None = None,
    multiply_weight_decay_factor_by_learning_rate: bool | None = None,
    slot_variable_creation_fn: SlotVariableCreationFn | None = None,
    clipvalue: ClipValue | None = None,
    low_dimensional_packing_status: bool = False,
  ):
    """Creates the AdagradMomentum configuration.

    Args:
      learning_rate: float, or a zero-argument callable for a dynamic rate.
      momentum: moving-average parameter ``mu`` of the momentum.
      use_nesterov: use the Nesterov variant of momentum.
      exponent: exponent ``k > 0`` of the Adagrad preconditioner.
      beta2: moving-average parameter of the accumulator, in (0, 1].
      epsilon: positive constant added to the accumulator.
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
    check_number("epsilon", epsilon)
    if epsilon <= 0:
      raise ValueError("Adagrad momentum: epsilon must be positive")
    check_number("exponent", exponent)
    if exponent <= 0:
      raise ValueError("Adagrad momentum: Precondition exponent must >0")
    check_number("momentum", momentum, minimum=0.0)
    check_number("beta2", beta2)
    if not 0.0 < beta2 <= 1.0:
      raise ValueError(f"Argument `beta2` must be in (0, 1]. Received: {beta2}")
    self.momentum = momentum
    self.use_nesterov = use_nesterov
    self.exponent = exponent
    self.beta2 = beta2
    self.epsilon = epsilon

  def slot_initializers(self) -> list[Initializer]:
    return [constant_initializer(), constant_initializer()]

  def _rule(
    self,
    params: tf.Tensor,
    slots: AdagradMomentumSlots,
    grads: tf.Tensor,
    lr: tf.Tensor,
  ) -> tuple[tf.Tensor, AdagradMomentumSlots]:
    if self.beta2 == 1.0:
      accumulators = slots.accumulators + tf.square(grads)
    else:
      accumulators = self.beta2 * slots.accumulators + (
        1.0 - self.beta2
      ) * tf.square(grads)
    scaled = grads * tf.pow(accumulators + self.epsilon, -1.0 / self.exponent)
    momenta = self.momentum * slots.momenta + scaled
    if self.use_nesterov:
      step = self.momentum * momenta + scaled
    else:
      step = momenta
    params = params - lr * step
    return params, AdagradMomentumSlots(accumulators, momenta)
