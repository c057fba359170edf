"""What tools/memory_report.py measures: one sharded table, trained and saved.

The workload of every measured job: a ``TPUEmbedding`` with one table
``big`` (``rows x dim``, every table row-sharded: ``row_sharding_threshold
=0``) and, when the export is measured, a small table ``side`` (the
exported subset); ``steps`` training steps of ``enqueue`` → ``dequeue`` →
``apply_gradients`` on the same global batches whatever the job's size
(stateless random ids, so a restored job replays the same steps, and a
1-worker job the same as a 2-worker job); a checkpoint of the
embedding's tables and slots (``save_checkpoint``/``restore_checkpoint``);
and *probes*: the activations of fixed rows, which every step trains, so a
restored job can prove it holds the saved values (parameters and slots:
the probe after one more step depends on the optimizer's slots).

``MirroredSteps`` runs the steps under ``MultiWorkerMirroredStrategy``
(``enqueue`` of a distributed dataset's per-replica batch, then
``strategy.run``);
``ParameterServerSteps`` under ``ParameterServerStrategy`` (whole steps
scheduled on the workers by a ``ClusterCoordinator``).

Example:
  >>> config = Workload(rows=100, dim=4, initializer="constant")
  >>> probe_ids(config.rows).tolist()
  [0, 6, 13, 19, 26, 33, 39, 46, 52, 59, 66, 72, 79, 85, 92, 99]
  >>> float(make_initializer(config)((1, 1), tf.float32)[0, 0])
  0.5
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import numpy as np
import tensorflow as tf
from memory_config import Workload

import tpu_embedding as tpe
from tpu_embedding.vocabularies.transition import VocabularyVariables

_OPTIMIZERS = {
  "sgd": lambda: tpe.SGD(0.1),
  "adagrad": lambda: tpe.Adagrad(0.1),
  "adam": lambda: tpe.Adam(0.01),
  "ftrl": lambda: tpe.FTRL(0.1),
}

_PROBES = 16


def make_initializer(workload: Workload) -> Any:
  """The table initializer named by ``workload.initializer``.

  ``default`` is None (``TableConfig``'s default, an unseeded truncated
  normal).
  """
  return {
    "default": None,
    "seeded": tf.random_uniform_initializer(-0.05, 0.05, seed=12),
    "unseeded": tf.random_uniform_initializer(-0.05, 0.05),
    "constant": tf.constant_initializer(0.5),
  }[workload.initializer]


def make_embedding(workload: Workload) -> tpe.TPUEmbedding:
  """The embedding of the workload (create it in the strategy's scope)."""
  features = {
    "big": tpe.FeatureConfig(
      tpe.TableConfig(
        workload.rows,
        workload.dim,
        name="big",
        initializer=make_initializer(workload),
        vocabulary=tpe.DynamicVocabulary() if workload.dynamic else None,
      )
    )
  }
  if workload.side_rows:
    side = tpe.TableConfig(workload.side_rows, workload.dim, name="side")
    features["side"] = tpe.FeatureConfig(side)
  return tpe.TPUEmbedding(
    features, _OPTIMIZERS[workload.optimizer](), row_sharding_threshold=0
  )


def create_embedding(
  strategy, workload: Workload, checkpoint: str = "", restore_first=False
) -> tpe.TPUEmbedding:
  """The workload's embedding, built, and restored from ``checkpoint``.

  Restored after ``build()`` (Model Garden's order), or before it with
  ``restore_first`` (the tables then take the checkpoint's values when
  created).
  """
  status = None
  with strategy.scope():
    embedding = make_embedding(workload)
    if checkpoint and restore_first:
      status = restore_checkpoint(embedding, checkpoint)
    embedding.build()
    if checkpoint and not restore_first:
      status = restore_checkpoint(embedding, checkpoint)
  if status is not None:
    # Not assert_existing_objects_matched(): Checkpoint.restore creates a
    # save_counter that a Checkpoint.write checkpoint lacks. The probes
    # prove every table and slot was restored.
    status.assert_nontrivial_match()
  return embedding


def probe_ids(rows: int) -> np.ndarray:
  """The rows every step trains and the probes read: spread over shards."""
  return np.unique(np.linspace(0, rows - 1, _PROBES).astype(np.int64))


def _features(workload: Workload, ids: tf.Tensor) -> dict[str, tf.Tensor]:
  """``ids`` of ``big``, and the same ids modulo its size for ``side``."""
  features = {"big": ids}
  if workload.side_rows:
    features["side"] = ids % workload.side_rows
  return features


def _parts_per_replica(workload: Workload, replicas: int) -> int:
  if workload.parts % replicas:
    raise ValueError(
      f"{replicas} replicas cannot split a global batch of "
      f"{workload.parts} parts evenly."
    )
  return workload.parts // replicas


def step_features(
  workload: Workload, step: Any, replica: Any, replicas: int
) -> dict[str, tf.Tensor]:
  """One replica's ids of one step, of a global batch fixed by the workload.

  A step's global batch is ``workload.parts`` parts of ``workload.batch``
  ids (the probe rows, then random rows seeded by the step and the part),
  whatever the job's replica count: replica ``r`` of ``replicas`` takes
  ``parts // replicas`` consecutive parts. So a job of any size trains the
  same steps.
  """
  count = _parts_per_replica(workload, replicas)
  probes = tf.constant(probe_ids(workload.rows))
  blocks = []
  for index in range(count):
    part = tf.cast(replica, tf.int64) * count + index
    blocks.append(probes)
    blocks.append(
      tf.random.stateless_uniform(
        [workload.batch - probes.shape[0]],
        seed=tf.stack([tf.cast(step, tf.int64), part]),
        maxval=workload.rows,
        dtype=tf.int64,
      )
    )
  return _features(workload, tf.concat(blocks, axis=0))


def probe_features(workload: Workload, replicas: int) -> dict[str, tf.Tensor]:
  """A replica's batch of the probe rows' ids (first), padded with row 0."""
  probes = probe_ids(workload.rows)
  padded = np.zeros(
    [workload.batch * _parts_per_replica(workload, replicas)], np.int64
  )
  padded[: len(probes)] = probes
  return _features(workload, tf.constant(padded))


def _probed(activations: tf.Tensor) -> tf.Tensor:
  """The probe rows' activations of a ``probe_features`` lookup."""
  return activations[:_PROBES]


def _train_on_dequeued(embedding: tpe.TPUEmbedding) -> None:
  """Dequeue, a linear loss, apply_gradients (inside the replica)."""
  with tf.GradientTape() as tape:
    activations = embedding.dequeue()
    tape.watch(activations)
    loss = tf.add_n([tf.reduce_sum(a) for a in tf.nest.flatten(activations)])
  embedding.apply_gradients(tape.gradient(loss, activations))


class MirroredSteps:
  """Training steps and probes under ``MultiWorkerMirroredStrategy``.

  Inputs come from ``distribute_datasets_from_function``: one input
  pipeline per worker, each worker one replica (its CPU). (Values from
  ``experimental_distribute_values_from_function`` would do for 2 workers,
  but ``enqueue`` refuses them on a 1-replica strategy.)
  """

  def __init__(self, strategy, embedding, workload: Workload):
    self._strategy = strategy
    self._workload = workload
    replicas = strategy.num_replicas_in_sync

    @tf.function
    def train(features):
      embedding.enqueue(features, training=True)
      strategy.run(lambda: _train_on_dequeued(embedding))

    @tf.function
    def probe(features):
      embedding.enqueue(features, training=False)
      return strategy.run(lambda: _probed(embedding.dequeue()["big"]))

    self._train, self._probe = train, probe
    self._replicas = replicas

  def _inputs(self, dataset_for_replica):
    def dataset_fn(context):
      replica = context.input_pipeline_id  # one replica per worker
      return dataset_for_replica(replica)

    return self._strategy.distribute_datasets_from_function(dataset_fn)

  def train(self, first: int, steps: int) -> None:
    """Runs steps ``first, ..., first + steps - 1``."""
    workload, replicas = self._workload, self._replicas
    for features in self._inputs(
      lambda replica: tf.data.Dataset.range(first, first + steps).map(
        lambda step: step_features(workload, step, replica, replicas)
      )
    ):
      self._train(features)

  def probe(self) -> np.ndarray:
    """The probe rows of ``big`` (as this worker's replica sees them)."""
    features = next(
      iter(
        self._inputs(
          lambda replica: tf.data.Dataset.from_tensors(
            probe_features(self._workload, self._replicas)
          )
        )
      )
    )
    local = self._strategy.experimental_local_results(self._probe(features))
    return np.asarray(local[0])


class ParameterServerSteps:
  """Training steps and probes scheduled by a ``ClusterCoordinator``.

  Every step is the whole global batch, on one worker.
  """

  def __init__(self, strategy, coordinator, embedding, workload: Workload):
    self._coordinator = coordinator

    def replica_train(step):
      embedding.enqueue(step_features(workload, step, 0, 1), training=True)
      _train_on_dequeued(embedding)

    @tf.function
    def train(step):
      strategy.run(replica_train, args=(step,))

    def replica_probe():
      embedding.enqueue(probe_features(workload, 1), training=False)
      return _probed(embedding.dequeue()["big"])

    @tf.function
    def probe():
      return strategy.run(replica_probe)

    self._train, self._probe = train, probe

  def train(self, first: int, steps: int) -> None:
    """Schedules steps ``first, ...`` (all at once), then joins."""
    for step in range(first, first + steps):
      self._coordinator.schedule(
        self._train, args=(tf.constant(step, tf.int64),)
      )
    self._coordinator.join()

  def probe(self) -> np.ndarray:
    """The probe rows of ``big``."""
    return np.asarray(self._coordinator.schedule(self._probe).fetch())


def _checkpoints_api(function: str) -> Any:
  """``tpu_embedding.checkpoints.<function>`` if the package has it."""
  try:
    from tpu_embedding import checkpoints  # type: ignore[attr-defined]
  except ImportError:
    return None
  found = getattr(checkpoints, function, None)
  return found if callable(found) else None


def _sliced_write() -> Any:
  """``tpu_embedding.checkpoints.save`` (or ``.write``), if it exists."""
  return _checkpoints_api("save") or _checkpoints_api("write")


def checkpoint_method() -> str:
  """How ``save_checkpoint`` and ``restore_checkpoint`` work here."""
  write = _sliced_write()
  save = (
    f"tpu_embedding.checkpoints.{write.__name__} (every worker)"
    if write
    else "tf.train.Checkpoint.write (chief: the prefix, others: a "
    "temporary directory)"
  )
  restore = (
    "tpu_embedding.checkpoints.restore"
    if _checkpoints_api("restore")
    else "tf.train.Checkpoint.read"
  )
  return f"save: {save}; restore: {restore}"


def save_checkpoint(strategy, embedding, prefix: str) -> str:
  """Saves the embedding's tables and slots under ``prefix``.

  Every worker of a multi-worker job calls it at the same time (the save
  reads sharded tables collectively); under ``ParameterServerStrategy``
  the coordinator alone. If the installed package has
  ``tpu_embedding.checkpoints.save`` (or ``.write``), every worker calls it
  as ``save(tf.train.Checkpoint(embedding=embedding), prefix)``, with the
  same prefix. Otherwise TensorFlow's multi-worker convention: every
  worker writes the whole ``tf.train.Checkpoint``, the chief to ``prefix``
  and the others to a temporary directory, deleted at once.

  Returns:
    The path of the checkpoint (``prefix``).
  """
  checkpoint = tf.train.Checkpoint(embedding=embedding)
  write = _sliced_write()
  if write is not None:
    write(checkpoint, prefix)
    return prefix
  if strategy.extended.should_checkpoint:
    return checkpoint.write(prefix)
  scratch = tempfile.mkdtemp(prefix="memory_report_worker_")
  try:
    checkpoint.write(os.path.join(scratch, os.path.basename(prefix)))
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  return prefix


def restore_checkpoint(embedding, prefix: str) -> Any:
  """Restores the embedding's tables and slots saved under ``prefix``.

  Every worker calls it (after ``embedding.build()``, or before it with
  ``--restore_order restore_first``). Uses
  ``tpu_embedding.checkpoints.restore(tf.train.Checkpoint(embedding=...),
  prefix)`` if the installed package has it, else
  ``tf.train.Checkpoint(embedding=embedding).read(prefix)``; either way
  ``create_embedding`` checks the status matched something; the probes
  check the values.

  Returns:
    The restore status.
  """
  checkpoint = tf.train.Checkpoint(embedding=embedding)
  restore = _checkpoints_api("restore")
  if restore is not None:
    return restore(checkpoint, prefix)
  return checkpoint.read(prefix)


def full_state_bytes(plan, vocabularies: dict) -> int:
  """Bytes of every table and slot, whole (the one-replica plan's bytes),
  and of the dynamic tables' vocabularies, whole."""
  total = 0
  for placement in plan.placements.values():
    per_replica = placement.bytes_per_replica()
    total += sum(per_replica) if placement.sharded else per_replica[0]
  for state in vocabularies.values():
    total += VocabularyVariables.bytes_of(state.vocabulary, state.capacity)
  return total


def vocabulary_bytes(vocabularies: dict) -> int:
  """Bytes of the vocabulary variables this process holds."""
  return sum(
    variable.shape.num_elements() * 8
    for state in vocabularies.values()
    for copy in state.copies
    for variable in copy.variables.values()
  )
