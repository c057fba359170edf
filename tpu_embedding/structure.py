"""Nested-structure helpers: flattening with paths, structure checks.

Feature paths are TensorFlow's joined string paths (``"a/b"``, ``"0"``), the
names every error message uses.

Example:
  >>> from tpu_embedding.structure import flatten_with_paths
  >>> flatten_with_paths({"b": 2, "a": [1]})
  [('a/0', 1), ('b', 2)]
"""

from __future__ import annotations

from typing import TypeVar

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.types import Nest
from tpu_embedding.types import Nested

T = TypeVar("T")


def flatten_with_paths(structure: Nest[T]) -> list[tuple[str, T]]:
  """``[(path, leaf)]`` in ``tf.nest.flatten`` order."""
  return list(compat.flatten_with_joined_string_paths(structure))


def check_same_structure(
  expected: Nested,
  given: Nested,
  what: str,
  error: type[Exception] | None = None,
) -> None:
  """Raises a one-line error naming ``what`` when the nests differ.

  The message names the missing and the unexpected feature paths (or,
  where the paths agree, what differs) and the expected paths.

  Args:
    expected: the reference nest (the feature config).
    given: the nest passed by the user.
    what: a description, e.g. ``"features passed to enqueue"``.
    error: the error type to raise; by default ``tf.nest``'s (a
      TypeError when a sequence's type differs, as TensorFlow's enqueue
      raises; ValueError otherwise). TensorFlow's lookups raise ValueError.

  Raises:
    ValueError: if the structures differ.
    TypeError: if a sequence's type differs (e.g. a tuple for a list) and
      ``error`` is None.
  """
  try:
    tf.nest.assert_same_structure(expected, given, expand_composites=False)
  except (ValueError, TypeError) as e:
    expected_paths = [p for p, _ in flatten_with_paths(expected)]
    raise (error or type(e))(
      f"The {what} do not match the structure of the feature config: "
      f"{structure_difference(expected, given, e)}. Expected the feature "
      f"paths {expected_paths}."
    ) from e


def structure_difference(
  expected: Nested, given: Nested, mismatch: Exception
) -> str:
  """What differs between two nests, in one line.

  Args:
    expected: the reference nest.
    given: the other nest.
    mismatch: ``tf.nest.assert_same_structure``'s error for them.

  Returns:
    ``"missing feature(s) [...]; unexpected feature(s) [...]"``, or where
    the paths agree, the first line of ``mismatch``.

  Example:
    >>> structure_difference({"a": 1, "b": 2}, {"a": 1, "c": 2}, ValueError())
    "missing feature(s) ['b']; unexpected feature(s) ['c']"
  """
  want = [p for p, _ in flatten_with_paths(expected)]
  if tf.nest.is_nested(expected) and not tf.nest.is_nested(given):
    kind = "tensor" if hasattr(given, "shape") else type(given).__name__
    return f"got a single {kind} where the config has {len(want)} feature(s)"
  if tf.nest.is_nested(given) and not tf.nest.is_nested(expected):
    return "got a nest where the config has a single feature"
  try:
    have = [p for p, _ in flatten_with_paths(given)]
  except (TypeError, ValueError):  # e.g. a dict of unsortable keys
    have = []
  missing = [p for p in want if p not in have]
  unexpected = [p for p in have if p not in want]
  parts = []
  if missing:
    parts.append(f"missing feature(s) {missing}")
  if unexpected:
    parts.append(f"unexpected feature(s) {unexpected}")
  if parts:
    return "; ".join(parts)
  lines = str(mismatch).strip().splitlines()
  return lines[0] if lines else "a different nesting of the same paths"
