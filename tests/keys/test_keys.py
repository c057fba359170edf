"""Key mappings: what a resolved table carries, and resolving it again."""

from __future__ import annotations

import inspect

import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tpu_embedding.gradients import RowGradients
from tpu_embedding.gradients import concat_pieces
from tpu_embedding.keys import IdentityMapping
from tpu_embedding.keys.dynamic import DynamicMapping
from tpu_embedding.resolved import ResolvedTable
from tpu_embedding.resolved import key_mapping
from tpu_embedding.resolved import resolve
from tpu_embedding.resolved import rows_table

#: TableConfig's constructor arguments.
ARGUMENTS = [
  name
  for name in inspect.signature(tpe.TableConfig.__init__).parameters
  if name != "self"
]


def _feature_config():
  users = tpe.TableConfig(
    6,
    2,
    name="users",
    vocabulary=tpe.DynamicVocabulary(min_count=2, bucket_size=2),
  )
  capped = tpe.TableConfig(
    3, 2, name="capped", vocabulary=tpe.DynamicVocabulary(capacity=3)
  )
  items = tpe.TableConfig(5, 2)  # unnamed: table_<i>
  return {
    "u": tpe.FeatureConfig(users),
    "i": tpe.FeatureConfig(items),
    "c": tpe.FeatureConfig(capped),
    "u2": tpe.FeatureConfig(users),
  }


def _described(config):
  """Everything a resolved config says, as plain values."""
  return (
    config.paths,
    [(t.get_config(), t.key_mapping) for t in config.tables],
    [config.tables.index(f.table) for f in config.features],
  )


def test_resolving_twice_is_resolving_once():
  once = resolve(_feature_config(), tpe.SGD(0.1))
  again = tf.nest.pack_sequence_as(once.structure, list(once.features))
  twice = resolve(again, tpe.SGD(0.1))
  assert _described(twice) == _described(once)
  # Flattened by path: c, i, u (u2 shares users).
  assert [t.name for t in twice.tables] == ["capped", "table_1", "users"]
  assert [t.vocabulary_size for t in twice.tables] == [4, 5, 7]
  assert [key_mapping(t).rows for t in twice.tables] == [4, 5, 7]


def test_resolved_tables_are_valid_table_configs():
  """Resolved tables are made by TableConfig's constructor: their fields
  are valid arguments (a vocabulary's capacity is its mapping's)."""
  for table in resolve(_feature_config(), tpe.SGD(0.1)).tables:
    assert isinstance(table, ResolvedTable)
    assert table.vocabulary is None
    assert table.vocabulary_size == table.key_mapping.rows
    tpe.TableConfig(**{name: getattr(table, name) for name in ARGUMENTS})
    tpe.TableConfig.from_config(table.get_config())


def test_the_constructor_still_refuses_a_capacity_off_vocabulary_size():
  with pytest.raises(ValueError, match="capacity .3. differs from"):
    tpe.TableConfig(4, 2, vocabulary=tpe.DynamicVocabulary(capacity=3))


def test_a_users_table_declares_the_mapping_resolve_gives_it():
  features = _feature_config()
  capped, items, users_table = resolve(features, None).tables
  for path, table in (("c", capped), ("i", items), ("u", users_table)):
    assert key_mapping(features[path].table) == key_mapping(table)
  users = users_table.key_mapping
  assert isinstance(users, DynamicMapping)
  assert (users.capacity, users.default_row, users.rows) == (6, 6, 7)
  assert users.vocabulary == features["u"].table.vocabulary.replace(capacity=6)
  assert items.key_mapping == IdentityMapping(5)
  assert capped.key_mapping.capacity == 3
  assert features["u"].table.vocabulary_size == 6  # never changed


def test_rows_table_reads_every_row_by_id():
  users = _feature_config()["u"].table
  rows = rows_table(users)
  assert (rows.name, rows.vocabulary_size, rows.vocabulary) == (
    "users",
    7,
    None,
  )
  assert rows.key_mapping == IdentityMapping(7)
  assert key_mapping(rows_table(rows)) == IdentityMapping(7)


def test_a_dynamic_mapping_refuses_the_tpu_and_stacking():
  users = key_mapping(_feature_config()["u"].table)
  with pytest.raises(ValueError, match="'users' has a DynamicVocabulary"):
    users.check_on_tpu("users")
  assert "never stacked" in users.unstackable
  IdentityMapping(5).check_on_tpu("items")  # no error
  assert IdentityMapping(5).unstackable is None


def test_updates_drop_only_the_default_row():
  users = key_mapping(_feature_config()["u"].table)
  ids = tf.constant([2, 6, 4], tf.int64)  # 6: the default row
  grads = RowGradients.dense(tf.constant([[1.0], [2.0], [3.0], [4.0]]))
  index = tf.constant([0, 1, 2, 1])
  kept, kept_grads, kept_index = users.updated_rows(ids, grads, index)
  assert kept.numpy().tolist() == [2, 4]
  assert concat_pieces(kept_grads).numpy().tolist() == [[1.0], [3.0]]
  assert kept_index.numpy().tolist() == [0, 1]
  same = IdentityMapping(7).updated_rows(ids, grads, index)
  assert same[0] is ids and same[1] is grads and same[2] is index
