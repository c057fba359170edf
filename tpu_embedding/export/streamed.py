"""Tables too large to hold whole, written into a SavedModel by chunks.

A disk-tiered table (``tables/tiered.py``) is never copied into memory for
``export_for_serving``: its serving copy (``unwritten_table``) is made of
variables of the full shape that hold no value (``UninitializedVariable``:
nothing allocated). The signature is traced on them,
``tf.saved_model.save`` records their keys and writes no value (it skips
uninitialized variables), and ``write_rows`` then writes their values into
the SavedModel's variables checkpoint from the table's files, one chunk
of rows at a time (``checkpointing.parts.chunk_rows``: at most 64 MiB of
float32 rows), as slices of the full tensors merged by the part writer.
A quantized table is quantized by pieces of a chunk: row-wise, so with
the same values as a whole-table quantization (``bfloat16`` or ``int8``;
TensorFlow restores no float16 tensor from slices: refused). The result
is an ordinary SavedModel (TensorFlow's variables, its signature's ops);
the export holds one chunk of rows and its stored copy at a time, besides
the table's cache.

Example:
  >>> import tempfile
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.resolved import resolve
  >>> from tpu_embedding.tables.tiered import TieredTable
  >>> from tpu_embedding.tracking import VariableTracker
  >>> table = resolve(tpe.FeatureConfig(tpe.TableConfig(1000, 4, name="t")),
  ...                 tpe.SGD(0.5)).tables[0]
  >>> store = TieredTable.create(
  ...     table, tempfile.mkdtemp(), 8, VariableTracker(tf.Module()))
  >>> written_in_parts(store)
  True
  >>> copy = unwritten_table(store, "int8", "t")
  >>> copy.values.dtype.name, copy.scale.shape.as_list()
  ('int8', [1000, 1])
  >>> bool(copy.values.is_initialized())
  False
"""

from __future__ import annotations

import os
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.checkpointing import parts
from tpu_embedding.checkpointing import slicing
from tpu_embedding.export.quantize import QuantizedRows
from tpu_embedding.export.quantize import QuantizedTable
from tpu_embedding.export.quantize import quantize_rows
from tpu_embedding.tables.base import TableStore

#: The variables checkpoint of a SavedModel, under its directory.
VARIABLES = os.path.join("variables", "variables")
#: Rows quantized at once (bytes of float32 rows): a chunk's quantized
#: parts are made by pieces, without a chunk's temporaries.
QUANTIZED_ROWS_BYTES = 2**20


def written_in_parts(store: TableStore) -> bool:
  """Whether ``store``'s table is too large to hold whole in this process
  (a disk-tiered table: saved by parts, one process)."""
  variable = store.variables["parameters"]
  return (
    isinstance(variable, slicing.WorkerParts)
    and variable.written_in_parts
    and variable.worker_count == 1
  )


def unwritten_table(
  store: TableStore, table_dtype: str, name: str
) -> tf.Variable | QuantizedTable:
  """A serving copy of ``store``'s table (as ``quantize.serving_table``
  makes it) whose variables hold no value yet: ``write_rows`` writes
  them into the SavedModel.

  Raises:
    ValueError: for ``float16``, which TensorFlow cannot restore from
      slices.
  """
  if table_dtype == "float16":
    raise ValueError(
      f"Table {name!r} is kept on disk and is exported by slices, which "
      "TensorFlow cannot restore as float16: export it as bfloat16, int8 "
      "or float32."
    )
  rows, dim = store.table.vocabulary_size, store.table.dim

  def variable(dtype: tf.DType, width: int, part: str) -> tf.Variable:
    return compat.UninitializedVariable(
      shape=[rows, width], dtype=dtype, name=f"{name}/{part}", trainable=False
    )

  with tf.init_scope(), tf.device("/CPU:0"):
    if table_dtype == "float32":
      return compat.UninitializedVariable(
        shape=[rows, dim], dtype=tf.float32, name=name, trainable=False
      )
    empty = quantize_rows(tf.zeros([0, dim]), table_dtype, name)
    held = QuantizedRows(
      *(
        None if part is None else variable(part.dtype, part.shape[1], key)
        for key, part in empty._asdict().items()
      )
    )
  return QuantizedTable(held, table_dtype, name)


def _chunks(store: TableStore) -> Iterator[tuple[int, np.ndarray]]:
  """``(first row, rows)`` of ``store``'s parameters, chunk by chunk, as
  its files hold them (its cache's changed rows written first)."""
  variable = store.variables["parameters"]
  for _, entries in variable.saved_parts(["rows"]):
    ((_, spec, rows),) = entries
    first = int(spec.split()[-1].split(",")[0])  # "<rows> <dim> first,n:..."
    yield first, rows
    del entries, rows  # (one chunk held at a time)


def _stored_rows(
  copied: tf.Variable | QuantizedTable, name: str
) -> tuple[list[tf.Variable], Callable[[np.ndarray], list[tf.Tensor]]]:
  """The variables of a serving copy, and what each stores of some float32
  rows (the rows, or their ``quantize_rows`` parts), in that order."""
  if not isinstance(copied, QuantizedTable):
    return [copied], lambda rows: [tf.constant(rows)]
  held = [copied.values, copied.scale, copied.offset]
  step = max(1, QUANTIZED_ROWS_BYTES // (4 * int(copied.shape[1])))

  def quantized(rows: np.ndarray) -> list[tf.Tensor]:
    pieces = [
      quantize_rows(rows[first : first + step], copied.table_dtype, name)
      for first in range(0, len(rows), step)
    ]
    stored = zip(*pieces, strict=True)
    return [tf.concat(part, 0) for part in stored if part[0] is not None]

  return [v for v in held if v is not None], quantized


def _entries(
  keys: list[str],
  variables: list[tf.Variable],
  values: list[tf.Tensor],
  first: int,
) -> list[slicing.Entry]:
  """The slices ``values`` of ``variables`` (saved as ``keys``) from row
  ``first`` on."""
  entries = []
  for key, variable, value in zip(keys, variables, values, strict=True):
    full = variable.shape.as_list()
    extents = [(first, int(value.shape[0])), (0, full[1])]
    entries.append((key, parts.slice_spec(full, extents), value))
  return entries


def write_rows(
  export_dir: str, root: Any, stores: Mapping[str, TableStore]
) -> None:
  """Writes the values of the unwritten copies in ``root.tables`` (copies
  of ``stores``) into the SavedModel ``export_dir`` just saved from
  ``root``, chunk by chunk; its fingerprint is written again."""
  copies = {
    name: copied
    for name, copied in root.tables.items()
    if written_in_parts(stores[name])
  }
  if not copies:
    return
  prefix = os.path.join(export_dir, VARIABLES)
  writer = parts.PartWriter(prefix, [])
  writer.begin()
  # What tf.saved_model.save wrote (all but these rows) is one part.
  tf.io.gfile.makedirs(writer.temp)
  main = writer.prefix("main")
  for path in [
    *tf.io.gfile.glob(f"{prefix}.data-?????-of-?????"),
    f"{prefix}.index",
  ]:
    tf.io.gfile.rename(path, main + path[len(prefix) :])
  for name, copied in copies.items():
    variables, stored = _stored_rows(copied, name)
    keys = [key for (key,) in parts.checkpoint_keys(root, variables)]
    for first, rows in _chunks(stores[name]):
      writer.write(
        f"{parts.key_id(keys[0])}-{first:012d}",
        _entries(keys, variables, stored(rows), first),
      )
      del rows  # (one chunk held at a time)
  writer.commit()
  compat.write_saved_model_fingerprint(export_dir)
