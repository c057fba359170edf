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

import tensorflow as tf
from absl import logging

from model_garden.ranking.configs import definitions


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
  resolver = getattr(strategy, "cluster_resolver", None)
  if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
    kind, index = resolver.task_type, resolver.task_id
    return kind in (None, "chief") or (kind == "worker" and index == 0)
  return True


def run_server_if_not_coordinator() -> bool:
  """For ``parameter_server`` jobs: serve (forever) unless the chief.

  Returns:
    False for the coordinator (which trains); never returns for workers
    and parameter servers, which run their server until killed.
  """
  kind, index = task_type()
  if kind in ("worker", "ps"):
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(
      resolver.cluster_spec(),
      job_name=kind,
      task_index=index,
      protocol=resolver.rpc_layer or "grpc",
      start=True,
    )
    logging.info("Serving as %s %d.", kind, index)
    server.join()
  return False


def create_strategy(
  name: str,
  *,
  num_replicas: int = 0,
  tpu: str = "",
  cluster: tf.train.ClusterSpec | None = None,
) -> tf.distribute.Strategy:
  """The strategy called ``name`` (see the module docstring).

  Args:
    name: one of ``definitions.STRATEGIES``.
    num_replicas: ``mirrored`` without GPUs: logical CPU devices to
      mirror over (``use_logical_cpus`` must have made them); 0: all.
    tpu: the TPU address for ``tpu``.
    cluster: ``parameter_server``: the cluster (default ``TF_CONFIG``).

  Raises:
    ValueError: for an unknown name.
  """
  if name not in definitions.STRATEGIES:
    raise ValueError(
      f"Unknown strategy {name!r}; use one of {definitions.STRATEGIES}."
    )
  if name == "default":
    return tf.distribute.get_strategy()
  if name == "multi_worker_mirrored":
    # First, before anything starts TensorFlow's context (listing logical
    # devices would): it configures the collectives.
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
