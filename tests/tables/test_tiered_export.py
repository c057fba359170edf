"""``export_for_serving`` of a disk-tiered table: streamed, same values.

The oracle is the in-memory layout: one embedding with table "big" on
disk (a 9 MiB table: two chunks of rows) and one with it in memory,
trained alike, each exported with a model reading "big", an in-memory
table "small" and a dense weight. The SavedModels hold the same keys
with the same values, bit for bit, for float32, bfloat16 and int8 (int8
quantized chunk by chunk equals the whole table quantized; float16 is
refused: TensorFlow restores no float16 tensor from slices), serve the
trained rows, load with TensorFlow's 1.x loader (the saver TF Serving
restores with) and ``saved_model_cli``, and hold no Python op (nothing of
the store). The export never changes which rows the training cache
holds.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

import tpu_embedding as tpe
from tests import processes
from tpu_embedding import export
from tpu_embedding.checkpointing.rows import read_tensors
from tpu_embedding.sharding import DiskTier
from tpu_embedding.sharding import PlacementPolicy

ROWS, DIM, BATCH, STEPS = 70_000, 32, 64, 4
TABLE_DTYPES = ("float32", "bfloat16", "int8")  # float16: refused
CACHE_ROWS = 512
SIGNATURE = {
  "big": export.FeatureSpec([None, None]),
  "small": export.FeatureSpec([None]),
}


def make_embedding(directory=None):
  big = tpe.TableConfig(
    ROWS,
    DIM,
    name="big",
    combiner="sum",
    initializer=tf.random_uniform_initializer(seed=3),
  )
  small = tpe.TableConfig(
    9, DIM, name="small", initializer=tf.random_uniform_initializer(seed=4)
  )
  policy = PlacementPolicy()
  if directory is not None:
    policy = PlacementPolicy(
      disk=DiskTier(str(directory), CACHE_ROWS * DIM * 4 * 2, ("big",))
    )
  emb = tpe.TPUEmbedding(
    {"big": tpe.FeatureConfig(big), "small": tpe.FeatureConfig(small)},
    tpe.Adagrad(0.3),
    row_sharding_threshold=policy,
  )
  emb.build(per_replica_batch_size=BATCH)
  return emb


def train(emb, seed):
  @tf.function
  def step(big, small):
    emb.enqueue({"big": big, "small": small})
    with tf.GradientTape() as tape:
      activations = emb.dequeue()
      tape.watch(activations)
      loss = tf.reduce_sum(activations["big"] ** 2) + tf.reduce_sum(
        activations["small"]
      )
    emb.apply_gradients(tape.gradient(loss, activations))

  rng = np.random.default_rng(seed)
  for _ in range(STEPS):  # spread over both chunks
    step(
      tf.RaggedTensor.from_tensor(rng.integers(0, ROWS, (BATCH, 2))),
      tf.constant(rng.integers(0, 9, BATCH), tf.int64),
    )


class Model(tf.Module):
  def __init__(self):
    super().__init__()
    self.weight = tf.Variable(tf.linspace(0.5, 1.5, DIM))

  def __call__(self, inputs):
    return {"score": (inputs["big"] + inputs["small"]) * self.weight}


def saved_values(path):
  prefix = os.path.join(path, "variables/variables")
  dtypes = tf.train.load_checkpoint(prefix).get_variable_to_dtype_map()
  keys = sorted(set(dtypes) - {"_CHECKPOINTABLE_OBJECT_GRAPH"})
  values = read_tensors(prefix, keys, [dtypes[key] for key in keys])
  return {key: value.numpy() for key, value in zip(keys, values, strict=True)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  base = tmp_path_factory.mktemp("tiered_export")
  disk, memory = make_embedding(base / "tier"), make_embedding()
  train(disk, 0)
  train(memory, 0)
  cache = disk.table_stores["big"].cache
  before = (cache.row_of_slot.copy(), cache.hits, cache.misses)
  model = Model()
  paths = {}
  for table_dtype in TABLE_DTYPES:
    for name, emb in (("disk", disk), ("memory", memory)):
      paths[name, table_dtype] = str(base / f"{name}_{table_dtype}")
      export.export_for_serving(
        paths[name, table_dtype],
        emb,
        model,
        SIGNATURE,
        table_dtype=table_dtype,
      )
  after = (cache.row_of_slot.copy(), cache.hits, cache.misses)
  return {
    "paths": paths,
    "memory": memory,
    "disk": disk,
    "model": model,
    "cache": (before, after),
  }


@pytest.mark.parametrize("table_dtype", TABLE_DTYPES)
def test_the_saved_model_holds_the_in_memory_exports_values(
  exported, table_dtype
):
  disk = saved_values(exported["paths"]["disk", table_dtype])
  memory = saved_values(exported["paths"]["memory", table_dtype])
  assert sorted(disk) == sorted(memory)
  for key, value in memory.items():
    assert disk[key].dtype == value.dtype, key
    np.testing.assert_array_equal(disk[key], value, err_msg=key)


def test_it_serves_the_trained_rows(exported):
  table = exported["memory"].table_stores["big"].read().numpy()
  small = exported["memory"].table_stores["small"].read().numpy()
  ids = np.array([[0, ROWS - 1], [65_535, 65_536], [7, -1]], np.int64)
  loaded = tf.saved_model.load(exported["paths"]["disk", "float32"])
  served = loaded.signatures["serving_default"](
    big=tf.constant(ids), small=tf.constant([1, 2, 3], tf.int64)
  )["score"].numpy()
  big = np.stack([table[[i for i in row if i >= 0]].sum(0) for row in ids])
  weight = exported["model"].weight.numpy()
  np.testing.assert_array_equal(served, (big + small[[1, 2, 3]]) * weight)


def test_tensorflow_1_loader_restores_it(exported):
  """TF Serving's path: the MetaGraph's saver restores the variables."""
  path = exported["paths"]["disk", "int8"]
  ids = np.arange(0, ROWS, 997)
  with tf.Graph().as_default(), tf.compat.v1.Session() as session:
    graph = tf.compat.v1.saved_model.load(session, ["serve"], path)
    signature = graph.signature_def["serving_default"]
    served = session.run(
      signature.outputs["score"].name,
      {
        signature.inputs["big"].name: ids[:, None],
        signature.inputs["small"].name: np.zeros_like(ids),
      },
    )
  loaded = tf.saved_model.load(path).signatures["serving_default"]
  expected = loaded(big=tf.constant(ids[:, None]), small=tf.zeros_like(ids))[
    "score"
  ]
  np.testing.assert_array_equal(served, expected.numpy())


def test_saved_model_cli_shows_it(exported):
  cli = [os.path.join(os.path.dirname(sys.executable), "saved_model_cli")]
  if not os.path.exists(cli[0]):  # a venv using the system's TensorFlow
    cli = [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]
  path = exported["paths"]["disk", "float32"]
  done = processes.run(
    [*cli, "show", "--all", "--dir", path],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert "outputs['score']" in done.stdout


def test_it_holds_no_python_op(exported):
  """Nothing of the tiered store (its cache runs Python functions)."""
  for table_dtype in ("float32", "int8"):
    path = exported["paths"]["disk", table_dtype]
    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
      proto.ParseFromString(f.read())
    graph = proto.meta_graphs[0].graph_def
    ops = {node.op for node in graph.node}
    for function in graph.library.function:
      ops |= {node.op for node in function.node_def}
    assert not ops & {"EagerPyFunc", "PyFunc", "PyFuncStateless"}, ops


def test_an_export_from_a_checkpoint_records_its_source(exported, tmp_path):
  emb, model = exported["disk"], exported["model"]
  checkpoint = tf.train.Checkpoint(embedding=emb, model=model)
  prefix = tpe.checkpoints.write(checkpoint, str(tmp_path / "ckpt"))
  path = str(tmp_path / "m")
  export.export_for_serving(
    path,
    emb,
    model,
    SIGNATURE,
    table_dtype="int8",
    source=export.ExportSource(prefix, checkpoint),
  )
  table = export.read_source(path)["tables"]["big"]
  assert table["shape"] == [ROWS, DIM]
  assert sorted(table["variables"]) == ["offset", "scale", "values"]
  np.testing.assert_array_equal(
    saved_values(path)[table["variables"]["values"]],
    saved_values(exported["paths"]["memory", "int8"])[
      table["variables"]["values"]
    ],
  )


def test_float16_is_refused_before_anything_is_written(exported, tmp_path):
  emb = exported["disk"]
  with pytest.raises(ValueError, match="export it as bfloat16, int8"):
    export.export_for_serving(
      str(tmp_path / "m"), emb, None, SIGNATURE, table_dtype="float16"
    )
  assert not (tmp_path / "m").exists()


def test_exports_leave_the_training_cache_alone(exported):
  (rows, hits, misses), (rows_after, hits_after, misses_after) = exported[
    "cache"
  ]
  np.testing.assert_array_equal(rows, rows_after)
  assert (hits, misses) == (hits_after, misses_after)


@pytest.mark.parametrize("table_dtype", ["float32", "int8"])
def test_a_serving_embedding_on_disk_exports_a_checkpoint_as_in_memory(
  exported, table_dtype, tmp_path
):
  """``TPUEmbeddingForServing(..., disk=DiskTier(...))`` (how a table
  larger than memory exports): the checkpoint restores into its files in
  chunks, the SavedModel holds the in-memory export's values and its
  lookups read the trained rows."""
  memory, model = exported["memory"], exported["model"]
  prefix = tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=memory, model=model), str(tmp_path / "ckpt")
  )
  served = tpe.TPUEmbeddingForServing(
    memory.feature_config,
    optimizer=None,
    disk=DiskTier(str(tmp_path / "serving"), CACHE_ROWS * DIM * 4, ("big",)),
  )
  restored = Model()
  export.restore_for_export(
    tf.train.Checkpoint(embedding=served, model=restored), prefix, served
  )
  assert served.table_stores["big"].cache_counts()  # on disk
  assert served.table_stores["small"].cache_counts() == []  # in memory
  assert os.listdir(tmp_path / "serving" / "big")
  ids = tf.constant([[0, ROWS - 1], [5, 70]], tf.int64)
  got = served({"big": ids, "small": tf.constant([1, 8], tf.int64)})
  want = memory({"big": ids, "small": tf.constant([1, 8], tf.int64)})
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  path = str(tmp_path / "m")
  export.export_for_serving(
    path, served, restored, SIGNATURE, table_dtype=table_dtype
  )
  disk_values = saved_values(path)
  memory_values = saved_values(exported["paths"]["memory", table_dtype])
  assert sorted(disk_values) == sorted(memory_values)
  for key, value in memory_values.items():
    np.testing.assert_array_equal(disk_values[key], value, err_msg=key)
