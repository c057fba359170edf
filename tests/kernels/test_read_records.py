"""A disk table's batched reads (``kernels.read_records``): the kernel's
pool of threads (through the page cache and past it, ``O_DIRECT``) and
the Python fallback read the same bytes as slicing the file, in the order
asked; a read past the end is an ``OSError``; direct reads leave nothing
in the page cache."""

from __future__ import annotations

import errno
import functools
import os
import subprocess

import numpy as np
import pytest

from tpu_embedding import kernels
from tpu_embedding.kernels import read_records

SIZE = 1 << 22


@pytest.fixture(name="path")
def _path(tmp_path):
  path = tmp_path / "records"
  path.write_bytes(np.random.default_rng(0).bytes(SIZE))
  return str(path)


@pytest.fixture(
  name="reader", params=["kernel", "direct-ring", "direct-pool", "python"]
)
def _reader(request, monkeypatch, path):
  if request.param == "python":
    monkeypatch.setattr(read_records, "_kernel", lambda: None)
    return read_records.read_runs
  if kernels.load() is None:
    pytest.skip("the kernels did not build here")
  assert read_records._kernel() is not None  # (the library has it)
  if request.param == "kernel":
    return read_records.read_runs
  monkeypatch.setattr(read_records, "USE_RING", request.param == "direct-ring")
  if request.param == "direct-ring" and not read_records.ring_ready():
    pytest.skip("the kernel refuses io_uring here (the pool reads instead)")
  direct = read_records.open_direct(path)
  if direct < 0:
    pytest.skip("this file system refuses O_DIRECT")
  request.addfinalizer(lambda: os.close(direct))
  return functools.partial(read_records.read_runs, direct_fd=direct)


@pytest.mark.parametrize("runs", [0, 1, 3, 500])
def test_runs_read_the_files_bytes_in_order(path, reader, runs):
  """More runs than the pool's threads and the ring's entries, in any
  order, of any size (a page's edge crossed, a few bytes, a whole run of
  records, more than a bounce buffer)."""
  rng = np.random.default_rng(runs)
  sizes = rng.integers(1, 9000, runs)
  sizes[: runs // 100] = 3 * 2**20 // 2  # (bounce buffers of 1 MiB)
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
  """Neither descriptor open for reading: EBADF (a direct read that fails
  is tried again through the page cache, and that failure is raised)."""
  fd = os.open(path, os.O_WRONLY)
  try:
    direct = os.open(path, os.O_WRONLY | os.O_DIRECT)
  except OSError:  # (a file system without O_DIRECT)
    direct = os.dup(fd)
  try:
    with pytest.raises(OSError) as raised:
      reader(fd, [0, 10], [4, 4], np.zeros(8, np.uint8), direct_fd=direct)
  finally:
    os.close(fd)
    os.close(direct)
  assert raised.value.errno == errno.EBADF


@pytest.mark.parametrize("ring", [True, False])
def test_direct_reads_leave_the_page_cache_empty(path, ring, monkeypatch):
  """Scattered reads past the page cache: the file's pages stay out of it
  (``mincore``), where buffered reads of the same runs bring them in."""
  if kernels.load() is None:
    pytest.skip("the kernels did not build here")
  monkeypatch.setattr(read_records, "USE_RING", ring)
  if ring and not read_records.ring_ready():
    pytest.skip("the kernel refuses io_uring here (the pool reads instead)")
  rng = np.random.default_rng(1)
  offsets = (rng.permutation(SIZE // 4096)[:64] * 4096 + 100).tolist()
  sizes = [512] * len(offsets)
  got = np.zeros(512 * len(offsets), np.uint8)
  fd = os.open(path, os.O_RDONLY)
  direct = read_records.open_direct(path)
  if direct < 0:
    os.close(fd)
    pytest.skip("this file system refuses O_DIRECT")
  try:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    read_records.read_runs(fd, offsets, sizes, got, direct_fd=direct)
    assert _cached_pages(path) == 0
    read_records.read_runs(fd, offsets, sizes, got)
    assert _cached_pages(path) >= len(offsets)  # (buffered: they come in)
  finally:
    os.close(fd)
    os.close(direct)


def _cached_pages(path: str) -> int:
  """Pages of the file at ``path`` in the page cache (util-linux's
  ``fincore``)."""
  out = subprocess.run(
    ["fincore", "--raw", "--noheadings", "--output", "PAGES", path],
    check=True,
    capture_output=True,
    text=True,
  ).stdout
  return int(out.split()[0])


def test_a_forked_child_reads_through_its_own_ring(path):
  """A child forked after its parent read through a ring sets up its own:
  the parent's is memory both would share, and their reads at once would
  mix (with the child's check removed, both read wrong bytes here)."""
  if kernels.load() is None or not read_records.ring_ready():
    pytest.skip("no io_uring here")
  rng = np.random.default_rng(2)
  offsets = (rng.integers(0, SIZE // 4096, 512) * 4096).tolist()
  whole = np.fromfile(path, np.uint8)
  want = np.concatenate([whole[o : o + 4096] for o in offsets])
  fd = os.open(path, os.O_RDONLY)
  direct = read_records.open_direct(path)
  if direct < 0:
    os.close(fd)
    pytest.skip("this file system refuses O_DIRECT")

  def reads_right() -> bool:
    got = np.zeros(want.size, np.uint8)
    right = True
    for _ in range(20):
      got[:] = 0
      read_records.read_runs(fd, offsets, [4096] * 512, got, direct_fd=direct)
      right &= bool((got == want).all())
    return right

  try:
    assert reads_right()  # (the parent's ring, set up before the fork)
    child = os.fork()
    if child == 0:  # (the child exits 0 only if it read the file's bytes)
      right = False
      try:
        right = reads_right()
      finally:
        os._exit(0 if right else 1)
    parent = reads_right()
    _, status = os.waitpid(child, 0)
  finally:
    os.close(fd)
    os.close(direct)
  assert parent
  assert os.waitstatus_to_exitcode(status) == 0
