"""A table held whole: one variable per table and slot, on one device.

The layout of the default strategy and ``OneDeviceStrategy``, of
``TPUEmbeddingForServing``, of a small table on one parameter server, and
of the Keras weights of ``ReplicatedEmbedding``.

Example:
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.resolved import resolve
  >>> from tpu_embedding.tables.whole import WholeTable
  >>> table = resolve(tpe.FeatureConfig(tpe.TableConfig(
  ...     3, 1, name="t", initializer=tf.zeros_initializer())),
  ...     tpe.SGD(1.0)).tables[0]
  >>> variable = tf.Variable(tf.zeros([3, 1]))
  >>> store = WholeTable.wrap(table, {"parameters": variable})
  >>> store.update(tf.constant([1], tf.int64),
  ...              PickedRows.dense(tf.constant([[2.0]])))
  >>> store.read().numpy().ravel().tolist()
  [0.0, -2.0, 0.0]
"""

from __future__ import annotations

import functools

import tensorflow as tf

from tpu_embedding import compat
from tpu_embedding.config import TableConfig
from tpu_embedding.gradients import PickedRows
from tpu_embedding.initializers import Initializer
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.lookup import RowRequest
from tpu_embedding.resolved import table_name
from tpu_embedding.tables.base import Block
from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.base import checkpoint_name
from tpu_embedding.tables.initial_values import RowWiseInitializer
from tpu_embedding.tables.update_guards import UNGUARDED
from tpu_embedding.tables.update_guards import UpdateGuard
from tpu_embedding.tracking import VariableTracker


def plain_variable_getter(
  name: str,
  shape: tuple[int, int],
  dtype: tf.DType,
  initializer: Initializer,
  trainable: bool,
  device: str | None = None,
) -> tf.Variable:
  """Creates one ``tf.Variable`` with ``initializer(shape, dtype=dtype)``;
  on ``device`` (if given) a plain variable, whatever the strategy."""
  initial_value = functools.partial(initializer, shape, dtype=dtype)
  if device is None:
    return tf.Variable(
      initial_value=initial_value,
      name=name,
      shape=shape,
      dtype=dtype,
      trainable=trainable,
    )
  with tf.device(device):
    return compat.ResourceVariable(
      initial_value, name=name, dtype=dtype, trainable=trainable
    )


class WholeTable(TableStore):
  """One ``[vocabulary_size, dim]`` variable per table and slot."""

  layout = "whole"

  def __init__(
    self, table: TableConfig, variables: Block, guard: UpdateGuard = UNGUARDED
  ):
    super().__init__(table, variables, [variables], guard)

  @classmethod
  def wrap(cls, table: TableConfig, variables: Block) -> WholeTable:
    """A store over existing variables (e.g. Keras weights), which their
    owner may update directly: a delta checkpoint holds all their rows."""
    store = cls(table, variables)
    store.tracks_changes = False
    return store

  @classmethod
  def create(
    cls,
    table: TableConfig,
    tracker: VariableTracker,
    device: str | None = None,
    guard: UpdateGuard = UNGUARDED,
  ) -> WholeTable:
    """Creates and tracks the table's variables (on ``device``, if given;
    its updates run as ``guard`` says).

    Variables are created through ``tracker``, so a checkpoint restored
    before they exist fills them (restore-before-build), and an
    optimizer's ``slot_variable_creation_fn`` creates its slots.
    """
    shape = (table.vocabulary_size, table.dim)

    getter = functools.partial(plain_variable_getter, device=device)

    initial = RowWiseInitializer(table.initializer, shape, table_name(table))
    parameters = tracker.create(
      table_name(table),
      shape,
      initial,
      getter,
      True,
      table.storage.stored_dtype(0),
    )
    initial.fill_in_place(parameters)
    variables = {"parameters": parameters}
    optimizer = table.optimizer
    if optimizer is not None:

      def slot_creator(slot: str, initializer: Initializer) -> tf.Variable:
        name = checkpoint_name(table_name(table), slot)
        initial = RowWiseInitializer(initializer, shape, name)
        variable = tracker.create(
          name, shape, initial, getter, False, table.storage.stored_dtype(1)
        )
        initial.fill_in_place(variable)
        return variable

      slots = optimizer.create_slots(parameters, slot_creator)
      if optimizer.slot_variable_creation_fn is not None:
        # Created by the user's function: still checkpointed under our keys.
        for slot, variable in slots.items():
          tracker.register(checkpoint_name(table_name(table), slot), variable)
      variables.update(slots)
    return cls(table, variables, guard)

  def block_rows(self, block: int) -> tuple[int, int]:
    return 0, self.table.vocabulary_size

  def gather(
    self,
    ids: tf.Tensor,
    key: str = "parameters",
    ops: StepOps = TENSORFLOW_OPS,
  ) -> tf.Tensor:
    return ops.gather_rows(self._variables[key], ids)

  def gather_occurrences(
    self, request: RowRequest, ops: StepOps = TENSORFLOW_OPS
  ) -> PickedRows:
    return self.gather_block_occurrences(0, request, ops)
