"""Dynamic vocabularies: the config's checks and the step rules against
an independent oracle (``tests/vocabulary_oracle.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.vocabulary_oracle import OracleVocabulary
from tests.vocabulary_oracle import splitmix64_finalizer
from tpu_embedding import kernels
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import KernelOps
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.keys.buckets import bucket_of
from tpu_embedding.keys.buckets import key_ids
from tpu_embedding.vocabularies.transition import VocabularyVariables
from tpu_embedding.vocabularies.transition import advance
from tpu_embedding.vocabularies.transition import find


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"capacity": 0}, "capacity must be None .* Received: 0"),
    ({"min_count": 0}, "min_count must be an int >= 1. Received: 0"),
    ({"eviction": "fifo"}, "eviction must be one of .* Received: 'fifo'"),
    ({"ttl_steps": 0}, "ttl_steps must be None or an int >= 1"),
    ({"key_dtype": tf.float32}, "key_dtype must be tf.int64 or tf.string"),
    ({"bucket_size": 0}, "bucket_size must be an int >= 1"),
    ({"probation_size": -2}, "probation_size must be None or an int >= 1"),
    ({"default_value": "x"}, "default_value must be a number"),
  ],
)
def test_invalid_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    tpe.DynamicVocabulary(**kwargs)


def test_table_config_checks_vocabulary():
  with pytest.raises(ValueError, match="TableConfig 'users'.*capacity \\(5\\)"):
    tpe.TableConfig(10, 2, name="users", vocabulary=tpe.DynamicVocabulary(5))
  with pytest.raises(ValueError, match="'users' must be None or a"):
    tpe.TableConfig(10, 2, name="users", vocabulary={"capacity": 10})
  table = tpe.TableConfig(
    10, 2, name="t", vocabulary=tpe.DynamicVocabulary(10, min_count=2)
  )
  assert "DynamicVocabulary(capacity=10, min_count=2" in repr(table)
  assert table.vocabulary.replace(min_count=3).min_count == 3


def test_buckets_match_the_oracle_hash():
  keys = [0, 1, -1, 2**62, -(2**63), 123456789]
  buckets = bucket_of(tf.constant(keys, tf.int64), 7).numpy().tolist()
  assert buckets == [splitmix64_finalizer(k) % 7 for k in keys]


def test_string_keys_are_fingerprints():
  keys = key_ids(tf.constant(["a", "b", "a"]))
  assert keys.dtype == tf.int64
  assert keys[0] == keys[2] and keys[0] != keys[1]
  assert bool(tf.reduce_all(keys >= 0))


CAPACITY = 22  # The streams' tables: 6 buckets of 3 or 4 rows.


def _stream_config(min_count, eviction, ttl_steps) -> tpe.DynamicVocabulary:
  """The vocabulary the streams run through (buckets of 4 rows, 3
  probation entries each)."""
  return tpe.DynamicVocabulary(
    min_count=min_count,
    eviction=eviction,
    ttl_steps=ttl_steps,
    bucket_size=4,
    probation_size=3,
  )


def _stream(rng, steps, batch, key_space):
  """Skewed raw keys (negative and huge ones too)."""
  ranks = np.minimum(rng.zipf(1.3, size=(steps, batch)), key_space) - 1
  scramble = rng.permutation(key_space).astype(np.int64) * 7919 - 2**40
  return scramble[ranks]


def _assert_same_state(variables, oracle):
  np.testing.assert_array_equal(variables["keys"].numpy(), oracle.keys)
  np.testing.assert_array_equal(variables["last_step"].numpy(), oracle.last)
  np.testing.assert_array_equal(variables["counts"].numpy(), oracle.count)
  if oracle.p:
    entries = np.array(oracle.probation).reshape(-1, 3)
    np.testing.assert_array_equal(
      variables["probation_keys"].numpy(), entries[:, 0]
    )
    np.testing.assert_array_equal(
      variables["probation_counts"].numpy(), entries[:, 1]
    )
    np.testing.assert_array_equal(
      variables["probation_last_step"].numpy(), entries[:, 2]
    )
  assert int(variables["step"].numpy()) == oracle.step
  assert int(variables["evictions"].numpy()) == oracle.evictions


def _ops(kernel: bool) -> StepOps:
  """The kernel ops or TensorFlow's (``kernels/ops.py``)."""
  if not kernel:
    return TENSORFLOW_OPS
  if kernels.load() is None:
    pytest.skip("the kernel library did not build")
  return KernelOps(kernels.load())


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("min_count", [1, 3])
@pytest.mark.parametrize("ttl_steps", [None, 4])
@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("kernel", [False, True], ids=["tf_ops", "kernel"])
def test_steps_match_the_oracle(
  rng, eviction, min_count, ttl_steps, traced, kernel
):
  config = _stream_config(min_count, eviction, ttl_steps)
  capacity = CAPACITY
  variables = VocabularyVariables(config, capacity)
  oracle = OracleVocabulary(
    capacity, 4, min_count, eviction, ttl_steps, probation_size=3
  )

  ops = _ops(kernel)

  def run(v, keys):
    return advance(v, keys, ops)

  step = tf.function(run) if traced else run
  for keys in _stream(rng, steps=25, batch=24, key_space=120):
    result = step(variables, tf.constant(keys))
    rows, given = oracle.advance(keys.tolist())
    np.testing.assert_array_equal(result.rows.numpy(), rows)
    assert sorted(result.new_rows.numpy().tolist()) == sorted(given)
    _assert_same_state(variables, oracle)
    probe = tf.constant(keys[:5])
    np.testing.assert_array_equal(
      find(variables, probe).numpy(), [oracle.find(k) for k in keys[:5]]
    )


@pytest.mark.parametrize("num_shards", [2, 4, 7])  # 7: one owns no bucket
@pytest.mark.parametrize(
  "min_count, eviction, ttl_steps",
  [(3, "lru", 4), (1, "lfu", None), (1, "lru", None), (1, "lru", 4)],
)
@pytest.mark.parametrize("kernel", [False, True], ids=["tf_ops", "kernel"])
def test_sharded_state_steps_match_the_oracle(
  rng, num_shards, min_count, eviction, ttl_steps, kernel
):
  """Each shard of the state owns a range of buckets: its keys get their
  row from it alone (-1 from the others), and the shards side by side are
  the one-device state."""
  config = _stream_config(min_count, eviction, ttl_steps)
  capacity = CAPACITY
  shards = [
    VocabularyVariables(config, capacity, shard, num_shards)
    for shard in range(num_shards)
  ]
  assert sum(v.layout.local_rows for v in shards) == capacity
  oracle = OracleVocabulary(
    capacity, 4, min_count, eviction, ttl_steps, probation_size=3
  )

  ops = _ops(kernel)

  @tf.function
  def step(variables, keys):
    return advance(variables, keys, ops)

  for keys in _stream(rng, steps=20, batch=24, key_space=120):
    results = [step(v, tf.constant(keys)) for v in shards]
    rows, given = oracle.advance(keys.tolist())
    answers = np.stack([r.rows.numpy() for r in results])
    assert ((answers >= 0).sum(axis=0) == 1).all()  # one owner per key
    np.testing.assert_array_equal(answers.max(axis=0), rows)
    new_rows = [r for result in results for r in result.new_rows.numpy()]
    assert sorted(new_rows) == sorted(given)
    found = np.stack([find(v, tf.constant(keys)).numpy() for v in shards])
    np.testing.assert_array_equal(found.max(axis=0), rows)
  whole = {
    name: np.concatenate([v[name].numpy() for v in shards])
    for name in ("keys", "last_step", "counts", "probation_keys")
  }
  np.testing.assert_array_equal(whole["keys"], oracle.keys)
  np.testing.assert_array_equal(whole["last_step"], oracle.last)
  np.testing.assert_array_equal(whole["counts"], oracle.count)
  if oracle.p:
    entries = np.array(oracle.probation).reshape(-1, 3)
    np.testing.assert_array_equal(whole["probation_keys"], entries[:, 0])
  assert {int(v["step"].numpy()) for v in shards} == {oracle.step}
  assert sum(int(v["evictions"].numpy()) for v in shards) == oracle.evictions


@pytest.mark.parametrize("kernel", [False, True], ids=["tf_ops", "kernel"])
def test_admission_eviction_and_expiry_by_hand(kernel):
  """One bucket of 2 rows: the rules on a story small enough to read."""
  config = tpe.DynamicVocabulary(
    min_count=2, eviction="lru", ttl_steps=3, bucket_size=2
  )
  v = VocabularyVariables(config, 2)

  ops = _ops(kernel)

  def step(*keys):
    rows = advance(v, tf.constant(keys, tf.int64), ops).rows
    return rows.numpy().tolist()

  assert step(10) == [2]  # seen once: no row (the default row is 2)
  assert step(10, 11) == [0, 2]  # 10 reaches min_count: row 0
  assert step(11, 12, 12) == [1, 0, 0]  # 11 admitted; 12 (2 at once) evicts 10
  assert find(v, tf.constant([10, 11, 12], tf.int64)).numpy().tolist() == [
    2,
    1,
    0,
  ]
  for _ in range(3):
    step(12)
  # Step 6: 11, last seen at step 3, is still live (6 - 3 <= ttl_steps).
  assert find(v, tf.constant([11], tf.int64)).numpy().tolist() == [1]
  step(12)
  # 11 unseen for 4 steps: expired (its row reads the default).
  assert find(v, tf.constant([11, 12], tf.int64)).numpy().tolist() == [2, 0]


@pytest.mark.parametrize("kernel", [False, True], ids=["tf_ops", "kernel"])
def test_step_without_keys_advances_the_step(kernel):
  v = VocabularyVariables(tpe.DynamicVocabulary(bucket_size=2), 4)
  result = advance(v, tf.zeros([0], tf.int64), _ops(kernel))
  assert result.rows.shape == [0] and result.new_rows.shape == [0]
  assert int(v["step"].numpy()) == 1


def test_kernel_ops_use_the_kernel_and_tensorflow_ops_never():
  if kernels.load() is None:
    pytest.skip("the kernel library did not build")
  v = VocabularyVariables(tpe.DynamicVocabulary(bucket_size=2), 4)

  def ops(fn):
    graph = tf.function(fn).get_concrete_function().graph
    return {op.type for op in graph.get_operations()}

  keys = tf.constant([3, 4], tf.int64)

  kernel_ops = KernelOps(kernels.load())
  assert "TpeVocabularyStep" in ops(lambda: advance(v, keys, kernel_ops).rows)
  assert "TpeVocabularyStep" not in ops(
    lambda: advance(v, keys, TENSORFLOW_OPS).rows
  )
  assert not {o for o in ops(lambda: find(v, keys)) if o.startswith("Tpe")}
