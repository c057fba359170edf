"""A training step never reads or writes a whole table: proven on the graph.

Untouched rows staying equal cannot tell a sparse update from a dense
read-modify-write of the whole table. Here the traced step itself is
inspected: every op that receives the handle of a table or slot variable
must be a row-level op (``ResourceGather``, ``ResourceScatter*``,
``ResourceSparseApply*``, this package's ``TpeGatherRows`` and
``TpeFusedSparseApply``). ``ReadVariableOp``/``AssignVariableOp`` or a
dense ``ResourceApply*`` on a table would read or write all its rows.
``Adam(lazy_adam=False)`` updates every row by definition: it is the
positive control showing the inspection sees whole-table access.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import mirrored_strategy

#: Ops that touch only the rows they are given.
#: Ops that read or write rows by id (Tpe*: this package's kernels,
#: tpu_embedding/kernels/gather_rows.cc and fused_update.cc).
ROW_OPS = (
  "ResourceGather",
  "ResourceScatter",
  "ResourceSparseApply",
  "TpeGatherRows",
  "TpeFusedSparseApply",
)
READ_OPS = ("ResourceGather", "TpeGatherRows")
WRITE_OPS = ("ResourceScatter", "TpeFusedSparseApply")

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


def _embedding(strategy, optimizer, pipelined):
  big = tpe.TableConfig(60, 4, name="big")
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


def _traced_step(strategy, emb):
  """The graph of one enqueue/dequeue/apply_gradients step."""

  def replica_step(item, history, country):
    emb.enqueue({"item": item, "history": history, "country": country})
    activations = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(tf.ones_like, activations))

  @tf.function
  def step(item, history, country):
    strategy.run(replica_step, (item, history, country))

  return step.get_concrete_function(
    tf.TensorSpec([None], tf.int64),
    tf.RaggedTensorSpec([None, None], tf.int64),
    tf.SparseTensorSpec([None, None], tf.int64),
  ).graph


def _table_accesses(graph, emb) -> dict[str, set[str]]:
  """``{op type: {store/slot}}`` of every op given a table variable (the
  backend's stores: stacked tables share one)."""
  handles = {}
  for name, store in emb.backend.stores.items():
    for block in store.blocks:
      for key, variable in block.items():
        handles[id(variable.handle)] = f"{name}/{key}"
  inside = {
    internal.name: handles[id(external)]
    for external, internal in graph.captures
    if id(external) in handles
  }
  assert inside, "no table variable is captured by the step"
  accesses: dict[str, set[str]] = {}
  for op in graph.get_operations():
    for tensor in op.inputs:
      if tensor.name in inside:
        accesses.setdefault(op.type, set()).add(inside[tensor.name])
  return accesses


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
  accesses = _table_accesses(_traced_step(strategy, emb), emb)
  whole = {
    op: tables for op, tables in accesses.items() if not op.startswith(ROW_OPS)
  }
  assert not whole, f"whole-table access in the step: {whole}"
  # Every table and slot is both gathered and written, row by row.
  touched = set().union(*accesses.values())
  expected = {
    f"{name}/{key}"
    for name, store in emb.backend.stores.items()
    for key in store.keys
  }
  assert touched == expected
  assert any(op.startswith(READ_OPS) for op in accesses)
  assert any(op.startswith(WRITE_OPS) for op in accesses)


@pytest.mark.parametrize("strategy_name", sorted(_strategies()))
def test_non_lazy_adam_is_seen_reading_whole_tables(strategy_name):
  # The positive control: this optimizer updates every row by definition.
  strategy = _strategies()[strategy_name]()
  emb = _embedding(strategy, tpe.Adam(0.1, lazy_adam=False), False)
  accesses = _table_accesses(_traced_step(strategy, emb), emb)
  assert "ReadVariableOp" in accesses
  assert "AssignVariableOp" in accesses
