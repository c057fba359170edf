"""Adagrad for embedding tables.

Example:
  >>> import tpu_embedding as tpe
  >>> tpe.Adagrad(learning_rate=0.1).SLOT_NAMES
  ('accumulators',)
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
from tpu_embedding.optimizers.base import constant_initializer
from tpu_embedding.optimizers.base import shared_arguments


class AdagradSlots(NamedTuple):
  """Adagrad's slot rows."""

  accumulators: tf.Tensor


class Adagrad(Optimizer):
  """Adagrad with TPU embedding semantics (no epsilon).

  For each looked-up row with summed gradient ``g``:

  .. math::

     a &\\leftarrow a + g^2 \\\\
     w &\\leftarrow w - lr \\cdot g / \\sqrt{a}

  ``a`` (slot ``accumulators``) starts at ``initial_accumulator_value``.

  Example:
    >>> import tpu_embedding as tpe
    >>> tpe.Adagrad(0.1, initial_accumulator_value=0.5)
    Adagrad(learning_rate=0.1, initial_accumulator_value=0.5)
  """

  SLOT_NAMES = ("accumulators",)
  Slots = AdagradSlots
  FUSED_RULE = "adagrad"

  def __init__(
    self,
    learning_rate: LearningRate = 0.001,
    initial_accumulator_value: float = 0.1,
    use_gradient_accumulation: bool = True,
    clip_weight_min: float | None = None,
    clip_weight_max: float | None = None,
    weight_decay_factor: float | None = None,
    multiply_weight_decay_factor_by_learning_rate: bool | None = None,
    slot_variable_creation_fn: SlotVariableCreationFn | None = None,
    clipvalue: ClipValue | None = None,
    low_dimensional_packing_status: bool = False,
  ):
    """Creates the Adagrad configuration.

    Args:
      learning_rate: float, or a zero-argument callable for a dynamic rate.
      initial_accumulator_value: initial accumulator, must be > 0.
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
    check_initial_accumulator(initial_accumulator_value)
    self.initial_accumulator_value = initial_accumulator_value

  def slot_initializers(self) -> list[Initializer]:
    return [constant_initializer(self.initial_accumulator_value)]

  def _rule(
    self,
    params: tf.Tensor,
    slots: AdagradSlots,
    grads: tf.Tensor,
    lr: tf.Tensor,
  ) -> tuple[tf.Tensor, AdagradSlots]:
    accumulators = slots.accumulators + tf.square(grads)
    # divide_no_nan (the accumulators are > 0): a plain division by a
    # square root is rewritten in graphs into a multiplication by rsqrt,
    # whose rounding differs; this keeps the IEEE quotient everywhere, as
    # the fused kernel (tpu_embedding/kernels) computes it.
    params = params - tf.math.divide_no_nan(lr * grads, tf.sqrt(accumulators))
    return params, AdagradSlots(accumulators)
