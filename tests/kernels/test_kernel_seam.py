"""The kernel seam: which ops serve a step, decided from the tables' devices.

``kernels/ops.select_ops`` is the one place that decides (``XLA_OPS`` for
XLA, TensorFlow's ops in a SavedModel, else by devices): this package's
CPU kernels only for tables whose every variable lives in this process's
CPU memory; TensorFlow's ops for a table on a GPU, on a parameter server
or on another worker (or nowhere yet). The engine asks it and passes
its ops down, so a table elsewhere never reaches a kernel, the fused
update included. No GPU here: devices are given as strings, and an
engine's tables are made to report another device.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.conftest import op_types
from tpu_embedding import compat
from tpu_embedding import kernels
from tpu_embedding.kernels import ops as ops_module
from tpu_embedding.kernels.ops import TENSORFLOW_OPS
from tpu_embedding.kernels.ops import XLA_OPS
from tpu_embedding.kernels.ops import KernelOps
from tpu_embedding.kernels.ops import in_this_process_cpu
from tpu_embedding.kernels.ops import select_ops
from tpu_embedding.tables.base import TableStore

needs_kernels = pytest.mark.skipif(
  kernels.load() is None, reason="the kernel library did not build"
)

#: This process, as a worker of a cluster.
HOST = "/job:worker/replica:0/task:0"

HERE = {
  "localhost cpu": "/job:localhost/replica:0/task:0/device:CPU:0",
  "this task's cpu": "/job:worker/replica:0/task:0/device:CPU:0",
  "this task's logical cpu": "/job:worker/replica:0/task:0/device:CPU:3",
  "a cpu, job unnamed": "/device:CPU:1",
}

ELSEWHERE = {
  "gpu": "/job:localhost/replica:0/task:0/device:GPU:0",
  "this task's gpu": "/job:worker/replica:0/task:0/device:GPU:1",
  "gpu, job unnamed": "/device:GPU:0",
  "parameter server": "/job:ps/replica:0/task:0/device:CPU:0",
  "another worker": "/job:worker/replica:0/task:1/device:CPU:0",
  "the chief": "/job:chief/replica:0/task:0/device:CPU:0",
  "unplaced": "",
}


@pytest.mark.parametrize("where", sorted(HERE))
def test_this_process_cpu_is_here(where):
  assert in_this_process_cpu(HERE[where], HOST)


@pytest.mark.parametrize("where", sorted(ELSEWHERE))
def test_gpus_parameter_servers_and_other_tasks_are_not(where):
  assert not in_this_process_cpu(ELSEWHERE[where], HOST)


@needs_kernels
def test_tables_on_this_process_cpu_get_the_kernels():
  ops = select_ops(HERE.values(), host=HOST)
  assert isinstance(ops, KernelOps) and ops.kernels
  assert ops.module is kernels.load()


@pytest.mark.parametrize("where", sorted(ELSEWHERE))
def test_one_variable_elsewhere_gives_every_table_tensorflow_ops(where):
  devices = [*HERE.values(), ELSEWHERE[where]]
  assert select_ops(devices, host=HOST) is TENSORFLOW_OPS


def test_no_tables_get_tensorflow_ops():
  assert select_ops([]) is TENSORFLOW_OPS


def test_tensorflow_ops_when_the_kernels_cannot_load(monkeypatch):
  monkeypatch.setattr(ops_module, "load", lambda: None)
  assert select_ops([HERE["localhost cpu"]]) is TENSORFLOW_OPS


@pytest.mark.parametrize(
  "devices", [[], list(HERE.values())], ids=["none", "here"]
)
def test_xla_and_savedmodel_traces_get_their_ops_whatever_the_devices(
  devices, monkeypatch
):
  """XLA_OPS for XLA (static shapes, TensorFlow's ops), then TensorFlow's
  in a SavedModel (TF Serving loads no kernels), before the devices."""
  chosen = []

  @tf.function(jit_compile=True)
  def compiled():
    chosen.append(select_ops(devices, host=HOST))
    return tf.constant(0)

  compiled.get_concrete_function()
  assert chosen == [XLA_OPS]
  monkeypatch.setattr(compat, "in_save_context", lambda: True)
  assert select_ops(devices, host=HOST) is TENSORFLOW_OPS


def test_concurrent_below_one_is_refused():
  with pytest.raises(ValueError, match="concurrent must be >= 1, got 0"):
    select_ops([HERE["localhost cpu"]], concurrent=0)


# --- an engine ----------------------------------------------------------


class _Elsewhere:
  """A variable as the engine sees it: only its device."""

  def __init__(self, device: str):
    self.device = device


def _never(*args, **kwargs):
  raise AssertionError("the fused update was reached")


def _engine(optimizer) -> tpe.TPUEmbedding:
  emb = tpe.TPUEmbedding(
    tpe.FeatureConfig(tpe.TableConfig(30, 4, name="t")), optimizer
  )
  emb.build()
  return emb


def _train(emb):
  @tf.function
  def train(ids):
    emb.enqueue(ids, training=True)
    emb.apply_gradients(tf.nest.map_structure(tf.ones_like, emb.dequeue()))

  return train


IDS = tf.ragged.constant([[1, 2], [2]], tf.int64)


@needs_kernels
@pytest.mark.parametrize(
  "where", ["gpu", "parameter server", "another worker", "the chief"]
)
@pytest.mark.parametrize("optimizer", [tpe.SGD, tpe.Adagrad])
def test_an_engine_with_a_table_elsewhere_never_reaches_a_kernel(
  where, optimizer, monkeypatch
):
  monkeypatch.setattr(compat, "host_address_space", lambda: HOST)
  monkeypatch.setattr(ops_module, "fused_apply", _never)
  held = TableStore.held_variables
  monkeypatch.setattr(
    TableStore,
    "held_variables",
    lambda store: [*held(store), _Elsewhere(ELSEWHERE[where])],
  )
  emb = _engine(optimizer(0.1))
  assert emb.engine.step_ops is TENSORFLOW_OPS
  table = emb.variables["t"]["parameters"]
  before = table.numpy()
  train = _train(emb)
  train(IDS)  # The update runs: TensorFlow's path, never the kernel.
  changed = (table.numpy() != before).any(axis=1).nonzero()[0].tolist()
  assert changed == [1, 2]
  assert not {t for t in op_types(train, IDS) if t.startswith("Tpe")}


@needs_kernels
def test_an_engine_with_tables_here_reaches_the_fused_update(monkeypatch):
  """The control of the test above: the same engine, its tables on this
  process's CPU, does reach the (here refusing) fused update."""
  monkeypatch.setattr(ops_module, "fused_apply", _never)
  emb = _engine(tpe.Adagrad(0.1))
  assert isinstance(emb.engine.step_ops, KernelOps)
  with pytest.raises(AssertionError, match="the fused update was reached"):
    _train(emb)(IDS)


def test_lookups_for_serving_take_tensorflow_ops():
  emb = _engine(tpe.SGD(0.1))

  @tf.function
  def serve(ids):  # What a SavedModel for TF Serving holds.
    return emb.embedding_lookup(ids)

  assert not {t for t in op_types(serve, IDS) if t.startswith("Tpe")}


@needs_kernels
def test_a_step_on_kernels_marks_its_written_rows_by_the_kernel():
  """The changed-row flags (delta checkpoints) are set by ``TpeMarkRows``,
  not TensorFlow's scatter, and hold exactly the step's rows."""
  emb = _engine(tpe.Adagrad(0.1))
  train = _train(emb)
  types = op_types(train, IDS)
  assert "TpeMarkRows" in types
  assert "ResourceScatterUpdate" not in types
  store = emb.engine.table_stores["t"]
  store.clear_changes()
  train(IDS)
  assert store.changed_rows().numpy().tolist() == [1, 2]


def _dequeue(emb, ids):
  @tf.function
  def step(ids):
    emb.enqueue(ids, training=True)
    activations = emb.dequeue()
    emb.apply_gradients(tf.nest.map_structure(tf.zeros_like, activations))
    return activations

  return step, step(ids)


@needs_kernels
@pytest.mark.parametrize(
  "ids, straight",
  [
    (tf.constant([4, 1, 4, 29], tf.int64), True),  # one id per output row
    (tf.ragged.constant([[4, 1], [4], [29, 4, 4]], tf.int64), False),  # bags
  ],
  ids=["one_per_row", "bags"],
)
def test_rows_of_one_id_per_output_row_are_read_straight_from_the_table(
  ids, straight
):
  """On the kernels, an activation that is one id's row is gathered from
  the table in occurrence order (the distinct rows are not gathered and
  then copied again); bags sum the distinct rows in place. Either way the
  activations are the table's rows (summed per bag)."""
  emb = tpe.TPUEmbedding(
    tpe.FeatureConfig(
      tpe.TableConfig(
        30,
        4,
        name="t",
        combiner="sum",
        initializer=tf.random_uniform_initializer(seed=3),
      )
    ),
    tpe.SGD(0.1),
  )
  emb.build()
  table = emb.variables["t"]["parameters"].numpy()
  step, activations = _dequeue(emb, ids)
  if straight:
    expected = table[ids.numpy()]
  else:
    expected = np.stack([table[row].sum(axis=0) for row in ids.to_list()])
  np.testing.assert_array_equal(activations.numpy(), expected)
  types = op_types(step, ids)
  assert "TpeGatherPieces" not in types
  assert ("TpeSegmentSum" in types) is not straight
  assert "TpeGatherRows" in types
