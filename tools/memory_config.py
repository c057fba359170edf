"""The settings of tools/memory_report.py's jobs (no TensorFlow import).

Example:
  >>> json.loads(Workload(rows=10).to_json())["rows"]
  10
"""

from __future__ import annotations

import dataclasses
import json

#: Prefix of the event lines the jobs write on stdout (``memory_jobs``).
TAG = "@memory "

#: Table initializers the jobs can use (``memory_workload.make_initializer``):
#: TableConfig's default, ``tf.random_uniform_initializer`` with and without
#: a seed, ``tf.constant_initializer(0.5)``.
INITIALIZERS = ("default", "seeded", "unseeded", "constant")

#: Table optimizers (learning rates in ``memory_workload``).
OPTIMIZERS = ("sgd", "adagrad", "adam", "ftrl")


@dataclasses.dataclass(frozen=True)
class Workload:
  """The measured job's tables and training.

  Attributes:
    rows: rows of the sharded table ``big``.
    dim: width of every table.
    optimizer: one of ``OPTIMIZERS``.
    initializer: one of ``INITIALIZERS``.
    steps: training steps.
    batch: ids per part of a step's global batch.
    parts: parts of a step's global batch (the largest job's replicas,
      one part each; a smaller job's replicas take several).
    side_rows: rows of the small table ``side`` (0: no such table).
    dynamic: ``big`` has a ``DynamicVocabulary`` (the ids are its raw
      keys; its vocabulary state is sharded with its rows and counts in
      the full state).
  """

  rows: int = 2_000_000
  dim: int = 128
  optimizer: str = "adagrad"
  initializer: str = "default"
  steps: int = 5
  batch: int = 4096
  parts: int = 2
  side_rows: int = 0
  dynamic: bool = False

  def to_json(self) -> str:
    """The fields as JSON (``Workload(**json.loads(text))`` reads it)."""
    return json.dumps(dataclasses.asdict(self))
