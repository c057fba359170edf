"""``CrossNetwork``: DCN v2's cross layers, full rank or low rank.

Each layer crosses the input ``x0`` with the previous layer's output
``x_l`` (Wang et al. 2020, DCN V2, Eq. 1 and 2):

.. code-block:: text

  full rank:  x_{l+1} = x0 * (W x_l + b) + x_l          W: d x d
  low rank:   x_{l+1} = x0 * (V (U x_l) + b) + x_l      U: r x d, V: d x r

where ``*`` is elementwise. One full-rank layer is
``tfrs.layers.feature_interaction.Cross()``, what Model Garden's
``dcn_criteo`` uses; ``num_layers`` low-rank layers are ``MultiLayerDCN``
(``dlrm_dcn_v2_criteo``: 3 layers of rank 512). Inputs are a tensor
``(batch, d)`` or a list of tensors concatenated on the last axis.

Example:
  >>> import numpy as np
  >>> from model_garden.ranking.layers import CrossNetwork
  >>> cross = CrossNetwork(num_layers=2, projection_dim=3)
  >>> tuple(cross(np.ones((4, 6), np.float32)).shape)
  (4, 6)
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="ranking")
class CrossNetwork(keras.layers.Layer):
  """Stacked cross layers ``x_{l+1} = x0 * (W x_l + b) + x_l``.

  Args:
    num_layers: cross layers in the stack.
    projection_dim: None for full-rank kernels ``W``; else the rank ``r``
      of ``W = V U``.
    use_bias: whether the layers add ``b``.
    kernel_initializer: Keras initializer of the kernels.
    bias_initializer: Keras initializer of the biases.
    **kwargs: ``keras.layers.Layer`` arguments.

  Input: ``(batch, d)`` or a list of ``(batch, d_i)`` (concatenated).
  Output: ``(batch, d)``.

  Example:
    >>> from model_garden.ranking.layers import CrossNetwork
    >>> CrossNetwork().get_config()["projection_dim"] is None
    True
  """

  def __init__(
    self,
    num_layers: int = 1,
    projection_dim: int | None = None,
    use_bias: bool = True,
    kernel_initializer: Any = "truncated_normal",
    bias_initializer: Any = "zeros",
    **kwargs: Any,
  ):
    super().__init__(**kwargs)
    if num_layers < 1:
      raise ValueError(f"num_layers must be >= 1, got {num_layers}.")
    if projection_dim is not None and projection_dim < 1:
      raise ValueError(
        f"projection_dim must be None or >= 1, got {projection_dim}."
      )
    self.num_layers = num_layers
    self.projection_dim = projection_dim
    self.use_bias = use_bias
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.bias_initializer = keras.initializers.get(bias_initializer)

  @property
  def kernels(self) -> list[keras.layers.Dense]:
    """Each layer's ``W`` (full rank) or ``V`` (low rank), with ``b``."""
    if not self.built:
      return []
    suffix = "" if self.projection_dim is None else "_v"
    return [getattr(self, f"cross_{i}{suffix}") for i in range(self.num_layers)]

  @property
  def projections(self) -> list[keras.layers.Dense]:
    """Each low-rank layer's ``U`` (empty for full rank)."""
    if not self.built or self.projection_dim is None:
      return []
    return [getattr(self, f"cross_{i}_u") for i in range(self.num_layers)]

  def _initializer(self) -> keras.initializers.Initializer:
    """A fresh copy, so that every kernel gets its own values."""
    config = self.kernel_initializer.get_config()
    return type(self.kernel_initializer).from_config(config)

  def build(self, input_shape: Any) -> None:
    if isinstance(input_shape, list):
      width = sum(int(s[-1]) for s in input_shape)
    else:
      width = int(input_shape[-1])
    shape = (None, width)
    # One attribute per layer (not a list): TensorFlow checkpoints track
    # attributes, and Keras 3 lists are invisible to them.
    for i in range(self.num_layers):
      if self.projection_dim is not None:
        project = keras.layers.Dense(
          self.projection_dim,
          use_bias=False,
          kernel_initializer=self._initializer(),
          name=f"cross_{i}_u",
          dtype=self.dtype_policy,
        )
        project.build(shape)
        setattr(self, f"cross_{i}_u", project)
      name = f"cross_{i}" if self.projection_dim is None else f"cross_{i}_v"
      kernel = keras.layers.Dense(
        width,
        use_bias=self.use_bias,
        kernel_initializer=self._initializer(),
        bias_initializer=self.bias_initializer,
        name=name,
        dtype=self.dtype_policy,
      )
      kernel.build(
        shape if self.projection_dim is None else (None, self.projection_dim)
      )
      setattr(self, name, kernel)

  def call(self, inputs: Any) -> Any:
    x0 = (
      ops.concatenate(inputs, axis=-1) if isinstance(inputs, list) else inputs
    )
    x = x0
    projections = self.projections
    for i, kernel in enumerate(self.kernels):
      projected = projections[i](x) if projections else x
      x = x0 * kernel(projected) + x
    return x

  def compute_output_shape(self, input_shape: Any) -> tuple:
    if isinstance(input_shape, list):
      width = sum(int(s[-1]) for s in input_shape)
      return (tuple(input_shape[0])[0], width)
    return tuple(input_shape)

  def get_config(self) -> dict[str, Any]:
    return {
      **super().get_config(),
      "num_layers": self.num_layers,
      "projection_dim": self.projection_dim,
      "use_bias": self.use_bias,
      "kernel_initializer": keras.initializers.serialize(
        self.kernel_initializer
      ),
      "bias_initializer": keras.initializers.serialize(self.bias_initializer),
    }
