"""FDO off TPU: SparseCore limits and buffer sizes measured from your data.

On TPUs with SparseCore (v5p, v6e, v7x) TensorFlow's ``TPUEmbeddingV2``
stacks tables and, every step, sends each id from the SparseCore that owns
its sample to the SparseCore shard that owns its row. Each stacked table
needs two limits, the most ids and the most unique ids one such
*partition* (a source SparseCore, a destination shard) receives in a step
(``max_ids_per_partition`` / ``max_unique_ids_per_partition``, TensorFlow's
``SparseCoreEmbeddingConfig.max_ids_per_table`` /
``max_unique_ids_per_table``), and a buffer for all the ids one chip sends
(``max_ids_per_chip_per_sample``). TensorFlow defaults the limits to 256
and fails the step when a partition exceeds them; JAX/keras-rs may drop the
ids over them instead.

This module computes them on any machine (no TPU), from a feature config
(ours, TensorFlow's or keras-rs'), a ``Topology`` and batches from any
``tf.data`` pipeline, exactly as ``TPUEmbeddingV2`` would:

* stacking: TensorFlow's own ``_stack_tables_with_same_table_dim_and_
  optimizer`` (its C++ ``SparseCoreLayoutStacker``, which runs on CPU), so
  the stacked table names, row offsets, shard rotations and feature sample
  offsets are TensorFlow's;
* partitioning: a numpy transcription of the kernels TensorFlow runs on
  the TPU host (``ConvertToListOfSparseCoreCooTensors`` then
  ``GetStatsFromListOfSparseCoreCooTensors`` in
  ``core/tpu/kernels/sparse_core_preprocess_ops.cc``), which are not
  available off TPU (``compute_sparse_core_stats`` fails on CPU with
  ``Could not find device for node ConvertToListOfSparseCoreCooTensors``).

The rules, per chip (each chip gets a contiguous ``1/num_chips`` of the
global batch, as ``experimental_distribute_dataset`` splits it):

1. Samples: a dense ``[B, ...]`` input has one sample per id (TensorFlow's
   ``output_shape`` is the input's shape: a sequence); a ragged or sparse
   ``[B, None]`` input has one sample per row (combined). A feature's
   ``sample_count`` is its samples on one chip; SparseCore ``s`` of the
   chip owns samples ``[s, s + 1) * sample_count / num_sc_per_chip``.
2. Rows: feature ``f`` of stacked table ``T`` has sample offset
   ``o_f`` (TensorFlow's ``feature_to_sample_offset``); its sample ``r``
   becomes row ``r % per_sc + o_f / num_sc_per_chip`` of its SparseCore.
3. Columns: id ``i`` of table ``t`` becomes
   ``((i + rotation_t) & m) + (i & ~m) + row_offset_t`` with
   ``m = num_chips * num_sc_per_chip - 1`` (mod sharding, rotated per
   table so that stacked tables start on different shards); its
   destination shard is ``column & m``.
4. Counting: per (chip, source SparseCore, destination shard), the ids are
   the distinct (row, column) pairs (duplicates of an id in one sample are
   merged, their weights summed) and the unique ids the distinct columns.

``max_ids_per_partition`` is the maximum of the id counts over all
partitions of a step (then over steps, or a percentile of the per-step
maxima); ``ids_buffer_per_chip`` is the most ids one chip sends in a step,
each (source, destination) run padded to 8 as TensorFlow's CSR conversion
pads it (``max_ids_per_chip_per_sample`` is that divided by the stacked
table's samples per chip, rounded up; it is also JAX's
``required_buffer_size`` summed over a device's SparseCores).

Example:
  >>> import numpy as np
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding import fdo
  >>> table = tpe.TableConfig(64, 8, name="items")
  >>> config = {"item": tpe.FeatureConfig(table)}
  >>> ids = np.arange(32, dtype=np.int64) % 64
  >>> data = tf.data.Dataset.from_tensor_slices({"item": ids}).batch(16)
  >>> stats = fdo.compute_stats(config, data, "v5p-8", optimizer=tpe.SGD(0.1))
  >>> stats.steps, stats.tables["items"].max_ids_per_partition
  (2, 1)
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

TFE = tf.tpu.experimental.embedding

#: JSON format tag of the files ``FdoStats.save`` writes.
FORMAT = "tpu_embedding.fdo/1"

#: TensorFlow's default limit for a stacked table missing from
#: ``SparseCoreEmbeddingConfig`` (``TPUEmbeddingV2.DEFAULT_MAX_IDS_PER_TABLE``).
TF_DEFAULT_LIMIT = 256

#: TensorFlow's default ``max_ids_per_chip_per_sample``.
TF_DEFAULT_IDS_PER_CHIP_PER_SAMPLE = 64

_PAD = 8  # TensorFlow's xla_pad_size in the CSR conversion.
_COL_BITS = 31  # Column ids are int32.


@dataclasses.dataclass(frozen=True)
class Generation:
  """A TPU generation with SparseCores.

  Attributes:
    sparse_cores_per_chip: SparseCores per chip.
    cores_per_chip: TensorCores per chip, which is what the number in a
      slice name (``v5p-8``) counts.
  """

  sparse_cores_per_chip: int
  cores_per_chip: int


#: The TPU generations that have SparseCores. Slice names count TensorCores
#: (``v5p-8`` is 4 chips; ``v6e-8`` is 8 chips; ``v7x-8`` is 4 chips).
GENERATIONS: dict[str, Generation] = {
  "v5p": Generation(sparse_cores_per_chip=4, cores_per_chip=2),
  "v6e": Generation(sparse_cores_per_chip=2, cores_per_chip=1),
  "v7x": Generation(sparse_cores_per_chip=4, cores_per_chip=2),
}


@dataclasses.dataclass(frozen=True)
class Topology:
  """The SparseCores an embedding is spread over.

  Attributes:
    num_chips: TPU chips (TensorFlow's ``num_replicas_in_sync`` under
      ``TPUStrategy``).
    num_sc_per_chip: SparseCores per chip.
    name: the preset it came from, if any.
  """

  num_chips: int
  num_sc_per_chip: int
  name: str | None = None

  def __post_init__(self):
    for field in ("num_chips", "num_sc_per_chip"):
      value = getattr(self, field)
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
          f"Topology {field} must be a positive integer; got {value!r}."
        )
    shards = self.num_sc_shards
    if shards & (shards - 1):
      raise ValueError(
        f"Topology {self.describe()}: {self.num_chips} chips x "
        f"{self.num_sc_per_chip} SparseCores = {shards} SparseCore shards, "
        "not a power of two; TPUEmbeddingV2 shards ids with a bit mask and "
        "needs a power of two."
      )

  @property
  def num_sc_shards(self) -> int:
    """SparseCores in all: the shards a table's rows are spread over."""
    return self.num_chips * self.num_sc_per_chip

  def describe(self) -> str:
    core = f"{self.num_chips} chips x {self.num_sc_per_chip} SparseCores"
    return f"{self.name} ({core})" if self.name else core

  def to_json(self) -> dict[str, Any]:
    return {
      "name": self.name,
      "num_chips": self.num_chips,
      "num_sc_per_chip": self.num_sc_per_chip,
    }


def topology(spec: Any) -> Topology:
  """A ``Topology`` from a preset name, a pair or a ``Topology``.

  Args:
    spec: ``"v5p-8"``, ``"v6e-16"``, ``"v7x-8"`` (generation and the
      slice's TensorCore count, as Cloud TPU names slices), a generation
      alone (``"v6e"``: one chip), ``(num_chips, num_sc_per_chip)``, a
      ``{"num_chips": ..., "num_sc_per_chip": ...}`` dict or a
      ``Topology``.

  Returns:
    The ``Topology``.

  Raises:
    ValueError: for an unknown generation or a malformed name.

  Example:
    >>> topology("v5p-8")
    Topology(num_chips=4, num_sc_per_chip=4, name='v5p-8')
    >>> topology("v6e-16").num_sc_shards
    32
  """
  if isinstance(spec, Topology):
    return spec
  if isinstance(spec, Mapping):
    return Topology(
      int(spec["num_chips"]), int(spec["num_sc_per_chip"]), spec.get("name")
    )
  if isinstance(spec, (tuple, list)) and len(spec) == 2:
    return Topology(int(spec[0]), int(spec[1]))
  if not isinstance(spec, str):
    raise ValueError(
      f"Unknown TPU topology {spec!r}: give a name such as 'v5p-8', a "
      "(num_chips, num_sc_per_chip) pair or a Topology."
    )
  name = spec.strip().lower()
  generation, _, count = name.partition("-")
  if generation not in GENERATIONS:
    raise ValueError(
      f"Unknown TPU topology {spec!r}: the TPU generations with "
      f"SparseCores are {sorted(GENERATIONS)} (e.g. 'v5p-8', 'v6e-16'); "
      "for another, pass (num_chips, num_sc_per_chip)."
    )
  gen = GENERATIONS[generation]
  if not count:
    return Topology(1, gen.sparse_cores_per_chip, name)
  if not count.isdigit() or int(count) % gen.cores_per_chip:
    raise ValueError(
      f"Unknown TPU topology {spec!r}: a {generation} slice is named "
      f"'{generation}-N' with N TensorCores, a multiple of "
      f"{gen.cores_per_chip}."
    )
  return Topology(
    int(count) // gen.cores_per_chip, gen.sparse_cores_per_chip, name
  )


# --- configs ---------------------------------------------------------------


def _is_keras_rs_nest(feature_config: Any) -> bool:
  from tpu_embedding.layers import keras_rs_configs

  return any(
    keras_rs_configs.is_keras_rs_feature(leaf)
    for leaf in tf.nest.flatten(feature_config)
  )


def to_tf_feature_config(feature_config: Any, optimizer: Any = None) -> Any:
  """A nest of TensorFlow ``FeatureConfig`` for any supported config.

  Args:
    feature_config: a nest of this package's, TensorFlow's or keras-rs'
      ``FeatureConfig``.
    optimizer: the optimizer of tables without one (this package's,
      TensorFlow's, or for keras-rs configs a Keras optimizer). Tables
      stack only with the same optimizer, so it matters.

  Returns:
    Fresh TensorFlow configs (the caller's are never modified).
  """
  from tpu_embedding.engines import tpu_conversion

  leaves = tf.nest.flatten(feature_config)
  if leaves and all(isinstance(leaf, TFE.FeatureConfig) for leaf in leaves):
    from tensorflow.python.tpu import tpu_embedding_v3

    clone = tpu_embedding_v3._clone_feature_config(feature_config)  # noqa: SLF001
    if optimizer is not None and not _is_tf_optimizer(optimizer):
      optimizer = tpu_conversion.to_tf_optimizer(optimizer)
    for leaf in tf.nest.flatten(clone):
      if leaf.table.optimizer is None:
        leaf.table.optimizer = optimizer
    return clone
  if _is_keras_rs_nest(feature_config):
    from tpu_embedding.layers import keras_rs_configs

    feature_config = keras_rs_configs.translate(feature_config).feature_config
  if _is_tf_optimizer(optimizer):
    from tpu_embedding.layers import tf_configs

    optimizer = tf_configs.from_tf_optimizer(optimizer)
  elif optimizer is not None and not _is_tpe_optimizer(optimizer):
    from tpu_embedding.layers import common

    optimizer = common.embedding_optimizer(optimizer)
  return tpu_conversion.to_tf_feature_config(feature_config, optimizer)


def _is_tf_optimizer(optimizer: Any) -> bool:
  from tpu_embedding.layers import tf_configs

  return optimizer is not None and tf_configs.is_tf_optimizer(optimizer)


def _is_tpe_optimizer(optimizer: Any) -> bool:
  from tpu_embedding.optimizers.base import Optimizer

  return isinstance(optimizer, Optimizer)


# --- inputs ----------------------------------------------------------------


@dataclasses.dataclass
class _Ids:
  """One feature's ids of one global batch, in TensorFlow's sample order."""

  chip: np.ndarray  # which chip's share of the batch the sample is in
  row: np.ndarray  # the sample, within that chip's share
  ids: np.ndarray
  sample_count: int  # samples per chip
  output_shape: tuple[int, ...]  # per chip


def _to_numpy(x: Any) -> np.ndarray:
  return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def _feature_ids(x: Any, path: str, num_chips: int) -> _Ids:
  """``x`` (one global batch of feature ``path``) as samples and ids."""
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
  return _Ids(chip, row, ids.astype(np.int64), sample_count, output_shape)


# --- the layout -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _FeatureLayout:
  path: str
  table: str  # the user's table
  stack: str
  vocabulary_size: int  # the user's, before padding
  col_offset: int
  col_shift: int
  row_offset: int  # TensorFlow's feature_to_sample_offset
  sample_count: int


@dataclasses.dataclass(frozen=True)
class StackLayout:
  """How TensorFlow stacks and partitions one stacked table.

  Attributes:
    name: the stacked table's name (TensorFlow's: the tables' names joined
      with ``_``, the key of ``SparseCoreEmbeddingConfig.max_ids_per_table``).
    tables: its tables, in stacking order.
    features: its features' paths.
    sample_count: samples per chip (TensorFlow's ``table_to_sample_count``).
    vocabulary_size: rows after padding, all tables.
    dim: width after padding.
    row_offsets: the first column of each table in the stack.
    rotations: each table's shard rotation.
  """

  name: str
  tables: tuple[str, ...]
  features: tuple[str, ...]
  sample_count: int
  vocabulary_size: int
  dim: int
  row_offsets: dict[str, int]
  rotations: dict[str, int]


class Layout:
  """TensorFlow's stacking for a config, a topology and per-chip shapes.

  Attributes:
    topology: the ``Topology``.
    stacks: ``{stacked table name: StackLayout}``.
    features: per flattened feature (TensorFlow's joined path order).
  """

  def __init__(
    self,
    tf_feature_config: Any,
    topo: Topology,
    output_shapes: Mapping[str, tuple[int, ...]],
    sparse_core_config: Any = None,
  ):
    from tensorflow.python.tpu import tpu_embedding_v3
    from tensorflow.python.util import nest

    config = tpu_embedding_v3._clone_feature_config(tf_feature_config)  # noqa: SLF001
    flat = nest.flatten_with_joined_string_paths(config)
    for path, feature in flat:
      feature.output_shape = tf.TensorShape(output_shapes[path])
      if feature.table.optimizer is None:
        raise ValueError(
          f"Table {feature.table.name!r} (feature {path!r}) has no optimizer;"
          " TPUEmbeddingV2 stacks only tables of the same optimizer, so pass "
          "optimizer= (or set the table's)."
        )
    tables = list({id(f.table): f.table for _, f in flat}.values())
    vocab = {t.name: t.vocabulary_size for t in tables}
    self.topology = topo
    for path, _ in flat:
      count = math.prod(output_shapes[path])
      if count % topo.num_sc_per_chip:
        raise ValueError(
          f"Feature {path!r}: {count} samples per chip do not split over "
          f"{topo.num_sc_per_chip} SparseCores per chip; TPUEmbeddingV2 "
          "needs the per-chip batch (times the sequence length of a dense "
          "input) divisible by the SparseCores per chip."
        )
    s = tpu_embedding_v3._stack_tables_with_same_table_dim_and_optimizer(  # noqa: SLF001
      tables,
      flat,
      topo.num_chips,
      topo.num_sc_per_chip,
      sparse_core_config,
    )
    self.features: list[_FeatureLayout] = []
    by_stack = collections.defaultdict(list)
    for path, feature in flat:
      stack, col_offset, col_shift = s.table_to_stacked_table_offset[
        feature.table.name
      ]
      self.features.append(
        _FeatureLayout(
          path=path,
          table=feature.table.name,
          stack=stack,
          vocabulary_size=vocab[feature.table.name],
          col_offset=int(col_offset),
          col_shift=int(col_shift),
          row_offset=int(s.feature_to_sample_offset[path]),
          sample_count=math.prod(output_shapes[path]),
        )
      )
      by_stack[stack].append(path)
    self.stacks: dict[str, StackLayout] = {}
    for stack, stack_tables in s.stacked_table_to_tables.items():
      self.stacks[stack] = StackLayout(
        name=stack,
        tables=tuple(t.name for t in stack_tables),
        features=tuple(by_stack[stack]),
        sample_count=int(s.table_to_sample_count[stack]),
        vocabulary_size=sum(t.vocabulary_size for t in stack_tables),
        dim=int(stack_tables[0].dim),
        row_offsets={
          t.name: int(s.table_to_stacked_table_offset[t.name][1])
          for t in stack_tables
        },
        rotations={
          t.name: int(s.table_to_stacked_table_offset[t.name][2])
          for t in stack_tables
        },
      )


# --- per-step counts ---------------------------------------------------------


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
    padded = -(-self.ids // _PAD) * _PAD
    return int(padded.sum(axis=(1, 2)).max(initial=0))


def partition(
  layout: Layout,
  ids: Mapping[str, _Ids],
  limits: Mapping[str, tuple[int, int]] | None = None,
) -> dict[str, StepCounts]:
  """Counts per partition for one global batch (TensorFlow's rules).

  Args:
    layout: the ``Layout``.
    ids: per feature path, its ids (``_feature_ids``).
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
    pairs = np.unique((sample << _COL_BITS) | col)
    pair_sample, pair_col = pairs >> _COL_BITS, pairs & ((1 << _COL_BITS) - 1)
    chip, row = np.divmod(pair_sample, stack.sample_count)
    source = chip * nsc + row // (stack.sample_count // nsc)
    part = source * shards + (pair_col & mask)
    size = topo.num_chips * nsc * shards
    id_counts = np.bincount(part, minlength=size)
    unique = np.unique((source << _COL_BITS) | pair_col)
    unique_part = (unique >> _COL_BITS) * shards + (unique & mask)
    unique_counts = np.bincount(unique_part, minlength=size)
    shape = (topo.num_chips, nsc, shards)
    step = StepCounts(id_counts.reshape(shape), unique_counts.reshape(shape))
    if limits is not None and name in limits:
      step.dropped = _dropped(part, pair_col, *limits[name])
    counts[name] = step
  return counts


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


# --- statistics --------------------------------------------------------------


@dataclasses.dataclass
class TableStats:
  """The statistics of one stacked table.

  Attributes:
    name: the stacked table's name.
    tables: the tables stacked in it.
    max_ids_per_partition: the most ids a partition received in a step.
    max_unique_ids_per_partition: the same for unique ids.
    percentile_max_ids_per_partition: the ``percentile`` of the per-step
      maxima.
    percentile_max_unique_ids_per_partition: the same for unique ids.
    ids_buffer_per_chip: the most ids one chip sent in a step, padded.
    max_ids_per_chip_per_sample: the ``max_ids_per_chip_per_sample`` this
      table needs (TensorFlow's buffer is that times its samples per chip).
    sample_count: the stacked table's samples per chip.
    ids_per_step: per step, the most ids in a partition.
    unique_ids_per_step: per step, the most unique ids in a partition.
    total_ids: ids counted (after merging duplicates within a sample).
    dropped_ids: ids the given limits would drop, or None.
    steps_over_limits: steps in which a partition exceeded the given limits
      (on TensorFlow, steps that would fail), or None.
    limits: the given ``(max_ids, max_unique_ids)``, or None.
  """

  name: str
  tables: tuple[str, ...]
  max_ids_per_partition: int
  max_unique_ids_per_partition: int
  percentile_max_ids_per_partition: int
  percentile_max_unique_ids_per_partition: int
  ids_buffer_per_chip: int
  max_ids_per_chip_per_sample: int
  sample_count: int
  ids_per_step: list[int]
  unique_ids_per_step: list[int]
  total_ids: int
  dropped_ids: int | None = None
  steps_over_limits: int | None = None
  limits: tuple[int, int] | None = None

  @property
  def dropped_fraction(self) -> float | None:
    """The fraction of ids the given limits would drop."""
    if self.dropped_ids is None:
      return None
    return self.dropped_ids / self.total_ids if self.total_ids else 0.0

  def limit(self, which: str = "max") -> tuple[int, int]:
    """``(max_ids, max_unique_ids)``: ``"max"`` or ``"percentile"``."""
    if which == "max":
      pair = (self.max_ids_per_partition, self.max_unique_ids_per_partition)
    elif which == "percentile":
      pair = (
        self.percentile_max_ids_per_partition,
        self.percentile_max_unique_ids_per_partition,
      )
    else:
      raise ValueError(f"which must be 'max' or 'percentile'; got {which!r}.")
    return max(1, pair[0]), max(1, pair[1])  # TensorFlow requires > 0.


@dataclasses.dataclass
class FdoStats:
  """SparseCore statistics over the batches seen.

  Attributes:
    topology: the ``Topology``.
    percentile: the percentile reported next to the maximum.
    steps: batches seen.
    tables: ``{stacked table name: TableStats}``.
  """

  topology: Topology
  percentile: float
  steps: int
  tables: dict[str, TableStats]

  @property
  def max_ids_per_chip_per_sample(self) -> int:
    """TensorFlow's one ``max_ids_per_chip_per_sample`` for all tables."""
    return max(
      (t.max_ids_per_chip_per_sample for t in self.tables.values()), default=1
    )

  def sparse_core_config(self, which: str = "max", **kwargs: Any) -> Any:
    """``tf.tpu.experimental.embedding.SparseCoreEmbeddingConfig`` with the
    measured limits (``which``: ``"max"`` or ``"percentile"``); ``kwargs``
    go to it too (e.g. ``allow_id_dropping=True``)."""
    limits = {name: t.limit(which) for name, t in self.tables.items()}
    kwargs.setdefault(
      "max_ids_per_chip_per_sample",
      max(TF_DEFAULT_IDS_PER_CHIP_PER_SAMPLE, self.max_ids_per_chip_per_sample),
    )
    return TFE.SparseCoreEmbeddingConfig(
      max_ids_per_table={k: v[0] for k, v in limits.items()},
      max_unique_ids_per_table={k: v[1] for k, v in limits.items()},
      **kwargs,
    )

  def sparse_core_config_source(self, which: str = "max") -> str:
    """The ``SparseCoreEmbeddingConfig(...)`` to paste."""
    config = self.sparse_core_config(which)
    return (
      "tf.tpu.experimental.embedding.SparseCoreEmbeddingConfig(\n"
      f"    max_ids_per_table={config.max_ids_per_table!r},\n"
      f"    max_unique_ids_per_table={config.max_unique_ids_per_table!r},\n"
      "    max_ids_per_chip_per_sample="
      f"{config.max_ids_per_chip_per_sample},\n)"
    )

  def keras_rs_limits(self, which: str = "max") -> dict[str, dict[str, int]]:
    """keras-rs ``TableConfig`` arguments per *table*: a table gets the
    limits of the stack it is in (keras-rs stacks as TensorFlow does)."""
    out = {}
    for stats in self.tables.values():
      max_ids, max_unique = stats.limit(which)
      for table in stats.tables:
        out[table] = {
          "max_ids_per_partition": max_ids,
          "max_unique_ids_per_partition": max_unique,
        }
    return out

  def keras_rs_source(self, which: str = "max") -> str:
    """``TableConfig(name=..., max_ids_per_partition=..., ...)`` lines."""
    return "\n".join(
      f"keras_rs.layers.TableConfig(name={table!r}, ..., "
      f"max_ids_per_partition={v['max_ids_per_partition']}, "
      f"max_unique_ids_per_partition={v['max_unique_ids_per_partition']})"
      for table, v in sorted(self.keras_rs_limits(which).items())
    )

  def to_json(self) -> dict[str, Any]:
    """The JSON ``save`` writes (``load_sparse_core_config`` reads it)."""
    return {
      "format": FORMAT,
      "topology": self.topology.to_json(),
      "percentile": self.percentile,
      "steps": self.steps,
      "max_ids_per_chip_per_sample": self.max_ids_per_chip_per_sample,
      "tables": {
        name: {
          **dataclasses.asdict(t),
          "limits": list(t.limits) if t.limits else None,
          "dropped_fraction": t.dropped_fraction,
          "tables": list(t.tables),
        }
        for name, t in self.tables.items()
      },
      "sparse_core_embedding_config": {
        "max_ids_per_table": {k: v.limit()[0] for k, v in self.tables.items()},
        "max_unique_ids_per_table": {
          k: v.limit()[1] for k, v in self.tables.items()
        },
        "max_ids_per_chip_per_sample": max(
          TF_DEFAULT_IDS_PER_CHIP_PER_SAMPLE, self.max_ids_per_chip_per_sample
        ),
      },
      "keras_rs": self.keras_rs_limits(),
    }

  def save(self, path: str | os.PathLike) -> str:
    """Writes ``to_json()`` to ``path`` (a file, or a directory: then
    ``fdo_stats.json`` in it); returns the file's path."""
    path = os.fspath(path)
    if os.path.isdir(path):
      path = os.path.join(path, "fdo_stats.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.to_json(), f, indent=2, sort_keys=True)
    os.replace(tmp, path)
    return path

  def summary(self, which: str = "max") -> str:
    """A table of the statistics, one stacked table a line."""
    lines = [
      f"FDO statistics over {self.steps} steps on {self.topology.describe()}"
      f" (p{self.percentile:g} = percentile of the per-step maxima):",
      f"  {'stacked table':30} {'max ids':>8} {'p':>6} {'max uniq':>8} "
      f"{'p':>6} {'buffer/chip':>11} {'dropped':>8}",
    ]
    for name, t in sorted(self.tables.items()):
      dropped = (
        "" if t.dropped_fraction is None else f"{t.dropped_fraction:.2%}"
      )
      shown = name if len(name) <= 30 else f"{name[:22]}..+{len(t.tables)}"
      lines.append(
        f"  {shown:30} {t.max_ids_per_partition:8d} "
        f"{t.percentile_max_ids_per_partition:6d} "
        f"{t.max_unique_ids_per_partition:8d} "
        f"{t.percentile_max_unique_ids_per_partition:6d} "
        f"{t.ids_buffer_per_chip:11d} {dropped:>8}"
      )
    lines.append(self.sparse_core_config_source(which))
    return "\n".join(lines)


def _limits_dict(limits: Any) -> dict[str, tuple[int, int]] | None:
  """``{stack: (max_ids, max_unique)}`` from a SparseCoreEmbeddingConfig, a
  dict of pairs, a pair for every table, or None."""
  if limits is None:
    return None
  if isinstance(limits, TFE.SparseCoreEmbeddingConfig):
    ids = limits.max_ids_per_table or {}
    uniq = limits.max_unique_ids_per_table or {}
    return _DefaultLimits(
      {
        k: (ids.get(k, TF_DEFAULT_LIMIT), uniq.get(k, TF_DEFAULT_LIMIT))
        for k in set(ids) | set(uniq)
      }
    )
  if isinstance(limits, tuple) and len(limits) == 2:
    return _DefaultLimits({}, (int(limits[0]), int(limits[1])))
  if isinstance(limits, int):
    return _DefaultLimits({}, (limits, limits))
  return _DefaultLimits({k: (int(v[0]), int(v[1])) for k, v in limits.items()})


class _DefaultLimits(dict):
  """Limits per stack; stacks not named get TensorFlow's default (256)."""

  def __init__(self, given, default=(TF_DEFAULT_LIMIT, TF_DEFAULT_LIMIT)):
    super().__init__(given)
    self.default = default

  def __contains__(self, key):
    return True

  def __missing__(self, key):
    return self.default


class FdoCollector:
  """Keeps SparseCore statistics batch after batch (online FDO).

  Example:
    >>> import numpy as np
    >>> import tpu_embedding as tpe
    >>> table = tpe.TableConfig(100, 4, name="t")
    >>> collector = FdoCollector(
    ...     {"f": tpe.FeatureConfig(table)}, "v6e-8", optimizer=tpe.SGD(0.1))
    >>> _ = collector.update({"f": np.zeros([32], np.int64)})
    >>> collector.result().tables["t"].max_unique_ids_per_partition
    1
  """

  def __init__(
    self,
    feature_config: Any,
    topology_spec: Any,
    *,
    optimizer: Any = None,
    percentile: float = 99.0,
    limits: Any = None,
    sparse_core_config: Any = None,
  ):
    """Prepares the collector (the layout is made on the first batch).

    Args:
      feature_config: a nest of this package's, TensorFlow's or keras-rs'
        ``FeatureConfig``.
      topology_spec: anything ``topology`` takes.
      optimizer: the optimizer of tables without one.
      percentile: reported next to the maximum (0 to 100).
      limits: limits to count drops against: a
        ``SparseCoreEmbeddingConfig`` (stacks it misses get TensorFlow's
        256), ``{stack: (max_ids, max_unique_ids)}`` or one pair for all.
      sparse_core_config: the ``SparseCoreEmbeddingConfig`` the TPU run
        uses, for its ``disable_table_stacking``.
    """
    if not 0 <= percentile <= 100:
      raise ValueError(f"percentile must be in [0, 100]; got {percentile}.")
    self.topology = topology(topology_spec)
    self.percentile = float(percentile)
    self.limits = _limits_dict(limits)
    self._tf_config = to_tf_feature_config(feature_config, optimizer)
    self._sparse_core_config = sparse_core_config
    from tensorflow.python.util import nest

    self._paths = [
      p for p, _ in nest.flatten_with_joined_string_paths(self._tf_config)
    ]
    self._structure = self._tf_config
    self.layout: Layout | None = None
    self._steps: dict[str, list[StepCounts]] = collections.defaultdict(list)
    self._ids_per_step: dict[str, list[int]] = collections.defaultdict(list)
    self._unique_per_step: dict[str, list[int]] = collections.defaultdict(list)
    self._buffer: dict[str, int] = collections.defaultdict(int)
    self._total: dict[str, int] = collections.defaultdict(int)
    self._dropped: dict[str, int] = collections.defaultdict(int)
    self._over: dict[str, int] = collections.defaultdict(int)
    self.steps = 0

  def _flatten(self, features: Any) -> list[Any]:
    try:
      tf.nest.assert_same_structure(
        self._structure, features, expand_composites=False
      )
    except (ValueError, TypeError) as e:
      raise ValueError(
        "The features do not have the feature config's structure "
        f"(features for {self._paths}): {e}"
      ) from None
    return tf.nest.flatten(features, expand_composites=False)

  def update(self, features: Any) -> dict[str, StepCounts]:
    """Adds one global batch of features (the feature config's structure;
    Tensors, RaggedTensors, SparseTensors or numpy arrays).

    Returns:
      This step's ``StepCounts`` per stacked table.
    """
    flat = self._flatten(features)
    nchips = self.topology.num_chips
    ids = {
      path: _feature_ids(x, path, nchips)
      for path, x in zip(self._paths, flat, strict=True)
    }
    shapes = {p: i.output_shape for p, i in ids.items()}
    if self.layout is None or self._shapes != shapes:
      if self.layout is not None:
        raise ValueError(
          "The batch shapes changed "
          f"({self._shapes} -> {shapes}); TPUEmbeddingV2 stacks for one "
          "per-chip batch shape: use drop_remainder=True."
        )
      self._shapes = shapes
      self.layout = Layout(
        self._tf_config, self.topology, shapes, self._sparse_core_config
      )
    counts = partition(self.layout, ids, self.limits)
    for name, step in counts.items():
      self._ids_per_step[name].append(int(step.ids.max(initial=0)))
      self._unique_per_step[name].append(int(step.unique_ids.max(initial=0)))
      self._buffer[name] = max(self._buffer[name], step.ids_buffer_per_chip)
      self._total[name] += int(step.ids.sum())
      if step.dropped is not None:
        self._dropped[name] += step.dropped
        max_ids, max_unique = self.limits[name]
        if (step.ids > max_ids).any() or (step.unique_ids > max_unique).any():
          self._over[name] += 1
    self.steps += 1
    return counts

  def result(self) -> FdoStats:
    """The statistics so far.

    Raises:
      ValueError: before any batch (an empty dataset).
    """
    if self.steps == 0 or self.layout is None:
      raise ValueError(
        "No batches: the dataset is empty, so there is nothing to measure "
        f"for tables {sorted(self._table_names())}."
      )
    tables = {}
    for name, stack in self.layout.stacks.items():
      ids = self._ids_per_step[name]
      uniq = self._unique_per_step[name]
      buffer = self._buffer[name]
      per_sample = max(1, -(-buffer // stack.sample_count))
      while (per_sample * stack.sample_count) % _PAD:
        per_sample += 1
      tables[name] = TableStats(
        name=name,
        tables=stack.tables,
        max_ids_per_partition=max(ids),
        max_unique_ids_per_partition=max(uniq),
        percentile_max_ids_per_partition=_percentile(ids, self.percentile),
        percentile_max_unique_ids_per_partition=_percentile(
          uniq, self.percentile
        ),
        ids_buffer_per_chip=buffer,
        max_ids_per_chip_per_sample=per_sample,
        sample_count=stack.sample_count,
        ids_per_step=list(ids),
        unique_ids_per_step=list(uniq),
        total_ids=self._total[name],
        dropped_ids=self._dropped[name] if self.limits is not None else None,
        steps_over_limits=self._over[name] if self.limits is not None else None,
        limits=tuple(self.limits[name]) if self.limits is not None else None,
      )
    return FdoStats(self.topology, self.percentile, self.steps, tables)

  def _table_names(self) -> set[str]:
    return {f.table.name for f in tf.nest.flatten(self._tf_config)}


def _percentile(values: list[int], q: float) -> int:
  return int(np.percentile(np.asarray(values), q, method="higher"))


def _features_of(element: Any) -> Any:
  """The features of a dataset element: ``(features, labels[, weights])``
  tuples give their first item."""
  if isinstance(element, tuple) and 1 < len(element) <= 3:
    return element[0]
  return element


def compute_stats(
  feature_config: Any,
  dataset: Iterable[Any],
  topology_spec: Any,
  *,
  optimizer: Any = None,
  num_batches: int | None = None,
  percentile: float = 99.0,
  limits: Any = None,
  sparse_core_config: Any = None,
  features_fn: Any = None,
) -> FdoStats:
  """SparseCore statistics of ``dataset`` (see the module docstring).

  Args:
    feature_config: a nest of this package's, TensorFlow's or keras-rs'
      ``FeatureConfig``.
    dataset: an iterable of global batches (a ``tf.data.Dataset``):
      features of the feature config's structure, or ``(features, labels)``.
    topology_spec: ``"v5p-8"``, ``(num_chips, num_sc_per_chip)``, ... (see
      ``topology``).
    optimizer: the optimizer of tables without one.
    num_batches: stop after this many batches (None: all).
    percentile: reported next to the maximum.
    limits: limits to count drops against (see ``FdoCollector``).
    sparse_core_config: the TPU run's ``SparseCoreEmbeddingConfig``.
    features_fn: maps a dataset element to the features (default: the
      element, or its first item for a tuple).

  Returns:
    The ``FdoStats``.

  Raises:
    ValueError: for an unknown topology, an id outside its table (naming
      the feature and table) or an empty dataset.
  """
  collector = FdoCollector(
    feature_config,
    topology_spec,
    optimizer=optimizer,
    percentile=percentile,
    limits=limits,
    sparse_core_config=sparse_core_config,
  )
  features_fn = features_fn or _features_of
  for i, element in enumerate(dataset):
    if num_batches is not None and i >= num_batches:
      break
    collector.update(features_fn(element))
  return collector.result()


def load(path: str | os.PathLike) -> dict[str, Any]:
  """The JSON ``FdoStats.save`` wrote (a file or its directory)."""
  path = os.fspath(path)
  if os.path.isdir(path):
    path = os.path.join(path, "fdo_stats.json")
  with open(path) as f:
    data = json.load(f)
  if data.get("format") != FORMAT:
    raise ValueError(
      f"{path} is not a tpu_embedding FDO file (format "
      f"{data.get('format')!r}, expected {FORMAT!r})."
    )
  return data


def load_sparse_core_config(
  path: str | os.PathLike, which: str = "max", **kwargs: Any
) -> Any:
  """The ``SparseCoreEmbeddingConfig`` of an FDO file.

  Args:
    path: the file ``FdoStats.save`` wrote, or its directory.
    which: ``"max"`` or ``"percentile"`` limits.
    **kwargs: more ``SparseCoreEmbeddingConfig`` fields
      (``allow_id_dropping=True``...).

  Returns:
    ``tf.tpu.experimental.embedding.SparseCoreEmbeddingConfig``.
  """
  data = load(path)
  key = {"max": "", "percentile": "percentile_"}[which]
  tables = data["tables"]
  kwargs.setdefault(
    "max_ids_per_chip_per_sample",
    data["sparse_core_embedding_config"]["max_ids_per_chip_per_sample"],
  )
  return TFE.SparseCoreEmbeddingConfig(
    max_ids_per_table={
      k: max(1, v[f"{key}max_ids_per_partition"]) for k, v in tables.items()
    },
    max_unique_ids_per_table={
      k: max(1, v[f"{key}max_unique_ids_per_partition"])
      for k, v in tables.items()
    },
    **kwargs,
  )


# --- online: while training --------------------------------------------------


def _concat(parts: list[Any]) -> Any:
  if isinstance(parts[0], tf.SparseTensor):
    return tf.sparse.concat(0, parts, expand_nonconcat_dims=True)
  return tf.concat(parts, axis=0)


def local_batch(strategy: tf.distribute.Strategy, features: Any) -> Any:
  """This worker's per-replica ``features`` as one batch, in replica order
  (what ``experimental_distribute_dataset`` split)."""
  leaves = tf.nest.flatten(features, expand_composites=False)
  joined = []
  for leaf in leaves:
    parts = list(strategy.experimental_local_results(leaf))
    joined.append(parts[0] if len(parts) == 1 else _concat(parts))
  return tf.nest.pack_sequence_as(features, joined, expand_composites=False)


class FdoTracker:
  """An ``FdoCollector`` that writes its statistics every N steps.

  Attributes:
    collector: the ``FdoCollector``.
    seconds: time spent computing statistics.
    path: the file written (``<stats_dir>/fdo_stats.json``).
  """

  def __init__(
    self,
    collector: FdoCollector,
    stats_dir: str,
    every_n_steps: int = 100,
  ):
    if every_n_steps < 1:
      raise ValueError(f"every_n_steps must be >= 1; got {every_n_steps}.")
    self.collector = collector
    self.every_n_steps = int(every_n_steps)
    os.makedirs(stats_dir, exist_ok=True)
    self.path = os.path.join(stats_dir, "fdo_stats.json")
    self.seconds = 0.0
    self.train_seconds: float | None = None

  def observe(self, features: Any) -> None:
    """Adds one global batch; writes the file every ``every_n_steps``."""
    import time  # noqa: PLC0415

    start = time.perf_counter()
    self.collector.update(features)
    self.seconds += time.perf_counter() - start
    if self.collector.steps % self.every_n_steps == 0:
      self.save()

  def save(self) -> str | None:
    """Writes the statistics (with the cost, if ``train_seconds`` is set);
    None before any batch."""
    if self.collector.steps == 0:
      return None
    stats = self.collector.result()
    stats.save(self.path)
    with open(self.path) as f:
      data = json.load(f)
    data["cost"] = self.cost()
    with open(self.path, "w") as f:
      json.dump(data, f, indent=2, sort_keys=True)
    return self.path

  def cost(self) -> dict[str, float | None]:
    """Seconds per batch of the statistics, and per training step when
    ``train_seconds`` (the steps' time without the statistics) is set."""
    steps = max(1, self.collector.steps)
    per_batch = self.seconds / steps
    step = None if self.train_seconds is None else self.train_seconds / steps
    return {
      "fdo_seconds_per_batch": per_batch,
      "train_step_seconds": step,
      "fdo_over_train_step": per_batch / step if step else None,
    }


def keras_callback(
  feature_config: Any,
  topology_spec: Any,
  stats_dir: str,
  *,
  every_n_steps: int = 100,
  features_fn: Any = None,
  **collector_kwargs: Any,
) -> Any:
  """A Keras callback that keeps FDO statistics while ``fit`` trains.

  A callback sees no batches, so it taps the dataset: pass
  ``callback.tap(dataset)`` to ``fit`` (a ``tf.data`` map that hands each
  global batch's ids to the collector on the input pipeline's thread), and
  the callback writes ``<stats_dir>/fdo_stats.json`` every
  ``every_n_steps`` batches and at the end of training.

  Args:
    feature_config: see ``FdoCollector``.
    topology_spec: the TPU the limits are for.
    stats_dir: where the statistics go.
    every_n_steps: write every this many batches.
    features_fn: the features of a dataset element (default: its first
      item of a tuple, else the element).
    **collector_kwargs: ``optimizer``, ``percentile``, ``limits``.

  Returns:
    The ``keras.callbacks.Callback``.
  """
  import keras  # noqa: PLC0415

  tracker = FdoTracker(
    FdoCollector(feature_config, topology_spec, **collector_kwargs),
    stats_dir,
    every_n_steps,
  )
  features_of = features_fn or _features_of

  class FdoCallback(keras.callbacks.Callback):
    """Writes FDO statistics of the tapped dataset while ``fit`` runs."""

    def __init__(self):
      super().__init__()
      self.tracker = tracker

    def tap(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
      spec = dataset.element_spec
      features_spec = features_of(spec)

      def observe(*flat):
        features = tf.nest.pack_sequence_as(
          features_spec, list(flat), expand_composites=True
        )
        tracker.collector.update(features)
        return np.int64(0)

      def fn(*element):
        element = element[0] if len(element) == 1 else element
        flat = tf.nest.flatten(features_of(element), expand_composites=True)
        token = tf.py_function(observe, flat, tf.int64)
        with tf.control_dependencies([token]):
          return tf.nest.map_structure(
            tf.identity, element, expand_composites=True
          )

      return dataset.map(fn)

    def on_train_batch_end(self, batch, logs=None):
      if tracker.collector.steps and (batch + 1) % every_n_steps == 0:
        tracker.save()

    def on_train_end(self, logs=None):
      tracker.save()

  return FdoCallback()
