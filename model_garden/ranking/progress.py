"""Training progress: a Keras progress bar, log lines and examples/s.

``Progress`` shows a ``keras.utils.Progbar`` on an interactive terminal
(one summary line at the end otherwise) and prints a log line every
``log_steps`` steps with the loss, the training metrics and the
throughput over that interval. ``Throughput`` measures examples/s,
leaving out the first steps of a run (they include tracing).

Example:
  >>> from model_garden.ranking.progress import Throughput
  >>> meter = Throughput(batch_size=100, skip_steps=1)
  >>> meter.record(step=0, now=0.0)
  >>> meter.record(step=1, now=10.0)  # the first step (tracing) is skipped
  >>> meter.record(step=3, now=11.0)
  >>> meter.examples_per_second()
  200.0
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TextIO

import keras


class Throughput:
  """Examples per second between recorded steps.

  Args:
    batch_size: examples per step (global).
    skip_steps: records after the first that are left out: the clock
      starts at record ``skip_steps + 1``.

  Example:
    >>> from model_garden.ranking.progress import Throughput
    >>> meter = Throughput(batch_size=10)
    >>> meter.record(step=0, now=0.0); meter.record(step=5, now=2.0)
    >>> meter.interval_examples_per_second()
    25.0
  """

  def __init__(self, batch_size: int, skip_steps: int = 0):
    self.batch_size = batch_size
    self.skip_steps = skip_steps
    self._recorded = 0
    self._first: tuple[int, float] | None = None
    self._last: tuple[int, float] | None = None
    self._interval_rate: float | None = None

  def record(self, step: int, now: float | None = None) -> None:
    """Notes that ``step`` steps are done at time ``now``."""
    now = time.perf_counter() if now is None else now
    self._recorded += 1
    if self._last is not None and step > self._last[0]:
      self._interval_rate = (
        (step - self._last[0]) * self.batch_size / (now - self._last[1])
      )
    if self._recorded > self.skip_steps and self._first is None:
      self._first = (step, now)
    self._last = (step, now)

  def interval_examples_per_second(self) -> float | None:
    """Throughput between the last two records."""
    return self._interval_rate

  def examples_per_second(self) -> float | None:
    """Throughput since the first counted record (None: too early)."""
    if self._first is None or self._last is None:
      return None
    steps = self._last[0] - self._first[0]
    seconds = self._last[1] - self._first[1]
    if steps <= 0 or seconds <= 0:
      return None
    return steps * self.batch_size / seconds


def format_metrics(metrics: Mapping[str, float]) -> str:
  """``"auc 0.7012  loss 0.4510"``.

  Example:
    >>> from model_garden.ranking.progress import format_metrics
    >>> format_metrics({"auc": 0.70123, "loss": 0.5})
    'auc 0.7012  loss 0.5000'
  """
  return "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())


class Progress:
  """A progress bar plus a log line every ``log_steps`` steps.

  Args:
    target: the last step of this stretch of training.
    initial: the step training starts from (a resumed run).
    batch_size: global examples per step.
    log_steps: steps between log lines.
    stream: where log lines go (default stdout).
    bar: ``True``/``False`` forces the progress bar on/off; None shows it
      on an interactive terminal only.
    total: the run's last step when this stretch stops before it, for a
      validation (``train_and_eval``): lines read ``step 250/600
      (validation at 300)``, never ``250/300``.

  Example:
    >>> import io
    >>> from model_garden.ranking.progress import Progress
    >>> out = io.StringIO()
    >>> progress = Progress(target=4, batch_size=8, log_steps=2, stream=out,
    ...                     bar=False)
    >>> for step in range(1, 5):
    ...   _ = progress.update(step, loss=0.5, metrics={"auc": 0.6})
    >>> out.getvalue().splitlines()[0].startswith("step      2/4")
    True
    >>> out = io.StringIO()
    >>> progress = Progress(target=300, initial=200, total=600, log_steps=50,
    ...                     stream=out, bar=False)
    >>> progress.update(250, loss=0.5)[:36]
    'step    250/600 (validation at 300) '
  """

  def __init__(
    self,
    target: int,
    initial: int = 0,
    batch_size: int = 1,
    log_steps: int = 100,
    stream: TextIO | None = None,
    bar: bool | None = None,
    total: int | None = None,
  ):
    self.target = target
    self.total = target if total is None else max(total, target)
    self.log_steps = max(1, log_steps)
    self.stream = stream or sys.stdout
    if bar is None:
      bar = hasattr(self.stream, "isatty") and self.stream.isatty()
    self.throughput = Throughput(batch_size, skip_steps=1)
    self.throughput.record(initial)
    self._log_meter = Throughput(batch_size)
    self._log_meter.record(initial)
    self._bar = None
    if bar and target > initial:
      self._bar = keras.utils.Progbar(
        self.total,
        stateful_metrics=["loss", "auc", "examples/s"],
        unit_name="step",
        interval=0.5,
      )
      self._bar.update(initial)

  def update(
    self,
    step: int,
    loss: float,
    metrics: Mapping[str, float] | None = None,
  ) -> str | None:
    """Records ``step``; returns the log line when one is due.

    Args:
      step: the steps done.
      loss: this step's loss.
      metrics: the training metrics so far (shown with the log line).
    """
    self.throughput.record(step)
    rate = self.throughput.interval_examples_per_second()
    if self._bar is not None:
      values = [("loss", loss)]
      if metrics and "auc" in metrics:
        values.append(("auc", metrics["auc"]))
      if rate:
        values.append(("examples/s", rate))
      self._bar.update(step, values)
    if step % self.log_steps and step != self.target:
      return None
    self._log_meter.record(step)
    interval_rate = self._log_meter.interval_examples_per_second()
    line = f"step {step:6d}/{self.total}"
    if self.target < self.total:
      line += f" (validation at {self.target})"
    line += f"  loss {loss:.4f}"
    if metrics:
      line += "  " + format_metrics(
        {k: v for k, v in metrics.items() if k != "loss"}
      )
    if interval_rate:
      line += f"  {interval_rate:,.0f} examples/s"
    if self._bar is not None:
      self.stream.write("\n")
    self.stream.write(line + "\n")
    self.stream.flush()
    return line
