"""Training with dynamic vocabularies, checked against numpy oracles.

Raw keys (huge and negative ints, or strings) go through the real
``enqueue`` → ``dequeue`` → ``apply_gradients`` loop on the default
strategy and on 2 and 4 replicas; the oracle maps keys with
``tests/vocabulary_oracle.py`` (the rules, written independently) and
trains rows with ``tests/oracle.py`` (TF's per-row equations). The
gradients depend on the activations, so a stale or misplaced row shows.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests import oracle
from tests import processes
from tests.conftest import mirrored_strategy
from tests.low_precision_oracle import rounded_table
from tests.vocabulary_oracle import OracleVocabulary
from tpu_embedding.vocabularies.sharded_state import ShardedVocabulary

CAPACITY, BUCKET, DIM, BATCH, STEPS = 12, 4, 3, 8, 6
INIT, DEFAULT = 0.25, -0.5
FLOAT32 = tpe.RowStorage()
OPTIMIZERS = {
  "sgd": (lambda: tpe.SGD(0.5), {"learning_rate": 0.5}),
  "adagrad": (
    lambda: tpe.Adagrad(0.3, initial_accumulator_value=0.2),
    {"learning_rate": 0.3, "initial_accumulator_value": 0.2},
  ),
  "adagrad_momentum": (
    lambda: tpe.AdagradMomentum(0.2, momentum=0.9),
    {"learning_rate": 0.2, "momentum": 0.9},
  ),
  "adam": (lambda: tpe.Adam(0.1), {"learning_rate": 0.1}),
  "ftrl": (lambda: tpe.FTRL(0.2), {"learning_rate": 0.2}),
}


def _stream(seed: int):
  """Per step: dense keys ``[BATCH]`` and ragged keys with weights."""
  rng = np.random.default_rng(seed)
  space = np.array([10**12 + 7 * i for i in range(15)] + [-3, -(2**40)])
  steps = []
  for _ in range(STEPS):
    dense = space[np.minimum(rng.zipf(1.4, BATCH), len(space)) - 1]
    lengths = rng.integers(0, 4, BATCH)
    flat = space[np.minimum(rng.zipf(1.2, lengths.sum()), len(space)) - 1]
    weights = rng.uniform(0.5, 2.0, lengths.sum())
    steps.append((dense, lengths, flat, weights))
  return steps


def _loss_terms(seed: int) -> list:
  """Per step, the fixed terms ``r`` of the loss of features a and b."""
  rng = np.random.default_rng(seed)
  return [
    tuple(tf.constant(rng.normal(size=(BATCH, DIM)), tf.float32) for _ in "ab")
    for _ in range(STEPS)
  ]


def _users(storage=FLOAT32, **vocabulary) -> tpe.TableConfig:
  """The dynamic table ``users``: ``CAPACITY`` rows, constant init."""
  return tpe.TableConfig(
    CAPACITY,
    DIM,
    name="users",
    initializer=tf.constant_initializer(INIT),
    vocabulary=tpe.DynamicVocabulary(bucket_size=BUCKET, **vocabulary),
    storage=storage,
  )


def _strategy(replicas: int) -> tf.distribute.Strategy:
  """The default strategy for 1 replica, else a ``MirroredStrategy``."""
  if replicas == 1:
    return tf.distribute.get_strategy()
  return mirrored_strategy(replicas)


def _make(
  strategy,
  optimizer,
  min_count,
  eviction,
  pipelined=False,
  sharded=False,
  storage=FLOAT32,
):
  """``sharded``: the table (and its vocabulary's state) row-sharded over
  the replicas; else replicated."""
  table = _users(
    storage, min_count=min_count, eviction=eviction, default_value=DEFAULT
  )
  with strategy.scope():
    emb = tpe.TPUEmbedding(
      {"a": tpe.FeatureConfig(table), "b": tpe.FeatureConfig(table)},
      optimizer,
      pipeline_execution_with_tensor_core=pipelined,
      row_sharding_threshold=0 if sharded else 10**9,
    )
    emb.build()
  return emb, table


def _train(strategy, emb, stream, loss_r, step=None):
  """Runs the steps (``step``: ``_step(strategy, emb)``, traced once for
  tests that step an embedding call by call); returns each step's global
  activations."""
  if step is None:
    step = _step(strategy, emb)
  outputs = []
  for (dense, lengths, flat, w), (r_a, r_b) in zip(stream, loss_r, strict=True):
    ragged = tf.RaggedTensor.from_row_lengths(flat, lengths)
    weights = tf.RaggedTensor.from_row_lengths(w.astype(np.float32), lengths)
    acts = step(tf.constant(dense), ragged, weights, r_a, r_b)
    outputs.append(
      {
        k: np.concatenate(
          [a[k].numpy() for a in strategy.experimental_local_results(acts)]
        )
        for k in ("a", "b")
      }
    )
  return outputs


def _step(strategy, emb):
  """A training step of ``emb``: its activations per replica."""
  replicas = strategy.num_replicas_in_sync
  per = BATCH // replicas

  @tf.function
  def step(dense, ragged, weights, r_a, r_b):
    def part(value):
      return strategy.experimental_distribute_values_from_function(
        lambda ctx: {
          k: None
          if v is None
          else v[ctx.replica_id_in_sync_group * per :][:per]
          for k, v in value.items()
        }
      )

    emb.enqueue(
      part({"a": dense, "b": ragged}),
      weights=part({"a": None, "b": weights}),
      training=True,
    )

    def replica_fn():
      ctx = tf.distribute.get_replica_context()
      i = ctx.replica_id_in_sync_group
      with tf.GradientTape() as tape:
        acts = emb.dequeue()
        tape.watch(acts)
        loss = tf.reduce_sum(
          0.25 * acts["a"] ** 2 + acts["a"] * r_a[i * per :][:per]
        ) + tf.reduce_sum(
          0.25 * acts["b"] ** 2 + acts["b"] * r_b[i * per :][:per]
        )
      emb.apply_gradients(tape.gradient(loss, acts))
      return acts

    return strategy.run(replica_fn)

  return step


def _oracle_run(
  stream, loss_r, name, hparams, min_count, eviction, pipelined=False
):
  """The steps in numpy; pipelined: each step's update is applied after
  the next step's lookup, without the rows that step gave to new keys
  (reset: the evicted key's update is lost with it), then flushed."""
  vocab = OracleVocabulary(CAPACITY, BUCKET, min_count, eviction)
  held: dict = {}
  dropped = 0
  optimizer = oracle.Optimizer.create(name, **hparams)
  params = np.full((CAPACITY + 1, DIM), INIT)
  params[CAPACITY] = DEFAULT
  slots = optimizer.init_slots(params.shape)
  fresh = optimizer.init_slots((1, DIM))
  outputs = []
  for (dense, lengths, flat, w), (r_a, r_b) in zip(stream, loss_r, strict=True):
    rows, given = vocab.advance(list(dense) + list(flat))
    for r in given:
      params[r] = INIT
      for s in slots:
        slots[s][r] = fresh[s][0]
      dropped += held.pop(r, None) is not None
    rows_a = np.array(rows[:BATCH])
    splits = np.cumsum([0, *lengths])
    rows_b = [
      rows[BATCH + splits[i] : BATCH + splits[i + 1]] for i in range(BATCH)
    ]
    w32 = w.astype(np.float32).astype(np.float64)
    weights_b = [list(w32[splits[i] : splits[i + 1]]) for i in range(BATCH)]
    acts_a = oracle.lookup(params, rows_a, combiner="mean")
    acts_b = oracle.lookup(params, rows_b, weights_b, combiner="mean")
    total: dict = {}
    for ids, weights, acts, r in (
      (rows_a, None, acts_a, r_a),
      (rows_b, weights_b, acts_b, r_b),
    ):
      grads = 0.5 * acts + r.numpy()
      for row, g in oracle.row_gradients(
        ids, grads, weights, combiner="mean"
      ).items():
        total[row] = total.get(row, 0.0) + g
    total.pop(CAPACITY, None)  # The default row never learns.
    if pipelined:
      optimizer.apply(params, slots, held)
      held = total
    else:
      optimizer.apply(params, slots, total)
    outputs.append({"a": acts_a, "b": acts_b})
  optimizer.apply(params, slots, held)  # flush_pipeline
  if pipelined:
    assert dropped, "no held row was given to a new key: a weak stream"
  return outputs, params, slots, vocab


def _assert_trained_as(emb, table, got, want, params, slots):
  """Every step's activations, then the table and its slots, equal the
  oracle's."""
  for step, (g, w) in enumerate(zip(got, want, strict=True)):
    for k in ("a", "b"):
      np.testing.assert_allclose(
        g[k], w[k], rtol=1e-5, atol=1e-5, err_msg=f"step {step} {k}"
      )
  np.testing.assert_allclose(
    emb.embedding_tables[table].numpy(), params, rtol=1e-5, atol=1e-5
  )
  for slot, value in slots.items():
    np.testing.assert_allclose(
      emb.variables["users"][slot].numpy(), value, rtol=1e-5, atol=1e-5
    )


def _state_bytes(replicas: int, sharded: bool, min_count: int) -> int:
  """Bytes of the vocabulary one replica holds at most: keys, last steps
  and counts per row and per probation entry (P = bucket_size entries a
  bucket), step and evictions; shard i of R owns buckets [iB/R, (i+1)B/R)."""
  buckets, probation = CAPACITY // BUCKET, BUCKET if min_count > 1 else 0
  shards = replicas if sharded else 1
  sizes = []
  for i in range(shards):
    first, end = i * buckets // shards, (i + 1) * buckets // shards
    rows = end * CAPACITY // buckets - first * CAPACITY // buckets
    sizes.append(8 * (3 * rows + 3 * (end - first) * probation + 2))
  return max(sizes)


def _cases(cases: str) -> list:
  """``"replicas[s]-min_count-eviction-optimizer"`` strings as parameters
  (``s``: sharded)."""
  params = []
  for case in cases.split():
    layout, min_count, eviction, name = case.split("-")
    params.append(
      pytest.param(
        int(layout.rstrip("s")),
        layout.endswith("s"),
        name,
        int(min_count),
        eviction,
        id=case,
      )
    )
  return params


# Every (optimizer, vocabulary) pair and every (layout, vocabulary) pair
# once; every optimizer on a sharded and on a replicated layout. The
# optimizers' per-row rules on sharded layouts are also checked for every
# optimizer (on 2 or 4 replicas) by tests/backends/test_sharded.py.
TRAINING_CASES = _cases(
  "1-1-lru-sgd 2-1-lru-adagrad 2s-1-lru-adagrad_momentum 4-1-lru-adam "
  "4s-1-lru-ftrl 4s-2-lfu-sgd 2s-2-lfu-adagrad 4-2-lfu-adagrad_momentum "
  "1-2-lfu-adam 2-2-lfu-ftrl 4s-2-lfu-adam"
)


@pytest.mark.parametrize(
  "replicas, sharded, name, min_count, eviction", TRAINING_CASES
)
def test_training_matches_the_oracles(
  replicas, sharded, name, min_count, eviction
):
  strategy = _strategy(replicas)
  make_optimizer, hparams = OPTIMIZERS[name]
  emb, table = _make(
    strategy, make_optimizer(), min_count, eviction, sharded=sharded
  )
  state = emb.engine.dynamic_tables.states["users"]
  assert isinstance(state, ShardedVocabulary) == sharded
  assert emb.sharding_plan is None or (
    emb.sharding_plan.placements["users"].sharded == sharded
  )
  stream, loss_r = _stream(seed=7), _loss_terms(seed=3)
  got = _train(strategy, emb, stream, loss_r)
  want, params, slots, vocab = _oracle_run(
    stream, loss_r, name, hparams, min_count, eviction
  )
  _assert_trained_as(emb, table, got, want, params, slots)
  # Lookups map keys with the state as it is (unknown keys: the default).
  probe = np.array([10**12, 10**12 + 7, -3, 5, -(2**40)])
  with strategy.scope():
    looked_up = emb({"a": tf.constant(probe), "b": tf.constant(probe)})
  outside = emb({"a": tf.constant(probe), "b": tf.constant(probe)})
  np.testing.assert_array_equal(outside["a"], looked_up["a"])  # no scope
  rows = [vocab.find(int(k)) for k in probe]
  np.testing.assert_allclose(
    looked_up["a"].numpy(), params[rows], rtol=1e-5, atol=1e-5
  )
  statistics = emb.engine.dynamic_tables.statistics()["users"]
  assert statistics == {
    "capacity": CAPACITY,
    "rows_in_use": sum(vocab.live(last, vocab.step) for last in vocab.last),
    "evictions": vocab.evictions,
    "step": STEPS,
    "state_bytes": _state_bytes(replicas, sharded, min_count),
  }


# 16-bit dynamic tables: every step equals the float32 table's step (a
# twin given the 16-bit values: the vocabularies, fed the same keys, give
# the same rows) with each row rounded by the independent oracle. INIT and
# DEFAULT, and so the rows given to new keys, are exact in 16 bits.
ROW_STORAGE_CASES = _cases("2s-1-lru-adagrad 2s-2-lfu-ftrl 1-1-lru-sgd")


@pytest.mark.parametrize(
  "replicas, sharded, name, min_count, eviction", ROW_STORAGE_CASES
)
def test_16_bit_tables_train_as_their_float32_twin_rounded(
  replicas, sharded, name, min_count, eviction
):
  # Adagrad: the fused kernel's update; FTRL: the TensorFlow path.
  storage = {
    "adagrad": tpe.RowStorage("bfloat16", seed=2),
    "ftrl": tpe.RowStorage("bfloat16", seed=4),
    "sgd": tpe.RowStorage("float16", rounding="nearest"),
  }[name]
  strategy = _strategy(replicas)
  make_optimizer, _ = OPTIMIZERS[name]
  low, _ = _make(
    strategy,
    make_optimizer(),
    min_count,
    eviction,
    sharded=sharded,
    storage=storage,
  )
  twin, _ = _make(
    strategy, make_optimizer(), min_count, eviction, sharded=sharded
  )
  streams = {"parameters": 0} | {
    slot: i + 1 for i, slot in enumerate(make_optimizer().SLOT_NAMES)
  }
  stream, loss_r = _stream(seed=7), _loss_terms(seed=3)
  low_step, twin_step = _step(strategy, low), _step(strategy, twin)
  for step, data in enumerate(zip(stream, loss_r, strict=True)):
    before = {
      key: tf.convert_to_tensor(v) for key, v in low.variables["users"].items()
    }
    for key, value in before.items():
      twin.variables["users"][key].assign(tf.cast(value, tf.float32))
    got = _train(strategy, low, [data[0]], [data[1]], low_step)
    want = _train(strategy, twin, [data[0]], [data[1]], twin_step)
    for k in ("a", "b"):
      np.testing.assert_array_equal(got[0][k], want[0][k], err_msg=f"{step}")
    for key, variable in low.variables["users"].items():
      stored = storage.dtype if key == "parameters" else storage.slots
      assert variable.dtype == tf.as_dtype(stored), key
      value = np.asarray(tf.cast(tf.convert_to_tensor(variable), tf.float64))
      twin_value = tf.convert_to_tensor(twin.variables["users"][key]).numpy()
      np.testing.assert_array_equal(
        value,
        rounded_table(twin_value, storage, streams[key], step),
        err_msg=f"step {step} {key}",
      )
  assert low.engine.dynamic_tables.statistics()["users"]["evictions"] > 0


def _single_feature(key_dtype=tf.int64, optimizer=None, min_count=2, **kwargs):
  table = _users(key_dtype=key_dtype, min_count=min_count)
  emb = tpe.TPUEmbedding(
    {"u": tpe.FeatureConfig(table)}, optimizer or tpe.Adagrad(0.5), **kwargs
  )
  emb.build()
  return emb, table


def _train_step(emb):
  @tf.function
  def step(keys):
    emb.enqueue({"u": keys}, training=True)
    with tf.GradientTape() as tape:
      acts = emb.dequeue()
      tape.watch(acts)
      loss = tf.reduce_sum(acts["u"] ** 2 + acts["u"])
    emb.apply_gradients(tape.gradient(loss, acts))
    return acts["u"]

  return step


def test_string_keys_train_as_their_fingerprints():
  words = [["ant", "bee", "ant", "cat"], ["bee", "dog", "bee", "eel"]] * 3
  by_string, table_s = _single_feature(tf.string)
  by_int, table_i = _single_feature(tf.int64)
  step_s, step_i = _train_step(by_string), _train_step(by_int)
  for batch in words:
    keys = tf.constant(batch)
    fingerprints = tf.strings.to_hash_bucket_fast(keys, 2**63 - 1)
    np.testing.assert_array_equal(step_s(keys), step_i(fingerprints))
  np.testing.assert_array_equal(
    by_string.embedding_tables[table_s].numpy(),
    by_int.embedding_tables[table_i].numpy(),
  )
  looked_up = by_string({"u": tf.constant(["bee", "zebra"])})["u"].numpy()
  assert not np.allclose(looked_up[0], INIT)  # trained
  np.testing.assert_array_equal(looked_up[1], [0.0] * DIM)  # unknown


@pytest.mark.parametrize(
  "key_dtype, keys, message",
  [
    (tf.string, tf.constant([1, 2]), "dtype int32; table 'users' has a "),
    (tf.int64, tf.constant(["a"]), "dtype string; table 'users' has a "),
    (tf.int64, tf.constant([1.5]), "dtype float32; table 'users' has a "),
  ],
)
def test_wrong_key_dtype_names_feature_and_table(key_dtype, keys, message):
  emb, _ = _single_feature(key_dtype)
  with pytest.raises(ValueError, match=f"Input u has keys of {message}"):
    emb.enqueue({"u": keys}, training=True)


def _snapshot(emb, table):
  state = emb.engine.dynamic_tables.states["users"].copy(0)
  return [emb.embedding_tables[table].numpy()] + [
    v.numpy() for v in state.variables.values()
  ]


def test_a_failed_step_changes_no_row_or_state():
  emb, table = _single_feature(tf.string)
  step = _train_step(emb)
  step(tf.constant(["ant", "bee", "ant"]))
  before = _snapshot(emb, table)
  with pytest.raises(tf.errors.InvalidArgumentError, match="empty string"):
    step(tf.constant(["ant", "", "cat"]))
  for a, b in zip(before, _snapshot(emb, table), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoint_moves_between_replica_counts(tmp_path, sharded):
  """Saved on 2 replicas (the state replicated, or sharded with the
  rows), restored on 1 and on 4 replicas in both layouts."""
  stream, loss_r = _stream(seed=11), _loss_terms(seed=5)
  two = mirrored_strategy(2)
  emb, _ = _make(two, tpe.Adagrad(0.3), 2, "lru", sharded=sharded)
  step = _step(two, emb)
  _train(two, emb, stream[:4], loss_r[:4], step)
  path = tf.train.Checkpoint(embedding=emb).save(str(tmp_path / "ckpt"))
  saved = dict(tf.train.list_variables(path))
  assert saved["embedding/users.Svocabulary/.ATTRIBUTES/keys"] == [CAPACITY]
  expected = _train(two, emb, stream[4:], loss_r[4:], step)
  for strategy, layout in (
    (tf.distribute.get_strategy(), False),
    (mirrored_strategy(4), False),
    (mirrored_strategy(4), True),
  ):
    restored, _ = _make(strategy, tpe.Adagrad(0.3), 2, "lru", sharded=layout)
    tf.train.Checkpoint(embedding=restored).restore(path).assert_consumed()
    got = _train(strategy, restored, stream[4:], loss_r[4:])
    for g, w in zip(got, expected, strict=True):
      for k in ("a", "b"):
        np.testing.assert_allclose(g[k], w[k], rtol=1e-6, atol=1e-6)


# Every layout, both optimizers, both vocabularies, each optimizer with
# each vocabulary, and the sharded layout with both vocabularies.
@pytest.mark.parametrize(
  "replicas, sharded, name, min_count, eviction",
  _cases(
    "1-1-lru-adagrad 2-2-lfu-adam 4-2-lfu-adagrad 4s-1-lru-adam "
    "4s-2-lfu-adagrad"
  ),
)
def test_pipelined_training_matches_the_oracles(
  replicas, sharded, name, min_count, eviction
):
  """One step stale; a row given to a new key loses the held update of
  the key it evicted."""
  strategy = _strategy(replicas)
  make_optimizer, hparams = OPTIMIZERS[name]
  emb, table = _make(
    strategy, make_optimizer(), min_count, eviction, True, sharded
  )
  # A stream where rows held for an update are given to new keys.
  stream, loss_r = _stream(seed=4), _loss_terms(seed=3)
  got = _train(strategy, emb, stream, loss_r)
  tf.function(lambda: strategy.run(emb.flush_pipeline))()
  want, params, slots, _ = _oracle_run(
    stream, loss_r, name, hparams, min_count, eviction, pipelined=True
  )
  unpipelined, *_ = _oracle_run(
    stream, loss_r, name, hparams, min_count, eviction
  )
  assert not np.allclose(want[-1]["a"], unpipelined[-1]["a"])
  _assert_trained_as(emb, table, got, want, params, slots)


def test_unsupported_settings_say_why():
  with pytest.raises(ValueError, match="changes every row"):
    _single_feature(optimizer=tpe.Adam(0.1, lazy_adam=False))
  emb, table = _single_feature()
  with pytest.raises(ValueError, match="mapped by its vocabulary's state"):
    tpe.serving_embedding_lookup(
      {"u": tf.constant([3])},
      None,
      {table: tf.zeros([CAPACITY + 1, DIM])},
      {"u": tpe.FeatureConfig(table)},
    )
  other = tpe.TableConfig(CAPACITY, DIM, name="other")
  with pytest.raises(ValueError, match="never stacked"):
    tpe.TPUEmbedding(
      {"u": tpe.FeatureConfig(table), "o": tpe.FeatureConfig(other)},
      tpe.SGD(0.1),
      table_stacking=[["users", "other"]],
    )


def test_sharding_plan_and_keras_config_keep_the_vocabulary():
  from tpu_embedding.layers.serialization import deserialize_feature_config
  from tpu_embedding.layers.serialization import serialize_feature_config

  emb, table = _single_feature(tf.string)
  config = serialize_feature_config({"u": tpe.FeatureConfig(table)})
  back = deserialize_feature_config(config)["u"].table
  assert back.vocabulary == table.vocabulary
  assert back.vocabulary.key_dtype == tf.string
  # The stored table: the keys' rows and the default row.
  assert emb.embedding_tables[table].shape == [CAPACITY + 1, DIM]


def test_keras_layer_trains_like_the_mid_level_loop():
  from tests.layers import builders
  from tpu_embedding.layers import TPUEmbedding
  from tpu_embedding.layers.keras_compat import keras

  kernel = np.arange(1, DIM + 1, dtype=np.float32)[:, None] / DIM
  keys = {"u": tf.constant([[10**15], [-4], [10**15], [99]], tf.int64)}
  y = tf.constant([[1.0], [0.0], [1.0], [-1.0]])

  def features():
    return {"u": tpe.FeatureConfig(_users())}

  layer = TPUEmbedding(features(), tpe.Adagrad(0.3))
  model = builders.LinearModel(layer, kernel)
  model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
  model.train_on_batch(keys, y)

  reference = tpe.TPUEmbedding(features(), tpe.Adagrad(0.3))
  reference.enqueue(keys, training=True)
  with tf.GradientTape() as tape:
    acts = reference.dequeue()
    tape.watch(acts)
    loss = builders.mse(builders.flat_activations(acts) @ kernel, y)
  reference.apply_gradients(tape.gradient(loss, acts))

  got = builders.full_values(layer.mid_level_api.variables)
  want = builders.full_values(reference.variables)
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, atol=1e-6, err_msg=str(key))
  assert not np.allclose(want[("users", "parameters")][:CAPACITY], INIT)
  restored = TPUEmbedding.from_config(layer.get_config())
  assert restored.get_config() == layer.get_config()


def test_export_serves_raw_keys(tmp_path):
  """A SavedModel of a string-keyed and an int-keyed dynamic table: raw
  keys in (padded ``[B, L]`` too), trained rows for known keys, the
  default row for others; loaded with TensorFlow alone and run with
  ``saved_model_cli``."""
  import json
  import os
  import sys

  from tpu_embedding.export import FeatureSpec
  from tpu_embedding.export import ServingLookup
  from tpu_embedding.export import export_for_serving

  words = tpe.TableConfig(
    CAPACITY,
    DIM,
    name="words",
    combiner="sum",
    vocabulary=tpe.DynamicVocabulary(bucket_size=BUCKET, key_dtype=tf.string),
  )
  items = tpe.TableConfig(
    CAPACITY,
    DIM,
    name="items",
    vocabulary=tpe.DynamicVocabulary(bucket_size=BUCKET, min_count=2),
  )
  config = {"w": tpe.FeatureConfig(words), "i": tpe.FeatureConfig(items)}
  emb = tpe.TPUEmbedding(config, tpe.Adagrad(0.5))

  @tf.function
  def step(w, i):
    emb.enqueue({"w": w, "i": i}, training=True)
    with tf.GradientTape() as tape:
      acts = emb.dequeue()
      tape.watch(acts)
      loss = tf.reduce_sum(acts["w"] ** 2) + tf.reduce_sum(acts["i"])
    emb.apply_gradients(tape.gradient(loss, acts))

  for _ in range(3):
    step(
      tf.ragged.constant([["ant", "bee"], ["cat"], ["ant"]]),
      tf.constant([10**13, -7, 10**13], tf.int64),
    )
  result = export_for_serving(
    str(tmp_path / "model"),
    emb,
    model=None,
    input_signature={
      "w": FeatureSpec([None, None], tf.string),
      "i": FeatureSpec([None], tf.int64),
    },
  )
  w = tf.constant([["ant", "bee"], ["zebra", ""], ["cat", ""]])
  i = tf.constant([10**13, -7, 5], tf.int64)
  want = emb(
    {"w": tf.ragged.constant([["ant", "bee"], ["zebra"], ["cat"]]), "i": i}
  )
  loaded = tf.saved_model.load(result.export_dir)
  served = loaded.signatures["serving_default"](w=w, i=i)
  for k in ("w", "i"):
    np.testing.assert_allclose(served[k].numpy(), want[k].numpy(), atol=1e-6)
  assert not np.allclose(want["i"].numpy()[:2], INIT)  # trained rows
  np.testing.assert_array_equal(want["i"].numpy()[2], [0.0] * DIM)  # unknown
  graph = loaded.signatures["serving_default"].graph
  assert not [op.type for op in graph.get_operations() if "Tpe" in op.type]
  live = ServingLookup(emb)({"i": i})["i"]  # the live state, no copy
  np.testing.assert_allclose(live.numpy(), want["i"].numpy(), atol=1e-6)

  cli = [os.path.join(os.path.dirname(sys.executable), "saved_model_cli")]
  if not os.path.exists(cli[0]):
    cli = [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]
  run = processes.run(
    [
      *cli, "run", "--dir", result.export_dir, "--tag_set", "serve",
      "--signature_def", "serving_default", "--input_exprs",
      f"w={json.dumps(w.numpy().astype(str).tolist())};"
      f"i={json.dumps(i.numpy().tolist())}",
      "--outdir", str(tmp_path / "out"),
    ],
    capture_output=True, text=True, check=True,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
  )  # fmt: skip
  del run
  for k in ("w", "i"):
    np.testing.assert_allclose(
      np.load(tmp_path / "out" / f"{k}.npy"), want[k].numpy(), atol=1e-6
    )


def test_sequence_feature_matches_the_oracles():
  """A sequence feature: ids past max_sequence_length are never looked up,
  so they are neither counted nor given rows."""
  length = 2
  emb = tpe.TPUEmbedding(
    {"s": tpe.FeatureConfig(_users(), max_sequence_length=length)},
    tpe.SGD(0.5),
  )
  vocab = OracleVocabulary(CAPACITY, BUCKET)
  params = np.full((CAPACITY + 1, DIM), INIT)
  params[CAPACITY] = 0.0
  rng = np.random.default_rng(9)
  for _ in range(5):
    lists = [
      list(rng.integers(-5, 20, rng.integers(0, 4))) for _ in range(BATCH)
    ]
    r = rng.normal(size=(BATCH, length, DIM)).astype(np.float32)
    emb.enqueue({"s": tf.ragged.constant(lists, tf.int64)}, training=True)
    with tf.GradientTape() as tape:
      acts = emb.dequeue()
      tape.watch(acts)
      loss = tf.reduce_sum(acts["s"] * r + 0.25 * acts["s"] ** 2)
    emb.apply_gradients(tape.gradient(loss, acts))
    kept = [keys[:length] for keys in lists]
    rows, given = vocab.advance([k for keys in kept for k in keys])
    for row in given:
      params[row] = INIT
    splits = np.cumsum([0, *map(len, kept)])
    row_lists = [rows[splits[i] : splits[i + 1]] for i in range(BATCH)]
    want = oracle.lookup(params, row_lists, max_sequence_length=length)
    np.testing.assert_allclose(acts["s"].numpy(), want, atol=1e-6)
    grads = oracle.row_gradients(
      row_lists, 0.5 * want + r, max_sequence_length=length
    )
    grads.pop(CAPACITY, None)
    for row, g in grads.items():
      params[row] -= 0.5 * g
  (table,) = emb.embedding_tables.values()
  np.testing.assert_allclose(table.numpy(), params, atol=1e-5)


def test_export_with_another_padding_serves_key_minus_one(tmp_path):
  from tpu_embedding.export import FeatureSpec
  from tpu_embedding.export import export_for_serving

  emb, table = _single_feature(tf.int64, min_count=1)
  step = _train_step(emb)
  step(tf.constant([-1, 5, -1], tf.int64))
  pad = -(2**63)
  result = export_for_serving(
    str(tmp_path / "m"),
    emb,
    model=None,
    input_signature={"u": FeatureSpec([None, None], padding=pad)},
  )
  serve = tf.saved_model.load(result.export_dir).signatures["serving_default"]
  got = serve(u=tf.constant([[-1, pad], [5, -1]], tf.int64))["u"].numpy()
  want = emb({"u": tf.ragged.constant([[-1], [5, -1]], tf.int64)})["u"]
  np.testing.assert_allclose(got, want.numpy(), atol=1e-6)
  assert not np.allclose(got[0], INIT)  # key -1 has a trained row
  with pytest.raises(ValueError, match="padding must be an int"):
    FeatureSpec([None, None], padding="")


def export_spec_for_cli():
  """What tools/export.py rebuilds the dynamic table's export from."""
  from tpu_embedding.export import ExportSpec
  from tpu_embedding.export import FeatureSpec

  table = _users(min_count=2, eviction="lru", default_value=DEFAULT)
  return ExportSpec(
    feature_config={
      "a": tpe.FeatureConfig(table),
      "b": tpe.FeatureConfig(table),
    },
    input_signature={"a": FeatureSpec([None], tf.int64)},
    model=None,
  )


def test_serving_and_export_from_a_checkpoint(tmp_path):
  """A checkpoint of a table sharded (rows and vocabulary) over 2
  replicas: TPUEmbeddingForServing restores the whole vocabulary and
  looks raw keys up as the trained object does; tools/export.py exports
  it from the checkpoint alone."""
  from tests.export.test_export import _load_tool

  stream, loss_r = _stream(seed=4), _loss_terms(seed=3)
  two = mirrored_strategy(2)
  emb, _ = _make(two, tpe.Adagrad(0.3), 2, "lru", sharded=True)
  _train(two, emb, stream, loss_r)
  path = tf.train.Checkpoint(embedding=emb).save(str(tmp_path / "ckpt" / "c"))
  probe = tf.constant([10**12, 10**12 + 7, -3, 5, -(2**40), 10**12 + 98])
  with two.scope():
    want = emb({"a": probe, "b": probe})["a"].numpy()
  assert not np.allclose(want[:2], INIT)  # trained rows
  np.testing.assert_array_equal(want[3], [DEFAULT] * DIM)  # never seen

  spec = export_spec_for_cli()
  serving = tpe.TPUEmbeddingForServing(spec.feature_config, None)
  tf.train.Checkpoint(embedding=serving).restore(path).expect_partial()
  np.testing.assert_allclose(serving({"a": probe})["a"], want, atol=1e-6)
  # A live ServingLookup follows further training (its keys map through
  # the shards as they are); an exported copy keeps the state it saw.
  from tpu_embedding.export import ServingLookup

  live, copied = ServingLookup(emb), ServingLookup(emb, copy=True)
  _train(two, emb, _stream(seed=8), _loss_terms(seed=8))
  with two.scope():
    now = emb({"a": probe, "b": probe})["a"].numpy()
  assert not np.allclose(now, want)
  np.testing.assert_allclose(live({"a": probe})["a"], now, atol=1e-6)
  np.testing.assert_allclose(copied({"a": probe})["a"], want, atol=1e-6)
  state = serving.vocabulary_states["users"].whole()
  assert int(state["step"]) == STEPS

  spec_file = tmp_path / "spec.py"
  spec_file.write_text(
    "from tests.vocabularies.test_dynamic_tables import export_spec_for_cli\n\n"
    "def build():\n  return export_spec_for_cli()\n"
  )
  tool_args = [
    "--spec", f"{spec_file}:build",
    "--checkpoint", str(tmp_path / "ckpt"),
    "--export_dir", str(tmp_path / "export"),
  ]  # fmt: skip
  assert _load_tool().main(tool_args) == 0
  loaded = tf.saved_model.load(str(tmp_path / "export"))
  served = loaded.signatures["serving_default"]
  np.testing.assert_allclose(served(a=probe)["a"], want, atol=1e-6)


def _traced_step_ops(tables: int) -> int:
  """Ops of a traced 2-replica training step (row-sharded dynamic tables,
  each its own stack, with a skip flag, as Model Garden's trainer)."""
  strategy = mirrored_strategy(2)
  with strategy.scope():
    configs = [
      tpe.TableConfig(
        64, 4, name=f"t{t}", vocabulary=tpe.DynamicVocabulary(bucket_size=4)
      )
      for t in range(tables)
    ]
    emb = tpe.TPUEmbedding(
      {f"f{t}": tpe.FeatureConfig(configs[t]) for t in range(tables)},
      tpe.Adagrad(0.1),
      row_sharding_threshold=0,
      table_stacking=None,
    )
    emb.build()
  features = {f"f{t}": tf.constant([1, 2, 3], tf.int64) for t in range(tables)}

  @tf.function
  def step(features):
    def replica(features):
      emb.enqueue(features, training=True)
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        loss = tf.add_n([tf.reduce_sum(a) for a in activations.values()])
      gradients = tape.gradient(loss, activations)
      emb.apply_gradients(gradients, skip=tf.constant(False))

    strategy.run(replica, args=(features,))

  return len(step.get_concrete_function(features).graph.get_operations())


def test_a_traced_step_grows_by_a_bounded_number_of_ops_per_table():
  """Tracing (and optimizing) a step costs by its ops: per table and
  replica they once were some 300 (each replica's keys sliced, new rows
  masked per variable, sizes sent for every exchanged list); 175 now."""
  per_table = (_traced_step_ops(6) - _traced_step_ops(2)) / 4
  assert per_table <= 400, per_table
