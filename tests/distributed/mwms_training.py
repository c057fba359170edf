"""One worker of a 2-process MultiWorkerMirroredStrategy run on 127.0.0.1.

Launched twice by tests/backends/test_multi_worker.py with ``TF_CONFIG``
set. Each worker holds the shards of its replica; lookups and updates
exchange ids and rows with collectives across the two processes. Every
worker checks its activations and the whole tables (gathered across workers)
against the same steps on one device, and that each traced step touches its
tables by row only (``check_row_only``: one ``row-only step:`` line per
optimizer); the chief also checks that the checkpoint (saved by both workers
together) restores whole into a single-device object. Prints "OK" and exits
0 on success.

In tests/backends/test_multi_worker.py its ``main`` runs as a phase of
``mwms_phases.py`` (several scripts per cluster launch).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# ``tests`` from this checkout, without putting the checkout on sys.path
# (as the root conftest.py does): ``tpu_embedding`` is the installed one.
_tests = importlib.machinery.ModuleSpec("tests", None, is_package=True)
_tests.submodule_search_locations = [str(pathlib.Path(__file__).parents[1])]
sys.modules.setdefault("tests", importlib.util.module_from_spec(_tests))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402
from tests import sparse_access  # noqa: E402
from tpu_embedding import compat  # noqa: E402
from tpu_embedding import kernels  # noqa: E402
from tpu_embedding import memory  # noqa: E402
from tpu_embedding import run_lock  # noqa: E402

V_BIG, V_SMALL, DIM, BATCH, STEPS = 29, 5, 3, 6, 3


OPTIMIZERS = {
  "sgd": lambda: tpe.SGD(0.2),
  "adagrad": lambda: tpe.Adagrad(0.3),
  "adagrad_momentum": lambda: tpe.AdagradMomentum(0.2, momentum=0.8),
  "adam": lambda: tpe.Adam(0.1),
  "ftrl": lambda: tpe.FTRL(0.2, l1_regularization_strength=0.01),
}


def make_embedding(big_init, small_init, optimizer, storage=None):
  """ "big" (row-sharded) and "small" (replicated), stored as ``storage``
  (a ``RowStorage``; None: float32)."""
  storage = storage or tpe.RowStorage()
  big = tpe.TableConfig(
    V_BIG,
    DIM,
    name="big",
    combiner="sum",
    initializer=tf.constant_initializer(big_init),
    storage=storage,
  )
  small = tpe.TableConfig(
    V_SMALL,
    DIM,
    name="small",
    initializer=tf.constant_initializer(small_init),
    storage=storage,
  )
  features = {
    "item": tpe.FeatureConfig(big),
    "country": tpe.FeatureConfig(small),
  }
  return tpe.TPUEmbedding(features, optimizer, row_sharding_threshold=10)


def loss_fn(activations, projection):
  return tf.reduce_sum(activations["item"] * projection) + tf.reduce_sum(
    activations["country"]
  )


def one_device_step(emb, loss_fn, projection):
  """The same step on one device (no strategy): the reference."""

  @tf.function
  def step(features):
    emb.enqueue(features, training=True)
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = loss_fn(activations, projection)
    emb.apply_gradients(tape.gradient(loss, activations))
    return activations

  return step


def training_step(strategy, emb, loss_fn, projection, per):
  """A step on a global batch: replica ``r`` takes examples ``[r * per,
  (r + 1) * per)`` and the loss ``loss_fn(activations, its projection
  rows)``; returns the activations."""

  @tf.function
  def step(features):
    def slice_for(ctx):
      r = ctx.replica_id_in_sync_group
      return tf.nest.map_structure(
        lambda t: t[r * per : (r + 1) * per], features
      )

    emb.enqueue(
      strategy.experimental_distribute_values_from_function(slice_for),
      training=True,
    )

    def replica_fn():
      r = tf.distribute.get_replica_context().replica_id_in_sync_group
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        loss = loss_fn(activations, projection[r * per : (r + 1) * per])
      emb.apply_gradients(tape.gradient(loss, activations))
      return activations

    return strategy.run(replica_fn)

  return step


def check_row_only(name, function, emb, every_table=True):
  """Asserts the traced ``function`` (a step) touches this worker's
  tables, slots and vocabulary arrays by row only (tests/sparse_access.py;
  ``every_table``: and writes each of them); prints the report its test
  checks."""
  accesses = sparse_access.check_row_only(
    sparse_access.concrete_functions(function), emb, every_table
  )
  print(sparse_access.row_only_report(name, accesses), flush=True)


def full_values(emb):
  return {
    (t, s): np.asarray(v.read_value() if hasattr(v, "read_value") else v)
    for t, slots in emb.variables.items()
    for s, v in slots.items()
  }


def train_and_check(
  name, strategy, batches, projection, big_init, small_init, per
):
  """Trains one optimizer sharded and on one device; asserts they agree."""
  single = make_embedding(big_init, small_init, OPTIMIZERS[name]())
  single_step = one_device_step(single, loss_fn, projection)
  want = [single_step(b) for b in batches]

  with strategy.scope():
    emb = make_embedding(big_init, small_init, OPTIMIZERS[name]())

  step = training_step(strategy, emb, loss_fn, projection, per)
  first = strategy.cluster_resolver.task_id * len(
    strategy.extended.worker_devices
  )
  for batch, expected in zip(batches, want, strict=True):
    got = step(batch)
    for key in expected:
      local = strategy.experimental_local_results(got[key])[0]
      np.testing.assert_allclose(
        local, expected[key][first * per : (first + 1) * per], atol=1e-5
      )
  assert emb.sharding_plan.placements["big"].sharded
  check_row_only(f"mwms/{name}", step, emb)
  # Each worker's blocks are on its own CPU: its kernels serve its steps.
  assert emb.engine.step_ops.kernels == (kernels.load() is not None), (
    emb.engine.step_ops,
    compat.host_address_space(),
    [v.device for v in emb.backend.shards("big")],
  )
  assert [s.shape[0] for s in emb.backend.shards("big")] == [
    15 if first == 0 else 14
  ]
  # build()'s memory check counted what this worker holds: its block of
  # "big" and its copy of "small" (tpu_embedding/memory.py).
  counted = memory.tables_here(
    emb.engine.config.tables,
    emb.sharding_plan,
    emb.backend.held_replicas,
    strategy,
  )
  held = {
    name: sum(store.bytes_per_device().values())
    for name, store in emb.table_stores.items()
  }
  assert counted == held, (counted, held)
  reference, gathered = full_values(single), full_values(emb)
  for key, value in reference.items():
    np.testing.assert_allclose(
      gathered[key], value, atol=1e-5, err_msg=f"{name} {key}"
    )
  # embedding_tables convert like TensorFlow's variables on every layout
  # (sharded over workers: a collective, every worker joins).
  for table, variable in emb.embedding_tables.items():
    want_value = reference[table.name, "parameters"]
    np.testing.assert_allclose(
      tf.convert_to_tensor(variable).numpy(), want_value, atol=1e-5
    )
    np.testing.assert_allclose(variable.numpy(), want_value, atol=1e-5)
    (local,) = strategy.experimental_local_results(variable)
    assert tuple(local.shape) == want_value.shape

  return emb, reference


def main(checkpoint_dir: str, strategy=None) -> None:
  strategy = strategy or tf.distribute.MultiWorkerMirroredStrategy()
  task = json.loads(os.environ["TF_CONFIG"])["task"]
  replicas = strategy.num_replicas_in_sync
  per = BATCH // replicas
  rng = np.random.default_rng(3)
  big_init = rng.normal(size=(V_BIG, DIM)).astype(np.float32)
  small_init = rng.normal(size=(V_SMALL, DIM)).astype(np.float32)
  projection = tf.constant(rng.normal(size=(BATCH, DIM)).astype(np.float32))
  hot = rng.integers(0, V_BIG, 3)  # ids repeated across workers
  batches = [
    {
      "item": tf.ragged.constant(
        [list(rng.choice(hot, rng.integers(0, 3))) for _ in range(BATCH)],
        dtype=tf.int64,
        ragged_rank=1,
      ),
      "country": tf.constant(rng.integers(0, V_SMALL, BATCH)),
    }
    for _ in range(STEPS)
  ]

  for name in sorted(OPTIMIZERS):
    emb, reference = train_and_check(
      name, strategy, batches, projection, big_init, small_init, per
    )
  is_chief = task["index"] == 0
  target = checkpoint_dir if is_chief else os.path.join(checkpoint_dir, "w1")
  path = tf.train.Checkpoint(embedding=emb).save(os.path.join(target, "ckpt"))
  if is_chief:
    restored = make_embedding(
      np.zeros_like(big_init), np.zeros_like(small_init), OPTIMIZERS["sgd"]()
    )
    tf.train.Checkpoint(embedding=restored).restore(path)
    for key, value in full_values(restored).items():
      np.testing.assert_allclose(value, reference[key], atol=1e-5, err_msg=key)
    shapes = dict(tf.train.list_variables(path))
    assert shapes["embedding/big/.ATTRIBUTES/VARIABLE_VALUE"] == [V_BIG, DIM]
  check_sliced_checkpoints(
    strategy, emb, reference, big_init, small_init, checkpoint_dir, is_chief
  )
  print("OK")


def check_sliced_checkpoints(
  strategy, emb, reference, big_init, small_init, checkpoint_dir, is_chief
):
  """tpe.checkpoints: every worker the same path, each its own rows."""
  sliced_dir = os.path.join(checkpoint_dir, "sliced")
  if is_chief:  # A part left by a worker killed while saving.
    tf.io.gfile.makedirs(os.path.join(sliced_dir, "ckpt-0_temp"))
  manager = tpe.checkpoints.CheckpointManager(
    tf.train.Checkpoint(embedding=emb), sliced_dir, max_to_keep=1
  )
  path = manager.save()
  manager.save()  # The first is swept by the chief alone.
  path = manager.latest_checkpoint
  assert path.endswith("ckpt-2"), path
  if is_chief:  # Only the last checkpoint, no part or temp left (and the
    # lock the chief's manager holds while it lives: run_lock).
    names = sorted(tf.io.gfile.listdir(sliced_dir))
    assert names[0] == run_lock.LOCK_FILE, names
    names = names[1:]
    assert names[:2] == ["checkpoint", "ckpt-2.data-00000-of-00003"], names
    assert names[2:] == [
      "ckpt-2.data-00001-of-00003",
      "ckpt-2.data-00002-of-00003",
      "ckpt-2.index",
    ], names
  # An ordinary checkpoint: each table whole under its key (one device).
  single = make_embedding(
    np.zeros_like(big_init), np.zeros_like(small_init), OPTIMIZERS["sgd"]()
  )
  tf.train.Checkpoint(embedding=single).restore(path)
  for key, value in full_values(single).items():
    np.testing.assert_allclose(value, reference[key], atol=1e-5, err_msg=key)
  if is_chief:  # TensorFlow's own serving class reads it too.
    tf_emb = tf.tpu.experimental.embedding
    serving = tf_emb.TPUEmbeddingForServing(
      {
        "item": tf_emb.FeatureConfig(
          tf_emb.TableConfig(V_BIG, DIM, name="big", combiner="sum")
        ),
        "country": tf_emb.FeatureConfig(
          tf_emb.TableConfig(V_SMALL, DIM, name="small")
        ),
      },
      tf_emb.SGD(0.1),
    )
    tf.train.Checkpoint(embedding=serving).restore(path).expect_partial()
    serving.build()
    for table, variable in serving.embedding_tables.items():
      np.testing.assert_allclose(
        variable.numpy(), reference[table.name, "parameters"], atol=1e-5
      )
  # Restored by both workers, before and after the tables exist.
  for build_first in (False, True):
    with strategy.scope():
      fresh = make_embedding(
        np.zeros_like(big_init),
        np.zeros_like(small_init),
        OPTIMIZERS["sgd"](),
      )
    if build_first:
      fresh.build()
    status = tpe.checkpoints.restore(tf.train.Checkpoint(embedding=fresh), path)
    if build_first:
      status.assert_existing_objects_matched()
    if not build_first:
      fresh.build()
    for key, value in full_values(fresh).items():
      np.testing.assert_allclose(
        value, reference[key], atol=1e-5, err_msg=f"{key} {build_first}"
      )


if __name__ == "__main__":
  main(sys.argv[1])
