"""The statistics FDO reports, and the configs to paste: ``FdoStats``.

Per stacked table (``TableStats``): the most ids and unique ids a
partition received in a step (the maximum over steps, and a percentile of
the per-step maxima), the same per partition (``partition_max_ids``, shaped
``[chip, source SparseCore, destination shard]``), and the ids buffer one
chip needs.

jax-tpu-embedding reports a stacked table's ``max_ids_per_partition`` as a
list of ``num_chips * num_sc_shards`` values, ``[device x shard]``: for
device ``d`` and destination shard ``s``, the most ids any of the device's
SparseCores sends ``s``. That is ``partition_max_ids.max(axis=1)`` (the
maximum over the source SparseCores) flattened, ``[d * num_sc_shards +
s]``: ``TableStats.jax_max_ids_per_partition()``; its
``required_buffer_size_per_sc`` (``[device x SparseCore]``) is each
source's ids padded to 8 per shard and summed over the shards.
``FdoStats``
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

import numpy as np
import tensorflow as tf

from tpu_embedding.engines import fdo_file as files
from tpu_embedding.fdo.topologies import Topology

TFE = tf.tpu.experimental.embedding

#: TensorFlow's default limit for a stacked table missing from
#: ``SparseCoreEmbeddingConfig`` (``TPUEmbeddingV2.DEFAULT_MAX_IDS_PER_TABLE``).
TF_DEFAULT_LIMIT = 256

#: TensorFlow's default ``max_ids_per_chip_per_sample``.
TF_DEFAULT_IDS_PER_CHIP_PER_SAMPLE = 64

#: Stacked table names longer than this are shown abbreviated.
SHORT_NAME = 40

#: What the partition arrays' axes are (``to_json``'s ``partition_axes``).
PARTITION_AXES = ["chip", "source SparseCore", "destination shard"]


def short_name(name: str, tables: tuple[str, ...], width: int = SHORT_NAME):
  """``name`` if it is short, else its first table and how many follow
  (``"embedding_table_01 +21 tables"``), at most ``width`` characters."""
  if len(name) <= width:
    return name
  if len(tables) > 1:
    more = f" +{len(tables) - 1} tables"
    first = tables[0]
    if len(first) + len(more) > width:
      first = first[: width - len(more) - 2] + ".."
    return first + more
  return name[: width - 2] + ".."


def _table_list(tables: tuple[str, ...]) -> str:
  """``a, b, c``, or where that is long ``a +25 tables``."""
  return short_name(", ".join(tables), tables)


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
    partition_max_ids: ``[chip, source SparseCore, destination shard]``:
      the most ids that partition received in any step (its maximum is
      ``max_ids_per_partition``); None where not kept.
    partition_max_unique_ids: the same for unique ids.
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
  partition_max_ids: np.ndarray | None = None
  partition_max_unique_ids: np.ndarray | None = None

  def jax_max_ids_per_partition(self, unique: bool = False) -> np.ndarray:
    """The per-partition maxima as jax-tpu-embedding lists them: one value
    per (device, destination shard), ``[d * num_sc_shards + s]``, the most
    any of the device's SparseCores sent (its
    ``SparseDenseMatmulInputStats.max_ids_per_partition[stack]``, or
    ``max_unique_ids_per_partition`` with ``unique``)."""
    counts = self.partition_max_unique_ids if unique else self.partition_max_ids
    if counts is None:
      raise ValueError(f"{self.name}: no per-partition statistics kept.")
    return counts.max(axis=1).reshape(-1)

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
    stacking: how the tables were stacked: ``"tensorflow"``
      (``TPUEmbeddingV2``; keras-rs on TensorFlow), ``"none"`` (each table
      alone) or ``"jax"`` (jax-tpu-embedding's rule: keras-rs on JAX).
  """

  topology: Topology
  percentile: float
  steps: int
  tables: dict[str, TableStats]
  stacking: str = "tensorflow"

  @property
  def keras_rs_backend(self) -> str:
    """Which keras-rs backend ``keras_rs_limits`` holds for, in words."""
    return {
      "tensorflow": "keras-rs on TensorFlow (TensorFlow's stacking; on JAX: "
      "stacking='jax')",
      "jax": "keras-rs on JAX (jax-tpu-embedding's stacking, "
      'table_stacking="auto")',
      "none": "keras-rs with table_stacking=None, on TensorFlow or JAX",
    }[self.stacking]

  @property
  def max_ids_per_chip_per_sample(self) -> int:
    """TensorFlow's one ``max_ids_per_chip_per_sample`` for all tables."""
    return max(
      (t.max_ids_per_chip_per_sample for t in self.tables.values()), default=1
    )

  def sparse_core_config(self, which: str = "max", **kwargs: Any) -> Any:
    """``tf.tpu.experimental.embedding.SparseCoreEmbeddingConfig`` with the
    measured limits (``which``: ``"max"`` or ``"percentile"``); ``kwargs``
    go to it too (e.g. ``allow_id_dropping=True``). Measured unstacked
    (``stacking="none"``), it has ``disable_table_stacking=True``."""
    if self.stacking == "jax":
      raise ValueError(
        "sparse_core_config: these statistics follow jax-tpu-embedding's "
        "stacking (keras-rs on JAX), whose stacked tables TensorFlow does not"
        " have; use keras_rs_limits(), or measure with stacking='tensorflow'."
      )
    arguments = self._sparse_core_arguments(which)
    if self.stacking != "none":
      del arguments["disable_table_stacking"]
    limits = {
      k: arguments.pop(k)
      for k in ("max_ids_per_table", "max_unique_ids_per_table")
    }
    return TFE.SparseCoreEmbeddingConfig(**limits, **{**arguments, **kwargs})

  def _sparse_core_arguments(self, which: str = "max") -> dict[str, Any]:
    """``SparseCoreEmbeddingConfig``'s arguments for the measured limits."""
    limits = {name: t.limit(which) for name, t in self.tables.items()}
    return {
      "max_ids_per_table": {k: v[0] for k, v in limits.items()},
      "max_unique_ids_per_table": {k: v[1] for k, v in limits.items()},
      "max_ids_per_chip_per_sample": max(
        TF_DEFAULT_IDS_PER_CHIP_PER_SAMPLE, self.max_ids_per_chip_per_sample
      ),
      "disable_table_stacking": self.stacking == "none",
    }

  def sparse_core_config_source(self, which: str = "max") -> str:
    """The ``SparseCoreEmbeddingConfig(...)`` to paste."""
    config = self.sparse_core_config(which)
    disable = (
      "    disable_table_stacking=True,\n" if self.stacking == "none" else ""
    )
    return (
      "tf.tpu.experimental.embedding.SparseCoreEmbeddingConfig(\n"
      f"    max_ids_per_table={config.max_ids_per_table!r},\n"
      f"    max_unique_ids_per_table={config.max_unique_ids_per_table!r},\n"
      "    max_ids_per_chip_per_sample="
      f"{config.max_ids_per_chip_per_sample},\n{disable})"
    )

  def keras_rs_limits(self, which: str = "max") -> dict[str, dict[str, int]]:
    """keras-rs ``TableConfig`` arguments per *table*: a table gets the
    limits of the stack it is in (keras-rs takes a stack's limits as the
    largest of its tables'). The stacks are this ``stacking``'s:
    TensorFlow's hold for keras-rs on TensorFlow, jax-tpu-embedding's
    (``stacking="jax"``) for keras-rs on JAX (``keras_rs_backend``)."""
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
    """The keras-rs ``TableConfig`` limits, one line per stacked table
    (its tables named, or if that is long the first and a count:
    ``keras_rs_limits`` and the JSON name them all)."""
    lines = []
    for _, stats in sorted(self.tables.items()):
      max_ids, max_unique = stats.limit(which)
      lines.append(
        f"{_table_list(stats.tables)}: max_ids_per_partition={max_ids}, "
        f"max_unique_ids_per_partition={max_unique}"
      )
    return "\n".join(lines)

  def to_json(self) -> dict[str, Any]:
    """The JSON ``save`` writes (``load_sparse_core_config`` reads it)."""
    return {
      "format": files.FORMAT,
      "topology": self.topology.to_json(),
      "percentile": self.percentile,
      "steps": self.steps,
      "max_ids_per_chip_per_sample": self.max_ids_per_chip_per_sample,
      "stacking": self.stacking,
      "partition_axes": PARTITION_AXES,
      "tables": {
        name: {
          **dataclasses.asdict(t),
          "limits": list(t.limits) if t.limits else None,
          "dropped_fraction": t.dropped_fraction,
          "tables": list(t.tables),
          "partition_max_ids": _as_list(t.partition_max_ids),
          "partition_max_unique_ids": _as_list(t.partition_max_unique_ids),
        }
        for name, t in self.tables.items()
      },
      "sparse_core_embedding_config": None
      if self.stacking == "jax"
      else self._sparse_core_arguments(),
      "keras_rs": self.keras_rs_limits(),
      "keras_rs_backend": self.keras_rs_backend,
    }

  def save(self, path: str | os.PathLike) -> str:
    """Writes ``to_json()`` to ``path`` (a file, or a directory: then
    ``fdo_stats.json`` in it); returns the file's path."""
    return files.save_json(self.to_json(), path)

  def summary(self, which: str = "max") -> str:
    """A table of the statistics, one stacked table a line (long names
    abbreviated: ``short_name``), then the ``SparseCoreEmbeddingConfig``
    to paste where its names are short enough to read."""
    stacking = {
      "tensorflow": "TensorFlow's stacking",
      "none": "tables unstacked",
      "jax": "jax-tpu-embedding's stacking (keras-rs on JAX)",
    }[self.stacking]
    shown = {n: short_name(n, t.tables) for n, t in self.tables.items()}
    width = max([13, *map(len, shown.values())])
    lines = [
      f"FDO statistics over {self.steps} steps on {self.topology.describe()}"
      f", {stacking} (p{self.percentile:g} = percentile of the per-step "
      "maxima):",
      f"  {'stacked table':{width}} {'max ids':>8} {'p':>6} {'max uniq':>8} "
      f"{'p':>6} {'buffer/chip':>11} {'dropped':>8}",
    ]
    for name, t in sorted(self.tables.items()):
      dropped = (
        "" if t.dropped_fraction is None else f"{t.dropped_fraction:.2%}"
      )
      lines.append(
        f"  {shown[name]:{width}} {t.max_ids_per_partition:8d} "
        f"{t.percentile_max_ids_per_partition:6d} "
        f"{t.max_unique_ids_per_partition:8d} "
        f"{t.percentile_max_unique_ids_per_partition:6d} "
        f"{t.ids_buffer_per_chip:11d} {dropped:>8}"
      )
    if self.stacking == "jax":
      lines.append(
        "No SparseCoreEmbeddingConfig: these stacks are jax-tpu-embedding's;"
        " the keras-rs limits hold for keras-rs on JAX."
      )
    elif max(map(len, self.tables), default=0) > SHORT_NAME:
      lines += [
        "SparseCoreEmbeddingConfig: not printed, its stacked table names run"
        f" to {max(map(len, self.tables))} characters. Save the file",
        "(FdoStats.save, fdo_report.py --save FILE) and pass "
        "tpe.TPUEmbedding(..., sparse_core_embedding_config=FILE),",
        "or fdo.load_sparse_core_config(FILE).",
      ]
    else:
      lines.append(self.sparse_core_config_source(which))
    return "\n".join(lines)


def _as_list(array: np.ndarray | None) -> list[Any] | None:
  return None if array is None else array.tolist()
