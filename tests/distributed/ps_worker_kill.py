"""A parameter-server job whose worker process is killed mid-training.

``python ps_worker_kill.py`` starts 1 parameter server and 2 workers as
real processes (``tf.distribute.Server`` on 127.0.0.1, ``server`` mode of
this script) and coordinates from this process: 40 steps are scheduled
with ``ClusterCoordinator.schedule``; worker 1 is killed (SIGKILL) while
steps are in flight. The coordinator must re-run its steps on worker 0 and
finish, and no update may be lost: every step adds its squared gradients
to the Adagrad accumulators (a linear loss, gradients of 0.5), so they
hold at least the 40 steps' sums (a step cut off after its update landed
may be re-run and count twice, as TensorFlow's coordinator documents).
Prints "OK" on success.
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
  server = tf.distribute.Server(
    tf.train.ClusterSpec(json.loads(spec)),
    job_name=job,
    task_index=index,
    protocol="grpc",
    start=True,
  )
  server.join()


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
      steps = tf.Variable(0, dtype=tf.int64)
    ids = tf.constant(np.arange(BATCH) % 3, tf.int64)  # hot rows 0, 1, 2

    def replica_step():
      emb.enqueue(ids)
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        loss = 0.5 * tf.reduce_sum(activations)
      emb.apply_gradients(tape.gradient(loss, activations))
      steps.assign_add(1)

    @tf.function
    def step():
      strategy.run(replica_step)

    for n in range(STEPS):
      coordinator.schedule(step)
      if n == STEPS // 4:
        time.sleep(1.0)  # steps in flight on both workers
        servers["worker", 1].send_signal(signal.SIGKILL)
        print("killed worker 1", flush=True)
    coordinator.join()
    accumulators = tf.convert_to_tensor(
      emb.variables["t"]["accumulators"]
    ).numpy()
    done = int(steps.numpy())
    # Per step, row r gets the gradient 0.5 * (ids == r).sum(): 0.5 * 3 for
    # rows 0 and 1, 0.5 * 2 for row 2; squared and summed over the steps.
    per_step = np.array([1.5**2, 1.5**2, 1.0**2])
    assert done >= STEPS, done
    want = 0.1 + STEPS * per_step[:, None]
    got = accumulators[:3]
    assert np.all(got >= want - 1e-4), (got, want, done)
    assert np.all(got <= 0.1 + done * per_step[:, None] + 1e-4), (got, done)
    np.testing.assert_array_equal(accumulators[3:], np.float32(0.1))
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
