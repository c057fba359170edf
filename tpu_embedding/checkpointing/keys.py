"""What checkpoints call values: their keys, here and in a saved graph.

``checkpoint_keys`` asks TensorFlow's own serialization for an object's
keys (without reading values); ``SavedKeys`` finds the key a saved
checkpoint holds another graph's value under; ``key_id`` names a key in
file names (a part's).

Example:
  >>> key_id("embedding/table/.ATTRIBUTES/VARIABLE_VALUE")
  'ee2d1f5a70bc'
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.checkpointing import slicing


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
