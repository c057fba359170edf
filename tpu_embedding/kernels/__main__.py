"""``python3 -m tpu_embedding.kernels build [--force]``: compile the kernels.

Prints where the library is and how long it took; exits 1 if the build
fails (the package then runs on its pure TensorFlow path).

Example:
  >>> main(["path"])  # doctest: +ELLIPSIS
  /.../libtpu_embedding_kernels.so
  0
"""

from __future__ import annotations

import argparse
import sys

from tpu_embedding.kernels import build as builder
from tpu_embedding.kernels import load


def main(argv: list[str] | None = None) -> int:
  """Runs ``build`` (compile if needed) or ``path`` (print the library's).

  Returns:
    The exit status: 0, or 1 when the build or the load fails.
  """
  parser = argparse.ArgumentParser(
    prog="python3 -m tpu_embedding.kernels",
    description="Compile tpu_embedding's TensorFlow kernels (C++) against "
    "the installed TensorFlow, into the kernel cache.",
  )
  parser.add_argument("command", choices=["build", "path"])
  parser.add_argument(
    "--force", action="store_true", help="Rebuild even if built already."
  )
  args = parser.parse_args(argv)
  if args.command == "path":
    print(builder.library_path())
    return 0
  try:
    path, seconds = builder.timed_build(args.force)
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
