"""The replicas of sharded tables exchange only what each one needs.

In one process the exchange is an all-to-all (``backends/exchanges.py``):
each owner receives only ids of its own rows, each id reaches exactly one
owner, no collective op is in the step, and because every occurrence's
gradient reaches its owner (read in place, in the global batch's order),
training equals one device bit for bit when each table has one feature.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy
from tpu_embedding import kernels
from tpu_embedding.backends.exchanges import AllToAll
from tpu_embedding.backends.exchanges import ExchangeRequest
from tpu_embedding.gradients import concat_pieces
from tpu_embedding.kernels.ops import TENSORFLOW_OPS

ROWS, DIM, BATCH, TABLES = 1_000, 4, 64, 3


def make_embedding(
  strategy, optimizer, init, table_stacking="auto", combiner="mean"
):
  with strategy.scope():
    tables = [
      tpe.TableConfig(
        ROWS,
        DIM,
        name=f"t{t}",
        initializer=tf.constant_initializer(init[t]),
        combiner=combiner,
      )
      for t in range(TABLES)
    ]
    embedding = tpe.TPUEmbedding(
      {f"f{t}": tpe.FeatureConfig(tables[t]) for t in range(TABLES)},
      optimizer,
      row_sharding_threshold=0,
      table_stacking=table_stacking,
    )
    embedding.build()
  return embedding


def skewed_ids(rng, size):
  """Skewed ids: duplicates within and across replicas."""
  return (rng.zipf(1.3, size) * 37 % ROWS).astype(np.int64)


def make_batches(rng, steps=3, kind="one_id"):
  """``[(features, weights)]``: one id per example (no weights), or 1-3
  weighted ids per example (each id's gradient is its output row's times
  its combiner scale)."""
  batches = []
  for _ in range(steps):
    if kind == "one_id":
      features = {
        f"f{t}": tf.constant(skewed_ids(rng, BATCH)) for t in range(TABLES)
      }
      batches.append((features, None))
      continue
    lengths = [rng.integers(1, 4, BATCH) for _ in range(TABLES)]
    features = {
      f"f{t}": tf.RaggedTensor.from_row_lengths(
        skewed_ids(rng, lengths[t].sum()), lengths[t]
      )
      for t in range(TABLES)
    }
    weights = {
      f"f{t}": tf.RaggedTensor.from_row_lengths(
        rng.uniform(0.2, 2.0, lengths[t].sum()).astype(np.float32),
        lengths[t],
      )
      for t in range(TABLES)
    }
    batches.append((features, weights))
  return batches


def train(embedding, strategy, batches, weights):
  replicas = strategy.num_replicas_in_sync
  per = BATCH // replicas

  def loss_fn(activations, w):
    # Gradients that depend on the activations.
    return sum(tf.reduce_sum(a * w + 0.5 * a * a) for a in activations.values())

  def per_replica(values):
    if values is None:
      return None
    return strategy.experimental_distribute_values_from_function(
      lambda ctx: {
        k: v[ctx.replica_id_in_sync_group * per :][:per]
        for k, v in values.items()
      }
    )

  @tf.function
  def step(features, id_weights):
    embedding.enqueue(
      per_replica(features), per_replica(id_weights), training=True
    )

    def replica_fn():
      replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      with tf.GradientTape() as tape:
        activations = embedding.dequeue()
        tape.watch(activations)
        loss = loss_fn(activations, weights[replica * per :][:per])
      embedding.apply_gradients(tape.gradient(loss, activations))
      return loss

    return strategy.run(replica_fn)

  for features, id_weights in batches:
    step(features, id_weights)
  return step


def full_values(embedding):
  return {
    (table, slot): np.asarray(tf.convert_to_tensor(variable))
    for table, slots in embedding.variables.items()
    for slot, variable in slots.items()
  }


_OPTIMIZERS = {"sgd": lambda: tpe.SGD(0.3), "adagrad": lambda: tpe.Adagrad(0.2)}
_STACKING = {"stacked": "auto", "alone": None}


def _exchange_cases(cases: str) -> list:
  """``"optimizer-replicas-stacking-kind"`` strings as parameters."""
  params = []
  for case in cases.split():
    optimizer, replicas, stacking, kind = case.split("-")
    params.append(
      pytest.param(
        _OPTIMIZERS[optimizer], int(replicas), _STACKING[stacking], kind,
        id=case,
      )
    )  # fmt: skip
  return params


# Every pair of (optimizer, replicas, stacking, kind) values at least once
# (a covering array of the 16 combinations), plus the widest exchange: 4
# replicas, stacked, weighted ids.
@pytest.mark.parametrize(
  "optimizer, replicas, stacking, kind",
  _exchange_cases(
    "sgd-2-stacked-one_id sgd-4-alone-weighted_ids "
    "adagrad-2-alone-weighted_ids adagrad-4-stacked-weighted_ids "
    "adagrad-4-alone-one_id sgd-4-stacked-weighted_ids"
  ),
)
def test_sharded_training_equals_one_device_bit_for_bit(
  optimizer, replicas, stacking, kind, rng
):
  init = rng.normal(size=(TABLES, ROWS, DIM)).astype(np.float32)
  weights = tf.constant(rng.normal(size=(BATCH, DIM)).astype(np.float32))
  batches = make_batches(rng, kind=kind)
  one = make_embedding(tf.distribute.get_strategy(), optimizer(), init)
  train(one, tf.distribute.get_strategy(), batches, weights)
  strategy = mirrored_strategy(replicas)
  sharded = make_embedding(strategy, optimizer(), init, stacking)
  assert isinstance(sharded.backend.exchange, AllToAll)
  # "auto" stacks the tables of several replicas (one store), None not.
  assert len(sharded.backend.stores) == (1 if stacking else TABLES)
  train(sharded, strategy, batches, weights)
  want, got = full_values(one), full_values(sharded)
  assert want.keys() == got.keys()
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=str(key))


def test_the_step_has_no_collective_op(rng):
  strategy = mirrored_strategy(2)
  init = rng.normal(size=(TABLES, ROWS, DIM)).astype(np.float32)
  embedding = make_embedding(strategy, tpe.Adagrad(0.1), init)
  batches = make_batches(rng, steps=1)
  weights = tf.constant(rng.normal(size=(BATCH, DIM)).astype(np.float32))
  step = train(embedding, strategy, batches, weights)
  graph = step.get_concrete_function(*batches[0]).graph
  types = {op.type for op in graph.get_operations()}
  for function in graph._functions.values():
    types |= {node.op for node in function.definition.node_def}
  assert not {t for t in types if "Collective" in t or "Nccl" in t}, types
  # Ids are split by owner (the kernel, or TensorFlow's partition).
  assert {"TpeSplitByOwner", "DynamicPartition"} & types
  if kernels.load() is not None:
    # Owners' replies expand straight into the occurrences; gradients are
    # read in place by the owners' fused update.
    assert {"TpeSplitByOwner", "TpeGatherPieces", "TpeFusedSparseApply"} <= (
      types
    )
    # Two replicas, each running its ops: on 2 cores or fewer, kernels do
    # not also spread their rows over the threads.
    spread = {
      op.get_attr("spread")
      for op in graph.get_operations()
      if op.type == "TpeFusedSparseApply"
    }
    assert spread == {2 < len(os.sched_getaffinity(0))}


class RecordingAllToAll(AllToAll):
  """The real exchange, also keeping what each replica received."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.received = {}

  def _route(self, lists):
    received = super()._route(lists)
    context = tf.distribute.get_replica_context()
    here = int(tf.get_static_value(context.replica_id_in_sync_group))
    self.received.setdefault(here, []).append(received)
    return received


def _occurrences(num_ids):
  """An index into ``num_ids`` distinct ids: reversed, then repeats."""
  return np.concatenate([np.arange(num_ids)[::-1], [0, num_ids - 1, 0]])


@pytest.mark.parametrize("replicas", [2, 4])
def test_each_owner_receives_only_its_own_ids(replicas, rng):
  strategy = mirrored_strategy(replicas)
  init = rng.normal(size=(TABLES, ROWS, DIM)).astype(np.float32)
  embedding = make_embedding(strategy, tpe.SGD(0.1), init, None)
  backend = embedding.backend
  recorder = RecordingAllToAll(0, replicas)
  backend._exchange = recorder
  placement = backend.plan.placements["t0"]
  store = backend.stores["t0"]
  ids_per_replica = [
    rng.choice(ROWS, size=20 + 5 * r, replace=False).astype(np.int64)
    for r in range(replicas)
  ]

  def replica_fn():
    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    ids = tf.gather(
      tf.ragged.constant(ids_per_replica, dtype=tf.int64), replica
    )
    here = int(tf.get_static_value(replica))
    index = _occurrences(len(ids_per_replica[here]))
    (rows,) = recorder.gather(
      here, [ExchangeRequest(store, ids, index)], TENSORFLOW_OPS
    )
    # The rows of ids from several owners come back as each occurrence's
    # row, in their order (picked out of the owners' replies).
    return concat_pieces(rows)

  result = strategy.run(replica_fn)
  for r, rows in enumerate(strategy.experimental_local_results(result)):
    want = init[0][ids_per_replica[r][_occurrences(len(ids_per_replica[r]))]]
    np.testing.assert_array_equal(rows.numpy(), want)
  sent = np.concatenate(ids_per_replica)
  got = []
  for owner in range(replicas):
    lo = placement.shard_offsets[owner]
    hi = lo + placement.shard_sizes[owner]
    ids_in = recorder.received[owner][0][0]  # the ids, one list per source
    assert len(ids_in) == replicas
    for source, part in enumerate(ids_in):
      part = part.numpy() + lo  # Sent as rows of the owner's block.
      assert ((part >= lo) & (part < hi)).all(), (owner, source, part)
      np.testing.assert_array_equal(
        part,
        [i for i in ids_per_replica[source] if lo <= i < hi],
      )
      got.append(part)
  # Every id went to exactly one owner: nothing all-gathered.
  assert sorted(np.concatenate(got).tolist()) == sorted(sent.tolist())
