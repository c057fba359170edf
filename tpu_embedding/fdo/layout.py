"""TensorFlow's stacking of a config's tables on a topology: ``Layout``.

``TPUEmbeddingV2`` stacks tables of the same width and optimizer into
stacked tables, each table at a row offset and with a shard rotation (so
that stacked tables start on different SparseCore shards), and each
feature's samples at a sample offset. ``Layout`` asks TensorFlow's own
``_stack_tables_with_same_table_dim_and_optimizer`` (its C++
``SparseCoreLayoutStacker``, which runs on CPU), so the stacked table
names, offsets and rotations are TensorFlow's.

Example:
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.fdo import configs, layout, topologies
  >>> features = {
  ...     name: tpe.FeatureConfig(tpe.TableConfig(64, 8, name=name))
  ...     for name in ("a", "b")}
  >>> tf_config = configs.to_tf_feature_config(features, tpe.SGD(0.1))
  >>> stacks = layout.Layout(
  ...     tf_config, topologies.topology("v5p-8"), {"a": (16,), "b": (16,)}
  ... ).stacks
  >>> stacks["a_b"].tables, stacks["a_b"].sample_count
  (('a', 'b'), 32)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.fdo.topologies import Topology

TFE = tf.tpu.experimental.embedding

#: ``stacking``: TensorFlow's ``TPUEmbeddingV2`` (and keras-rs on
#: TensorFlow), jax-tpu-embedding's (keras-rs on JAX), or none (each table
#: its own stacked table: TensorFlow's ``disable_table_stacking=True``,
#: keras-rs' ``table_stacking=None``).
STACKINGS = ("tensorflow", "jax", "none")


class _DropMessages(logging.Filter):
  """Drops the log records whose message starts with ``prefix``."""

  def __init__(self, prefix: str):
    super().__init__()
    self.prefix = prefix

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(self.prefix)


@contextlib.contextmanager
def without_absl_warning(prefix: str) -> Iterator[None]:
  """Drops absl's log records starting with ``prefix`` while the block
  runs: a library's warning about what a call here asks for on purpose
  (TensorFlow's ``Table stacking is disabled.`` once per unstacked
  layout); nothing else, and only for that call."""
  logger = logging.getLogger("absl")
  drop = _DropMessages(prefix)
  logger.addFilter(drop)
  try:
    yield
  finally:
    logger.removeFilter(drop)


def resolve_stacking(stacking: str | None, sparse_core_config: Any) -> str:
  """``stacking`` checked against ``sparse_core_config``'s
  ``disable_table_stacking`` (None: ``"none"`` where that is set, else
  ``"tensorflow"``)."""
  disabled = bool(getattr(sparse_core_config, "disable_table_stacking", False))
  if stacking is None:
    return "none" if disabled else "tensorflow"
  if stacking not in STACKINGS:
    raise ValueError(
      f"stacking must be one of {', '.join(map(repr, STACKINGS))}; got "
      f"{stacking!r}."
    )
  if disabled and stacking != "none":
    raise ValueError(
      f"stacking={stacking!r}, but the SparseCoreEmbeddingConfig given has "
      "disable_table_stacking=True; pass stacking='none' (or neither)."
    )
  return stacking


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
    stacking: ``"tensorflow"``, ``"none"`` (TensorFlow's stacking disabled)
      or ``"jax"`` (``jax_layout.jax_layout``: jax-tpu-embedding's).
  """

  def __init__(
    self,
    tf_feature_config: Any,
    topo: Topology,
    output_shapes: Mapping[str, tuple[int, ...]],
    sparse_core_config: Any = None,
    stacking: str | None = None,
  ):
    """Stacks as TensorFlow does.

    Args:
      tf_feature_config: TensorFlow's ``FeatureConfig`` nest.
      topo: the ``Topology``.
      output_shapes: per feature path, its per-chip output shape.
      sparse_core_config: the TPU run's ``SparseCoreEmbeddingConfig``.
      stacking: ``"tensorflow"`` or ``"none"`` (TensorFlow's
        ``disable_table_stacking=True``, without its warning); None: as
        ``sparse_core_config`` says.
    """
    self.stacking = resolve_stacking(stacking, sparse_core_config)
    if self.stacking == "jax":
      raise ValueError("Layout stacks as TensorFlow; see jax_layout.")
    if self.stacking == "none" and not getattr(
      sparse_core_config, "disable_table_stacking", False
    ):
      sparse_core_config = TFE.SparseCoreEmbeddingConfig(
        disable_table_stacking=True
      )
    config = compat.clone_tf_feature_config(tf_feature_config)
    flat = compat.flatten_with_joined_string_paths(config)
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
    with without_absl_warning("Table stacking is disabled."):
      s = compat.stack_sparse_core_tables(
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

  @classmethod
  def from_parts(
    cls,
    topo: Topology,
    stacks: dict[str, StackLayout],
    features: list[_FeatureLayout],
    stacking: str,
  ) -> Layout:
    """A layout another stacker made (``jax_layout``)."""
    made = cls.__new__(cls)
    made.topology = topo
    made.stacks = stacks
    made.features = features
    made.stacking = stacking
    return made
