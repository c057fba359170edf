"""A task of a parameter-server cluster, serving the tables it holds.

Under ``tf.distribute.ParameterServerStrategy`` the coordinator builds
every table's variables on the parameter-server tasks, and its restores
send rows there. Nothing of this package runs in those processes unless
they start with it: ``serve`` sets the process up for large table buffers
(``allocator.return_large_buffers``: freed buffers leave the process
instead of staying resident in glibc's heap) and then runs the task's
``tf.distribute.Server``, as TensorFlow's own launch of a task does.

Example:
  Each parameter-server and worker task's script (``TF_CONFIG`` names
  the cluster and the task)::

      import tpu_embedding as tpe
      tpe.servers.serve()

  >>> from tpu_embedding import servers
  >>> servers.SERVING_TASKS
  ('ps', 'worker')
"""

from __future__ import annotations

import tensorflow as tf

from tpu_embedding import allocator

#: The task types that serve (the chief coordinates; it trains).
SERVING_TASKS = ("ps", "worker")


def serve(
  cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver
  | None = None,
  *,
  join: bool = True,
) -> tf.distribute.Server:
  """Starts this process's ``ps`` or ``worker`` task, set up for tables.

  Args:
    cluster_resolver: the cluster and this task (default: ``TF_CONFIG``,
      ``TFConfigClusterResolver``).
    join: serve until the process is killed (the usual); False returns
      the started server.

  Returns:
    The server (with ``join=False``; otherwise it never returns).

  Raises:
    ValueError: the resolver names no task of this process, or a task
      that does not serve (the chief: it coordinates the training).
  """
  resolver = (
    cluster_resolver or tf.distribute.cluster_resolver.TFConfigClusterResolver()
  )
  kind = resolver.task_type
  if kind not in SERVING_TASKS:
    raise ValueError(
      f"servers.serve: this process's task is {kind!r}, expected one of "
      f"{list(SERVING_TASKS)} (set TF_CONFIG's task, or pass "
      "cluster_resolver=; the chief coordinates and does not serve)."
    )
  allocator.return_large_buffers()  # (before the first table buffer)
  server = tf.distribute.Server(
    resolver.cluster_spec(),
    job_name=kind,
    task_index=resolver.task_id,
    protocol=getattr(resolver, "rpc_layer", None) or "grpc",
    start=True,
  )
  if join:
    server.join()
  return server
