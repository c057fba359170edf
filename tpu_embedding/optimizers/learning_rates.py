"""Each distinct learning-rate callable evaluated once per update.

TPU's ``apply_gradients`` evaluates each distinct callable learning rate
once per step and hands the values to every table that uses it. Off TPU,
each table's update asks its optimizer for the rate
(``Optimizer.learning_rate_tensor``); inside ``once_per_update()`` (the
engine enters it around a step's updates) the first request for a
callable evaluates it and the others reuse the value, so 26 tables on one
schedule build and run the schedule once, not 26 times. Outside the
scope, each request evaluates the callable.

Values are kept per graph (a ``tf.cond`` branch is a graph of its own)
and only for the scope's duration: a later step evaluates again.

Example:
  >>> import tpu_embedding as tpe
  >>> calls = []
  >>> def rate():
  ...   calls.append(1)
  ...   return 0.5
  >>> a, b = tpe.SGD(learning_rate=rate), tpe.SGD(learning_rate=rate)
  >>> with once_per_update():
  ...   values = [float(a.learning_rate_tensor()),
  ...             float(b.learning_rate_tensor())]
  >>> values, len(calls)
  ([0.5, 0.5], 1)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from collections.abc import Iterator

import tensorflow as tf

# Per thread: MirroredStrategy traces each replica's step in its own thread.
_scope = threading.local()


@contextlib.contextmanager
def once_per_update() -> Iterator[None]:
  """Inside, each distinct learning-rate callable is evaluated once (per
  graph)."""
  outer = getattr(_scope, "values", None)
  _scope.values = {}
  try:
    yield
  finally:
    _scope.values = outer


def evaluate(learning_rate: Callable[[], object]) -> tf.Tensor:
  """``learning_rate()`` as a float32 scalar; inside ``once_per_update``
  the value of the first call for this callable in this graph."""
  values = getattr(_scope, "values", None)
  if values is None:
    return tf.cast(learning_rate(), tf.float32)
  # By identity (a callable need not be hashable); the entry holds the
  # callable, so its id is not reused while the scope lasts.
  key = (id(learning_rate), tf.compat.v1.get_default_graph())
  if key not in values:
    values[key] = (learning_rate, tf.cast(learning_rate(), tf.float32))
  return values[key][1]
