"""Compiles this package's TensorFlow kernels against the installed TensorFlow.

The C++ sources ship with the package; ``build()`` compiles them with the
flags TensorFlow gives (``tf.sysconfig``) into a cache directory keyed by
the TensorFlow version, the sources' hash and this CPU's instruction sets,
so a TensorFlow upgrade, an edited source or another CPU builds anew and
nothing stale is ever loaded. The kernels are compiled for this CPU
(``-march=native``: wide vectors for the update's square roots and
divisions, the same IEEE results) and, where the compiler refuses that,
for the generic target. Concurrent
processes (a test suite, several workers) wait on a file lock; the library
appears under its final name only once complete.

``python3 -m tpu_embedding.kernels build`` builds ahead of time (the
README's install command runs it). Environment:

* ``TPU_EMBEDDING_KERNEL_DIR``: the cache directory (default
  ``~/.cache/tpu_embedding/kernels``).
* ``TPU_EMBEDDING_KERNELS=0``: never build or load (the TensorFlow path).
* ``CXX``: the compiler (default ``g++``).

Example:
  >>> import os
  >>> os.path.basename(source_path())
  'fused_update.cc'
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
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
)

#: Headers the sources include (part of the library's cache key).
HEADERS = ("piece_rows.h", "spread.h")

#: Flags beyond TensorFlow's: IEEE float math as TensorFlow computes it (no
#: contraction into fused multiply-adds, no fast-math), errno-free sqrt so
#: loops vectorize.
EXTRA_FLAGS = (
  "-std=c++17",
  "-shared",
  "-fPIC",
  "-O3",
  "-ffp-contract=off",
  "-fno-math-errno",
  "-Wno-deprecated-declarations",
)


#: Flags tried first: code for this CPU (the cache key names the CPU).
NATIVE_FLAGS = ("-march=native",)


class BuildError(RuntimeError):
  """The kernels could not be compiled (the message has the compiler's)."""


def source_path(name: str = SOURCES[0]) -> str:
  """The path of one of the kernels' C++ sources (shipped as package data)."""
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), name)


def cache_dir() -> str:
  """Where built libraries are kept."""
  default = os.path.join(
    os.path.expanduser("~"), ".cache", "tpu_embedding", "kernels"
  )
  return os.environ.get("TPU_EMBEDDING_KERNEL_DIR", default)


def library_path() -> str:
  """The library for this TensorFlow and these sources (may not exist)."""
  digest = hashlib.sha256()
  for name in SOURCES + HEADERS:
    with open(source_path(name), "rb") as f:
      digest.update(f.read())
  digest.update(" ".join(EXTRA_FLAGS + NATIVE_FLAGS).encode())
  digest.update((_cpu_features() or platform.machine()).encode())
  key = f"tf{tf.__version__}-{digest.hexdigest()[:16]}"
  return os.path.join(cache_dir(), key, "libtpu_embedding_kernels.so")


def enabled() -> bool:
  """False when ``TPU_EMBEDDING_KERNELS=0`` asks for the TensorFlow path."""
  return os.environ.get("TPU_EMBEDDING_KERNELS", "1") != "0"


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
  ``/proc/cpuinfo``), or "" where that is unknown (then the kernels are
  built for the generic target: a cache shared by several machines never
  holds code one of them cannot run)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          return line
  except OSError:
    pass
  return ""


def compile_command(output: str, native: bool = True) -> list[str]:
  """The compiler command line writing the library to ``output`` (for
  this CPU with ``native`` where it is known, else for the generic
  target)."""
  compiler = shlex.split(os.environ.get("CXX", "g++"))
  native = native and bool(_cpu_features())
  return [
    *compiler,
    *EXTRA_FLAGS,
    *(NATIVE_FLAGS if native else ()),
    *tf.sysconfig.get_compile_flags(),
    *[source_path(name) for name in SOURCES],
    "-o",
    output,
    *tf.sysconfig.get_link_flags(),
  ]


def build(force: bool = False) -> str:
  """Compiles the kernels (unless already built); returns the library path.

  Raises:
    BuildError: if the compiler is missing or fails.
  """
  path = library_path()
  if os.path.exists(path) and not force:
    return path
  directory = os.path.dirname(path)
  with _locked(directory):
    if os.path.exists(path) and not force:
      return path  # Another process built it while we waited.
    handle, partial = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(handle)
    try:
      result = subprocess.run(
        compile_command(partial), capture_output=True, text=True, check=False
      )
      if result.returncode != 0:  # E.g. no -march=native: generic code.
        result = subprocess.run(
          compile_command(partial, native=False),
          capture_output=True,
          text=True,
          check=False,
        )
    except OSError as e:
      os.unlink(partial)
      raise BuildError(f"Cannot run the C++ compiler: {e}") from e
    if result.returncode != 0:
      os.unlink(partial)
      raise BuildError(
        f"Compiling {', '.join(SOURCES)} failed (exit {result.returncode}):\n"
        f"{result.stderr[-4000:]}"
      )
    os.replace(partial, path)
  return path


def timed_build(force: bool = False) -> tuple[str, float]:
  """``build`` and the seconds it took."""
  start = time.perf_counter()
  path = build(force)
  return path, time.perf_counter() - start
