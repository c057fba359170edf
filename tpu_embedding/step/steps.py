"""What ``enqueue`` hands to ``dequeue`` and ``apply_gradients``.

TensorFlow's TPU loop is three calls: ``enqueue`` (outside or inside
``strategy.run``), then ``dequeue`` and ``apply_gradients`` inside it. A
``Step`` carries one replica's prepared ids from the first call to the
others, within the same function (graph) or eagerly; ``Enqueued`` holds
per-replica values enqueued outside ``strategy.run`` until each replica's
``dequeue`` takes its own part.

Example:
  >>> import tensorflow as tf
  >>> select_replica(tf.distribute.get_strategy(), {"f": tf.constant([1])}, 0)
  {'f': <tf.Tensor: shape=(1,), dtype=int32, numpy=array([1], dtype=int32)>}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf
from absl import logging

from tpu_embedding import errors
from tpu_embedding.config import FeatureConfig
from tpu_embedding.lookup import TableBatch
from tpu_embedding.structure import flatten_with_paths


@dataclasses.dataclass
class Step:
  """One replica's enqueued ids, and (after dequeue) their table batches."""

  prepared: list
  training: bool
  graph: Any
  batches: dict[str, TableBatch] | None = None


@dataclasses.dataclass
class Enqueued:
  """Per-replica ids enqueued outside ``strategy.run`` (cross-replica)."""

  features: Any
  weights: Any
  training: bool
  graph: Any


def current_graph() -> Any:
  """The graph being built, or None when executing eagerly."""
  return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


def select_replica(
  strategy: tf.distribute.Strategy, structure: Any, replica: int
) -> Any:
  """Local replica ``replica``'s component of each distributed value."""

  def select(value):
    if isinstance(value, tf.distribute.DistributedValues):
      return strategy.experimental_local_results(value)[replica]
    return value

  return tf.nest.map_structure(select, structure)


def checked_gradients(
  gradients: Any, step: Step, features: tuple[FeatureConfig, ...]
) -> list[tf.Tensor]:
  """Flattened activation gradients, checked against the step's shapes.

  A None gradient becomes zeros (with TensorFlow's warning).

  Raises:
    ValueError: for a non-tensor gradient or one of the wrong shape; the
      message names the feature.
  """
  flat = []
  for (path, grad), prepared, feature in zip(
    flatten_with_paths(gradients), step.prepared, features, strict=True
  ):
    expected = prepared.static_shape.concatenate([feature.table.dim])
    if grad is None:
      logging.warning(
        "No gradient passed for feature %s, sending zero gradient. This "
        "may not be correct behavior for certain optimizers like Adam.",
        path,
      )
      grad = tf.zeros(
        tf.concat([prepared.output_shape, [feature.table.dim]], 0), tf.float32
      )
    elif not isinstance(grad, tf.Tensor):
      raise ValueError(errors.GRADIENT_TYPE.format(type=type(grad), path=path))
    elif not grad.shape.is_compatible_with(expected):
      raise ValueError(
        errors.GRADIENT_SHAPE.format(
          shape=grad.shape, path=path, expected=expected
        )
      )
    flat.append(grad)
  return flat


def checked_step_id(step_id: Any) -> tf.Tensor | None:
  """``apply_gradients(step_id=...)`` as a scalar int64 tensor (or None).

  Raises:
    ValueError: for a variable (a re-run step would read another value),
      or a value that is not a scalar integer.
  """
  if step_id is None:
    return None
  if isinstance(step_id, tf.Variable):
    raise ValueError(errors.STEP_ID_VARIABLE)
  try:
    tensor = tf.convert_to_tensor(step_id)
  except (TypeError, ValueError):
    tensor = None
  if (
    tensor is None
    or not tensor.dtype.is_integer
    or tensor.shape.rank not in (None, 0)
  ):
    raise ValueError(errors.STEP_ID_VALUE.format(value=step_id))
  return tf.cast(tensor, tf.int64)
