"""The jobs of one tools/memory_report.py measurement, and their figures.

For one initializer, ``run_initializer`` runs, one after another: a
``MultiWorkerMirroredStrategy`` job that builds, trains, saves (and
exports), a fresh job of as many workers that restores, optionally a
1-worker job that saves and an N-worker job that restores it, and the
same with ``ParameterServerStrategy`` (servers measured from outside). A
restored job must report the probe rows of the job that saved
(``check_restored``). Every measured phase of every process is a ``Row``.

Example:
  >>> row = Row("default", "MWMS 2 workers", "worker0", "build", 3 * MIB,
  ...           1.0, full_bytes=4 * MIB, plan_bytes=2 * MIB)
  >>> row.ratio, row.plan_ratio
  (0.75, 1.5)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
from typing import Any

from memory_cluster import Job
from memory_cluster import JobError
from memory_cluster import cluster_spec
from memory_cluster import tf_config
from memory_config import Workload
from proc_memory import Meter

#: Bytes per MiB.
MIB = 2**20
#: Rows of the exported table (``--export``).
SIDE_ROWS = 1000


@dataclasses.dataclass
class Row:
  """One process's peak growth in one phase.

  Attributes:
    initializer: the table initializer.
    job: e.g. ``"MWMS 2 workers"``.
    process: e.g. ``"worker0"``, ``"ps1"``, ``"coordinator"``.
    phase: ``build``, ``train``, ``save``, ``export``, ``restore``, ...
    growth: peak resident growth over the baseline, bytes.
    seconds: the phase's duration.
    start: resident growth over the baseline when the phase began (what
      it inherited from earlier phases), bytes.
    full_bytes: every table and slot, whole.
    plan_bytes: this process's bytes in the sharding plan.
    checked: whether ``--limit`` applies (a process of an N-process job).
  """

  initializer: str
  job: str
  process: str
  phase: str
  growth: int
  seconds: float
  start: int = 0
  full_bytes: int = 0
  plan_bytes: int = 0
  checked: bool = True

  @property
  def ratio(self) -> float:
    """Growth / full state."""
    return self.growth / self.full_bytes

  @property
  def plan_ratio(self) -> float | None:
    """Growth / this process's plan bytes (None if it holds none)."""
    return self.growth / self.plan_bytes if self.plan_bytes else None


@dataclasses.dataclass
class JobResult:
  """A finished job: its rows and the probe values it reported."""

  rows: list[Row]
  probe: dict[str, Any]


def _finish_rows(rows: list[Row], plan: dict[str, Any]) -> None:
  """Adds the plan's bytes; orders by phase (as they ran), then process."""
  phases = list(dict.fromkeys(row.phase for row in rows))
  rows.sort(key=lambda row: (phases.index(row.phase), row.process))
  for row in rows:
    row.full_bytes = plan["full_bytes"]
    row.plan_bytes = plan["processes"].get(row.process, 0)


def _restore_order(args) -> list[str]:
  return {
    "build_first": [],
    "restore_first": ["--restore_first"],
    "both": ["--restore_first", "--restore_again"],
  }[args.restore_order]


def run_mirrored(
  args,
  workload: Workload,
  name: str,
  stage: str,
  checkpoint: str,
  *,
  workers: int,
  export_dir: str = "",
) -> JobResult:
  """One ``MultiWorkerMirroredStrategy`` job of ``workers`` processes.

  Args:
    args: the tool's flags.
    workload: what the job trains.
    name: the job's name in progress lines and log files.
    stage: ``train`` (build, train, save) or ``restore``.
    checkpoint: the checkpoint's prefix.
    workers: worker processes.
    export_dir: with ``stage="train"``, also export the ``side`` table.
  """
  progress = args.progress
  spec = cluster_spec(worker=workers)
  label = f"MWMS {workers} worker{'s' * (workers > 1)}"
  rows: list[Row] = []
  plan: dict[str, Any] = {}
  probe: dict[str, Any] = {}
  job_args = ["mwms", "--stage", stage, "--workload", workload.to_json()]
  job_args += ["--checkpoint", checkpoint] + _restore_order(args)
  if export_dir and stage == "train":
    job_args += ["--export_dir", export_dir]
  with Job(name, args.log_dir, args.timeout) as job:
    for index in range(workers):
      job.start(f"worker{index}", job_args, tf_config(spec, "worker", index))
    for process, event in job.events():
      if event["event"] == "progress":
        progress(f"{name} {event['message']}")
      elif event["event"] == "plan":
        plan["full_bytes"] = event["full_bytes"]
        plan.setdefault("processes", {}).update(event["processes"])
        args.checkpoints = event["checkpoints"]
      elif event["event"] == "probe":
        probe = event
      elif event["event"] == "phase":
        rows.append(
          Row(
            workload.initializer,
            label,
            process,
            event["phase"],
            event["growth"],
            event["seconds"],
            start=event["start"],
            checked=workers == args.workers,
          )
        )
        progress(
          f"{name} {process}: {event['phase']} peak growth "
          f"{event['growth'] / MIB:,.0f} MiB ({event['seconds']:.1f}s)"
        )
  _finish_rows(rows, plan)
  return JobResult(rows, probe)


def run_parameter_servers(
  args, workload: Workload, name: str, stage: str, checkpoint: str
) -> JobResult:
  """One ``ParameterServerStrategy`` job, its servers measured outside."""
  progress = args.progress
  spec = cluster_spec(chief=1, worker=1, ps=args.ps)
  rows: list[Row] = []
  plan: dict[str, Any] = {}
  probe: dict[str, Any] = {}
  meters: dict[str, Meter] = {}
  starts: dict[str, int] = {}
  with Job(name, args.log_dir, args.timeout) as job:
    for task_type in ("ps", "worker"):
      for index in range(len(spec[task_type])):
        job.start(
          f"{task_type}{index}",
          ["server"],
          tf_config(spec, task_type, index),
          reports=False,
        )
    job.start(
      "coordinator",
      [
        "ps",
        "--stage",
        stage,
        "--workload",
        workload.to_json(),
        "--checkpoint",
        checkpoint,
        *_restore_order(args),
      ],
      tf_config(spec, "chief", 0),
      answers=True,
    )
    for _, event in job.events():
      kind = event["event"]
      if kind == "baseline":
        meters = {label: Meter(job.pid(label)) for label in job.labels()}
      elif kind == "begin":
        progress(f"{name}: {event['phase']} ...")
        starts = {label: meter.begin() for label, meter in meters.items()}
      elif kind == "end":
        for label, meter in meters.items():
          rows.append(
            Row(
              workload.initializer,
              f"PS {args.ps} tasks",
              label,
              event["phase"],
              meter.end(),
              event["seconds"],
              start=starts[label],
            )
          )
        latest = rows[-len(meters) :]
        progress(
          f"{name}: {event['phase']} peak growth "
          + ", ".join(f"{r.process} {r.growth / MIB:,.0f} MiB" for r in latest)
        )
      elif kind == "plan":
        plan = event
        args.checkpoints = event["checkpoints"]
      elif kind == "probe":
        probe = event
      if kind in ("baseline", "begin", "end"):
        job.answer("coordinator", "go")
  _finish_rows(rows, plan)
  return JobResult(rows, probe)


def _close(a: list, b: list) -> bool:
  if isinstance(a, list):
    return len(a) == len(b) and all(map(_close, a, b))
  return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


def check_restored(saved: JobResult, restored: JobResult, what: str) -> None:
  """Raises ``JobError`` unless the restored job's probes equal the saved.

  Both jobs report the probe rows right after saving (restoring) and after
  one more identical step, which reads the optimizer's slots.
  """
  for key in ("saved", "one_more_step"):
    if key not in saved.probe or key not in restored.probe:
      raise JobError(f"{what}: a job reported no probe values ({key}).")
    if not _close(saved.probe[key], restored.probe[key]):
      raise JobError(
        f"{what}: the restored job's probe rows ({key}) differ from the "
        "saved job's: the checkpoint was not restored."
      )


def run_initializer(
  args, initializer: str, rows: list[Row], errors: list[str]
) -> None:
  """Every job of one initializer, one after another.

  Each saving job is followed by a fresh job restoring its checkpoint
  (unless ``--no-restore``).
  Appends their rows to ``rows`` as the jobs finish; a failed job (or a
  restore that did not reproduce the saved probes) appends to ``errors``
  and the next pair of jobs still runs.
  """
  workload = Workload(
    rows=args.rows,
    dim=args.dim,
    optimizer=args.optimizer,
    initializer=initializer,
    steps=args.steps,
    batch=args.batch,
    parts=args.workers,
    side_rows=SIDE_ROWS if args.export else 0,
    dynamic=args.dynamic,
  )
  work = os.path.join(args.work_dir, initializer)
  n = args.workers
  mirrored = functools.partial(run_mirrored, workers=n)
  pairs = []  # (what, restore phase, checkpoint, saving job, restoring job)
  if "mwms" in args.strategies:
    export = os.path.join(work, "export") if args.export else ""
    save = functools.partial(run_mirrored, workers=n, export_dir=export)
    pairs.append((f"{initializer} MWMS", "restore", "mwms", save, mirrored))
    if args.resize:
      single = functools.partial(run_mirrored, workers=1)
      pairs.append(
        (
          f"{initializer} MWMS 1-{n}",
          f"restore 1->{n}",
          "mwms1",
          single,
          mirrored,
        )
      )
  if "ps" in args.strategies:
    ps = run_parameter_servers
    pairs.append((f"{initializer} PS", "restore", "ps", ps, ps))
  for what, phase, directory, save, restore in pairs:
    name = what.replace(" ", "-")
    checkpoint = os.path.join(work, directory, "ckpt")
    os.makedirs(os.path.dirname(checkpoint), exist_ok=True)
    try:
      saved = save(args, workload, f"{name}-save", "train", checkpoint)
      rows += saved.rows
      if not args.restore:
        continue
      restored = restore(
        args, workload, f"{name}-restore", "restore", checkpoint
      )
      for row in restored.rows:  # restore (into built): restore 1->N ...
        row.phase = row.phase.replace("restore", phase, 1)
      rows += restored.rows
      check_restored(saved, restored, f"{what} {phase}")
    except JobError as e:
      errors.append(str(e))
      args.progress(f"FAILED: {e}")
    finally:
      _drop(checkpoint)


def _drop(checkpoint: str) -> None:
  """Deletes a checkpoint's directory (they are large)."""
  shutil.rmtree(os.path.dirname(checkpoint), ignore_errors=True)
