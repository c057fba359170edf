"""Resident memory of a process, phase by phase, from ``/proc/<pid>``.

What a user sees of a process's memory is its resident set: ``VmRSS`` in
``/proc/<pid>/status`` now, ``VmHWM`` its high-water mark. Writing ``5`` to
``/proc/<pid>/clear_refs`` resets the high-water mark to the current
resident size (Linux >= 4.0), so the peak of each phase is visible on its
own. A ``Meter`` takes a baseline (``VmRSS``) once, then for each phase
resets the mark at the start and reads ``VmHWM`` at the end: the phase's
*peak growth* is ``VmHWM(end of phase) - baseline``, i.e. the most memory
the process held above the baseline at any moment of the phase, including
what earlier phases left resident.

The same meter works on this process (``pid="self"``) and from outside on
a child of the same user (``pid=1234``).

Example:
  >>> meter = Meter()  # baseline: this process's resident size now
  >>> inherited = meter.begin()
  >>> block = bytearray(64 * 2**20)  # 64 MiB, touched
  >>> meter.end() >= 60 * 2**20
  True
"""

from __future__ import annotations

import re

_FIELD = re.compile(r"^(Vm\w+):\s+(\d+) kB$", re.MULTILINE)


def status(pid: int | str = "self") -> dict[str, int]:
  """``{field: bytes}`` of the ``Vm*`` lines of ``/proc/<pid>/status``.

  Raises:
    OSError: if the process does not exist (or is not readable).
  """
  with open(f"/proc/{pid}/status") as f:
    text = f.read()
  return {name: int(kib) * 1024 for name, kib in _FIELD.findall(text)}


def resident(pid: int | str = "self") -> int:
  """The resident set size (``VmRSS``) in bytes."""
  return status(pid)["VmRSS"]


def peak(pid: int | str = "self") -> int:
  """The resident high-water mark (``VmHWM``) in bytes."""
  return status(pid)["VmHWM"]


def reset_peak(pid: int | str = "self") -> None:
  """Resets ``VmHWM`` to the current ``VmRSS`` (``clear_refs`` ``5``)."""
  with open(f"/proc/{pid}/clear_refs", "w") as f:
    f.write("5")


class Meter:
  """Peak resident growth of one process over a fixed baseline, by phase.

  Attributes:
    pid: the process measured (``"self"`` or a pid).
    baseline: ``VmRSS`` in bytes when the meter was created.
  """

  def __init__(self, pid: int | str = "self"):
    self.pid = pid
    self.baseline = resident(pid)

  def begin(self) -> int:
    """Starts a phase: resets the high-water mark.

    Returns:
      The resident growth over the baseline now, in bytes: what the phase
      inherits from earlier ones.
    """
    reset_peak(self.pid)
    return resident(self.pid) - self.baseline

  def end(self) -> int:
    """Ends a phase: its peak growth over the baseline, in bytes."""
    return peak(self.pid) - self.baseline
