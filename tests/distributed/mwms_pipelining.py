"""Pipelining on one worker of a 2-process MultiWorkerMirroredStrategy run.

Launched twice by tests/backends/test_multi_worker.py with ``TF_CONFIG`` set:
``python mwms_pipelining.py``. The table of tests/step/test_pipelining.py
(row-sharded over the two workers' replicas) trains pipelined on its
global batches, replica ``r`` taking examples ``[r * per, (r + 1) * per)``;
``flush_pipeline`` runs after step ``FLUSH_AFTER`` and after the last
step. Every worker asserts, against that file's one-step-stale schedule
computed on one device (``reference``): its activations at every step,
the whole table before the last flush (the last update still held) and
every variable after it; and that the traced step and flush touch the
table by row only (``row-only step:`` lines). Prints "OK" last on success.

In tests/backends/test_multi_worker.py its ``main`` runs as a phase of
``mwms_phases.py`` (several scripts per cluster launch).
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
from mwms_training import check_row_only  # noqa: E402 (this directory)
from mwms_training import training_step  # noqa: E402

from tests.step import test_pipelining as schedule  # noqa: E402

FLUSH_AFTER = 1
#: A row's gradient sums its occurrences across workers in another order
#: than on one device: the last bit may differ (an update applied twice or
#: lost moves values by ~0.1).
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}


def main(strategy=None) -> None:
  strategy = strategy or tf.distribute.MultiWorkerMirroredStrategy()
  replicas = strategy.num_replicas_in_sync
  assert replicas == 2, replicas
  per = schedule.BATCH // replicas
  rng = np.random.default_rng(1234)  # The same data on every worker.
  init = rng.normal(size=(schedule.V, schedule.DIM)).astype(np.float32)
  data = schedule.batches(rng)
  projection = tf.constant(
    rng.normal(size=(schedule.BATCH, schedule.DIM)), tf.float32
  )
  want_activations, want_before_flush, want_vars = schedule.reference(
    init, data, projection, flush_after=FLUSH_AFTER
  )

  emb = schedule.make_embedding(True, init, strategy)
  assert emb.sharding_plan.placements["t"].sharded

  step = training_step(strategy, emb, schedule.loss_fn, projection, per)

  flush = tf.function(lambda: strategy.run(emb.flush_pipeline))
  replica = strategy.cluster_resolver.task_id  # One replica per worker.
  rows = slice(replica * per, (replica + 1) * per)
  for n, (features, want) in enumerate(
    zip(data, want_activations, strict=True)
  ):
    got = step(features)
    for key in want:
      (local,) = strategy.experimental_local_results(got[key])
      np.testing.assert_allclose(
        local, want[key][rows], **TOLERANCE, err_msg=f"step {n} {key}"
      )
    if n == FLUSH_AFTER:
      flush()
  check_row_only("mwms/pipelined", step, emb)
  table = emb.variables["t"]
  np.testing.assert_allclose(
    tf.convert_to_tensor(table["parameters"]).numpy(),
    want_before_flush,
    **TOLERANCE,
    err_msg="before the last flush",
  )
  flush()
  check_row_only("mwms/flush_pipeline", flush, emb, every_table=False)
  for slot, variable in table.items():
    np.testing.assert_allclose(
      tf.convert_to_tensor(variable).numpy(),
      want_vars[slot].numpy(),
      **TOLERANCE,
      err_msg=slot,
    )
  print("OK")


if __name__ == "__main__":
  main()
