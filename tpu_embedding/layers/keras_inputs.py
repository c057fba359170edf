"""Inputs the lookup does not take from Keras: lone ids, symbolic stand-ins.

tensorflow-recommenders' layers and ``keras.layers.Embedding`` take scalar
ids and rank-1 sparse ids (``batch_lone_ids``); Keras 3 infers a layer's
output by calling it on stand-ins (``symbolic_activations``, ``InputKinds``).
``base.EmbeddingLayer`` brings both to the lookup's terms around each call.

Example:
  >>> import tensorflow as tf
  >>> ids, _, scalar = batch_lone_ids({"a": 3, "b": tf.constant([1, 2])}, None)
  >>> ids["a"].numpy().tolist(), scalar
  ([3], [True, False])
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from tpu_embedding.inputs import prepare_feature
from tpu_embedding.resolved import ResolvedConfig


def _is_scalar_id(inp: Any) -> bool:
  if isinstance(inp, (int, np.integer)) and not isinstance(inp, bool):
    return True
  return isinstance(inp, tf.Tensor) and inp.shape.rank == 0


def batch_lone_ids(features: Any, weights: Any) -> tuple[Any, Any, list[bool]]:
  """Scalar ids as a batch of one; rank-1 sparse ids as one id per example.

  tensorflow-recommenders' layers (off TPU) and ``keras.layers.Embedding``
  take both; the mid-level API needs a batch dimension, and for sparse ids
  an id dimension:

  - a scalar id ``i`` (a Python int or a rank-0 tensor) becomes ``[i]``;
    ``unbatch_scalars`` turns its ``[1, dim]`` activation back into
    ``[dim]``: row ``i`` of the table, as TensorFlow's serving lookup;
  - a rank-1 ``SparseTensor`` of dense shape ``[n]`` (tf-keras' placeholder
    for ``Input(shape=(), sparse=True)``) becomes ``[n, 1]``: example
    ``b`` has the id at position ``b``, or none (zeros).

  Args:
    features: a nest of ids (already checked against the feature config).
    weights: None or a nest like ``features``.

  Returns:
    ``(features, weights, scalar)``; ``scalar`` flags, in
    ``tf.nest.flatten`` order, the features that were scalars.
  """
  flat = tf.nest.flatten(features, expand_composites=False)
  flat_weights = (
    [None] * len(flat)
    if weights is None
    else tf.nest.flatten(weights, expand_composites=False)
  )
  scalar = [_is_scalar_id(inp) for inp in flat]
  new_ids, new_weights = [], []
  for inp, weight, is_scalar in zip(flat, flat_weights, scalar, strict=True):
    if is_scalar:
      inp = tf.reshape(inp, [1])
    elif isinstance(inp, tf.SparseTensor) and inp.shape.rank == 1:
      inp = tf.sparse.expand_dims(inp, -1)
      if isinstance(weight, tf.SparseTensor) and weight.shape.rank == 1:
        weight = tf.sparse.expand_dims(weight, -1)
    new_ids.append(inp)
    new_weights.append(weight)
  features = tf.nest.pack_sequence_as(features, new_ids)
  if weights is not None:
    weights = tf.nest.pack_sequence_as(weights, new_weights)
  return features, weights, scalar


def unbatch_scalars(activations: Any, scalar: list[bool]) -> Any:
  """``[1, ...]`` activations of scalar ids as ``[...]`` (see above)."""
  if not any(scalar):
    return activations
  flat = tf.nest.flatten(activations)
  flat = [
    tf.squeeze(out, 0) if is_scalar else out
    for out, is_scalar in zip(flat, scalar, strict=True)
  ]
  return tf.nest.pack_sequence_as(activations, flat)


class InputKinds:
  """What kind of ids a layer has been given, per feature.

  Keras 3 traces layers with stand-ins: dense placeholders for sparse and
  ragged inputs too (building a model from a batch of data), or the mean
  of the first batch over the replicas (float ids). A dense ``[batch, n]``
  stand-in (``n != 1``) is then ambiguous: ids combined per example
  (``[batch, dim]``) or dense multi-hot ids (``[batch, n, dim]``). The
  layer records what it is really given and resolves the ambiguity so:

  * a feature seen sparse or ragged: combined;
  * a feature seen as real dense multi-hot ids: multi-hot;
  * a mean (floats) or an unknown ``n``: combined;
  * a placeholder without a batch size
    (``keras.Input(shape=(n,), dtype="int64")``): multi-hot;
  * otherwise (Keras building a model from a batch before any call):
    combined, the TPU rule. A model whose first call would be such a build
    with dense multi-hot ids must be built by calling it on a batch first.
  """

  def __init__(self) -> None:
    self.combined: set[str] = set()
    self.multi_hot: set[str] = set()

  def record(
    self, features: Any, config: ResolvedConfig, symbolic: bool
  ) -> None:
    """Remembers the kinds of ids given (dense only from real calls)."""
    for inp, path in zip(
      tf.nest.flatten(features, expand_composites=False),
      config.paths,
      strict=True,
    ):
      if isinstance(inp, (tf.SparseTensor, tf.RaggedTensor)):
        self.combined.add(path)
      elif not symbolic and _several_ids(inp):
        self.multi_hot.add(path)

  def stands_for_combined(self, inp: Any, path: str) -> bool:
    """Whether a dense stand-in with several ids per row is combined."""
    if path in self.combined:
      return True
    if path in self.multi_hot:
      return False
    if not inp.dtype.is_integer or inp.shape[-1] is None:
      return True
    return inp.shape[0] is not None


def _several_ids(inp: Any) -> bool:
  """A dense tensor with a last dimension other than 1 (rank 2 or more)."""
  shape = inp.shape
  return isinstance(inp, tf.Tensor) and (shape.rank or 0) > 1 and shape[-1] != 1


def _symbolic_ids(inp: Any, path: str, kinds: InputKinds) -> Any:
  """What Keras' shape tracing passes, as ids of the kind it stands for."""
  combined = _several_ids(inp) and kinds.stands_for_combined(inp, path)
  if not inp.dtype.is_integer:
    inp = tf.cast(inp, tf.int64)
  return tf.sparse.from_dense(inp) if combined else inp


def symbolic_activations(
  features: Any, config: ResolvedConfig, kinds: InputKinds
) -> Any:
  """Zero activations of the right shapes, without looking anything up.

  Used while Keras traces a layer only for its output shapes (see
  ``InputKinds``).
  """
  kinds.record(features, config, symbolic=True)
  outputs = []
  for inp, feature, path in zip(
    tf.nest.flatten(features, expand_composites=False),
    config.features,
    config.paths,
    strict=True,
  ):
    prepared = prepare_feature(
      _symbolic_ids(inp, path, kinds),
      None,
      feature,
      path,
      check_ids=False,
    )
    zeros = tf.zeros(
      tf.concat([prepared.output_shape, [feature.table.dim]], axis=0)
    )
    zeros.set_shape(prepared.static_shape.concatenate([feature.table.dim]))
    outputs.append(zeros)
  return tf.nest.pack_sequence_as(config.structure, outputs)
