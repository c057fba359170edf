"""Files of a checkpoint written by several processes: parts, merge, commit.

The pieces ``tpu_embedding.checkpoints`` (full saves) and
``tpu_embedding.checkpoint_deltas`` (delta saves) share: which state every
worker writes its own part of, a barrier over the workers, and the atomic
directory handling. Parts are written under ``<prefix>_temp/`` and merged
there; the merged data files move to ``<prefix>`` and its index last, so a
``<prefix>.index`` is only ever a whole save (the rename of the index is
the commit); whatever a killed save left is removed by the next save in
that directory before it writes anything. A save is named by ``save_id``:
a digest of its committed index, the same on every worker.

Example:
  >>> import tempfile
  >>> import tensorflow as tf
  >>> prefix = tempfile.mkdtemp() + "/ckpt"
  >>> _ = tf.train.Checkpoint(v=tf.Variable(1.0)).write(prefix)
  >>> len(save_id(prefix))
  16
"""

from __future__ import annotations

import hashlib
import os
import re
import weakref
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.tables import slicing


def worker_parts(checkpoint: Any) -> list[slicing.WorkerParts]:
  """What every worker writes its part of: multi-worker tables, and
  state sharded like them (a dynamic table's vocabulary)."""
  return [
    obj
    for obj in tf.train.TrackableView(checkpoint).descendants()
    if isinstance(obj, slicing.WorkerParts) and obj.worker_count > 1
  ]


#: One compiled barrier per strategy.
_barriers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Workers:
  """This worker's place in the cluster, and a barrier over all workers."""

  def __init__(self, variable: slicing.WorkerParts):
    self.strategy = variable.strategy
    self.index, self.count = variable.worker_index, variable.worker_count
    self.chief = self.index == 0

  def barrier(self) -> None:
    if self.strategy not in _barriers:
      strategy = self.strategy
      _barriers[strategy] = tf.function(
        lambda: strategy.reduce(
          tf.distribute.ReduceOp.SUM,
          strategy.run(lambda: tf.constant(1.0)),
          axis=None,
        )
      )
    _barriers[self.strategy]()


def key_id(key: str) -> str:
  """A file-name-safe, stable id of a checkpoint key."""
  return hashlib.sha1(key.encode()).hexdigest()[:12]


def checkpoint_keys(
  checkpoint: Any, variables: Sequence[Any]
) -> list[list[str]]:
  """The checkpoint keys of each of ``variables`` in ``checkpoint``."""
  # TensorFlow's own serialization names them (no value is read: the
  # variables are written apart).
  with slicing.written_apart():
    keys = compat.checkpoint_keys(checkpoint)
  return [keys[id(v)] for v in variables]


def remove(path: str) -> None:
  """Removes the file or directory ``path``, if there is one."""
  if tf.io.gfile.isdir(path):
    tf.io.gfile.rmtree(path)
  elif tf.io.gfile.exists(path):
    tf.io.gfile.remove(path)


#: A checkpoint's data file: ``<prefix>.data-00000-of-00001``.
_DATA_FILE = re.compile(r"(.*)\.data-\d{5}-of-\d{5}")


def remove_stale_temps(file_prefix: str) -> None:
  """Removes what a save killed next to ``file_prefix`` left behind:
  ``*_temp`` directories, and data files without their index (a merge cut
  off before its commit)."""
  directory = os.path.dirname(file_prefix) or "."
  tf.io.gfile.makedirs(directory)
  names = {name.rstrip("/") for name in tf.io.gfile.listdir(directory)}
  for name in sorted(names):
    data = _DATA_FILE.fullmatch(name)
    if name.endswith("_temp") or (
      data is not None and f"{data.group(1)}.index" not in names
    ):
      remove(os.path.join(directory, name))


def commit(merged: str, file_prefix: str) -> None:
  """Moves the checkpoint ``merged`` to ``file_prefix``, its index last.

  A checkpoint already at ``file_prefix`` loses its index first and then
  its data files, so that no index ever names data files of another save.
  """
  for path in [
    f"{file_prefix}.index",
    *tf.io.gfile.glob(f"{file_prefix}.data-?????-of-?????"),
  ]:
    remove(path)
  for path in tf.io.gfile.glob(f"{merged}.data-?????-of-?????"):
    suffix = path[len(merged) :]
    tf.io.gfile.rename(path, file_prefix + suffix, overwrite=True)
  tf.io.gfile.rename(f"{merged}.index", f"{file_prefix}.index", overwrite=True)


def merge_and_commit(temp: str, file_prefix: str) -> None:
  """Merges the workers' ``part-*`` checkpoints in ``temp`` into one,
  moves it to ``file_prefix`` (``commit``) and removes ``temp``."""
  parts = sorted(
    name[: -len(".index")] for name in tf.io.gfile.glob(f"{temp}/part-*.index")
  )
  merged = f"{temp}/merged"
  with tf.device("CPU"):
    tf.raw_ops.MergeV2Checkpoints(
      checkpoint_prefixes=parts,
      destination_prefix=merged,
      delete_old_dirs=False,
    )
  commit(merged, file_prefix)
  remove(temp)


def save_id(file_prefix: str) -> str:
  """A digest of the committed save ``file_prefix`` (of its index, which
  holds every tensor's checksum): what a delta names its parent by.

  Raises:
    tf.errors.NotFoundError: there is no ``<file_prefix>.index``.
  """
  with tf.io.gfile.GFile(f"{file_prefix}.index", "rb") as index:
    return hashlib.sha256(index.read()).hexdigest()[:16]


#: The tensor a TensorFlow checkpoint keeps its object graph in.
_OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"


def _escaped(name: str) -> str:
  """A local name as a checkpoint key writes it (TensorFlow's escaping)."""
  return name.replace(".", "..").replace("/", ".S")


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
        (c for c in node.children if _escaped(c.local_name) == name), None
      )
      if child is None:
        return None
      node = self._graph.nodes[child.node_id]
    for saved in node.attributes:
      if saved.name == attribute:
        return str(saved.checkpoint_key)
    return None
