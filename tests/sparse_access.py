"""Which ops a traced step gives the tables' variables: the row-only proof.

A training step must never read or write a whole table. Untouched rows
staying equal cannot tell a sparse update from a dense read-modify-write,
so the traced step itself is inspected: ``step_accesses`` follows the
handle of every table, slot and vocabulary-state variable a traced
function captures through its whole graph (into nested functions:
``tf.function`` calls, ``cond`` and ``while`` bodies, Keras' step
functions; through ``Identity``) and returns each op that receives one.
``whole_accesses`` keeps those that are not row ops: ``ReadVariableOp``,
``AssignVariableOp``, a dense ``ResourceApply*``, or any op this module
does not know (an unknown consumer counts as whole-table access: the
check can fail wrongly, never pass wrongly). An op's type does not say
which rows it is given (a gather of every row id would pass), nor what a
kernel does inside: tests/kernels/test_kernel_row_guard.py runs the kernels and
whole steps with the tables' other rows unreachable.

Used in this process by tests/test_sparse_access.py and
tests/layers/test_mirrored.py, and inside the worker processes of
tests/distributed/ (MultiWorkerMirrored, parameter servers, Keras ``fit``
on workers), which print ``row_only_report`` for their tests to check.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any
from typing import NamedTuple

#: Ops that read or write rows by id (Tpe*: this package's kernels,
#: tpu_embedding/kernels/gather_rows.cc, fused_update.cc and
#: vocabulary_step.cc, whose own row-only proof is
#: tests/kernels/test_kernel_row_guard.py).
ROW_OPS = (
  "ResourceGather",
  "ResourceScatter",
  "ResourceSparseApply",
  "TpeGatherRows",
  "TpeFusedSparseApply",
  "TpeVocabularyStep",
)
READ_OPS = ("ResourceGather", "TpeGatherRows")
WRITE_OPS = ("ResourceScatter", "ResourceSparseApply", "TpeFusedSparseApply")

#: Ops given a handle that read its shape, never its values.
METADATA_OPS = ("VariableShape",)

#: Ops whose output ``i`` is their input ``i``.
_PASS_THROUGH = ("Identity", "IdentityN")


class Tracked(NamedTuple):
  """A variable the proof follows.

  Attributes:
    label: ``<table or stack>/<slot>`` (``parameters`` for the table), or
      ``<table>/vocabulary/<array>`` for a dynamic vocabulary's state.
    scalar: a scalar (a vocabulary's ``step`` and ``evictions``: read and
      written whole by design, one int64 each); exempt.
  """

  label: str
  scalar: bool


def tracked_variables(embedding: Any) -> dict[int, Tracked]:
  """``{id(handle): Tracked}`` of this process's table, slot and
  vocabulary-state variables of a built mid-level ``embedding`` (the
  backend's stores: stacked tables share one)."""
  tracked = {}
  for name, store in embedding.backend.stores.items():
    for block in store.blocks:
      for key, variable in block.items():
        tracked[id(variable.handle)] = Tracked(f"{name}/{key}", False)
  for name, state in embedding.engine.dynamic_tables.states.items():
    for copy in state.copies:
      for key, variable in copy.variables.items():
        tracked[id(variable.handle)] = Tracked(
          f"{name}/vocabulary/{key}", variable.shape.rank == 0
        )
  return tracked


def expected_labels(embedding: Any) -> set[str]:
  """The labels of every table and slot (not vocabulary state): what a
  training step must touch, row by row."""
  return {
    f"{name}/{key}"
    for name, store in embedding.backend.stores.items()
    for key in store.keys
  }


def concrete_functions(function: Any) -> list[Any]:
  """Every graph ``function`` traced: a ``tf.function``'s concrete
  functions, or those of the ``tf.function``s a plain Python function
  closes over (Keras 3's ``model.train_function`` calls them)."""
  found, seen, pending = [], set(), [function]
  while pending:
    candidate = pending.pop()
    if id(candidate) in seen:
      continue
    seen.add(id(candidate))
    # TensorFlow keeps no public list of a tf.function's traces.
    listing = getattr(candidate, "_list_all_concrete_functions", None)
    if listing is not None:
      found.extend(listing())
      continue
    for cell in getattr(candidate, "__closure__", None) or ():
      try:
        value = cell.cell_contents
      except ValueError:  # An empty cell.
        continue
      if callable(value):
        pending.append(value)
  return found


def step_accesses(
  functions: Iterable[Any], tracked: dict[int, Tracked]
) -> dict[str, set[Tracked]]:
  """``{op type: {Tracked}}``: every op, in ``functions`` (concrete
  functions) and every function they call, that receives the handle of a
  tracked variable.

  Raises:
    AssertionError: when no function captures a tracked variable.
  """
  accesses: dict[str, set[Tracked]] = {}
  captured = False
  for function in functions:
    graph = function.graph
    marks = {
      (internal.op.name, 0): tracked[id(external)]
      for external, internal in graph.captures
      if id(external) in tracked
    }
    captured = captured or bool(marks)
    graph_def = graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    _walk(graph_def.node, marks, _Library(library, accesses))
  assert captured, "no tracked variable is captured by the step"
  return accesses


def whole_accesses(
  accesses: dict[str, set[Tracked]],
) -> dict[str, list[str]]:
  """``{op type: [labels]}`` of the accesses that are not row ops (nor
  metadata reads) on a table, slot or vocabulary array: none, where a
  step touches only the rows it looks up."""
  whole = {}
  for op, variables in accesses.items():
    if op.startswith(ROW_OPS + METADATA_OPS):
      continue
    labels = sorted(v.label for v in variables if not v.scalar)
    if labels:
      whole[op] = labels
  return whole


def touched(accesses: dict[str, set[Tracked]], ops: tuple[str, ...]) -> set:
  """Labels of the variables given to ``ops`` (prefixes of op types)."""
  return {
    v.label
    for op, variables in accesses.items()
    if op.startswith(ops)
    for v in variables
  }


def check_row_only(
  functions: Iterable[Any], embedding: Any, expect_every_table: bool = True
) -> dict[str, list[str]]:
  """Asserts the traced ``functions`` touch ``embedding``'s tables, slots
  and vocabulary arrays through row ops only (and, with
  ``expect_every_table``, gather every table's rows and write every
  table and slot row by row).

  Returns:
    ``{op type: [labels]}`` of every access, for a report.

  Raises:
    AssertionError: naming the whole-table accesses, or the tables a
      step never reads or writes by rows.
  """
  accesses = step_accesses(functions, tracked_variables(embedding))
  whole = whole_accesses(accesses)
  assert not whole, f"whole-table access in the step: {whole}"
  if expect_every_table:
    expected = expected_labels(embedding)
    looked_up = {label for label in expected if label.endswith("/parameters")}
    read, written = touched(accesses, READ_OPS), touched(accesses, WRITE_OPS)
    assert looked_up <= read, f"not gathered by rows: {looked_up - read}"
    assert expected <= written, f"not written by rows: {expected - written}"
  return {op: sorted(v.label for v in vs) for op, vs in accesses.items()}


#: The line a worker process prints (``row_only_report``) for its test.
REPORT_PREFIX = "row-only step:"


def row_only_report(name: str, accesses: dict[str, list[str]]) -> str:
  """One line naming a checked step and the ops its tables got."""
  return (
    f"{REPORT_PREFIX} {json.dumps({'step': name, 'ops': sorted(accesses)})}"
  )


def reports(output: str) -> dict[str, list[str]]:
  """``{step name: op types}`` of the ``row_only_report`` lines in a
  process's output."""
  found = {}
  for line in output.splitlines():
    if line.startswith(REPORT_PREFIX):
      report = json.loads(line[len(REPORT_PREFIX) :])
      found[report["step"]] = report["ops"]
  return found


class _Library(NamedTuple):
  functions: dict[str, Any]
  accesses: dict[str, set[Tracked]]


def _tensor(ref: str) -> tuple[str, int]:
  """``(node, output)`` of a node input (``name``, ``name:i`` at the top
  level; ``arg`` or ``node:output_arg:i`` in a function body)."""
  parts = ref.split(":")
  return parts[0], int(parts[-1]) if len(parts) > 1 else 0


def _functions_called(node: Any) -> list[str]:
  """Names of the functions ``node`` runs (calls, branches, loop bodies)."""
  names = []
  for attr in node.attr.values():
    if attr.HasField("func"):
      names.append(attr.func.name)
    names.extend(f.name for f in attr.list.func)
  return names


def _walk(
  nodes: Any,
  marks: dict[tuple[str, int], Tracked],
  library: _Library,
) -> None:
  """Records the ops of ``nodes`` given a marked tensor in
  ``library.accesses``; marks (in place) what passes a handle on."""
  while True:
    before = len(marks)
    for node in nodes:
      inputs = [ref for ref in node.input if not ref.startswith("^")]
      given = {
        position: marks[key]
        for position, ref in enumerate(inputs)
        if (key := _tensor(ref)) in marks
      }
      if not given:
        continue
      for output, variable in _consume(node, len(inputs), given, library):
        marks.setdefault((node.name, output), variable)
    if len(marks) == before:
      return


def _consume(
  node: Any, arity: int, given: dict[int, Tracked], library: _Library
) -> list[tuple[int, Tracked]]:
  """Follows handles into the functions ``node`` runs, or records it as
  an access; returns ``(output, variable)`` for outputs that are handles."""
  if node.op in _PASS_THROUGH:
    return list(given.items())
  called = _functions_called(node)
  if not called:
    for variable in given.values():
      library.accesses.setdefault(node.op, set()).add(variable)
    return []
  outputs = []
  for name in called:
    function = library.functions[name]
    arguments = function.signature.input_arg
    # The function's arguments are the node's last inputs (a call or a
    # loop: all of them; a branch: all but the condition or index).
    offset = arity - len(arguments)
    if offset not in (0, 1) or min(given) < offset:
      for variable in given.values():  # Unknown: counted as whole.
        library.accesses.setdefault(node.op, set()).add(variable)
      continue
    inner = {
      (arguments[position - offset].name, 0): variable
      for position, variable in given.items()
    }
    _walk(function.node_def, inner, library)
    for index, output in enumerate(function.signature.output_arg):
      key = _tensor(function.ret[output.name])
      if key in inner:
        outputs.append((index, inner[key]))
  return outputs
