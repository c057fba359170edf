"""Figures of the benchmark tools (matplotlib, drawn to PNG files).

Not a tool itself: ``tools/benchmark.py --plot FILE`` imports it.

Example:
  >>> import argparse
  >>> title(argparse.Namespace(tables=26, rows=200_000, dim=64,
  ...                          batch_size=4096, sweep_tables=8))
  'batch 4096, width 64, Adagrad (26 x 200,000 rows; size sweep: 8 tables)'
"""

from __future__ import annotations

from typing import Any


def title(args: Any) -> str:
  return (
    f"batch {args.batch_size}, width {args.dim}, Adagrad "
    f"({args.tables} x {args.rows:,} rows; size sweep: "
    f"{args.sweep_tables} tables)"
  )


def benchmark_figure(
  path: str,
  dists: list[dict] | None,
  rows: list[dict] | None,
  title: str = "",
) -> None:
  """Examples/s of ours, Keras and the floor: by id distribution (bars)
  and by table size (lines), log scale."""
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  panels = [p for p in (dists, rows) if p]
  if not panels:
    raise ValueError("--plot needs --sweep dist, rows or all.")
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5))
  axes = [axes] if len(panels) == 1 else list(axes)
  series = [
    ("ours", "tpu_embedding", "tab:blue"),
    ("keras", "Keras Embedding + Adagrad", "tab:orange"),
    ("floor", "memory floor (membench)", "tab:gray"),
  ]
  if dists:
    ax = axes.pop(0)
    width = 0.27
    for k, (key, label, color) in enumerate(series):
      values = [_value(r, key) for r in dists]
      if all(v is None for v in values):
        continue
      xs = [i + (k - 1) * width for i in range(len(dists))]
      ax.bar(xs, [v or 0 for v in values], width, label=label, color=color)
    ax.set_xticks(range(len(dists)), [r["label"] for r in dists])
    ax.set_yscale("log")
    ax.set_ylabel("examples / s")
    ax.set_title(f"by id distribution ({dists[0]['tables']} tables)")
    ax.legend()
  if rows:
    ax = axes.pop(0)
    sizes = [r["rows"] for r in rows]
    for key, label, color in series:
      values = [_value(r, key) for r in rows]
      if all(v is None for v in values):
        continue
      ax.plot(sizes, values, "o-", label=label, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rows per table")
    ax.set_ylabel("examples / s")
    ax.set_title(f"by table size ({rows[0]['tables']} tables)")
    ax.legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _value(result: dict, key: str) -> float | None:
  value = result.get(key)
  return getattr(value, "median", value)
