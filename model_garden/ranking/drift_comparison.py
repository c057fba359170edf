r"""DLRM on drifting raw 64-bit keys: dynamic vocabularies vs ``key mod rows``.

Trains the same DLRM (``dlrm_criteo_cpu_small``: 26 tables of width 16,
bottom MLP 64-32-16, top MLP 128-64-1) twice on the same stream of
``data.drifting.DriftingCriteo`` examples, whose categorical values are raw
hashed 64-bit keys and whose popular keys keep changing:

* ``hashed``: fixed tables, each fed ``key mod rows`` (what users of fixed
  vocabularies do: unrelated keys share rows);
* ``dynamic``: the same number of rows per table as a
  ``tpu_embedding.DynamicVocabulary`` fed the raw keys (a key gets a row
  after ``--min_count`` sightings, the least recently seen key of a full
  bucket gives its row up; other keys read a zero row);
* ``hashed_same_bytes``: ``key mod rows`` tables given the dynamic
  tables' whole memory (their rows, slots and vocabulary state) as rows:
  every table scaled by the same factor.

The stream is read once, as in production: each batch is predicted before
the model trains on it, so the training metrics are *progressive
validation* (test-then-train) metrics; after the stream, the model is
evaluated on the examples that follow it (``--eval_examples``). Each
variant runs in its own process so that its peak resident memory
(``VmHWM``) is its own; the table bytes (rows, slots and vocabulary state)
are read from the built variables.

Run (about 2 minutes on 2 CPU cores)::

  python3 -m model_garden.ranking.drift_comparison --model_dir /tmp/drift

``--model_dir`` gets ``comparison.json``, ``comparison.png`` (progressive
AUC along the stream) and TensorBoard summaries per variant
(``<variant>/train``). ``--variant hashed|dynamic`` runs one variant in
this process (``--json FILE`` writes its figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from model_garden import cli

if __name__ == "__main__":
  cli.quiet_tensorflow()  # before TensorFlow is imported

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from model_garden.ranking import configs  # noqa: E402
from model_garden.ranking import strategies  # noqa: E402
from model_garden.ranking.data import drifting  # noqa: E402
from model_garden.ranking.data import synthetic  # noqa: E402
from model_garden.ranking.metrics import RankingMetrics  # noqa: E402
from model_garden.ranking.progress import Progress  # noqa: E402
from model_garden.ranking.task import RankingTask  # noqa: E402

#: The variants, in the order they run.
VARIANTS = ("hashed", "dynamic", "hashed_same_bytes")


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  add = parser.add_argument
  add("--model_dir", required=True, help="Where results and summaries go.")
  add("--variant", choices=VARIANTS, help="Run one variant in this process.")
  add("--json", help="With --variant: write its figures to this file.")
  add("--examples", type=int, default=1_048_576, help="Training stream.")
  add("--eval_examples", type=int, default=131_072, help="After the stream.")
  add("--batch_size", type=int, default=4096)
  add("--window", type=int, default=131_072, help="Examples per AUC point.")
  add("--rows", type=int, default=20_000, help="Max rows of a table.")
  add(
    "--entities",
    type=int,
    default=200_000,
    help="Max keys in play per feature at any time (Criteo's sizes capped).",
  )
  add("--examples_per_shift", type=int, default=8, help="Drift speed.")
  add("--zipf_exponent", type=float, default=1.05)
  add("--min_count", type=int, default=2, help="Dynamic: sightings to admit.")
  add("--eviction", choices=("lru", "lfu"), default="lru")
  add("--num_replicas", type=int, default=1, help="Logical CPUs mirrored.")
  add("--seed", type=int, default=0, help="Seeds every initializer.")
  add(
    "--rows_scale",
    type=float,
    default=1.0,
    help="Multiplies every table's rows (hashed_same_bytes; set by the "
    "comparison from the other two variants' bytes).",
  )
  return parser


def generator(args: argparse.Namespace) -> drifting.DriftingCriteo:
  return drifting.DriftingCriteo(
    synthetic.capped_vocab_sizes(args.entities),
    seed=args.seed,
    zipf_exponent=args.zipf_exponent,
    examples_per_shift=args.examples_per_shift,
  )


def table_rows(args: argparse.Namespace) -> tuple[int, ...]:
  """Rows per table: Criteo's sizes capped at ``--rows`` (the same for
  ``hashed`` and ``dynamic``), times ``--rows_scale``."""
  rows = synthetic.capped_vocab_sizes(
    args.rows, synthetic.capped_vocab_sizes(args.entities)
  )
  return tuple(int(r * args.rows_scale) for r in rows)


def experiment(args: argparse.Namespace, variant: str) -> Any:
  """``dlrm_criteo_cpu_small`` at these tables, batch and steps."""
  steps = args.examples // args.batch_size
  return configs.override(
    configs.get_config("dlrm_criteo_cpu_small"),
    {
      "task.model.vocab_sizes": list(table_rows(args)),
      "task.model.vocabulary": ("dynamic" if variant == "dynamic" else "fixed"),
      "task.model.vocabulary_min_count": args.min_count,
      "task.model.vocabulary_eviction": args.eviction,
      "task.train_data.global_batch_size": args.batch_size,
      "task.validation_data.global_batch_size": args.batch_size,
      "trainer.train_steps": steps,
      "trainer.enable_metrics_in_training": True,
      # No decay: the stream never ends; warm up as the CPU config does.
      "trainer.optimizer_config.lr_config.decay_start_steps": steps,
    },
  )


def peak_resident_bytes() -> int:
  """``VmHWM``: the most resident memory this process has held."""
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  raise OSError("no VmHWM in /proc/self/status")


def table_bytes(task: RankingTask) -> dict[str, int]:
  """Bytes of the tables' rows and slots, and of the vocabularies' state
  (summed over devices)."""
  rows = sum(
    sum(store.bytes_per_device().values())
    for store in task.embedding.table_stores.values()
  )
  replicas = len(task.embedding.backend.local_devices)
  statistics = task.embedding.engine.dynamic_tables.statistics()
  vocabularies = replicas * sum(s["state_bytes"] for s in statistics.values())
  return {"rows_and_slots": rows, "vocabulary_state": vocabularies}


def run_variant(args: argparse.Namespace, variant: str) -> dict[str, Any]:
  """Trains one variant on the stream; returns its figures."""
  if args.num_replicas > 1:
    strategies.use_logical_cpus(args.num_replicas)
    strategy = strategies.create_strategy(
      "mirrored", num_replicas=args.num_replicas
    )
  else:
    strategy = tf.distribute.get_strategy()
  config = experiment(args, variant)
  keras.utils.set_random_seed(args.seed)  # The dense layers' initial values.
  task = RankingTask(config, strategy, seed=args.seed)
  peak_after_build = peak_resident_bytes()
  gen = generator(args)
  rows = None if variant == "dynamic" else config.task.model.vocab_sizes

  def distributed(start: int, count: int):
    stream = gen.stream(args.batch_size, start, count, rows)
    return strategy.experimental_distribute_dataset(stream)

  steps = args.examples // args.batch_size
  steps_per_window = max(1, args.window // args.batch_size)
  writer = tf.summary.create_file_writer(
    os.path.join(args.model_dir, variant, "train")
  )
  progress = Progress(steps, batch_size=args.batch_size, log_steps=50)
  overall, window = RankingMetrics(), RankingMetrics()
  curve: list[dict[str, float]] = []
  started = time.perf_counter()
  step = 0
  for features, labels in distributed(0, steps * args.batch_size):
    result = task.train_step(features, labels)
    step += 1
    statistics = {k: v.numpy() for k, v in result["statistics"].items()}
    window.add(statistics)
    if step > steps_per_window:  # The first window is warm-up.
      overall.add(statistics)
    progress.update(step, float(result["loss"]), window.result())
    if step % steps_per_window == 0 or step == steps:
      point = {"examples": step * args.batch_size, **window.result()}
      point.update(_fill(task))
      curve.append(point)
      with writer.as_default(step=step):
        for name, value in point.items():
          tf.summary.scalar(name, value)
      window = RankingMetrics()
  seconds = time.perf_counter() - started
  peak_after_training = peak_resident_bytes()
  held_out = RankingMetrics()
  after = distributed(steps * args.batch_size, args.eval_examples)
  for features, labels in after:
    statistics = task.eval_step(features, labels)
    held_out.add({k: v.numpy() for k, v in statistics.items()})
  return {
    "variant": variant,
    "rows": sum(config.task.model.vocab_sizes),
    "progressive": overall.result(),
    "held_out": held_out.result(),
    "curve": curve,
    "examples_per_second": steps * args.batch_size / seconds,
    "peak_resident_bytes": {
      "after_build": peak_after_build,
      "after_training": peak_after_training,
      "end": peak_resident_bytes(),
    },
    "table_bytes": table_bytes(task),
    "vocabularies": task.embedding.engine.dynamic_tables.statistics(),
  }


def _fill(task: RankingTask) -> dict[str, float]:
  """Dynamic tables: the share of rows in use and evictions so far."""
  statistics = task.embedding.engine.dynamic_tables.statistics().values()
  if not statistics:
    return {}
  return {
    "rows_in_use": sum(s["rows_in_use"] for s in statistics)
    / sum(s["capacity"] for s in statistics),
    "evictions": float(sum(s["evictions"] for s in statistics)),
  }


def compare(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
  """Runs each variant in a child process; returns their figures."""
  results: dict[str, Any] = {}
  for variant in VARIANTS:
    path = os.path.join(args.model_dir, f"{variant}.json")
    command = [sys.executable, "-m", __spec__.name, *argv]
    command += ["--variant", variant, "--json", path]
    if variant == "hashed_same_bytes":
      command += ["--rows_scale", str(_same_bytes_scale(results))]
    print(f"--- {variant} ---", flush=True)
    subprocess.run(command, check=True, env=_env_importing_model_garden())
    with open(path, encoding="utf-8") as f:
      results[variant] = json.load(f)
  return results


def _same_bytes_scale(results: dict[str, Any]) -> float:
  """The rows factor that gives ``hashed`` tables ``dynamic``'s bytes."""
  dynamic = sum(results["dynamic"]["table_bytes"].values())
  return dynamic / results["hashed"]["table_bytes"]["rows_and_slots"]


def _env_importing_model_garden() -> dict[str, str]:
  """This environment, with ``model_garden``'s parent first on
  ``PYTHONPATH``: the children import the packages this process imported,
  wherever they start (``PYTHONSAFEPATH``, Python 3.11+: ``python -m``
  does not put the working directory, say a source checkout, first)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  path = os.environ.get("PYTHONPATH")
  return dict(
    os.environ,
    PYTHONPATH=root + (os.pathsep + path if path else ""),
    PYTHONSAFEPATH="1",
  )


def report(results: dict[str, Any]) -> str:
  """The comparison as a text table."""
  mib = 2**20
  lines = [f"{'':28s}" + "".join(f"{v:>19s}" for v in results)]

  def row(name: str, fn) -> None:
    values = "".join(f"{fn(r):>19s}" for r in results.values())
    lines.append(f"{name:28s}{values}")

  row("rows (all tables)", lambda r: f"{r['rows']:,}")
  row("progressive AUC", lambda r: f"{r['progressive']['auc']:.4f}")
  row("progressive loss", lambda r: f"{r['progressive']['loss']:.4f}")
  row("held-out AUC (next window)", lambda r: f"{r['held_out']['auc']:.4f}")
  row("held-out loss", lambda r: f"{r['held_out']['loss']:.4f}")
  row("examples/s", lambda r: f"{r['examples_per_second']:,.0f}")
  row(
    "table rows+slots MiB",
    lambda r: f"{r['table_bytes']['rows_and_slots'] / mib:.1f}",
  )
  row(
    "vocabulary state MiB",
    lambda r: f"{r['table_bytes']['vocabulary_state'] / mib:.1f}",
  )
  row(
    "peak RSS after build MiB",
    lambda r: f"{r['peak_resident_bytes']['after_build'] / mib:,.0f}",
  )
  row(
    "peak RSS (whole run) MiB",
    lambda r: f"{r['peak_resident_bytes']['end'] / mib:,.0f}",
  )
  return "\n".join(lines)


def plot(results: dict[str, Any], path: str) -> None:
  """Progressive AUC per window along the stream, one line per variant."""
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  figure, axis = plt.subplots(figsize=(7, 4))
  for variant, result in results.items():
    curve = result["curve"]
    axis.plot(
      [p["examples"] for p in curve],
      [p["auc"] for p in curve],
      marker="o",
      label=variant,
    )
  axis.set_xlabel("examples of the stream")
  axis.set_ylabel("progressive AUC (window)")
  axis.set_title("DLRM on drifting raw keys: dynamic vs key mod rows")
  axis.grid(alpha=0.3)
  axis.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  if args.examples < args.batch_size or args.eval_examples < args.batch_size:
    raise cli.UsageError(
      "--examples and --eval_examples must be >= --batch_size."
    )
  from model_garden.ranking import preflight  # noqa: PLC0415

  preflight.check_model_dir(args.model_dir)
  os.makedirs(args.model_dir, exist_ok=True)
  if args.variant:
    result = run_variant(args, args.variant)
    if args.json:
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=_plain)
    return {args.variant: result}
  results = compare(args, argv)
  text = report(results)
  print(text)
  with open(os.path.join(args.model_dir, "comparison.json"), "w") as f:
    json.dump(results, f, indent=1, default=_plain)
  plot(results, os.path.join(args.model_dir, "comparison.png"))
  return results


def _plain(value: Any) -> Any:
  """numpy scalars as Python numbers (for ``json``)."""
  if isinstance(value, np.generic):
    return value.item()
  raise TypeError(f"{type(value).__name__} is not JSON serializable")


if __name__ == "__main__":
  cli.run(main)
