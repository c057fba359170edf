"""One worker of a 2-process MultiWorkerMirroredStrategy job that may be killed.

Launched twice by tests/backends/test_multi_worker.py with ``TF_CONFIG`` set:
``python mwms_resume.py MODEL_DIR MODE OUT``. Trains a row-sharded Adam
table for ``STEPS`` steps on batches fixed by the step number, saving with
``tpe.checkpoints.CheckpointManager`` (every worker, same directory) every
``EVERY`` steps.

* ``MODE=kill``: both workers kill themselves (SIGKILL) after step
  ``KILL_AT``, past the last checkpoint, as a preempted job does.
* ``MODE=run``: restores the latest checkpoint if any (before the tables
  exist: each worker reads its own rows), trains to ``STEPS`` and writes
  the whole tables and slots (gathered) to ``OUT`` (chief only).

A killed and resumed job must end bit-identical to an uninterrupted one.
Prints "OK" on success.

In tests/backends/test_multi_worker.py its ``main`` runs as a phase of
``mwms_phases.py`` (several scripts per cluster launch).
"""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402

ROWS, DIM, PER_REPLICA, STEPS, EVERY, KILL_AT = 50, 4, 3, 10, 3, 7


def batch(
  step: int, replica: int, rows: int = ROWS, per_replica: int = PER_REPLICA
) -> tf.Tensor:
  rng = np.random.default_rng(1000 * step + replica)
  return tf.constant(rng.integers(0, rows, per_replica), tf.int64)


def train_and_save(
  strategy,
  model_dir: str,
  out: str,
  sizes: tuple[int, int, int] = (ROWS, DIM, PER_REPLICA),
  steps: int = STEPS,
  every: int = EVERY,
  after_step=None,
) -> None:
  """The job: restore the latest checkpoint, train to ``steps`` saving
  every ``every`` steps (calling ``after_step(step)`` after each), write
  the gathered tables and slots to ``out`` (chief only). ``sizes``: rows,
  width and ids per replica. Also ``mwms_checkpoint_kill.py``'s job."""
  rows, dim, per_replica = sizes
  with strategy.scope():
    table = tpe.TableConfig(
      rows, dim, name="t", initializer=tf.random_uniform_initializer(seed=5)
    )
    emb = tpe.TPUEmbedding(
      tpe.FeatureConfig(table), tpe.Adam(0.05), row_sharding_threshold=0
    )
    step = tf.Variable(0, dtype=tf.int64)
  manager = tpe.checkpoints.CheckpointManager(
    tf.train.Checkpoint(embedding=emb, step=step), model_dir, max_to_keep=2
  )
  manager.restore_or_initialize()
  emb.build()
  print(f"starting at step {int(step.numpy())}", flush=True)

  @tf.function
  def train(ids):
    emb.enqueue(ids)

    def replica_fn():
      with tf.GradientTape() as tape:
        activations = emb.dequeue()
        tape.watch(activations)
        loss = tf.reduce_sum(tf.sin(activations))
      emb.apply_gradients(tape.gradient(loss, activations))

    strategy.run(replica_fn)

  while int(step.numpy()) < steps:
    current = int(step.numpy())
    train(
      strategy.experimental_distribute_values_from_function(
        lambda ctx, s=current: batch(
          s, ctx.replica_id_in_sync_group, rows, per_replica
        )
      )
    )
    step.assign_add(1)
    if int(step.numpy()) % every == 0:
      manager.save()
    if after_step is not None:
      after_step(int(step.numpy()))
  values = {
    key: tf.convert_to_tensor(variable).numpy()
    for key, variable in emb.variables["t"].items()
  }
  if strategy.extended.should_checkpoint:
    np.savez(out, **values)
  print("OK")


def main(model_dir: str, mode: str, out: str, strategy=None) -> None:
  def after_step(done: int) -> None:
    if mode == "kill" and done == KILL_AT:
      os.kill(os.getpid(), signal.SIGKILL)

  strategy = strategy or tf.distribute.MultiWorkerMirroredStrategy()
  train_and_save(strategy, model_dir, out, after_step=after_step)


if __name__ == "__main__":
  main(*sys.argv[1:4])
