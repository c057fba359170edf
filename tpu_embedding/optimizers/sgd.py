"""Stochastic gradient descent for embedding tables.

Example:
  >>> import tpu_embedding as tpe
  >>> tpe.SGD(learning_rate=0.1)
  SGD(learning_rate=0.1)
"""

from __future__ import annotations

import tensorflow as tf

from tpu_embedding.initializers import Initializer
from tpu_embedding.optimizers.base import ClipValue
from tpu_embedding.optimizers.base import LearningRate
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.optimizers.base import SlotRows
from tpu_embedding.optimizers.base import shared_arguments


class SGD(Optimizer):
  """Stochastic gradient descent with TPU embedding semantics.

  For each looked-up row with summed gradient ``g``:

  .. math:: w \\leftarrow w - lr \\cdot g

  It has no slot variables. Pass it as the global optimizer of
  ``TPUEmbedding`` or as a ``TableConfig``'s own optimizer.

  Example:
    >>> import tpu_embedding as tpe
    >>> table = tpe.TableConfig(vocabulary_size=10, dim=4,
    ...                         optimizer=tpe.SGD(0.2), name="t")
    >>> table.optimizer.learning_rate
    0.2
  """

  FUSED_RULE = "sgd"

  def __init__(
    self,
    learning_rate: LearningRate = 0.01,
    use_gradient_accumulation: bool = True,
    clip_weight_min: float | None = None,
    clip_weight_max: float | None = None,
    weight_decay_factor: float | None = None,
    multiply_weight_decay_factor_by_learning_rate: bool | None = None,
    clipvalue: ClipValue | None = None,
    low_dimensional_packing_status: bool = False,
  ):
    """Creates the SGD configuration.

    Args:
      learning_rate: float, or a zero-argument callable for a dynamic rate.
      use_gradient_accumulation: TPU option; off TPU duplicates are summed.
      clip_weight_min: minimum weight after the update; None: -infinity.
      clip_weight_max: maximum weight after the update; None: +infinity.
      weight_decay_factor: decoupled weight decay; None: no decay.
      multiply_weight_decay_factor_by_learning_rate: scale the decay by lr.
      clipvalue: gradient clipping: ``c`` for ``[-c, c]`` or ``(min, max)``.
      low_dimensional_packing_status: TPU memory-packing option.

    Raises:
      ValueError: for an invalid hyper-parameter.
    """
    super().__init__(**shared_arguments(locals()))

  def slot_initializers(self) -> list[Initializer]:
    return []

  def _rule(
    self, params: tf.Tensor, slots: SlotRows, grads: tf.Tensor, lr: tf.Tensor
  ) -> tuple[tf.Tensor, SlotRows]:
    return params - lr * grads, slots
