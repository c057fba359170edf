"""A parameter-server job whose worker process is killed mid-training.

``python ps_worker_kill.py`` starts 1 parameter server and 2 workers as
real processes (``tpe.servers.serve`` on 127.0.0.1, ``server`` mode of
this script) and coordinates from this process: 40 steps are scheduled
with ``ClusterCoordinator.schedule``, each with its step id
(``apply_gradients(step_id=...)``). A test-only hook holds each worker's
first step after its update has landed on the parameter server (the step
waits for a token of a queue on the PS); worker 1 is then killed
(SIGKILL), so its step, already applied, is certainly re-run by the
coordinator on worker 0. Every update must land exactly once: each step
adds its squared gradients to the Adagrad accumulators (a linear loss,
gradients of 0.5, sums exact in float32), so they equal the 40 steps'
sums, although 41 steps ran (without the step ids the re-run counts
twice). Prints "OK" on success.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

ROWS, DIM, STEPS, BATCH = 30, 4, 40, 8


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def serve(spec: str, job: str, index: int) -> None:
  from tpu_embedding import servers  # noqa: PLC0415

  servers.serve(
    tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(json.loads(spec)), task_type=job, task_id=index
    )
  )


def main() -> None:
  import tpu_embedding as tpe  # noqa: PLC0415

  spec = {
    "worker": [f"127.0.0.1:{free_port()}" for _ in range(2)],
    "ps": [f"127.0.0.1:{free_port()}"],
    "chief": [f"127.0.0.1:{free_port()}"],
  }
  servers = {
    (job, i): subprocess.Popen(
      [sys.executable, __file__, "server", json.dumps(spec), job, str(i)]
    )
    for job, count in (("worker", 2), ("ps", 1))
    for i in range(count)
  }
  try:
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc"
    )
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(
      strategy
    )
    with strategy.scope():
      table = tpe.TableConfig(
        ROWS, DIM, name="t", initializer=tf.zeros_initializer()
      )
      emb = tpe.TPUEmbedding(tpe.FeatureConfig(table), tpe.Adagrad(0.1))
      emb.build()
      landed = tf.Variable(0, dtype=tf.int64)  # steps past their update
    with tf.device("/job:ps/replica:0/task:0/device:CPU:0"):
      tokens = tf.queue.FIFOQueue(4 * STEPS, tf.int32, shapes=[])
    accumulators = emb.variables["t"]["accumulators"]
    ids = tf.constant(np.arange(BATCH) % 3, tf.int64)  # hot rows 0, 1, 2

    def replica_step(step_id):
      emb.enqueue(ids)
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        loss = 0.5 * tf.reduce_sum(activations)
      emb.apply_gradients(tape.gradient(loss, activations), step_id=step_id)
      # Test-only hook: read after the update (automatic control
      # dependencies order it after the write), the step counts itself
      # landed, then waits for a token: the first step of each worker holds
      # until worker 1 is killed.
      with tf.control_dependencies([tf.convert_to_tensor(accumulators)]):
        count = landed.assign_add(1)
      with tf.control_dependencies([count]):
        tokens.dequeue()

    @tf.function
    def step(step_id):
      strategy.run(replica_step, args=(step_id,))

    for n in range(STEPS):
      coordinator.schedule(step, args=(tf.constant(n, tf.int64),))
    deadline = time.monotonic() + 120
    while int(landed.numpy()) < 2:  # both workers hold an applied step
      assert time.monotonic() < deadline, "the workers' steps did not land"
      time.sleep(0.05)
    servers["worker", 1].send_signal(signal.SIGKILL)
    print("killed worker 1", flush=True)
    tokens.enqueue_many(tf.zeros([4 * STEPS], tf.int32))
    coordinator.join()
    got = tf.convert_to_tensor(accumulators).numpy()
    done = int(landed.numpy())
    # Per step, row r gets the gradient 0.5 * (ids == r).sum(): 0.5 * 3 for
    # rows 0 and 1, 0.5 * 2 for row 2, squared and added STEPS times.
    want = np.full([ROWS, DIM], 0.1, np.float32)
    for _ in range(STEPS):
      want[:3] += np.float32([[1.5**2], [1.5**2], [1.0**2]])
    # Worker 1's held step ran again on worker 0: once more than scheduled.
    assert done == STEPS + 1, done
    np.testing.assert_array_equal(got, want, err_msg=f"{done} steps ran")
    print(f"{done} steps ran for {STEPS} scheduled")
    print("OK", flush=True)
  finally:
    for process in servers.values():
      process.kill()
  # The coordinator keeps waiting for the killed worker to come back.
  os._exit(0)


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "server":
    serve(sys.argv[2], sys.argv[3], int(sys.argv[4]))
  else:
    try:
      main()
    except BaseException:  # exit even though the coordinator still waits
      traceback.print_exc()
      sys.stdout.flush()
      os._exit(1)
