"""Per-feature activation shapes, with TensorFlow's TPU priority rules.

A feature's activation shape (without ``dim``) comes, in priority order,
from ``FeatureConfig.output_shape``, from ``build(per_replica_input_shapes)``
and from the first batch enqueued. Later batches must agree (unknown
dimensions match anything).

Example:
  >>> import tensorflow as tf
  >>> shapes = OutputShapes([tf.TensorShape(None)], ["f"])
  >>> shapes.update([tf.TensorShape([8])])
  >>> shapes.check([tf.TensorShape([8])])
  >>> shapes.shapes
  [TensorShape([8])]
"""

from __future__ import annotations

import tensorflow as tf

from tpu_embedding import errors
from tpu_embedding.config import FeatureConfig


def _matches(old: tf.TensorShape, new: tf.TensorShape) -> bool:
  return all(
    a is None or b is None or a == b
    for a, b in zip(old.as_list(), new.as_list(), strict=True)
  )


class OutputShapes:
  """The activation shape of every feature, in flattened order."""

  def __init__(self, configured: list[tf.TensorShape], paths: list[str]):
    self.shapes = [tf.TensorShape(s) for s in configured]
    self._paths = paths

  def update(self, incoming: list[tf.TensorShape]) -> None:
    """Fills the shapes not yet known from ``incoming``."""
    self.shapes = [
      old if old.rank else new
      for old, new in zip(self.shapes, incoming, strict=True)
    ]

  def check(self, incoming: list[tf.TensorShape]) -> None:
    """Raises ValueError where ``incoming`` contradicts a known shape."""
    for path, old, new in zip(self._paths, self.shapes, incoming, strict=True):
      if not old.rank or not new.rank:
        continue
      if new.rank in (1, 2) and old.rank > new.rank:
        continue  # A ragged sequence input; checked when it is looked up.
      if old.rank != new.rank or not _matches(old, new):
        raise ValueError(
          errors.INCONSISTENT_SHAPE.format(path=path, old=old, new=new)
        )


def output_shapes_from_input_shapes(
  input_shapes: list[tf.TensorShape], features: list[FeatureConfig]
) -> list[tf.TensorShape]:
  """Activation shapes implied by per-replica input shapes (TPU rule).

  A rank-2 shape ``(B, N)`` with ``N != 1`` of a sequence feature gives
  ``(B, L)``; a rank-1 shape is kept; otherwise the last dimension (the ids
  of one example) is dropped.

  Raises:
    ValueError: for a shape of unknown rank or rank 0.
  """
  outputs = []
  for shape, feature in zip(input_shapes, features, strict=True):
    shape = tf.TensorShape(shape)
    if shape.rank is None or shape.rank < 1:
      raise ValueError(
        f"Received input tensor of shape {shape}. Rank must be 1 and above"
      )
    if (
      shape.rank == 2
      and shape[-1] != 1
      and not feature.output_shape.rank
      and feature.max_sequence_length > 0
    ):
      shape = tf.TensorShape([shape[0], feature.max_sequence_length, None])
    outputs.append(shape if shape.rank == 1 else shape[:-1])
  return outputs


def output_shapes_from_batch_size(
  batch_size: int, features: list[FeatureConfig]
) -> list[tf.TensorShape]:
  """Activation shapes for a per-replica batch size (deprecated TF form)."""
  return [
    tf.TensorShape([batch_size, f.max_sequence_length])
    if f.max_sequence_length > 0 and not f.output_shape.rank
    else tf.TensorShape([batch_size])
    for f in features
  ]
