"""Which kernel library this process loads, and why none when none.

``choose()`` decides without loading anything, in this order:

1. ``TPU_EMBEDDING_KERNELS=0``: none (the TensorFlow ops path, asked for).
2. A tuned library (``python3 -m tpu_embedding.kernels build``) for this
   TensorFlow, these sources and this CPU.
3. The portable libraries the install built into the package: the widest
   level this CPU runs, if they were built against the running TensorFlow
   (its version and commit, from ``build_info.json``). Run from a
   checkout's root, the installed copy's, if built from the same sources
   (``portable_directory``).

Otherwise none, with the reason in one line: no library was built at
install (no compiler then), another TensorFlow, a CPU below every level.
A library that fails to load (a symbol TensorFlow does not have) is
reported the same way by ``kernels.load()``; nothing ever compiles here.

Example:
  >>> choice = choose(directory="/nonexistent", tuned="/nonexistent.so")
  >>> choice.path is None, choice.reason.startswith("the install built no")
  (True, True)
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os

from tpu_embedding.kernels import build as builder

#: What the TensorFlow path's one-line message tells a user to do.
REMEDY = (
  "install a C++ compiler (e.g. `apt-get install g++`) and reinstall "
  "tpu_embedding, or run `python3 -m tpu_embedding.kernels build`"
)


@dataclasses.dataclass(frozen=True)
class Choice:
  """The library to load, or why there is none.

  Attributes:
    path: the library's file, or None.
    origin: ``"tuned"``, ``"package:<level>"`` or ``"none"``.
    reason: why there is no library ("" when there is one).
    asked: True when the user asked for the TensorFlow path.
  """

  path: str | None
  origin: str
  reason: str = ""
  asked: bool = False


def disabled() -> bool:
  """True when ``TPU_EMBEDDING_KERNELS=0`` asks for the TensorFlow path."""
  return os.environ.get("TPU_EMBEDDING_KERNELS", "1") == "0"


def choose(
  directory: str | None = None,
  tuned: str | None = None,
  cpu_flags: frozenset[str] | None = None,
  tensorflow: dict[str, str] | None = None,
) -> Choice:
  """The library this process should load (see the module docstring).

  Args:
    directory: where the portable libraries are (default: this package's
      kernels directory).
    tuned: the tuned library's path (default: ``build.tuned_library_path``).
    cpu_flags: this CPU's instruction sets (default: ``/proc/cpuinfo``'s).
    tensorflow: the running TensorFlow's identity (default: this one's).
  """
  if disabled():
    return Choice(None, "none", "TPU_EMBEDDING_KERNELS=0", asked=True)
  tuned = builder.tuned_library_path() if tuned is None else tuned
  if os.path.exists(tuned):
    return Choice(tuned, "tuned")
  directory = portable_directory() if directory is None else directory
  info = builder.read_build_info(directory)
  if info is None:
    return Choice(
      None,
      "none",
      "the install built no kernel library (was a C++ compiler missing?)",
    )
  running = builder.tensorflow_identity() if tensorflow is None else tensorflow
  built = info.get("tensorflow", {})
  if built != running:
    return Choice(
      None,
      "none",
      f"its kernels were built for TensorFlow {built.get('version')} "
      f"({built.get('git_version')}) and this is TensorFlow "
      f"{running['version']} ({running['git_version']})",
    )
  flags = builder.cpu_flags() if cpu_flags is None else cpu_flags
  levels = [
    level
    for level in builder.runnable_levels(builder.machine_levels(), flags)
    if level.name in info.get("libraries", {})
  ]
  if not levels:
    return Choice(
      None,
      "none",
      "this CPU runs none of the built kernel libraries "
      f"({', '.join(sorted(info.get('libraries', {})))})",
    )
  widest = levels[-1]
  path = os.path.join(directory, info["libraries"][widest.name])
  return Choice(path, f"package:{widest.name}")


def portable_directory() -> str:
  """Where the portable libraries are: this package's kernels directory,
  or, where that holds no build (a checkout run from its root, e.g.
  ``python3 -m model_garden.ranking.train`` after ``pip install .``,
  imports the checkout's files), the installed distribution's, provided
  it was built from these very sources."""
  own = builder.package_dir()
  if builder.read_build_info(own) is not None:
    return own
  # Every installed copy (a checkout's own egg-info is found too: it
  # locates back to the checkout, which holds no build).
  for distribution in importlib.metadata.distributions(name="tpu_embedding"):
    installed = str(distribution.locate_file("tpu_embedding/kernels"))
    info = builder.read_build_info(installed)
    if info is not None and info.get("sources") == builder.sources_digest():
      return installed
  return own


def tensorflow_path_message(reason: str) -> str:
  """The one line saying that the TensorFlow path runs, why, and what to
  do."""
  return (
    f"tpu_embedding: fused kernels not loaded ({reason}); training runs "
    f"on TensorFlow ops (same numbers, slower). To get them: {REMEDY}."
  )
