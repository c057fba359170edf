"""Trains on an in-process parameter-server cluster; checks against one device.

Run as a script (by tests/backends/test_parameter_server.py) because
connecting to a cluster changes the whole process's TensorFlow context.
Starts 2 workers and 2 parameter servers as in-process gRPC servers on
127.0.0.1, trains with a ``ClusterCoordinator`` one step at a time, and
compares tables, slots and a checkpoint with the same steps on one device;
then schedules steps on both workers at once (asynchronous training) and
checks every update lands. Every scheduled step's graph touches the tables
by row only (a ``row-only step:`` line per training run). 16-bit tables
(``RowStorage``) on the PS tasks, one step at a time, equal one device's
bit for bit, and their checkpoint resumes on one device as the run that
went on. Prints "OK" and exits 0 on success.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import pathlib
import socket
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
from tpu_embedding.kernels.ops import TENSORFLOW_OPS  # noqa: E402

V_BIG, V_SMALL, DIM, BATCH, STEPS = 37, 5, 3, 6, 4
FLOAT32 = tpe.RowStorage()
#: 16-bit tables: bfloat16 parameters and Adagrad accumulators.
BFLOAT16 = tpe.RowStorage("bfloat16", slots="bfloat16", seed=6)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_cluster(num_workers: int, num_ps: int) -> tf.train.ClusterSpec:
  spec = tf.train.ClusterSpec(
    {
      "worker": [f"127.0.0.1:{free_port()}" for _ in range(num_workers)],
      "ps": [f"127.0.0.1:{free_port()}" for _ in range(num_ps)],
    }
  )
  # In-process workers need num_workers + 1 inter-op threads, or steps
  # scheduled on several workers at once hang (TensorFlow b/172296720).
  worker_config = tf.compat.v1.ConfigProto(
    inter_op_parallelism_threads=num_workers + 1
  )
  for job, count in (("worker", num_workers), ("ps", num_ps)):
    for index in range(count):
      tf.distribute.Server(
        spec,
        job_name=job,
        task_index=index,
        protocol="grpc",
        config=worker_config if job == "worker" else None,
        start=True,
      )
  return spec


def in_process_cluster(
  num_workers: int, num_ps: int
) -> tuple[
  tf.distribute.experimental.ParameterServerStrategy,
  tf.distribute.experimental.coordinator.ClusterCoordinator,
]:
  """A ``ParameterServerStrategy`` over ``start_cluster``'s servers, and
  its coordinator."""
  spec = start_cluster(num_workers, num_ps)
  strategy = tf.distribute.experimental.ParameterServerStrategy(
    tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
  )
  coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(
    strategy
  )
  return strategy, coordinator


def make_embedding(optimizer, big_init, small_init, storage=FLOAT32):
  big = tpe.TableConfig(
    V_BIG,
    DIM,
    name="big",
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


def train_fn(emb, projection):
  def step(item, country):
    emb.enqueue({"item": item, "country": country})
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = tf.reduce_sum(activations["item"] * projection) + tf.reduce_sum(
        activations["country"]
      )
    emb.apply_gradients(tape.gradient(loss, activations))

  return step


def values(emb):
  return {
    (t, s): np.asarray(tf.convert_to_tensor(v))
    for t, slots in emb.variables.items()
    for s, v in slots.items()
  }


def disjoint_batches(rng):
  """``(batches, projection)`` where no two batches share a row.

  Steps run on both workers at once update without locks, as asynchronous
  parameter-server training does: steps touching the same rows at the same
  time may overwrite each other's update. Batches that each own their rows
  (the small table gets one id per step) must give the single-device
  result in any order.
  """
  steps = V_SMALL
  big_rows = rng.permutation(V_BIG)[: steps * 4].reshape(steps, 4)
  batches = [
    (tf.constant(rows), tf.constant([step] * 4))
    for step, rows in enumerate(big_rows)
  ]
  return batches, tf.constant(rng.normal(size=(4, DIM)).astype(np.float32))


def one_device(big_init, small_init, projection, batches, storage=FLOAT32):
  single = make_embedding(tpe.Adagrad(0.2), big_init, small_init, storage)
  single_step = tf.function(train_fn(single, projection))
  for item, country in batches:
    single_step(item, country)
  return values(single)


def on_cluster(
  strategy,
  coordinator,
  big_init,
  small_init,
  projection,
  batches,
  *,
  wait,
  storage=FLOAT32,
):
  """Trains on the workers; ``wait``: one step at a time, else all at once."""
  with strategy.scope():
    emb = make_embedding(tpe.Adagrad(0.2), big_init, small_init, storage)
    emb.build()
  replica_step = train_fn(emb, projection)

  @tf.function
  def worker_step(item, country):
    strategy.run(replica_step, args=(item, country))

  for item, country in batches:
    coordinator.schedule(worker_step, args=(item, country))
    if wait:
      coordinator.join()
  coordinator.join()
  # The step the coordinator sent the workers (the graph it traced) reads
  # and updates the blocks on the PS tasks by row only, inside their locks.
  accesses = sparse_access.check_row_only(
    sparse_access.concrete_functions(worker_step), emb
  )
  print(sparse_access.row_only_report("ps", accesses), flush=True)
  return emb


def assert_values(emb, want):
  got = values(emb)
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, atol=1e-5, err_msg=str(key))


def check_no_update_is_lost(strategy, coordinator, big_init, small_init, rng):
  """Steps on both workers at once, all on the same hot rows.

  With a linear loss every step's row gradients are fixed by its ids, so
  the Adagrad accumulators' final value (initial + sum of squared
  gradients) does not depend on the order of the steps: concurrent steps
  must give exactly the sequential value (the gradients are multiples of
  0.5, so every sum is exact in float32). A read-modify-write that lost a
  concurrent update would fall short.
  """
  hot = tf.constant(rng.permutation(V_BIG)[:3])
  batches = [
    (tf.gather(hot, rng.integers(0, 3, 4)), tf.constant([0, 1, 0, 1]))
    for _ in range(40)
  ]
  projection = tf.fill([4, DIM], 0.5)
  want = one_device(big_init, small_init, projection, batches)
  got = values(
    on_cluster(
      strategy,
      coordinator,
      big_init,
      small_init,
      projection,
      batches,
      wait=False,
    )
  )
  for table in ("big", "small"):
    key = (table, "accumulators")
    np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))


def main(checkpoint_dir: str) -> None:
  rng = np.random.default_rng(7)
  big_init = rng.normal(size=(V_BIG, DIM)).astype(np.float32)
  small_init = rng.normal(size=(V_SMALL, DIM)).astype(np.float32)
  projection = tf.constant(rng.normal(size=(BATCH, DIM)).astype(np.float32))
  batches = [
    (
      tf.constant(rng.integers(0, V_BIG, BATCH)),
      tf.constant(rng.integers(0, V_SMALL, BATCH)),
    )
    for _ in range(STEPS)
  ]
  disjoint, disjoint_projection = disjoint_batches(rng)
  # Read now: connecting to the cluster renames this process's job.
  want = one_device(big_init, small_init, projection, batches)
  want_disjoint = one_device(
    big_init, small_init, disjoint_projection, disjoint
  )
  want_16 = one_device(big_init, small_init, projection, batches, BFLOAT16)
  want_16_went_on = one_device(
    big_init, small_init, projection, batches * 2, BFLOAT16
  )

  strategy, coordinator = in_process_cluster(num_workers=2, num_ps=2)
  # Pipelining is refused: workers update asynchronously already.
  with strategy.scope():
    table = tpe.TableConfig(V_BIG, DIM, name="big")
    try:
      tpe.TPUEmbedding(
        tpe.FeatureConfig(table),
        tpe.SGD(0.1),
        pipeline_execution_with_tensor_core=True,
      )
    except ValueError as e:
      assert "not available under ParameterServerStrategy" in str(e), e
    else:
      raise AssertionError("pipelining was accepted under PS")
  # One step at a time: the single-device sequence.
  emb = on_cluster(
    strategy, coordinator, big_init, small_init, projection, batches, wait=True
  )
  devices = [v.device for v in emb.backend.shards("big")]
  assert {d.split("/")[1] for d in devices} == {"job:ps"}, devices
  # Tables on the PS tasks: TensorFlow's ops (plain TensorFlow servers).
  assert emb.engine.step_ops is TENSORFLOW_OPS, emb.engine.step_ops
  assert [v.shape[0] for v in emb.backend.shards("big")] == [19, 18]
  assert_values(emb, want)
  for variable in emb.embedding_tables.values():  # any layout converts
    whole = tf.convert_to_tensor(variable).numpy()
    np.testing.assert_array_equal(np.asarray(variable.numpy()), whole)
    (local,) = strategy.experimental_local_results(variable)
    assert tuple(local.shape) == whole.shape
  # All steps scheduled at once, running on both workers concurrently.
  concurrent = on_cluster(
    strategy,
    coordinator,
    big_init,
    small_init,
    disjoint_projection,
    disjoint,
    wait=False,
  )
  assert_values(concurrent, want_disjoint)
  check_no_update_is_lost(strategy, coordinator, big_init, small_init, rng)

  path = tf.train.Checkpoint(embedding=emb).save(
    os.path.join(checkpoint_dir, "ps")
  )
  restored = make_embedding(
    tpe.Adagrad(0.2), np.zeros_like(big_init), np.zeros_like(small_init)
  )
  tf.train.Checkpoint(embedding=restored).restore(path)
  for key, value in values(restored).items():
    np.testing.assert_allclose(value, want[key], atol=1e-5, err_msg=str(key))
  check_row_storage(
    strategy,
    coordinator,
    (big_init, small_init, projection, batches),
    want_16,
    want_16_went_on,
    checkpoint_dir,
  )
  print("OK")


def check_row_storage(
  strategy, coordinator, data, want, want_went_on, checkpoint_dir
):
  """16-bit tables on the PS tasks, one step at a time: the blocks there
  round each update with the same draws as one device (rows by global
  id, the count of updates), bit for bit; a checkpoint holds the stored
  type and the update count, and resumes on one device as the run that
  went on."""
  big_init, small_init, projection, batches = data
  emb = on_cluster(
    strategy,
    coordinator,
    big_init,
    small_init,
    projection,
    batches,
    wait=True,
    storage=BFLOAT16,
  )
  assert emb.variables["big"]["parameters"].dtype == tf.bfloat16
  got = values(emb)
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=f"16-bit {key}")
  path = tf.train.Checkpoint(embedding=emb).save(
    os.path.join(checkpoint_dir, "ps16")
  )
  resumed = make_embedding(
    tpe.Adagrad(0.2),
    np.zeros_like(big_init),
    np.zeros_like(small_init),
    BFLOAT16,
  )
  tf.train.Checkpoint(embedding=resumed).restore(path)
  resumed_step = tf.function(train_fn(resumed, projection))
  for item, country in batches:
    resumed_step(item, country)
  got = values(resumed)
  for key, value in want_went_on.items():
    np.testing.assert_array_equal(got[key], value, err_msg=f"resumed {key}")


if __name__ == "__main__":
  main(sys.argv[1])
