"""Delta checkpoints: a full save plus its deltas is the full save.

Each case trains, saves a full checkpoint, trains, saves a delta, trains,
saves another delta; a fresh object (same layout, or one device) restores
the full checkpoint and the deltas in order. The oracle is a full save of
the live object at that step: every tensor of a full save of the restored
object equals it bit for bit (tables, slots, dense weights, dynamic
vocabularies' state). Refusals: a delta on another run's base, a skipped
delta; a delta write that fails on the filesystem (``RLIMIT_FSIZE``: the
file-size limit) leaves the previous saves restorable.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

import numpy as np
import pytest
import tensorflow as tf

import tpu_embedding as tpe
from tests import processes
from tests.conftest import mirrored_strategy
from tpu_embedding.checkpointing import deltas as checkpoint_deltas
from tpu_embedding.gradients import RowGradients

BATCH = 8
DIM = 4
#: Rows of the tables; each step looks up a few of them.
ROWS = {"big": 64, "small": 8}
#: A checkpoint's own counter (a restore creates it): not training state.
SAVE_COUNTER = "save_counter/.ATTRIBUTES/VARIABLE_VALUE"

OPTIMIZERS = {
  "adagrad": lambda: tpe.Adagrad(0.1, initial_accumulator_value=0.2),
  "adam": lambda: tpe.Adam(0.05),
  # Changes every row at every step (zero gradients move rows with momenta).
  "dense_adam": lambda: tpe.Adam(0.05, lazy_adam=False),
}


def _strategy(replicas: int) -> tf.distribute.Strategy:
  if replicas == 1:
    return tf.distribute.get_strategy()
  return mirrored_strategy(replicas)


def _embedding(layout: str, optimizer: str, replicas: int, seed: int = 0):
  """``(embedding, dense variable, strategy)`` of a layout, built."""
  strategy = _strategy(replicas)
  init = tf.random_uniform_initializer(-1.0, 1.0, seed=seed)
  kwargs = {}
  if layout == "dynamic":
    tables = {
      "big": tpe.TableConfig(
        ROWS["big"],
        DIM,
        name="big",
        initializer=tf.constant_initializer(0.5),
        vocabulary=tpe.DynamicVocabulary(bucket_size=4),
      )
    }
  else:
    tables = {
      name: tpe.TableConfig(rows, DIM, name=name, initializer=init)
      for name, rows in ROWS.items()
    }
  if layout == "stacked":
    kwargs["table_stacking"] = [["big", "small"]]
  if layout == "mirrored":
    kwargs["row_sharding_threshold"] = 20  # big: row-sharded; small: copies
  features = {name: tpe.FeatureConfig(table) for name, table in tables.items()}
  with strategy.scope():
    emb = tpe.TPUEmbedding(features, OPTIMIZERS[optimizer](), **kwargs)
    emb.build()
    dense = tf.Variable(tf.zeros([3]), name="dense")
  return emb, dense, strategy


def _batches(layout: str, steps: int, seed: int) -> list[dict[str, tf.Tensor]]:
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(steps):
    if layout == "dynamic":  # keys far from the rows' ids
      batches.append(
        {"big": tf.constant(rng.integers(1000, 1020, BATCH), tf.int64)}
      )
    else:
      batches.append(
        {n: tf.constant(rng.integers(0, r, BATCH)) for n, r in ROWS.items()}
      )
  return batches


def _trainer(emb, dense, strategy):
  replicas = strategy.num_replicas_in_sync

  def replica_step():
    with tf.GradientTape() as tape:
      acts = emb.dequeue()
      tape.watch(acts)
      loss = tf.add_n([tf.reduce_sum(a * a + a) for a in tf.nest.flatten(acts)])
    emb.apply_gradients(tape.gradient(loss, acts))

  @tf.function
  def step(features):
    if replicas > 1:
      features = strategy.experimental_distribute_values_from_function(
        lambda ctx: {
          k: v[ctx.replica_id_in_sync_group :: replicas]
          for k, v in features.items()
        }
      )
      emb.enqueue(features, training=True)
      strategy.run(replica_step)
    else:
      emb.enqueue(features, training=True)
      replica_step()
    dense.assign_add(tf.constant([1.0, 0.5, 0.25]))

  return step


def _full_values(checkpoint, path) -> dict[str, np.ndarray]:
  """Every tensor of a full save of ``checkpoint`` (the oracle): by
  TensorFlow's own ``write``, which leaves the chain of saves alone."""
  checkpoint.write(path)
  reader = tf.train.load_checkpoint(path)
  return {
    key: reader.get_tensor(key)
    for key in reader.get_variable_to_shape_map()
    if key not in ("_CHECKPOINTABLE_OBJECT_GRAPH", SAVE_COUNTER)
  }


def _assert_same(got, want):
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)


def _chain(tmp_path, layout, optimizer, replicas):
  """Trains and saves full, delta, delta; returns the paths and the live
  state's full save."""
  emb, dense, strategy = _embedding(layout, optimizer, replicas)
  checkpoint = tf.train.Checkpoint(embedding=emb, dense=dense)
  step = _trainer(emb, dense, strategy)
  batches = iter(_batches(layout, 6, seed=1))
  step(next(batches))
  full = tpe.checkpoints.write(checkpoint, str(tmp_path / "ckpt-1"))
  deltas = []
  for number in (2, 3):
    step(next(batches))
    step(next(batches))
    deltas.append(
      tpe.checkpoints.write_delta(checkpoint, str(tmp_path / f"delta-{number}"))
    )
  want = _full_values(checkpoint, str(tmp_path / "oracle"))
  return full, deltas, want, (emb, dense, checkpoint)


CASES = [
  ("one_device", "adagrad", 1, 1),
  ("one_device", "adam", 1, 1),
  ("mirrored", "adagrad", 2, 2),
  ("mirrored", "adam", 2, 1),
  ("stacked", "adam", 1, 1),
  ("dynamic", "adagrad", 2, 2),
]


@pytest.mark.parametrize(
  "layout,optimizer,replicas,restore_replicas",
  CASES,
  ids=[f"{c[0]}-{c[1]}-{c[2]}to{c[3]}" for c in CASES],
)
def test_full_plus_deltas_restores_the_live_state_bit_for_bit(
  tmp_path, layout, optimizer, replicas, restore_replicas
):
  full, deltas, want, _ = _chain(tmp_path, layout, optimizer, replicas)
  # A delta holds only the rows written since the save before it.
  meta = checkpoint_deltas.read_meta(deltas[0])
  assert 0 < meta["rows"] < ROWS["big"]
  fresh, dense, _ = _embedding(layout, optimizer, restore_replicas, seed=7)
  checkpoint = tf.train.Checkpoint(embedding=fresh, dense=dense)
  tpe.checkpoints.restore(checkpoint, full, deltas=deltas)
  got = _full_values(checkpoint, str(tmp_path / "restored"))
  _assert_same(got, want)


@pytest.mark.parametrize(
  "layout,replicas", [("one_device", 1), ("mirrored", 2)]
)
def test_deltas_of_an_optimizer_updating_every_row_restore_every_row(
  tmp_path, layout, replicas
):
  """``Adam(lazy_adam=False)`` moves rows nobody looked up (their momenta
  decay): each delta holds every row, and full + deltas is the live state,
  every row and slot (the oracle: a full save of the live object)."""
  full, deltas, want, _ = _chain(tmp_path, layout, "dense_adam", replicas)
  for delta in deltas:
    assert checkpoint_deltas.read_meta(delta)["rows"] == ROWS["big"]
    ids, _ = checkpoint_deltas.read_rows(
      delta, "embedding/big/.ATTRIBUTES/VARIABLE_VALUE"
    )
    np.testing.assert_array_equal(np.sort(ids), np.arange(ROWS["big"]))
  # Rows the steps after the full save did not look up moved too (the
  # first step gave them momenta): the looked-up rows alone would restore
  # them wrong.
  key = "embedding/big/.ATTRIBUTES/VARIABLE_VALUE"
  base = tf.train.load_checkpoint(full).get_tensor(key)
  moved = np.flatnonzero((base != want[key]).any(axis=1))
  looked_up = np.concatenate(
    [b["big"].numpy() for b in _batches(layout, 6, seed=1)[1:5]]
  )
  assert np.setdiff1d(moved, looked_up).size
  fresh, dense, _ = _embedding(layout, "dense_adam", replicas, seed=7)
  checkpoint = tf.train.Checkpoint(embedding=fresh, dense=dense)
  tpe.checkpoints.restore(checkpoint, full, deltas=deltas)
  _assert_same(_full_values(checkpoint, str(tmp_path / "restored")), want)


def test_a_delta_holds_the_touched_rows_only(tmp_path):
  emb, dense, _ = _embedding("one_device", "adagrad", 1)
  checkpoint = tf.train.Checkpoint(embedding=emb, dense=dense)
  full = tpe.checkpoints.write(checkpoint, str(tmp_path / "ckpt-1"))
  store = emb.table_stores["big"]
  store.update(
    tf.constant([5, 40, 63], tf.int64), RowGradients.dense(tf.ones([3, DIM]))
  )
  delta = tpe.checkpoints.write_delta(checkpoint, str(tmp_path / "delta-2"))
  rows = checkpoint_deltas.read_rows(
    delta, "embedding/big/.ATTRIBUTES/VARIABLE_VALUE"
  )
  assert rows is not None
  np.testing.assert_array_equal(rows[0], [5, 40, 63])
  np.testing.assert_array_equal(rows[1], store.read().numpy()[[5, 40, 63]])
  small = checkpoint_deltas.read_rows(
    delta, "embedding/small/.ATTRIBUTES/VARIABLE_VALUE"
  )
  assert small is not None and small[0].size == 0
  meta = checkpoint_deltas.read_meta(delta)
  assert meta["parent_name"] == "ckpt-1"
  # Nothing written since: the next delta is empty.
  again = tpe.checkpoints.write_delta(checkpoint, str(tmp_path / "delta-3"))
  assert checkpoint_deltas.read_meta(again)["rows"] == 0
  assert full


def test_a_delta_of_exactly_one_row_restores_it(tmp_path):
  """One row of one table (and its slot) written since the full save:
  the restore rewrites that row, and leaves the rest as saved."""
  emb, dense, _ = _embedding("one_device", "adagrad", 1)
  checkpoint = tf.train.Checkpoint(embedding=emb, dense=dense)
  full = tpe.checkpoints.write(checkpoint, str(tmp_path / "ckpt-1"))
  emb.table_stores["small"].update(
    tf.constant([6], tf.int64), RowGradients.dense(tf.ones([1, DIM]))
  )
  delta = tpe.checkpoints.write_delta(checkpoint, str(tmp_path / "delta-2"))
  assert checkpoint_deltas.read_meta(delta)["rows"] == 1
  want = _full_values(checkpoint, str(tmp_path / "oracle"))
  fresh, dense2, _ = _embedding("one_device", "adagrad", 1, seed=9)
  restored = tf.train.Checkpoint(embedding=fresh, dense=dense2)
  tpe.checkpoints.restore(restored, full, deltas=[delta])
  _assert_same(_full_values(restored, str(tmp_path / "got")), want)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("chain")
  full, deltas, want, live = _chain(tmp_path, "one_device", "adagrad", 1)
  return tmp_path, full, deltas, want, live


def _fresh():
  emb, dense, _ = _embedding("one_device", "adagrad", 1, seed=3)
  return emb, tf.train.Checkpoint(embedding=emb, dense=dense)


def test_a_skipped_delta_is_refused_and_nothing_restored(chain):
  _, full, deltas, _, _ = chain
  emb, checkpoint = _fresh()
  before = emb.table_stores["big"].read().numpy()
  with pytest.raises(checkpoint_deltas.DeltaMismatchError) as error:
    tpe.checkpoints.restore(checkpoint, full, deltas=[deltas[1]])
  message = str(error.value)
  assert "\n" not in message
  assert "delta-3" in message and "delta-2" in message
  assert "ckpt-1" in message
  np.testing.assert_array_equal(emb.table_stores["big"].read().numpy(), before)


def test_a_delta_on_another_runs_base_is_refused(chain, tmp_path):
  _, _, deltas, _, _ = chain
  other, dense, strategy = _embedding("one_device", "adagrad", 1, seed=5)
  checkpoint = tf.train.Checkpoint(embedding=other, dense=dense)
  _trainer(other, dense, strategy)(_batches("one_device", 1, seed=9)[0])
  base = tpe.checkpoints.write(checkpoint, str(tmp_path / "ckpt-1"))
  with pytest.raises(
    checkpoint_deltas.DeltaMismatchError, match="follows save 'ckpt-1'"
  ):
    tpe.checkpoints.restore(checkpoint, base, deltas=deltas)


def test_a_full_checkpoint_is_not_a_delta(chain):
  _, full, _, _, _ = chain
  _, checkpoint = _fresh()
  with pytest.raises(ValueError, match="is not a delta checkpoint"):
    tpe.checkpoints.restore(checkpoint, full, deltas=[full])


def test_a_delta_needs_a_previous_save(tmp_path):
  emb, dense, _ = _embedding("one_device", "adagrad", 1, seed=4)
  checkpoint = tf.train.Checkpoint(embedding=emb, dense=dense)
  with pytest.raises(ValueError, match="write a full checkpoint first"):
    tpe.checkpoints.write_delta(checkpoint, str(tmp_path / "delta-1"))


def _write_with_file_limit(checkpoint, path, limit):
  """``write_delta`` with files limited to ``limit`` bytes (a full disk:
  the write fails with EFBIG)."""
  old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  old = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
  try:
    return tpe.checkpoints.write_delta(checkpoint, path)
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, old)
    signal.signal(signal.SIGXFSZ, old_handler)


def test_a_failed_delta_write_leaves_the_previous_saves_restorable(tmp_path):
  emb, dense, strategy = _embedding("one_device", "adagrad", 1)
  checkpoint = tf.train.Checkpoint(embedding=emb, dense=dense)
  step = _trainer(emb, dense, strategy)
  batches = iter(_batches("one_device", 4, seed=2))
  step(next(batches))
  full = tpe.checkpoints.write(checkpoint, str(tmp_path / "ckpt-1"))
  step(next(batches))
  delta = tpe.checkpoints.write_delta(checkpoint, str(tmp_path / "delta-2"))
  want_2 = _full_values(checkpoint, str(tmp_path / "oracle-2"))
  step(next(batches))
  failed = str(tmp_path / "delta-3")
  with pytest.raises(tf.errors.OpError):
    _write_with_file_limit(checkpoint, failed, 256)
  assert not os.path.exists(failed + ".index")
  emb2, checkpoint2 = _fresh()
  tpe.checkpoints.restore(checkpoint2, full, deltas=[delta])
  _assert_same(_full_values(checkpoint2, str(tmp_path / "got-2")), want_2)
  # The rows of the failed delta are still marked: the next one has them.
  again = tpe.checkpoints.write_delta(checkpoint, failed)
  assert not os.path.exists(failed + "_temp")
  want_3 = _full_values(checkpoint, str(tmp_path / "oracle-3"))
  tpe.checkpoints.restore(checkpoint2, full, deltas=[delta, again])
  _assert_same(_full_values(checkpoint2, str(tmp_path / "got-3")), want_3)
  assert emb2 is not None


def test_the_manager_keeps_a_full_save_every_k_deltas(tmp_path):
  emb, dense, strategy = _embedding("one_device", "adam", 1)
  checkpoint = tf.train.Checkpoint(embedding=emb, dense=dense)
  manager = tpe.checkpoints.CheckpointManager(
    checkpoint, str(tmp_path), max_to_keep=2, delta_interval=2
  )
  step = _trainer(emb, dense, strategy)
  names = []
  for batch in _batches("one_device", 5, seed=4):
    step(batch)
    names.append(os.path.basename(manager.save()))
  assert names == ["ckpt-1", "delta-2", "delta-3", "ckpt-4", "delta-5"]
  assert not tf.io.gfile.glob(str(tmp_path / "delta-2.*"))  # old chain
  with open(tmp_path / "deltas.json") as f:
    assert json.load(f) == {"base": "ckpt-4", "deltas": ["delta-5"]}
  want = _full_values(checkpoint, str(tmp_path / "oracle"))
  fresh, dense2, _ = _embedding("one_device", "adam", 1, seed=8)
  restored = tf.train.Checkpoint(embedding=fresh, dense=dense2)
  again = tpe.checkpoints.CheckpointManager(
    restored, str(tmp_path), max_to_keep=2, delta_interval=2
  )
  assert again.restore_or_initialize().endswith("delta-5")
  _assert_same(_full_values(restored, str(tmp_path / "got")), want)
  with pytest.raises(ValueError, match="delta_interval must be an int >= 0"):
    tpe.checkpoints.CheckpointManager(
      checkpoint, str(tmp_path), 2, delta_interval=-1
    )


def test_delta_benchmark_tool_reports_small_ratios(tmp_path):
  out = processes.run(
    [
      sys.executable,
      os.path.join(
        os.path.dirname(__file__), "..", "..", "tools", "delta_benchmark.py"
      ),
      "--rows=50000",
      "--dim=32",
      "--touched=0.01",
      f"--dir={tmp_path}",
      "--json",
    ],
    capture_output=True,
    text=True,
    check=False,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
  )
  assert out.returncode == 0, out.stderr[-2000:]
  report = json.loads(out.stdout)
  assert report["size_ratio"] <= 0.03
  assert report["bit_identical"] is True
  assert report["full_bytes"] > 20 * report["delta_bytes"]
