"""Every private TensorFlow name the package relies on, and what for.

TensorFlow's public API lacks a few things an embedding library needs
(row-sharded variables, per-device variables inside a strategy scope,
checkpoint-saver registration, nest paths). They are imported here, and
only here, each with the reason, so that a TensorFlow upgrade that moves
one breaks one module and the fix is in one place. Keras' private modules
are imported lazily (by functions below), because the mid-level API does
not need Keras.

Example:
  >>> from tpu_embedding import compat
  >>> compat.flatten_with_joined_string_paths({"b": 1, "a": [2]})
  [('a/0', 2), ('b', 1)]
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

# A checkpoint index's entries: where each saved tensor's bytes are, so
# that a restore reads some rows of a saved tensor alone
# (``checkpointing/index.py``).
from tensorflow.core.protobuf.tensor_bundle_pb2 import BundleEntryProto
from tensorflow.core.protobuf.tensor_bundle_pb2 import BundleHeaderProto

# A checkpoint's saved object graph: which path reached each value, so
# that another graph's keys find theirs (``checkpointing.deltas.SavedKeys``).
from tensorflow.core.protobuf.trackable_object_graph_pb2 import (
  TrackableObjectGraph,
)

# TensorFlow's own checkpoint keys of a checkpoint's objects, without
# reading a value (``checkpoints.py``: the keys multi-worker tables' parts
# are written under).
from tensorflow.python.checkpoint import graph_view as _graph_view
from tensorflow.python.checkpoint import save_util as _save_util

# The cluster position of a worker (MultiWorkerMirroredStrategy): which
# global replicas are this process's.
from tensorflow.python.distribute.multi_worker_util import id_in_cluster

# Row blocks of one logical table, saved as one full-size checkpoint value
# (slices) and read in id order by ``tf.nn.embedding_lookup``: the layout of
# TensorFlow's own sharded embedding variables.
from tensorflow.python.distribute.sharded_variable import ShardedVariable

# This process's address among the cluster's devices
# (``/job:<job>/replica:<r>/task:<t>``; ``/job:localhost/...`` alone): which
# variables live in this process's memory (``kernels/ops.py``).
from tensorflow.python.eager.context import context as _eager_context

# Whether a graph is traced for XLA (``tf.function(jit_compile=True)``,
# Keras ``jit_compile``): the step's ops must then be ones XLA compiles.
from tensorflow.python.ops.control_flow_util import GraphOrParentsInXlaContext

# A plain variable on one device even inside a strategy scope (the scope's
# variable creator would mirror it), and one whose first dimension may
# change at each assign (pipelining's held updates). Their base class:
# the plain resource variables our kernels read by handle (not distributed
# or Keras 3 variables).
from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable
from tensorflow.python.ops.resource_variable_ops import ResourceVariable

# A variable with a shape and no value (nothing allocated): a disk-tiered
# table's serving copy, traced into a SavedModel whose saver records its
# key and writes no value (``export/streamed.py`` writes it by parts).
from tensorflow.python.ops.resource_variable_ops import UninitializedVariable

# Tells the gradient tapes that a variable was read (as its own
# ``sparse_read`` does), so ops reading it by handle are differentiable.
from tensorflow.python.ops.resource_variable_ops import variable_accessed

# A SavedModel's ``fingerprint.pb`` (digests of its graph and variables),
# written again when a new version's variables are rewritten from a delta
# (``export/from_delta.py``) so that it names the new variables.
from tensorflow.python.saved_model.fingerprinting_utils import (
  write_fingerprint as write_saved_model_fingerprint,
)

# Registers the checkpoint callback that copies tables off / onto the TPU
# around saves and restores, as TensorFlow does for its own TPUEmbedding.
from tensorflow.python.saved_model.registration import register_checkpoint_saver

# Whether a function is being traced for a SavedModel (custom kernels must
# stay out of it: TF Serving loads TensorFlow's ops only).
from tensorflow.python.saved_model.save_context import in_save_context

# TensorFlow's SparseCore stacking (``TPUEmbeddingV2``'s, its C++
# ``SparseCoreLayoutStacker`` runs on CPU) and its copy of a feature config:
# FDO off TPU stacks tables exactly as the TPU will (``fdo/layout.py``).
from tensorflow.python.tpu.tpu_embedding_v3 import (
  _clone_feature_config as clone_tf_feature_config,
)
from tensorflow.python.tpu.tpu_embedding_v3 import (
  _stack_tables_with_same_table_dim_and_optimizer as stack_sparse_core_tables,
)

# A lazily read checkpoint value (multi-worker slices: read only on save).
from tensorflow.python.training.saving.saveable_object import SaveSpec

# Feature paths (``"a/0"``) in error messages, in ``tf.nest.flatten`` order.
from tensorflow.python.util.nest import flatten_with_joined_string_paths

#: ``tf.__internal__.tracking.Trackable``: the checkpoint base class (public
#: under ``tf.__internal__``, which TensorFlow reserves for its own libraries).
Trackable = tf.__internal__.tracking.Trackable

__all__ = [
  "BaseResourceVariable",
  "BundleEntryProto",
  "BundleHeaderProto",
  "ResourceVariable",
  "SaveSpec",
  "ShardedVariable",
  "Trackable",
  "TrackableObjectGraph",
  "UninitializedVariable",
  "checkpoint_keys",
  "clone_tf_feature_config",
  "flatten_with_joined_string_paths",
  "host_address_space",
  "id_in_cluster",
  "in_save_context",
  "keras_in_symbolic_scope",
  "keras_inner_variable",
  "keras_learning_rate",
  "keras_tensorflow_trainer",
  "parameter_server_resolver",
  "register_checkpoint_saver",
  "restore_source",
  "restore_uid",
  "serialized_tensors",
  "set_update_uid",
  "stack_sparse_core_tables",
  "tf_tpu_variables",
  "update_uid",
  "variable_accessed",
  "write_saved_model_fingerprint",
]


def checkpoint_keys(checkpoint: tf.train.Checkpoint) -> dict[int, list[str]]:
  """``{id(object): [its checkpoint keys]}`` of a checkpoint's objects
  (a Keras 3 variable's inner ``tf.Variable`` too: ``keras_inner_variable``).

  TensorFlow's own serialization of the object graph names them
  (``save_util.serialize_graph_view``); nothing is read or written. An
  object saved through legacy ``SaveableObject``s (a ``ShardedVariable``)
  is serialized as a converter holding it (``.obj``).
  """
  serialized = _save_util.serialize_graph_view(
    _graph_view.ObjectGraphView(checkpoint)
  )[0]
  keys = {}
  for obj, by_key in serialized.items():
    obj = getattr(obj, "obj", obj)
    keys[id(obj)] = list(by_key)
    inner = keras_inner_variable(obj)
    if inner is not None:  # what functions traced on the model capture
      keys.setdefault(id(inner), list(by_key))
  return keys


def keras_inner_variable(obj: object) -> tf.Variable | None:
  """The ``tf.Variable`` a Keras 3 variable holds its value in, or None.

  Keras 3's ``keras.Variable`` (TensorFlow backend) is the object a
  checkpoint names, but functions traced on the model (a SavedModel's
  signatures) capture the ``tf.Variable`` inside it (``_value``).
  tf-keras and ``tf.Module`` variables are ``tf.Variable``s themselves.
  """
  if not type(obj).__module__.startswith("keras."):
    return None
  inner = getattr(obj, "_value", None)  # Keras 3's private attribute
  return inner if isinstance(inner, tf.Variable) else None


def serialized_tensors(checkpoint: Any) -> list[tuple[Any, dict[str, Any]]]:
  """``(object, {checkpoint key: value})`` of a checkpoint's objects, as
  TensorFlow's serialization gives them (values may be callables or save
  specs, read only when asked; a slice spec maps to each slice's value)."""
  serialized = _save_util.serialize_graph_view(
    _graph_view.ObjectGraphView(checkpoint)
  )[0]
  return list(serialized.items())


# A trackable's ``_update_uid``: TensorFlow's restore assigns a checkpointed
# value to it only when the restore is newer than this; ``checkpoints.py``
# raises it to keep TensorFlow off the values it reads itself, then sets it
# to the restore's uid (``restore_uid``) so the status counts them matched.
def update_uid(trackable: tf.__internal__.tracking.Trackable) -> int:
  """The restore uid ``trackable`` was last updated by."""
  return int(trackable._update_uid)  # noqa: SLF001


def set_update_uid(
  trackable: tf.__internal__.tracking.Trackable, uid: int
) -> None:
  """Marks ``trackable`` as updated by restore ``uid``."""
  trackable._update_uid = uid  # noqa: SLF001


def restore_uid(status: object) -> int | None:
  """The uid of the restore behind a ``Checkpoint.restore`` status, or None."""
  return getattr(getattr(status, "_checkpoint", None), "restore_uid", None)


def restore_source(restore: Any) -> tuple[str, str]:
  """``(save_path, checkpoint key)`` of a pending restore-on-create value.

  ``restore`` is TensorFlow's restore-on-create callable (what
  ``VariableTracker.pending_restore`` returns); a row-sharded table reads
  its blocks' rows of that key itself (``checkpointing/rows.py``) instead
  of calling it (which reads every stored piece its rows overlap whole).
  """
  position = restore.checkpoint_position
  (key,) = [
    attribute.checkpoint_key
    for attribute in position.object_proto.attributes
    if attribute.name == "VARIABLE_VALUE"
  ]
  return position.checkpoint.save_path_string, key


def restore_shape(restore: Any) -> tf.TensorShape | None:
  """The saved shape of a pending restore-on-create value (``restore``, as
  for ``restore_source``); None where the checkpoint does not say."""
  return restore.checkpoint_position.value_shape()


def restore_dtype(restore: Any) -> tf.DType | None:
  """The saved dtype of a pending restore-on-create value; None where the
  checkpoint does not say."""
  position = restore.checkpoint_position
  for attribute in position.object_proto.attributes:
    if attribute.name == "VARIABLE_VALUE":
      dtype = position._checkpoint.dtype_map.get(attribute.checkpoint_key)  # noqa: SLF001
      return None if dtype is None else tf.as_dtype(dtype)
  return None


def in_xla_context() -> bool:
  """Whether the function being traced will be compiled by XLA."""
  return bool(GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def host_address_space() -> str:
  """This process's device prefix, e.g. ``/job:localhost/replica:0/task:0``."""
  return str(_eager_context().host_address_space())


def parameter_server_resolver(strategy: tf.distribute.Strategy) -> Any:
  """The cluster resolver of a ``ParameterServerStrategy``.

  ``ParameterServerStrategy.cluster_resolver`` is None in TensorFlow 2.21
  (it keeps the resolver in a private attribute).
  """
  resolver = strategy.cluster_resolver
  if resolver is None:
    resolver = strategy._cluster_resolver  # noqa: SLF001
  return resolver


def tf_tpu_variables(tf_embedding: Any) -> dict[str, dict[str, Any]]:
  """``{table: {"parameters": var, <slot>: var}}`` of TensorFlow's object.

  TensorFlow's ``TPUEmbedding``/``TPUEmbeddingV2`` keep their table and
  slot variables in ``_variables`` (public only as ``embedding_tables``,
  without the slots).
  """
  return dict(getattr(tf_embedding, "_variables", None) or {})


def keras_tensorflow_trainer() -> Any:
  """Keras 3's ``keras.src.backend.tensorflow.trainer`` module, or None.

  ``layers/distributed_fit.py`` wraps its ``TensorFlowTrainer`` build step
  (keras-team/keras#20585); Keras exports neither.
  """
  try:
    from keras.src.backend.tensorflow import trainer
  except ImportError:
    return None
  return trainer


def keras_in_symbolic_scope() -> bool:
  """Whether Keras 3 is tracing a layer only for its output shapes.

  Keras exports the scope class (``keras.SymbolicScope``) but not the
  query, ``keras.src.backend.common.symbolic_scope.in_symbolic_scope``.
  """
  from keras.src.backend.common import symbolic_scope

  return symbolic_scope.in_symbolic_scope()


def keras_learning_rate(optimizer: Any) -> Any:
  """The learning rate a Keras optimizer was given, as an object.

  A float (or its variable), a ``LearningRateSchedule`` or a zero-argument
  callable. ``layers/keras_optimizers.py`` evaluates a schedule at each
  step, as Keras does; Keras exposes only the current value
  (``learning_rate``) and a serialized copy (``get_config``). Keras 3 and
  tf-keras keep it in ``_learning_rate``, tf-keras' legacy optimizers in
  ``_hyper["learning_rate"]``.
  """
  hyper = getattr(optimizer, "_hyper", None)
  if isinstance(hyper, dict):
    return hyper.get("learning_rate")
  return optimizer._learning_rate  # noqa: SLF001


def retrieve_tpu_tables(tf_embedding: Any) -> None:
  """Copies TensorFlow's TPU tables to their host variables (before save)."""
  tf_embedding._retrieve_variables()  # noqa: SLF001


def load_tpu_tables(tf_embedding: Any) -> None:
  """Copies host variables onto the TPU (after restore)."""
  tf_embedding._load_variables()  # noqa: SLF001
