"""The ranking models' dense part: bottom MLP, interaction, top MLP.

``RankingModel`` is Model Garden's ``tfrs.experimental.models.Ranking``
without the embedding layer (``tpu_embedding`` looks the features up and
updates the tables; Keras only holds the dense layers):

.. code-block:: text

  dense_features (B, 13) ── bottom MLP ──► d (B, k)
  embeddings e_0 .. e_25 (B, dim) ─┐
                                   ├─► interaction([e_0, .., e_25, d]) ─► i
  concat_dense: [d, i], else i ──► top MLP ──► logit (B,)

``build_model(model_config)`` picks the interaction: DLRM's
``DotInteraction(skip_gather=True)``, DCN v2's full-rank ``CrossNetwork``
(one layer) or DLRM-DCNv2's low-rank ``CrossNetwork`` (``dcn_num_layers``
of rank ``dcn_low_rank_dim``), as Model Garden's ``RankingTask`` does. The
model returns logits; the click probability is their sigmoid (Model
Garden's top MLP ends in a sigmoid: the same model).

Example:
  >>> import numpy as np
  >>> from model_garden.ranking import model as ranking_model
  >>> from model_garden.ranking.configs import definitions
  >>> config = definitions.ModelConfig(
  ...   vocab_sizes=(10, 20), embedding_dim=4, bottom_mlp=(8, 4),
  ...   top_mlp=(8, 1))
  >>> model = ranking_model.build_model(config)
  >>> logits = model({"dense_features": np.ones((3, 13), np.float32),
  ...                 "embeddings": [np.ones((3, 4), np.float32)] * 2})
  >>> tuple(logits.shape)
  (3,)
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from model_garden.ranking.configs import definitions
from model_garden.ranking.layers import MLP
from model_garden.ranking.layers import CrossNetwork
from model_garden.ranking.layers import DotInteraction


class RankingModel(keras.Model):
  """Bottom MLP, feature interaction and top MLP; returns logits.

  Args:
    bottom_mlp: applied to the dense features; for the dot interaction
      its output width must equal the embeddings' width.
    interaction: takes the list ``[e_0, ..., e_{n-1}, bottom output]``.
    top_mlp: applied to the interaction (and the bottom output when
      ``concat_dense``); its last layer has 1 unit.
    concat_dense: feed the bottom MLP's output to the top MLP too.
    **kwargs: ``keras.Model`` arguments.

  Inputs: ``{"dense_features": (B, num_dense), "embeddings": [n x (B,
  dim_i)]}``. Output: ``(B,)`` logits.

  Example:
    >>> import numpy as np
    >>> from model_garden.ranking.layers import MLP, DotInteraction
    >>> from model_garden.ranking.model import RankingModel
    >>> model = RankingModel(MLP([2], final_activation="relu"),
    ...                      DotInteraction(), MLP([1]))
    >>> out = model({"dense_features": np.ones((5, 3), np.float32),
    ...              "embeddings": [np.ones((5, 2), np.float32)]})
    >>> tuple(out.shape)
    (5,)
  """

  def __init__(
    self,
    bottom_mlp: keras.layers.Layer,
    interaction: keras.layers.Layer,
    top_mlp: keras.layers.Layer,
    concat_dense: bool = True,
    **kwargs: Any,
  ):
    super().__init__(**kwargs)
    self.bottom_mlp = bottom_mlp
    self.interaction = interaction
    self.top_mlp = top_mlp
    self.concat_dense = concat_dense

  def call(self, inputs: dict[str, Any], training: bool | None = None) -> Any:
    del training  # No dropout or batch norm.
    dense = self.bottom_mlp(inputs["dense_features"])
    interaction = self.interaction(list(inputs["embeddings"]) + [dense])
    if self.concat_dense:
      interaction = ops.concatenate([dense, interaction], axis=1)
    # Logits in float32 whatever the compute dtype (mixed precision).
    return ops.cast(ops.reshape(self.top_mlp(interaction), (-1,)), "float32")


def build_interaction(
  config: definitions.ModelConfig, dtype: str | None = None
) -> keras.layers.Layer:
  """The interaction layer a ``ModelConfig`` names.

  Raises:
    ValueError: for an unknown ``interaction``.

  Example:
    >>> from model_garden.ranking.configs import definitions
    >>> from model_garden.ranking.model import build_interaction
    >>> layer = build_interaction(definitions.ModelConfig(
    ...   interaction="multi_layer_dcn", dcn_low_rank_dim=32))
    >>> layer.num_layers, layer.projection_dim
    (3, 32)
  """
  if config.interaction == "dot":
    return DotInteraction(skip_gather=True, name="dot_interaction", dtype=dtype)
  if config.interaction == "cross":
    return CrossNetwork(num_layers=1, name="cross", dtype=dtype)
  if config.interaction == "multi_layer_dcn":
    return CrossNetwork(
      num_layers=config.dcn_num_layers,
      projection_dim=config.dcn_low_rank_dim,
      use_bias=config.dcn_use_bias,
      kernel_initializer=config.dcn_kernel_initializer,
      bias_initializer=config.dcn_bias_initializer,
      name="multi_layer_dcn",
      dtype=dtype,
    )
  raise ValueError(
    f"interaction {config.interaction!r} is not supported; it must be one "
    f"of {definitions.INTERACTIONS}."
  )


def build_model(
  config: definitions.ModelConfig, dtype: str | None = None
) -> RankingModel:
  """The (unbuilt) dense model of a ``ModelConfig``.

  Args:
    config: the model config.
    dtype: a Keras dtype policy for every layer: None (the global one,
      float32 by default), ``"mixed_bfloat16"`` or ``"mixed_float16"``
      (``runtime.mixed_precision_dtype``): float32 weights, computations in
      16 bits, inputs cast on entry and logits returned in float32.

  Example:
    >>> from model_garden.ranking import model as ranking_model
    >>> from model_garden.ranking.configs import definitions
    >>> config = definitions.ModelConfig(vocab_sizes=(10,), embedding_dim=4,
    ...                                  bottom_mlp=(4,), top_mlp=(1,))
    >>> m = ranking_model.build_model(config, dtype="mixed_bfloat16")
    >>> logits = m(ranking_model.example_inputs(config))
    >>> top = m.top_mlp.dense_0
    >>> top.compute_dtype, top.kernel.dtype, logits.dtype.name
    ('bfloat16', 'float32', 'float32')
  """
  return RankingModel(
    bottom_mlp=MLP(
      config.bottom_mlp, final_activation="relu", name="bottom", dtype=dtype
    ),
    interaction=build_interaction(config, dtype),
    top_mlp=MLP(config.top_mlp, final_activation=None, name="top", dtype=dtype),
    concat_dense=config.concat_dense,
    name="ranking_model",
    dtype=dtype,
  )


def example_inputs(
  config: definitions.ModelConfig, batch_size: int = 1
) -> dict[str, Any]:
  """Zero inputs of the right shapes (to build the model's variables).

  Example:
    >>> from model_garden.ranking.configs import definitions
    >>> from model_garden.ranking.model import example_inputs
    >>> x = example_inputs(definitions.ModelConfig(vocab_sizes=(5, 6),
    ...                                            embedding_dim=3))
    >>> tuple(x["dense_features"].shape), len(x["embeddings"])
    ((1, 13), 2)
  """
  return {
    "dense_features": ops.zeros((batch_size, config.num_dense_features)),
    "embeddings": [
      ops.zeros((batch_size, dim)) for dim in config.embedding_dims()
    ],
  }
