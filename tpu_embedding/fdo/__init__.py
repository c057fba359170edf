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

This package computes them on any machine (no TPU), from a feature config
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

The package, one concept per module:

* ``topologies``: TPU generations, slice presets, ``Topology``;
* ``configs``: this package's, TensorFlow's or keras-rs' feature configs
  as TensorFlow's;
* ``samples``: a feature's global batch as per-chip samples and ids;
* ``layout``: TensorFlow's stacking (``Layout``, ``StackLayout``), or
  none (``stacking="none"``);
* ``jax_layout``: keras-rs on JAX, stacked by jax-tpu-embedding's own
  ``auto_stack_tables`` (``stacking="jax"``);
* ``partitioning``: the ids each partition receives in a step
  (``partition``, ``StepCounts``) and those limits would drop;
* ``stats``: ``TableStats`` (per stacked table, and per partition
  ``[chip, source SparseCore, destination shard]``), ``FdoStats`` and the
  configs to paste;
* ``collector``: ``FdoCollector``, ``compute_stats``;
* the file (``load``...) is the engine's, ``engines/fdo_file.py``;
* ``online``: while training (``FdoTracker``, ``keras_callback``,
  ``local_batch``).

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

from tpu_embedding.engines.fdo_file import FORMAT
from tpu_embedding.engines.fdo_file import load
from tpu_embedding.engines.fdo_file import load_sparse_core_config
from tpu_embedding.fdo.collector import FdoCollector
from tpu_embedding.fdo.collector import compute_stats
from tpu_embedding.fdo.configs import to_tf_feature_config
from tpu_embedding.fdo.layout import STACKINGS
from tpu_embedding.fdo.layout import Layout
from tpu_embedding.fdo.layout import StackLayout
from tpu_embedding.fdo.online import FdoTracker
from tpu_embedding.fdo.online import keras_callback
from tpu_embedding.fdo.online import local_batch
from tpu_embedding.fdo.partitioning import StepCounts
from tpu_embedding.fdo.partitioning import partition
from tpu_embedding.fdo.stats import TF_DEFAULT_IDS_PER_CHIP_PER_SAMPLE
from tpu_embedding.fdo.stats import TF_DEFAULT_LIMIT
from tpu_embedding.fdo.stats import FdoStats
from tpu_embedding.fdo.stats import TableStats
from tpu_embedding.fdo.stats import short_name
from tpu_embedding.fdo.topologies import GENERATIONS
from tpu_embedding.fdo.topologies import Generation
from tpu_embedding.fdo.topologies import Topology
from tpu_embedding.fdo.topologies import topology

__all__ = [
  "FORMAT",
  "GENERATIONS",
  "STACKINGS",
  "TF_DEFAULT_IDS_PER_CHIP_PER_SAMPLE",
  "TF_DEFAULT_LIMIT",
  "FdoCollector",
  "FdoStats",
  "FdoTracker",
  "Generation",
  "Layout",
  "StackLayout",
  "StepCounts",
  "TableStats",
  "Topology",
  "compute_stats",
  "keras_callback",
  "load",
  "load_sparse_core_config",
  "local_batch",
  "partition",
  "short_name",
  "to_tf_feature_config",
  "topology",
]
