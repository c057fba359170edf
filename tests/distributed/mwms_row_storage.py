"""16-bit tables (``RowStorage``) on 2 MultiWorkerMirroredStrategy workers.

A phase of ``mwms_phases.py`` (``row_storage``). Tables stored as
bfloat16 (Adagrad, bfloat16 slots) and float16 (SGD): "big" row-sharded
over both workers' replicas, "small" a copy per replica. Each step must be
the float32 step (a float32 twin on the same cluster, given the 16-bit
values) with every row rounded by ``tests/low_precision_oracle.py`` at its
global id and the step's update count: each worker's blocks number their
rows globally and count their updates as one device does. Then both
workers write a checkpoint (``tpe.checkpoints.write``: each its own
rows), which the chief restores on one device: the stored values and
types; and both workers restore it into new tables and take one more
step, bit for bit as the tables that went on (the update count, the
draws' step, is saved). Prints "OK".
"""

from __future__ import annotations

import os

import mwms_training  # (this directory; it makes ``tests``)
import numpy as np
import tensorflow as tf
from mwms_training import BATCH
from mwms_training import DIM
from mwms_training import V_BIG
from mwms_training import V_SMALL
from mwms_training import loss_fn
from mwms_training import training_step

import tpu_embedding as tpe
from tests.low_precision_oracle import rounded_table

STORAGES = {
  "adagrad": (tpe.Adagrad(0.3), tpe.RowStorage("bfloat16", "bfloat16", seed=4)),
  "sgd": (tpe.SGD(0.2), tpe.RowStorage("float16", seed=9)),
}
STEPS = 3


def make_embedding(inits, optimizer, storage):
  return mwms_training.make_embedding(
    inits["big"], inits["small"], optimizer, storage
  )


def values(emb):
  """Every variable's whole value as float64 (a collective)."""
  return {
    (table, key): np.asarray(
      tf.cast(tf.convert_to_tensor(variable), tf.float64)
    )
    for table, keys in emb.variables.items()
    for key, variable in keys.items()
  }


def train_and_check(name, strategy, inits, batches, projection, per):
  optimizer, storage = STORAGES[name]
  with strategy.scope():
    low = make_embedding(inits, optimizer, storage)
    twin = make_embedding(inits, optimizer, tpe.RowStorage())
  low_step = training_step(strategy, low, loss_fn, projection, per)
  twin_step = training_step(strategy, twin, loss_fn, projection, per)
  low.build()
  twin.build()
  assert low.sharding_plan.placements["big"].sharded
  streams = {"parameters": 0} | {
    slot: i + 1 for i, slot in enumerate(optimizer.SLOT_NAMES)
  }
  for step, batch in enumerate(batches):
    before = values(low)
    for (table, key), value in before.items():
      twin.variables[table][key].assign(value.astype(np.float32))
    twin_step(batch)
    low_step(batch)
    after32, got = values(twin), values(low)
    for (table, key), value in after32.items():
      want = rounded_table(value, storage, streams[key], step)
      np.testing.assert_array_equal(
        got[table, key], want, err_msg=f"{name} step {step} {table}/{key}"
      )
    assert np.any(got["big", "parameters"] != before["big", "parameters"])
  return low


def main(directory: str, strategy=None) -> None:
  strategy = strategy or tf.distribute.MultiWorkerMirroredStrategy()
  per = BATCH // strategy.num_replicas_in_sync
  rng = np.random.default_rng(5)
  inits = {
    "big": rng.normal(size=(V_BIG, DIM)).astype(np.float32),
    "small": rng.normal(size=(V_SMALL, DIM)).astype(np.float32),
  }
  projection = tf.constant(rng.normal(size=(BATCH, DIM)).astype(np.float32))
  batches = [
    {
      "item": tf.ragged.constant(
        [
          list(rng.integers(0, V_BIG, rng.integers(0, 3))) for _ in range(BATCH)
        ],
        dtype=tf.int64,
        ragged_rank=1,
      ),
      "country": tf.constant(rng.integers(0, V_SMALL, BATCH)),
    }
    for _ in range(STEPS)
  ]
  for name in sorted(STORAGES):
    low = train_and_check(name, strategy, inits, batches, projection, per)
    want = values(low)
    path = tpe.checkpoints.write(
      tf.train.Checkpoint(embedding=low), os.path.join(directory, name)
    )
    optimizer, storage = STORAGES[name]
    with strategy.scope():
      resumed = make_embedding(inits, optimizer, storage)
    resumed.build()
    tpe.checkpoints.restore(tf.train.Checkpoint(embedding=resumed), path)
    for emb in (low, resumed):
      training_step(strategy, emb, loss_fn, projection, per)(batches[0])
    went_on = values(low)
    for key, value in values(resumed).items():
      np.testing.assert_array_equal(value, went_on[key], err_msg=f"{key}")
    if strategy.cluster_resolver.task_id == 0:
      one = make_embedding(inits, optimizer, storage)
      tf.train.Checkpoint(embedding=one).restore(path).expect_partial()
      one.build()
      types = {key: storage.slot_dtype for key in optimizer.SLOT_NAMES}
      types["parameters"] = storage.parameter_dtype
      for table, keys in one.variables.items():
        for key, variable in keys.items():
          assert variable.dtype == types[key], (table, key, variable.dtype)
      for key, value in values(one).items():
        np.testing.assert_array_equal(value, want[key], err_msg=f"{key}")
  print("OK", flush=True)
