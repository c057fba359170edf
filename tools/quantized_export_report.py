"""Size, validation AUC and serving latency of quantized ranking exports.

Trains a ranking experiment (``dlrm_criteo_cpu_small`` by default; or
reuses the run in ``--model_dir`` when it holds a checkpoint), exports
its latest checkpoint once per ``--table_dtypes`` entry with
``export_for_serving(table_dtype=...)``, and for each SavedModel, loaded
with ``tf.saved_model.load`` and served through ``serving_default``:

* its size on disk (all files) and its ``variables/`` size;
* the validation AUC over the experiment's validation set (the exact
  ROC AUC, and the trainer's 200-threshold one), and the largest
  difference of a predicted probability from float32's;
* its latency per request of ``--batch_sizes`` examples (median of
  ``--repeats`` blocks of calls, the types interleaved so that a busy
  machine slows them alike).

It prints a table with ratios against float32 (``--json``: every number).

Run:
  python3 tools/quantized_export_report.py --model_dir /tmp/tpe_quant \\
      --json /tmp/quantized_export.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from model_garden import cli

if __name__ == "__main__":
  cli.quiet_tensorflow()  # before TensorFlow is imported

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tpu_embedding import checkpoints  # noqa: E402
from tpu_embedding.export import TABLE_DTYPES  # noqa: E402


def progress(message: str, *args: object) -> None:
  """A progress line on stderr."""
  print(message % args if args else message, file=sys.stderr, flush=True)


def exact_auc(labels: np.ndarray, scores: np.ndarray) -> float:
  """The ROC AUC: the Mann-Whitney statistic with ties counted half.

  Example:
    >>> import numpy as np
    >>> exact_auc(np.array([0, 1, 0, 1]), np.array([0.1, 0.4, 0.4, 0.9]))
    0.875
  """
  labels = np.asarray(labels, np.float64).reshape(-1)
  scores = np.asarray(scores, np.float64).reshape(-1)
  order = np.argsort(scores, kind="mergesort")
  sorted_scores = scores[order]
  ranks = np.empty(len(scores), np.float64)
  # Average ranks (1-based) over runs of equal scores.
  starts = np.r_[0, np.flatnonzero(np.diff(sorted_scores)) + 1]
  ends = np.r_[starts[1:], len(scores)]
  for begin, end in zip(starts, ends, strict=True):
    ranks[order[begin:end]] = (begin + end + 1) / 2.0
  positives = labels.sum()
  negatives = len(labels) - positives
  if positives == 0 or negatives == 0:
    return float("nan")
  sum_ranks = ranks[labels == 1].sum()
  return float(
    (sum_ranks - positives * (positives + 1) / 2) / (positives * negatives)
  )


def directory_bytes(path: str) -> int:
  """Bytes of the files under ``path``."""
  return sum(
    os.path.getsize(os.path.join(root, name))
    for root, _, names in os.walk(path)
    for name in names
  )


def train_or_reuse(config: Any, model_dir: str) -> tuple[str, dict]:
  """The latest checkpoint of ``model_dir``, training first if none."""
  from model_garden.ranking import train  # noqa: PLC0415

  base, deltas = checkpoints.latest_with_deltas(model_dir)
  latest = checkpoints.chain_end(base, deltas)
  if latest:
    progress("Reusing %s", latest)
    return latest, {}
  progress("Training %s in %s", "the experiment", model_dir)
  summary = train.run(config, model_dir, mode="train_and_eval")
  return summary["checkpoint"], summary.get("validation", {})


def signature_batches(config: Any) -> list[tuple[dict, np.ndarray]]:
  """The validation set as ``(signature inputs, labels)`` batches."""
  from model_garden.ranking import saved_model  # noqa: PLC0415
  from model_garden.ranking.inputs import RankingInputs  # noqa: PLC0415

  inputs = RankingInputs(config.task)
  batches = []
  for features, labels in inputs.eval_dataset_fn()(None):
    request = {"dense_features": features["dense_features"]}
    for key, ids in features["sparse_features"].items():
      if isinstance(ids, tf.SparseTensor):
        ids = tf.sparse.to_dense(ids, default_value=-1)
      request[saved_model.input_name(int(key))] = tf.cast(ids, tf.int64)
    batches.append((request, labels.numpy().reshape(-1)))
  return batches


def evaluate(serve: Any, batches: list) -> tuple[dict[str, float], Any]:
  """AUCs of a signature over the batches, and its predictions."""
  from model_garden.ranking import metrics  # noqa: PLC0415

  totals = metrics.RankingMetrics()
  predictions, labels = [], []
  for request, label in batches:
    p = serve(**request)["predictions"]
    totals.add(metrics.batch_statistics(label, p, tf.zeros_like(p)))
    predictions.append(p.numpy().reshape(-1))
    labels.append(label)
  predicted = np.concatenate(predictions)
  return {
    "auc": exact_auc(np.concatenate(labels), predicted),
    "auc_200_thresholds": totals.result()["auc"],
  }, predicted


def request_of(batches: list, size: int) -> dict[str, tf.Tensor]:
  """The first ``size`` validation examples as one request."""
  first = batches[0][0]
  return {k: tf.identity(v[:size]) for k, v in first.items()}


def time_calls(serve: Any, request: dict, calls: int) -> float:
  """Milliseconds per call over ``calls`` calls."""
  start = time.perf_counter()
  for _ in range(calls):
    out = serve(**request)["predictions"]
  out.numpy()
  return (time.perf_counter() - start) / calls * 1e3


def report(args: argparse.Namespace) -> dict[str, Any]:
  """Trains (or reuses), exports, evaluates and times."""
  from model_garden.ranking import saved_model  # noqa: PLC0415
  from model_garden.ranking import train  # noqa: PLC0415

  types = [t.strip() for t in args.table_dtypes.split(",") if t.strip()]
  for t in types:
    if t not in TABLE_DTYPES:
      raise cli.UsageError(
        f"--table_dtypes: unknown type {t!r}; allowed: "
        f"{', '.join(TABLE_DTYPES)}."
      )
  if "float32" not in types:
    types.insert(0, "float32")
  config = train.build_config(
    args.experiment, params_override=args.params_override
  )
  os.makedirs(args.model_dir, exist_ok=True)
  checkpoint, trained = train_or_reuse(config, args.model_dir)
  result: dict[str, Any] = {
    "experiment": args.experiment,
    "checkpoint": checkpoint,
    "training_validation": trained,
    "types": {},
  }
  batches = signature_batches(config)
  progress("Validation: %d batches", len(batches))
  served = {}
  predictions = {}
  for t in types:
    export_dir = os.path.join(args.model_dir, "quantized", t)
    if tf.io.gfile.exists(export_dir):
      tf.io.gfile.rmtree(export_dir)
    start = time.perf_counter()
    saved_model.export_from_checkpoint(
      config, checkpoint, export_dir, table_dtype=t
    )
    seconds = time.perf_counter() - start
    serve = tf.saved_model.load(export_dir).signatures["serving_default"]
    served[t] = serve
    aucs, predictions[t] = evaluate(serve, batches)
    result["types"][t] = {
      "export_seconds": seconds,
      "saved_model_bytes": directory_bytes(export_dir),
      "variables_bytes": directory_bytes(os.path.join(export_dir, "variables")),
      **aucs,
      "max_prediction_difference": float(
        np.max(np.abs(predictions[t] - predictions["float32"]))
      ),
    }
    progress("%s: exported and evaluated (AUC %.5f)", t, aucs["auc"])
  sizes = args.batch_sizes
  timings: dict[str, dict[int, list[float]]] = {
    t: {b: [] for b in sizes} for t in types
  }
  for size in sizes:
    request = request_of(batches, size)
    calls = max(5, args.calls // max(1, size // 64))
    for t in types:  # warm up (tracing, thread pools)
      time_calls(served[t], request, 5)
    for _ in range(args.repeats):
      for t in types:
        timings[t][size].append(time_calls(served[t], request, calls))
  for t in types:
    result["types"][t]["latency_ms"] = {
      str(b): {
        "median": statistics.median(v),
        "min": min(v),
        "max": max(v),
        "values": v,
      }
      for b, v in timings[t].items()
    }
  return result


def describe(result: dict[str, Any]) -> str:
  """The table: one row per type, ratios against float32."""
  base = result["types"]["float32"]
  sizes = list(base["latency_ms"])
  header = (
    f"{'type':9} {'SavedModel':>11} {'ratio':>6} {'variables':>10} "
    f"{'ratio':>6} {'AUC':>8} {'dAUC':>8} {'max|dp|':>8}"
  )
  header += "".join(f" {'ms@' + b:>9} {'ratio':>6}" for b in sizes)
  lines = [f"{result['experiment']} ({result['checkpoint']})", header]
  for t, row in result["types"].items():
    line = (
      f"{t:9} {row['saved_model_bytes'] / 1e6:9.2f}MB "
      f"{row['saved_model_bytes'] / base['saved_model_bytes']:6.3f} "
      f"{row['variables_bytes'] / 1e6:8.2f}MB "
      f"{row['variables_bytes'] / base['variables_bytes']:6.3f} "
      f"{row['auc']:8.5f} {row['auc'] - base['auc']:+8.5f} "
      f"{row['max_prediction_difference']:8.1e}"
    )
    for b in sizes:
      ms = row["latency_ms"][b]["median"]
      line += f" {ms:9.3f} {ms / base['latency_ms'][b]['median']:6.3f}"
    lines.append(line)
  return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
  parser = cli.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
    "--experiment",
    default="dlrm_criteo_cpu_small",
    help="the Model Garden ranking experiment to train and export",
  )
  parser.add_argument(
    "--params_override", default="", help="as model_garden.ranking.train's"
  )
  parser.add_argument(
    "--model_dir",
    default="/tmp/tpe_quant",
    help="the training run (reused if it holds a checkpoint); the exports "
    "go to <model_dir>/quantized/<type>",
  )
  parser.add_argument(
    "--table_dtypes",
    default=",".join(TABLE_DTYPES),
    help="comma-separated table types (float32 is always the reference)",
  )
  parser.add_argument(
    "--batch_sizes",
    type=cli.positive_ints,
    default=[1, 512],
    help="serving batch sizes to time",
  )
  parser.add_argument(
    "--calls", default=200, type=int, help="calls per timed block at batch 1"
  )
  parser.add_argument(
    "--repeats", default=5, type=int, help="timed blocks per type and batch"
  )
  parser.add_argument("--json", default="", help="also write every number")
  return parser


def main(argv: list[str] | None = None) -> int:
  """Runs the report; a user's error is one line (exit 2 usage, 1 runtime)."""
  args = build_parser().parse_args(argv)
  tf.get_logger().setLevel("ERROR")
  try:
    result = cli.run(lambda: report(args))
  except SystemExit as e:
    return int(e.code or 0)
  print(describe(result))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
