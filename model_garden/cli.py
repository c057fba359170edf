"""What every command-line entry point answers when something is wrong.

One place for the behaviour of ``model_garden`` programs and ``tools/``:

* a **usage error** (a flag, a config key, a value of the wrong type, an
  unknown experiment) prints one line saying what is wrong and what is
  allowed, ending ``see --help``, and exits 2 (``UsageError``);
* a **runtime failure the user can fix** (files, permissions, memory,
  data) prints one line naming the file, key or table, and exits 1
  (``FixableError``, and the ``OSError``\\ s, TensorFlow file errors and
  ``MemoryError`` that ``one_line`` recognises);
* no traceback for either, unless ``--debug`` is on the command line or
  ``TPE_DEBUG=1`` is set (the traceback then comes before the same line
  and exit code); any other exception is a bug and keeps its traceback;
  Ctrl-C is ``Interrupted.``, exit 130.

``quiet_tensorflow()``, called by an entry point's ``main`` module before
TensorFlow is imported, keeps TensorFlow's start-up banner out of the
output unless the user set ``TF_CPP_MIN_LOG_LEVEL``. Importing
``tpu_embedding`` never does any of this: only entry points do.

Example:
  >>> from model_garden import cli
  >>> cli.one_line(cli.UsageError("--rows must be positive, got 0."))
  (2, '--rows must be positive, got 0; see --help')
  >>> cli.one_line(FileNotFoundError(2, "No such file", "/data/x.tsv"))
  (1, '/data/x.tsv: No such file')
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any
from typing import NoReturn

#: Exit codes.
USAGE = 2
RUNTIME = 1
INTERRUPTED = 130  # as a shell reports SIGINT
#: Set to 1 (or pass ``--debug``) to see the traceback of a handled error.
DEBUG_ENV = "TPE_DEBUG"
#: Marks a ``TF_CPP_MIN_LOG_LEVEL`` set by ``quiet_tensorflow`` (not by
#: the user), so that child processes stay quiet too.
_QUIET_ENV = "TPE_QUIET_TENSORFLOW"
#: TensorFlow's C++ log lines (absl format, from a ``.cc`` source: Python's
#: absl logging is kept) that ``quiet_tensorflow`` drops: INFO and WARNING
#: (what ``TF_CPP_MIN_LOG_LEVEL=2`` means), the
#: notice printed before absl's logging starts, the CPU-instruction
#: notice's second line and the CUDA probe's errors on a machine without
#: a GPU driver.
_NOISE = re.compile(
  r"^(?:[IW]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w./-]+\.(?:cc|h|cpp):\d+\] "
  r"|WARNING: All log messages before absl::InitializeLog\(\) "
  r"|To enable the following instructions: "
  r"|E\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w./-]+\.cc:\d+\] (?:failed call to cuInit"
  r"|Unable to register cu))"
)
_FILTER = r"""
import os, re, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: reads to the end
noise = re.compile(sys.argv[1].encode())
out = os.fdopen(int(sys.argv[2]), "wb", buffering=0)
for line in sys.stdin.buffer:
  if not noise.match(line):
    out.write(line)
"""


class UsageError(Exception):
  """A wrong flag, key or value: one line, ``see --help``, exit 2."""

  exit_code = USAGE


class FixableError(Exception):
  """A runtime failure the user can fix (names the file, key or table):
  one line, exit 1."""

  exit_code = RUNTIME


def debugging(argv: list[str] | None = None) -> bool:
  """Whether the user asked for tracebacks (``--debug`` or ``TPE_DEBUG``)."""
  argv = sys.argv if argv is None else argv
  return os.environ.get(DEBUG_ENV, "") not in ("", "0") or "--debug" in argv


def _first_line(text: str) -> str:
  lines = [line.strip() for line in str(text).strip().splitlines()]
  return next((line for line in lines if line), "")


def with_help(message: str) -> str:
  """``message`` on one line, ending ``; see --help``."""
  text = " ".join(message.split()).rstrip(".")
  return text if text.endswith("see --help") else f"{text}; see --help"


def is_noise(line: str) -> bool:
  """Whether ``quiet_tensorflow`` drops this line of stderr.

  Example:
    >>> from model_garden import cli
    >>> cli.is_noise("I0000 00:00:1795703316.512546    4492 port.cc:153] "
    ...              "oneDNN custom operations are on.")
    True
    >>> cli.is_noise("W1126 14:50:00.123456 140123 train.py:12] kept")
    False
  """
  return _NOISE.match(line) is not None


def one_line(error: BaseException) -> tuple[int, str] | None:
  """``(exit code, message)`` for an error the user can fix, else None.

  Example:
    >>> from model_garden import cli
    >>> cli.one_line(MemoryError()) [0]
    1
    >>> cli.one_line(KeyError("x")) is None  # a bug: keep the traceback
    True
  """
  if isinstance(error, UsageError) or _is_absl_usage_error(error):
    return USAGE, with_help(str(error))
  if isinstance(error, FixableError):
    return RUNTIME, " ".join(str(error).split("\n")[:2]).strip()
  if isinstance(error, MemoryError):
    return RUNTIME, (
      "Out of memory: use smaller tables (task.model.vocab_sizes), smaller "
      "batches, or more machines."
    )
  if isinstance(error, OSError) and error.filename is not None:
    reason = error.strerror or _first_line(str(error))
    return RUNTIME, f"{error.filename}: {reason}"
  if isinstance(error, (FileNotFoundError, PermissionError)):
    return RUNTIME, _first_line(str(error))
  tf_error = _tensorflow_error(error)
  if tf_error is not None:
    return RUNTIME, tf_error
  return None


def _is_absl_usage_error(error: BaseException) -> bool:
  kind = type(error)
  return kind.__name__ == "UsageError" and kind.__module__ == "absl.app"


def _tensorflow_error(error: BaseException) -> str | None:
  """The first line of a TensorFlow error about files or memory."""
  tf_errors = sys.modules.get("tensorflow.python.framework.errors_impl")
  if tf_errors is None:
    return None
  kinds = (
    tf_errors.NotFoundError,
    tf_errors.PermissionDeniedError,
    tf_errors.FailedPreconditionError,
    tf_errors.ResourceExhaustedError,
    tf_errors.AlreadyExistsError,
    tf_errors.DataLossError,
  )
  if not isinstance(error, kinds):
    return None
  text = _first_line(getattr(error, "message", str(error)))
  text = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", text)
  return text or type(error).__name__


def fail(code: int, message: str) -> NoReturn:
  """Prints ``message`` as the last line of stderr and exits ``code``."""
  sys.stdout.flush()
  print(message, file=sys.stderr, flush=True)
  sys.exit(code)


def run(
  main: Callable[[], Any],
  translate: Callable[[BaseException], BaseException | None] | None = None,
) -> Any:
  """Calls ``main()``; a user's error becomes one line and its exit code.

  Args:
    main: the program.
    translate: turns an exception into a ``UsageError`` / ``FixableError``
      with a better message (or returns None to keep it).

  Returns:
    What ``main`` returns.
  """
  try:
    return main()
  except SystemExit:
    raise
  except KeyboardInterrupt:
    if debugging():
      traceback.print_exc()
    fail(INTERRUPTED, "Interrupted.")
  except Exception as error:  # noqa: BLE001 (re-raised unless a user's)
    better = translate(error) if translate is not None else None
    answer = one_line(better if better is not None else error)
    if answer is None:
      raise
    if debugging():
      traceback.print_exc()
    fail(*answer)


def positive_int(text: str) -> int:
  """An ``argparse`` type: an integer >= 1.

  Example:
    >>> from model_garden import cli
    >>> cli.positive_int("3")
    3
  """
  return _int_at_least(1, text)


def non_negative_int(text: str) -> int:
  """An ``argparse`` type: an integer >= 0.

  Example:
    >>> from model_garden import cli
    >>> cli.non_negative_int("0")
    0
  """
  return _int_at_least(0, text)


def _int_at_least(minimum: int, text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"expected an integer >= {minimum}, got {text!r}"
    ) from None
  if value < minimum:
    raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
  return value


def positive_ints(text: str) -> list[int]:
  """An ``argparse`` type: comma-separated integers >= 1.

  Example:
    >>> from model_garden import cli
    >>> cli.positive_ints("1,2,4")
    [1, 2, 4]
  """
  try:
    values = [int(v) for v in text.split(",")]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(
      f"expected comma-separated integers >= 1 (e.g. 1,2,4), got {text!r}"
    )
  return values


class ArgumentParser(argparse.ArgumentParser):
  """``argparse`` with one-line usage errors (exit 2) and ``--debug``.

  Example:
    >>> from model_garden import cli
    >>> parser = cli.ArgumentParser(prog="tool")
    >>> parser.parse_args(["--debug"]).debug
    True
  """

  def __init__(self, *args: Any, **kwargs: Any):
    super().__init__(*args, **kwargs)
    self.add_argument(
      "--debug",
      action="store_true",
      help="show the traceback of an error (also: TPE_DEBUG=1)",
    )

  def error(self, message: str) -> NoReturn:
    fail(USAGE, with_help(f"{self.prog}: {message}"))

  def parse_args(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
    """Parses, then checks that a ``--json`` file can be written (before
    the work, not after it)."""
    parsed = super().parse_args(*args, **kwargs)
    path = getattr(parsed, "json", None)
    if path and isinstance(path, str):
      directory = os.path.dirname(os.path.abspath(path))
      if os.path.isdir(path) or not os.path.isdir(directory):
        what = (
          "is a directory"
          if os.path.isdir(path)
          else (f"{directory} is not a directory")
        )
        fail(RUNTIME, f"--json {path}: {what}.")
      if not os.access(directory, os.W_OK):
        fail(RUNTIME, f"--json {path}: {directory} is not writable.")
    return parsed


def absl_main(
  main: Callable[[list[str]], Any],
  translate: Callable[[BaseException], BaseException | None] | None = None,
) -> Callable[[list[str]], Any]:
  """``app.run(cli.absl_main(main), flags_parser=cli.absl_flags_parser)``:
  ``main(argv)`` under ``run`` (absl's ``UsageError`` is a usage line)."""
  return lambda argv: run(lambda: main(argv), translate)


def absl_flags_parser(argv: list[str]) -> list[str]:
  """``app.run(main, flags_parser=...)``: a flag error is one line, exit 2
  (absl prints its help and exits 1)."""
  from absl import flags  # noqa: PLC0415

  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(USAGE, with_help(_first_line(str(e))))


def quiet_tensorflow() -> None:
  """Keeps TensorFlow's start-up banner out of this process's stderr.

  Unless the user set ``TF_CPP_MIN_LOG_LEVEL``, sets it to 2 and, since
  TensorFlow 2.21 writes its banner before its C++ logging reads that
  variable, passes the process's stderr through a filter that drops
  TensorFlow's INFO/WARNING log lines and the CUDA probe's errors on a
  machine without a GPU driver; everything else (Python's output, other
  errors) goes through unchanged. Call it in an entry point's ``main``
  module before TensorFlow is imported; never in a library.
  """
  user_set = "TF_CPP_MIN_LOG_LEVEL" in os.environ and _QUIET_ENV not in (
    os.environ
  )
  if user_set or getattr(quiet_tensorflow, "_done", False):
    return
  quiet_tensorflow._done = True  # type: ignore[attr-defined]
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
  os.environ[_QUIET_ENV] = "1"
  try:
    sys.stderr.flush()
    real = os.dup(2)
    read, write = os.pipe()
    process = subprocess.Popen(
      [sys.executable, "-I", "-S", "-c", _FILTER, _NOISE.pattern, str(real)],
      stdin=read,
      pass_fds=(real,),
      close_fds=True,
    )
  except OSError:
    return
  os.close(read)
  os.dup2(write, 2)
  os.close(write)

  def finish() -> None:
    try:
      sys.stderr.flush()
    except (OSError, ValueError):
      pass
    os.dup2(real, 2)  # closes the pipe: the filter reads to the end
    try:
      process.wait(timeout=5)
    except subprocess.TimeoutExpired:
      pass

  atexit.register(finish)
