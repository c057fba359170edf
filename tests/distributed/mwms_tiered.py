"""A disk-tiered table on one worker of a 2-process MultiWorkerMirroredStrategy.

Launched twice by tests/tables/test_tiered_sharded.py with ``TF_CONFIG``
set: ``python mwms_tiered.py DIR``. The embedding of that test file
(table "big" on disk, row-sharded over the two workers' replicas, each
worker's block in its own directory ``DIR/worker<i>``) trains on the same
global batches as the in-memory layout; every worker asserts tables and
slots equal bit for bit, that ``tpe.checkpoints.write`` of the disk table
restores into the in-memory layout, and that a one-device checkpoint
(``DIR/one``, its values in ``DIR/one.npz``, written by the test) restores
into the disk table: 1 -> 2 workers. Prints "OK" last on success.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# ``tests`` from this checkout, without putting the checkout on sys.path
# (as the root conftest.py does): ``tpu_embedding`` is the installed one.
_tests = importlib.machinery.ModuleSpec("tests", None, is_package=True)
_tests.submodule_search_locations = [str(pathlib.Path(__file__).parents[1])]
sys.modules["tests"] = importlib.util.module_from_spec(_tests)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_embedding as tpe  # noqa: E402
from tests.tables import test_tiered_sharded as tiered  # noqa: E402


def main() -> None:
  directory = pathlib.Path(sys.argv[1])
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  assert strategy.num_replicas_in_sync == tiered.REPLICAS
  task = strategy.cluster_resolver.task_id
  data = tiered.batches("ragged", np.random.default_rng(3))
  want = tiered.make_embedding(tpe.Adagrad(0.3), strategy)
  tiered.train(want, data, strategy)
  got = tiered.make_embedding(
    tpe.Adagrad(0.3), strategy, directory / f"worker{task}"
  )
  tiered.train(got, data, strategy)
  store = got.table_stores["big"]
  assert store.layout == "tiered_row_sharded"
  blocks = sorted(directory.glob(f"worker{task}/big/block*"))
  assert [path.name for path in blocks] == [f"block{task}"], blocks
  assert store.tier(0).cache.writes > 0
  saved = tiered.values(want)
  tiered.assert_same(tiered.values(got), saved)
  # The disk table's checkpoint, streamed by every worker, into memory.
  prefix = str(directory / "tiered")
  tpe.checkpoints.write(
    tf.train.Checkpoint(embedding=got), prefix, chunk_bytes=3 * tiered.DIM * 4
  )
  memory = tiered.make_embedding(tpe.Adagrad(0.3), strategy)
  tpe.checkpoints.restore(tf.train.Checkpoint(embedding=memory), prefix)
  tiered.assert_same(tiered.values(memory), saved)
  # One device's checkpoint into the disk table of 2 workers.
  again = tiered.make_embedding(
    tpe.Adagrad(0.3), strategy, directory / f"again{task}"
  )
  tpe.checkpoints.restore(
    tf.train.Checkpoint(embedding=again), str(directory / "one")
  )
  with np.load(directory / "one.npz") as one:
    want_one = {tuple(key.split(":")): one[key] for key in one.files}
  tiered.assert_same(tiered.values(again), want_one)
  print("OK")


if __name__ == "__main__":
  main()
