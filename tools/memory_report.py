"""Peak resident memory per process, phase by phase, of sharded-table jobs.

Sharding exists so that a table too large for one host trains anyway: with
N workers (or N parameter servers) each process should hold about 1/N of
the table's state (table + optimizer slots) at every phase. This tool
measures it as a user would, from the processes' resident memory, on
localhost clusters (127.0.0.1, free ports, one ``TF_CONFIG`` per process):

* ``MultiWorkerMirroredStrategy``, ``--workers`` worker processes (one
  CPU replica each), one table ``big`` of ``--rows x --dim`` row-sharded
  (``row_sharding_threshold=0``) with ``--optimizer``. Phases: **build**
  (``TPUEmbedding`` created and built), **train** (``--steps`` steps of
  enqueue → dequeue → apply_gradients in ``strategy.run``), **save** (a
  checkpoint of the tables and slots), **export** (``--export``: a
  SavedModel of a small second table only, ``export_for_serving`` from the
  sharded job), then (unless ``--no-restore``) a FRESH job of as many
  workers: **restore** (build + restore that checkpoint, in
  ``--restore_order``; with ``both``, restored before the tables are
  built, then again into the built tables: **restore into built**). With
  ``--resize``: a 1-worker job saves and a fresh N-worker job restores
  (**restore 1->N**, and **restore 1->N into built**).
* ``ParameterServerStrategy``: ``--ps`` parameter-server tasks, 1 worker
  task (plain ``tf.distribute.Server`` processes) and a coordinator
  process; build, train (steps scheduled with ``ClusterCoordinator``),
  save, and restore in a fresh cluster.

Each process's figure for a phase is its *peak resident growth*:
``VmHWM`` at the end of the phase minus a baseline ``VmRSS`` taken once,
after TensorFlow and the strategy are set up (one collective / one
scheduled function run) and before any table exists. The high-water mark
is reset at the start of every phase (``5`` > ``/proc/<pid>/clear_refs``),
so a phase's figure is the most its process held above the baseline
during that phase, including what earlier phases left resident (the
table itself). Multi-worker workers measure themselves
(``/proc/self/status``); the parameter-server job's processes are measured
from outside at phase boundaries the coordinator announces.

The report prints, per process and phase: the resident growth when the
phase began (what it inherited: memory earlier phases freed may stay
resident), the peak growth in MiB, its ratio to the full state (every
table and slot, whole: e.g. 2,000,000 x 128 float32 with Adagrad =
1.9 GiB) and to the plan's bytes for that process
(``embedding.sharding_plan``: its replicas' or PS task's share). The exit
code is 1, with one line naming them, when a promised phase
(``PROMISED_PHASES``: build, train, save, and every restore, as the
README says) of an N-process job (N = ``--workers`` or ``--ps``) grows
more than ``--limit`` (0.6) times the full state, or (one line, with the
logs' directory) when a job fails or a restored job does not hold the
saved values (probe rows compared after the restore and after one more
step); 2 for a usage error; else 0. ``export`` (and the 1-worker job of
``--resize``) is measured and shown but promises nothing. Jobs run one
after another; progress lines go to stderr, the table to stdout.

Run:
  python3 tools/memory_report.py                       # 2M x 128, Adagrad
  python3 tools/memory_report.py --initializers all --json /tmp/mem.json
  python3 tools/memory_report.py --rows 400000 --dim 64 --strategies mwms \\
      --no-resize --no-export
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

from model_garden import cli

if __name__ == "__main__":
  cli.quiet_tensorflow()  # this process (--logdir) and its children

from memory_config import INITIALIZERS  # noqa: E402
from memory_config import OPTIMIZERS  # noqa: E402
from memory_runs import MIB  # noqa: E402
from memory_runs import Row  # noqa: E402
from memory_runs import run_initializer  # noqa: E402

#: The phases whose peak growth the README promises to keep under
#: ``--limit`` (0.6x of the full state) on every process of an N-process
#: job, by their first word (``restore`` is also ``restore into built``,
#: ``restore 1->N``, ...). The others (``export``) are measured and shown,
#: and never change the exit status.
PROMISED_PHASES = ("build", "train", "save", "restore")


class Progress:
  """Timestamped progress lines on stderr."""

  def __init__(self):
    self._start = time.time()

  def __call__(self, message: str) -> None:
    print(f"[{time.time() - self._start:7.1f}s] {message}", file=sys.stderr)
    sys.stderr.flush()


def format_table(rows: list[Row], limit: float) -> str:
  """The report: one line per process and phase."""
  header = (
    f"{'initializer':<12} {'job':<15} {'process':<12} {'phase':<13} "
    f"{'at start MiB':>12} {'peak growth MiB':>15} {'x full state':>12} "
    f"{'x plan/process':>14} {'limit':>6}"
  )
  lines = [header, "-" * len(header)]
  for row in rows:
    plan = "-" if row.plan_ratio is None else f"{row.plan_ratio:.2f}"
    verdict = "-"
    if promised(row):
      verdict = "OVER" if row.ratio > limit else "ok"
    lines.append(
      f"{row.initializer:<12} {row.job:<15} {row.process:<12} "
      f"{row.phase:<13} {row.start / MIB:>12,.1f} {row.growth / MIB:>15,.1f} "
      f"{row.ratio:>12.2f} {plan:>14} {verdict:>6}"
    )
  if rows:
    lines.append(
      f"full state: {rows[0].full_bytes / MIB:,.1f} MiB; limit {limit}x "
      "for every process of an N-process job in the promised phases ("
      f"{', '.join(PROMISED_PHASES)}; the others are shown only)"
    )
  return "\n".join(lines)


def promised(row: Row) -> bool:
  """Whether ``--limit`` applies to ``row`` (and to the exit status)."""
  return row.checked and row.phase.split()[0] in PROMISED_PHASES


def over_promise(rows: list[Row], limit: float) -> str | None:
  """One line naming the promised phases over ``limit``, or None.

  Example:
    >>> rows = [Row("default", "MWMS 2 workers", f"worker{w}", phase,
    ...             growth, 1.0, full_bytes=100)
    ...         for w, phase, growth in [(0, "save", 70), (1, "save", 50),
    ...                                  (0, "export", 90)]]
    >>> print(over_promise(rows, 0.6))  # doctest: +NORMALIZE_WHITESPACE
    memory_report: phase over the 0.6x promise: save 0.70x (MWMS 2 workers
    worker0)
  """
  worst: dict[str, Row] = {}
  for row in rows:
    if promised(row) and row.ratio > limit:
      if row.phase not in worst or row.ratio > worst[row.phase].ratio:
        worst[row.phase] = row
  if not worst:
    return None
  phases = ", ".join(
    f"{phase} {row.ratio:.2f}x ({row.job} {row.process})"
    for phase, row in worst.items()
  )
  plural = "phases" if len(worst) > 1 else "phase"
  return f"memory_report: {plural} over the {limit}x promise: {phases}"


def write_summaries(logdir: str, rows: list[Row]) -> None:
  """TensorBoard scalars: each row's growth (MiB and x full state)."""
  import tensorflow as tf  # only with --logdir: the tool runs without it

  with tf.summary.create_file_writer(logdir).as_default():
    for row in rows:
      tag = f"{row.initializer}/{row.job}/{row.process}/{row.phase}"
      tf.summary.scalar(f"peak_growth_MiB/{tag}", row.growth / MIB, step=0)
      tf.summary.scalar(f"peak_growth_x_full/{tag}", row.ratio, step=0)


def _positive(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def _choices(allowed: tuple[str, ...], all_means: tuple[str, ...]):
  def parse(text: str) -> list[str]:
    names = list(all_means) if text == "all" else text.split(",")
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
      raise argparse.ArgumentTypeError(
        f"{unknown or text!r}: expected a comma-separated list of "
        f"{', '.join(allowed)} (or 'all')"
      )
    return names

  return parse


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(
    description=__doc__.splitlines()[0],
    epilog="See the module docstring for what is measured and how.",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--rows", type=_positive, default=2_000_000, help="rows of the table"
  )
  parser.add_argument(
    "--dim", type=_positive, default=128, help="width of the table"
  )
  parser.add_argument(
    "--optimizer",
    choices=OPTIMIZERS,
    default="adagrad",
    help="the table's optimizer (its slots are part of the state)",
  )
  parser.add_argument(
    "--initializers",
    type=_choices(INITIALIZERS, INITIALIZERS),
    default=["default"],
    help="comma-separated table initializers, each measured in its own "
    f"jobs, or 'all': {', '.join(INITIALIZERS)} (TableConfig's default; "
    "tf.random_uniform_initializer with and without a seed; "
    "tf.constant_initializer(0.5))",
  )
  parser.add_argument(
    "--strategies",
    type=_choices(("mwms", "ps"), ("mwms", "ps")),
    default=["mwms", "ps"],
    help="mwms (MultiWorkerMirroredStrategy), ps (ParameterServerStrategy)",
  )
  parser.add_argument(
    "--workers", type=_positive, default=2, help="MWMS worker processes (N)"
  )
  parser.add_argument(
    "--ps", type=_positive, default=2, help="parameter-server tasks (N)"
  )
  parser.add_argument(
    "--steps", type=_positive, default=5, help="training steps"
  )
  parser.add_argument(
    "--batch",
    type=_positive,
    default=4096,
    help="ids per replica per step (of the N-worker job; the global "
    "batch is the same in every job)",
  )
  parser.add_argument(
    "--resize",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="also restore a 1-worker MWMS checkpoint into N workers",
  )
  parser.add_argument(
    "--export",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="also export a small second table from the MWMS job",
  )
  parser.add_argument(
    "--restore",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="restore each checkpoint in a fresh job (and check its values)",
  )
  parser.add_argument(
    "--restore_order",
    choices=("build_first", "restore_first", "both"),
    default="build_first",
    help="restore after embedding.build() (Model Garden's order), before "
    "it (the tables take the checkpoint's values when created), or both: "
    "before it, then again into the built tables (one more phase)",
  )
  parser.add_argument(
    "--limit",
    type=float,
    default=0.6,
    help="largest allowed peak growth of a process of an N-process job, "
    "as a fraction of the full state",
  )
  parser.add_argument(
    "--dynamic",
    action="store_true",
    help="the table has a DynamicVocabulary (ids as raw keys): its "
    "vocabulary state, sharded with its rows, counts in the full state "
    "(MultiWorkerMirroredStrategy only)",
  )
  parser.add_argument("--json", default="", help="write all figures here")
  parser.add_argument(
    "--logdir", default="", help="write TensorBoard scalars here"
  )
  parser.add_argument(
    "--work_dir",
    default="",
    help="checkpoints and logs (default: a temporary directory, deleted)",
  )
  parser.add_argument(
    "--timeout", type=float, default=3600, help="seconds per job"
  )
  return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.batch <= 16:
    parser.error("--batch must be > 16 (the probe rows are in every batch)")
  if args.limit <= 0:
    parser.error(f"--limit must be > 0, got {args.limit}")
  if args.dynamic and "ps" in args.strategies:
    parser.error(
      "--dynamic needs --strategies=mwms: ParameterServerStrategy does not "
      "train dynamic tables yet"
    )
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  temporary = not args.work_dir
  args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="memory_report_")
  args.log_dir = os.path.join(args.work_dir, "logs")
  os.makedirs(args.log_dir, exist_ok=True)
  args.progress = Progress()
  rows: list[Row] = []
  errors: list[str] = []
  for initializer in args.initializers:
    run_initializer(args, initializer, rows, errors)
  if temporary and not errors:
    shutil.rmtree(args.work_dir, ignore_errors=True)
  print(format_table(rows, args.limit))
  print(f"checkpoints: {getattr(args, 'checkpoints', 'none written')}")
  if args.json:
    figures = [
      {**dataclasses.asdict(r), "ratio": r.ratio, "plan_ratio": r.plan_ratio}
      for r in rows
    ]
    settings = {
      k: v
      for k, v in vars(args).items()
      if isinstance(v, (int, float, str, list))
    }
    with open(args.json, "w") as f:
      json.dump(
        {"settings": settings, "rows": figures, "errors": errors}, f, indent=1
      )
  if args.logdir:
    write_summaries(args.logdir, rows)
  if errors:
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    print(
      f"memory_report: {errors[0]}{more}; logs: {args.log_dir}",
      file=sys.stderr,
    )
    return 1
  over = over_promise(rows, args.limit)
  if over:
    print(over, file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
