"""The partitioning of a global batch's ids and its per-step counts.

Every step, each SparseCore sends each of its ids to the SparseCore shard
that owns the id's row. A numpy transcription of the kernels TensorFlow
runs on the TPU host (``ConvertToListOfSparseCoreCooTensors`` then
``GetStatsFromListOfSparseCoreCooTensors`` in
``core/tpu/kernels/sparse_core_preprocess_ops.cc``, not available off TPU)
counts, per (chip, source SparseCore, destination shard), the ids (distinct
(row, column) pairs) and the unique ids (distinct columns), and the ids
given limits would drop (JAX's ``allow_id_dropping``).

Example:
  >>> import numpy as np
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.fdo import configs, layout, partitioning
  >>> from tpu_embedding.fdo import samples, topologies
  >>> config = configs.to_tf_feature_config(
  ...     {"f": tpe.FeatureConfig(tpe.TableConfig(64, 8, name="t"))},
  ...     tpe.SGD(0.1))
  >>> ids = {"f": samples.feature_ids(np.arange(8) % 4, "f", num_chips=1)}
  >>> stack_layout = layout.Layout(
  ...     config, topologies.Topology(1, 4), {"f": (8,)})
  >>> counts = partitioning.partition(stack_layout, ids, {"t": (1, 1)})
  >>> counts["t"].ids.shape, int(counts["t"].ids.max()), counts["t"].dropped
  ((1, 4, 4), 1, 0)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

import numpy as np

from tpu_embedding.fdo.layout import Layout
from tpu_embedding.fdo.samples import SampleIds

#: TensorFlow's ``xla_pad_size`` in the CSR conversion: each (source,
#: destination) run of ids is padded to a multiple of it.
PAD = 8
_COL_BITS = 31  # Column ids are int32.


@dataclasses.dataclass
class StepCounts:
  """One step's counts for one stacked table.

  Attributes:
    ids: ``[num_chips, num_sc_per_chip, num_sc_shards]``: the ids each
      (chip, source SparseCore) sends each destination shard.
    unique_ids: the same, for unique ids.
    dropped: ids the limits given to ``partition`` would drop (JAX's
      ``allow_id_dropping`` rule; TensorFlow fails the step instead), or
      None without limits.
  """

  ids: np.ndarray
  unique_ids: np.ndarray
  dropped: int | None = None

  @property
  def ids_buffer_per_chip(self) -> int:
    """The most ids one chip sends, each run padded to 8."""
    padded = -(-self.ids // PAD) * PAD
    return int(padded.sum(axis=(1, 2)).max(initial=0))


def partition(
  layout: Layout,
  ids: Mapping[str, SampleIds],
  limits: Mapping[str, tuple[int, int]] | None = None,
) -> dict[str, StepCounts]:
  """Counts per partition for one global batch (TensorFlow's rules).

  Args:
    layout: the ``Layout``.
    ids: per feature path, its ids (``samples.feature_ids``).
    limits: ``{stack: (max_ids, max_unique_ids)}`` to count drops against.

  Returns:
    ``{stacked table: StepCounts}``.

  Raises:
    ValueError: for an id outside its table, naming the feature and table.
  """
  topo = layout.topology
  nsc, shards = topo.num_sc_per_chip, topo.num_sc_shards
  mask = shards - 1
  per_stack: dict[str, list[tuple[np.ndarray, np.ndarray]]] = (
    collections.defaultdict(list)
  )
  for f in layout.features:
    x = ids[f.path]
    values = x.ids
    if values.size:
      low, high = int(values.min()), int(values.max())
      if low < 0 or high >= f.vocabulary_size:
        bad = low if low < 0 else high
        raise ValueError(
          f"Feature {f.path!r} has id {bad}, outside its table {f.table!r} "
          f"of {f.vocabulary_size} rows (ids must be in [0, "
          f"{f.vocabulary_size}))."
        )
    stack = layout.stacks[f.stack]
    per_sc = f.sample_count // nsc
    sc, within = np.divmod(x.row, per_sc)
    # ConvertToListOfSparseCoreCooTensors: the row within the SparseCore's
    # share of the stacked table's samples ...
    row = within + f.row_offset // nsc + (stack.sample_count // nsc) * sc
    # ... and the column: mod sharding, rotated, offset into the stack.
    col = ((values + f.col_shift) & mask) + (values & ~mask) + f.col_offset
    sample = x.chip * stack.sample_count + row  # distinct per chip and row
    per_stack[f.stack].append((sample, col))
  counts = {}
  for name, stack in layout.stacks.items():
    parts = per_stack.get(name, [])
    sample = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0)
    col = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0)
    sample = sample.astype(np.int64)
    col = col.astype(np.int64)
    # GetStatsFromListOfSparseCoreCooTensors: ids are distinct (row, col)
    # pairs, unique ids distinct columns, per (source, destination).
    pairs = _unique((sample << _COL_BITS) | col)
    pair_sample, pair_col = pairs >> _COL_BITS, pairs & ((1 << _COL_BITS) - 1)
    chip, row = np.divmod(pair_sample, stack.sample_count)
    source = chip * nsc + row // (stack.sample_count // nsc)
    part = source * shards + (pair_col & mask)
    size = topo.num_chips * nsc * shards
    id_counts = np.bincount(part, minlength=size)
    unique = _unique((source << _COL_BITS) | pair_col)
    unique_part = (unique >> _COL_BITS) * shards + (unique & mask)
    unique_counts = np.bincount(unique_part, minlength=size)
    shape = (topo.num_chips, nsc, shards)
    step = StepCounts(id_counts.reshape(shape), unique_counts.reshape(shape))
    if limits is not None and name in limits:
      step.dropped = _dropped(part, pair_col, *limits[name])
    counts[name] = step
  return counts


def _unique(values: np.ndarray) -> np.ndarray:
  """``np.unique(values)`` by sorting: numpy 2's hash-based ``np.unique``
  takes several times longer on millions of int64 keys."""
  values = np.sort(values)
  keep = np.ones(values.size, bool)
  keep[1:] = values[1:] != values[:-1]
  return values[keep]


def _dropped(part: np.ndarray, col: np.ndarray, max_ids: int, max_uniq: int):
  """Ids dropped when each partition keeps, in column order, the ids of its
  first ``max_uniq`` columns and of those the first ``max_ids``."""
  if part.size == 0:
    return 0
  order = np.lexsort((col, part))
  part, col = part[order], col[order]
  new_part = np.ones(part.size, bool)
  new_part[1:] = part[1:] != part[:-1]
  new_col = new_part.copy()
  new_col[1:] |= col[1:] != col[:-1]
  starts = np.flatnonzero(new_part)
  first = np.repeat(starts, np.diff(np.append(starts, part.size)))
  cum_cols = np.cumsum(new_col)
  col_rank = cum_cols - cum_cols[first]  # 0-based rank of the column
  within_unique = col_rank < max_uniq
  cum_kept = np.cumsum(within_unique)
  base = cum_kept[first] - within_unique[first]
  kept = within_unique & (cum_kept - base <= max_ids)
  return int(part.size - kept.sum())
