"""Refusing tables that cannot fit in this process's memory, before building.

``TPUEmbedding.build()`` (and the first call, which builds) asks
``check_tables_fit`` whether the tables' parameters and optimizer slots
fit in the memory this process can still get; if not it raises one line
(``errors.TableMemoryError``) naming the tables, the bytes needed and the
bytes available, before any variable is allocated.

**Bytes needed** come from the one place that knows each table's layout,
the sharding plan (``sharding.TablePlacement.bytes_per_replica``:
rows x dim x 4 bytes x (1 + optimizer slots), per replica), summed over
the replicas this process holds (``Backend.replicas_here``): a whole
table on one device counts once; a row-sharded table over the N replicas
of one process (``MirroredStrategy``) counts whole, over N worker
processes about 1/N; a replicated table counts once per local replica.
Tables on a GPU, or on parameter servers (other processes), are not
counted against this process's memory.

**Memory available** is the least of what is known: the cgroup's limit
less its usage (``memory.max`` - ``memory.current``, cgroup v2, or
``memory.limit_in_bytes`` - ``memory.usage_in_bytes``, v1), the
machine's ``MemAvailable`` (``/proc/meminfo``) and the address space left
under ``RLIMIT_AS``.

To build anyway set ``TPU_EMBEDDING_SKIP_MEMORY_CHECK=1`` in the
environment, or build inside ``with tpu_embedding.memory.unchecked():``.

Example:
  >>> from tpu_embedding.config import TableConfig
  >>> from tpu_embedding.optimizers import Adagrad
  >>> table = TableConfig(1000, 8, name="t", optimizer=Adagrad(0.1))
  >>> plan = Planner(2).plan([table], PlacementPolicy(0)).tables
  >>> bytes_here(plan, replicas=[0, 1])  # both row blocks in this process
  {'t': 64000}
  >>> bytes_here(plan, replicas=[1])  # one worker of two
  {'t': 32000}
  >>> try:
  ...   check_tables_fit({"t": 64000}, Available(1000, "MemAvailable"))
  ... except errors.TableMemoryError as e:
  ...   print(str(e)[:64])
  tpu_embedding: tables need 62.5 KiB in this process (t: 62.5 KiB
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence

import tensorflow as tf

from tpu_embedding import errors
from tpu_embedding.config import TableConfig
from tpu_embedding.planning import Planner
from tpu_embedding.replicas import local_devices
from tpu_embedding.sharding import PlacementPolicy
from tpu_embedding.sharding import ShardingPlan

#: Set to ``1`` to build tables whatever the memory available.
SKIP_ENV = "TPU_EMBEDDING_SKIP_MEMORY_CHECK"

#: Limits at or above this are "no limit" (cgroup v1 writes ~2**63).
_UNLIMITED = 2**60

#: Tables named in the message; the rest are summed.
_SHOWN = 3

_skipped = 0


@dataclasses.dataclass(frozen=True)
class Available:
  """Bytes this process can still allocate, and what limits them.

  Attributes:
    bytes: the bytes.
    source: the limit that gave them (``"cgroup memory.max"``,
      ``"MemAvailable"``, ``"RLIMIT_AS"``), for messages.
  """

  bytes: int
  source: str


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
  """Builds tables inside the block without the memory check.

  Example:
    >>> import tpu_embedding as tpe
    >>> emb = tpe.TPUEmbedding(
    ...     tpe.FeatureConfig(tpe.TableConfig(5, 2, name="t")), tpe.SGD(0.1))
    >>> with tpe.memory.unchecked():
    ...   emb.build()
  """
  global _skipped
  _skipped += 1
  try:
    yield
  finally:
    _skipped -= 1


def skipped() -> bool:
  """Whether the check is off (``SKIP_ENV`` set, or inside ``unchecked``)."""
  return _skipped > 0 or os.environ.get(SKIP_ENV, "") not in ("", "0")


def _read_int(path: str) -> int | None:
  try:
    with open(path, encoding="ascii") as f:
      text = f.read().strip()
  except OSError:
    return None
  return int(text) if text.isdigit() else None  # "max": no limit


def cgroup_available(
  root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
) -> int | None:
  """The cgroup's memory limit less its usage (None without a limit).

  Reads cgroup v2 (``memory.max``, ``memory.current``) in the process's
  group and its ancestors (the tightest counts), else cgroup v1
  (``memory/memory.limit_in_bytes``, ``memory.usage_in_bytes``).

  Args:
    root: where the cgroup filesystem is mounted.
    proc_cgroup: the process's cgroup membership file.
  """
  paths = {"v2": "/", "v1": "/"}
  try:
    with open(proc_cgroup, encoding="ascii") as f:
      for line in f:
        number, controllers, path = line.rstrip("\n").split(":", 2)
        if number == "0" and not controllers:
          paths["v2"] = path
        elif "memory" in controllers.split(","):
          paths["v1"] = path
  except (OSError, ValueError):
    pass
  left = []
  group = paths["v2"].strip("/")
  while True:  # The group, then its ancestors up to the root.
    directory = os.path.join(root, group)
    limit = _read_int(os.path.join(directory, "memory.max"))
    used = _read_int(os.path.join(directory, "memory.current"))
    if limit is not None and used is not None and limit < _UNLIMITED:
      left.append(limit - used)
    if not group:
      break
    group = os.path.dirname(group)
  if not left:  # cgroup v1: the group's directory, or the namespace's root.
    for group in (paths["v1"].strip("/"), ""):
      directory = os.path.join(root, "memory", group)
      limit = _read_int(os.path.join(directory, "memory.limit_in_bytes"))
      used = _read_int(os.path.join(directory, "memory.usage_in_bytes"))
      if limit is not None and used is not None:
        if limit < _UNLIMITED:
          left.append(limit - used)
        break
  return max(0, min(left)) if left else None


def _proc_field(path: str, field: str) -> int | None:
  """A ``kB`` field of a ``/proc`` file, in bytes."""
  try:
    with open(path, encoding="ascii") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    return None
  return None


def available_memory() -> Available | None:
  """Bytes this process can still get: the least of the known limits.

  Returns:
    The bytes and their source, or None where nothing is known (not
    Linux).
  """
  found = []
  cgroup = cgroup_available()
  if cgroup is not None:
    found.append(Available(cgroup, "cgroup memory limit"))
  meminfo = _proc_field("/proc/meminfo", "MemAvailable")
  if meminfo is not None:
    found.append(Available(meminfo, "MemAvailable"))
  limit, _ = resource.getrlimit(resource.RLIMIT_AS)
  if limit != resource.RLIM_INFINITY:
    size = _proc_field("/proc/self/status", "VmSize") or 0
    found.append(Available(max(0, limit - size), "RLIMIT_AS"))
  return min(found, key=lambda a: a.bytes) if found else None


def bytes_here(plan: ShardingPlan, replicas: Sequence[int]) -> dict[str, int]:
  """Parameter and slot bytes of each table held by ``replicas``.

  Args:
    plan: the tables' placements (a stacked table's own rows).
    replicas: the plan's replicas whose bytes count.

  Returns:
    ``{table: bytes}``, in the plan's order.
  """
  return {
    name: sum(placement.bytes_per_replica()[r] for r in replicas)
    for name, placement in plan.placements.items()
  }


def host_replicas(
  replicas: Mapping[int, str | None], strategy: tf.distribute.Strategy
) -> list[int]:
  """Those of ``replicas`` whose rows are in host memory (not a GPU's).

  Args:
    replicas: ``{replica of the plan: device}`` held by this process
      (``Backend.held_replicas``; None: the strategy's or default device).
    strategy: the strategy the tables are created under.
  """
  on_host = []
  for replica, device in replicas.items():
    if device is None:
      device = next(iter(local_devices(strategy)), None)
    if device is None:  # The default device: a GPU if there is one.
      if not tf.config.list_logical_devices("GPU"):
        on_host.append(replica)
      continue
    if tf.DeviceSpec.from_string(device).device_type in (None, "CPU"):
      on_host.append(replica)
  return on_host


def tables_here(
  tables: Sequence[TableConfig],
  plan: ShardingPlan | None,
  replicas: Mapping[int, str | None],
  strategy: tf.distribute.Strategy,
) -> dict[str, int]:
  """Host-memory bytes of each table (and slots) in this process.

  Args:
    tables: the resolved tables.
    plan: their placements (None: every table whole on one device).
    replicas: the plan's replicas in this process and their devices
      (``Backend.held_replicas``).
    strategy: the strategy the tables are created under.

  Returns:
    ``{table: bytes}``.
  """
  if plan is None:  # Every table whole: the plan of one shard.
    plan = Planner(1).plan(tables, PlacementPolicy(), None).tables
  assert plan is not None
  return bytes_here(plan, host_replicas(replicas, strategy))


def _size(size: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if size < 1024 or unit == "GiB":
      return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
    size /= 1024
  raise AssertionError("unreachable")


def check_tables_fit(
  needed: Mapping[str, int], available: Available | None = None
) -> None:
  """Refuses tables whose bytes exceed the memory available.

  Args:
    needed: ``{table: bytes}`` this process would hold.
    available: the memory available (default: ``available_memory()``).

  Raises:
    errors.TableMemoryError: one line naming the largest tables, the bytes
      needed and available, and how to build anyway.
  """
  total = sum(needed.values())
  if total == 0 or skipped():
    return
  available = available_memory() if available is None else available
  if available is None or total <= available.bytes:
    return
  largest = sorted(needed.items(), key=lambda item: -item[1])
  shown = [f"{name}: {_size(size)}" for name, size in largest[:_SHOWN]]
  rest = largest[_SHOWN:]
  if rest:
    others = sum(size for _, size in rest)
    shown.append(f"{len(rest)} more: {_size(others)}")
  raise errors.TableMemoryError(
    errors.TABLES_EXCEED_MEMORY.format(
      needed=_size(total),
      tables=", ".join(shown),
      available=_size(available.bytes),
      source=available.source,
      env=SKIP_ENV,
    )
  )
