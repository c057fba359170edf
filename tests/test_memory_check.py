"""``build()`` refuses tables that cannot fit in memory, before allocating.

The bytes a process needs are checked against an independent measure:
what the built layouts actually hold (``TableStore.bytes_per_device``),
and ``rows x dim x 4 x (1 + slots)`` worked out here by hand.
"""

from __future__ import annotations

import re
import time

import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy
from tpu_embedding import memory
from tpu_embedding.planning import Planner
from tpu_embedding.sharding import PlacementPolicy

GIB = 2**30

#: ``(optimizer, slots)``: slot variables each optimizer keeps per table.
SLOTS = {
  "sgd": (tpe.SGD(0.1), 0),
  "adagrad": (tpe.Adagrad(0.1), 1),
  "adagrad_momentum": (tpe.AdagradMomentum(0.1), 2),
  "adam": (tpe.Adam(0.1), 2),
  "ftrl": (tpe.FTRL(0.1), 2),
}


def _status_kib(field: str) -> int:
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise AssertionError(f"no {field} in /proc/self/status")


def _limit(monkeypatch, size: int) -> None:
  """Makes the check see ``size`` bytes available."""
  monkeypatch.setattr(
    memory, "available_memory", lambda: memory.Available(size, "a test limit")
  )


def _embedding(rows, dim=64, optimizer=None, **kwargs):
  table = tpe.TableConfig(rows, dim, name="items")
  return tpe.TPUEmbedding(
    {"item": tpe.FeatureConfig(table)},
    optimizer or tpe.Adagrad(0.1),
    **kwargs,
  )


@pytest.mark.parametrize("how", ["build", "first_call"])
def test_a_table_larger_than_memory_is_refused_at_once(how, monkeypatch):
  monkeypatch.delenv(memory.SKIP_ENV, raising=False)
  available = memory.available_memory()
  if available is None or available.bytes > 2e9 * 64 * 4 * 2:
    pytest.skip(f"{available}: no limit below the table's 953.7 GiB here")
  emb = _embedding(2_000_000_000)
  peak, start = _status_kib("VmHWM"), time.perf_counter()
  with pytest.raises(tpe.errors.TableMemoryError) as raised:
    if how == "build":
      emb.build()
    else:
      emb({"item": tf.constant([1, 2])})
  assert time.perf_counter() - start < 1.0
  # Nothing allocated: the peak resident memory did not grow by a table
  # block (the table alone is 477 GiB).
  assert _status_kib("VmHWM") - peak < 64 * 1024
  # 2e9 rows x 64 x 4 bytes x (1 + Adagrad's accumulator) = 953.7 GiB.
  message = str(raised.value)
  assert "\n" not in message
  assert re.fullmatch(
    r"tpu_embedding: tables need 953\.7 GiB in this process \(items: "
    r"953\.7 GiB\) but \d+\.\d [KMG]i?B is available \(.+\); use smaller "
    r"tables, keep the largest on a local disk behind a RAM cache "
    r"\(row_sharding_threshold=PlacementPolicy\(disk=DiskTier\(directory, "
    r"cache_bytes, tables\)\), docs/large_tables\.md\), spread them over "
    r"more processes \(MultiWorkerMirroredStrategy, "
    r"ParameterServerStrategy\), or set "
    r"TPU_EMBEDDING_SKIP_MEMORY_CHECK=1 \(or build inside `with "
    r"tpu_embedding.memory.unchecked\(\):`\) to build anyway\.",
    message,
  ), message
  # TensorFlow's own out-of-memory error type, for code that catches it.
  assert isinstance(raised.value, tf.errors.ResourceExhaustedError)


def test_a_table_kept_on_disk_counts_its_cache(monkeypatch, tmp_path):
  """The way out the message names: a 47.7 GiB table on disk builds its
  64 KiB cache (and a map of 4 bytes a row, 200 MB) under 256 MiB."""
  from tpu_embedding.sharding import DiskTier
  from tpu_embedding.sharding import PlacementPolicy

  table = tpe.TableConfig(50_000_000, 128, name="items")
  emb = tpe.TPUEmbedding(
    tpe.FeatureConfig(table),
    tpe.Adagrad(0.1),
    row_sharding_threshold=PlacementPolicy(
      disk=DiskTier(str(tmp_path), 2**16, ("items",))
    ),
  )
  _limit(monkeypatch, 256 * 2**20)
  emb.build()
  assert emb.table_stores["items"].bytes_per_device() == {
    emb.table_stores["items"].blocks[0]["parameters"].device: 2**16
  }


def test_the_message_names_the_largest_tables_first(monkeypatch):
  tables = [tpe.TableConfig(1000 * (i + 1), 8, name=f"t{i}") for i in range(5)]
  emb = tpe.TPUEmbedding([tpe.FeatureConfig(t) for t in tables], tpe.SGD(0.1))
  _limit(monkeypatch, 1000)
  with pytest.raises(tpe.errors.TableMemoryError) as raised:
    emb.build()
  # t4: 5000 x 8 x 4 = 156.2 KiB; the two smallest: 31.2 + 62.5 KiB.
  assert (
    "tables need 468.8 KiB in this process (t4: 156.2 KiB, t3: 125.0 KiB, "
    "t2: 93.8 KiB, 2 more: 93.8 KiB) but 1000 B is available (a test "
    "limit)"
  ) in str(raised.value)


def _held_bytes(emb) -> int:
  """What the built layouts hold, summed over the stores and devices."""
  return sum(
    sum(store.bytes_per_device().values())
    for store in emb.table_stores.values()
  )


LAYOUTS = {
  # name: (strategy or None, row_sharding_threshold, copies of the table)
  "one_device": (None, 10_000, 1),
  # Two replicas in one process: each holds half the rows, the process
  # all of them.
  "mirrored_2_row_sharded": (2, 0, 1),
  # A replicated table: one whole copy per replica, both in this process.
  "mirrored_2_replicated": (2, 1_000_000, 2),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("optimizer", sorted(SLOTS))
def test_the_bytes_checked_are_those_the_layout_holds(
  layout, optimizer, monkeypatch
):
  replicas, threshold, copies = LAYOUTS[layout]
  rows, dim = 5000, 16
  opt, slots = SLOTS[optimizer]
  needed = rows * dim * 4 * (1 + slots) * copies  # by hand

  def make():
    if replicas is None:
      return _embedding(rows, dim, opt)
    with mirrored_strategy(replicas).scope():
      return _embedding(rows, dim, opt, row_sharding_threshold=threshold)

  _limit(monkeypatch, needed - 1)
  with pytest.raises(tpe.errors.TableMemoryError, match="items: "):
    make().build()
  _limit(monkeypatch, needed)
  emb = make()
  emb.build()
  assert _held_bytes(emb) == needed


def test_a_row_sharded_table_counts_its_share_per_worker():
  # Worker w of a 2-worker MultiWorkerMirroredStrategy (one replica each)
  # holds replica w's block: the plan's bytes of that replica only.
  table = tpe.TableConfig(1001, 8, name="t", optimizer=tpe.Adam(0.1))
  plan = Planner(2).plan([table], PlacementPolicy(0), None).tables
  assert memory.bytes_here(plan, [0]) == {"t": 501 * 8 * 4 * 3}
  assert memory.bytes_here(plan, [1]) == {"t": 500 * 8 * 4 * 3}
  assert memory.bytes_here(plan, [0, 1]) == {"t": 1001 * 8 * 4 * 3}


def test_stacked_tables_are_named_each_with_its_own_rows(monkeypatch):
  tables = [
    tpe.TableConfig(100 * (i + 1), 4, name=n) for i, n in enumerate("ab")
  ]
  emb = tpe.TPUEmbedding(
    [tpe.FeatureConfig(t) for t in tables],
    tpe.Adagrad(0.1),
    table_stacking=[["a", "b"]],
  )
  _limit(monkeypatch, 10)
  with pytest.raises(
    tpe.errors.TableMemoryError,
    match=r"need 9\.4 KiB in this process \(b: 6\.2 KiB, a: 3\.1 KiB\)",
  ):
    emb.build()


def test_the_override_builds_anyway(monkeypatch):
  _limit(monkeypatch, 100)  # far less than the table's 8 KiB
  monkeypatch.delenv(memory.SKIP_ENV, raising=False)
  with pytest.raises(tpe.errors.TableMemoryError):
    _embedding(64, 16).build()
  monkeypatch.setenv(memory.SKIP_ENV, "0")  # "0" does not skip
  with pytest.raises(tpe.errors.TableMemoryError):
    _embedding(64, 16).build()
  monkeypatch.setenv(memory.SKIP_ENV, "1")
  emb = _embedding(64, 16)
  emb.build()
  assert emb.embedding_lookup({"item": tf.constant([3])})["item"].shape == (
    1,
    16,
  )
  monkeypatch.delenv(memory.SKIP_ENV)
  with memory.unchecked():
    _embedding(64, 16).build()
  with pytest.raises(tpe.errors.TableMemoryError):
    _embedding(64, 16).build()  # on again after the block


def test_available_memory_is_the_tightest_limit(monkeypatch):
  # One reading of each /proc field: MemAvailable moves between two reads
  # on a busy machine (CI saw 17,592,905,728 then 17,585,631,232).
  read, readings = memory._proc_field, {}
  monkeypatch.setattr(
    memory,
    "_proc_field",
    lambda path, field: readings.setdefault((path, field), read(path, field)),
  )
  meminfo = memory._proc_field("/proc/meminfo", "MemAvailable")
  found = memory.available_memory()
  assert found is not None and found.bytes <= meminfo
  # An address-space limit 1 GiB above the current size leaves 1 GiB.
  size = memory._proc_field("/proc/self/status", "VmSize")
  monkeypatch.setattr(
    memory.resource,
    "getrlimit",
    lambda which: (size + GIB, memory.resource.RLIM_INFINITY),
  )
  found = memory.available_memory()
  assert found.source == "RLIMIT_AS"
  assert GIB - 64 * 2**20 <= found.bytes <= GIB


def _write(path, text):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)


def test_cgroup_v2_limits_of_the_group_and_its_ancestors(tmp_path):
  _write(tmp_path / "proc_cgroup", "0::/jobs/me\n")
  root = tmp_path / "cgroup"
  _write(root / "jobs" / "me" / "memory.max", "1000\n")
  _write(root / "jobs" / "me" / "memory.current", "300\n")
  _write(root / "jobs" / "memory.max", "500\n")  # tighter, above
  _write(root / "jobs" / "memory.current", "100\n")
  _write(root / "memory.max", "max\n")
  _write(root / "memory.current", "5000\n")
  args = (str(root), str(tmp_path / "proc_cgroup"))
  assert memory.cgroup_available(*args) == 400
  _write(root / "jobs" / "memory.max", "max\n")
  assert memory.cgroup_available(*args) == 700
  _write(root / "jobs" / "me" / "memory.max", "max\n")
  assert memory.cgroup_available(*args) is None


def test_cgroup_v1_limit(tmp_path):
  _write(tmp_path / "proc_cgroup", "4:memory:/box\n0::/\n")
  root = tmp_path / "cgroup"
  _write(root / "memory" / "box" / "memory.limit_in_bytes", "2048\n")
  _write(root / "memory" / "box" / "memory.usage_in_bytes", "48\n")
  args = (str(root), str(tmp_path / "proc_cgroup"))
  assert memory.cgroup_available(*args) == 2000
  # No limit: v1 writes a number near 2**63.
  _write(root / "memory" / "box" / "memory.limit_in_bytes", f"{2**63 - 4096}")
  assert memory.cgroup_available(*args) is None


def test_tables_for_serving_are_checked_too(monkeypatch):
  monkeypatch.delenv(memory.SKIP_ENV, raising=False)
  table = tpe.TableConfig(2_000_000_000, 64, name="items")
  serving = tpe.TPUEmbeddingForServing(tpe.FeatureConfig(table), None)
  with pytest.raises(
    tpe.errors.TableMemoryError,
    match=r"^tpu_embedding: tables need 476\.8 GiB in this process \(items: "
    r"476\.8 GiB\)",  # no optimizer: no slots
  ):
    serving.build()
