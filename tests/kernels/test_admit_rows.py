"""A disk table's host map (``kernels.admit_rows``): the kernel and numpy
make the same decisions, bit for bit, step after step (every array and
counter of the map, every output), including the whole-cache fallback,
the counts' halving and refusals, which change nothing; and the policy's
invariants hold, checked here on their own terms."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tpu_embedding import kernels
from tpu_embedding.kernels import admit_rows
from tpu_embedding.kernels.admit_rows import CacheMap

ROWS = 5_000


@pytest.fixture(name="kernel")
def _kernel():
  if kernels.load() is None:
    pytest.skip("the kernels did not build here")
  found = admit_rows._kernels()  # noqa: SLF001
  assert found is not None  # (the library has them)
  return found


def _copy(cache: CacheMap) -> CacheMap:
  return CacheMap(*(np.copy(a) for a in dataclasses.astuple(cache)))


def _assert_same(got: CacheMap, want: CacheMap) -> None:
  for field in dataclasses.fields(CacheMap):
    np.testing.assert_array_equal(
      getattr(got, field.name), getattr(want, field.name), err_msg=field.name
    )


def _steps(seed: int, count: int):
  """Distinct rows of skewed steps, some larger than the cache allows."""
  rng = np.random.default_rng(seed)
  p = np.arange(1, ROWS + 1, dtype=np.float64) ** -1.1
  order = rng.permutation(ROWS)
  for step in range(count):
    if step % 10 == 9:  # (many rows, mostly cold)
      yield rng.choice(ROWS, 450, replace=False)
      continue
    draws = int(rng.integers(1, 900))
    ranks = rng.choice(ROWS, draws, p=p / p.sum())
    yield rng.permutation(np.unique(order[ranks]))


def _takes_from_the_whole_cache(cache, rows, window, min_window) -> bool:
  """Whether admitting ``rows`` succeeds only through the whole-cache
  fallback (the window ahead of the hand holds too few idle slots)."""
  step = cache.counters[admit_rows.STEP] + 1
  slots = cache.slot_of_row[rows].astype(np.int64) - 1
  need = int((slots < 0).sum())
  last = cache.last_use.copy()
  last[slots[slots >= 0]] = step
  span = min(cache.size, max(min_window, window * need))
  ahead = (cache.counters[admit_rows.HAND] + np.arange(span)) % cache.size
  idle = last < step - 1
  return 0 < need and idle[ahead].sum() < need <= idle.sum()


@pytest.mark.parametrize(
  ("size", "window", "min_window", "aging"),
  [(600, 16, 64, 2), (900, 2, 16, 128), (4_000, 16, 4096, 1)],
)
def test_the_kernel_decides_as_numpy(kernel, monkeypatch, size, window,
                                     min_window, aging):  # fmt: skip
  """Small windows (the whole-cache fallback), fast aging, refusals."""
  del kernel
  with_kernel = CacheMap.empty(ROWS, size)
  with_numpy = CacheMap.empty(ROWS, size)
  changed = [np.zeros(-(-ROWS // 8), np.uint8) for _ in range(2)]
  refused = whole_cache = 0
  for rows in _steps(size, 300):
    whole_cache += _takes_from_the_whole_cache(
      with_numpy, rows, window, min_window
    )
    got = admit_rows.admit(with_kernel, rows, window, min_window, aging)
    with monkeypatch.context() as patch:
      patch.setattr(admit_rows, "_kernels", lambda: None)
      want = admit_rows.admit(with_numpy, rows, window, min_window, aging)
      want_slots = None
      if want is not None:
        update = rows[: rows.size // 2]
        want_slots = admit_rows.mark_updated(with_numpy, changed[1], update)
    assert (got is None) == (want is None)
    if want is None:
      refused += 1
    else:
      for field in dataclasses.fields(want):
        np.testing.assert_array_equal(
          getattr(got, field.name), getattr(want, field.name), field.name
        )
      slots = admit_rows.mark_updated(with_kernel, changed[0], update)
      np.testing.assert_array_equal(slots, want_slots)
    _assert_same(with_kernel, with_numpy)
    np.testing.assert_array_equal(changed[0], changed[1])
  assert with_kernel.counters[admit_rows.STEP] > 200
  if size == 600:
    assert refused > 0  # (the cases were exercised)
  if size == 900:  # (small windows: the fallback; slow aging: saturation)
    assert with_kernel.frequency.max() == 255
    assert whole_cache > 0


@pytest.fixture(name="admit", params=["kernel", "numpy"])
def _admit(request, monkeypatch):
  if request.param == "kernel":
    if kernels.load() is None:
      pytest.skip("the kernels did not build here")
  else:
    monkeypatch.setattr(admit_rows, "_kernels", lambda: None)
  return admit_rows.admit


def test_a_refusal_changes_nothing(admit):
  """Cached rows of the refused step (one twice, its old use restored)
  keep their last use; rows outside the table are refused too."""
  cache = CacheMap.empty(ROWS, 150)
  assert admit(cache, np.arange(100), 16, 4096, 128) is not None
  assert admit(cache, np.arange(20), 16, 4096, 128) is not None
  before = _copy(cache)
  assert admit(cache, np.arange(50, 200), 16, 4096, 128) is None
  _assert_same(cache, before)
  for outside in (ROWS, -1):
    with pytest.raises(IndexError, match=f"row {outside} is outside"):
      admit(cache, np.array([3, outside]), 16, 4096, 128)
    _assert_same(cache, before)


def test_marking_a_row_not_cached_changes_nothing(admit):
  cache = CacheMap.empty(ROWS, 150)
  changed = np.zeros(-(-ROWS // 8), np.uint8)
  admit(cache, np.array([3, 4]), 16, 4096, 128)
  before, changed_before = _copy(cache), changed.copy()
  assert admit_rows.mark_updated(cache, changed, np.array([3, 9])) is None
  with pytest.raises(IndexError):
    admit_rows.mark_updated(cache, changed, np.array([4, ROWS]))
  _assert_same(cache, before)
  np.testing.assert_array_equal(changed, changed_before)
  slots = admit_rows.mark_updated(cache, changed, np.array([4, 3, 4]))
  assert slots.tolist() == [1, 0, 1]
  assert cache.dirty.tolist()[:3] == [True, True, False]
  assert np.flatnonzero(np.unpackbits(changed, bitorder="little")).tolist() == [
    3,
    4,
  ]


def test_a_map_of_other_types_is_refused():
  good = CacheMap.empty(10, 4)
  with pytest.raises(ValueError, match="slot_of_row: int64"):
    dataclasses.replace(good, slot_of_row=np.zeros(10, np.int64))


def test_the_policys_invariants(admit):
  """Each asked row ends in a slot that holds it; rows of the step before
  keep theirs; empty slots go first; a changed row that leaves is
  reported for write-back with the slot it left."""
  cache = CacheMap.empty(ROWS, 500)
  previous = np.zeros(0, np.int64)
  ever_full = False
  for rows in _steps(7, 200):
    if rows.size > 200:
      continue
    held_before = cache.row_of_slot.copy()
    dirty_before = cache.dirty.copy()
    was = {r: int(cache.slot_of_row[r]) - 1 for r in previous.tolist()}
    admitted = admit(cache, rows, 16, 64, 128)
    assert admitted is not None
    np.testing.assert_array_equal(cache.row_of_slot[admitted.slots], rows)
    np.testing.assert_array_equal(cache.slot_of_row[rows] - 1, admitted.slots)
    for row, slot in was.items():
      assert cache.slot_of_row[row] - 1 == slot
    empty = np.flatnonzero(held_before < 0)
    taken = admitted.load_slots
    if empty.size >= taken.size:
      assert np.isin(taken, empty).all()
    else:
      ever_full = True
    leaving = held_before[taken]
    wrote = (leaving >= 0) & dirty_before[taken]
    np.testing.assert_array_equal(admitted.evicted_slots, taken[wrote])
    np.testing.assert_array_equal(admitted.evicted_rows, leaving[wrote])
    assert not cache.dirty[taken].any()
    cache.dirty[admitted.slots[::3]] = True  # (an update of some)
    previous = rows
  assert ever_full
