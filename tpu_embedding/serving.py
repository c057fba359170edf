"""Serving lookups: ``TPUEmbeddingForServing`` and ``serving_embedding_lookup``.

These follow TensorFlow's serving semantics, which differ from training in
three places: a dense id tensor of any shape is gathered as is
(``(B, L)`` gives ``(B, L, dim)``); a sparse input with
``validate_weights_and_indices=True`` (or of rank > 2) uses the "safe"
lookup, which drops negative ids and non-positive weights; and the feature
config's ``max_sequence_length`` applies to rank-2 sparse and ragged inputs.
The safe lookup keeps non-positive weights under the ``sum`` combiner, and
sparse input ignores ``FeatureConfig.output_shape`` (giving ``(B, dim)``),
both as in TensorFlow.
Ids at or above ``vocabulary_size`` are an error, never clipped.

One deliberate difference from TensorFlow: with
``validate_weights_and_indices=False`` TensorFlow's sparse lookup returns
only as many rows as the last non-empty example; this one always returns
``batch_size`` rows (the missing ones are zeros).

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> table = tpe.TableConfig(5, 2, initializer=tpe.RowIdInitializer(),
  ...                         combiner="sum")
  >>> features = {"f": tpe.FeatureConfig(table)}
  >>> serving = tpe.TPUEmbeddingForServing(features, optimizer=None)
  >>> ids = tf.sparse.from_dense([[1, 2], [0, 4]])
  >>> serving({"f": ids})["f"].numpy().tolist()
  [[3.0, 3.0], [4.0, 4.0]]
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import tensorflow as tf

from tpu_embedding import errors
from tpu_embedding import memory
from tpu_embedding.backends.local import LocalBackend
from tpu_embedding.backends.selection import check_disk_tables
from tpu_embedding.compat import Trackable
from tpu_embedding.config import FeatureConfig
from tpu_embedding.config import TableConfig
from tpu_embedding.inputs import check_ids_in_range
from tpu_embedding.inputs import check_input_type
from tpu_embedding.inputs import gate_on_all_checks
from tpu_embedding.inputs import is_sequence
from tpu_embedding.inputs import prepare_feature
from tpu_embedding.kernels.ops import lookup_ops
from tpu_embedding.keys import KeysToRows
from tpu_embedding.lookup import occurrence_rows
from tpu_embedding.optimizers.base import Optimizer
from tpu_embedding.resolved import key_mapping
from tpu_embedding.resolved import resolve
from tpu_embedding.resolved import rows_table
from tpu_embedding.sharding import IN_MEMORY
from tpu_embedding.sharding import DiskTier
from tpu_embedding.stacking import stack_of
from tpu_embedding.step.activations import look_up_groups
from tpu_embedding.structure import flatten_with_paths
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.base import parameters_by_user_table
from tpu_embedding.tables.base import row_reader
from tpu_embedding.tables.base import variables_by_name
from tpu_embedding.tracking import VariableTracker
from tpu_embedding.types import ActivationsNest
from tpu_embedding.types import FeatureConfigNest
from tpu_embedding.types import FeatureNest
from tpu_embedding.types import WeightsNest
from tpu_embedding.vocabularies.dynamic_tables import DynamicTables
from tpu_embedding.vocabularies.sharing import LocalReplicas
from tpu_embedding.vocabularies.state import VocabularyState

#: Reads rows of one table by id, in id order.
RowReader = Callable[[tf.Tensor], tf.Tensor]


@tf.autograph.experimental.do_not_convert
def serving_embedding_lookup(
  inputs: FeatureNest,
  weights: WeightsNest | None,
  tables: Mapping[TableConfig, Any],
  feature_config: FeatureConfigNest,
) -> ActivationsNest:
  """Looks up ``inputs`` in ``tables`` with the feature configs' rules.

  Args:
    inputs: a nest of id tensors; its paths must be a subset of the
      feature config's (a serving signature may take only some features).
    weights: None, or a nest like ``inputs`` (entries may be None).
    tables: ``{TableConfig: variable or tensor}``.
    feature_config: the nest of ``FeatureConfig`` the inputs refer to.

  Returns:
    A nest like ``inputs`` of activations.

  Raises:
    ValueError: for paths not in the feature config, wrong kinds, dtypes,
      ranks, or weights that do not fit their ids.
  """
  readers = {table: row_reader(value) for table, value in tables.items()}
  return lookup_with_readers(inputs, weights, readers, feature_config)


@tf.autograph.experimental.do_not_convert
def lookup_with_readers(
  inputs: Any,
  weights: Any,
  readers: Mapping[TableConfig, RowReader],
  feature_config: Any,
  translators: Mapping[TableConfig, KeysToRows] | None = None,
) -> Any:
  """``serving_embedding_lookup`` reading rows through ``readers``.

  Args:
    inputs: a nest of id tensors (paths: a subset of the feature config's).
    weights: None, or a nest like ``inputs``.
    readers: ``{TableConfig: function(ids) -> rows}``, e.g. a table
      store's ``gather``.
    feature_config: the nest of ``FeatureConfig`` the inputs refer to.
    translators: ``{TableConfig: function(keys) -> row ids}`` of the
      tables whose inputs are keys (their key mappings' ``serving_rows``,
      ``keys.py``).
  """
  flat_inputs = flatten_with_paths(inputs)
  flat_weights = [None] * len(flat_inputs)
  if weights is not None:
    tf.nest.assert_same_structure(inputs, weights)
    flat_weights = tf.nest.flatten(weights)
  features = dict(flatten_with_paths(feature_config))
  input_paths = {path for path, _ in flat_inputs}
  if not input_paths.issubset(features):
    raise ValueError(
      "Inputs are not a subset of feature_config. Inputs keys are "
      f"{sorted(input_paths)}, but feature_config keys are "
      f"{sorted(features)}; unknown: {sorted(input_paths - set(features))}"
    )
  outputs = []
  for (path, inp), weight in zip(flat_inputs, flat_weights, strict=True):
    feature = features[path]
    if feature.table not in readers:
      raise ValueError(
        f"No table given for feature {path} (table {feature.table.name!r})."
      )
    read = readers[feature.table]
    inp = key_mapping(feature.table).serving_rows(
      inp, path, feature.table.name, (translators or {}).get(feature.table)
    )
    feature = feature.replace(table=rows_table(feature.table))
    outputs.append(_lookup_one(inp, weight, feature, read, path))
  return tf.nest.pack_sequence_as(inputs, outputs)


def _lookup_one(
  inp: Any, weight: Any, feature: FeatureConfig, read: RowReader, path: str
) -> tf.Tensor:
  _check_serving_weight(inp, weight, path)
  check_input_type(inp, weight, path)
  if weight is not None and feature.max_sequence_length > 0:
    raise ValueError(
      errors.SEQUENCE_WEIGHTS.format(
        path=path, length=feature.max_sequence_length
      )
    )
  table_config = feature.table
  name = table_config.name or "<unnamed>"
  if isinstance(inp, tf.Tensor):
    if feature.max_sequence_length > 0:
      raise ValueError(errors.SEQUENCE_DENSE.format(path=path))
    ids = check_ids_in_range(
      tf.cast(inp, tf.int64), table_config.vocabulary_size, path, name
    )
    return read(ids)
  if isinstance(inp, tf.SparseTensor):
    if feature.output_shape.rank:
      # TF's serving lookup ignores output_shape for sparse input (and
      # then never treats it as a sequence).
      feature = feature.replace(
        output_shape=tf.TensorShape(None), max_sequence_length=0
      )
    safe = not is_sequence(feature, inp) and (
      feature.validate_weights_and_indices or inp.shape.rank > 2
    )
    if safe:
      inp, weight = _prune_invalid(inp, weight, table_config.combiner)
  named = table_config.replace(name=name)
  (prepared,) = gate_on_all_checks(
    [prepare_feature(inp, weight, feature.replace(table=named), path)]
  )
  ops = lookup_ops()  # Serving: TensorFlow's ops alone.
  (activations,), _ = look_up_groups(
    [(stack_of([named], 0), [[0]])],
    [prepared],
    lambda requests: [occurrence_rows(read(requests[0][1]), requests[0][2])],
    ops=ops,
  )
  return activations


def _check_serving_weight(inp: Any, weight: Any, path: str) -> None:
  """Weight errors with the texts of TensorFlow's serving lookup."""
  if weight is None:
    return
  if isinstance(inp, tf.Tensor):
    raise ValueError(f"Weight specified for {path}, but input is dense.")
  if type(weight) is not type(inp):
    raise ValueError(
      f"Weight for {path} is of type {type(weight)} but it does not match "
      f"type of the input which is {type(inp)}."
    )


def _prune_invalid(
  ids: tf.SparseTensor, weights: tf.SparseTensor | None, combiner: str
):
  """Drops negative ids, and non-positive weights unless summing.

  This is TensorFlow's "safe" sparse lookup: with the ``sum`` combiner
  negative and zero weights are kept.
  """
  keep = ids.values >= 0
  if weights is not None:
    if combiner != "sum":
      keep = tf.logical_and(keep, weights.values > 0)
    weights = tf.sparse.retain(weights, keep)
  return tf.sparse.retain(ids, keep), weights


class TPUEmbeddingForServing(Trackable):
  """Embedding tables for serving (and CPU lookups) from a checkpoint.

  A drop-in for ``tf.tpu.experimental.embedding.TPUEmbeddingForServing``:
  it creates the same variables under the same checkpoint keys (with the
  optimizer's slots when an optimizer is given), so it restores checkpoints
  of ``TPUEmbedding`` trained anywhere, ours or TensorFlow's.

  Example:
    >>> import tensorflow as tf
    >>> import tpu_embedding as tpe
    >>> table = tpe.TableConfig(8, 2, name="t")
    >>> serving = tpe.TPUEmbeddingForServing(tpe.FeatureConfig(table), None)
    >>> serving(tf.constant([1, 7])).shape
    TensorShape([2, 2])
  """

  def __init__(
    self,
    feature_config: FeatureConfigNest,
    optimizer: Optimizer | None,
    experimental_sparsecore_restore_info: Any = None,
    *,
    disk: DiskTier = IN_MEMORY,
  ):
    """Creates the serving object.

    Args:
      feature_config: a nest of ``FeatureConfig``.
      optimizer: an optimizer whose slots should be created too (to load a
        training checkpoint completely), or None for the tables only.
      experimental_sparsecore_restore_info: accepted for compatibility.
      disk: tables kept on a local disk behind a RAM cache
        (``sharding.DiskTier``), as in training: a checkpoint restores
        into their files in chunks, and ``export_for_serving`` streams
        them from there, so tables larger than memory export. Lookups read
        their rows from the files (cached rows from the cache).

    Raises:
      RuntimeError: if created under a ``TPUStrategy``.
      ValueError: for an invalid feature config, or a ``disk`` naming a
        table that is not one or has a dynamic vocabulary.
    """
    del experimental_sparsecore_restore_info
    strategy = tf.distribute.get_strategy()
    if isinstance(
      strategy,
      (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy),
    ):
      raise RuntimeError("Serving on TPU is not yet supported.")
    self._feature_config = feature_config
    self._config = resolve(feature_config, optimizer)
    check_disk_tables(disk, self._config.tables)
    # Each table whole on the default device, or on disk.
    self._backend = LocalBackend(disk)
    self._stores: dict[str, TableStore] = {}
    # One whole copy of each vocabulary, here (serving runs no step).
    self._dynamic = DynamicTables(self._config, LocalReplicas())
    self._built = False

  def build(self) -> None:
    """Creates the table (and slot) variables.

    Raises:
      errors.TableMemoryError: for tables that cannot fit in this
        process's memory (``memory.py``), before allocating them.
    """
    if self._built:
      return
    whole = {0: None}  # The tables in one process, on the default device.
    tables = self._config.tables
    needed = memory.tables_here(
      tables, None, whole, tf.distribute.get_strategy()
    )
    memory.check_tables_fit(self._backend.resident_bytes(needed, tables))
    with tf.init_scope():
      tracker = VariableTracker(self)
      self._stores = self._backend.create_tables(tables, tracker)
      for name, store in self._stores.items():
        # (a 16-bit table's: a training checkpoint's key, matched)
        store.track_update_count(tracker, [name])
      # Dynamic tables: the whole vocabulary, under the training key.
      self._dynamic.build([None], self._stores, tracker)
    self._built = True

  @property
  def vocabulary_states(self) -> dict[str, VocabularyState]:
    """``{table name: VocabularyState}`` of the dynamic tables."""
    self.build()
    return self._dynamic.states

  @property
  def table_stores(self) -> dict[str, TableStore]:
    """``{table name: TableStore}`` (whole tables, or on disk)."""
    self.build()
    return self._stores

  @property
  def feature_config(self) -> FeatureConfigNest:
    """The feature config nest this object was created with."""
    return self._feature_config

  @property
  def embedding_tables(self) -> dict[TableConfig, tf.Variable]:
    """``{TableConfig: table variable}``, keyed by the user's configs."""
    return parameters_by_user_table(
      self._config.user_tables, self._config.tables, self.table_stores
    )

  @property
  def variables(self) -> dict[str, dict[str, tf.Variable]]:
    """``{table_name: {"parameters": var, <slot name>: var, ...}}``."""
    return variables_by_name(self.table_stores)

  def __call__(
    self, features: FeatureNest, weights: WeightsNest | None = None
  ) -> ActivationsNest:
    """Looks up ``features``; see ``embedding_lookup``."""
    return self.embedding_lookup(features, weights)

  def embedding_lookup(
    self, features: FeatureNest, weights: WeightsNest | None = None
  ) -> ActivationsNest:
    """Serving lookups of ``features`` (a subset of the feature config);
    a dynamic table's raw keys are mapped by its vocabulary first."""
    tables = self.embedding_tables
    return lookup_with_readers(
      features,
      weights,
      {table: row_reader(value) for table, value in tables.items()},
      self._feature_config,
      self._dynamic.translators(),
    )
