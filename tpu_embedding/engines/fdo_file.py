"""The FDO file: the statistics as JSON, and TensorFlow's config from it.

``FdoStats.save`` (and the trainer's ``--fdo_stats_dir``) write
``fdo_stats.json``; ``load_sparse_core_config`` turns it into the
``SparseCoreEmbeddingConfig`` a TPU run takes (``tpe.TPUEmbedding(...,
sparse_core_embedding_config=path)`` calls it).

Example:
  >>> import os
  >>> import tempfile
  >>> import numpy as np
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding import fdo
  >>> table = tpe.TableConfig(64, 8, name="t")
  >>> stats = fdo.compute_stats(
  ...     {"f": tpe.FeatureConfig(table)}, [{"f": np.zeros(16, np.int64)}],
  ...     (1, 4), optimizer=tpe.SGD(0.1))
  >>> path = stats.save(tempfile.mkdtemp())
  >>> os.path.basename(path), load(path)["steps"]
  ('fdo_stats.json', 1)
  >>> load_sparse_core_config(path).max_unique_ids_per_table
  {'t': 1}
"""

from __future__ import annotations

import json
import os
from typing import Any

import tensorflow as tf

TFE = tf.tpu.experimental.embedding

#: JSON format tag of the files ``FdoStats.save`` writes.
FORMAT = "tpu_embedding.fdo/1"


def save_json(data: dict[str, Any], path: str | os.PathLike) -> str:
  """Writes ``data`` to ``path`` (a file, or a directory: then
  ``fdo_stats.json`` in it) at once; returns the file's path."""
  path = os.fspath(path)
  if os.path.isdir(path):
    path = os.path.join(path, "fdo_stats.json")
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=2, sort_keys=True)
  os.replace(tmp, path)
  return path


def load(path: str | os.PathLike) -> dict[str, Any]:
  """The JSON ``FdoStats.save`` wrote (a file or its directory)."""
  path = os.fspath(path)
  if os.path.isdir(path):
    path = os.path.join(path, "fdo_stats.json")
  with open(path) as f:
    try:
      data = json.load(f)
    except ValueError as error:
      raise ValueError(
        f"{path} is not a tpu_embedding FDO file (not JSON: {error})."
      ) from None
  found = data.get("format") if isinstance(data, dict) else None
  if found != FORMAT:
    raise ValueError(
      f"{path} is not a tpu_embedding FDO file (format {found!r}, "
      f"expected {FORMAT!r})."
    )
  return data


def load_sparse_core_config(
  path: str | os.PathLike, which: str = "max", **kwargs: Any
) -> Any:
  """The ``SparseCoreEmbeddingConfig`` of an FDO file.

  Args:
    path: the file ``FdoStats.save`` wrote, or its directory.
    which: ``"max"`` or ``"percentile"`` limits.
    **kwargs: more ``SparseCoreEmbeddingConfig`` fields
      (``allow_id_dropping=True``...).

  Returns:
    ``tf.tpu.experimental.embedding.SparseCoreEmbeddingConfig``.
  """
  data = load(path)
  key = {"max": "", "percentile": "percentile_"}[which]
  tables = data["tables"]
  if data.get("stacking") == "jax":
    raise ValueError(
      f"{path} was measured with jax-tpu-embedding's stacking (keras-rs on "
      'JAX): its stacked tables are not TensorFlow\'s; use its "keras_rs" '
      "limits, or measure with stacking='tensorflow'."
    )
  if data.get("stacking") == "none":
    kwargs.setdefault("disable_table_stacking", True)
  kwargs.setdefault(
    "max_ids_per_chip_per_sample",
    data["sparse_core_embedding_config"]["max_ids_per_chip_per_sample"],
  )
  return TFE.SparseCoreEmbeddingConfig(
    max_ids_per_table={
      k: max(1, v[f"{key}max_ids_per_partition"]) for k, v in tables.items()
    },
    max_unique_ids_per_table={
      k: max(1, v[f"{key}max_unique_ids_per_partition"])
      for k, v in tables.items()
    },
    **kwargs,
  )
