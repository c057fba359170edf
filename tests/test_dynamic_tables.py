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
from tests.conftest import mirrored_strategy
from tests.vocabulary_oracle import OracleVocabulary

CAPACITY, BUCKET, DIM, BATCH, STEPS = 12, 4, 3, 8, 6
INIT, DEFAULT = 0.25, -0.5
OPTIMIZERS = {
  "sgd": (lambda: tpe.SGD(0.5), {"learning_rate": 0.5}),
  "adagrad": (
    lambda: tpe.Adagrad(0.3, initial_accumulator_value=0.2),
    {"learning_rate": 0.3, "initial_accumulator_value": 0.2},
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


def _make(strategy, optimizer, min_count, eviction):
  table = tpe.TableConfig(
    CAPACITY,
    DIM,
    name="users",
    initializer=tf.constant_initializer(INIT),
    vocabulary=tpe.DynamicVocabulary(
      min_count=min_count,
      eviction=eviction,
      bucket_size=BUCKET,
      default_value=DEFAULT,
    ),
  )
  with strategy.scope():
    emb = tpe.TPUEmbedding(
      {"a": tpe.FeatureConfig(table), "b": tpe.FeatureConfig(table)},
      optimizer,
    )
    emb.build()
  return emb, table


def _train(strategy, emb, stream, loss_r):
  """Runs the steps; returns each step's global activations."""
  replicas = strategy.num_replicas_in_sync
  per = BATCH // replicas

  @tf.function
  def step(dense, ragged, weights, r_a, r_b):
    def part(value):
      return strategy.experimental_distribute_values_from_function(
        lambda ctx: {
          k: None if v is None else v[ctx.replica_id_in_sync_group * per :][:per]
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


def _oracle_run(stream, loss_r, name, hparams, min_count, eviction):
  vocab = OracleVocabulary(CAPACITY, BUCKET, min_count, eviction)
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
    optimizer.apply(params, slots, total)
    outputs.append({"a": acts_a, "b": acts_b})
  return outputs, params, slots, vocab


@pytest.mark.parametrize("replicas", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("min_count, eviction", [(1, "lru"), (2, "lfu")])
def test_training_matches_the_oracles(replicas, name, min_count, eviction):
  strategy = (
    tf.distribute.get_strategy() if replicas == 1 else mirrored_strategy(replicas)
  )
  make_optimizer, hparams = OPTIMIZERS[name]
  emb, table = _make(strategy, make_optimizer(), min_count, eviction)
  stream = _stream(seed=7)
  rng = np.random.default_rng(3)
  loss_r = [
    (
      tf.constant(rng.normal(size=(BATCH, DIM)), tf.float32),
      tf.constant(rng.normal(size=(BATCH, DIM)), tf.float32),
    )
    for _ in range(STEPS)
  ]
  got = _train(strategy, emb, stream, loss_r)
  want, params, slots, vocab = _oracle_run(
    stream, loss_r, name, hparams, min_count, eviction
  )
  for step, (g, w) in enumerate(zip(got, want, strict=True)):
    for k in ("a", "b"):
      np.testing.assert_allclose(
        g[k], w[k], rtol=1e-5, atol=1e-5, err_msg=f"step {step} {k}"
      )
  np.testing.assert_allclose(
    emb.embedding_tables[table].numpy(), params, rtol=1e-5, atol=1e-5
  )
  variables = emb.variables["users"]
  for slot, value in slots.items():
    np.testing.assert_allclose(
      variables[slot].numpy(), value, rtol=1e-5, atol=1e-5
    )
  # Lookups map keys with the state as it is (unknown keys: the default).
  probe = np.array([10**12, 10**12 + 7, -3, 5, -(2**40)])
  with strategy.scope():
    looked_up = emb({"a": tf.constant(probe), "b": tf.constant(probe)})
  rows = [vocab.find(int(k)) for k in probe]
  np.testing.assert_allclose(
    looked_up["a"].numpy(), params[rows], rtol=1e-5, atol=1e-5
  )
