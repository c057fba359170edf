"""One worker of a 2-process job killed in the middle of a sliced save.

Launched by tests/checkpointing/test_checkpoint_kill.py (twice per cluster,
``TF_CONFIG`` set): ``python mwms_checkpoint_kill.py MODEL_DIR MODE OUT``
(or several ``MODEL_DIR run OUT`` triples: those jobs one after another in
one launch). Trains a row-sharded Adam table for ``STEPS`` steps on batches
fixed by the step number, saving with ``tpe.checkpoints.CheckpointManager``
(every worker, same directory) every ``EVERY`` steps; the second save
(``ckpt-2``, step 4) is the one a kill cuts off. ``MODE``:

* ``run``: restores the latest checkpoint if any (each worker its own
  rows), prints the step it starts at, trains to ``STEPS`` and writes the
  whole tables and slots (gathered) to ``OUT`` (chief only).
* ``kill_worker``: worker 1 kills itself (SIGKILL) inside
  ``tpe.checkpoints``' write of ``ckpt-2``, right after writing its rows
  of the table's second key (its rows of the third are never written).
  The hook is the op that writes a part, ``tf.raw_ops.SaveV2``, wrapped
  in this script only.
* ``kill_chief``: the chief kills itself inside the merge of ``ckpt-2``.
  TensorFlow's ``MergeV2Checkpoints`` is one C++ op with no hook inside,
  so this script wraps ``tf.raw_ops.MergeV2Checkpoints``: the real op
  merges every part but the last to the destination asked for, and the
  chief dies before the rest. That leaves at the destination what a
  merge cut off leaves, or worse: moved data files and an index that
  lacks some of the tables' rows.

* ``kill_commit``: the chief kills itself in the commit of ``ckpt-2``
  (the merged files moved from ``ckpt-2_temp`` to ``ckpt-2``, the index
  last), right after the first file moved: the hook is
  ``tf.io.gfile.rename``, wrapped in this script only.

The other worker is left blocked (in a collective, waiting for the dead
one); the test kills it, as ``model_garden.ranking.launcher`` does.
Prints "OK" on success.
"""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from mwms_resume import train_and_save  # noqa: E402 (this directory)

ROWS, DIM, PER_REPLICA, STEPS, EVERY = 20, 2, 3, 6, 2
#: Parts a worker writes per save: the table, its momenta, its velocities.
KEYS = 3


def die() -> None:
  print("killing this process", flush=True)
  os.kill(os.getpid(), signal.SIGKILL)


def kill_in_second_save_v2() -> None:
  """SIGKILL after this worker's second part of the second save."""
  save_v2, calls = tf.raw_ops.SaveV2, []

  def wrapped(**kwargs):
    result = save_v2(**kwargs)
    calls.append(kwargs["prefix"])
    if len(calls) == KEYS + 2:
      die()
    return result

  tf.raw_ops.SaveV2 = wrapped


def kill_in_second_merge() -> None:
  """SIGKILL in the second merge, the last part not merged."""
  merge, calls = tf.raw_ops.MergeV2Checkpoints, []

  def wrapped(checkpoint_prefixes, destination_prefix, **kwargs):
    calls.append(destination_prefix)
    if len(calls) == 2:
      merge(
        checkpoint_prefixes=checkpoint_prefixes[:-1],
        destination_prefix=destination_prefix,
        delete_old_dirs=False,
      )
      die()
    return merge(
      checkpoint_prefixes=checkpoint_prefixes,
      destination_prefix=destination_prefix,
      **kwargs,
    )

  tf.raw_ops.MergeV2Checkpoints = wrapped


def kill_after_first_commit_rename() -> None:
  """SIGKILL after the first file of ``ckpt-2`` is moved in place."""
  rename = tf.io.gfile.rename

  def wrapped(src, dst, overwrite=False):
    rename(src, dst, overwrite)
    if os.path.basename(dst).startswith("ckpt-2."):
      die()

  tf.io.gfile.rename = wrapped


def main(model_dir: str, mode: str, out: str, strategy=None) -> None:
  strategy = strategy or tf.distribute.MultiWorkerMirroredStrategy()
  worker = strategy.cluster_resolver.task_id
  if mode == "kill_worker" and worker == 1:
    kill_in_second_save_v2()
  if mode == "kill_chief" and worker == 0:
    kill_in_second_merge()
  if mode == "kill_commit" and worker == 0:
    kill_after_first_commit_rename()
  train_and_save(
    strategy, model_dir, out, (ROWS, DIM, PER_REPLICA), STEPS, EVERY
  )


def run_jobs(args: list[str]) -> None:
  """``MODEL_DIR run OUT`` triples, one job each, on one strategy (a
  ``=== MODEL_DIR`` line before each; the kill modes need a launch of
  their own: they patch TensorFlow's ops in the process)."""
  assert len(args) % 3 == 0 and set(args[1::3]) == {"run"}, args
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  for first in range(0, len(args), 3):
    print(f"=== {args[first]}", flush=True)
    main(*args[first : first + 3], strategy)
    sys.stdout.flush()


if __name__ == "__main__":
  if len(sys.argv) == 4:
    main(*sys.argv[1:4])
  else:
    run_jobs(sys.argv[1:])
