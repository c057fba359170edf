"""The ``tf.distribute`` strategy a ranking run trains under.

``create_strategy(name, num_replicas=..., tpu=...)`` for the ``--strategy``
names:

==========================  ================================================
``default``                 no strategy: one device, whole tables
``one_device``              ``OneDeviceStrategy`` on the first GPU or CPU
``mirrored``                ``MirroredStrategy``: the GPUs, or
                            ``num_replicas`` logical CPU devices; big tables
                            row-sharded across the replicas
``multi_worker_mirrored``   ``MultiWorkerMirroredStrategy`` (``TF_CONFIG``)
``parameter_server``        ``ParameterServerStrategy`` (``TF_CONFIG``, or
                            an in-process cluster, ``local_cluster``)
``tpu``                     ``TPUStrategy`` (TensorFlow's TPU embedding)
==========================  ================================================

``use_logical_cpus(n)`` splits the CPU into ``n`` logical devices; it must
run before TensorFlow initializes its devices (before any op).

A ``multi_worker_mirrored`` task first waits for the other tasks of
``TF_CONFIG``'s cluster to start (``wait_for_cluster``): after
``WAIT_NOTE_AFTER`` seconds it says so, naming the tasks whose address
does not answer yet, again every ``WAIT_NOTE_EVERY`` seconds, and gives up
after ``cluster_timeout`` seconds (``--cluster_timeout``, default
``DEFAULT_CLUSTER_TIMEOUT``; ``ClusterTimeoutError``, one line, exit 1).

Example:
  >>> from model_garden.ranking import strategies
  >>> strategy = strategies.create_strategy("default")
  >>> strategy.num_replicas_in_sync
  1
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any
from typing import TextIO

import tensorflow as tf
from absl import logging

from model_garden.ranking.configs import definitions
from tpu_embedding import run_lock
from tpu_embedding import servers


def use_logical_cpus(num_devices: int) -> None:
  """Splits the (first) physical CPU into ``num_devices`` logical devices.

  Raises:
    RuntimeError: if TensorFlow has already initialized its devices with
      another configuration (call this first, before any op).
  """
  cpus = tf.config.list_physical_devices("CPU")
  current = tf.config.get_logical_device_configuration(cpus[0])
  if current is not None and len(current) == num_devices:
    return
  try:
    tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * num_devices
    )
  except RuntimeError as e:
    raise RuntimeError(
      f"Cannot split the CPU into {num_devices} logical devices: TensorFlow "
      "is already initialized. Call use_logical_cpus before any op runs."
    ) from e


#: Seconds a ``multi_worker_mirrored`` task waits for its cluster before
#: giving up (``--cluster_timeout``; 0: forever).
DEFAULT_CLUSTER_TIMEOUT = 600.0
#: Seconds of waiting before the first note, then between notes.
WAIT_NOTE_AFTER = 3.0
WAIT_NOTE_EVERY = 30.0


def _answers(address: str) -> bool:
  """Whether ``host:port`` accepts a TCP connection (a started server)."""
  host, _, port = address.rpartition(":")
  try:
    with socket.create_connection((host.strip("[]"), int(port)), timeout=1):
      return True
  except (OSError, ValueError):
    return False


def peer_tasks(tf_config: dict[str, Any]) -> list[tuple[str, str]]:
  """``(task, address)`` of the other tasks of ``TF_CONFIG``'s cluster
  (``"worker 1"``, ``"127.0.0.1:2223"``), evaluators aside.

  Example:
    >>> from model_garden.ranking import strategies
    >>> strategies.peer_tasks({"cluster": {"worker": ["a:1", "b:2"]},
    ...                        "task": {"type": "worker", "index": 0}})
    [('worker 1', 'b:2')]
  """
  task = tf_config.get("task") or {}
  me = (task.get("type"), int(task.get("index", 0)))
  return [
    (f"{job} {index}", address)
    for job, addresses in sorted((tf_config.get("cluster") or {}).items())
    if job != "evaluator"
    for index, address in enumerate(addresses)
    if (job, index) != me
  ]


class ClusterTimeoutError(RuntimeError):
  """The other tasks of the cluster did not all start in time."""


def own_address(tf_config: dict[str, Any]) -> str | None:
  """This task's ``host:port`` in ``TF_CONFIG``'s cluster (or None)."""
  task = tf_config.get("task") or {}
  addresses = (tf_config.get("cluster") or {}).get(task.get("type"), [])
  index = int(task.get("index", 0))
  return addresses[index] if 0 <= index < len(addresses) else None


def _listen(address: str | None) -> socket.socket | None:
  """A plain listener on this task's port while it waits, so that its
  peers see it started (None if the port cannot be taken)."""
  if not address:
    return None
  try:
    return socket.create_server(("", int(address.rpartition(":")[2])))
  except (OSError, ValueError):
    return None


def wait_for_cluster(
  peers: list[tuple[str, str]],
  timeout: float | None,
  *,
  address: str | None = None,
  note_after: float = WAIT_NOTE_AFTER,
  note_every: float = WAIT_NOTE_EVERY,
  poll: float = 0.5,
  stream: TextIO | None = None,
) -> None:
  """Returns once every peer's address answers; says what it waits for.

  ``MultiWorkerMirroredStrategy()`` waits inside TensorFlow, holding
  Python's lock, until every task of the cluster has joined: nothing can
  be said from there. So a task first waits here, its own ``address``'s
  port held by a plain listener (its peers see it started; released
  before TensorFlow's server takes it), until every peer answers (its
  listener, or its TensorFlow server). After ``note_after`` seconds it
  writes one line naming the peers not answering yet, at their addresses,
  and again every ``note_every`` seconds.

  Args:
    peers: ``(task, address)`` of the other tasks (``peer_tasks``).
    timeout: seconds before giving up (None or 0: never).
    address: this task's ``host:port``, held while waiting.
    note_after: seconds before the first note.
    note_every: seconds between notes.
    poll: seconds between tries.
    stream: where notes go (default stdout).

  Raises:
    ClusterTimeoutError: after ``timeout`` seconds, naming the peers not
      answering and the flag (one line).
  """
  if not peers:
    return
  listener = _listen(address)
  try:
    start = time.monotonic()
    next_note = note_after
    while True:
      missing = [(t, a) for t, a in peers if not _answers(a)]
      if not missing:
        return
      waited = time.monotonic() - start
      named = ", ".join(f"{task} at {where}" for task, where in missing)
      if timeout and waited >= timeout:
        raise ClusterTimeoutError(
          f"multi_worker_mirrored: {named} did not start within "
          f"{timeout:.0f}s (--cluster_timeout): start every task of "
          "TF_CONFIG's cluster (or check its addresses), or raise "
          "--cluster_timeout."
        )
      if waited >= next_note:
        limit = (
          f"giving up after {timeout:.0f}s (--cluster_timeout)"
          if timeout
          else "no timeout (--cluster_timeout=0)"
        )
        out = stream or sys.stdout
        out.write(
          f"multi_worker_mirrored: waiting for TF_CONFIG's cluster "
          f"({waited:.0f}s): for {named} (not answering yet); {limit}.\n"
        )
        out.flush()
        next_note = waited + note_every
      time.sleep(poll)
  finally:
    if listener is not None:
      listener.close()


def free_port() -> int:
  """A free TCP port on 127.0.0.1."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def local_cluster(num_workers: int, num_ps: int) -> tf.train.ClusterSpec:
  """Starts a parameter-server cluster of in-process servers on 127.0.0.1.

  For trying ``parameter_server`` on one machine: ``num_workers`` workers
  and ``num_ps`` parameter servers, each a ``tf.distribute.Server`` on a
  free loopback port, in this process.

  Each worker gets at least ``num_workers + 1`` inter-op threads: in-process
  workers with fewer (the default is one per core) hang as soon as steps run
  on several workers at once (as TensorFlow's own in-process test clusters
  do, b/172296720).
  """
  spec = tf.train.ClusterSpec(
    {
      "worker": [f"127.0.0.1:{free_port()}" for _ in range(num_workers)],
      "ps": [f"127.0.0.1:{free_port()}" for _ in range(num_ps)],
    }
  )
  worker_config = tf.compat.v1.ConfigProto(
    inter_op_parallelism_threads=max(num_workers + 1, os.cpu_count() or 1)
  )
  for job, count in (("worker", num_workers), ("ps", num_ps)):
    for index in range(count):
      tf.distribute.Server(
        spec,
        job_name=job,
        task_index=index,
        protocol="grpc",
        config=worker_config if job == "worker" else None,
        start=True,
      )
  return spec


def task_type() -> tuple[str | None, int]:
  """This process's ``(task type, index)`` from ``TF_CONFIG`` (or None)."""
  config = json.loads(os.environ.get("TF_CONFIG", "{}") or "{}")
  task = config.get("task", {})
  return task.get("type"), int(task.get("index", 0))


def is_chief(strategy: tf.distribute.Strategy) -> bool:
  """Whether this process writes checkpoints, summaries and exports."""
  if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    # (its cluster is TF_CONFIG's: the chief task, or worker 0 without one)
    return run_lock.is_chief_task()
  return True


def run_server_if_not_coordinator() -> bool:
  """For ``parameter_server`` jobs: serve (forever) unless the chief.

  Returns:
    False for the coordinator (which trains); never returns for workers
    and parameter servers, which run their server until killed.
  """
  kind, index = task_type()
  if kind in ("worker", "ps"):
    logging.info("Serving as %s %d.", kind, index)
    servers.serve()  # (set up for the rows the coordinator builds here)
  return False


def create_strategy(
  name: str,
  *,
  num_replicas: int = 0,
  tpu: str = "",
  cluster: tf.train.ClusterSpec | None = None,
  cluster_timeout: float | None = DEFAULT_CLUSTER_TIMEOUT,
) -> tf.distribute.Strategy:
  """The strategy called ``name`` (see the module docstring).

  Args:
    name: one of ``definitions.STRATEGIES``.
    num_replicas: ``mirrored`` without GPUs: logical CPU devices to
      mirror over (``use_logical_cpus`` must have made them); 0: all.
    tpu: the TPU address for ``tpu``.
    cluster: ``parameter_server``: the cluster (default ``TF_CONFIG``).
    cluster_timeout: ``multi_worker_mirrored``: seconds to wait for the
      other tasks of ``TF_CONFIG`` (``wait_for_cluster``; None or 0:
      forever).

  Raises:
    ValueError: for an unknown name.
    ClusterTimeoutError: ``multi_worker_mirrored``'s peers did not start.
  """
  if name not in definitions.STRATEGIES:
    raise ValueError(
      f"Unknown strategy {name!r}; use one of {definitions.STRATEGIES}."
    )
  if name == "default":
    return tf.distribute.get_strategy()
  if name == "multi_worker_mirrored":
    # First, before anything starts TensorFlow's context (listing logical
    # devices would): it configures the collectives. It returns once every
    # task of the cluster has joined.
    tf_config = json.loads(os.environ.get("TF_CONFIG", "{}") or "{}")
    wait_for_cluster(
      peer_tasks(tf_config), cluster_timeout, address=own_address(tf_config)
    )
    return tf.distribute.MultiWorkerMirroredStrategy()
  gpus = tf.config.list_logical_devices("GPU")
  if name == "one_device":
    return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")
  if name == "mirrored":
    if gpus:
      return tf.distribute.MirroredStrategy()
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    if num_replicas:
      if num_replicas > len(cpus):
        raise ValueError(
          f"--num_replicas={num_replicas} but there are {len(cpus)} logical "
          "CPU devices."
        )
      cpus = cpus[:num_replicas]
    return tf.distribute.MirroredStrategy(cpus)
  if name == "parameter_server":
    resolver = (
      tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, rpc_layer="grpc"
      )
      if cluster is not None
      else tf.distribute.cluster_resolver.TFConfigClusterResolver()
    )
    return tf.distribute.experimental.ParameterServerStrategy(resolver)
  resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
  tf.config.experimental_connect_to_cluster(resolver)
  tf.tpu.experimental.initialize_tpu_system(resolver)
  return tf.distribute.TPUStrategy(resolver)
