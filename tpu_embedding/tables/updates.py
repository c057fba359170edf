"""Applying an optimizer to rows of a table block: the one sparse update.

Every layout updates its rows through ``apply_rows``: gather the rows and
their slots, apply the optimizer's pure row rule (``optimizers/``), and
scatter the results back. Only the given rows are read and written; the
one exception is ``Adam(lazy_adam=False)``, whose rule changes every row by
definition.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.resolved import resolve
  >>> table = resolve(tpe.FeatureConfig(tpe.TableConfig(3, 1, name="t")),
  ...                 tpe.SGD(0.5)).tables[0]
  >>> block = {"parameters": tf.Variable(tf.zeros([3, 1]))}
  >>> _ = apply_rows(table, block, tf.constant([2], tf.int64),
  ...            RowGradients.dense(tf.constant([[1.0]])), num_rows=3)
  >>> block["parameters"].numpy().ravel().tolist()
  [0.0, 0.0, -0.5]
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import RowGradients
from tpu_embedding.gradients import summed_gradients
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.row_storage import decode
from tpu_embedding.tables.rounding import BlockRounding


def apply_rows(
  table: TableConfig,
  block: dict[str, Any],
  ids: tf.Tensor,
  grads: RowGradients,
  num_rows: int,
  index: tf.Tensor | None = None,
  ops: StepOps = TENSORFLOW_OPS,
  rounding: BlockRounding | None = None,
) -> list[Any]:
  """Applies ``table.optimizer`` to rows ``ids`` of one block of variables.

  Args:
    table: the table (with its resolved optimizer).
    block: ``{"parameters": var, <slot>: var}`` holding ``num_rows`` rows
      (a whole table or one row block of it).
    ids: ``[n]`` distinct row indices into ``block``.
    grads: ``[n, dim]`` summed gradients of those rows; with ``index``,
      ``[m, dim]`` gradients of single occurrences instead (both where
      they are: ``gradients.RowGradients``).
    num_rows: rows in ``block``.
    index: None, or ``[m]`` int32: the position in ``ids`` of each row of
      ``grads``. A row's gradient is then the sum of its occurrences, added
      in occurrence order starting from zero (``unsorted_segment_sum``).
    ops: the step's row ops (``kernels/ops.py``): with the kernels', the
      fused update applies per-occurrence gradients where it can.
    rounding: how the block writes float32 results into its stored types
      (``rounding.BlockRounding``); None: the table's, for a block
      starting at row 0 (rows are read as float32 and the rule runs in
      float32 whatever they are stored in).

  Returns:
    The write operations (in a graph; None entries when eager).
  """
  optimizer = table.optimizer
  if optimizer is None:
    raise ValueError(
      f"Table '{table.name}' has no optimizer: pass one to "
      "TPUEmbedding(optimizer=...) or to its TableConfig."
    )
  if rounding is None:
    rounding = BlockRounding(table, 0, None)
  if index is not None:
    fused = ops.fused_apply(table, block, ids, grads, index, rounding)
    if fused is not None:  # One kernel: sum and update (same numbers).
      return fused
  summed = summed_gradients(ids, grads, index)
  lr = optimizer.learning_rate_tensor()
  names = optimizer.SLOT_NAMES
  if optimizer.updates_all_rows:
    dense_grads = tf.math.unsorted_segment_sum(summed, ids, num_rows)
    slots = optimizer.Slots(*(decode(block[n].read_value()) for n in names))
    params, slots = optimizer.apply(
      decode(block["parameters"].read_value()), slots, dense_grads, lr
    )
    every_row = tf.range(num_rows, dtype=tf.int64)
    keys = ("parameters", *names)
    stored = [
      rounding.encode(key, value, every_row)
      for key, value in zip(keys, (params, *slots), strict=True)
    ]
    # Written only once every value is encoded: a float16 range check
    # refuses the update before any variable changes.
    with tf.control_dependencies(stored):
      writes = [
        block[key].assign(value, read_value=False)
        for key, value in zip(keys, stored, strict=True)
      ]
      return [*writes, rounding.advance()]
  slots = optimizer.Slots(*(decode(tf.gather(block[n], ids)) for n in names))
  params = decode(tf.gather(block["parameters"], ids))
  params, slots = optimizer.apply(params, slots, summed, lr)
  keys = ("parameters", *names)
  stored = [
    rounding.encode(key, value, ids)
    for key, value in zip(keys, (params, *slots), strict=True)
  ]
  with tf.control_dependencies(stored):  # (as above)
    writes = [
      _scatter(block[key], ids, value)
      for key, value in zip(keys, stored, strict=True)
    ]
    return [*writes, rounding.advance()]


def _scatter(variable: Any, ids: tf.Tensor, rows: tf.Tensor) -> Any:
  """Writes ``rows`` at ``ids``; returns the write (None when eager)."""
  return tf.raw_ops.ResourceScatterUpdate(
    resource=variable.handle, indices=ids, updates=rows
  )
