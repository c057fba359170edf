"""The memory floor of the benchmark step, from a membench JSON.

Not a tool itself: ``tools/benchmark.py --membench FILE`` imports it. A
step that deduplicates its ids must at least gather its ``U`` distinct rows
and read-modify-write them with their Adagrad slot, at the random-row rates
this machine reaches in DRAM (membench's largest table); and per id
occurrence (``N`` of them) write its row into its bag's activation and add
its bag's gradient into its distinct row's sum, both from cache-resident
rows (membench's smallest table: run it with ``--extra <dim>:0.001``)::

  floor = batch / (U / R_gather + U / R_adagrad
                   + N / R_gather_cached + N / R_scatter_cached)

with ``U`` the expected distinct ids of each feature (``tables`` features
of ``batch`` ids each, or ``batch * hotness`` for a multi-hot feature),
summed, and ``N = batch * ids per example``. The rates are read from
``../shared/membench/membench.py``'s JSON (nothing of membench is copied).
Id hashing and the dense part are left out: an upper bound.

Example:
  >>> round(expected_unique("uniform", 1000, 1000, 1.05))
  632
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Rates:
  """Random-row rates (rows/s) of one width and id distribution.

  Attributes:
    gather, adagrad: a DRAM-sized table's gathers and Adagrad updates.
    cached_gather, cached_scatter: a cache-resident table's gathers and
      scatter-adds.
    pages: the pages membench measured them on: ``thp`` (transparent huge
      pages, as the kernels back tables) or ``4k``.
  """

  gather: float
  adagrad: float
  cached_gather: float
  cached_scatter: float
  pages: str = "4k"


def rates(path: str, dim: int, dist: str) -> Rates:
  """This machine's rates: membench's C implementation, 2 threads, width
  ``dim``, ids ``uniform`` or ``zipf`` (medians) on its largest table, and
  uniform ids on its smallest; on transparent huge pages where the file
  has them at that width (the kernels back tables with them, and their
  rates are 1.4-1.6x the 4 KiB ones here), else on 4 KiB pages.

  Raises:
    ValueError: naming what the JSON lacks (and the membench run that
      measures it).
  """
  with open(path, encoding="utf-8") as f:
    try:
      data = json.load(f)
    except ValueError as error:
      raise ValueError(
        f"{path} is not JSON ({error}): expected the file membench.py "
        "--json writes."
      ) from None
  listed = data.get("results") if isinstance(data, dict) else None
  if not isinstance(listed, list) or not all(
    isinstance(r, dict) for r in listed
  ):
    raise ValueError(
      f"{path} has no 'results' list of measurements: expected the file "
      "membench.py --json writes."
    )
  ours = [
    r
    for r in listed
    if r.get("impl") == "c" and r.get("threads") == 2 and r.get("dim") == dim
  ]
  pages = "thp" if any(r.get("pages") == "thp" for r in ours) else "4k"
  results = [r for r in ours if r.get("pages") == pages]
  sizes = sorted({r.get("rows", 0) for r in results})
  if len(sizes) < 2:
    raise ValueError(
      f"{path} has no cache-resident table at dim {dim} next to the DRAM "
      f"one on {pages} pages (run membench.py --threads 2 --dims {dim} "
      f"--pages thp --only stream,tables --extra {dim}:0.001)."
    )

  def rate(rows: int, ids: str, **match: Any) -> float:
    found = [
      r["mrows"]
      for r in results
      if r.get("rows", 0) == rows
      and r.get("dist") == ids
      and all(r.get(k) == v for k, v in match.items())
    ]
    if not found:
      raise ValueError(
        f"{path} has no membench rate for {match} at dim {dim}, {rows:,} "
        f"rows, ids {ids}, {pages} pages (run membench.py --threads 2 "
        f"--dims {dim} --pages thp --only stream,tables --extra {dim}:0.001)."
      )
    return statistics.median(found) * 1e6

  big, small = sizes[-1], sizes[0]
  return Rates(
    gather=rate(big, dist, bench="gather"),
    adagrad=rate(big, dist, bench="opt", op="adagrad"),
    cached_gather=rate(small, "uniform", bench="gather"),
    cached_scatter=rate(small, "uniform", bench="scatter"),
    pages=pages,
  )


def floor(r: Rates, batch: int, unique_rows: float, occurrences: int) -> float:
  """The floor in examples/s for ``unique_rows`` distinct rows and
  ``occurrences`` ids a step, at rates ``r`` (``rates``)."""
  seconds = (
    unique_rows / r.gather
    + unique_rows / r.adagrad
    + occurrences / r.cached_gather
    + occurrences / r.cached_scatter
  )
  return batch / seconds
