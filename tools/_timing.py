"""Repeated timings for the benchmark tools: median, spread, JSON.

Not a tool itself: ``tools/benchmark.py``, ``input_benchmark.py`` and
``pipelining_benchmark.py`` import it (it sits next to them). Each
measurement runs ``repeats`` times; the report gives the median, the
range and the spread (range over median), so that a reader can tell a
real difference from noise, and ``--json`` writes every repeat.

Example:
  >>> import _timing
  >>> m = _timing.Measurement("step", "ms/step", [10.0, 12.0, 11.0])
  >>> m.median, round(m.spread, 3)
  (11.0, 0.182)
  >>> m.describe("{:.1f}")
  '11.0 ms/step (median of 3; 10.0-12.0, spread 18.2%)'
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Measurement:
  """One quantity measured several times.

  Attributes:
    name: what was measured (a JSON key).
    unit: e.g. ``"examples/s"``.
    values: one value per repeat, in order.
  """

  name: str
  unit: str
  values: list[float]

  @property
  def median(self) -> float:
    return statistics.median(self.values)

  @property
  def spread(self) -> float:
    """``(max - min) / median`` (0 with one repeat)."""
    return (max(self.values) - min(self.values)) / self.median

  def describe(self, number: str = "{:,.0f}") -> str:
    """``"12,345 examples/s (median of 3; 12,000-12,600, spread 4.9%)"``."""
    low, high = number.format(min(self.values)), number.format(max(self.values))
    return (
      f"{number.format(self.median)} {self.unit} (median of "
      f"{len(self.values)}; {low}-{high}, spread {self.spread:.1%})"
    )

  def to_json(self) -> dict[str, Any]:
    return {
      "unit": self.unit,
      "median": self.median,
      "min": min(self.values),
      "max": max(self.values),
      "spread": self.spread,
      "values": self.values,
    }


def repeat(
  name: str, unit: str, measure: Callable[[], float], repeats: int
) -> Measurement:
  """Calls ``measure()`` ``repeats`` times.

  Example:
    >>> import _timing
    >>> _timing.repeat("x", "s", lambda: 2.0, 3).values
    [2.0, 2.0, 2.0]
  """
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}.")
  return Measurement(name, unit, [float(measure()) for _ in range(repeats)])


def per_repeat_ratio(
  name: str, numerators: list[float], denominators: list[float]
) -> Measurement:
  """The ratio of two measurements taken in turn, repeat by repeat.

  The machine's speed drifts over a run: a ratio taken within each repeat
  compares like with like, where a ratio of medians need not.

  Example:
    >>> import _timing
    >>> _timing.per_repeat_ratio("r", [2.0, 3.0], [1.0, 2.0]).values
    [2.0, 1.5]
  """
  return Measurement(
    name,
    "x",
    [n / d for n, d in zip(numerators, denominators, strict=True)],
  )


def examples_per_second(step, batches, args) -> float:
  """Examples per second of ``step`` cycling through ``batches``.

  ``args.warmup`` untimed calls first, then ``args.steps`` timed ones
  (``args.batch_size`` examples each), waited for once at the end.
  """
  for i in range(args.warmup):
    step(batches[i % len(batches)]).numpy()
  start = time.perf_counter()
  for i in range(args.steps):
    loss = step(batches[i % len(batches)])
  loss.numpy()
  return args.steps * args.batch_size / (time.perf_counter() - start)


def write_json(
  path: str, settings: dict[str, Any], measurements: list[Measurement]
) -> None:
  """Writes the settings and every measurement (all repeats) to ``path``."""
  result = {
    "settings": settings,
    "machine": {
      "python": platform.python_version(),
      "processor": platform.processor() or platform.machine(),
      "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    },
    "measurements": {m.name: m.to_json() for m in measurements},
  }
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
