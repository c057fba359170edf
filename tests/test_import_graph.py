"""The package's folders import each other one way, down the layers.

Every import counts: at module level, inside functions, and under
``TYPE_CHECKING``. A *unit* is a folder (a subpackage, all its modules
together) or a top-level module; ``LAYERS`` orders them, bottom first, and
a unit imports only units of lower layers (ARCHITECTURE.md: imports flow
one way). Within a unit, modules import each other without circles. An
import against the layers means code in the wrong place: move it to the
layer it belongs to, or pass it in, instead of hiding the import in a
function.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import tpu_embedding

PACKAGE = pathlib.Path(tpu_embedding.__file__).parent


#: The units, bottom first. A unit imports only units of the layers before
#: its own (never one of its layer, or above). A new folder or top-level
#: module takes its place here.
LAYERS: tuple[tuple[str, ...], ...] = (
  # Foundations: TensorFlow's private names, errors, small helpers, the
  # gradients' types, initializers.
  (
    "compat",
    "errors",
    "allocator",
    "data",
    "run_lock",
    "gradients",
    "initializers",
  ),
  # How inputs become rows (KeyMapping, DynamicVocabulary), the optimizers'
  # rules, replicas, variables.
  # Checkpoint files (one home: checkpointing/; checkpoints, its public
  # names).
  # How rows are stored (RowStorage).
  ("keys", "optimizers", "replicas", "checkpointing", "row_storage"),
  # A task of a parameter-server cluster, set up for tables.
  ("servers",),
  # Table variables as checkpoint dependencies (read part by part).
  ("tracking",),
  ("checkpoints",),
  # What the user declares, and its types.
  ("config",),
  ("types", "kernels"),
  ("structure",),
  ("resolved",),
  # Placement; inputs as ids.
  ("sharding", "inputs"),
  ("lookup",),
  # One table (or stack) in one layout: the row store.
  ("tables",),
  ("stacking",),
  ("planning",),
  # Rows to and from the stores; the memory check.
  ("backends", "memory"),
  ("vocabularies",),
  # The off-TPU step: lookups into activations, its bookkeeping, when
  # updates land.
  ("step",),
  # The engines (one per platform), serving.
  ("engines", "serving"),
  ("embedding",),
  # Keras layers and exports, on top of the engines.
  ("layers", "export"),
  # FDO measures any config kind (ours, TensorFlow's, keras-rs').
  ("fdo",),
  # The public names (tpu_embedding/__init__.py).
  ("__init__",),
)


def _modules() -> dict[str, pathlib.Path]:
  modules = {}
  for path in PACKAGE.rglob("*.py"):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    modules[".".join(parts)] = path
  return modules


def _imported(
  node: ast.AST, module: str, is_package: bool, modules: dict[str, object]
) -> list[str]:
  """The package's modules that one import statement imports."""
  if isinstance(node, ast.Import):
    names = [alias.name for alias in node.names]
  elif isinstance(node, ast.ImportFrom):
    base = node.module or ""
    if node.level:
      here = module.split(".") if is_package else module.split(".")[:-1]
      here = here[: len(here) - node.level + 1]
      base = ".".join(here + ([base] if base else []))
    names = [
      f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
      for alias in node.names
    ]
  else:
    return []
  found = []
  for name in names:
    while name and name not in modules:  # an attribute of a module
      name = name.rpartition(".")[0]
    if name and name != module:
      found.append(name)
  return found


def import_graph() -> dict[str, dict[str, int]]:
  """``{module: {imported module: line}}`` over the whole package."""
  modules = _modules()
  graph: dict[str, dict[str, int]] = {}
  for module, path in modules.items():
    edges = graph.setdefault(module, {})
    for node in ast.walk(ast.parse(path.read_text())):
      for name in _imported(node, module, path.name == "__init__.py", modules):
        edges.setdefault(name, node.lineno)
  return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  found: list[list[str]] = []

  def visit(module: str) -> None:
    index[module] = low[module] = len(index)
    stack.append(module)
    for other in graph[module]:
      if other not in index:
        visit(other)
        low[module] = min(low[module], low[other])
      elif other in stack:
        low[module] = min(low[module], index[other])
    if low[module] == index[module]:
      component = []
      while True:
        other = stack.pop()
        component.append(other)
        if other == module:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for module in sorted(graph):
    if module not in index:
      visit(module)
  return found


def test_the_modules_of_a_folder_import_each_other_without_circles():
  graph = import_graph()
  found = circles(graph)
  lines = [
    f"{a}:{graph[a][b]} imports {b}"
    for component in found
    for a in component
    for b in graph[a]
    if b in component
  ]
  assert not found, "Import circles:\n" + "\n".join(lines)


def unit(module: str) -> str:
  """The layer unit of a module: its folder, or itself at the top level."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def against_the_layers(
  graph: dict[str, dict[str, int]], layers: tuple[tuple[str, ...], ...]
) -> list[str]:
  """Each import of a unit of the same or a higher layer, as text."""
  layer = {name: i for i, names in enumerate(layers) for name in names}
  return [
    f"{a}:{line} imports {b} ({unit(a)}, layer {layer[unit(a)]}, imports "
    f"{unit(b)}, layer {layer[unit(b)]})"
    for a in sorted(graph)
    for b, line in sorted(graph[a].items())
    if unit(a) != unit(b) and layer[unit(b)] >= layer[unit(a)]
  ]


def test_every_folder_and_top_level_module_has_one_layer():
  listed = [name for names in LAYERS for name in names]
  units = {unit(module) for module in _modules()}
  assert len(listed) == len(set(listed)), "A unit listed twice in LAYERS"
  assert set(listed) == units, (
    f"Not in LAYERS: {sorted(units - set(listed))}; "
    f"in LAYERS but not in the package: {sorted(set(listed) - units)}"
  )


def test_folders_import_down_the_layers():
  found = against_the_layers(import_graph(), LAYERS)
  assert not found, "Imports against LAYERS:\n" + "\n".join(found)


@pytest.mark.parametrize(
  "source, expected",
  [
    ("from tpu_embedding.low import x", []),
    ("from tpu_embedding.high.b import x", ["tpu_embedding.mid.a:1"]),
    ("def f():\n  from tpu_embedding import high", ["tpu_embedding.mid.a:2"]),
    ("from tpu_embedding.mid.c import x", []),
    ("from tpu_embedding import side", ["tpu_embedding.mid.a:1"]),
  ],
  ids=["down", "up", "up_in_a_function", "same_folder", "same_layer"],
)
def test_imports_against_the_layers_are_found(source, expected):
  modules = {
    name: 0
    for name in (
      "tpu_embedding.low",
      "tpu_embedding.mid.a",
      "tpu_embedding.mid.c",
      "tpu_embedding.side",
      "tpu_embedding.high",
      "tpu_embedding.high.b",
    )
  }
  graph: dict[str, dict[str, int]] = {name: {} for name in modules}
  for node in ast.walk(ast.parse(source)):
    for name in _imported(node, "tpu_embedding.mid.a", False, modules):
      graph["tpu_embedding.mid.a"][name] = node.lineno
  layers = (("low",), ("mid", "side"), ("high",))
  found = against_the_layers(graph, layers)
  assert [text.split(" ")[0] for text in found] == expected


@pytest.mark.parametrize(
  "source, expected",
  [
    ("import tpu_embedding.b", [["tpu_embedding.a", "tpu_embedding.b"]]),
    ("from tpu_embedding import b", [["tpu_embedding.a", "tpu_embedding.b"]]),
    ("from . import b", [["tpu_embedding.a", "tpu_embedding.b"]]),
    (
      "def f():\n  from tpu_embedding.b import x",
      [["tpu_embedding.a", "tpu_embedding.b"]],
    ),
    ("from tpu_embedding.c import x", []),
  ],
  ids=["import", "from_package", "relative", "in_a_function", "no_circle"],
)
def test_circles_are_found_whatever_the_import_form(source, expected):
  modules = {"tpu_embedding.a": 0, "tpu_embedding.b": 0, "tpu_embedding.c": 0}
  graph: dict[str, dict[str, int]] = {name: {} for name in modules}
  graph["tpu_embedding.b"]["tpu_embedding.a"] = 1
  for node in ast.walk(ast.parse(source)):
    for name in _imported(node, "tpu_embedding.a", False, modules):
      graph["tpu_embedding.a"][name] = node.lineno
  assert circles(graph) == expected


#: Private modules of TensorFlow and Keras: only ``compat.py`` imports them.
PRIVATE = ("tensorflow.python", "tensorflow.core", "keras.src", "tf_keras.src")


def private_imports(source: str) -> list[tuple[int, str]]:
  """``(line, module)`` of each private TensorFlow/Keras import."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level:
      names = [node.module or ""]
    else:
      continue
    found += [
      (node.lineno, name)
      for name in names
      if any(name == p or name.startswith(p + ".") for p in PRIVATE)
    ]
  return found


def test_only_compat_imports_private_tensorflow_modules():
  found = [
    f"{name}:{line} imports {module}"
    for name, path in sorted(_modules().items())
    if name != "tpu_embedding.compat"
    for line, module in private_imports(path.read_text())
  ]
  assert not found, (
    "Private TensorFlow/Keras imports belong in compat.py, with what they "
    "are for:\n" + "\n".join(found)
  )


def test_private_imports_are_found_in_functions_too():
  source = "def f():\n  from tensorflow.python.checkpoint import save_util\n"
  assert private_imports(source) == [(2, "tensorflow.python.checkpoint")]
  assert private_imports("import tensorflow as tf") == []
