"""The fused sparse update: segment sum and optimizer in one kernel.

``tables/updates.apply_rows`` asks the step's ops (``kernels/ops.py``)
first for per-occurrence gradients; the kernel ops call ``fused_apply``,
which returns None where the kernel does not apply (an optimizer without
a ``fused_rule``, or variables it cannot read), and the TensorFlow path
runs. It only ever sees variables in this process's CPU memory: the step's
ops are the kernels' only when every table lives there
(``ops.select_ops``).

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding import kernels
  >>> from tpu_embedding.resolved import resolve
  >>> table = resolve(tpe.FeatureConfig(tpe.TableConfig(3, 1, name="t")),
  ...                 tpe.SGD(0.5)).tables[0]
  >>> block = {"parameters": tf.Variable(tf.zeros([3, 1]))}
  >>> module = kernels.load()
  >>> _ = module is None or fused_apply(
  ...     module, table, block, tf.constant([2], tf.int64),
  ...     RowGradients.dense(tf.constant([[1.0], [2.0]])), tf.constant([0, 0]),
  ...     spread=True)
  >>> block["parameters"].numpy().ravel().tolist() in ([0.0, 0.0, -1.5],
  ...     [0.0, 0.0, 0.0])  # (updated, or no kernels here)
  True
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol

import tensorflow as tf

from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import RowGradients

if TYPE_CHECKING:
  from tpu_embedding.row_storage import RowStorage


class Rounding(Protocol):
  """How a row block writes its variables back (``tables/rounding.py``'s
  ``BlockRounding``): what the kernel needs of it."""

  @property
  def storage(self) -> RowStorage: ...

  @property
  def first_row(self) -> int: ...

  @property
  def fused(self) -> bool: ...

  @property
  def table(self) -> str: ...

  def step(self) -> tf.Tensor: ...

  def advance(self) -> Any: ...


#: The rules the kernel implements (an optimizer's ``fused_rule``).
RULES = ("sgd", "adagrad")


def _bound(value: float | None, default: float) -> float:
  return default if value is None else float(value)


def fused_apply(
  module: Any,
  table: TableConfig,
  block: dict[str, Any],
  ids: tf.Tensor,
  grads: RowGradients,
  index: tf.Tensor,
  spread: bool,
  rounding: Rounding | None = None,
) -> list[Any] | None:
  """Applies ``table``'s optimizer to rows ``ids`` with one fused kernel.

  Args:
    module: the loaded kernel module (``kernels.load()``).
    table: the table (its optimizer's ``fused_rule`` must be one of
      ``RULES``: ``SGD`` and ``Adagrad``).
    block: ``{"parameters": var, <slot>: var}``.
    ids: ``[n]`` distinct int64 row indices into ``block``.
    grads: the gradients of single occurrences (``gradients.RowGradients``:
      read in place and scaled as they are summed, never concatenated,
      gathered or multiplied first).
    index: ``[m]`` int32 position in ``ids`` of each gradient row.
    spread: spread the rows over the CPU threads (``ops.KernelOps``).
    rounding: how the block writes its variables back: float32 as they
      are, 16-bit rounded (``tables/rounding.BlockRounding``); None only
      for float32 variables (16-bit ones then take the TensorFlow path).

  Returns:
    The kernel op in a list (``[None]`` when eager), or None when the
    kernel does not apply (then nothing was done).
  """
  optimizer = table.optimizer
  rule = None if optimizer is None else optimizer.fused_rule
  if optimizer is None or rule not in RULES:
    return None
  names = ("parameters", *optimizer.SLOT_NAMES)
  variables = [block[name] for name in names]
  if any(not hasattr(v, "handle") for v in variables):
    return None  # Not plain resource variables (e.g. user-made slots).
  if rounding is None:
    if any(v.dtype != tf.float32 for v in variables):
      return None  # (16-bit rows round as their block says)
    rounded = {"rounding_step": tf.constant(0, tf.int64)}
  elif not rounding.fused:
    return None  # (rows that draw by a map: the TensorFlow path)
  else:
    rounded = {
      "rounding_step": rounding.step(),
      "stochastic": rounding.storage.rounding == "stochastic",
      "seed": rounding.storage.seed,
      "first_row": rounding.first_row,
      "table": rounding.table,
    }
  op = module.tpe_fused_sparse_apply(
    variables=[v.handle for v in variables],
    rows=tf.cast(ids, tf.int64),
    index=tf.cast(index, tf.int32),
    grads=[tf.cast(g, tf.float32) for g in grads.pieces],
    positions=[tf.cast(p, tf.int32) for p in grads.positions],
    scales=[tf.cast(s, tf.float32) for s in grads.scales],
    lr=optimizer.learning_rate_tensor(),
    rule=rule,
    clip_gradient_min=_bound(optimizer.clip_gradient_min, -math.inf),
    clip_gradient_max=_bound(optimizer.clip_gradient_max, math.inf),
    weight_decay=float(optimizer.weight_decay_factor or 0.0),
    decay_by_lr=bool(optimizer.multiply_weight_decay_factor_by_learning_rate),
    clip_weight_min=_bound(optimizer.clip_weight_min, -math.inf),
    clip_weight_max=_bound(optimizer.clip_weight_max, math.inf),
    spread=spread,
    **rounded,
  )
  if rounding is None:
    return [op]
  with tf.control_dependencies([op] if op is not None else []):
    return [op, rounding.advance()]  # (counted once the op succeeded)
