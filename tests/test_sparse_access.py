"""A training step never reads or writes a whole table: proven on the graph.

Untouched rows staying equal cannot tell a sparse update from a dense
read-modify-write of the whole table. Here the traced step itself is
inspected (tests/sparse_access.py): every op that receives the handle of
a table, slot or vocabulary-state variable, in the step and every function
it calls, must be a row-level op (``ResourceGather``,
``ResourceScatter*``, ``ResourceSparseApply*``, this package's
``TpeGatherRows``, ``TpeFusedSparseApply`` and ``TpeVocabularyStep``).
``ReadVariableOp``/``AssignVariableOp`` or a dense ``ResourceApply*`` on a
table would read or write all its rows. ``Adam(lazy_adam=False)`` updates
every row by definition: it is the positive control showing the
inspection sees whole-table access.

Here: one device and 2-replica Mirrored, plain and pipelined steps (and
``flush_pipeline``), skipped steps, dynamic tables. Elsewhere, on the same
helper: Keras ``fit`` (tests/layers/test_mirrored.py, and on 2 workers
tests/layers/test_multi_worker_fit.py), MultiWorkerMirrored
(tests/backends/test_multi_worker.py) and parameter servers
(tests/backends/test_parameter_server.py); inside the kernels:
tests/kernels/test_kernel_row_guard.py.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests import sparse_access
from tests.conftest import mirrored_strategy

OPTIMIZERS = {
  "sgd": lambda: tpe.SGD(0.1),
  "adagrad": lambda: tpe.Adagrad(0.1),
  "adagrad_momentum": lambda: tpe.AdagradMomentum(0.1, momentum=0.9),
  "lazy_adam": lambda: tpe.Adam(0.1),
  "ftrl": lambda: tpe.FTRL(0.1),
  "adagrad_clipped_decayed": lambda: tpe.Adagrad(
    0.1, clipvalue=1.0, clip_weight_max=0.5, weight_decay_factor=0.01
  ),
}


def _embedding(strategy, optimizer, pipelined, vocabulary=None):
  big = tpe.TableConfig(60, 4, name="big", vocabulary=vocabulary)
  small = tpe.TableConfig(8, 4, name="small", combiner="sum")
  with strategy.scope():
    emb = tpe.TPUEmbedding(
      {
        "item": tpe.FeatureConfig(big),
        "history": tpe.FeatureConfig(big),
        "country": tpe.FeatureConfig(small),
      },
      optimizer,
      pipeline_execution_with_tensor_core=pipelined,
      row_sharding_threshold=20,
    )
  emb.build()
  return emb


def _traced_step(strategy, emb, skip=False):
  """The concrete function of one enqueue/dequeue/apply_gradients step
  (with ``skip``: ``apply_gradients(skip=)`` given a traced flag)."""

  def replica_step(item, history, country, flag):
    emb.enqueue({"item": item, "history": history, "country": country})
    activations = emb.dequeue()
    gradients = tf.nest.map_structure(tf.ones_like, activations)
    emb.apply_gradients(gradients, skip=flag if skip else None)

  @tf.function
  def step(item, history, country, flag):
    strategy.run(replica_step, (item, history, country, flag))

  return step.get_concrete_function(
    tf.TensorSpec([None], tf.int64),
    tf.RaggedTensorSpec([None, None], tf.int64),
    tf.SparseTensorSpec([None, None], tf.int64),
    tf.TensorSpec([], tf.bool),
  )


def _strategies():
  return {
    "one_device": lambda: tf.distribute.get_strategy(),
    "mirrored_2": lambda: mirrored_strategy(2),
  }


@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
@pytest.mark.parametrize("strategy_name", sorted(_strategies()))
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_step_touches_only_looked_up_rows(
  optimizer_name, strategy_name, pipelined
):
  strategy = _strategies()[strategy_name]()
  emb = _embedding(strategy, OPTIMIZERS[optimizer_name](), pipelined)
  # Every table and slot is both gathered and written, row by row.
  sparse_access.check_row_only([_traced_step(strategy, emb)], emb)


@pytest.mark.parametrize("strategy_name", sorted(_strategies()))
def test_skipped_steps_and_flushes_touch_only_looked_up_rows(strategy_name):
  """``apply_gradients(skip=)`` (an update without rows when the flag is
  set) and ``flush_pipeline`` (the held update, applied at once)."""
  strategy = _strategies()[strategy_name]()
  plain = _embedding(strategy, tpe.Adagrad(0.1), False)
  sparse_access.check_row_only([_traced_step(strategy, plain, True)], plain)
  pipelined = _embedding(strategy, tpe.Adagrad(0.1), True)
  flush = tf.function(lambda: strategy.run(pipelined.flush_pipeline))
  accesses = sparse_access.check_row_only(
    [flush.get_concrete_function()], pipelined, expect_every_table=False
  )
  assert any(op.startswith(sparse_access.WRITE_OPS) for op in accesses)


@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
@pytest.mark.parametrize("strategy_name", sorted(_strategies()))
def test_dynamic_table_steps_touch_only_looked_up_rows(
  strategy_name, pipelined
):
  """A table with a ``DynamicVocabulary`` (row-sharded on 2 replicas, its
  state sharded alike): its rows, slots and vocabulary arrays (keys, last
  step, counts, probation) are read and written by row. The state's two
  scalars (``step``, ``evictions``: one int64 each) are read and assigned
  whole by design."""
  strategy = _strategies()[strategy_name]()
  vocabulary = tpe.DynamicVocabulary(bucket_size=4, min_count=2)
  emb = _embedding(strategy, tpe.Adagrad(0.1), pipelined, vocabulary)
  function = _traced_step(strategy, emb)
  accesses = sparse_access.step_accesses(
    [function], sparse_access.tracked_variables(emb)
  )
  sparse_access.check_row_only([function], emb)
  state = sparse_access.touched(accesses, sparse_access.ROW_OPS)
  arrays = {"keys", "last_step", "counts", "probation_keys"}
  assert {f"big/vocabulary/{a}" for a in arrays} <= state, state
  scalars = {
    v.label for variables in accesses.values() for v in variables if v.scalar
  }
  assert scalars == {"big/vocabulary/step", "big/vocabulary/evictions"}


@pytest.mark.parametrize("strategy_name", sorted(_strategies()))
def test_non_lazy_adam_is_seen_reading_whole_tables(strategy_name):
  # The positive control: this optimizer updates every row by definition.
  strategy = _strategies()[strategy_name]()
  emb = _embedding(strategy, tpe.Adam(0.1, lazy_adam=False), False)
  accesses = sparse_access.step_accesses(
    [_traced_step(strategy, emb)], sparse_access.tracked_variables(emb)
  )
  whole = sparse_access.whole_accesses(accesses)
  assert "ReadVariableOp" in whole
  assert "AssignVariableOp" in whole


def test_handles_are_followed_into_nested_functions_and_branches():
  """A whole read hidden in a nested ``tf.function``, a ``tf.cond``
  branch or a ``while`` body (behind an ``Identity``) is still seen."""
  table = tf.Variable(tf.zeros([6, 2]))
  tracked = {id(table.handle): sparse_access.Tracked("t/parameters", False)}

  @tf.function
  def nested(ids):
    return tf.gather(table, ids) + tf.reduce_sum(table)

  @tf.function
  def step(ids, flag):
    rows = nested(ids)
    branch = tf.cond(flag, lambda: table.read_value(), lambda: rows)

    def body(i, total):
      return i + 1, total + tf.reduce_sum(tf.identity(table.value()))

    loop = tf.while_loop(lambda i, _: i < 2, body, (0, 0.0))
    return branch, loop

  function = step.get_concrete_function(
    tf.TensorSpec([None], tf.int64), tf.TensorSpec([], tf.bool)
  )
  accesses = sparse_access.step_accesses([function], tracked)
  assert sparse_access.whole_accesses(accesses) == {
    "ReadVariableOp": ["t/parameters"]
  }
  assert sparse_access.touched(accesses, ("ResourceGather",))
  # Each of the three reads alone is seen too.
  for hidden in ("nested", "cond", "while"):

    @tf.function
    def alone(ids, flag, hidden=hidden):
      if hidden == "nested":
        return nested(ids)
      if hidden == "cond":
        return tf.cond(flag, table.read_value, lambda: tf.zeros([6, 2]))
      return tf.while_loop(
        lambda i, _: i < 2,
        lambda i, t: (i + 1, t + tf.reduce_sum(table.value())),
        (0, 0.0),
      )

    function = alone.get_concrete_function(
      tf.TensorSpec([None], tf.int64), tf.TensorSpec([], tf.bool)
    )
    whole = sparse_access.whole_accesses(
      sparse_access.step_accesses([function], tracked)
    )
    assert whole == {"ReadVariableOp": ["t/parameters"]}, (hidden, whole)
