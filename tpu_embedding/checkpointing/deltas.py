"""Delta checkpoints: the rows written since the previous save.

Every table store keeps one bit per row (``tables/changed_rows.py``), set
by every write of the row or its slots in the same step. A delta save
(``write_delta``) writes, for each table and slot of a checkpoint, the ids
and values of the rows set since the previous save (full or delta) of
these tables, and everything else of the checkpoint whole: dense weights,
counters, dynamic vocabularies' state (small: three int64 per row). Its
size and time follow the rows touched, not the tables.

Each worker writes its own rows (tables sharded over workers), the chief
everything else, as parts merged and committed like a full checkpoint
(``parts.PartWriter``): a ``<prefix>.index`` is only ever a whole delta,
and a save killed while writing leaves the previous saves as they were.
The bits are cleared only once the delta is committed.

A delta names its parent: the digest (``parts.save_id``) of
the save it follows. ``apply_deltas`` (``checkpoints.restore(...,
deltas=...)``) checks the whole chain before changing anything, then
writes each delta's rows in order into any layout and replica count:
each process takes the rows its blocks hold. A delta applied to another
base, or after a skipped delta, is refused with a ``DeltaMismatchError``
naming both saves.

Delta files hold plain tensors: ``_DELTA/meta`` (JSON), and per table key
``_DELTA/<worker>/rows/<key>`` (int64 ids) and ``_DELTA/<worker>/values/
<key>`` (``[n, dim]``), beside the other state under its usual keys.

Example:
  >>> import tempfile
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> emb = tpe.TPUEmbedding(tpe.FeatureConfig(tpe.TableConfig(8, 2)),
  ...                        tpe.SGD(0.1))
  >>> emb.build()
  >>> checkpoint = tf.train.Checkpoint(embedding=emb)
  >>> directory = tempfile.mkdtemp()
  >>> base = tpe.checkpoints.write(checkpoint, directory + "/ckpt-1")
  >>> store = emb.table_stores["table_0"]
  >>> _ = store.write_rows(3, tf.ones([1, 2]))
  >>> delta = write_delta(checkpoint, directory + "/delta-2")
  >>> read_meta(delta)["rows"]
  1
  >>> _ = tpe.checkpoints.restore(checkpoint, base, deltas=[delta])
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.checkpointing import parts
from tpu_embedding.checkpointing import rows as saved_rows
from tpu_embedding.checkpointing import slicing

__all__ = [
  "DeltaMismatchError",
  "apply_deltas",
  "read_meta",
  "read_rows",
  "write_delta",
]

#: The delta's metadata tensor (JSON).
META_KEY = "_DELTA/meta"
#: Format version of ``META_KEY``.
FORMAT = 1
_STORE_ATTRIBUTE = "_tpu_embedding_store"


class DeltaMismatchError(ValueError):
  """A delta does not follow the save it is applied to.

  Example:
    >>> str(DeltaMismatchError("delta-3 follows x, not y"))
    'delta-3 follows x, not y'
  """


#: ``{store or checkpoint: (prefix, save id)}``: the last save of a
#: checkpoint's tables written or restored by this process.
_last_saves: weakref.WeakKeyDictionary[Any, tuple[str, str]] = (
  weakref.WeakKeyDictionary()
)


class _Table:
  """One table variable of a checkpoint: its key, store and store key."""

  def __init__(self, key: str, variable: Any):
    self.key = key
    self.variable = variable
    self.store, self.store_key = getattr(variable, _STORE_ATTRIBUTE)


def _split(
  checkpoint: Any,
) -> tuple[list[_Table], list[tuple[Any, dict[str, Any]]]]:
  """The checkpoint's table variables, and its other objects' tensors as
  TensorFlow serializes them, tables' values unread (``rows_apart``)."""
  tables, rest = [], []
  with slicing.rows_apart():
    serialized = list(compat.serialized_tensors(checkpoint))
  for obj, by_key in serialized:
    variable = getattr(obj, "obj", obj)  # (a legacy saveable's converter)
    if hasattr(variable, _STORE_ATTRIBUTE):
      (key,) = by_key
      tables.append(_Table(key, variable))
    else:
      rest.append((obj, by_key))
  return tables, rest


def _anchors(checkpoint: Any, tables: Sequence[_Table]) -> list[Any]:
  """What the last save of these tables is recorded under."""
  return [t.store for t in tables] or [checkpoint]


def record_save(checkpoint: Any, file_prefix: str) -> None:
  """Records ``file_prefix`` (committed, full or delta) as the last save
  of ``checkpoint``'s tables and clears their changed rows."""
  tables, _ = _split(checkpoint)
  saved = (file_prefix, parts.save_id(file_prefix))
  for table in tables:
    table.store.clear_changes()
  for anchor in {
    id(a): a for a in [*_anchors(checkpoint, tables), checkpoint]
  }.values():
    _last_saves[anchor] = saved


def last_save(checkpoint: Any) -> tuple[str, str] | None:
  """``(prefix, save id)`` of the last save of ``checkpoint``'s tables
  written or restored here, or None."""
  tables, _ = _split(checkpoint)
  for anchor in [*_anchors(checkpoint, tables), checkpoint]:
    if anchor in _last_saves:
      return _last_saves[anchor]
  return None


def _value(value: Any) -> tf.Tensor:
  """A serialized value as a tensor (callables and save specs read)."""
  tensor = getattr(value, "tensor", value)
  if callable(tensor) and not isinstance(tensor, tf.Tensor):
    tensor = tensor()
  if isinstance(tensor, tf.Variable):
    tensor = tensor.read_value()
  return tf.convert_to_tensor(tensor)


def _rest_entries(
  rest: list[tuple[Any, dict[str, Any]]], chief: bool
) -> list[slicing.Entry]:
  """``(key, slice spec, tensor)`` of the other objects' values: slices
  (this worker's part of multi-worker state) on every worker, whole
  values on the chief (also those multi-worker state gives whole: an
  array without elements, which every worker would write). Every worker
  reads every value, in the same order: a value may be a collective (a
  sharded vocabulary's total evictions)."""
  entries = []
  for _, by_key in rest:
    for key, value in by_key.items():
      pieces = value.items() if isinstance(value, dict) else [("", value)]
      for spec, piece in pieces:
        tensor = _value(piece)
        if chief or spec:
          entries.append((key, spec, tensor))
  return entries


def write_delta(
  checkpoint: Any, file_prefix: str, previous: str | None = None
) -> str:
  """Writes the rows changed since the previous save to ``file_prefix``.

  Call it on every worker with the same ``file_prefix``, like
  ``checkpoints.write``.

  Args:
    checkpoint: a ``tf.train.Checkpoint`` holding the tables.
    file_prefix: the delta's prefix, on a filesystem all workers share.
    previous: the save the delta follows; None (default): the last save
      of these tables written or restored by ``tpu_embedding.checkpoints``
      in this process. The changed rows are those since that save.

  Returns:
    ``file_prefix``.

  Raises:
    ValueError: no previous save is known (write a full checkpoint first).
  """
  tables, rest = _split(checkpoint)
  if previous is None:
    last = last_save(checkpoint)
    if last is None:
      raise ValueError(
        f"Delta checkpoint '{file_prefix}': no previous save of these "
        "tables was written or restored by this process; write a full "
        "checkpoint first (tpu_embedding.checkpoints.write or "
        "CheckpointManager)."
      )
    previous, parent = last
  else:
    parent = parts.save_id(previous)
  spread = parts.worker_parts(checkpoint)  # every worker writes their rows
  writer = parts.PartWriter(file_prefix, spread)
  index, chief = writer.index, writer.chief
  writer.begin()
  entries = []
  rows = 0
  by_store: dict[int, tf.Tensor] = {}
  for table in tables:
    if not (chief or any(table.variable is v for v in spread)):
      continue
    store = table.store
    if id(store) not in by_store:
      by_store[id(store)] = store.changed_rows()
    ids = by_store[id(store)]
    values = store.read_rows(ids, table.store_key)
    rows = max(rows, int(ids.shape[0]))
    entries += [
      (f"_DELTA/{index:05d}/rows/{table.key}", "", ids),
      (f"_DELTA/{index:05d}/values/{table.key}", "", values),
    ]
  entries += _rest_entries(rest, chief)
  if chief:
    meta = {
      "format": FORMAT,
      "parent": parent,
      "parent_name": os.path.basename(previous),
      "tables": sorted(t.key for t in tables),
      "rows": rows,
    }
    entries.append(
      (META_KEY, "", tf.constant(json.dumps(meta, sort_keys=True)))
    )
  writer.write(f"{index:05d}", entries)
  writer.commit()
  record_save(checkpoint, file_prefix)
  return file_prefix


def read_meta(delta: str) -> dict[str, Any]:
  """The metadata of the delta ``delta`` (its parent, tables, rows).

  Raises:
    ValueError: ``delta`` is not a delta checkpoint.
  """
  try:
    reader = tf.train.load_checkpoint(delta)
  except (tf.errors.NotFoundError, tf.errors.DataLossError) as error:
    raise ValueError(
      f"Delta checkpoint '{delta}' cannot be read: no committed save there "
      f"({type(error).__name__})."
    ) from None
  if not reader.has_tensor(META_KEY):
    raise ValueError(
      f"'{delta}' is not a delta checkpoint (it has no {META_KEY}); pass a "
      "full checkpoint as the base and deltas written by write_delta."
    )
  meta: dict[str, Any] = json.loads(reader.get_tensor(META_KEY))
  return meta


def read_rows(delta: str, key: str) -> tuple[np.ndarray, np.ndarray] | None:
  """``(ids, values)`` of table key ``key`` in ``delta`` (every worker's
  rows), or None if the delta does not hold that key."""
  reader = tf.train.load_checkpoint(delta)
  names = reader.get_variable_to_shape_map()
  workers = sorted(
    name.split("/")[1]
    for name in names
    if name.startswith("_DELTA/") and name.endswith(f"/rows/{key}")
  )
  if not workers:
    return None
  ids = [reader.get_tensor(f"_DELTA/{w}/rows/{key}") for w in workers]
  values = [reader.get_tensor(f"_DELTA/{w}/values/{key}") for w in workers]
  return np.concatenate(ids), np.concatenate(values)


def check_chain(base: str, deltas: Sequence[str]) -> list[dict[str, Any]]:
  """Checks that each of ``deltas`` follows the save before it (``base``
  first); returns their metadata.

  Raises:
    DeltaMismatchError: one line naming the delta, the save it follows
      and the save it was given after.
  """
  previous, expected = base, parts.save_id(base)
  metas = []
  for delta in deltas:
    meta = read_meta(delta)
    if meta["parent"] != expected:
      raise DeltaMismatchError(
        f"Delta '{delta}' follows save '{meta['parent_name']}' (id "
        f"{meta['parent']}), not '{previous}' (id {expected}): apply the "
        "deltas of one run in order, starting from the full checkpoint "
        "they follow."
      )
    metas.append(meta)
    previous, expected = delta, parts.save_id(delta)
  return metas


#: The tensor a TensorFlow checkpoint keeps its object graph in.
_OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"


class SavedKeys:
  """What a saved checkpoint calls the values of another object graph.

  A checkpoint key is the path by which its saver first reached a value
  (``dense_optimizer/_trainable_variables/0/...`` for a model weight the
  optimizer tracks); a checkpoint holding less (a serving export's
  ``tf.train.Checkpoint(embedding=..., model=...)``) calls the same value
  by another path (``model/dense/kernel/...``). TensorFlow's restore
  matches them through the saved object graph; so does ``saved_key``:
  it follows a key's path from the saved graph's root, child by child,
  to the saved key of that attribute. Deltas hold values under their
  full checkpoint's keys and no object graph: translate with the full
  checkpoint's.

  Example:
    >>> import tempfile
    >>> import tensorflow as tf
    >>> weight = tf.Variable(1.0)
    >>> prefix = tf.train.Checkpoint(
    ...   a=tf.train.Checkpoint(w=weight), b=tf.train.Checkpoint(w=weight)
    ... ).write(tempfile.mkdtemp() + "/ckpt")
    >>> SavedKeys(prefix).saved_key("b/w/.ATTRIBUTES/VARIABLE_VALUE")
    'a/w/.ATTRIBUTES/VARIABLE_VALUE'
  """

  def __init__(self, file_prefix: str):
    reader = tf.train.load_checkpoint(file_prefix)
    self.file_prefix = file_prefix
    self._graph = compat.TrackableObjectGraph()
    if reader.has_tensor(_OBJECT_GRAPH):
      self._graph.ParseFromString(reader.get_tensor(_OBJECT_GRAPH))

  def saved_key(self, key: str) -> str | None:
    """The saved key of the value another graph keys ``key``, or None
    when the saved graph has no such path."""
    if not self._graph.nodes:
      return None
    path, _, attribute = key.partition("/.ATTRIBUTES/")
    node = self._graph.nodes[0]
    for name in path.split("/") if path else []:
      child = next(
        (c for c in node.children if parts.escaped(c.local_name) == name), None
      )
      if child is None:
        return None
      node = self._graph.nodes[child.node_id]
    for saved in node.attributes:
      if saved.name == attribute:
        return str(saved.checkpoint_key)
    return None


def apply_deltas(
  checkpoint: Any, base: str, deltas: Sequence[str], *, partial: bool = False
) -> None:
  """Writes ``deltas`` in order into ``checkpoint``, restored from ``base``.

  The tables must exist (build the embedding before). Every delta is
  checked before any is applied.

  Args:
    checkpoint: the ``tf.train.Checkpoint`` restored from ``base``.
    base: the full checkpoint the first delta follows.
    deltas: the deltas, in order.
    partial: ``checkpoint`` holds a part of the saved state (a serving
      export: tables without their optimizer slots, or a subset of the
      tables), as ``expect_partial`` for ``base``: the delta's other
      tables are not read. Every table ``checkpoint`` holds must still be
      in each delta.

  Raises:
    DeltaMismatchError: a delta does not follow the save before it.
    ValueError: a delta holds a table ``checkpoint`` does not have, or
      (``partial``) lacks one it has, or lacks a value its full
      checkpoint holds. Nothing is restored.
  """
  metas = check_chain(base, deltas)
  tables, rest = _split(checkpoint)
  # What the saves call this checkpoint's values (another path may have
  # reached them first when they were saved: SavedKeys).
  saved_keys = SavedKeys(base)

  def saved(key: str) -> str:
    return saved_keys.saved_key(key) or key

  keys = {saved(t.key) for t in tables}
  for delta, meta in zip(deltas, metas, strict=True):
    missing = sorted(set(meta["tables"]) - keys)
    if missing and not partial:
      raise ValueError(
        f"Delta '{delta}' holds rows of {missing[0]}, which the checkpoint "
        "it is applied to does not have (build the embedding before "
        "restoring deltas, with the tables it was trained with)."
      )
    absent = sorted(keys - set(meta["tables"]))
    if absent and partial:
      raise ValueError(
        f"Delta '{delta}' holds no rows of {absent[0]}, which the "
        "checkpoint it is applied to has: it is not a delta of the run "
        "that trained these tables."
      )
  in_base = set(tf.train.load_checkpoint(base).get_variable_to_shape_map())
  stored = {
    delta: set(tf.train.load_checkpoint(delta).get_variable_to_shape_map())
    for delta in deltas
  }
  for delta in deltas:  # the dense state the base has, in every delta
    for _, by_key in rest:
      lacking = sorted(
        key for key in map(saved, by_key) if key in in_base - stored[delta]
      )
      if lacking:
        raise ValueError(
          f"Delta '{delta}' holds no value of {lacking[0]}, which the full "
          "checkpoint it follows has: it is not a delta of the run that "
          "wrote that checkpoint."
        )
  for delta in deltas:
    for table in tables:
      rows = read_rows(delta, saved(table.key))
      if rows is not None and rows[0].size:
        table.store.write_rows_at(rows[0], rows[1], table.store_key)
    _restore_rest(rest, delta, saved, stored[delta])
  if deltas:
    record_save(checkpoint, deltas[-1])
  else:
    record_save(checkpoint, base)


def _restore_rest(
  rest: list[tuple[Any, dict[str, Any]]],
  delta: str,
  saved: Callable[[str], str],
  stored: set[str],
) -> None:
  """Restores the other objects' values (whole, or this worker's slices)
  from ``delta``, found under their saved keys (``saved``); values the
  delta does not hold (``stored``: its keys; an object the saving
  checkpoint did not have, e.g. its ``save_counter``) are kept."""
  for obj, by_key in rest:
    restored = {}
    for own_key, value in by_key.items():
      key = saved(own_key)
      if key not in stored:
        continue  # not saved (apply_deltas refused what the base has)
      spec, piece = (
        next(iter(value.items())) if isinstance(value, dict) else ("", value)
      )
      dtype = getattr(piece, "dtype", None) or _value(piece).dtype
      (tensor,) = saved_rows.read_tensors(delta, [key], [dtype], [spec])
      restored[own_key.rsplit("/.ATTRIBUTES/", 1)[-1]] = tensor
    if restored:
      # Multi-worker state takes this worker's slices, as serialized.
      with slicing.sliced():
        obj._restore_from_tensors(restored)  # noqa: SLF001
