"""Independent oracle of a dynamic vocabulary's steps, in plain Python.

Written from the rules in ``tpu_embedding/keys/vocabulary.py`` (a
loop over keys and buckets, no vectorization), not from the TensorFlow
code, so the two can be compared step by step.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

_M64 = 2**64 - 1


def splitmix64_finalizer(key: int) -> int:
  z = int(key) & _M64
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
  return z ^ (z >> 31)


@dataclass
class OracleVocabulary:
  """The state: per row ``key, last, count``; per bucket its probation."""

  capacity: int
  bucket_size: int = 64
  min_count: int = 1
  eviction: str = "lru"
  ttl_steps: int | None = None
  probation_size: int | None = None
  step: int = 0
  evictions: int = 0
  keys: list = field(default_factory=list)
  last: list = field(default_factory=list)
  count: list = field(default_factory=list)
  probation: list = field(default_factory=list)

  def __post_init__(self):
    size = min(self.bucket_size, self.capacity)
    self.num_buckets = -(-self.capacity // size)
    self.keys = [0] * self.capacity
    self.last = [0] * self.capacity
    self.count = [0] * self.capacity
    p = self.bucket_size if self.probation_size is None else self.probation_size
    self.p = p if self.min_count > 1 else 0
    # probation[b][e] = [key, count, last]
    self.probation = [
      [[0, 0, 0] for _ in range(self.p)] for _ in range(self.num_buckets)
    ]

  def bucket(self, key: int) -> int:
    return splitmix64_finalizer(key) % self.num_buckets

  def bucket_rows(self, b: int) -> range:
    c, n = self.capacity, self.num_buckets
    return range(b * c // n, (b + 1) * c // n)

  def live(self, last: int, t: int) -> bool:
    return last > 0 and (self.ttl_steps is None or t - last <= self.ttl_steps)

  def find(self, key: int, t: int | None = None) -> int:
    t = self.step if t is None else t
    key = int(key)
    for r in self.bucket_rows(self.bucket(key)):
      if self.keys[r] == key and self.live(self.last[r], t):
        return r
    return self.capacity

  def advance(self, occurrences: list[int]) -> tuple[list[int], list[int]]:
    """One step; returns (row of each occurrence, rows given this step)."""
    t = self.step + 1
    order: list[int] = []
    seen: dict[int, int] = {}
    for k in occurrences:
      if k not in seen:
        order.append(k)
        seen[k] = 0
      seen[k] += 1
    row_of: dict[int, int] = {}
    hit_rows = set()
    total: dict[int, int] = {}
    on_probation: dict[int, tuple[int, int]] = {}  # key -> (bucket, entry)
    for k in order:
      r = self.find(k, t)
      if r < self.capacity:
        row_of[k] = r
        hit_rows.add(r)
        continue
      prior = 0
      b = self.bucket(k)
      for e, (pk, pc, pl) in enumerate(self.probation[b] if self.p else []):
        if pk == k and self.live(pl, t):
          prior = pc
          on_probation[k] = (b, e)
      total[k] = seen[k] + prior
    asking = [
      k for k in order if k not in row_of and total[k] >= self.min_count
    ]
    given = []
    for b in sorted({self.bucket(k) for k in asking}):
      mine = sorted(
        (k for k in asking if self.bucket(k) == b),
        key=lambda k: (-total[k], order.index(k)),
      )
      rows = list(self.bucket_rows(b))
      free = [r for r in rows if not self.live(self.last[r], t)]
      taken = [
        r for r in rows if self.live(self.last[r], t) and r not in hit_rows
      ]
      if self.eviction == "lru":
        taken.sort(key=lambda r: (self.last[r], self.count[r], r))
      else:
        taken.sort(key=lambda r: (self.count[r], self.last[r], r))
      for k, r in zip(mine, free + taken, strict=False):
        row_of[k] = r
        given.append(r)
        self.evictions += r in taken
    # Writes.
    for k in order:
      r = row_of.get(k)
      if r is None:
        continue
      if r in hit_rows:
        self.last[r] = t
        self.count[r] += seen[k]
      else:
        self.keys[r], self.last[r], self.count[r] = k, t, total[k]
    if self.p:
      self._probation(order, row_of, hit_rows, total, on_probation, t)
    self.step = t
    return [row_of.get(k, self.capacity) for k in occurrences], given

  def _probation(self, order, row_of, hit_rows, total, on_probation, t):
    touched = set(on_probation.values())
    joining = []
    for k in order:
      admitted = k in row_of and row_of[k] not in hit_rows
      hit = k in row_of and row_of[k] in hit_rows
      if hit:
        continue
      if k in on_probation:
        b, e = on_probation[k]
        if admitted:
          self.probation[b][e][2] = 0
        else:
          self.probation[b][e] = [k, total[k], t]
      elif not admitted:
        joining.append(k)
    for b in sorted({self.bucket(k) for k in joining}):
      mine = sorted(
        (k for k in joining if self.bucket(k) == b),
        key=lambda k: (-total[k], order.index(k)),
      )
      entries = [e for e in range(self.p) if (b, e) not in touched]
      entry = self.probation[b]
      free = [e for e in entries if not self.live(entry[e][2], t)]
      used = sorted(
        (e for e in entries if self.live(entry[e][2], t)),
        key=lambda e: (entry[e][2], entry[e][1], e),
      )
      for k, e in zip(mine, free + used, strict=False):
        entry[e] = [k, total[k], t]
