"""``MLP``: a stack of ``Dense`` layers (tensorflow_recommenders' block).

Example:
  >>> import numpy as np
  >>> from model_garden.ranking.layers import MLP
  >>> mlp = MLP([8, 4], final_activation="relu")
  >>> out = mlp(np.ones((2, 3), np.float32))
  >>> tuple(out.shape), bool((np.asarray(out) >= 0).all())
  ((2, 4), True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras


@keras.saving.register_keras_serializable(package="ranking")
class MLP(keras.layers.Layer):
  """Sequential ``Dense`` layers: ``activation`` between, ``final_activation``
  after the last.

  Args:
    units: the layers' widths, in order.
    use_bias: whether the layers have biases.
    activation: the activation of every layer but the last.
    final_activation: the activation of the last layer (None: linear).
    **kwargs: ``keras.layers.Layer`` arguments (``name``, ``dtype``).

  Example:
    >>> from model_garden.ranking.layers import MLP
    >>> MLP([16, 1]).get_config()["units"]
    [16, 1]
  """

  def __init__(
    self,
    units: Sequence[int],
    use_bias: bool = True,
    activation: str | None = "relu",
    final_activation: str | None = None,
    **kwargs: Any,
  ):
    super().__init__(**kwargs)
    if not units:
      raise ValueError("MLP needs at least one layer (units is empty).")
    self.units = [int(u) for u in units]
    self.use_bias = use_bias
    self.activation = activation
    self.final_activation = final_activation
    # One attribute per layer (not a list): TensorFlow checkpoints track
    # attributes, and Keras 3 lists are invisible to them.
    for i, width in enumerate(self.units):
      setattr(
        self,
        f"dense_{i}",
        keras.layers.Dense(
          width,
          activation=activation
          if i < len(self.units) - 1
          else final_activation,
          use_bias=use_bias,
          name=f"dense_{i}",
          dtype=self.dtype_policy,
        ),
      )

  @property
  def dense_layers(self) -> list[keras.layers.Dense]:
    """The ``Dense`` layers, in order."""
    return [getattr(self, f"dense_{i}") for i in range(len(self.units))]

  def build(self, input_shape: Any) -> None:
    shape = tuple(input_shape)
    for layer in self.dense_layers:
      layer.build(shape)
      shape = shape[:-1] + (layer.units,)

  def call(self, inputs: Any) -> Any:
    x = inputs
    for layer in self.dense_layers:
      x = layer(x)
    return x

  def compute_output_shape(self, input_shape: Any) -> tuple:
    return tuple(input_shape)[:-1] + (self.units[-1],)

  def get_config(self) -> dict[str, Any]:
    return {
      **super().get_config(),
      "units": self.units,
      "use_bias": self.use_bias,
      "activation": self.activation,
      "final_activation": self.final_activation,
    }
