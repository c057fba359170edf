"""One feature's global batch as samples and ids, in TensorFlow's order.

Each chip gets a contiguous ``1/num_chips`` of a global batch (as
``experimental_distribute_dataset`` splits it). A dense ``[B, ...]`` input
has one sample per id (TensorFlow's ``output_shape`` is the input's shape:
a sequence); a ragged or sparse ``[B, None]`` input has one sample per row
(combined). ``feature_ids`` gives, for every id, its chip and its sample
within that chip's share.

Example:
  >>> import numpy as np
  >>> from tpu_embedding.fdo import samples
  >>> x = samples.feature_ids(np.array([[3, 4], [5, 6]]), "f", num_chips=2)
  >>> x.chip.tolist(), x.row.tolist(), x.sample_count, x.output_shape
  ([0, 0, 1, 1], [0, 1, 0, 1], 2, (1, 2))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import tensorflow as tf


@dataclasses.dataclass
class SampleIds:
  """One feature's ids of one global batch, in TensorFlow's sample order."""

  chip: np.ndarray  # which chip's share of the batch the sample is in
  row: np.ndarray  # the sample, within that chip's share
  ids: np.ndarray
  sample_count: int  # samples per chip
  output_shape: tuple[int, ...]  # per chip


def _to_numpy(x: Any) -> np.ndarray:
  return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def feature_ids(
  x: Any, path: str, num_chips: int, rows_are_samples: bool = False
) -> SampleIds:
  """``x`` (one global batch of feature ``path``) as samples and ids.

  ``rows_are_samples``: a dense ``[B, k, ...]`` input is ``B`` samples
  (jax-tpu-embedding's rule) instead of one sample per id (TensorFlow's).
  """
  if isinstance(x, (tf.RaggedTensor, tf.compat.v1.ragged.RaggedTensorValue)):
    if x.ragged_rank != 1 or len(x.shape) != 2:
      raise ValueError(
        f"Feature {path!r}: a ragged input must be [batch, None]; got shape "
        f"{x.shape}."
      )
    splits = _to_numpy(x.row_splits).astype(np.int64)
    ids = _to_numpy(x.values).reshape(-1)
    batch = len(splits) - 1
    example = np.repeat(np.arange(batch), np.diff(splits))
    shape: tuple[int, ...] = (batch,)
  elif isinstance(x, (tf.SparseTensor, tf.compat.v1.SparseTensorValue)):
    dense_shape = tuple(int(d) for d in _to_numpy(x.dense_shape))
    if len(dense_shape) != 2:
      raise ValueError(
        f"Feature {path!r}: a sparse input must be [batch, N]; got dense "
        f"shape {dense_shape}."
      )
    indices = _to_numpy(x.indices)
    ids = _to_numpy(x.values).reshape(-1)
    batch = dense_shape[0]
    example = indices[:, 0].astype(np.int64)
    shape = (batch,)
  else:
    array = _to_numpy(x)
    if array.ndim == 0:
      raise ValueError(f"Feature {path!r}: a scalar is not a batch of ids.")
    batch = array.shape[0]
    shape = array.shape
    ids = array.reshape(-1)
    example = None
    if rows_are_samples and array.ndim > 1:
      example = np.repeat(np.arange(batch), math.prod(array.shape[1:]))
      shape = (batch,)
  if batch % num_chips:
    raise ValueError(
      f"Feature {path!r}: the batch of {batch} does not split over "
      f"{num_chips} chips; give global batches divisible by the number of "
      "chips (each chip gets batch / num_chips samples)."
    )
  per_chip = batch // num_chips
  output_shape = (per_chip,) + tuple(shape[1:])
  sample_count = math.prod(output_shape)
  if example is None:  # dense: every id is a sample
    position = np.arange(ids.size, dtype=np.int64)
    chip, row = np.divmod(position, sample_count)
  else:
    chip, row = np.divmod(example, per_chip)
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(
      f"Feature {path!r}: ids must be integers; got {ids.dtype}."
    )
  return SampleIds(chip, row, ids.astype(np.int64), sample_count, output_shape)


def features_of(element: Any) -> Any:
  """The features of a dataset element: ``(features, labels[, weights])``
  tuples give their first item."""
  if isinstance(element, tuple) and 1 < len(element) <= 3:
    return element[0]
  return element
