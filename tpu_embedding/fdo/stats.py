"""The statistics FDO reports, and the configs to paste: ``FdoStats``.

Per stacked table (``TableStats``): the most ids and unique ids a
partition received in a step (the maximum over steps, and a percentile of
the per-step maxima), and the ids buffer one chip needs. ``FdoStats``
turns them into TensorFlow's ``SparseCoreEmbeddingConfig`` (or its source
to paste), keras-rs ``TableConfig`` arguments, a summary and the JSON file
``tpu_embedding.fdo.load_sparse_core_config`` reads.

Example:
  >>> import numpy as np
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding import fdo
  >>> table = tpe.TableConfig(64, 8, name="t")
  >>> collector = fdo.FdoCollector(
  ...     {"f": tpe.FeatureConfig(table)}, (1, 4), optimizer=tpe.SGD(0.1))
  >>> _ = collector.update({"f": np.zeros(16, np.int64)})
  >>> stats = collector.result()
  >>> stats.tables["t"].limit(), stats.keras_rs_limits()["t"]
  ((4, 1), {'max_ids_per_partition': 4, 'max_unique_ids_per_partition': 1})
  >>> stats.sparse_core_config().max_ids_per_table
  {'t': 4}
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import tensorflow as tf

from tpu_embedding.fdo import files
from tpu_embedding.fdo.topologies import Topology

TFE = tf.tpu.experimental.embedding

#: TensorFlow's default limit for a stacked table missing from
#: ``SparseCoreEmbeddingConfig`` (``TPUEmbeddingV2.DEFAULT_MAX_IDS_PER_TABLE``).
TF_DEFAULT_LIMIT = 256

#: TensorFlow's default ``max_ids_per_chip_per_sample``.
TF_DEFAULT_IDS_PER_CHIP_PER_SAMPLE = 64


@dataclasses.dataclass
class TableStats:
  """The statistics of one stacked table.

  Attributes:
    name: the stacked table's name.
    tables: the tables stacked in it.
    max_ids_per_partition: the most ids a partition received in a step.
    max_unique_ids_per_partition: the same for unique ids.
    percentile_max_ids_per_partition: the ``percentile`` of the per-step
      maxima.
    percentile_max_unique_ids_per_partition: the same for unique ids.
    ids_buffer_per_chip: the most ids one chip sent in a step, padded.
    max_ids_per_chip_per_sample: the ``max_ids_per_chip_per_sample`` this
      table needs (TensorFlow's buffer is that times its samples per chip).
    sample_count: the stacked table's samples per chip.
    ids_per_step: per step, the most ids in a partition.
    unique_ids_per_step: per step, the most unique ids in a partition.
    total_ids: ids counted (after merging duplicates within a sample).
    dropped_ids: ids the given limits would drop, or None.
    steps_over_limits: steps in which a partition exceeded the given limits
      (on TensorFlow, steps that would fail), or None.
    limits: the given ``(max_ids, max_unique_ids)``, or None.
  """

  name: str
  tables: tuple[str, ...]
  max_ids_per_partition: int
  max_unique_ids_per_partition: int
  percentile_max_ids_per_partition: int
  percentile_max_unique_ids_per_partition: int
  ids_buffer_per_chip: int
  max_ids_per_chip_per_sample: int
  sample_count: int
  ids_per_step: list[int]
  unique_ids_per_step: list[int]
  total_ids: int
  dropped_ids: int | None = None
  steps_over_limits: int | None = None
  limits: tuple[int, int] | None = None

  @property
  def dropped_fraction(self) -> float | None:
    """The fraction of ids the given limits would drop."""
    if self.dropped_ids is None:
      return None
    return self.dropped_ids / self.total_ids if self.total_ids else 0.0

  def limit(self, which: str = "max") -> tuple[int, int]:
    """``(max_ids, max_unique_ids)``: ``"max"`` or ``"percentile"``."""
    if which == "max":
      pair = (self.max_ids_per_partition, self.max_unique_ids_per_partition)
    elif which == "percentile":
      pair = (
        self.percentile_max_ids_per_partition,
        self.percentile_max_unique_ids_per_partition,
      )
    else:
      raise ValueError(f"which must be 'max' or 'percentile'; got {which!r}.")
    return max(1, pair[0]), max(1, pair[1])  # TensorFlow requires > 0.


@dataclasses.dataclass
class FdoStats:
  """SparseCore statistics over the batches seen.

  Attributes:
    topology: the ``Topology``.
    percentile: the percentile reported next to the maximum.
    steps: batches seen.
    tables: ``{stacked table name: TableStats}``.
  """

  topology: Topology
  percentile: float
  steps: int
  tables: dict[str, TableStats]

  @property
  def max_ids_per_chip_per_sample(self) -> int:
    """TensorFlow's one ``max_ids_per_chip_per_sample`` for all tables."""
    return max(
      (t.max_ids_per_chip_per_sample for t in self.tables.values()), default=1
    )

  def sparse_core_config(self, which: str = "max", **kwargs: Any) -> Any:
    """``tf.tpu.experimental.embedding.SparseCoreEmbeddingConfig`` with the
    measured limits (``which``: ``"max"`` or ``"percentile"``); ``kwargs``
    go to it too (e.g. ``allow_id_dropping=True``)."""
    limits = {name: t.limit(which) for name, t in self.tables.items()}
    kwargs.setdefault(
      "max_ids_per_chip_per_sample",
      max(TF_DEFAULT_IDS_PER_CHIP_PER_SAMPLE, self.max_ids_per_chip_per_sample),
    )
    return TFE.SparseCoreEmbeddingConfig(
      max_ids_per_table={k: v[0] for k, v in limits.items()},
      max_unique_ids_per_table={k: v[1] for k, v in limits.items()},
      **kwargs,
    )

  def sparse_core_config_source(self, which: str = "max") -> str:
    """The ``SparseCoreEmbeddingConfig(...)`` to paste."""
    config = self.sparse_core_config(which)
    return (
      "tf.tpu.experimental.embedding.SparseCoreEmbeddingConfig(\n"
      f"    max_ids_per_table={config.max_ids_per_table!r},\n"
      f"    max_unique_ids_per_table={config.max_unique_ids_per_table!r},\n"
      "    max_ids_per_chip_per_sample="
      f"{config.max_ids_per_chip_per_sample},\n)"
    )

  def keras_rs_limits(self, which: str = "max") -> dict[str, dict[str, int]]:
    """keras-rs ``TableConfig`` arguments per *table*: a table gets the
    limits of the stack it is in (keras-rs stacks as TensorFlow does)."""
    out = {}
    for stats in self.tables.values():
      max_ids, max_unique = stats.limit(which)
      for table in stats.tables:
        out[table] = {
          "max_ids_per_partition": max_ids,
          "max_unique_ids_per_partition": max_unique,
        }
    return out

  def keras_rs_source(self, which: str = "max") -> str:
    """``TableConfig(name=..., max_ids_per_partition=..., ...)`` lines."""
    return "\n".join(
      f"keras_rs.layers.TableConfig(name={table!r}, ..., "
      f"max_ids_per_partition={v['max_ids_per_partition']}, "
      f"max_unique_ids_per_partition={v['max_unique_ids_per_partition']})"
      for table, v in sorted(self.keras_rs_limits(which).items())
    )

  def to_json(self) -> dict[str, Any]:
    """The JSON ``save`` writes (``load_sparse_core_config`` reads it)."""
    return {
      "format": files.FORMAT,
      "topology": self.topology.to_json(),
      "percentile": self.percentile,
      "steps": self.steps,
      "max_ids_per_chip_per_sample": self.max_ids_per_chip_per_sample,
      "tables": {
        name: {
          **dataclasses.asdict(t),
          "limits": list(t.limits) if t.limits else None,
          "dropped_fraction": t.dropped_fraction,
          "tables": list(t.tables),
        }
        for name, t in self.tables.items()
      },
      "sparse_core_embedding_config": {
        "max_ids_per_table": {k: v.limit()[0] for k, v in self.tables.items()},
        "max_unique_ids_per_table": {
          k: v.limit()[1] for k, v in self.tables.items()
        },
        "max_ids_per_chip_per_sample": max(
          TF_DEFAULT_IDS_PER_CHIP_PER_SAMPLE, self.max_ids_per_chip_per_sample
        ),
      },
      "keras_rs": self.keras_rs_limits(),
    }

  def save(self, path: str | os.PathLike) -> str:
    """Writes ``to_json()`` to ``path`` (a file, or a directory: then
    ``fdo_stats.json`` in it); returns the file's path."""
    return files.save_json(self.to_json(), path)

  def summary(self, which: str = "max") -> str:
    """A table of the statistics, one stacked table a line."""
    lines = [
      f"FDO statistics over {self.steps} steps on {self.topology.describe()}"
      f" (p{self.percentile:g} = percentile of the per-step maxima):",
      f"  {'stacked table':30} {'max ids':>8} {'p':>6} {'max uniq':>8} "
      f"{'p':>6} {'buffer/chip':>11} {'dropped':>8}",
    ]
    for name, t in sorted(self.tables.items()):
      dropped = (
        "" if t.dropped_fraction is None else f"{t.dropped_fraction:.2%}"
      )
      shown = name if len(name) <= 30 else f"{name[:22]}..+{len(t.tables)}"
      lines.append(
        f"  {shown:30} {t.max_ids_per_partition:8d} "
        f"{t.percentile_max_ids_per_partition:6d} "
        f"{t.max_unique_ids_per_partition:8d} "
        f"{t.percentile_max_unique_ids_per_partition:6d} "
        f"{t.ids_buffer_per_chip:11d} {dropped:>8}"
      )
    lines.append(self.sparse_core_config_source(which))
    return "\n".join(lines)
