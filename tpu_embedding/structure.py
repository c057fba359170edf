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
  """Raises an error naming ``what`` when the nests differ.

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
    tf.nest.assert_same_structure(expected, given)
  except (ValueError, TypeError) as e:
    expected_paths = [p for p, _ in flatten_with_paths(expected)]
    raise (error or type(e))(
      f"The {what} do not match the structure of the feature config. "
      f"Expected the feature paths {expected_paths}. Details: {e}"
    ) from e
