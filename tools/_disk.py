"""The disk tier's figures for tools/benchmark.py: the disk's random-read
rate, and the misses of an ideal cache (the IO floor's terms).

Example:
  >>> round(ideal_misses("uniform", rows=100, draws=10, exponent=0.0,
  ...                    cache_rows=50), 2)
  4.78
"""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import subprocess
import sys
import time

import numpy as np

#: Bytes of one random read (a page).
PAGE = 4096


def disk_read_rate(
  directory: str,
  threads: int = 64,
  seconds: float = 2.0,
  size: int = 2**30,
  processes: int = 4,
) -> float:
  """Random 4 KiB reads per second from a file in ``directory``, with
  ``threads`` reads in flight over ``processes`` processes (one Python
  process's threads reach about half of this machine's SSD rate), each
  page read once (its pages dropped from the page cache first, no
  readahead, and read past the page cache where the file system allows
  ``O_DIRECT``: the disk, not memory, answers, one page per read)."""
  path = os.path.join(directory, "read_rate.bin")
  chunk = np.random.default_rng(0).integers(0, 255, 2**24, np.uint8).tobytes()
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
  try:
    for offset in range(0, size, len(chunk)):
      os.pwrite(fd, chunk, offset)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    runs = [
      subprocess.Popen(
        [sys.executable, __file__, path, str(seed), str(threads // processes),
         str(seconds), str(processes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      )
      for seed in range(processes)
    ]  # fmt: skip
    total = 0.0
    for run in runs:
      out, err = run.communicate()
      if run.returncode != 0:  # (one line, naming the file)
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise OSError(errno.EIO, f"the disk probe failed: {last}", path)
      total += float(out)
    return total
  finally:
    os.close(fd)
    os.remove(path)


def _read_rate(
  path: str, seed: int, threads: int, seconds: float, parts: int
) -> float:
  """One probe process: random reads of its part of the pages."""
  fd = os.open(path, os.O_RDONLY)
  os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
  try:
    reader = os.open(path, os.O_RDONLY | os.O_DIRECT)
  except OSError:  # (a file system without O_DIRECT: tmpfs)
    reader = os.dup(fd)
  pages = np.random.default_rng(1).permutation(os.path.getsize(path) // PAGE)
  mine = np.array_split(pages, parts)[seed]
  deadline = time.perf_counter() + seconds

  def read(part: np.ndarray) -> int:
    buffer = mmap.mmap(-1, PAGE)  # (page-aligned, as O_DIRECT needs)
    done = 0
    for page in part:
      os.preadv(reader, [buffer], int(page) * PAGE)
      done += 1
      if done % 64 == 0 and time.perf_counter() > deadline:
        break
    return done

  start = time.perf_counter()
  try:
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      total = sum(pool.map(read, np.array_split(mine, threads)))
  finally:
    os.close(reader)
    os.close(fd)
  return total / (time.perf_counter() - start)


def probabilities(dist: str, rows: int, exponent: float) -> np.ndarray:
  """Each rank's probability, most probable first."""
  if dist == "uniform":
    return np.full(rows, 1.0 / rows)
  p = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
  return p / p.sum()


def ideal_misses(
  dist: str, rows: int, draws: int, exponent: float, cache_rows: int
) -> float:
  """E[distinct ids of a step outside an ideal cache]: one holding the
  ``cache_rows`` most probable rows, the step ``draws`` ids."""
  p = probabilities(dist, rows, exponent)[cache_rows:]
  return float(np.sum(-np.expm1(draws * np.log1p(-p))))


def fixed_ids(
  rng: np.random.Generator,
  ranks_of: np.ndarray,
  p: np.ndarray,
  size: int,
) -> np.ndarray:
  """``size`` ids drawn with probabilities ``p`` by rank, rank ``r`` being
  row ``ranks_of[r]`` (one permutation per table, kept across steps: a
  cache sees the same hot rows every step)."""
  ranks = np.minimum(
    np.searchsorted(np.cumsum(p), rng.random(size)), p.size - 1
  )
  return ranks_of[ranks].astype(np.int64)


if __name__ == "__main__":  # One probe process (``disk_read_rate``).
  path, seed, threads, seconds, parts = sys.argv[1:]
  print(_read_rate(path, int(seed), int(threads), float(seconds), int(parts)))
