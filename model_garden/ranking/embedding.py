"""The ranking models' embeddings: one ``tpu_embedding`` table per feature.

As Model Garden's ``_get_tpu_embedding_feature_config``: categorical
feature ``i`` (keyed ``str(i)``, as the Criteo readers name it) has its
own table ``embedding_table_{i:02d}`` of ``vocab_sizes[i]`` rows,
``combiner="mean"`` (multi-hot ids are averaged) and a truncated normal
initializer of standard deviation ``1 / sqrt(dim)``; with
``ModelConfig.vocabulary="dynamic"`` each table is a
``tpe.DynamicVocabulary`` of that many rows, fed raw int64 keys.
``make_embedding`` creates the ``tpu_embedding.TPUEmbedding`` under the
current strategy: tables above ``ModelConfig.size_threshold`` rows are
row-sharded across the replicas, the others replicated; with
``ModelConfig.disk_directory``, tables above ``disk_size_threshold`` rows
are kept on that local disk behind a RAM cache (``placement_policy``;
row-sharded over the replicas of ``mirrored`` or
``multi_worker_mirrored``, a cache each; each worker its own
subdirectory: ``disk_directory``).

Example:
  >>> from model_garden.ranking import embedding
  >>> from model_garden.ranking.configs import definitions
  >>> config = definitions.ModelConfig(vocab_sizes=(100, 7), embedding_dim=4)
  >>> features = embedding.feature_config(config)
  >>> features["1"].table.name, features["1"].table.combiner
  ('embedding_table_01', 'mean')
"""

from __future__ import annotations

import math
import os
from typing import Any

import tensorflow as tf

import tpu_embedding as tpe
from model_garden.ranking import strategies
from model_garden.ranking.configs import definitions
from tpu_embedding.sharding import DiskTier
from tpu_embedding.sharding import PlacementPolicy


def table_name(index: int) -> str:
  """The name (and checkpoint key) of feature ``index``'s table."""
  return f"embedding_table_{index:02d}"


def feature_config(
  config: definitions.ModelConfig,
  seed: int | None = None,
  per_replica_batch_size: int | None = None,
) -> dict[str, tpe.FeatureConfig]:
  """``{str(i): FeatureConfig}``: one mean-combined table per feature.

  Args:
    config: the vocabulary sizes and widths.
    seed: seeds table ``i``'s initializer with ``seed + i`` (the same
      values whatever the sharding); None: unseeded.
    per_replica_batch_size: fixes the features' ``output_shape`` (what
      TPU programs need); None lets the first batch decide.

  Returns:
    The feature config, keyed as the Criteo readers' ``sparse_features``.
  """
  features = {}
  for i, (size, dim) in enumerate(
    zip(config.vocab_sizes, config.embedding_dims(), strict=True)
  ):
    table = tpe.TableConfig(
      vocabulary_size=size,
      dim=dim,
      combiner="mean",
      initializer=tf.initializers.TruncatedNormal(
        mean=0.0,
        stddev=1 / math.sqrt(dim),
        seed=None if seed is None else seed + i,
      ),
      name=table_name(i),
      vocabulary=_vocabulary(config),
      storage=tpe.RowStorage(
        config.table_dtype,
        config.slot_dtype,
        config.rounding,
        seed=0 if seed is None else seed,
      ),
    )
    features[str(i)] = tpe.FeatureConfig(
      table=table,
      name=str(i),
      output_shape=[per_replica_batch_size] if per_replica_batch_size else None,
    )
  return features


def _vocabulary(config: definitions.ModelConfig) -> Any:
  """Each table's ``DynamicVocabulary`` (None for fixed tables)."""
  if config.vocabulary != "dynamic":
    return None
  return tpe.DynamicVocabulary(
    min_count=config.vocabulary_min_count,
    eviction=config.vocabulary_eviction,
    ttl_steps=config.vocabulary_ttl_steps or None,
  )


def disk_table_names(config: definitions.ModelConfig) -> tuple[str, ...]:
  """The names of the tables kept on disk (``ModelConfig.disk_tables``)."""
  return tuple(table_name(i) for i in config.disk_tables())


def disk_directory(
  config: definitions.ModelConfig,
  strategy: str = "default",
  task: tuple[str | None, int] | None = None,
) -> str:
  """Where this process keeps its tables on disk: ``disk_directory``, or
  under ``multi_worker_mirrored`` its task's own ``disk_directory/<type>
  <index>`` (``task``, default ``TF_CONFIG``'s; ``worker0`` without one):
  each worker's blocks in their own files, as the library locks a
  table's directory for one process.

  Example:
    >>> from model_garden.ranking import embedding
    >>> from model_garden.ranking.configs import definitions
    >>> config = definitions.ModelConfig(disk_directory="/ssd")
    >>> embedding.disk_directory(config, "mirrored")
    '/ssd'
    >>> embedding.disk_directory(config, "multi_worker_mirrored", ("worker", 1))
    '/ssd/worker1'
  """
  if strategy != "multi_worker_mirrored":
    return config.disk_directory
  kind, index = strategies.task_type() if task is None else task
  return os.path.join(config.disk_directory, f"{kind or 'worker'}{index}")


def placement_policy(
  config: definitions.ModelConfig, strategy: str = "default"
) -> int | PlacementPolicy:
  """``TPUEmbedding(row_sharding_threshold=...)``: the threshold, with the
  tables kept on disk when ``disk_directory`` names a directory (this
  process's under ``strategy``: ``disk_directory()``).

  Example:
    >>> from model_garden.ranking import embedding
    >>> from model_garden.ranking.configs import definitions
    >>> config = definitions.ModelConfig(vocab_sizes=(100, 7))
    >>> embedding.placement_policy(config)
    50000
    >>> embedding.placement_policy(definitions.ModelConfig(
    ...   vocab_sizes=(100, 7), disk_directory="/ssd", disk_size_threshold=10,
    ...   disk_cache_bytes=4096)).disk
    DiskTier(directory='/ssd', cache_bytes=4096, tables=('embedding_table_00',))
  """
  threshold = config.row_sharding_threshold()
  names = disk_table_names(config)
  if not names:
    return threshold
  directory = disk_directory(config, strategy)
  disk = DiskTier(directory, config.disk_cache_bytes, names)
  return PlacementPolicy(threshold, disk=disk)


def make_embedding(
  config: definitions.ModelConfig,
  optimizer: Any,
  *,
  seed: int | None = None,
  pipeline: bool = False,
  per_replica_batch_size: int | None = None,
  strategy: str = "default",
) -> tpe.TPUEmbedding:
  """The model's ``TPUEmbedding`` under the current strategy (not built).

  Args:
    config: the model config (tables, ``size_threshold``, the disk tier).
    optimizer: the tables' optimizer (``optimizers.embedding_optimizer``).
    seed: see ``feature_config``.
    pipeline: ``pipeline_execution_with_tensor_core`` (TPU only).
    per_replica_batch_size: see ``feature_config``.
    strategy: ``runtime.distribution_strategy`` (``disk_directory``).

  Example:
    >>> import tpu_embedding as tpe
    >>> from model_garden.ranking import embedding
    >>> from model_garden.ranking.configs import definitions
    >>> emb = embedding.make_embedding(
    ...   definitions.ModelConfig(vocab_sizes=(100, 7), embedding_dim=4),
    ...   tpe.SGD(0.1))
    >>> sorted(emb.variables)
    ['embedding_table_00', 'embedding_table_01']
  """
  return tpe.TPUEmbedding(
    feature_config(config, seed, per_replica_batch_size),
    optimizer,
    pipeline_execution_with_tensor_core=pipeline,
    row_sharding_threshold=placement_policy(config, strategy),
    # A table kept on disk is held alone: under MirroredStrategy the
    # library refuses stacks of tables on disk, which "auto" makes on GPUs.
    table_stacking=None if config.disk_tables() else "auto",
  )


def activations_in_order(activations: dict[str, Any]) -> list[Any]:
  """The activations of features ``"0", "1", ...`` in numeric order."""
  return [activations[str(i)] for i in range(len(activations))]
