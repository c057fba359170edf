"""A disk table's batched reads (``kernels.read_records``): the kernel's
pool of threads and the Python fallback read the same bytes as slicing
the file, in the order asked; a read past the end is an ``OSError``."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from tpu_embedding import kernels
from tpu_embedding.kernels import read_records

SIZE = 1 << 20


@pytest.fixture(name="path")
def _path(tmp_path):
  path = tmp_path / "records"
  path.write_bytes(np.random.default_rng(0).bytes(SIZE))
  return str(path)


@pytest.fixture(name="reader", params=["kernel", "python"])
def _reader(request, monkeypatch):
  if request.param == "kernel":
    if kernels.load() is None:
      pytest.skip("the kernels did not build here")
    assert read_records._kernel() is not None  # (the library has it)
  else:
    monkeypatch.setattr(read_records, "_kernel", lambda: None)
  return read_records.read_runs


@pytest.mark.parametrize("runs", [0, 1, 3, 500])
def test_runs_read_the_files_bytes_in_order(path, reader, runs):
  """More runs than the pool's threads, in any order, of any size (a
  page's edge crossed, a few bytes, a whole run of records)."""
  rng = np.random.default_rng(runs)
  sizes = rng.integers(1, 9000, runs)
  offsets = rng.integers(0, SIZE - sizes)
  whole = np.fromfile(path, np.uint8)
  pieces = [whole[o : o + s] for o, s in zip(offsets, sizes, strict=True)]
  want = np.concatenate(pieces) if runs else np.zeros(0, np.uint8)
  got = np.full(want.size, 7, np.uint8)
  fd = os.open(path, os.O_RDONLY)
  try:
    reader(fd, offsets.tolist(), sizes.tolist(), got)
  finally:
    os.close(fd)
  np.testing.assert_array_equal(got, want)


def test_a_read_past_the_end_fails(path, reader):
  got = np.zeros(201, np.uint8)
  fd = os.open(path, os.O_RDONLY)
  try:
    with pytest.raises(OSError) as raised:
      reader(fd, [0, SIZE - 100], [100, 100 + 1], got)
  finally:
    os.close(fd)
  assert raised.value.errno == errno.EIO


def test_a_failed_read_fails_with_its_errno(path, reader):
  fd = os.open(path, os.O_WRONLY)  # (not open for reading: EBADF)
  try:
    with pytest.raises(OSError) as raised:
      reader(fd, [0, 10], [4, 4], np.zeros(8, np.uint8))
  finally:
    os.close(fd)
  assert raised.value.errno == errno.EBADF
