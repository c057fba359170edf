"""Table stacking: tables that update alike, held and looked up as one.

Tables with the same width, the same optimizer settings and the same
placement are stored as one variable (and one per optimizer slot), each
table's rows at an offset in it, the way TensorFlow's ``TPUEmbeddingV2``
stacks tables on SparseCore. A step then deduplicates, gathers and
updates each stack once instead of once per table: per-op overhead stops
growing with the number of tables.

Stacking changes nothing users see: ``embedding_tables``, ``variables``,
checkpoints (each table under its own key with its full
``[vocabulary_size, dim]`` value), serving and export are per table.

``table_stacking`` (as keras-rs names it):

* ``"auto"`` (default): on accelerators (GPUs), and on CPUs when several
  replicas of one process share the tables (``MirroredStrategy``), tables
  are grouped by (width, optimizer, placement, quantization); a group of
  one is not a stack, and tables whose optimizer has a
  ``slot_variable_creation_fn`` or whose key mapping is never stacked
  (``keys.KeyMapping.unstackable``: a dynamic table's) stay alone. On one
  CPU device ``"auto"``
  keeps every table alone: measured on 2 cores (``tools/benchmark.py
  --table_stacking``), the tables' independent steps run concurrently on
  the cores while a stack runs as one chain, and stacking lost 26 x
  200,000 x 64 (Zipf ids: 188k vs 313k examples/s; uniform: 110k vs
  216k) and 26 x 2,000 (303k vs 462k). With several replicas each replica
  runs its own chain while the others run theirs, and stacking cuts the
  ops every replica runs per table: 26 x 200,000 x 64 sharded, uniform
  ids, stacked vs alone, 134k vs 112k examples/s on 2 replicas, 97k vs
  89k on 4. Layouts that cannot stack (tables over several workers or
  parameter servers) keep every table alone.
* ``None``: no stacking.
* a list of table-name lists (or one list of names): exactly those
  stacks; the members must be compatible.

Example:
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.resolved import resolve
  >>> a, b, c = (tpe.TableConfig(10, 4, name=n) for n in "abc")
  >>> d = tpe.TableConfig(10, 8, name="d")
  >>> config = resolve([tpe.FeatureConfig(t) for t in (a, b, c, d)],
  ...                  tpe.SGD(0.1))
  >>> [s.names for s in plan_stacks(config.tables, "auto")]
  [('a', 'b', 'c'), ('d',)]
  >>> stack = plan_stacks(config.tables, "auto")[0]
  >>> stack.config.vocabulary_size, stack.offsets
  (30, (0, 10, 20))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from tpu_embedding.config import TableConfig
from tpu_embedding.resolved import key_mapping
from tpu_embedding.resolved import table_name
from tpu_embedding.tables.initial_values import StackedInitializer

#: What ``table_stacking`` accepts.
TableStacking = str | Sequence[str] | Sequence[Sequence[str]] | None

_BAD_VALUE = (
  "table_stacking must be 'auto', None or lists of table names. Received: {!r}"
)

#: ``placement(table) -> str``: the layout kind a table would get alone.
PlacementOf = Callable[[TableConfig], str]


@dataclasses.dataclass(frozen=True)
class TableStack:
  """Tables held as one.

  Attributes:
    tables: the member tables (resolved), in config order.
    offsets: first row of each member in the stack.
    config: the stack as one table: its name, total rows, the members'
      width and optimizer (for a single table, the table itself).
  """

  tables: tuple[TableConfig, ...]
  offsets: tuple[int, ...]
  config: TableConfig

  @property
  def name(self) -> str:
    return table_name(self.config)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(table_name(t) for t in self.tables)

  @property
  def stacked(self) -> bool:
    """Whether this holds several tables (one table is not a stack)."""
    return len(self.tables) > 1


def stack_of(tables: Sequence[TableConfig], index: int) -> TableStack:
  """The ``TableStack`` of ``tables`` (one table: itself, unchanged)."""
  if len(tables) == 1:
    return TableStack(tuple(tables), (0,), tables[0])
  offsets, total = [], 0
  for table in tables:
    offsets.append(total)
    total += table.vocabulary_size
  first = tables[0]
  config = TableConfig(
    vocabulary_size=total,
    dim=first.dim,
    initializer=StackedInitializer(list(zip(offsets, tables, strict=True))),
    optimizer=first.optimizer,
    combiner="sum",
    name=_stack_name([table_name(t) for t in tables], index),
    quantization_config=first.quantization_config,
    storage=first.storage,
  )
  return TableStack(tuple(tables), tuple(offsets), config)


def _stack_name(names: list[str], index: int) -> str:
  joined = "_".join(names)
  if len(joined) <= 48 and all(c.isalnum() or c in "_-." for c in joined):
    return f"stack_{joined}"
  return f"stack_{index}_{len(names)}_tables"


def _signature(table: TableConfig, placement: PlacementOf) -> tuple | None:
  """Tables with equal signatures may stack; None: this one cannot."""
  optimizer = table.optimizer
  if optimizer is None or optimizer.slot_variable_creation_fn is not None:
    return None
  if key_mapping(table).unstackable is not None:
    return None
  return (
    table.dim,
    optimizer,
    placement(table),
    table.quantization_config,
    table.storage,
  )


def _incompatibility(
  table: TableConfig, first: TableConfig, placement: PlacementOf
) -> str | None:
  """Why ``table`` cannot stack with ``first`` (None: it can)."""
  optimizer = table.optimizer
  if optimizer is None:
    return "it has no optimizer"
  if optimizer.slot_variable_creation_fn is not None:
    return "its optimizer has a slot_variable_creation_fn"
  unstackable = key_mapping(table).unstackable
  unstackable = unstackable or key_mapping(first).unstackable
  if unstackable is not None:
    return unstackable
  if table.dim != first.dim:
    return f"its dim is {table.dim}, not {first.dim}"
  if optimizer != first.optimizer:
    return f"its optimizer {optimizer!r} differs from {first.optimizer!r}"
  if placement(table) != placement(first):
    return f"it is {placement(table)}, not {placement(first)}"
  if table.quantization_config != first.quantization_config:
    return "its quantization_config differs"
  if table.storage != first.storage:
    return f"its storage {table.storage!r} differs from {first.storage!r}"
  return None


def _same_kind(table: TableConfig) -> str:
  return "whole"


def auto_stacks(on_accelerators: bool, replicas: int) -> bool:
  """Whether ``table_stacking="auto"`` stacks (measured: module docstring).

  On accelerators, and with several replicas in one process; not on one
  CPU device.

  Example:
    >>> auto_stacks(False, 1), auto_stacks(False, 2), auto_stacks(True, 1)
    (False, True, True)
  """
  return on_accelerators or replicas > 1


def plan_stacks(
  tables: Sequence[TableConfig],
  table_stacking: TableStacking = "auto",
  placement: PlacementOf = _same_kind,
  can_stack: bool = True,
  where: str = "",
  auto: bool = True,
) -> list[TableStack]:
  """Groups ``tables`` into stacks (every table in exactly one).

  Args:
    tables: the resolved tables, in config order.
    table_stacking: ``"auto"``, None, or explicit lists of table names.
    placement: the layout kind each table gets alone; tables of
      different kinds never stack.
    can_stack: whether the layouts in use can hold stacks; if not,
      ``"auto"`` stacks nothing and explicit stacks are an error.
    where: what cannot stack, for that error (e.g. the strategy).
    auto: whether ``"auto"`` stacks (on the devices in use it pays off);
      if not, ``"auto"`` keeps every table alone.

  Returns:
    The stacks, in the config order of their earliest table.

  Raises:
    ValueError: for an unknown value, unknown or repeated table names,
      members that cannot stack, or explicit stacks where layouts cannot
      hold them.
  """
  by_name = {table_name(t): t for t in tables}
  groups: list[list[TableConfig]]
  if table_stacking is None:
    groups = [[t] for t in tables]
  elif isinstance(table_stacking, str):
    if table_stacking != "auto":
      raise ValueError(_BAD_VALUE.format(table_stacking))
    if can_stack and auto:
      groups = _auto_groups(tables, placement)
    else:
      groups = [[t] for t in tables]
  else:
    groups = _explicit_groups(tables, by_name, table_stacking, placement)
    if not can_stack and any(len(g) > 1 for g in groups):
      raise ValueError(
        f"table_stacking={table_stacking!r}: tables cannot be stacked "
        f"{where or 'here'}; use table_stacking='auto' or None."
      )
  order = {table_name(t): i for i, t in enumerate(tables)}
  groups.sort(key=lambda g: min(order[table_name(t)] for t in g))
  return [stack_of(group, i) for i, group in enumerate(groups)]


def _auto_groups(
  tables: Sequence[TableConfig], placement: PlacementOf
) -> list[list[TableConfig]]:
  groups: dict[Any, list[TableConfig]] = {}
  alone: list[list[TableConfig]] = []
  for table in tables:
    signature = _signature(table, placement)
    if signature is None:
      alone.append([table])
    else:
      groups.setdefault(signature, []).append(table)
  return list(groups.values()) + alone


def _explicit_groups(
  tables: Sequence[TableConfig],
  by_name: dict[str, TableConfig],
  table_stacking: Sequence[Any],
  placement: PlacementOf,
) -> list[list[TableConfig]]:
  if not isinstance(table_stacking, Sequence):
    raise ValueError(_BAD_VALUE.format(table_stacking))
  lists = list(table_stacking)
  if lists and all(isinstance(n, str) for n in lists):
    lists = [lists]  # One stack given as a list of names.
  seen: set[str] = set()
  groups = []
  for names in lists:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
      raise ValueError(_BAD_VALUE.format(table_stacking))
    if not names:
      raise ValueError("table_stacking has an empty stack ([]).")
    group = []
    for name in names:
      if name not in by_name:
        raise ValueError(
          f"table_stacking names table {name!r}, which is not among the "
          f"tables {sorted(by_name)}."
        )
      if name in seen:
        raise ValueError(
          f"table_stacking puts table {name!r} in more than one stack."
        )
      seen.add(name)
      group.append(by_name[name])
    for table in group if len(group) > 1 else []:
      reason = _incompatibility(table, group[0], placement)
      if reason is not None:
        raise ValueError(
          f"table_stacking: table {table_name(table)!r} cannot be stacked "
          f"with {table_name(group[0])!r}: {reason}."
        )
    groups.append(group)
  groups += [[t] for t in tables if table_name(t) not in seen]
  return groups
