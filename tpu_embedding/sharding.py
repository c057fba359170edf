"""The sharding plan: which table is replicated, which is row-sharded.

A table with more rows than ``row_threshold`` is split into contiguous row
blocks, one per replica ("div" sharding, the layout of
``tf.distribute`` sharded variables): replica ``r`` holds rows
``[offsets[r], offsets[r] + sizes[r])``, the first ``vocabulary_size % N``
replicas one row more. Smaller tables are replicated: every replica holds a
full copy and applies the same (globally summed) update to it. A
``PlacementPolicy`` says which: the row threshold, and the placement of
chosen tables whatever their size (an ``int`` is accepted wherever a policy
is, and becomes one there; ``RowThreshold`` is the policy's earlier name).

The plan holds no variables; it is inspectable (``report()``) before any
memory is spent. ``make_plan`` places each table alone; a backend's
``Planner`` (``planning.py``) stacks tables from those placements.

Example:
  >>> import tpu_embedding as tpe
  >>> big = tpe.TableConfig(1_000_000, 64, name="items")
  >>> small = tpe.TableConfig(100, 8, name="countries")
  >>> plan = make_plan([big, small], num_replicas=4, row_threshold=10_000)
  >>> plan.placements["items"].shard_sizes
  (250000, 250000, 250000, 250000)
  >>> plan.placements["countries"].kind
  'replicated'
  >>> forced = PlacementPolicy(10_000, {"countries": ROW_SHARDED})
  >>> make_plan([big, small], 4, forced).placements["countries"].shard_sizes
  (25, 25, 25, 25)
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Collection
from collections.abc import Mapping
from collections.abc import Sequence

from tpu_embedding.config import TableConfig
from tpu_embedding.resolved import table_name

#: Tables with more rows than this are row-sharded by default.
DEFAULT_ROW_THRESHOLD = 10_000

#: ``TablePlacement.kind`` values.
ROW_SHARDED = "row_sharded"
REPLICATED = "replicated"

_FLOAT_BYTES = 4


@dataclasses.dataclass(frozen=True)
class DiskTier:
  """Tables kept on a local disk behind a RAM cache of their rows.

  A table it names is a ``tables.tiered.TieredTable``: its rows and
  optimizer slots live in files under ``directory/<table>`` (working
  state, rebuilt from checkpoints), and at most ``cache_bytes`` of them in
  memory; it trains with the same numbers as in memory. On one device (the
  default strategy, ``OneDeviceStrategy``), and row-sharded under
  ``MirroredStrategy`` and ``MultiWorkerMirroredStrategy``
  (``tables.tiered_sharded.TieredShardedTable``: each replica's rows in
  ``directory/<table>/block<r>``, behind a cache of ``cache_bytes`` on
  its device; each process its own directory).
  Tables it names stack only with one another (``planning.py``): such a
  stack is one tiered table, its cache theirs together (one device).

  Attributes:
    directory: a local directory for the tables' files.
    cache_bytes: memory for each named table's cache (parameters and
      slots of the cached rows), on each replica of a sharded one.
    tables: the names of the tables kept on disk.

  Raises:
    ValueError: for tables without a directory or a positive cache.

  Example:
    >>> tier = DiskTier("/tmp/tables", 256 * 2**20, ("users",))
    >>> tier.holds("users"), tier.holds("items")
    (True, False)
    >>> DiskTier("", 0, ("users",))
    Traceback (most recent call last):
    ...
    ValueError: DiskTier for tables ('users',): directory must name a ...
  """

  directory: str = ""
  cache_bytes: int = 0
  tables: tuple[str, ...] = ()

  def __post_init__(self) -> None:
    object.__setattr__(self, "tables", tuple(self.tables))
    if self.tables and (not self.directory or self.cache_bytes <= 0):
      raise ValueError(
        f"DiskTier for tables {self.tables}: directory must name a local "
        f"directory and cache_bytes be positive. Received: "
        f"directory={self.directory!r}, cache_bytes={self.cache_bytes}"
      )

  def holds(self, name: str) -> bool:
    """Whether table ``name`` is kept on disk."""
    return name in self.tables

  def cache_rows(self, row_bytes: int) -> int:
    """Rows of a cache whose row takes ``row_bytes`` (its parameters and
    slots as stored: ``tables.tiered.cached_row_bytes``).

    Example:
      >>> DiskTier("/tmp/tables", 2**20, ("users",)).cache_rows(512)
      2048
    """
    return self.cache_bytes // row_bytes

  def memory_bytes(self, rows: int) -> int:
    """Memory a table of ``rows`` rows kept on disk holds: its cache and
    its map of the cached rows (4 bytes a row)."""
    return self.cache_bytes + 4 * rows


#: No table kept on disk.
IN_MEMORY = DiskTier()


@dataclasses.dataclass(frozen=True)
class PlacementPolicy:
  """Which tables are row-sharded: what every plan is made from.

  ``RowThreshold`` is another name for it; ``int(policy)`` is its threshold.

  Attributes:
    row_threshold: tables with more rows are row-sharded, smaller ones
      replicated; 0 shards every table.
    forced: ``{table name: ROW_SHARDED or REPLICATED}``: the placement of
      these tables whatever their size (read-only); with a single shard
      every table is whole anyway. ``DistributedEmbedding`` fills it from
      keras-rs placements.
    disk: the tables kept on a local disk behind a RAM cache
      (``DiskTier``; none by default).

  Raises:
    ValueError: for a negative threshold, or another placement than
      ``ROW_SHARDED`` and ``REPLICATED``.

  Example:
    >>> policy = PlacementPolicy(10_000, {"users": ROW_SHARDED})
    >>> policy.kind("users", 500, 4), policy.kind("items", 500, 4)
    ('row_sharded', 'replicated')
    >>> int(RowThreshold(10_000, {"users": ROW_SHARDED}))
    10000
    >>> PlacementPolicy(10, {"users": "sparsecore"})
    Traceback (most recent call last):
    ...
    ValueError: Table 'users': placement 'sparsecore' is neither ...
  """

  row_threshold: int = DEFAULT_ROW_THRESHOLD
  forced: Mapping[str, str] = dataclasses.field(default_factory=dict)
  disk: DiskTier = IN_MEMORY

  def __post_init__(self) -> None:
    if self.row_threshold < 0:
      raise ValueError(
        f"row_threshold must be >= 0. Received: {self.row_threshold}"
      )
    for name, kind in self.forced.items():
      if kind not in (ROW_SHARDED, REPLICATED):
        raise ValueError(
          f"Table {name!r}: placement {kind!r} is neither {ROW_SHARDED!r} "
          f"nor {REPLICATED!r}."
        )
    forced = types.MappingProxyType(dict(self.forced))
    object.__setattr__(self, "forced", forced)

  @classmethod
  def of(cls, threshold: int | PlacementPolicy) -> PlacementPolicy:
    """The policy a ``row_sharding_threshold`` argument gives: an ``int``
    or a policy.

    Example:
      >>> PlacementPolicy.of(5)
      PlacementPolicy(row_threshold=5, forced={})
    """
    if isinstance(threshold, PlacementPolicy):
      return threshold
    return cls(int(threshold))

  def __int__(self) -> int:
    return int(self.row_threshold)

  def __reduce__(self) -> tuple[type, tuple[int, dict[str, str], DiskTier]]:
    return (PlacementPolicy, (self.row_threshold, dict(self.forced), self.disk))

  def __repr__(self) -> str:
    disk = f", disk={self.disk!r}" if self.disk.tables else ""
    return (
      f"PlacementPolicy(row_threshold={self.row_threshold}, "
      f"forced={dict(self.forced)!r}{disk})"
    )

  def kind(self, name: str, vocabulary_size: int, num_shards: int) -> str:
    """``ROW_SHARDED`` or ``REPLICATED`` for one table (the plan's rule).

    A table with fewer rows than shards is always replicated: a row block
    per shard would leave some shard without rows, and a copy of so few
    rows costs nothing.

    Example:
      >>> PlacementPolicy(10).kind("t", 50, 2)
      'row_sharded'
      >>> PlacementPolicy(10).kind("t", 50, 1)
      'replicated'
      >>> PlacementPolicy(0).kind("t", 3, 4)  # fewer rows than shards
      'replicated'
    """
    if num_shards == 1 or vocabulary_size < num_shards:
      return REPLICATED
    if self.disk.holds(name):  # Each replica's rows on its own files.
      return ROW_SHARDED
    if name in self.forced:
      return self.forced[name]
    return ROW_SHARDED if vocabulary_size > self.row_threshold else REPLICATED

  def check_tables(self, names: Collection[str]) -> None:
    """Raises a ValueError if ``forced`` names a table not in ``names``."""
    unknown = sorted(set(self.forced) - set(names))
    if unknown:
      raise ValueError(
        f"The row-sharding threshold fixes the placement of tables {unknown}"
        f", which are not among the tables {sorted(names)}."
      )


#: The policy's earlier name: ``RowThreshold(threshold, forced)``.
RowThreshold = PlacementPolicy


@dataclasses.dataclass(frozen=True)
class TablePlacement:
  """Where one table's rows live.

  Attributes:
    table: the table name.
    kind: ``"row_sharded"`` or ``"replicated"``.
    shard_sizes: rows held by each replica (all ``vocabulary_size`` when
      replicated).
    shard_offsets: first row of each replica's block (all 0 when
      replicated).
    dim: the table width.
    num_slots: optimizer slot variables per table.
    stack: the stack holding the table (``stacking.py``), or None. A
      stacked table's sizes and offsets are its own rows' share of the
      stack's blocks.
    parameter_bytes: bytes of one stored parameter value (4; 2 for a
      16-bit ``RowStorage``).
    slot_bytes: bytes of one stored slot value.
  """

  table: str
  kind: str
  shard_sizes: tuple[int, ...]
  shard_offsets: tuple[int, ...]
  dim: int
  num_slots: int
  stack: str | None = None
  parameter_bytes: int = _FLOAT_BYTES
  slot_bytes: int = _FLOAT_BYTES

  @property
  def sharded(self) -> bool:
    return self.kind == ROW_SHARDED

  def rows_of(self, replica: int) -> tuple[int, int]:
    """``(first row, rows)`` of replica ``replica``'s block."""
    return self.shard_offsets[replica], self.shard_sizes[replica]

  def bytes_per_replica(self) -> list[int]:
    """Parameter plus slot bytes held by each replica."""
    per_row = self.dim * (
      self.parameter_bytes + self.num_slots * self.slot_bytes
    )
    return [size * per_row for size in self.shard_sizes]


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
  """Placement of every table over ``num_replicas`` replicas.

  Attributes:
    num_replicas: the row shards (replicas, or parameter servers).
    policy: the ``PlacementPolicy`` it was planned from.
    placements: ``{table name: TablePlacement}`` (a backend's own plan:
      ``{stack or table name: TablePlacement}``, see ``planning.py``).
  """

  num_replicas: int
  policy: PlacementPolicy
  placements: dict[str, TablePlacement]

  @property
  def row_threshold(self) -> int:
    """Tables with more rows are row-sharded (``policy.row_threshold``)."""
    return self.policy.row_threshold

  def bytes_per_replica(self) -> list[int]:
    """Total table and slot bytes held by each replica."""
    totals = [0] * self.num_replicas
    for placement in self.placements.values():
      for r, size in enumerate(placement.bytes_per_replica()):
        totals[r] += size
    return totals

  def report(self) -> str:
    """A human-readable table of placements and bytes per replica."""
    fixed = [
      f"{n} {k}" for n, k in self.policy.forced.items() if n in self.placements
    ]
    forced = f" (placement fixed: {', '.join(fixed)})" if fixed else ""
    lines = [
      f"{self.num_replicas} replica(s), tables with more than "
      f"{self.row_threshold:,} rows are row-sharded{forced}",
      f"{'table':<24} {'placement':<12} {'rows/replica':>14} "
      f"{'MiB/replica':>12}  stack",
    ]
    for p in self.placements.values():
      lines.append(
        f"{p.table:<24} {p.kind:<12} {max(p.shard_sizes):>14,} "
        f"{max(p.bytes_per_replica()) / 2**20:>12.2f}  {p.stack or '-'}"
      )
    total = max(self.bytes_per_replica()) / 2**20
    lines.append(f"{'total (largest replica)':<51} {total:>12.2f}")
    return "\n".join(lines)


def shard_sizes(rows: int, num_shards: int) -> tuple[int, ...]:
  """Rows per shard, the first ``rows % num_shards`` one larger."""
  base, extra = divmod(rows, num_shards)
  return tuple(base + (1 if i < extra else 0) for i in range(num_shards))


def placement(table: TableConfig, kind: str, num_shards: int) -> TablePlacement:
  """A named ``table``'s placement of kind ``kind`` over ``num_shards``.

  Example:
    >>> placement(TableConfig(5, 4, name="t"), ROW_SHARDED, 2).shard_sizes
    (3, 2)
  """
  if kind == ROW_SHARDED:
    sizes = shard_sizes(table.vocabulary_size, num_shards)
    offsets = tuple(sum(sizes[:r]) for r in range(num_shards))
  else:
    sizes = (table.vocabulary_size,) * num_shards
    offsets = (0,) * num_shards
  num_slots = len(table.optimizer.SLOT_NAMES) if table.optimizer else 0
  storage = table.storage
  return TablePlacement(
    table_name(table),
    kind,
    sizes,
    offsets,
    table.dim,
    num_slots,
    parameter_bytes=storage.parameter_dtype.size,
    slot_bytes=storage.slot_dtype.size,
  )


def make_plan(
  tables: Sequence[TableConfig],
  num_replicas: int,
  row_threshold: int | PlacementPolicy = DEFAULT_ROW_THRESHOLD,
) -> ShardingPlan:
  """Places each of the named ``tables`` alone over ``num_replicas``: the
  placements a backend's ``Planner`` (``planning.py``) stacks tables from.

  Args:
    tables: named table configs (with their resolved optimizers).
    num_replicas: replicas in sync (1 gives every table whole).
    row_threshold: tables with more rows are row-sharded; 0 shards all.
      A ``PlacementPolicy`` also fixes the placement of the tables it
      names.

  Returns:
    The ``ShardingPlan``.

  Raises:
    ValueError: for a non-positive replica count or negative threshold, an
      unnamed table, or a policy naming a table not in ``tables``.
  """
  if num_replicas < 1:
    raise ValueError(f"num_replicas must be >= 1. Received: {num_replicas}")
  policy = PlacementPolicy.of(row_threshold)
  names = [table_name(t) for t in tables]
  policy.check_tables(names)
  placements = {}
  for name, table in zip(names, tables, strict=True):
    kind = policy.kind(name, table.vocabulary_size, num_replicas)
    placements[name] = placement(table, kind, num_replicas)
  return ShardingPlan(num_replicas, policy, placements)


def member_placement(
  stack: TablePlacement, table: str, offset: int, rows: int
) -> TablePlacement:
  """The placement of a table held at ``offset`` in a stack.

  Example:
    >>> stack = TablePlacement("s", ROW_SHARDED, (6, 6), (0, 6), 4, 1)
    >>> p = member_placement(stack, "b", 4, 5)  # rows 4..8 of the stack
    >>> p.shard_sizes, p.shard_offsets, p.stack
    ((2, 3), (0, 2), 's')
  """
  sizes, offsets = [], []
  for first, size in zip(stack.shard_offsets, stack.shard_sizes, strict=True):
    a, b = max(first, offset), min(first + size, offset + rows)
    sizes.append(max(0, b - a))
    offsets.append(min(max(0, a - offset), rows))
  return dataclasses.replace(
    stack,
    table=table,
    shard_sizes=tuple(sizes),
    shard_offsets=tuple(offsets),
    stack=stack.table,
  )
