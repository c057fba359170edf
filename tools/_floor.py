"""The memory floor of the benchmark step, from a membench JSON.

Not a tool itself: ``tools/benchmark.py --membench FILE`` imports it. A
step that deduplicates its ids must at least gather its ``U`` distinct rows
and read-modify-write them with their Adagrad slot, at the random-row rates
this machine reaches (measured by ``../shared/membench/membench.py``,
whose JSON is read here; nothing of membench is copied)::

  floor = batch / (U / R_gather + U / R_adagrad)   examples/s

with ``U = tables * E[distinct ids among batch draws]``. Id processing,
combiners and the dense part are left out: an upper bound.

Example:
  >>> round(expected_unique("uniform", 1000, 1000, 1.05))
  632
"""

from __future__ import annotations

import json
import statistics
from typing import Any

import numpy as np


def expected_unique(dist: str, rows: int, draws: int, exponent: float) -> float:
  """E[number of distinct ids] among ``draws`` ids over ``rows`` rows.

  ``uniform`` or the truncated ``zipf`` (rank ``r`` with probability
  proportional to ``r**-exponent``).
  """
  if dist == "uniform":
    return float(rows * -np.expm1(draws * np.log1p(-1.0 / rows)))
  p = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
  p /= p.sum()
  return float(np.sum(-np.expm1(draws * np.log1p(-p))))


def rates(path: str, dim: int, dist: str) -> tuple[float, float]:
  """``(gather, adagrad)`` rows/s: membench's C implementation, 2 threads,
  4 KiB pages, width ``dim``, ids ``uniform`` or ``zipf`` (medians)."""
  with open(path, encoding="utf-8") as f:
    results = json.load(f)["results"]

  def rate(**match: Any) -> float:
    found = [
      r["mrows"]
      for r in results
      if r.get("impl") == "c"
      and r.get("pages") == "4k"
      and r.get("threads") == 2
      and r.get("dim") == dim
      and r.get("dist") == dist
      and all(r.get(k) == v for k, v in match.items())
    ]
    if not found:
      raise ValueError(
        f"{path} has no membench rate for {match} at dim {dim}, ids {dist} "
        "(run membench.py --threads 2 --dims <dim> --pages 4k)."
      )
    return statistics.median(found) * 1e6

  return rate(bench="gather"), rate(bench="opt", op="adagrad")


def floor(
  path: str, batch: int, unique_rows: float, dim: int, dist: str
) -> float:
  """The floor in examples/s for ``unique_rows`` distinct rows a step."""
  gather, adagrad = rates(path, dim, "uniform" if dist == "uniform" else "zipf")
  return batch / (unique_rows / gather + unique_rows / adagrad)
