"""tf.data helpers for embedding inputs: batching, distribution, ids.

Small building blocks for the input pipelines that feed ``TPUEmbedding``,
in the shape TPU users write them:

* ``batch``, ``prefetch`` and ``with_options`` (autotune, determinism);
  ``batch`` drops a short last batch, for fixed per-replica shapes;
* ``per_replica_batch_size``, ``shard_for_input_pipeline`` and
  ``distribute_fn`` for ``strategy.distribute_datasets_from_function``,
  and ``input_options`` for it and ``experimental_distribute_dataset``,
  which keeps the (sparse) ids on the host as TPU users do;
* ``multi_hot_to_sparse``: dense ``(batch, k)`` ids as a ``SparseTensor``
  that keeps id 0 (``tf.sparse.from_dense`` drops it);
* ``prefetch_rows``: the rows of tables kept on disk read while the step
  before runs.

Reading files and validating records is the application's business (the
Criteo readers of ``model_garden.ranking.data`` have theirs).

Example:
  >>> import tensorflow as tf
  >>> from tpu_embedding import data
  >>> ds = tf.data.Dataset.range(10)
  >>> ds = data.prefetch(data.batch(ds, 4))
  >>> [b.numpy().tolist() for b in ds]
  [[0, 1, 2, 3], [4, 5, 6, 7]]
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

#: A dataset-building function for ``distribute_fn``.
DatasetFn = Callable[
  [int, "tf.distribute.InputContext | None"], tf.data.Dataset
]


def shard_for_input_pipeline(
  dataset: tf.data.Dataset,
  input_context: tf.distribute.InputContext | None,
) -> tf.data.Dataset:
  """Keeps this input pipeline's share of ``dataset`` (round robin).

  ``tf.distribute.InputContext`` has no ``shard`` method: this is the
  ``dataset.shard(num_input_pipelines, input_pipeline_id)`` idiom.

  Args:
    dataset: any dataset.
    input_context: the context ``distribute_datasets_from_function`` passes,
      or None (then ``dataset`` is returned unchanged).

  Returns:
    Every ``num_input_pipelines``-th element, from ``input_pipeline_id`` on.

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding import data
    >>> ctx = tf.distribute.InputContext(num_input_pipelines=2,
    ...                                  input_pipeline_id=1)
    >>> ds = data.shard_for_input_pipeline(tf.data.Dataset.range(5), ctx)
    >>> [int(x) for x in ds]
    [1, 3]
  """
  if input_context is None or input_context.num_input_pipelines <= 1:
    return dataset
  return dataset.shard(
    input_context.num_input_pipelines, input_context.input_pipeline_id
  )


def batch(
  dataset: tf.data.Dataset,
  batch_size: int,
  *,
  drop_remainder: bool = True,
  deterministic: bool | None = None,
) -> tf.data.Dataset:
  """Batches in parallel; by default drops a last partial batch.

  TPU programs (and ``TPUEmbedding``'s fixed per-replica shapes) need every
  batch the same size, hence ``drop_remainder=True``.

  Args:
    dataset: unbatched elements.
    batch_size: elements per batch (per replica under a strategy).
    drop_remainder: drop the last batch if it is short.
    deterministic: passed to ``Dataset.batch``.

  Returns:
    The batched dataset.

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding import data
    >>> ds = data.batch(tf.data.Dataset.range(5), 2, drop_remainder=False)
    >>> [len(b) for b in ds]
    [2, 2, 1]
  """
  if batch_size <= 0:
    raise ValueError(f"batch_size must be positive, got {batch_size}.")
  return dataset.batch(
    batch_size,
    drop_remainder=drop_remainder,
    num_parallel_calls=tf.data.AUTOTUNE,
    deterministic=deterministic,
  )


def prefetch(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """Overlaps input preparation with training (``tf.data.AUTOTUNE``).

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding import data
    >>> len(list(data.prefetch(tf.data.Dataset.range(3))))
    3
  """
  return dataset.prefetch(tf.data.AUTOTUNE)


def prefetch_rows(
  dataset: tf.data.Dataset,
  embedding: Any,
  features: Callable[[Any], Any] | None = None,
  batches_ahead: int = 2,
) -> tf.data.Dataset:
  """Reads the rows of a batch's disk-tiered tables while a step runs.

  Each batch passes through unchanged, ``batches_ahead`` batches ahead of
  the step: on its way, its ids go to their tables
  (``TableStore.prefetch_rows``), and a table kept on disk
  (``sharding.DiskTier``) reads those of its rows that its RAM cache does
  not hold into RAM, in the background (each row once), so that the step
  that looks them up takes them from there (as FBGEMM prefetches batch i + 1
  during batch i). No number changes (a row written after it was read
  ahead is read again); without tables on disk the dataset is returned
  as it is.

  Args:
    dataset: batches of the features nest ``embedding.enqueue`` takes.
    embedding: a built ``TPUEmbedding`` (off TPU).
    features: picks the features nest out of an element (default: the
      element is the nest).
    batches_ahead: batches read ahead of the step (each missed row read
      once): 2 keeps the disk busy while a step takes the rows of the
      batch before (where the disk is the limit: 1.3x the rate of 1 on
      this machine); 1 uses less CPU beside the step (where the step's
      host work is the limit: 1.1-1.2x the rate of 2).

  Returns:
    The same batches.

  Example:
    >>> import tensorflow as tf
    >>> import tpu_embedding as tpe
    >>> from tpu_embedding import data
    >>> emb = tpe.TPUEmbedding({"f": tpe.FeatureConfig(tpe.TableConfig(
    ...     10, 2, name="t"))}, tpe.SGD(0.1))
    >>> emb.build()
    >>> ds = tf.data.Dataset.from_tensor_slices({"f": [[1, 2], [3, 4]]})
    >>> [b["f"].numpy().tolist() for b in data.prefetch_rows(ds, emb)]
    [[1, 2], [3, 4]]
  """
  if batches_ahead < 1:
    raise ValueError(f"batches_ahead must be at least 1, got {batches_ahead}.")
  if not embedding.disk_tier_counts():
    return dataset  # (no table on disk: nothing to read ahead)
  configs = tf.nest.flatten(embedding.feature_config)
  names = [embedding.table_names[c.table] for c in configs]
  stores = embedding.table_stores
  # Per table read ahead, its features (a batch's rows of a table: one set).
  reading = {
    name: [at for at, other in enumerate(names) if other == name]
    for name in dict.fromkeys(names)
    if stores[name].reads_ahead
  }
  pick = features or (lambda element: element)
  given = pick(dataset.element_spec)
  try:
    tf.nest.assert_same_structure(
      embedding.feature_config, given, check_types=False
    )
  except (ValueError, TypeError):
    raise ValueError(
      "prefetch_rows: the batches' features are not shaped like the "
      f"embedding's feature_config ({_paths(embedding.feature_config)}; "
      f"got {_paths(given)}): pass features= picking the nest that "
      "enqueue takes."
    ) from None

  def warm(*ids: np.ndarray) -> np.bool_:
    for name, rows in zip(reading, ids, strict=True):
      stores[name].prefetch_rows(rows)
    return np.bool_(True)

  def stage(*element: Any) -> Any:
    element = element[0] if len(element) == 1 else element
    values = tf.nest.flatten(pick(element))
    ids = [
      tf.concat([_ids(values[at]) for at in features], 0)
      for features in reading.values()
    ]
    done = tf.numpy_function(warm, ids, tf.bool, stateful=True)
    with tf.control_dependencies([done]):
      return tf.nest.map_structure(tf.identity, element)

  return dataset.map(stage).prefetch(batches_ahead)


def _paths(nest: Any, prefix: str = "") -> str:
  """A nest's paths (``a/0, b``), for an error's one line."""
  if isinstance(nest, Mapping):
    items = [(str(key), nest[key]) for key in sorted(nest)]
  elif isinstance(nest, (list, tuple)):
    items = [(str(at), value) for at, value in enumerate(nest)]
  else:
    return prefix[:-1] or "one value"
  return ", ".join(_paths(value, f"{prefix}{key}/") for key, value in items)


def _ids(value: Any) -> tf.Tensor:
  """A feature's ids, flat (dense, ragged or sparse)."""
  if isinstance(value, tf.RaggedTensor):
    value = value.flat_values
  elif isinstance(value, tf.SparseTensor):
    value = value.values
  return tf.reshape(tf.cast(value, tf.int64), [-1])


def with_options(
  dataset: tf.data.Dataset,
  *,
  deterministic: bool = True,
  autotune: bool = True,
) -> tf.data.Dataset:
  """Sets ``tf.data.Options``: autotuning, determinism, parallel maps.

  Args:
    dataset: any dataset.
    deterministic: whether element order must be reproducible; False lets
      parallel stages hand out elements as soon as they are ready.
    autotune: let tf.data tune parallelism and buffer sizes.

  Returns:
    ``dataset`` with those options.

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding import data
    >>> ds = data.with_options(tf.data.Dataset.range(3), deterministic=False)
    >>> ds.options().deterministic
    False
  """
  options = tf.data.Options()
  options.deterministic = deterministic
  options.autotune.enabled = autotune
  options.experimental_optimization.map_parallelization = True
  options.experimental_optimization.parallel_batch = True
  return dataset.with_options(options)


def per_replica_batch_size(
  global_batch_size: int,
  input_context: tf.distribute.InputContext | None,
) -> int:
  """The batch one replica gets from a global batch size.

  Args:
    global_batch_size: examples per step over all replicas.
    input_context: from ``distribute_datasets_from_function``, or None.

  Returns:
    ``input_context.get_per_replica_batch_size(global_batch_size)``, or
    ``global_batch_size`` without a context.

  Raises:
    ValueError: when the global batch does not divide evenly.

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding import data
    >>> ctx = tf.distribute.InputContext(num_replicas_in_sync=4)
    >>> data.per_replica_batch_size(4096, ctx)
    1024
  """
  if input_context is None:
    return global_batch_size
  return input_context.get_per_replica_batch_size(global_batch_size)


def distribute_fn(
  make_dataset: DatasetFn,
  global_batch_size: int,
) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
  """Wraps a dataset builder for ``strategy.distribute_datasets_from_function``.

  Args:
    make_dataset: ``make_dataset(per_replica_batch_size, input_context)``
      returns one pipeline's dataset, batched per replica; it should shard
      its input with ``input_context`` (e.g. with
      ``shard_for_input_pipeline``).
    global_batch_size: examples per step over all replicas.

  Returns:
    ``dataset_fn(input_context)``.

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding import data
    >>> def make(batch_size, ctx):
    ...   ds = data.shard_for_input_pipeline(tf.data.Dataset.range(8), ctx)
    ...   return data.batch(ds, batch_size)
    >>> strategy = tf.distribute.get_strategy()
    >>> dist = strategy.distribute_datasets_from_function(
    ...   data.distribute_fn(make, 4), data.input_options())
    >>> [b.numpy().tolist() for b in dist]
    [[0, 1, 2, 3], [4, 5, 6, 7]]
  """

  def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
    batch_size = per_replica_batch_size(global_batch_size, input_context)
    return make_dataset(batch_size, input_context)

  return dataset_fn


def input_options() -> tf.distribute.InputOptions:
  """Distribution options that keep the ids on the host.

  TPU embedding inputs are enqueued from the host (and ``SparseTensor`` /
  ``RaggedTensor`` ids cannot be fetched to a TPU), so TPU users pass
  ``experimental_fetch_to_device=False``; ``TPUEmbedding.enqueue`` then
  moves what it needs. Pass the result to
  ``distribute_datasets_from_function`` or
  ``experimental_distribute_dataset``.

  Example:
    >>> from tpu_embedding import data
    >>> data.input_options().experimental_fetch_to_device
    False
  """
  return tf.distribute.InputOptions(experimental_fetch_to_device=False)


def multi_hot_to_sparse(ids: tf.Tensor) -> tf.SparseTensor:
  """Dense multi-hot ids ``(batch, k)`` as a ``SparseTensor``, keeping 0.

  A dense ``(batch, k)`` id tensor is looked up id by id (output
  ``(batch, k, dim)``); as a ``SparseTensor`` its row is combined
  (``sum``/``mean``/``sqrtn``) into ``(batch, dim)``, the multi-hot way.
  ``tf.sparse.from_dense`` would silently drop every id equal to 0 (it
  drops zeros); this keeps all ``batch * k`` ids.

  Args:
    ids: ``[batch, k]`` integer ids.

  Returns:
    A ``SparseTensor`` of dense shape ``[batch, k]`` holding every id.

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding import data
    >>> sp = data.multi_hot_to_sparse(tf.constant([[0, 5], [3, 0]]))
    >>> sp.values.numpy().tolist(), sp.dense_shape.numpy().tolist()
    ([0, 5, 3, 0], [2, 2])
  """
  ids = tf.convert_to_tensor(ids)
  if ids.shape.rank != 2:
    raise ValueError(f"ids must be [batch, k], got shape {ids.shape}.")
  shape = tf.shape(ids, out_type=tf.int64)
  rows = tf.repeat(tf.range(shape[0]), shape[1])
  cols = tf.tile(tf.range(shape[1]), [shape[0]])
  return tf.SparseTensor(
    indices=tf.stack([rows, cols], axis=1),
    values=tf.reshape(ids, [-1]),
    dense_shape=shape,
  )
