"""The engine's dynamic tables: raw keys become rows before each lookup.

A dynamic table of capacity ``C`` is stored as ``C + 1`` rows: rows
``[0, C)`` are given to keys, row ``C`` is the default row (what keys
without a row read; never updated). Its resolved table carries that
``DynamicMapping`` (``keys/dynamic.py``), which also drops the default row from
updates; ``DynamicTables`` does the rest around the one lookup path:

* a training lookup gathers the global batch's keys of each dynamic table
  (its features in order, replicas in order; ``sharing.py``), runs the
  vocabulary's step on this replica's copy (or shard: then each key's row
  comes from the replica owning its bucket, and every replica learns all
  new rows), resets the rows given to new keys (values and optimizer
  slots, the same values on every replica) in the block this replica
  holds, and hands the lookup each key's row;
* other lookups map keys with the state as it is (shards combined);
* with pipelining, the held update drops the rows just given to new keys.

The state of a row-sharded table is sharded with it (``state.py``): shard
``r`` of ``R`` is a range of buckets, so no replica holds the whole map.
Checkpoints hold it under ``<table>/vocabulary`` (``build``, for the
engine and for serving).

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> table = tpe.TableConfig(
  ...     8, 2, name="t", initializer=tf.ones_initializer(),
  ...     vocabulary=tpe.DynamicVocabulary(bucket_size=4))
  >>> emb = tpe.TPUEmbedding(tpe.FeatureConfig(table), tpe.SGD(0.5))
  >>> emb.enqueue(tf.constant([10**12, -3]), training=True)
  >>> activations = emb.dequeue()
  >>> activations.numpy().tolist()
  [[1.0, 1.0], [1.0, 1.0]]
  >>> emb.apply_gradients(tf.ones_like(activations))
  >>> emb(tf.constant([10**12, 77])).numpy().tolist()  # 77: never seen
  [[0.5, 0.5], [0.0, 0.0]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding.config import TableConfig
from tpu_embedding.inputs import PreparedFeature
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.keys import KeysToRows
from tpu_embedding.keys.dynamic import DynamicMapping
from tpu_embedding.resolved import ResolvedConfig
from tpu_embedding.resolved import key_mapping
from tpu_embedding.resolved import table_name
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.base import variable_specs
from tpu_embedding.tracking import VariableTracker
from tpu_embedding.vocabularies.sharded_state import ShardedVocabulary
from tpu_embedding.vocabularies.sharing import ReplicaSharing
from tpu_embedding.vocabularies.sharing import flat
from tpu_embedding.vocabularies.sharing import slices_of
from tpu_embedding.vocabularies.state import ReplicatedVocabulary
from tpu_embedding.vocabularies.state import VocabularyState
from tpu_embedding.vocabularies.transition import is_live


def dynamic_mappings(
  tables: Sequence[TableConfig],
) -> list[tuple[TableConfig, DynamicMapping]]:
  """The tables among ``tables`` whose keys a vocabulary maps to rows,
  with their mappings (``resolved.key_mapping``), in order."""
  pairs = [(table, key_mapping(table)) for table in tables]
  return [(t, m) for t, m in pairs if isinstance(m, DynamicMapping)]


def check_dynamic_support(tables: Sequence[TableConfig], backend: Any) -> None:
  """Raises where the dynamic tables among ``tables`` cannot train.

  Raises:
    ValueError: naming the tables and why.
  """
  dynamic = [table for table, _ in dynamic_mappings(tables)]
  alone = backend.steps_alone_under
  if dynamic and alone is not None:
    raise ValueError(
      f"Tables {[table_name(t) for t in dynamic]} have a DynamicVocabulary, "
      f"which does not train under {alone} (not supported yet: the "
      "vocabulary's step needs every worker's keys of a step at once)."
    )
  for table in dynamic:
    optimizer = table.optimizer
    if optimizer is None:
      continue
    if optimizer.updates_all_rows:
      raise ValueError(
        f"Table '{table_name(table)}' has a DynamicVocabulary and an "
        f"optimizer that changes every row each step ({optimizer!r}): the "
        "default row and the rows of absent keys must not change. Use a "
        "lazy optimizer (e.g. Adam(lazy_adam=True))."
      )
    if optimizer.slot_variable_creation_fn:
      raise ValueError(
        f"Table '{table_name(table)}' has a DynamicVocabulary and its "
        "optimizer a slot_variable_creation_fn: rows given to new keys "
        "reset their slots, which needs the optimizer's own slots."
      )


class DynamicTables:
  """Maps the keys of a config's dynamic tables to rows.

  Args:
    config: the resolved config.
    sharing: how the step's replicas share keys and new rows
      (``sharing.for_strategy``).
  """

  def __init__(self, config: ResolvedConfig, sharing: ReplicaSharing):
    self._config = config
    self._sharing = sharing
    self._tables = dynamic_mappings(config.tables)
    self._states: dict[str, VocabularyState] = {}

  @property
  def states(self) -> dict[str, VocabularyState]:
    """Each dynamic table's vocabulary state, by table name."""
    return dict(self._states)

  def build(
    self,
    devices: Sequence[str | None],
    stores: dict[str, TableStore],
    tracker: VariableTracker,
    strategy: tf.distribute.Strategy | None = None,
  ) -> None:
    """Creates the state (a copy, or a shard, per local replica), saved
    under ``<table>/vocabulary``.

    Args:
      devices: one device per local replica.
      stores: the table stores by name.
      tracker: registers the states for checkpoints.
      strategy: the strategy (its replicas are the shards): the state of
        a table whose store is sharded by rows (``rows_sharded``) is
        sharded too, one shard per replica.
    """
    for table, mapping in self._tables:
      name = table_name(table)
      state: VocabularyState
      if stores[name].rows_sharded and strategy is not None:
        state = ShardedVocabulary(
          mapping.vocabulary, mapping.capacity, devices, strategy
        )
      else:
        state = ReplicatedVocabulary(
          mapping.vocabulary, mapping.capacity, devices
        )
      self._states[name] = state
      tracker.register(f"{name}/vocabulary", state, restore=True)

  def write_default_rows(self, stores: dict[str, TableStore]) -> None:
    """Fills each default row of ``stores`` (by table name) with its
    ``default_value`` (training: serving restores it)."""
    for table, mapping in self._tables:
      default = tf.fill([1, table.dim], mapping.vocabulary.default_value)
      stores[table_name(table)].write_rows(mapping.default_row, default)

  def translators(self) -> dict[TableConfig, KeysToRows]:
    """``{user's table: its keys to rows}`` of the dynamic tables, for
    serving lookups of the user's features: the state as it is now, from
    this process (``VocabularyState.find_live``)."""
    config = self._config
    user_of = {
      id(t): u for t, u in zip(config.tables, config.user_tables, strict=True)
    }
    return {
      user_of[id(table)]: self._states[table_name(table)].find_live
      for table, _ in self._tables
    }

  def statistics(self) -> dict[str, dict[str, int]]:
    """Per dynamic table: ``capacity``, ``rows_in_use`` (live keys at the
    last step), ``evictions`` (live keys evicted so far), ``step`` and
    ``state_bytes`` (of the vocabulary's variables the largest of this
    process's replicas holds: a whole copy, or its shard of a row-sharded
    table's state; the rows and slots not included). Sharded across
    workers: a collective every worker joins."""
    result = {}
    for table, mapping in self._tables:
      state = self._states[table_name(table)]
      whole = state.whole()
      in_use = is_live(
        whole["last_step"], whole["step"], state.vocabulary.ttl_steps
      )
      result[table_name(table)] = {
        "capacity": mapping.capacity,
        "rows_in_use": int(tf.reduce_sum(tf.cast(in_use, tf.int64))),
        "evictions": int(whole["evictions"]),
        "step": int(whole["step"]),
        "state_bytes": max(
          sum(
            v.shape.num_elements() * v.dtype.size
            for v in copy.variables.values()
          )
          for copy in state.copies
        ),
      }
    return result

  def rows(self, prepared: list[PreparedFeature], replica: int) -> list:
    """``prepared`` with each dynamic feature's keys replaced by rows
    (the state as it is: ``VocabularyState.lookup``)."""
    prepared = list(prepared)
    for table, _ in self._tables:
      features = self._config.features_of(table)
      rows = self._states[table_name(table)].lookup(
        [prepared[i].ids for i in features], replica, self._sharing
      )
      for i, feature_rows in zip(features, rows, strict=True):
        prepared[i] = dataclasses.replace(prepared[i], ids=feature_rows)
    return prepared

  def rows_for_training(
    self,
    prepared: list[PreparedFeature],
    replica: int,
    stores: dict[str, TableStore],
    ops: StepOps,
  ) -> tuple[list, dict[str, tf.Tensor]]:
    """Runs each dynamic table's step, then maps keys to rows.

    Args:
      prepared: this replica's prepared features.
      replica: this replica's index among the local ones (its copy of
        the state, and the block of each store it writes).
      stores: the table stores by name.
      ops: the step's row ops (``kernels/ops.py``).

    Returns:
      ``prepared`` with rows for keys, and per dynamic table the rows
      given to new keys at this step (reset: an update held back by
      pipelining must not touch them).
    """
    prepared, new_rows = list(prepared), {}
    for table, _ in self._tables:
      name = table_name(table)
      features = self._config.features_of(table)
      # The global batch's keys: feature by feature, each feature's
      # examples in order (replica after replica), as on one device.
      parts, mine = self._sharing.every_replica(
        [prepared[i].ids for i in features]
      )
      rows, given = self._states[name].step(
        tf.concat(flat(parts), 0), replica, self._sharing, ops
      )
      # One order whatever the layout: the same initial values per row.
      given = tf.sort(given)
      self._reset_rows(stores[name], replica, given)
      new_rows[name] = given
      for i, feature in zip(
        features, slices_of(rows, parts, mine), strict=True
      ):
        prepared[i] = dataclasses.replace(prepared[i], ids=feature)
    return prepared, new_rows

  def _reset_rows(self, store: TableStore, block: int, rows: tf.Tensor):
    """Writes initial values (parameters and slots) to ``rows`` of the
    ``block`` this replica holds: replica 0's values, so that every copy
    of a replicated table stays equal even with a random initializer."""
    table = store.table
    count = tf.size(rows, out_type=tf.int64)
    specs = variable_specs(table)
    values = [
      initial_rows(initializer, count, table.dim, table_name(table))
      for _, initializer, _ in specs
    ]
    values = self._sharing.first_replica(values)
    first, size = store.block_rows(block)
    # The positions of this block's rows, found once (a boolean_mask per
    # variable would build its shape arithmetic each time).
    mine = tf.reshape(
      tf.where(tf.logical_and(rows >= first, rows < first + size)), [-1]
    )
    local = tf.gather(rows, mine) - first
    store.write_block_rows(
      block,
      local,
      {
        key: tf.gather(value, mine)
        for (key, _, _), value in zip(specs, values, strict=True)
      },
    )


def initial_rows(initializer: Any, count: tf.Tensor, dim: int, table: str):
  """``count`` rows of ``initializer``'s values (shape ``[count, dim]``).

  Raises:
    ValueError: for an initializer that cannot make rows for new keys
      (one that only makes a whole table of fixed values).
  """
  try:
    values = initializer(tf.stack([count, dim]), dtype=tf.float32)
    return tf.cast(values, tf.float32)
  except (TypeError, ValueError, NotImplementedError):
    pass
  try:  # Constants need a static shape: one row, repeated.
    row = tf.reshape(initializer([1, dim], dtype=tf.float32), [1, dim])
  except (TypeError, ValueError) as e:
    raise ValueError(
      f"Table '{table}': its initializer {initializer!r} cannot make rows "
      "for new keys of a dynamic vocabulary; use a scalar constant or a "
      "random initializer."
    ) from e
  return tf.tile(row, tf.stack([count, 1]))
