"""The sharding plan: which table is replicated, which is row-sharded.

A table with more rows than ``row_threshold`` is split into contiguous row
blocks, one per replica ("div" sharding, the layout of
``tf.distribute`` sharded variables): replica ``r`` holds rows
``[offsets[r], offsets[r] + sizes[r])``, the first ``vocabulary_size % N``
replicas one row more. Smaller tables are replicated: every replica holds a
full copy and applies the same (globally summed) update to it. A
``RowThreshold`` fixes the placement of chosen tables whatever their size.

The plan holds no variables; it is inspectable (``report()``) before any
memory is spent.

Example:
  >>> import tpu_embedding as tpe
  >>> big = tpe.TableConfig(1_000_000, 64, name="items")
  >>> small = tpe.TableConfig(100, 8, name="countries")
  >>> plan = make_plan([big, small], num_replicas=4, row_threshold=10_000)
  >>> plan.placements["items"].shard_sizes
  (250000, 250000, 250000, 250000)
  >>> plan.placements["countries"].kind
  'replicated'
  >>> forced = RowThreshold(10_000, {"countries": ROW_SHARDED})
  >>> make_plan([big, small], 4, forced).placements["countries"].shard_sizes
  (25, 25, 25, 25)
"""

from __future__ import annotations

import dataclasses
import types
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


class RowThreshold(int):
  """A row-sharding threshold that fixes the placement of some tables.

  An ``int``: the threshold of the tables it does not name, accepted
  wherever ``row_sharding_threshold`` is (``TPUEmbedding``, the Keras
  layers, the backends). The tables it names are placed as it says
  (``ROW_SHARDED`` or ``REPLICATED``) whatever their size; with a single
  replica every table is whole anyway. ``DistributedEmbedding`` builds
  one from keras-rs placements.

  Attributes:
    forced: ``{table name: ROW_SHARDED or REPLICATED}`` (read-only).

  Example:
    >>> threshold = RowThreshold(10_000, {"users": ROW_SHARDED})
    >>> int(threshold), dict(threshold.forced)
    (10000, {'users': 'row_sharded'})
  """

  forced: Mapping[str, str]

  def __new__(cls, threshold: int, forced: Mapping[str, str]) -> RowThreshold:
    """Creates the threshold.

    Args:
      threshold: rows above which the other tables are row-sharded.
      forced: ``{table name: ROW_SHARDED or REPLICATED}``.

    Raises:
      ValueError: for another placement than those two.
    """
    for name, kind in forced.items():
      if kind not in (ROW_SHARDED, REPLICATED):
        raise ValueError(
          f"Table {name!r}: placement {kind!r} is neither {ROW_SHARDED!r} "
          f"nor {REPLICATED!r}."
        )
    self = super().__new__(cls, threshold)
    self.forced = types.MappingProxyType(dict(forced))
    return self

  def __reduce__(self) -> tuple[type, tuple[int, dict[str, str]]]:
    return (RowThreshold, (int(self), dict(self.forced)))

  def __repr__(self) -> str:
    return f"RowThreshold({int(self)}, {dict(self.forced)!r})"


def placement_kind(
  name: str, vocabulary_size: int, num_replicas: int, row_threshold: int
) -> str:
  """``ROW_SHARDED`` or ``REPLICATED`` for one table (the plan's rule).

  A table with fewer rows than replicas is always replicated: a row
  block per replica would leave some replica without rows, and a copy of
  so few rows costs nothing.

  Example:
    >>> placement_kind("t", 50, 2, 10), placement_kind("t", 50, 1, 10)
    ('row_sharded', 'replicated')
    >>> placement_kind("t", 3, 4, 0)  # fewer rows than replicas
    'replicated'
  """
  if num_replicas == 1 or vocabulary_size < num_replicas:
    return REPLICATED
  if isinstance(row_threshold, RowThreshold) and name in row_threshold.forced:
    return row_threshold.forced[name]
  return ROW_SHARDED if vocabulary_size > row_threshold else REPLICATED


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
  """

  table: str
  kind: str
  shard_sizes: tuple[int, ...]
  shard_offsets: tuple[int, ...]
  dim: int
  num_slots: int
  stack: str | None = None

  @property
  def sharded(self) -> bool:
    return self.kind == ROW_SHARDED

  def bytes_per_replica(self) -> list[int]:
    """Parameter plus slot bytes held by each replica."""
    per_row = self.dim * _FLOAT_BYTES * (1 + self.num_slots)
    return [size * per_row for size in self.shard_sizes]


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
  """Placement of every table over ``num_replicas`` replicas."""

  num_replicas: int
  row_threshold: int
  placements: dict[str, TablePlacement]

  def bytes_per_replica(self) -> list[int]:
    """Total table and slot bytes held by each replica."""
    totals = [0] * self.num_replicas
    for placement in self.placements.values():
      for r, size in enumerate(placement.bytes_per_replica()):
        totals[r] += size
    return totals

  def report(self) -> str:
    """A human-readable table of placements and bytes per replica."""
    forced = ""
    if isinstance(self.row_threshold, RowThreshold):
      fixed = [
        f"{n} {k}"
        for n, k in self.row_threshold.forced.items()
        if n in self.placements  # (a stack's placement is its tables')
      ]
      forced = f" (placement fixed: {', '.join(fixed)})" if fixed else ""
    lines = [
      f"{self.num_replicas} replica(s), tables with more than "
      f"{int(self.row_threshold):,} rows are row-sharded{forced}",
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


def make_plan(
  tables: Sequence[TableConfig],
  num_replicas: int,
  row_threshold: int = DEFAULT_ROW_THRESHOLD,
) -> ShardingPlan:
  """Plans the placement of named ``tables`` over ``num_replicas``.

  Args:
    tables: named table configs (with their resolved optimizers).
    num_replicas: replicas in sync (1 gives every table whole).
    row_threshold: tables with more rows are row-sharded; 0 shards all.
      A ``RowThreshold`` also fixes the placement of the tables it names.

  Returns:
    The ``ShardingPlan``.

  Raises:
    ValueError: for a non-positive replica count or negative threshold, an
      unnamed table, or a ``RowThreshold`` naming a table not in
      ``tables``.
  """
  if num_replicas < 1:
    raise ValueError(f"num_replicas must be >= 1. Received: {num_replicas}")
  if row_threshold < 0:
    raise ValueError(f"row_threshold must be >= 0. Received: {row_threshold}")
  if isinstance(row_threshold, RowThreshold):
    names = {table_name(t) for t in tables}
    unknown = sorted(set(row_threshold.forced) - names)
    if unknown:
      raise ValueError(
        f"The row-sharding threshold fixes the placement of tables {unknown}"
        f", which are not among the tables {sorted(names)}."
      )
  placements: dict[str, TablePlacement] = {}
  for table in tables:
    name = table_name(table)
    num_slots = len(table.optimizer.SLOT_NAMES) if table.optimizer else 0
    kind = placement_kind(
      name, table.vocabulary_size, num_replicas, row_threshold
    )
    if kind == ROW_SHARDED:
      sizes = shard_sizes(table.vocabulary_size, num_replicas)
      offsets = tuple(sum(sizes[:r]) for r in range(num_replicas))
    else:
      sizes = (table.vocabulary_size,) * num_replicas
      offsets = (0,) * num_replicas
    placements[name] = TablePlacement(
      name, kind, sizes, offsets, table.dim, num_slots
    )
  return ShardingPlan(num_replicas, row_threshold, placements)


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
