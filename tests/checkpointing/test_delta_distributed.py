"""Delta checkpoints across processes: 2 workers, and parameter servers.

One launch per cluster does every phase (tests/distributed/mwms_delta.py,
tests/distributed/ps_delta.py): a full save, two deltas, and a full save at
the last delta's step (``final``: the oracle, the live state), then a
restore of the full save plus the deltas on the same cluster, written back
as ``restored``. Here: ``restored``, and a restore of the chain on one
device (this process, default strategy), equal ``final`` tensor by tensor
(tables, slots, dense weights, the dynamic vocabulary's state), bit for
bit; each delta holds exactly the rows the steps since the save before
touched, each worker's part only rows of its own blocks, with their values
at the delta's step. On 2 workers, worker 1 is killed (SIGKILL) in the
middle of a third delta's write: no part of it is visible, and the chain
before it restores.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests.distributed import cluster
from tests.distributed import mwms_delta
from tests.distributed import ps_delta
from tpu_embedding.checkpointing import deltas as checkpoint_deltas

HERE = pathlib.Path(__file__).parents[1] / "distributed"
#: Not training state: TensorFlow's object graph, a checkpoint's counter.
NOT_STATE = (
  "_CHECKPOINTABLE_OBJECT_GRAPH",
  "save_counter/.ATTRIBUTES/VARIABLE_VALUE",
)


def tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
  """Every tensor of the checkpoint ``path`` but ``NOT_STATE``."""
  reader = tf.train.load_checkpoint(str(path))
  return {
    key: reader.get_tensor(key)
    for key in reader.get_variable_to_shape_map()
    if key not in NOT_STATE
  }


def assert_same(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    assert np.array_equal(got[key], value), key


def value_key(table: str, slot: str = "parameters") -> str:
  name = table if slot == "parameters" else f"{table}.S{slot}"
  return f"embedding/{name}/.ATTRIBUTES/VARIABLE_VALUE"


def worker_rows(delta: pathlib.Path) -> dict[tuple[int, str], np.ndarray]:
  """``{(worker, table): ids}`` of every part of ``delta``; the slot's
  ids asserted equal to the parameters'."""
  reader = tf.train.load_checkpoint(str(delta))
  rows = {}
  for name in reader.get_variable_to_shape_map():
    if name.startswith("_DELTA/") and "/rows/" in name:
      _, worker, _, key = name.split("/", 3)
      table = key.split("/")[1].split(".S")[0]
      ids = reader.get_tensor(name)
      if (int(worker), table) in rows:
        np.testing.assert_array_equal(ids, rows[int(worker), table])
      rows[int(worker), table] = ids
  return rows


def restore_on_one_device(directory: pathlib.Path, module, out) -> dict:
  """The chain restored into a one-device object, as a full save."""
  emb = module.make_embedding(init=False)
  emb.build()
  checkpoint = tf.train.Checkpoint(
    embedding=emb, dense=tf.Variable(tf.zeros([2]), name="dense")
  )
  tpe.checkpoints.restore(
    checkpoint,
    str(directory / "ckpt-1"),
    deltas=[str(directory / "delta-2"), str(directory / "delta-3")],
  )
  checkpoint.write(str(out))
  return tensors(out)


# MultiWorkerMirroredStrategy: 2 worker processes.


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
  """``(directory, [chief, worker 1])`` of the job (see the script)."""
  directory = tmp_path_factory.mktemp("mwms")
  finished = cluster.run_job([HERE / "mwms_delta.py", directory])
  for worker in finished:
    assert "phases done" in worker.stdout, worker.stdout + worker.stderr
  return directory, finished


def test_two_workers_restore_full_plus_deltas_bit_identical(workers):
  """Restored on the 2 workers: the live object's tables, slots and
  vocabulary state and statistics (gathered there), and written back, the
  final full save."""
  directory, _ = workers
  assert_same(
    dict(np.load(directory / "restored.npz")),
    dict(np.load(directory / "live.npz")),
  )
  final = tensors(directory / "final")
  assert "embedding/users.Svocabulary/.ATTRIBUTES/keys" in final
  assert_same(tensors(directory / "restored"), final)


def test_one_device_restores_two_workers_deltas_bit_identical(
  workers, tmp_path
):
  """After the kill of the fourth save: ``ckpt-1`` + deltas 2 and 3."""
  directory, _ = workers
  got = restore_on_one_device(directory, mwms_delta, tmp_path / "one")
  assert_same(got, tensors(directory / "final"))


def touched(steps: range, table: str, replicas: int = 2) -> np.ndarray:
  """Sorted ids of ``table`` that ``steps`` looked up (static tables)."""
  ids = [
    mwms_delta.batch(step, replica)[table]
    for step in steps
    for replica in range(replicas)
  ]
  return np.unique(np.concatenate(ids))


def test_each_worker_writes_its_own_rows(workers):
  """Each part holds rows of its worker's blocks only; together the rows
  the steps since the save before touched; the replicated table's copy
  is the chief's alone."""
  directory, _ = workers
  with open(directory / "placements.json") as f:
    placements = json.load(f)
  final = tensors(directory / "final")
  for delta, steps in (("delta-2", range(1, 3)), ("delta-3", range(3, 5))):
    rows = worker_rows(directory / delta)
    assert sorted(rows) == [
      (0, "a"),
      (0, "small"),
      (0, "users"),
      (1, "a"),
      (1, "users"),
    ]
    for table in ("a", "users"):
      placement = placements[table]
      for worker in (0, 1):
        ids = rows[worker, table]
        first = placement["offsets"][worker]
        assert ids.size, (delta, worker, table)
        assert first <= ids.min(), (delta, worker, table, ids)
        assert ids.max() < first + placement["sizes"][worker]
    np.testing.assert_array_equal(
      np.concatenate([rows[0, "a"], rows[1, "a"]]), touched(steps, "a")
    )
    np.testing.assert_array_equal(rows[0, "small"], touched(steps, "small"))
  # The last delta's values: the rows of the full save at its step.
  for table in ("a", "users", "small"):
    for slot in ("parameters", "accumulators"):
      key = value_key(table, slot)
      got = checkpoint_deltas.read_rows(str(directory / "delta-3"), key)
      assert got is not None
      np.testing.assert_array_equal(got[1], final[key][got[0]], key)


def test_a_worker_killed_writing_a_delta_leaves_the_chain_as_it_was(
  workers,
):
  """Worker 1 dies right after writing its part of ``delta-4``; the chief
  waits for it and is killed. Nothing of ``delta-4`` is committed (its
  parts stay under ``delta-4_temp``, which the next save removes); the
  chain before it checks and restores (previous test)."""
  directory, (chief, worker) = workers
  assert worker.returncode == -9, worker
  assert "killing this process" in worker.stdout
  assert chief.returncode != 0 and "killing" not in chief.stdout
  assert (directory / "delta-4_temp" / "part-00001.index").exists()
  assert not list(directory.glob("delta-4.*"))
  with pytest.raises(ValueError, match="no committed save there"):
    checkpoint_deltas.read_meta(str(directory / "delta-4"))
  metas = checkpoint_deltas.check_chain(
    str(directory / "ckpt-1"),
    [str(directory / "delta-2"), str(directory / "delta-3")],
  )
  assert [m["parent_name"] for m in metas] == ["ckpt-1", "delta-2"]


# ParameterServerStrategy: 2 workers and 2 PS tasks in one process.


@pytest.fixture(scope="module")
def parameter_servers(tmp_path_factory):
  directory = tmp_path_factory.mktemp("ps")
  cluster.run_script([HERE / "ps_delta.py", directory]).check()
  return directory


def test_parameter_servers_restore_full_plus_deltas_bit_identical(
  parameter_servers, tmp_path
):
  """Restored on the PS tasks (asserted there, written back) and on one
  device: the final full save. Each delta holds the rows touched since
  the save before (the coordinator writes them all: one part)."""
  directory = parameter_servers
  final = tensors(directory / "final")
  assert_same(tensors(directory / "restored"), final)
  got = restore_on_one_device(directory, ps_delta, tmp_path / "one")
  assert_same(got, final)
  for delta, steps in (("delta-2", range(1, 3)), ("delta-3", range(3, 5))):
    rows = worker_rows(directory / delta)
    assert sorted(rows) == [(0, "big"), (0, "small")]
    for table in ("big", "small"):
      ids = [ps_delta.batch(step)[table] for step in steps]
      np.testing.assert_array_equal(
        rows[0, table], np.unique(np.concatenate(ids))
      )
  for table in ("big", "small"):
    key = value_key(table, "accumulators")
    ids, values = checkpoint_deltas.read_rows(str(directory / "delta-3"), key)
    np.testing.assert_array_equal(values, final[key][ids])
