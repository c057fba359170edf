"""Rows of a saved tensor read alone (``checkpointing/rows.py``).

Checkpoints written by TensorFlow's ``SaveV2`` (and merged by its
``MergeV2Checkpoints``, as ``tpu_embedding.checkpoints.write`` merges the
workers' parts): whole tensors, row slices, slices split along the columns;
every part ``SavedRows.read_rows`` yields must be the saved rows, and a
piece only partly wanted must be read by its rows' bytes alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tpu_embedding import checkpoints
from tpu_embedding.checkpointing.index import CheckpointIndex
from tpu_embedding.checkpointing.index import slice_key
from tpu_embedding.checkpointing.rows import SavedRows

ROWS, DIM = 50, 3
VALUE = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)

#: How ``VALUE`` is stored: each part a checkpoint of ``(start, rows)``
#: row slices (None: the whole tensor), merged into one checkpoint.
STORED = {
  "whole": [[None]],
  "one_part": [[(0, 20), (20, 30)]],
  "parts": [[(0, 7)], [(7, 13), (20, 25)], [(45, 5)]],
}


def _save(prefix: str, slices) -> None:
  specs, tensors = [], []
  for piece in slices:
    if piece is None:
      specs.append("")
      tensors.append(VALUE)
    else:
      start, rows = piece
      specs.append(f"{ROWS} {DIM} {start},{rows}:-")
      tensors.append(VALUE[start : start + rows])
  tf.raw_ops.SaveV2(
    prefix=prefix,
    tensor_names=["t"] * len(specs),
    shape_and_slices=specs,
    tensors=tensors,
  )


def _checkpoint(directory, layout: str) -> str:
  parts = [f"{directory}/part{i}" for i in range(len(STORED[layout]))]
  for prefix, slices in zip(parts, STORED[layout], strict=True):
    _save(prefix, slices)
  tf.raw_ops.MergeV2Checkpoints(
    checkpoint_prefixes=parts, destination_prefix=f"{directory}/ckpt"
  )
  return f"{directory}/ckpt"


def _read(prefix: str, start: int, count: int, **sizes) -> np.ndarray:
  parts = list(
    SavedRows(prefix).read_rows(
      "t", (ROWS, DIM), start, count, tf.float32, **sizes
    )
  )
  firsts = [first for first, _ in parts]
  sizes_read = [int(value.shape[0]) for _, value in parts]
  assert firsts == list(np.cumsum([start, *sizes_read[:-1]])), firsts
  return np.concatenate([value.numpy() for _, value in parts])


@pytest.mark.parametrize("layout", sorted(STORED))
def test_every_part_read_holds_the_saved_rows(layout, tmp_path):
  prefix = _checkpoint(tmp_path, layout)
  for start, count in [(0, ROWS), (0, 1), (3, 9), (7, 13), (19, 31), (49, 1)]:
    for whole_rows, range_rows in [(ROWS, ROWS), (8, 4), (1, 1), (30, 7)]:
      got = _read(
        prefix, start, count, whole_rows=whole_rows, range_rows=range_rows
      )
      np.testing.assert_array_equal(got, VALUE[start : start + count])


def test_a_part_of_a_large_piece_is_read_by_its_bytes_alone(
  tmp_path, monkeypatch
):
  """Rows 10-19 of a whole saved tensor: 10 rows of bytes are read, and
  RestoreV2 (which would read the whole tensor) is not called; a piece
  wholly within the rows and small enough is read by RestoreV2."""
  prefix = _checkpoint(tmp_path, "whole")
  read, restored = [], []
  gfile = tf.io.gfile.GFile

  restore_v2 = tf.raw_ops.RestoreV2

  class CountingFile(gfile):
    def read(self, n=-1):
      data = super().read(n)
      if ".data-" in self.name:  # (not the index)
        read.append(len(data))
      return data

  def restore(**kwargs):
    restored.append(kwargs["shape_and_slices"])
    return restore_v2(**kwargs)

  monkeypatch.setattr(tf.io.gfile, "GFile", CountingFile)
  monkeypatch.setattr(tf.raw_ops, "RestoreV2", restore)
  got = _read(prefix, 10, 10, whole_rows=ROWS - 1, range_rows=4)
  np.testing.assert_array_equal(got, VALUE[10:20])
  assert read == [4 * DIM * 4, 4 * DIM * 4, 2 * DIM * 4] and not restored
  got = _read(prefix, 0, ROWS, whole_rows=ROWS, range_rows=4)
  np.testing.assert_array_equal(got, VALUE)
  assert restored == [[""]]


def test_slices_split_along_columns_are_read_by_tensorflow(tmp_path):
  prefix = f"{tmp_path}/ckpt"
  tf.raw_ops.SaveV2(
    prefix=prefix,
    tensor_names=["t", "t"],
    shape_and_slices=[f"{ROWS} {DIM} -:0,1", f"{ROWS} {DIM} -:1,2"],
    tensors=[VALUE[:, :1], VALUE[:, 1:]],
  )
  got = _read(prefix, 5, 20, whole_rows=6, range_rows=3)
  np.testing.assert_array_equal(got, VALUE[5:25])


def test_slice_keys_are_tensorflows(tmp_path):
  """Huge offsets and full extents: the keys TensorFlow writes."""
  prefix = f"{tmp_path}/ckpt"
  shape = "8589934592 2"
  tf.raw_ops.SaveV2(
    prefix=prefix,
    tensor_names=["h", "h", "h"],
    shape_and_slices=[
      f"{shape} 0,1:-",
      f"{shape} 1048583,2:0,2",
      f"{shape} 8589934590,2:-",
    ],
    tensors=[tf.ones([1, 2]), tf.ones([2, 2]), tf.ones([2, 2])],
  )
  index = CheckpointIndex(prefix)
  entry = index.entry(b"h")
  assert entry is not None and len(entry.slices) == 3
  for stored in entry.slices:
    extents = [
      (e.start, e.length if e.HasField("length") else -1) for e in stored.extent
    ]
    found = index.entry(slice_key("h", extents))
    assert found is not None, extents
    assert found.size == extents[0][1] * 2 * 4


def test_a_truncated_data_file_is_an_error(tmp_path):
  prefix = _checkpoint(tmp_path, "whole")
  (data,) = tf.io.gfile.glob(f"{prefix}.data-*")
  with open(data, "r+b") as f:
    f.truncate(ROWS * DIM * 4 // 2)
  with pytest.raises(tf.errors.DataLossError, match="truncated"):
    _read(prefix, 40, 5, whole_rows=1, range_rows=5)


def test_restore_leaves_tables_the_checkpoint_lacks(tmp_path):
  """Row-sharded tables that a checkpoint lacks keep their values, as
  TensorFlow's restore leaves them; the others are restored."""
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

  def embedding(names, value):
    features = {
      name: tpe.FeatureConfig(
        tpe.TableConfig(
          10, 2, name=name, initializer=tf.constant_initializer(value)
        )
      )
      for name in names
    }
    return tpe.TPUEmbedding(features, tpe.SGD(0.1), row_sharding_threshold=0)

  with strategy.scope():
    saved = embedding(["a"], 1.0)
    saved.build()
    path = tf.train.Checkpoint(embedding=saved).write(f"{tmp_path}/ckpt")
    restored = embedding(["a", "b"], 2.0)
    restored.build()
    checkpoints.restore(tf.train.Checkpoint(embedding=restored), path)
  tables = restored.variables
  np.testing.assert_array_equal(tables["a"]["parameters"].numpy(), 1.0)
  np.testing.assert_array_equal(tables["b"]["parameters"].numpy(), 2.0)


@pytest.mark.parametrize("io_device", [None, "/job:localhost/device:CPU:1"])
def test_parts_are_read_where_the_restore_options_say(
  io_device, tmp_path, monkeypatch
):
  """Each part is read on its block's host (a parameter server reads its
  own rows), or on ``CheckpointOptions.experimental_io_device`` if set,
  and holds the saved rows either way."""
  strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  table = tpe.TableConfig(ROWS, DIM, name="t")
  with strategy.scope():
    saved = tpe.TPUEmbedding(
      {"f": tpe.FeatureConfig(table)}, tpe.SGD(0.1), row_sharding_threshold=0
    )
    saved.build()
    blocks = saved.variables["t"]["parameters"].variables
    for block, first in zip(blocks, [0, ROWS // 2], strict=True):
      block.assign(VALUE[first : first + block.shape[0]])
    path = tf.train.Checkpoint(embedding=saved).write(f"{tmp_path}/ckpt")
    restored = tpe.TPUEmbedding(
      {"f": tpe.FeatureConfig(table)}, tpe.SGD(0.1), row_sharding_threshold=0
    )
    restored.build()
  where = []
  restore_v2 = tf.raw_ops.RestoreV2

  def restore(**kwargs):
    where.append(tf.constant(0.0).device)  # (the device scope it runs in)
    return restore_v2(**kwargs)

  monkeypatch.setattr(tf.raw_ops, "RestoreV2", restore)
  options = tf.train.CheckpointOptions(experimental_io_device=io_device)
  checkpoints.restore(tf.train.Checkpoint(embedding=restored), path, options)
  blocks = restored.variables["t"]["parameters"].variables
  np.testing.assert_array_equal(
    np.concatenate([block.numpy() for block in blocks]), VALUE
  )
  host = "/job:localhost/replica:0/task:0/device:CPU:"
  assert set(where) == {host + ("1" if io_device else "0")}, where
