"""``servers.serve``: a task of a parameter-server cluster, set up for
the tables the coordinator builds there (the real multi-process job:
``tests/distributed/ps_worker_kill.py``, whose tasks it starts)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tensorflow as tf

from tests.distributed.ps_training import free_port
from tpu_embedding import servers

#: A ps task started with ``join=False``, in a fresh process: what it set.
_TASK = """
import json, sys
import tensorflow as tf
from tpu_embedding import allocator, servers
spec = tf.train.ClusterSpec(json.loads(sys.argv[1]))
server = servers.serve(
  tf.distribute.cluster_resolver.SimpleClusterResolver(
    spec, task_type="ps", task_id=0
  ),
  join=False,
)
applied = allocator.applied()
print(json.dumps({"target": server.target, "large_buffers": applied}))
"""


def _spec() -> dict[str, list[str]]:
  return {
    "ps": [f"127.0.0.1:{free_port()}"],
    "chief": [f"127.0.0.1:{free_port()}"],
  }


def test_a_ps_task_serves_with_large_buffers_returned(tmp_path):
  spec = _spec()
  done = subprocess.run(
    [sys.executable, "-c", _TASK, json.dumps(spec)],
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
    cwd=tmp_path,  # (the installed package)
  )
  assert done.returncode == 0, done.stderr[-2000:]
  task = json.loads(done.stdout.strip().splitlines()[-1])
  assert task == {"target": f"grpc://{spec['ps'][0]}", "large_buffers": True}


@pytest.mark.parametrize("kind", ["chief", None])
def test_a_task_that_does_not_serve_is_refused_in_one_line(kind, monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  resolver = None  # (None: TF_CONFIG, here unset)
  if kind is not None:
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(_spec()), task_type=kind, task_id=0
    )
  with pytest.raises(ValueError) as raised:
    servers.serve(resolver)
  message = str(raised.value)
  assert "\n" not in message
  assert f"task is {kind!r}" in message and "['ps', 'worker']" in message
