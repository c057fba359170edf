"""``python3 -m tpu_embedding.kernels {status,build,path}``.

* ``status`` (``--json``): which library this process loads and why, or
  why the TensorFlow path runs; exits 1 when no library loads.
* ``build [--force]``: an optional rebuild tuned to this CPU
  (``-march=native``) into the kernel cache, preferred over the portable
  libraries the install built. Exits 1 if the build or the load fails.
* ``path``: the tuned library's path (which may not exist).

Example:
  >>> main(["path"])  # doctest: +ELLIPSIS
  /.../libtpu_embedding_kernels.so
  0
"""

from __future__ import annotations

import argparse
import json
import sys

from tpu_embedding.kernels import build as builder
from tpu_embedding.kernels import library
from tpu_embedding.kernels import load


def status() -> dict:
  """What ``status`` reports: the choice, the build record, the load."""
  choice = library.choose()
  loaded = choice.path is not None and load() is not None
  return {
    "loaded": loaded,
    "library": choice.path,
    "origin": choice.origin,
    "reason": choice.reason,
    "build_info": builder.read_build_info(builder.package_dir()),
    "tensorflow": builder.tensorflow_identity(),
  }


def main(argv: list[str] | None = None) -> int:
  """Runs one command.

  Returns:
    The exit status: 0, or 1 when the build or the load fails.
  """
  parser = argparse.ArgumentParser(
    prog="python3 -m tpu_embedding.kernels",
    description="tpu_embedding's TensorFlow kernels (C++): which library "
    "loads, or an optional rebuild tuned to this CPU.",
  )
  parser.add_argument("command", choices=["status", "build", "path"])
  parser.add_argument(
    "--force", action="store_true", help="build: rebuild even if built."
  )
  parser.add_argument("--json", action="store_true", help="status: print JSON.")
  args = parser.parse_args(argv)
  if args.command == "path":
    print(builder.tuned_library_path())
    return 0
  if args.command == "status":
    report = status()
    if args.json:
      print(json.dumps(report, indent=2))
    elif report["loaded"]:
      print(f"tpu_embedding kernels: {report['library']} ({report['origin']})")
    else:
      print(
        "tpu_embedding kernels: none loaded "
        f"({report['reason'] or 'the library does not load'})"
      )
    return 0 if report["loaded"] else 1
  try:
    path, seconds = builder.timed(builder.build_tuned, args.force)
  except builder.BuildError as e:
    print(f"tpu_embedding kernels: build failed: {e}", file=sys.stderr)
    return 1
  if load() is None:
    print(
      f"tpu_embedding kernels: built {path} but cannot load it", file=sys.stderr
    )
    return 1
  print(f"tpu_embedding kernels: {path} ({seconds:.1f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
