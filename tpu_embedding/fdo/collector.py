"""The statistics batch after batch: ``FdoCollector``, ``compute_stats``.

A collector makes the ``Layout`` on the first global batch (TensorFlow
stacks for one per-chip batch shape), partitions every batch and keeps the
per-step maxima, the ids buffer per chip and, given limits, the ids they
would drop; ``result()`` is the ``FdoStats`` so far. ``compute_stats`` runs
one over a dataset.

Example:
  >>> import numpy as np
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> table = tpe.TableConfig(64, 8, name="items")
  >>> data = tf.data.Dataset.from_tensor_slices(
  ...     {"item": np.arange(64) % 64}).batch(32)
  >>> stats = compute_stats(
  ...     {"item": tpe.FeatureConfig(table)}, data, "v5p-8",
  ...     optimizer=tpe.SGD(0.1), limits=(1, 1))
  >>> stats.steps, stats.tables["items"].dropped_ids
  (2, 0)
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import numpy as np
import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.fdo.configs import to_tf_feature_config
from tpu_embedding.fdo.layout import Layout
from tpu_embedding.fdo.layout import resolve_stacking
from tpu_embedding.fdo.partitioning import PAD
from tpu_embedding.fdo.partitioning import StepCounts
from tpu_embedding.fdo.partitioning import partition
from tpu_embedding.fdo.samples import feature_ids
from tpu_embedding.fdo.samples import features_of
from tpu_embedding.fdo.stats import TF_DEFAULT_LIMIT
from tpu_embedding.fdo.stats import FdoStats
from tpu_embedding.fdo.stats import TableStats
from tpu_embedding.fdo.topologies import topology

TFE = tf.tpu.experimental.embedding


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
    stacking: str | None = None,
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
      stacking: how tables stack: ``"tensorflow"`` (``TPUEmbeddingV2``,
        keras-rs on TensorFlow), ``"none"`` (each table alone:
        ``disable_table_stacking=True`` / keras-rs ``table_stacking=None``)
        or ``"jax"`` (keras-rs configs on JAX: jax-tpu-embedding's
        ``auto_stack_tables``, see ``jax_layout``); None: ``"none"`` where
        ``sparse_core_config`` disables stacking, else ``"tensorflow"``.
    """
    if not 0 <= percentile <= 100:
      raise ValueError(f"percentile must be in [0, 100]; got {percentile}.")
    self.topology = topology(topology_spec)
    self.percentile = float(percentile)
    self.limits = _limits_dict(limits)
    self.stacking = resolve_stacking(stacking, sparse_core_config)
    if self.stacking == "jax":
      from tpu_embedding.fdo import jax_layout

      jax_layout.check(feature_config)
    self._feature_config = feature_config
    self._tf_config = to_tf_feature_config(feature_config, optimizer)
    self._sparse_core_config = sparse_core_config
    self._paths = [
      p for p, _ in compat.flatten_with_joined_string_paths(self._tf_config)
    ]
    self._structure = self._tf_config
    self.layout: Layout | None = None
    self._shapes: dict[str, tuple[int, ...]] = {}
    self._steps: dict[str, list[StepCounts]] = collections.defaultdict(list)
    self._ids_per_step: dict[str, list[int]] = collections.defaultdict(list)
    self._unique_per_step: dict[str, list[int]] = collections.defaultdict(list)
    self._buffer: dict[str, int] = collections.defaultdict(int)
    self._total: dict[str, int] = collections.defaultdict(int)
    self._dropped: dict[str, int] = collections.defaultdict(int)
    self._over: dict[str, int] = collections.defaultdict(int)
    # Per partition [chip, source SparseCore, shard], the most in a step.
    self._partition_ids: dict[str, np.ndarray] = {}
    self._partition_unique: dict[str, np.ndarray] = {}
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
    rows = self.stacking == "jax"
    ids = {
      path: feature_ids(x, path, nchips, rows_are_samples=rows)
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
      self.layout = self._make_layout(shapes)
    counts = partition(self.layout, ids, self.limits)
    for name, step in counts.items():
      self._ids_per_step[name].append(int(step.ids.max(initial=0)))
      self._unique_per_step[name].append(int(step.unique_ids.max(initial=0)))
      self._buffer[name] = max(self._buffer[name], step.ids_buffer_per_chip)
      self._total[name] += int(step.ids.sum())
      for most, seen in (
        (self._partition_ids, step.ids),
        (self._partition_unique, step.unique_ids),
      ):
        most[name] = np.maximum(most.get(name, seen), seen)
      if step.dropped is not None and self.limits is not None:
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
      while (per_sample * stack.sample_count) % PAD:
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
        limits=self.limits[name] if self.limits is not None else None,
        partition_max_ids=self._partition_ids[name].copy(),
        partition_max_unique_ids=self._partition_unique[name].copy(),
      )
    return FdoStats(
      self.topology, self.percentile, self.steps, tables, self.stacking
    )

  def _make_layout(self, shapes: dict[str, tuple[int, ...]]) -> Layout:
    if self.stacking != "jax":
      return Layout(
        self._tf_config,
        self.topology,
        shapes,
        self._sparse_core_config,
        stacking=self.stacking,
      )
    from tpu_embedding.fdo.jax_layout import jax_layout

    nchips = self.topology.num_chips
    global_shapes = {
      p: (shape[0] * nchips,) + tuple(shape[1:]) for p, shape in shapes.items()
    }
    return jax_layout(
      self._feature_config, self._paths, self.topology, global_shapes
    )

  def _table_names(self) -> set[str]:
    return {f.table.name for f in tf.nest.flatten(self._tf_config)}


def _percentile(values: list[int], q: float) -> int:
  return int(np.percentile(np.asarray(values), q, method="higher"))


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
  stacking: str | None = None,
) -> FdoStats:
  """SparseCore statistics of ``dataset`` (see ``tpu_embedding.fdo``).

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
    stacking: ``"tensorflow"``, ``"none"`` or ``"jax"`` (see
      ``FdoCollector``).

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
    stacking=stacking,
  )
  features_fn = features_fn or features_of
  for i, element in enumerate(dataset):
    if num_batches is not None and i >= num_batches:
      break
    collector.update(features_fn(element))
  return collector.result()
