"""The log of row records behind a disk-tiered table (``row_files``).

Random writes, rewrites and reads against a dict of rows (the oracle),
across many segment cleanings; the file stays within its space bound; a
writer thread appending while the main thread reads.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from tpu_embedding.tables import row_files
from tpu_embedding.tables.row_files import RowFiles

ROWS, DIM, KEYS = 3000, 3, ("parameters", "accumulator")


def _values(rng, count):
  return [rng.standard_normal([count, DIM]).astype(np.float32) for _ in KEYS]


@pytest.mark.parametrize("hot", [0.02, 1.0])
def test_rewrites_read_back_and_the_file_stays_bounded(
  tmp_path, hot, monkeypatch
):
  """Rows written again and again (a hot few, or all alike) read back
  their last values; the cleaner keeps the file within ``SPACE`` times
  the rows written (plus three segments, of 64 records here so that it
  cleans many, and the largest write)."""
  monkeypatch.setattr(row_files, "SEGMENT_RECORDS", 64)
  rng = np.random.default_rng(0)
  files = RowFiles(str(tmp_path), ROWS, DIM, KEYS)
  oracle: dict[int, list[np.ndarray]] = {}
  written_rows = 0
  for step in range(400):
    pool = int(ROWS * hot) if step > 20 else ROWS
    size = min(pool, int(rng.integers(1, 300)))
    rows = rng.choice(pool, size=size, replace=False)
    values = _values(rng, rows.size)
    files.write(rows, values)
    for i, row in enumerate(rows.tolist()):
      oracle[row] = [v[i].copy() for v in values]
    written_rows += rows.size
    asked = rng.choice(sorted(oracle), size=50)
    got = files.read(asked)
    for k in range(len(KEYS)):
      want = np.stack([oracle[r][k] for r in asked.tolist()])
      np.testing.assert_array_equal(got[k], want)
  # Records: SPACE x live, the tail, two segments and the largest write.
  bound = row_files.SPACE * len(oracle) + 3 * 64 + 300
  assert written_rows > 5 * bound  # (many segments cleaned)
  size = os.path.getsize(tmp_path / "rows.records")
  assert size <= bound * (8 + DIM * 4 * len(KEYS))
  everything = files.read(np.array(sorted(oracle)))[1]
  np.testing.assert_array_equal(
    everything, np.stack([oracle[r][1] for r in sorted(oracle)])
  )


def test_a_row_never_written_is_refused(tmp_path):
  files = RowFiles(str(tmp_path), ROWS, DIM, KEYS)
  files.write(np.array([1]), _values(np.random.default_rng(1), 1))
  with pytest.raises(AssertionError, match="never written"):
    files.read(np.array([1, 2]))


def test_write_range_keeps_the_other_keys(tmp_path):
  files = RowFiles(str(tmp_path), ROWS, DIM, KEYS)
  first = _values(np.random.default_rng(2), 10)
  files.write(np.arange(5, 15), first)
  files.write_range(7, {"accumulator": np.full([3, DIM], 9, np.float32)})
  parameters, accumulators = files.read(np.arange(5, 15))
  np.testing.assert_array_equal(parameters, first[0])
  np.testing.assert_array_equal(accumulators[2:5], np.full([3, DIM], 9))
  np.testing.assert_array_equal(accumulators[:2], first[1][:2])


def test_reads_beside_a_writing_thread(tmp_path, monkeypatch):
  """A thread writes rows again and again (the same values each time:
  row ``r`` holds ``r``), so the cleaner moves records and reuses
  segments all along, while the main thread reads: every read is right."""
  monkeypatch.setattr(row_files, "SEGMENT_RECORDS", 64)
  files = RowFiles(str(tmp_path), ROWS, DIM, KEYS)

  def values(rows):
    held = np.repeat(rows.astype(np.float32)[:, None], DIM, 1)
    return [held, -held]

  files.write(np.arange(ROWS), values(np.arange(ROWS)))
  stop = threading.Event()

  def writer():
    own = np.random.default_rng(4)
    while not stop.is_set():
      rows = own.choice(ROWS, 200, replace=False)
      files.write(rows, values(rows))

  thread = threading.Thread(target=writer)
  thread.start()
  rng = np.random.default_rng(3)
  try:
    for _ in range(300):
      asked = rng.choice(ROWS, 100, replace=False)
      got = files.read(asked)
      np.testing.assert_array_equal(got[0], values(asked)[0])
      np.testing.assert_array_equal(got[1], values(asked)[1])
  finally:
    stop.set()
    thread.join()
