"""Compiles this package's TensorFlow kernels against TensorFlow.

Two kinds of library, from the same C++ sources and flags:

* **Portable** (``build_portable``): what ``pip install .`` and
  ``pip wheel .`` build (``setup.py``), into the installed package. One
  library per x86-64 level (``LEVELS``: AVX, the level TensorFlow's own
  wheels require; AVX2; AVX-512), and the loader (``library.py``) loads
  the widest one this CPU runs. ``build_info.json`` beside them names the
  TensorFlow they were compiled against. On other machines (Arm), one
  library for the generic target.
* **Tuned** (``build_tuned``): ``python3 -m tpu_embedding.kernels build``
  compiles for exactly this CPU (``-march=native``, else the widest level
  it runs: ``tuned_targets``) into a cache keyed by
  the TensorFlow version, the sources' hash and the CPU's instruction
  sets; the loader prefers it when it exists. Optional: an install that
  built the portable libraries needs nothing more.

Every library computes the same numbers: IEEE float math as TensorFlow
does it (no contraction into fused multiply-adds, no fast-math), so wider
vectors change the speed, never a bit of the result
(``tests/kernels/test_kernel_delivery.py`` compares the levels).

No training, serving or test process compiles: only the install and the
``build`` command do. Environment:

* ``TPU_EMBEDDING_KERNEL_DIR``: the tuned libraries' cache (default
  ``~/.cache/tpu_embedding/kernels``).
* ``CXX``: the compiler (default ``g++``).

Example:
  >>> os.path.basename(source_path())
  'fused_update.cc'
  >>> [level.name for level in LEVELS]
  ['avx', 'avx2', 'avx512']
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import platform
import shlex
import subprocess
import tempfile
import time

import tensorflow as tf

SOURCES = (
  "fused_update.cc",
  "split_by_owner.cc",
  "unique.cc",
  "gather_rows.cc",
  "segment_sum.cc",
  "vocabulary_step.cc",
  "mark_rows.cc",
  "read_records.cc",
  "read_ring.cc",
  "admit_rows.cc",
)

#: Sources compiled once per level: their loops are arithmetic on rows.
VECTOR_SOURCES = ("fused_update.cc", "segment_sum.cc", "gather_rows.cc")

#: Headers the sources include (part of the tuned library's cache key).
HEADERS = ("piece_rows.h", "read_ring.h", "row_types.h", "spread.h")

#: Flags beyond TensorFlow's: IEEE float math as TensorFlow computes it (no
#: contraction into fused multiply-adds, no fast-math), errno-free sqrt so
#: loops vectorize.
EXTRA_FLAGS = (
  "-std=c++17",
  "-fPIC",
  "-O3",
  "-ffp-contract=off",
  "-fno-math-errno",
  "-Wno-deprecated-declarations",
)

#: The tuned library's target: this CPU.
NATIVE_FLAGS = ("-march=native",)

#: What ``build_portable`` writes beside the libraries.
BUILD_INFO = "build_info.json"

#: The libraries' file names: ``LIBRARY.format(level)``.
LIBRARY = "libtpu_embedding_kernels.{}.so"


@dataclasses.dataclass(frozen=True)
class Level:
  """One portable library's target.

  Attributes:
    name: its name (in the library's file name).
    flags: the compiler flags that select it.
    cpu_flags: what ``/proc/cpuinfo`` must list for a CPU to run it.
  """

  name: str
  flags: tuple[str, ...]
  cpu_flags: frozenset[str]


#: x86-64 targets, narrowest first. AVX is TensorFlow 2.21's own minimum.
#: The AVX2 and AVX-512 levels also prefetch the rows an update will write
#: with write intent (PREFETCHW, ``3dnowprefetch`` in ``/proc/cpuinfo``):
#: measured 1.33x faster steps with uniform ids than the same level
#: without it (``-march=native`` enables it where the CPU has it).
LEVELS = (
  Level(
    "avx",
    ("-march=x86-64-v2", "-mavx"),
    frozenset({"sse4_2", "popcnt", "avx"}),
  ),
  Level(
    "avx2",
    ("-march=x86-64-v3", "-mprfchw"),
    frozenset(
      {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "3dnowprefetch"}
    ),
  ),
  Level(
    "avx512",
    ("-march=x86-64-v4", "-mprfchw"),
    frozenset(
      {
        "avx2",
        "avx512f",
        "avx512bw",
        "avx512cd",
        "avx512dq",
        "avx512vl",
        "3dnowprefetch",
      }
    ),
  ),
)

#: Any other machine: the compiler's default target.
GENERIC = Level("generic", (), frozenset())


class BuildError(RuntimeError):
  """The kernels could not be compiled (the message has the compiler's)."""


def source_path(name: str = SOURCES[0]) -> str:
  """The path of one of the kernels' C++ sources (shipped as package data)."""
  return os.path.join(package_dir(), name)


def package_dir() -> str:
  """The directory of this package's kernels (and portable libraries)."""
  return os.path.dirname(os.path.abspath(__file__))


def machine_levels() -> tuple[Level, ...]:
  """The portable libraries built for this kind of machine."""
  if platform.machine().lower() in ("x86_64", "amd64"):
    return LEVELS
  return (GENERIC,)


def cpu_flags() -> frozenset[str]:
  """This CPU's instruction sets (the flags line of ``/proc/cpuinfo``;
  empty where it cannot be read)."""
  line = _cpu_features()
  return frozenset(line.partition(":")[2].split())


def runnable_levels(
  levels: tuple[Level, ...], flags: frozenset[str]
) -> list[Level]:
  """The levels a CPU with ``flags`` runs, narrowest first."""
  return [level for level in levels if level.cpu_flags <= flags]


def compile_command(output: str, target: tuple[str, ...]) -> list[str]:
  """The compiler command line writing the whole library to ``output``.

  Args:
    output: the shared library to write.
    target: the flags that select the instruction set (``Level.flags``,
      or ``NATIVE_FLAGS``).
  """
  return [
    *shlex.split(os.environ.get("CXX", "g++")),
    *EXTRA_FLAGS,
    "-shared",
    *target,
    *tf.sysconfig.get_compile_flags(),
    *[source_path(name) for name in SOURCES],
    "-o",
    output,
    *tf.sysconfig.get_link_flags(),
  ]


def object_command(
  source: str, output: str, target: tuple[str, ...]
) -> list[str]:
  """The compiler command line compiling one source to an object file."""
  return [
    *shlex.split(os.environ.get("CXX", "g++")),
    *EXTRA_FLAGS,
    *target,
    *tf.sysconfig.get_compile_flags(),
    "-c",
    source_path(source),
    "-o",
    output,
  ]


def link_command(objects: list[str], output: str) -> list[str]:
  """The compiler command line linking objects into a library."""
  return [
    *shlex.split(os.environ.get("CXX", "g++")),
    "-shared",
    *objects,
    "-o",
    output,
    *tf.sysconfig.get_link_flags(),
  ]


def tensorflow_identity() -> dict[str, str]:
  """What a library is compiled against: TensorFlow's version and commit."""
  return {"version": tf.__version__, "git_version": tf.version.GIT_VERSION}


def _compile(command: list[str]) -> subprocess.CompletedProcess:
  try:
    return subprocess.run(command, capture_output=True, text=True, check=False)
  except OSError as e:
    raise BuildError(f"Cannot run the C++ compiler {command[0]!r}: {e}") from e


def _failed(result: subprocess.CompletedProcess) -> BuildError:
  return BuildError(
    f"Compiling {', '.join(SOURCES)} failed (exit {result.returncode}):\n"
    f"{result.stderr[-4000:]}"
  )


def _run_all(commands: list[list[str]], jobs: int) -> None:
  """Runs compiler commands, ``jobs`` at once; raises on the first
  failure."""
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    for result in pool.map(_compile, commands):
      if result.returncode != 0:
        raise _failed(result)


def build_portable(directory: str, jobs: int | None = None) -> dict:
  """Compiles one library per level of this machine into ``directory``.

  The sources whose loops are arithmetic (``VECTOR_SOURCES``: the
  optimizer rules' square roots and divisions, the combiner's sums) are
  compiled once per level; the others (hashing, copies and routing of
  rows, bound by memory) once for the narrowest level and linked into
  every library. Compilers run ``jobs`` at once (default: one per CPU
  core); ``build_info.json`` is written last, so a directory holds it only
  with every library complete.

  Args:
    directory: where the libraries go (the installed package's
      ``tpu_embedding/kernels``).
    jobs: compilers run at once.

  Returns:
    The build information written (TensorFlow identity, libraries by
    level, seconds).

  Raises:
    BuildError: if the compiler is missing or fails for any level.
  """
  start = time.perf_counter()
  os.makedirs(directory, exist_ok=True)
  levels = machine_levels()
  previous = read_build_info(directory)
  if previous is not None and _same_build(previous, directory, levels):
    return previous  # Built from these sources for this TensorFlow.
  jobs = jobs or len(os.sched_getaffinity(0))
  with tempfile.TemporaryDirectory(dir=directory) as scratch:

    def obj(source: str, level: Level) -> str:
      return os.path.join(scratch, f"{source}.{level.name}.o")

    def target(source: str, level: Level) -> Level:
      return level if source in VECTOR_SOURCES else levels[0]

    compiles = {
      obj(source, target(source, level)): (source, target(source, level))
      for level in levels
      for source in SOURCES
    }
    _run_all(
      [
        object_command(source, output, level.flags)
        for output, (source, level) in compiles.items()
      ],
      jobs,
    )
    libraries = {
      level.name: os.path.join(scratch, LIBRARY.format(level.name))
      for level in levels
    }
    _run_all(
      [
        link_command([obj(s, target(s, level)) for s in SOURCES], output)
        for level, output in zip(levels, libraries.values(), strict=True)
      ],
      jobs,
    )
    for path in libraries.values():
      os.replace(path, os.path.join(directory, os.path.basename(path)))
  info = {
    "tensorflow": tensorflow_identity(),
    "libraries": {level.name: LIBRARY.format(level.name) for level in levels},
    "sources": sources_digest(),
    "seconds": round(time.perf_counter() - start, 1),
  }
  _write_atomically(os.path.join(directory, BUILD_INFO), json.dumps(info))
  return info


def _digest(*extra: str) -> str:
  """A hash of the sources and headers, and of ``extra`` (flags, CPU)."""
  digest = hashlib.sha256()
  for name in SOURCES + HEADERS:
    with open(source_path(name), "rb") as f:
      digest.update(f.read())
  for text in extra:
    digest.update(text.encode())
  return digest.hexdigest()[:16]


def sources_digest() -> str:
  """A hash of the sources, headers and flags the portable libraries are
  built from."""
  return _digest(
    " ".join(EXTRA_FLAGS), repr([(lvl.name, lvl.flags) for lvl in LEVELS])
  )


def _same_build(info: dict, directory: str, levels: tuple[Level, ...]) -> bool:
  """Whether ``info`` (with its libraries in ``directory``) is what a
  build would make now (a rebuilt wheel from an unchanged tree)."""
  names = {level.name: LIBRARY.format(level.name) for level in levels}
  return (
    info.get("tensorflow") == tensorflow_identity()
    and info.get("sources") == sources_digest()
    and info.get("libraries") == names
    and all(os.path.exists(os.path.join(directory, n)) for n in names.values())
  )


def read_build_info(directory: str) -> dict | None:
  """``build_portable``'s record in ``directory``, or None (none built)."""
  try:
    with open(os.path.join(directory, BUILD_INFO), encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def remove_portable(directory: str) -> None:
  """Removes ``build_portable``'s libraries and record from ``directory``."""
  for name in os.listdir(directory):
    if name == BUILD_INFO or (
      name.startswith("libtpu_embedding_kernels.") and name.endswith(".so")
    ):
      os.unlink(os.path.join(directory, name))


def _write_atomically(path: str, text: str) -> None:
  handle, partial = tempfile.mkstemp(dir=os.path.dirname(path))
  with os.fdopen(handle, "w", encoding="utf-8") as f:
    f.write(text)
  os.chmod(partial, 0o644)
  os.replace(partial, path)


def cache_dir() -> str:
  """Where tuned libraries are kept."""
  default = os.path.join(
    os.path.expanduser("~"), ".cache", "tpu_embedding", "kernels"
  )
  return os.environ.get("TPU_EMBEDDING_KERNEL_DIR", default)


def tuned_library_path() -> str:
  """The tuned library for this TensorFlow, these sources and this CPU
  (it may not exist)."""
  digest = _digest(
    " ".join(EXTRA_FLAGS + NATIVE_FLAGS), _cpu_features() or platform.machine()
  )
  key = f"tf{tf.__version__}-{digest}"
  return os.path.join(cache_dir(), key, "libtpu_embedding_kernels.so")


@contextlib.contextmanager
def _locked(directory: str):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, ".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def _cpu_features() -> str:
  """What identifies this CPU's instruction sets (Linux: the flags line of
  ``/proc/cpuinfo``), or "" where that is unknown."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          return line
  except OSError:
    pass
  return ""


def tuned_targets() -> list[tuple[str, ...]]:
  """The targets ``build_tuned`` tries, best first.

  This CPU (``-march=native``); the same without AVX-512 FP16 (GCC 12
  cannot compile TensorFlow's Eigen headers for it); the widest portable
  level this CPU runs; the compiler's default target.
  """
  targets: list[tuple[str, ...]] = []
  if _cpu_features():
    targets += [NATIVE_FLAGS, (*NATIVE_FLAGS, "-mno-avx512fp16")]
  runnable = runnable_levels(machine_levels(), cpu_flags())
  if runnable and runnable[-1].flags:
    targets.append(runnable[-1].flags)
  return [*targets, ()]


def build_tuned(force: bool = False) -> str:
  """Compiles the library for this CPU (unless built); returns its path.

  Tries ``tuned_targets()`` in order and keeps the first that compiles.
  Concurrent processes wait on a file lock; the library appears under its
  final name only once complete.

  Raises:
    BuildError: if the compiler is missing or fails for every target.
  """
  path = tuned_library_path()
  if os.path.exists(path) and not force:
    return path
  directory = os.path.dirname(path)
  with _locked(directory):
    if os.path.exists(path) and not force:
      return path  # Another process built it while we waited.
    handle, partial = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(handle)
    try:
      for target in tuned_targets():
        result = _compile(compile_command(partial, target))
        if result.returncode == 0:
          break
      else:
        raise _failed(result)
    except BuildError:
      os.unlink(partial)
      raise
    os.replace(partial, path)
  return path


def timed(build, *args, **kwargs) -> tuple:
  """``build(*args, **kwargs)`` and the seconds it took."""
  start = time.perf_counter()
  result = build(*args, **kwargs)
  return result, time.perf_counter() - start
