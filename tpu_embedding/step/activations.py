"""The one lookup path: ids in, activations out, for any row source.

Every lookup of this package — the mid-level API's ``dequeue`` and direct
lookups, the Keras layers, serving and export — runs the same stages::

  features ──prepare──▶ PreparedFeature ──gate──▶ (checks passed)
    ──group──▶ TableBatch per table (ids of all its features, deduplicated)
    ──gather──▶ each id's row (the caller's row source reads each
                distinct row once and expands it to the id occurrences)
    ──combine──▶ [rows, dim] ──split──▶ one activation per feature

Only the row source differs: a backend (which may exchange ids between
replicas), a table store, or plain Keras weights.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.resolved import resolve
  >>> table = tpe.TableConfig(10, 1, combiner="sum", name="t")
  >>> config = resolve({"f": tpe.FeatureConfig(table)}, None)
  >>> prepared = prepare_features(
  ...     config, {"f": tf.ragged.constant([[1, 2], [3]])}, None, "features")
  >>> from tpu_embedding.lookup import occurrence_rows
  >>> def rows(requests):  # row i holds the value i
  ...   return [occurrence_rows(tf.cast(r.ids, tf.float32)[:, None], r.index)
  ...           for r in requests]
  >>> from tpu_embedding.kernels.ops import TENSORFLOW_OPS
  >>> activations, _ = look_up(config, prepared, rows, ops=TENSORFLOW_OPS)
  >>> activations["f"].numpy().ravel().tolist()
  [3.0, 3.0]
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding import errors
from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import PickedRows
from tpu_embedding.inputs import PreparedFeature
from tpu_embedding.inputs import gate_on_all_checks
from tpu_embedding.inputs import prepare_feature
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.lookup import RowRequest
from tpu_embedding.lookup import TableBatch
from tpu_embedding.lookup import combine
from tpu_embedding.lookup import group_table
from tpu_embedding.lookup import split_activations
from tpu_embedding.resolved import ResolvedConfig
from tpu_embedding.stacking import TableStack
from tpu_embedding.stacking import stack_of
from tpu_embedding.structure import check_same_structure

#: Reads the rows of several tables at once: ``[lookup.RowRequest]`` →
#: per request the row of each id occurrence, ``rows(unique ids)[index]``,
#: as ``PickedRows``: each distinct row read once and left in place
#: (``lookup.occurrence_rows``; the combiner reads each occurrence's row
#: where it is), or, for occurrences that are output rows of their own,
#: possibly each occurrence's row in order (positions None).
RowSource = Callable[[Sequence[RowRequest]], Sequence[PickedRows]]


def prepare_features(
  config: ResolvedConfig,
  features: Any,
  weights: Any,
  what: str,
  direct: bool = False,
) -> list[PreparedFeature]:
  """Checks and flattens a nest of features (and weights) for lookup.

  Args:
    config: the resolved feature config.
    features: a nest of id tensors like the feature config.
    weights: None, or a nest like it (entries may be None).
    what: what the features are, for errors (e.g. "features passed to
      enqueue").
    direct: a direct lookup (``TPUEmbedding.__call__``, the Keras layers),
      with the errors of TensorFlow's lookups there: a ValueError for any
      structure mismatch, and a dense tensor refused for a sequence feature
      (``enqueue`` follows the TPU's rules and accepts it).

  Returns:
    One ``PreparedFeature`` per feature, gated on all input checks (a bad
    input fails the step before any row is read or written).

  Raises:
    ValueError: for a wrong structure, kind, dtype, rank or shape; the
      message names the feature.
  """
  error = ValueError if direct else None
  check_same_structure(config.structure, features, what, error)
  flat_inputs = tf.nest.flatten(features, expand_composites=False)
  flat_weights = [None] * len(flat_inputs)
  if weights is not None:
    check_same_structure(
      config.structure, weights, what.replace("features", "weights"), error
    )
    flat_weights = tf.nest.flatten(weights, expand_composites=False)
  if direct:
    for inp, feature, path in zip(
      flat_inputs, config.features, config.paths, strict=True
    ):
      if feature.max_sequence_length > 0 and isinstance(inp, tf.Tensor):
        raise ValueError(errors.SEQUENCE_DENSE.format(path=path))
  prepared = [
    prepare_feature(inp, weight, feature, path)
    for inp, weight, feature, path in zip(
      flat_inputs, flat_weights, config.features, config.paths, strict=True
    )
  ]
  return gate_on_all_checks(prepared)


def look_up(
  config: ResolvedConfig,
  prepared: Sequence[PreparedFeature],
  row_source: RowSource,
  stacks: Sequence[TableStack] | None = None,
  *,
  ops: StepOps,
) -> tuple[Any, dict[str, TableBatch]]:
  """Activations of prepared features, with rows from ``row_source``.

  Args:
    config: the resolved feature config (tables and their features).
    prepared: one prepared feature per feature of ``config``.
    row_source: reads the distinct rows of every table at once.
    stacks: the tables grouped as the row source holds them
      (``stacking.py``): each stack is deduplicated and read once. None:
      every table alone.
    ops: the row ops (``kernels/ops.py``) that deduplicate and combine:
      an engine's training steps pass its own, everything else
      ``TENSORFLOW_OPS`` (what a SavedModel may hold).

  Returns:
    ``(activations, batches)``: a nest like the feature config, and each
    stack's (or table's) ``TableBatch`` keyed by its name (what
    ``occurrence_gradients`` needs for the update).
  """
  if stacks is None:
    stacks = [stack_of([table], 0) for table in config.tables]
  flat, batches = look_up_groups(
    [
      (stack, [config.features_of(t) for t in stack.tables]) for stack in stacks
    ],
    prepared,
    row_source,
    ops=ops,
  )
  return tf.nest.pack_sequence_as(config.structure, flat), batches


def _request(table: TableConfig, batch: TableBatch) -> RowRequest:
  """What a row source is asked for one table (or stack)."""
  return RowRequest(
    table, batch.unique_ids, batch.unique_index, batch.segments is None
  )


def stack_features(config: ResolvedConfig, stack: TableStack) -> list[int]:
  """Flat indices of the features of a stack, member by member."""
  return [i for table in stack.tables for i in config.features_of(table)]


def look_up_groups(
  groups: Sequence[tuple[TableStack, Sequence[Sequence[int]]]],
  prepared: Sequence[PreparedFeature],
  row_source: RowSource,
  *,
  ops: StepOps,
) -> tuple[list[tf.Tensor], dict[str, TableBatch]]:
  """``look_up`` for explicit groups: each stack (or table: a stack of
  one, ``stacking.stack_of``) with, per member table, the indices in
  ``prepared`` of its features.

  Returns:
    ``(flat activations, batches)``, activations in ``prepared`` order.
  """
  flat: list[Any] = [None] * len(prepared)
  batches = {}
  for stack, indices in groups:
    members = zip(stack.tables, stack.offsets, map(len, indices), strict=True)
    batches[stack.name] = group_table(
      stack.config,
      [prepared[i] for mine in indices for i in mine],
      ops,
      list(members),
    )
  all_rows = row_source(
    [_request(stack.config, batches[stack.name]) for stack, _ in groups]
  )
  for (stack, indices), rows in zip(groups, all_rows, strict=True):
    batch = batches[stack.name]
    outputs = split_activations(combine(rows, batch, ops), batch)
    flat_indices = [i for mine in indices for i in mine]
    for i, output in zip(flat_indices, outputs, strict=True):
      flat[i] = output
  return flat, batches
