"""MultiWorkerMirroredStrategy: two real worker processes on 127.0.0.1.

Each process runs tests/distributed/mwms_training.py with its ``TF_CONFIG``;
the table is sharded across the two workers' replicas. See that script for
what each worker asserts.
"""

from __future__ import annotations

import pathlib

from tests.distributed import cluster

SCRIPT = pathlib.Path(__file__).parent / "distributed" / "mwms_training.py"


def test_two_workers_train_sharded_tables_like_one_device(tmp_path):
  for worker in cluster.run_workers([SCRIPT, tmp_path]):
    worker.check()
