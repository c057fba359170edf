"""The processes of tools/memory_report.py's jobs, one role per process.

tools/memory_report.py starts them with a ``TF_CONFIG`` each and reads
their stdout, where they report in lines ``@memory {json}``:

``mwms``
  One worker of a ``MultiWorkerMirroredStrategy`` job. It measures itself
  (``/proc/self/status``, ``proc_memory.Meter``): the baseline after
  TensorFlow and the strategy are set up (one collective run), then each
  phase's peak growth. ``--stage train``: build, train, save (and export);
  ``--stage restore``: a fresh job restores the checkpoint (with
  ``--restore_again``, once more into the built tables).
``ps``
  The coordinator of a ``ParameterServerStrategy`` job. It announces each
  phase's beginning and end and waits for a line on stdin in between, so
  that the launcher can measure the parameter servers from outside.
``server``
  A parameter-server or worker task: a plain ``tf.distribute.Server``,
  running until killed.

Events: ``baseline``; ``plan`` (``full_bytes`` and each process's bytes
in the sharding plan; ``checkpoints``: how they are saved); ``phase`` (a
measured phase: ``process``, ``phase``, ``growth`` bytes, ``start``: the
resident growth when it began, ``seconds``); ``begin``/``end`` (the
coordinator's phases); ``probe`` (values proving a restore);
``progress``.

Run by the launcher only, e.g.
  TF_CONFIG=... python3 tools/memory_jobs.py mwms --stage train \\
      --workload '{"rows": 400000, "dim": 64}' --checkpoint /tmp/m/ckpt
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import proc_memory  # noqa: E402
import tensorflow as tf  # noqa: E402
from memory_config import TAG  # noqa: E402
from memory_config import Workload  # noqa: E402
from memory_workload import MirroredSteps  # noqa: E402
from memory_workload import ParameterServerSteps  # noqa: E402
from memory_workload import checkpoint_method  # noqa: E402
from memory_workload import create_embedding  # noqa: E402
from memory_workload import full_state_bytes  # noqa: E402
from memory_workload import restore_checkpoint  # noqa: E402
from memory_workload import save_checkpoint  # noqa: E402
from memory_workload import vocabulary_bytes  # noqa: E402

from tpu_embedding import export  # noqa: E402
from tpu_embedding import servers  # noqa: E402


def emit(event: str, **fields) -> None:
  """Writes one event line for the launcher."""
  print(TAG + json.dumps({"event": event, **fields}), flush=True)


def progress(message: str) -> None:
  emit("progress", message=message)


# --- MultiWorkerMirroredStrategy: each worker measures itself ---------------


class SelfMeasured:
  """Phases of this process, measured in-process and reported."""

  def __init__(self, process: str):
    self.process = process
    self.meter = proc_memory.Meter()
    emit("baseline", process=process, bytes=self.meter.baseline)

  @contextlib.contextmanager
  def phase(self, name: str):
    progress(f"{self.process}: {name} ...")
    start = time.time()
    inherited = self.meter.begin()
    yield
    growth = self.meter.end()
    emit(
      "phase",
      process=self.process,
      phase=name,
      growth=growth,
      start=inherited,
      seconds=time.time() - start,
    )


def emit_plan(embedding, processes: dict[str, list[int]]) -> None:
  """Reports the plan (full state, each process's replicas' bytes) and
  how checkpoints are written."""
  plan = embedding.sharding_plan
  per_replica = plan.bytes_per_replica()
  vocabularies = embedding.vocabulary_states
  emit(
    "plan",
    checkpoints=checkpoint_method(),
    full_bytes=full_state_bytes(plan, vocabularies),
    processes={
      # (a process's own vocabulary shards: it reports for itself)
      name: sum(per_replica[r] for r in replicas)
      + vocabulary_bytes(vocabularies)
      for name, replicas in processes.items()
    },
  )


def export_subset(strategy, embedding, export_dir: str) -> None:
  """Exports the ``side`` table only (every worker; the chief's is kept)."""
  with tempfile.TemporaryDirectory(prefix="memory_report_export_") as scratch:
    export.export_for_serving(
      export_dir if strategy.extended.should_checkpoint else scratch,
      embedding,
      None,
      {"side": export.FeatureSpec([None])},
      tables=["side"],
    )


def restore_again(embedding, checkpoint: str) -> None:
  """Restores ``checkpoint`` into the built (and restored) tables."""
  restore_checkpoint(embedding, checkpoint).assert_nontrivial_match()


def _restore_from(args: argparse.Namespace) -> tuple[str, bool]:
  """``create_embedding``'s checkpoint and order for this stage."""
  if args.stage == "restore":
    return args.checkpoint, args.restore_first
  return "", False


def run_mwms(args: argparse.Namespace, workload: Workload) -> None:
  """One worker of a ``MultiWorkerMirroredStrategy`` job (``--stage``)."""
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  # Set up: one collective, so the baseline holds the runtime's buffers.
  strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
  task = strategy.cluster_resolver.task_id
  local = len(strategy.extended.worker_devices)
  measured = SelfMeasured(f"worker{task}")
  build_phase = "build" if args.stage == "train" else "restore"
  with measured.phase(build_phase):
    embedding = create_embedding(strategy, workload, *_restore_from(args))
  if args.stage == "restore" and args.restore_again:
    with measured.phase("restore into built"):
      restore_again(embedding, args.checkpoint)
  replicas = list(range(task * local, (task + 1) * local))
  emit_plan(embedding, {measured.process: replicas})
  steps = MirroredSteps(strategy, embedding, workload)
  if args.stage == "train":
    with measured.phase("train"):
      steps.train(0, workload.steps)
    with measured.phase("save"):
      save_checkpoint(strategy, embedding, args.checkpoint)
  emit_probes(task == 0, steps, workload)
  if args.export_dir:
    with measured.phase("export"):
      export_subset(strategy, embedding, args.export_dir)


def emit_probes(report: bool, steps, workload: Workload) -> None:
  """The probe rows now and after one more step (every worker joins)."""
  now = steps.probe()
  steps.train(workload.steps, 1)
  after = steps.probe()
  if report:
    emit("probe", saved=now.tolist(), one_more_step=after.tolist())


# --- ParameterServerStrategy: the launcher measures the servers -------------


class Announced:
  """Phases announced to the launcher, which measures the servers."""

  def __init__(self):
    self.announce("baseline")

  @staticmethod
  def announce(event: str, **fields) -> None:
    emit(event, **fields)
    if sys.stdin.readline().strip() != "go":
      raise SystemExit("the launcher went away")

  @contextlib.contextmanager
  def phase(self, name: str):
    self.announce("begin", phase=name)
    start = time.time()
    yield
    self.announce("end", phase=name, seconds=time.time() - start)


def run_ps(args: argparse.Namespace, workload: Workload) -> None:
  """The coordinator of a ``ParameterServerStrategy`` job (``--stage``)."""
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
  coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(
    strategy
  )
  coordinator.schedule(tf.function(lambda: tf.constant(1))).fetch()
  announced = Announced()
  build_phase = "build" if args.stage == "train" else "restore"
  with announced.phase(build_phase):
    embedding = create_embedding(strategy, workload, *_restore_from(args))
  if args.stage == "restore" and args.restore_again:
    with announced.phase("restore into built"):
      restore_again(embedding, args.checkpoint)
  num_ps = resolver.cluster_spec().num_tasks("ps")
  emit_plan(embedding, {f"ps{i}": [i] for i in range(num_ps)})
  steps = ParameterServerSteps(strategy, coordinator, embedding, workload)
  if args.stage == "train":
    with announced.phase("train"):
      steps.train(0, workload.steps)
    with announced.phase("save"):
      save_checkpoint(strategy, embedding, args.checkpoint)
  emit_probes(True, steps, workload)


def run_server() -> None:
  """The task of ``TF_CONFIG``, served forever (``tpe.servers.serve``)."""
  servers.serve()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("role", choices=["mwms", "ps", "server"])
  parser.add_argument("--stage", choices=["train", "restore"], default="train")
  parser.add_argument("--workload", default="{}", help="Workload fields, JSON")
  parser.add_argument("--checkpoint", default="", help="checkpoint prefix")
  parser.add_argument(
    "--export_dir", default="", help="also export the 'side' table here"
  )
  parser.add_argument(
    "--restore_first",
    action="store_true",
    help="restore before build() (default: after)",
  )
  parser.add_argument(
    "--restore_again",
    action="store_true",
    help="then restore again, into the built tables (stage restore)",
  )
  args = parser.parse_args()
  if args.role == "server":
    run_server()
    return
  workload = Workload(**json.loads(args.workload))
  {"mwms": run_mwms, "ps": run_ps}[args.role](args, workload)
  emit("done")


if __name__ == "__main__":
  main()
