"""tpu_embedding.data: batching, options, distribution, multi-hot ids."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy
from tpu_embedding import data


def test_batch_drops_remainder_by_default():
  sizes = [len(b) for b in data.batch(tf.data.Dataset.range(7), 3)]
  assert sizes == [3, 3]
  ds = data.batch(tf.data.Dataset.range(7), 3)
  assert ds.element_spec.shape.as_list() == [3]
  with pytest.raises(ValueError, match="positive"):
    data.batch(tf.data.Dataset.range(7), 0)


def test_with_options_and_prefetch():
  ds = data.prefetch(
    data.with_options(tf.data.Dataset.range(4), deterministic=False)
  )
  options = ds.options()
  assert options.deterministic is False
  assert options.autotune.enabled is True
  assert options.experimental_optimization.map_parallelization is True
  assert [int(x) for x in ds] == [0, 1, 2, 3]


def test_per_replica_batch_size():
  ctx = tf.distribute.InputContext(num_replicas_in_sync=4)
  assert data.per_replica_batch_size(4096, ctx) == 1024
  assert data.per_replica_batch_size(4096, None) == 4096
  with pytest.raises(ValueError):
    data.per_replica_batch_size(10, ctx)


def test_input_options_keep_ids_on_host():
  options = data.input_options()
  assert isinstance(options, tf.distribute.InputOptions)
  assert options.experimental_fetch_to_device is False


def test_distribute_fn_under_mirrored_strategy():
  strategy = mirrored_strategy(2)
  seen = []

  def make(batch_size, ctx):
    seen.append((batch_size, ctx.num_input_pipelines, ctx.input_pipeline_id))
    ds = tf.data.Dataset.range(16)
    return data.batch(data.shard_for_input_pipeline(ds, ctx), batch_size)

  dist = strategy.distribute_datasets_from_function(
    data.distribute_fn(make, 8), data.input_options()
  )
  batches = [strategy.experimental_local_results(b) for b in dist]
  assert seen == [(4, 1, 0)]
  assert len(batches) == 2
  values = sorted(int(v) for step in batches for r in step for v in r)
  assert values == list(range(16))
  assert all(r.device.endswith("CPU:0") for r in batches[0])


def test_multi_hot_to_sparse_keeps_id_zero_and_sums_in_lookup():
  ids = tf.constant([[0, 2, 0], [1, 1, 3]])
  sparse = data.multi_hot_to_sparse(ids)
  assert sparse.values.numpy().tolist() == [0, 2, 0, 1, 1, 3]
  assert tf.sparse.from_dense(ids).values.numpy().tolist() == [2, 1, 1, 3]

  table = tpe.TableConfig(4, 2, combiner="sum", name="t")
  emb = tpe.TPUEmbedding({"f": tpe.FeatureConfig(table)}, tpe.SGD(0.1))
  out = emb({"f": sparse})["f"].numpy()
  rows = emb.embedding_tables[table].numpy()
  np.testing.assert_allclose(out, rows[ids.numpy()].sum(axis=1), rtol=1e-6)
  with pytest.raises(ValueError, match=r"\[batch, k\]"):
    data.multi_hot_to_sparse(tf.constant([1, 2]))
