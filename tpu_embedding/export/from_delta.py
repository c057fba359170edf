"""A new SavedModel version from the previous one and a delta checkpoint.

An export from a checkpoint (``tools/export.py``, or ``export_for_serving(
..., source=ExportSource(path, checkpoint))``) records where its values
came from, in ``assets.extra/tpu_embedding_source.json`` (a file TF
Serving and TensorFlow's loader ignore): the checkpoint's digest
(``checkpointing.parts.save_id``, what a delta names its parent by) and, for
each exported table and model variable, its key in the training
checkpoint and in the SavedModel's variables.

``apply_delta(base_export, delta, export_dir)`` writes the next version
from TensorFlow's files alone (no model code, no training job): it checks
that the delta follows the base version's source (else a one-line
``DeltaMismatchError`` naming both digests), rewrites the delta's rows of
each exported table (quantized again with ``quantize_rows`` for a float16,
bfloat16 or int8 export: row-wise, so the result equals a quantized export
of the whole table), takes the model's variables from the delta (deltas
hold dense state whole), and keeps everything else of the base version.
The delta's other tables and its optimizer slots are not read. The result
equals an export of the full checkpoint at the delta's step, bit for bit.

The version is written under ``<export_dir>_temp`` (not a number: TF
Serving does not load it) and renamed into place once whole, so a write
that fails or is killed leaves the previous versions as they were (the
next ``apply_delta`` to that directory removes the leftover). Tables with
a ``DynamicVocabulary`` are refused (export them from a full checkpoint).

Example:
  >>> import tempfile
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding import export
  >>> emb = tpe.TPUEmbedding({"f": tpe.FeatureConfig(
  ...     tpe.TableConfig(8, 2, name="t"))}, tpe.SGD(0.1))
  >>> emb.build()
  >>> ckpt = tf.train.Checkpoint(embedding=emb)
  >>> work = tempfile.mkdtemp()
  >>> base = tpe.checkpoints.write(ckpt, work + "/ckpt-1")
  >>> _ = export.export_for_serving(
  ...     work + "/1", emb, None, {"f": export.FeatureSpec()},
  ...     source=export.ExportSource(base, ckpt))
  >>> _ = emb.table_stores["t"].write_rows(3, tf.ones([1, 2]))
  >>> delta = tpe.checkpoints.write_delta(ckpt, work + "/delta-2")
  >>> export.apply_delta(work + "/1", delta, work + "/2").rows
  {'t': 1}
  >>> serve = tf.saved_model.load(work + "/2").signatures["serving_default"]
  >>> serve(f=tf.constant([3], tf.int64))["f"].numpy()
  array([[1., 1.]], dtype=float32)
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.checkpointing import deltas
from tpu_embedding.checkpointing import slicing
from tpu_embedding.checkpointing.deltas import DeltaMismatchError
from tpu_embedding.checkpointing.deltas import SavedKeys
from tpu_embedding.checkpointing.manager import saved_chain
from tpu_embedding.checkpointing.parts import remove
from tpu_embedding.checkpointing.parts import save_id
from tpu_embedding.checkpointing.parts import write_tensors
from tpu_embedding.checkpointing.rows import read_tensors
from tpu_embedding.export.quantize import QuantizedTable
from tpu_embedding.export.quantize import check_table_dtype
from tpu_embedding.export.quantize import quantize_rows

__all__ = [
  "DeltaExport",
  "DeltaMismatchError",
  "ExportSource",
  "SourceKeys",
  "apply_delta",
  "read_source",
  "record_source",
  "source_keys",
]

#: Where an export records its source, inside the SavedModel directory.
SOURCE_FILE = os.path.join("assets.extra", "tpu_embedding_source.json")
#: Format version of ``SOURCE_FILE``.
FORMAT = 1
#: The variables checkpoint of a SavedModel, under its directory.
_VARIABLES = os.path.join("variables", "variables")
#: Files of a SavedModel written anew (not copied from the base).
_REWRITTEN = ("variables", "fingerprint.pb")


@dataclasses.dataclass(frozen=True)
class ExportSource:
  """The checkpoint an export's values were restored from (or equal).

  Attributes:
    path: the checkpoint's prefix (``.../ckpt-20``), full or a delta.
    checkpoint: a ``tf.train.Checkpoint`` of the exported embedding and
      model under their keys in that checkpoint
      (``tf.train.Checkpoint(embedding=emb, model=model)``): it names
      every exported variable's key there.

  Example:
    >>> import tensorflow as tf
    >>> from tpu_embedding.export import ExportSource
    >>> ExportSource("/tmp/run/ckpt-1", tf.train.Checkpoint()).path
    '/tmp/run/ckpt-1'
  """

  path: str
  checkpoint: Any


@dataclasses.dataclass(frozen=True)
class DeltaExport:
  """What ``apply_delta`` wrote.

  Attributes:
    export_dir: the new SavedModel version.
    base_export: the version it was made from.
    delta: the delta checkpoint applied.
    parent: the base version's source digest (the delta's parent).
    source: the new version's source digest (the delta's own).
    rows: ``{table: rows rewritten}`` of the exported tables.
    model_variables: how many model variables were taken from the delta.
    seconds: the wall time of the whole call.

  Example:
    >>> from tpu_embedding.export import DeltaExport
    >>> DeltaExport("/m/2", "/m/1", "/run/delta-2", "a", "b", {"t": 3}, 2,
    ...             0.5).rows
    {'t': 3}
  """

  export_dir: str
  base_export: str
  delta: str
  parent: str
  source: str
  rows: dict[str, int]
  model_variables: int
  seconds: float


def _one_key(keys: list[str] | None) -> str | None:
  return keys[0] if keys is not None and len(keys) == 1 else None


@dataclasses.dataclass(frozen=True)
class SourceKeys:
  """Each exported variable's key in an export's source checkpoint.

  Attributes:
    source: the source.
    tables: ``{table name: its key there}``.
    model: ``{id(model variable): its key there}``.
  """

  source: ExportSource
  tables: dict[str, str]
  model: dict[int, str]


def _variable_names(variables: list[Any]) -> str:
  names = [str(getattr(v, "name", v)) for v in variables]
  shown = ", ".join(names[:5])
  return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def source_keys(
  source: ExportSource,
  stores: Mapping[str, Any],
  model_variables: list[Any],
) -> SourceKeys:
  """Finds every exported variable in ``source.checkpoint`` (nothing is
  read or written): ``export_for_serving(..., source=...)`` calls it
  before writing anything.

  A Keras 3 model's variables are matched through the ``keras.Variable``
  the checkpoint names (``compat.checkpoint_keys``); tf-keras and
  ``tf.Module`` variables are themselves.

  Args:
    source: the checkpoint the values came from.
    stores: ``{table name: TableStore}`` of the exported tables.
    model_variables: the variables the exported model reads.

  Raises:
    ValueError: a table or model variable is not in ``source.checkpoint``
      (one line naming them): an export recording it would make versions
      from deltas that keep its old value.
  """
  with slicing.rows_apart():  # keys only: no table is read
    own = compat.checkpoint_keys(source.checkpoint)
  # The keys the source's saves hold these values under (a model weight
  # may be saved as its optimizer's: deltas.SavedKeys).
  saved_keys = SavedKeys(saved_chain(source.path)[0])
  trained = {
    obj: [saved_keys.saved_key(key) or key for key in keys]
    for obj, keys in own.items()
  }
  tables = {}
  for name, store in stores.items():
    key = _one_key(trained.get(id(store.variables["parameters"])))
    if key is None:
      raise ValueError(
        f"Table {name!r} is not in the source checkpoint's objects "
        f"({source.path}): ExportSource.checkpoint must hold the exported "
        "embedding under its key there."
      )
    tables[name] = key
  model = {}
  unmapped = []
  for variable in model_variables:
    key = _one_key(trained.get(id(variable)))
    if key is None:
      unmapped.append(variable)
    else:
      model[id(variable)] = key
  if unmapped:
    raise ValueError(
      f"The exported model reads {len(unmapped)} variable(s) that "
      f"ExportSource.checkpoint does not hold ({_variable_names(unmapped)}): "
      f"put the model under its key in {source.path}'s objects "
      "(tf.train.Checkpoint(embedding=..., model=model)), so that every "
      "exported value has its source; nothing was written."
    )
  return SourceKeys(source, tables, model)


def record_source(
  export_dir: str,
  keys: SourceKeys,
  root: Any,
  table_dtype: str,
) -> dict[str, Any]:
  """Records the export's source in the SavedModel ``export_dir`` just
  written (``export_for_serving(..., source=...)`` calls it).

  Args:
    export_dir: the SavedModel, written from ``root``.
    keys: ``source_keys`` of its tables and model variables.
    root: the saved object: its ``tables`` (``{name: copy}``),
      ``vocabularies`` and ``model_variables``.
    table_dtype: the type the tables are stored in.

  Returns:
    The record written to ``SOURCE_FILE``.
  """
  saved = compat.checkpoint_keys(root)
  stored = tf.train.load_checkpoint(
    os.path.join(export_dir, _VARIABLES)
  ).get_variable_to_shape_map()

  def saved_key(variable: tf.Variable) -> str:
    key = _one_key(saved.get(id(variable)))
    if key is None or key not in stored:
      raise RuntimeError(
        f"Variable {variable.name} has no key of its own in the SavedModel "
        f"{export_dir}'s variables (found {saved.get(id(variable))})."
      )
    return key

  tables = {}
  for name, copied in root.tables.items():
    parts = (
      {"values": copied.values, "scale": copied.scale, "offset": copied.offset}
      if isinstance(copied, QuantizedTable)
      else {"values": copied}
    )
    tables[name] = {
      "key": keys.tables[name],
      "shape": copied.shape.as_list(),
      "variables": {
        part: saved_key(variable)
        for part, variable in parts.items()
        if variable is not None
      },
    }
  model = {
    keys.model[id(variable)]: saved_key(variable)
    for variable in root.model_variables
  }
  source = keys.source
  name = os.path.basename(source.path.rstrip("/"))
  record = {
    "format": FORMAT,
    "source": save_id(source.path),
    "source_name": name,
    "history": [name],
    "table_dtype": check_table_dtype(table_dtype),
    "tables": tables,
    "dynamic_tables": sorted(root.vocabularies),
    "model": model,
    "unmapped_model_variables": 0,
  }
  _write_record(export_dir, record)
  return record


def _write_record(export_dir: str, record: dict[str, Any]) -> None:
  path = os.path.join(export_dir, SOURCE_FILE)
  tf.io.gfile.makedirs(os.path.dirname(path))
  with tf.io.gfile.GFile(path, "w") as f:
    f.write(json.dumps(record, indent=1, sort_keys=True))


def read_source(export_dir: str) -> dict[str, Any]:
  """The source record of the SavedModel ``export_dir``.

  Its ``source`` is the digest of the checkpoint (or last delta) its
  values equal; ``history`` names the checkpoint and the deltas applied
  since, in order.

  Raises:
    ValueError: ``export_dir`` is not a SavedModel, or records no source.

  Example:
    >>> from tpu_embedding.export import read_source
    >>> read_source("/nonexistent/1")
    Traceback (most recent call last):
    ...
    ValueError: '/nonexistent/1' is not a SavedModel (no saved_model.pb).
  """
  if not tf.io.gfile.exists(os.path.join(export_dir, "saved_model.pb")):
    raise ValueError(f"'{export_dir}' is not a SavedModel (no saved_model.pb).")
  path = os.path.join(export_dir, SOURCE_FILE)
  if not tf.io.gfile.exists(path):
    raise ValueError(
      f"SavedModel '{export_dir}' records no source checkpoint (no "
      f"{SOURCE_FILE}): export it from a checkpoint with tools/export.py "
      "before applying deltas to it."
    )
  with tf.io.gfile.GFile(path) as f:
    record: dict[str, Any] = json.loads(f.read())
  if record.get("format") != FORMAT:
    raise ValueError(
      f"SavedModel '{export_dir}': {SOURCE_FILE} has format "
      f"{record.get('format')!r}; this version reads format {FORMAT}."
    )
  return record


@dataclasses.dataclass
class _Updates:
  """The new values of the base version's variables, by saved key."""

  rows: dict[str, tuple[np.ndarray, tf.Tensor]] = dataclasses.field(
    default_factory=dict
  )
  whole: dict[str, tf.Tensor] = dataclasses.field(default_factory=dict)
  row_counts: dict[str, int] = dataclasses.field(default_factory=dict)


def _updates(
  base_export: str, record: dict[str, Any], delta: str, meta: dict[str, Any]
) -> _Updates:
  """Reads and checks the delta's rows and dense values (nothing written)."""
  base = tf.train.load_checkpoint(os.path.join(base_export, _VARIABLES))
  shapes = base.get_variable_to_shape_map()
  dtypes = base.get_variable_to_dtype_map()
  held = set(meta["tables"])
  table_dtype = record["table_dtype"]
  updates = _Updates()
  for name, table in record["tables"].items():
    if table["key"] not in held:
      raise ValueError(
        f"Delta '{delta}' holds no rows of table {name!r} ({table['key']}), "
        f"which SavedModel '{base_export}' exports: it is not a delta of "
        "the run that SavedModel was exported from."
      )
    found = deltas.read_rows(delta, table["key"])
    rows, dim = table["shape"]
    if found is None or not found[0].size:
      updates.row_counts[name] = 0
      continue
    ids, values = found
    updates.row_counts[name] = int(ids.size)
    if values.shape != (ids.size, dim):
      raise ValueError(
        f"Delta '{delta}' holds rows of shape {values.shape} for table "
        f"{name!r}, whose rows have {dim} values: it is not a delta of "
        "this model."
      )
    if ids.min() < 0 or ids.max() >= rows:
      raise ValueError(
        f"Delta '{delta}' writes row {int(ids.max())} of table {name!r}, "
        f"which has {rows} rows: it is not a delta of this model."
      )
    if table_dtype == "float32":
      parts = {"values": tf.constant(values, tf.float32)}
    else:
      quantized = quantize_rows(tf.constant(values), table_dtype, name)
      parts = {
        part: value
        for part, value in quantized._asdict().items()
        if value is not None
      }
    for part, key in table["variables"].items():
      updates.rows[key] = (ids.astype(np.int64), parts[part])
  stored = tf.train.load_checkpoint(delta).get_variable_to_shape_map()
  for trained_key, saved_key in record["model"].items():
    if trained_key not in stored:
      raise ValueError(
        f"Delta '{delta}' holds no value of {trained_key}, which SavedModel "
        f"'{base_export}' serves: it is not a delta of the run that "
        "SavedModel was exported from."
      )
    if stored[trained_key] != shapes[saved_key]:
      raise ValueError(
        f"Delta '{delta}' holds {trained_key} of shape "
        f"{stored[trained_key]}; SavedModel '{base_export}' has "
        f"{shapes[saved_key]}: it is not a delta of this model."
      )
    (updates.whole[saved_key],) = read_tensors(
      delta, [trained_key], [dtypes[saved_key]]
    )
  return updates


def _write_variables(base_prefix: str, prefix: str, updates: _Updates) -> None:
  """Writes the base's variables with ``updates`` to ``prefix``."""
  dtypes = tf.train.load_checkpoint(base_prefix).get_variable_to_dtype_map()
  names = sorted(dtypes)
  values = read_tensors(base_prefix, names, [dtypes[n] for n in names])
  entries = []
  with tf.device("CPU"):
    for name, value in zip(names, values, strict=True):
      if name in updates.whole:
        value = updates.whole[name]
      elif name in updates.rows:
        ids, new_rows = updates.rows[name]
        value = tf.tensor_scatter_nd_update(value, ids[:, None], new_rows)
      entries.append((name, "", value))
  write_tensors(prefix, entries)


def _copy_tree(source: str, target: str) -> None:
  """Copies the SavedModel ``source`` to ``target``, but its variables
  and fingerprint (written anew)."""
  tf.io.gfile.makedirs(os.path.join(target, "variables"))
  for directory, subdirectories, files in tf.io.gfile.walk(source):
    relative = os.path.relpath(directory, source)
    if relative.split(os.sep)[0] in _REWRITTEN:
      continue
    for name in subdirectories:
      if relative != "." or name not in _REWRITTEN:
        tf.io.gfile.makedirs(
          os.path.normpath(os.path.join(target, relative, name))
        )
    for name in files:
      if relative == "." and name in _REWRITTEN:
        continue
      tf.io.gfile.copy(
        os.path.join(directory, name),
        os.path.normpath(os.path.join(target, relative, name)),
        overwrite=True,
      )


def _commit(temp: str, export_dir: str) -> None:
  """Renames the whole version ``temp`` to ``export_dir`` (replacing it)."""
  old = f"{export_dir}_old"
  if tf.io.gfile.exists(export_dir):
    remove(old)
    tf.io.gfile.rename(export_dir, old)
  tf.io.gfile.rename(temp, export_dir)
  remove(old)


def apply_delta(
  base_export: str, delta: str, export_dir: str, *, overwrite: bool = False
) -> DeltaExport:
  """Writes ``export_dir``: the SavedModel ``base_export`` plus ``delta``.

  Args:
    base_export: a SavedModel exported from a checkpoint (or made by
      ``apply_delta``), which records its source.
    delta: a delta checkpoint (``tpu_embedding.checkpoints.write_delta``)
      whose parent is that source.
    export_dir: the new version's directory (for TF Serving:
      ``<model>/<version>``), absent or empty.
    overwrite: replace a non-empty ``export_dir`` (at the final rename).

  Returns:
    A ``DeltaExport``.

  Raises:
    DeltaMismatchError: the delta does not follow the base version's
      source (another run's delta, or a delta skipped): one line naming
      both digests. Nothing is written.
    ValueError: ``base_export`` records no source, has dynamic tables, or
      is ``export_dir``; ``delta`` is not a delta or not of this model;
      ``export_dir`` is not empty without ``overwrite``. Nothing is
      written.
  """
  start = time.perf_counter()
  base_export = base_export.rstrip("/") or "/"
  export_dir = export_dir.rstrip("/") or "/"
  if os.path.abspath(base_export) == os.path.abspath(export_dir):
    raise ValueError(
      f"The new version's directory {export_dir} is the base version's: "
      "write it to a new version directory."
    )
  record = read_source(base_export)
  meta = deltas.read_meta(delta)
  if meta["parent"] != record["source"]:
    raise DeltaMismatchError(
      f"Delta '{delta}' follows save '{meta['parent_name']}' (id "
      f"{meta['parent']}), not '{record['source_name']}' (id "
      f"{record['source']}), the source of SavedModel '{base_export}': "
      "apply the deltas of the run it was exported from, in order, each "
      "to the version made from the one before."
    )
  if record.get("unmapped_model_variables"):
    raise ValueError(
      f"SavedModel '{base_export}' reads {record['unmapped_model_variables']} "
      "model variable(s) its source record does not map to the training "
      "checkpoint (an export by an earlier version, which matched Keras 3 "
      "variables by identity): a version made from it would keep their old "
      "values. Export it anew from the checkpoint (tools/export.py), then "
      "apply the deltas after that checkpoint."
    )
  if record["dynamic_tables"]:
    raise ValueError(
      f"SavedModel '{base_export}' exports tables with a DynamicVocabulary "
      f"({', '.join(record['dynamic_tables'])}), whose deltas apply_delta "
      "does not support: export the new version from a full checkpoint."
    )
  if (
    tf.io.gfile.exists(export_dir)
    and tf.io.gfile.listdir(export_dir)
    and not overwrite
  ):
    raise ValueError(
      f"export_dir {export_dir} is not empty; pass --overwrite "
      "(overwrite=True) or choose a new version directory."
    )
  updates = _updates(base_export, record, delta, meta)
  temp = f"{export_dir}_temp"
  remove(temp)  # what a killed write left
  try:
    _copy_tree(base_export, temp)
    _write_variables(
      os.path.join(base_export, _VARIABLES),
      os.path.join(temp, _VARIABLES),
      updates,
    )
    name = os.path.basename(delta.rstrip("/"))
    new_record = dict(
      record,
      source=save_id(delta),
      source_name=name,
      history=[*record["history"], name],
    )
    _write_record(temp, new_record)
    compat.write_saved_model_fingerprint(temp)
  except BaseException:
    remove(temp)
    raise
  _commit(temp, export_dir)
  return DeltaExport(
    export_dir=export_dir,
    base_export=base_export,
    delta=delta,
    parent=record["source"],
    source=new_record["source"],
    rows=updates.row_counts,
    model_variables=len(updates.whole),
    seconds=time.perf_counter() - start,
  )
