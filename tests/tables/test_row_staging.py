"""Rows read ahead from a disk table's file (``row_staging``), through
``RowCache``: a row written after it was read ahead is never taken from
RAM; a restore drops every read ahead; a failed read ahead is read again.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tpu_embedding.tables import row_staging
from tpu_embedding.tables.row_cache import RowCache

ROWS, DIM, GRID = 100, 2, 10


def _initial(key, first, count):
  """Row ``r``'s initial value: ``r`` (the slot: ``r + 1000``)."""
  shift = 0 if key == "parameters" else 1000
  rows = np.arange(first, first + count, dtype=np.float32) + shift
  return np.repeat(rows[:, None], DIM, axis=1)


def _cache(tmp_path, slots=4):
  keys = ("parameters", "accumulator")
  return RowCache(str(tmp_path), ROWS, DIM, slots, keys, GRID, _initial)


def _values(rows, plus):
  rows = np.asarray(rows, np.float32)[:, None] + plus
  return [np.repeat(rows, DIM, axis=1), np.repeat(rows + 1000, DIM, axis=1)]


def _load(cache, rows):
  """Admits ``rows`` and loads them, as a step does: their values."""
  admitted = cache.admit(np.asarray(rows, np.int64))
  assert admitted.load_rows.tolist() == list(rows)
  return [v[:, 0].tolist() for v in cache.load(admitted.load_rows)]


def test_rows_read_ahead_are_taken_from_ram(tmp_path):
  cache = _cache(tmp_path)
  cache.stored(np.arange(ROWS))  # (every grid block on disk)
  cache.prefetch(np.array([7, 3, 3, -1, 500]))  # (out of range: skipped)
  assert _load(cache, [3, 7]) == [[3, 7], [1003, 1007]]
  assert cache.staging.taken == 2
  assert _load(cache, [9]) == [[9], [1009]]  # (not read ahead: the file)
  assert cache.staging.taken == 2


def test_rows_a_current_read_ahead_holds_are_read_once(tmp_path, monkeypatch):
  """Two coming batches share rows (``data.prefetch_rows`` reads two
  batches ahead): the second read ahead reads only the rows the first
  does not hold, or holds stale (written since); both steps take theirs
  from RAM."""
  cache = _cache(tmp_path, slots=8)
  cache.stored(np.arange(ROWS))
  read = []
  files_read = cache.files.read

  def reading(rows):
    if rows.size:  # (rows the disk reads)
      read.append(rows.tolist())
    return files_read(rows)

  monkeypatch.setattr(cache.files, "read", reading)
  cache.prefetch(np.array([3, 7, 8]))
  cache.staging.take(np.array([3]))  # (the read is done)
  cache.write_back(np.array([8]), _values([8], 0.5))  # (8's copy: stale)
  cache.wait()
  assert cache.staging.held(np.array([3, 7, 8, 9])).tolist() == [
    True, True, False, False,
  ]  # fmt: skip
  cache.prefetch(np.array([7, 8, 9]))
  cache.staging.take(np.array([9]))  # (the second read is done)
  assert read == [[3, 7, 8], [8, 9]]
  assert _load(cache, [3, 7]) == [[3, 7], [1003, 1007]]
  assert _load(cache, [8, 9]) == [[8.5, 9], [1008.5, 1009]]
  assert cache.staging.taken == 2 + 4  # (3 and 9 above, then 3, 7, 8, 9)
  assert read == [[3, 7, 8], [8, 9]]  # (nothing read by the steps)


@pytest.mark.parametrize("finished", [True, False])
def test_a_row_written_after_its_read_ahead_is_read_again(tmp_path, finished):
  """Written back after the read ahead (the write done or still in
  flight when the step loads it): the step gets the written values."""
  cache = _cache(tmp_path)
  cache.stored(np.arange(ROWS))
  cache.prefetch(np.array([5, 6]))
  cache.staging.take(np.array([5, 6]))  # (the reads are done)
  cache.write_back(np.array([5]), _values([5], 0.5))
  if finished:
    cache.wait()
  assert _load(cache, [5, 6]) == [[5.5, 6], [1005.5, 1006]]
  assert cache.staging.taken == 3  # (5 and 6 above, then 6)


def test_a_row_in_flight_when_read_ahead_is_not_staged(tmp_path, monkeypatch):
  """Its write-back still writing when the read ahead starts (the file
  holds the old values then): the step gets the written values."""
  cache = _cache(tmp_path)
  cache.stored(np.arange(ROWS))
  release = threading.Event()
  write = cache.files.write
  monkeypatch.setattr(
    cache.files, "write", lambda *a: (release.wait(10), write(*a))
  )
  cache.write_back(np.array([4]), _values([4], 0.25))
  cache.prefetch(np.array([4, 6]))
  cache.staging.take(np.array([6]))  # (the read ahead is done)
  release.set()
  cache.wait()
  assert _load(cache, [4]) == [[4.25], [1004.25]]
  assert cache.staging.taken == 1  # (6 above)


def test_a_restore_drops_every_read_ahead(tmp_path):
  cache = _cache(tmp_path)
  cache.stored(np.arange(ROWS))
  cache.prefetch(np.array([1, 2]))
  cache.write_window("parameters", 0, np.full([GRID, DIM], -1, np.float32))
  cache.write_rows("accumulator", np.array([2]), np.full([1, DIM], 9, "f4"))
  assert _load(cache, [1, 2]) == [[-1, -1], [1001, 9]]
  assert cache.staging.taken == 0


def test_a_failed_read_ahead_is_read_by_the_step(tmp_path, monkeypatch):
  cache = _cache(tmp_path)
  cache.stored(np.arange(ROWS))

  def fails(rows):
    raise OSError("the disk went away for a moment")

  monkeypatch.setattr(cache.staging, "_files", _Failing(cache.files, fails))
  cache.prefetch(np.array([8]))
  assert _load(cache, [8]) == [[8], [1008]]
  assert cache.staging.taken == 0


class _Failing:
  """``files`` whose reads ``fail``."""

  def __init__(self, files, fail):
    self.dim, self.keys, self.read = files.dim, files.keys, fail


def test_the_sets_kept_are_bounded(tmp_path):
  cache = _cache(tmp_path)
  cache.stored(np.arange(ROWS))
  for row in range(row_staging.SETS + 2):
    cache.prefetch(np.array([row]))
  assert _load(cache, [0, row]) == [[0, row], [1000, 1000 + row]]
  assert cache.staging.taken == 1  # (row 0's set is gone)


def test_a_row_read_again_as_its_read_ahead_leaves_is_kept(tmp_path):
  """With every set in use, a row held only by the oldest (which leaves
  at the next read ahead) is read again into the new set, and the
  oldest's leaving keeps the new copy."""
  cache = _cache(tmp_path)
  cache.stored(np.arange(ROWS))
  for row in range(row_staging.SETS):
    cache.prefetch(np.array([row]))  # (row 0's set is the oldest)
  cache.prefetch(np.array([0, 50]))
  assert _load(cache, [0, 50]) == [[0, 50], [1000, 1050]]
  assert cache.staging.taken == 2


def test_a_failed_write_back_keeps_failing_and_serving_its_rows(
  tmp_path, monkeypatch
):
  """A write-back whose file write fails (after one that succeeded): every
  later load raises the disk's error, not another, until the write is
  given up; the rows of the write that succeeded come from the file."""
  cache = _cache(tmp_path)
  cache.stored(np.arange(ROWS))
  write = cache.files.write

  def full_for_row_2(rows, values):
    if 2 in rows.tolist():
      raise OSError(28, "No space left on device")
    write(rows, values)

  monkeypatch.setattr(cache.files, "write", full_for_row_2)
  cache.write_back(np.array([1]), _values([1], 0.5))
  cache.write_back(np.array([2]), _values([2], 0.5))
  for _ in range(2):
    with pytest.raises(OSError, match="No space left"):
      cache.wait()
  assert cache.staging.take(np.array([2]))[0].tolist() == [True]
  assert cache.files.read(np.array([1]))[0][:, 0].tolist() == [1.5]
